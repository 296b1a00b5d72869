"""NIC collector: Ethernet and InfiniBand counters and link state from sysfs.

Reads under ``root`` (default ``/sys``; tests and the simulated source point it at a tree of the
same layout):

- ``class/net/<if>/statistics/*`` (counters), ``operstate`` (``link_up`` = 1 when "up"),
  ``flags`` (``admin_up`` = its IFF_UP bit: 0 for an interface the operator left down),
  ``carrier`` (unreadable while the interface is down: 0) and ``carrier_changes``. One
  ``Source.NIC`` sample per interface, tags ``device`` = the interface, ``kind`` = "net".
- ``class/infiniband/<hca>/ports/<n>/`` ``state`` ("4: ACTIVE" -> ``state`` 4, ``link_up`` = 1 when
  ACTIVE), ``phys_state`` ("5: LinkUp" -> 5), ``rate`` ("400 Gb/sec (4X NDR)" -> ``rate_gbps`` 400),
  ``counters/*`` and ``hw_counters/*``. One sample per port, index = port number, tags
  ``device`` = the HCA, ``port``, ``kind`` = "ib". The port data counters
  (``port_xmit_data``/``port_rcv_data``) count 4-octet lane units: they are reported as
  ``port_xmit_bytes``/``port_rcv_bytes``, multiplied by 4.

Every counter ``c`` gives ``c`` (the raw total) and, from the second collect on, ``c_per_s``.
A counter that went down is a wrap when the previous value was within the top quarter of a 32-
or 64-bit range (the delta is taken across the wrap), otherwise a reset (the counter restarted:
the delta is the new value). Files that read "N/A" or do not parse as numbers are skipped.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from transom import contracts
from transom.log import get

__all__ = ["NICCollector", "NICSettings", "counter_delta"]

log = get("agent.nic")

_DATA_LANES = {"port_xmit_data": "port_xmit_bytes", "port_rcv_data": "port_rcv_bytes"}
_WRAPS = (2**32, 2**64)


@dataclass
class NICSettings:
    """``[collectors.nic]``"""

    #: sysfs mount point (a test or the simulated source points it elsewhere)
    root: str = "/sys"
    #: sysfs (the real tree under root) or simulated (a fake node's tree, with NIC faults; explicit only)
    source: str = "sysfs"
    #: interfaces to read (empty: all but the excluded)
    include: list[str] = field(default_factory=list)
    #: interfaces never read
    exclude: list[str] = field(default_factory=lambda: ["lo"])
    #: also read virtual interfaces (veth pairs, bridges, tunnels, ifb: sysfs places them under
    #: devices/virtual); off by default: containers, pods and test beds add and remove them all the
    #: time, and a link that vanishes is not a fault of the node. One named in ``include`` is read.
    virtual: bool = False
    #: read InfiniBand ports under class/infiniband
    infiniband: bool = True
    #: also report the raw counter totals, not only the rates
    totals: bool = True


def counter_delta(old: int, new: int) -> tuple[int, str]:
    """``(delta, how)`` between two reads of a monotonic counter; ``how`` is ok, wrap or reset."""
    if new >= old:
        return new - old, "ok"
    for span in _WRAPS:
        if span * 3 // 4 <= old < span:
            return new + span - old, "wrap"
    return new, "reset"


def _read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # ENOENT when it vanished
        return None
    try:
        return os.read(fd, 256).decode("ascii", "replace").strip()
    except OSError:  # EINVAL for carrier of a down interface
        return None
    finally:
        os.close(fd)


class _Files:
    """Reads sysfs attributes; under the real ``/sys`` it keeps each file open and re-reads it with
    ``pread`` at offset 0 (the kernel renders an attribute afresh on every read from 0), which
    saves an open and a close per file per collect. Other roots (tests, the simulated tree, where
    a file may be replaced) are opened each time. Files not read in a collect are closed."""

    def __init__(self, keep_open: bool) -> None:
        self.keep_open = keep_open
        self._fds: dict[str, int] = {}
        self._used: set[str] = set()

    def read(self, path: str) -> str | None:
        if not self.keep_open:
            return _read(path)
        self._used.add(path)
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError:
                return None
        try:
            return os.pread(fd, 256, 0).decode("ascii", "replace").strip()
        except OSError as exc:  # EINVAL: carrier of a down interface; ENODEV: the device went away
            if exc.errno != errno.EINVAL:
                self._drop(path)
            return None

    def _drop(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def sweep(self) -> None:
        for path in [p for p in self._fds if p not in self._used]:
            self._drop(path)
        self._used.clear()

    def close(self) -> None:
        for path in list(self._fds):
            self._drop(path)


def _number(text: str | None) -> int | None:
    if text is None or text in ("", "N/A"):
        return None
    try:
        return int(text, 0) if text.startswith("0x") else int(text)
    except ValueError:
        return None


def _leading_int(text: str | None) -> int | None:
    """``"4: ACTIVE"`` -> 4, ``"400 Gb/sec (4X NDR)"`` -> 400."""
    if not text:
        return None
    head = text.split(":")[0].split()[0]
    try:
        return int(float(head))
    except ValueError:
        return None


class NICCollector:
    name = "nic"
    Settings = NICSettings

    def __init__(self, settings: NICSettings | None = None, advance: Callable[[], None] | None = None) -> None:
        self.settings = settings or NICSettings()
        self._advance = advance  # the simulated tree moves its counters before each read
        self._files = _Files(keep_open=os.path.realpath(self.settings.root) == "/sys" and advance is None)
        self._last: dict[tuple[str, str], tuple[int, float]] = {}
        self.wraps = 0
        self.resets = 0
        net = os.path.join(self.settings.root, "class", "net")
        if not os.path.isdir(net):
            log.warning("nic collector: %s does not exist; no Ethernet counters", net)

    def _rates(self, dev: str, counters: dict[str, int], now: float) -> dict[str, float]:
        fields: dict[str, float] = {}
        for name, value in counters.items():
            if self.settings.totals:
                fields[name] = float(value)
            last = self._last.get((dev, name))
            self._last[(dev, name)] = (value, now)
            if last is None or now <= last[1]:
                continue
            delta, how = counter_delta(last[0], value)
            if how == "wrap":
                self.wraps += 1
            elif how == "reset":
                self.resets += 1
                log.info("nic collector: %s %s went from %d to %d: counter reset", dev, name, last[0], value)
            fields[f"{name}_per_s"] = delta / (now - last[1])
        return fields

    def _counters(self, directory: str, lanes: bool = False) -> dict[str, int]:
        out: dict[str, int] = {}
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            return out
        for name in names:
            value = _number(self._files.read(os.path.join(directory, name)))
            if value is None:
                continue
            if lanes and name in _DATA_LANES:
                out[_DATA_LANES[name]] = value * 4
            else:
                out[name] = value
        return out

    def _net(self, now: float) -> list[contracts.Sample]:
        base = os.path.join(self.settings.root, "class", "net")
        try:
            ifaces = sorted(os.listdir(base))
        except OSError:
            return []
        s = self.settings
        samples = []
        for iface in ifaces:
            if iface in s.exclude or (s.include and iface not in s.include):
                continue
            d = os.path.join(base, iface)
            if not s.virtual and iface not in s.include and "/devices/virtual/" in os.path.realpath(d):
                continue
            counters = self._counters(os.path.join(d, "statistics"))
            oper = self._files.read(os.path.join(d, "operstate"))
            fields = self._rates(f"net:{iface}", counters, now)
            fields["link_up"] = 1.0 if oper == "up" else 0.0
            flags = _number(self._files.read(os.path.join(d, "flags")))   # "0x1003"; IFF_UP is 0x1
            if flags is not None:
                fields["admin_up"] = float(int(flags) & 1)
            carrier = _number(self._files.read(os.path.join(d, "carrier")))
            fields["carrier"] = float(carrier or 0)
            changes = _number(self._files.read(os.path.join(d, "carrier_changes")))
            if changes is not None:
                fields["carrier_changes"] = float(changes)
            samples.append(contracts.Sample(contracts.Source.NIC, fields, tags={"device": iface, "kind": "net"}))
        return samples

    def _ib(self, now: float) -> list[contracts.Sample]:
        base = os.path.join(self.settings.root, "class", "infiniband")
        try:
            hcas = sorted(os.listdir(base))
        except OSError:
            return []
        samples = []
        for hca in hcas:
            if hca in self.settings.exclude or (self.settings.include and hca not in self.settings.include):
                continue
            ports_dir = os.path.join(base, hca, "ports")
            try:
                ports = sorted(os.listdir(ports_dir), key=lambda p: int(p) if p.isdigit() else 0)
            except OSError:
                continue
            for port in ports:
                d = os.path.join(ports_dir, port)
                counters = self._counters(os.path.join(d, "counters"), lanes=True)
                counters.update(self._counters(os.path.join(d, "hw_counters")))
                fields = self._rates(f"ib:{hca}:{port}", counters, now)
                state = _leading_int(self._files.read(os.path.join(d, "state")))
                phys = _leading_int(self._files.read(os.path.join(d, "phys_state")))
                rate = _leading_int(self._files.read(os.path.join(d, "rate")))
                if state is not None:
                    fields["state"] = float(state)
                    fields["link_up"] = 1.0 if state == 4 else 0.0
                if phys is not None:
                    fields["phys_state"] = float(phys)
                if rate is not None:
                    fields["rate_gbps"] = float(rate)
                samples.append(contracts.Sample(contracts.Source.NIC, fields, index=int(port) if port.isdigit() else None,
                                                tags={"device": hca, "port": port, "kind": "ib"}))
        return samples

    def collect(self) -> list[contracts.Sample]:
        if self._advance is not None:
            self._advance()
        now = time.monotonic()
        samples = self._net(now)
        if self.settings.infiniband:
            samples += self._ib(now)
        self._files.sweep()
        return samples

    def close(self) -> None:
        self._files.close()
