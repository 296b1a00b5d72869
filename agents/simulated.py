"""The simulated node: fake GPUs with realistic values and a fault scenario, and a fake NIC sysfs tree.

:class:`SimulatedGPUSource` is a :class:`~transom.agents.fakenvml.FakeNVML` (pynvml's names,
signatures and error codes) whose values move like a busy H100 SXM node: utilisation about
93% +- 2, 80 GiB framebuffer mostly used, power following utilisation (90 W idle, about 570 W
busy, of 700 W TDP), temperature following power, boost clocks, energy integrating power, each GPU
with its own offsets drawn from ``seed``. It is never chosen silently: the agent uses it only for
``--gpu-source simulated``.

Faults come from :meth:`inject_xid` (the UDP ``transom inject``) or from a scenario file played
from the moment the source is initialised. The scenario is TOML, one ``[[fault]]`` table each::

    [[fault]]
    at = 30            # seconds after start
    kind = "xid"       # see KINDS
    gpu = 1
    code = 79          # xid: 79, 48, 63, 64, 74, 94, 95
    duration = 20      # thermal, power, straggler, hang, nic_flap: seconds (0: for good)
    count = 4          # ecc_dbe, nvlink, nic_errors: how many errors
    device = "mlx5_0"  # nic_flap, nic_errors: the interface or HCA
    factor = 0.7       # straggler: fraction of the healthy clock and power

What each does, as the driver shows it: XID 79 (fallen off the bus): the GPU answers
GPU_IS_LOST from then on; 48 (double-bit ECC) and ``ecc_dbe``: DBE volatile and aggregate counts
and a retired page (``ecc_dbe`` also raises XID 48); 63 / 64: a row remapping pending / failed;
74: NVLink replay and recovery errors; 94 / 95: a contained / uncontained ECC error (DBE count);
``thermal``: temperature up 25 C, HW and SW thermal slowdown reasons, SM clock down 40%;
``power``: SW power cap reason, power held at 400 W, SM clock down 20%; ``nvlink``: CRC flit,
CRC data and replay errors; ``straggler``: SM clock and power scaled by ``factor``; ``hang``:
utilisation pinned at 100% at near-idle power (a collective spinning) and ``on_hang`` called (the
agent SIGSTOPs its training ranks); ``nic_flap``: the link goes down for ``duration`` (operstate,
carrier, IB state and phys_state) and comes back, carrier changes counted; ``nic_errors``:
symbol, receive and link-error counters jump by ``count``.

:class:`SimulatedSysfs` writes a ``class/net`` and ``class/infiniband`` tree with the real layout
(under a directory of the caller's) whose counters advance at a steady training traffic rate on
each :meth:`SimulatedSysfs.advance`; the NIC collector reads it with ``source = "simulated"``.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import pynvml

from transom.config import ConfigError
from transom.log import get

from .fakenvml import NVLINK_FIELDS, FakeDevice, FakeNVML

__all__ = ["SimulatedGPUSource", "SimulatedSysfs", "Fault", "load_scenario", "LOST_XIDS", "KINDS", "SCENARIO_XIDS"]

log = get("agent.sim")

#: XID codes after which the simulated GPU is lost.
LOST_XIDS = frozenset({79})
#: XID codes a scenario may raise.
SCENARIO_XIDS = (79, 48, 63, 64, 74, 94, 95)
KINDS = ("xid", "ecc_dbe", "thermal", "power", "nvlink", "straggler", "hang", "nic_flap", "nic_errors")
_DURATION_KINDS = ("thermal", "power", "straggler", "hang", "nic_flap")
_FAULT_KEYS = ("at", "kind", "gpu", "code", "duration", "count", "device", "factor")
_UNC, _COR = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
_VOL, _AGG = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str
    gpu: int = 0
    code: int = 0
    duration: float = 0.0
    count: int = 1
    device: str = ""
    factor: float = 0.7


def load_scenario(path: str, num_gpus: int | None = None) -> list[Fault]:
    """Parse a scenario file; :class:`ConfigError` names the fault and key that is wrong."""
    import tomllib

    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"scenario: file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"scenario {path}: not valid TOML: {exc}") from None
    extra = sorted(set(doc) - {"fault"})
    if extra:
        raise ConfigError(f"scenario {path}: unknown top-level key '{extra[0]}'; expected [[fault]] tables")
    faults = []
    for i, f in enumerate(doc.get("fault", [])):
        where = f"scenario {path} fault #{i + 1}"
        unknown = sorted(set(f) - set(_FAULT_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key '{unknown[0]}'; valid keys: {', '.join(_FAULT_KEYS)}")
        kind = f.get("kind")
        if kind not in KINDS:
            raise ConfigError(f"{where}: kind {kind!r} is unknown; expected one of: {', '.join(KINDS)}")
        for key, typ in (("at", (int, float)), ("gpu", int), ("code", int), ("duration", (int, float)),
                         ("count", int), ("device", str), ("factor", (int, float))):
            if key in f and (isinstance(f[key], bool) or not isinstance(f[key], typ)):
                raise ConfigError(f"{where}: '{key}' has the wrong type ({f[key]!r})")
        if "at" not in f or f["at"] < 0:
            raise ConfigError(f"{where}: 'at' (seconds after start, >= 0) is required")
        if kind == "xid" and f.get("code") not in SCENARIO_XIDS:
            raise ConfigError(f"{where}: xid 'code' must be one of {', '.join(map(str, SCENARIO_XIDS))}, "
                              f"got {f.get('code')!r}")
        if num_gpus is not None and not kind.startswith("nic") and not 0 <= f.get("gpu", 0) < num_gpus:
            raise ConfigError(f"{where}: 'gpu' must be 0..{num_gpus - 1}, got {f.get('gpu')}")
        faults.append(Fault(**{k: f[k] for k in _FAULT_KEYS if k in f}))
    return sorted(faults, key=lambda x: x.at)


@dataclass
class _Base:
    util: float
    temp_offset: float
    fb_used_mib: float


class SimulatedGPUSource(FakeNVML):
    """Fake GPUs with noise and faults (see the module docstring)."""

    MODEL = "NVIDIA H100 80GB HBM3 (simulated)"
    FB_TOTAL_MIB = 81559
    IDLE_W, LOAD_W = 90.0, 520.0        # power at idle, and added at 100% utilisation (700 W TDP)
    SM_CLOCK_MHZ, MEM_CLOCK_MHZ = 1980, 2619

    def __init__(self, num_gpus: int = 2, seed: int | None = None, scenario: list[Fault] | None = None,
                 on_hang: Callable[[Fault], Any] | None = None) -> None:
        if num_gpus < 1:
            raise ValueError(f"num_gpus must be at least 1, got {num_gpus}")
        super().__init__(num_gpus)
        self.num_gpus = num_gpus
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self.scenario = list(scenario or [])
        self.on_hang = on_hang
        self.nic: SimulatedSysfs | None = None
        self.played: list[Fault] = []
        self._active: list[tuple[Fault, float]] = []   # (fault, until monotonic; inf = for good)
        self._t0 = time.monotonic()
        self._player: threading.Thread | None = None
        self._stop = threading.Event()
        rng = self._rng
        self._base = []
        for dev in self.devices:
            dev.uuid = f"GPU-sim-{rng.getrandbits(64):016x}"
            dev.name = self.MODEL
            dev.fb_total_mib = self.FB_TOTAL_MIB
            self._base.append(_Base(util=rng.uniform(90.0, 96.0), temp_offset=rng.uniform(-3.0, 3.0),
                                    fb_used_mib=rng.uniform(0.80, 0.90) * self.FB_TOTAL_MIB))
        self._last: dict[int, float] = {}
        self._early: list[tuple[int, int, float | None]] = []

    def __repr__(self) -> str:
        return f"SimulatedGPUSource(num_gpus={self.num_gpus}, faults={len(self.scenario)})"

    # ------------------------------------------------------------------ lifecycle

    def nvmlInit(self) -> None:
        super().nvmlInit()
        self._t0 = time.monotonic()
        if self.scenario and self._player is None:
            self._stop.clear()
            self._player = threading.Thread(target=self._play, name="transom-scenario", daemon=True)
            self._player.start()

    def nvmlShutdown(self) -> None:
        self._stop.set()
        if self._player is not None:
            self._player.join(5)
            self._player = None
        super().nvmlShutdown()

    def _play(self) -> None:
        for fault in self.scenario:
            delay = self._t0 + fault.at - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                return
            try:
                self.apply(fault)
            except Exception as exc:  # a scenario must not end the agent
                log.warning("scenario: %s failed: %s", fault, exc)

    # ------------------------------------------------------------------ faults

    def push_xid(self, gpu: int, code: int, timestamp: float | None = None) -> None:
        """As FakeNVML's, but an XID raised before the collector registered for events waits for it
        (a scenario fault at 0 s must not race the agent's start)."""
        with self._cond:
            if not self._registered.get(gpu, 0) & pynvml.nvmlEventTypeXidCriticalError:
                self._early.append((gpu, code, timestamp))
                return
        super().push_xid(gpu, code, timestamp)

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: object) -> None:
        super().nvmlDeviceRegisterEvents(handle, eventTypes, eventSet)
        with self._cond:
            early = [e for e in self._early if e[0] == handle.index]
            self._early = [e for e in self._early if e[0] != handle.index]
        for gpu, code, ts in early:
            super().push_xid(gpu, code, ts)

    def inject_xid(self, gpu: int, code: int) -> float:
        """Raise XID ``code`` on GPU ``gpu`` now, with its effects; return the injection time."""
        if not 0 <= gpu < self.num_gpus:
            raise ValueError(f"no GPU {gpu}: this simulated node has GPUs 0..{self.num_gpus - 1}")
        ts = time.time()
        with self._lock:
            dev = self.devices[gpu]
            if code in (48, 94, 95):
                self._dbe(dev, 1)
            elif code == 63:
                dev.remapped_unc += 1
                dev.remap_pending = 1
            elif code == 64:
                dev.remap_failure = 1
            elif code == 74:
                self._nvlink(dev, 3, recovery=True)
            self.push_xid(gpu, code, timestamp=ts)
            if code in LOST_XIDS:
                dev.lost = True
        return ts

    def _dbe(self, dev: FakeDevice, count: int) -> None:
        for key in ((_UNC, _VOL), (_UNC, _AGG)):
            dev.ecc[key] = dev.ecc.get(key, 0) + count
        dev.retired_dbe.extend(0x7F000 + len(dev.retired_dbe) + i for i in range(count))
        dev.retired_pending = 1

    def _nvlink(self, dev: FakeDevice, count: int, recovery: bool = False) -> None:
        crc_flit, crc_data, replay, recov = NVLINK_FIELDS
        dev.nvlink[crc_flit] += count
        dev.nvlink[crc_data] += max(1, count // 2)
        dev.nvlink[replay] += count
        if recovery:
            dev.nvlink[recov] += 1

    def apply(self, fault: Fault) -> None:
        """Carry out one scenario fault now."""
        log.warning("scenario: %s on %s", fault.kind, f"GPU {fault.gpu}" if not fault.kind.startswith("nic")
                    else fault.device or "the first NIC")
        self.played.append(fault)
        k = fault.kind
        if k == "xid":
            self.inject_xid(fault.gpu, fault.code)
            return
        if k.startswith("nic"):
            if self.nic is None:
                log.warning("scenario: %s needs the simulated NIC ([collectors.nic] source = \"simulated\"); skipped", k)
                return
            self.nic.fault(fault)
            return
        with self._lock:
            dev = self.devices[fault.gpu]
            if k == "ecc_dbe":
                self._dbe(dev, fault.count)
            elif k == "nvlink":
                self._nvlink(dev, fault.count)
            if k in _DURATION_KINDS:
                until = time.monotonic() + fault.duration if fault.duration > 0 else float("inf")
                self._active.append((fault, until))
            self._last.clear()  # the next query shows the fault
        if k == "ecc_dbe":
            self.push_xid(fault.gpu, 48, timestamp=time.time())
        if k == "hang" and self.on_hang is not None:
            self.on_hang(fault)

    # ------------------------------------------------------------------ values

    def _effects(self, index: int, now: float) -> dict[str, Fault]:
        self._active = [(f, u) for f, u in self._active if u > now]
        return {f.kind: f for f, _u in self._active if f.gpu == index}

    def _refresh(self, dev: FakeDevice) -> None:
        now = time.monotonic()
        last = self._last.get(dev.index)
        if last is not None and now - last < 0.05:
            return  # one coherent set of values per collect
        with self._lock:
            last = self._last.get(dev.index)
            self._last[dev.index] = now
            rng, base = self._rng, self._base[dev.index]
            fx = self._effects(dev.index, now)
            util = min(100.0, max(0.0, rng.gauss(base.util, 2.0)))
            power = self.IDLE_W + util / 100.0 * self.LOAD_W + rng.gauss(0.0, 12.0)
            sm = self.SM_CLOCK_MHZ - abs(rng.gauss(0.0, 20.0))
            reasons = 0
            if "straggler" in fx:
                f = fx["straggler"].factor
                sm *= f
                power = self.IDLE_W + (power - self.IDLE_W) * f
            if "power" in fx:
                reasons |= pynvml.nvmlClocksEventReasonSwPowerCap
                power = min(power, 400.0 + rng.gauss(0.0, 3.0))
                sm *= 0.8
            if "hang" in fx:
                util, power = 100.0, self.IDLE_W + 60.0 + rng.gauss(0.0, 4.0)
            temp = 33.0 + 0.05 * power + base.temp_offset + rng.gauss(0.0, 0.7)
            if "thermal" in fx:
                temp += 25.0
                reasons |= pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonSwThermalSlowdown
                sm *= 0.6
            dev.util = round(util)
            dev.mem_util = round(min(100.0, max(0.0, util * 0.45 + rng.gauss(0.0, 2.0))))
            dev.fb_used_mib = min(self.FB_TOTAL_MIB, base.fb_used_mib + rng.gauss(0.0, 64.0))
            dt = 0.0 if last is None else now - last
            dev.energy_mj += int(power * dt * 1000)
            dev.power_mw = int(power * 1000)
            dev.temp = round(temp)
            dev.mem_temp = round(temp + 6.0 + rng.gauss(0.0, 0.5))
            dev.sm_clock = int(sm)
            dev.mem_clock = self.MEM_CLOCK_MHZ
            dev.clocks_event_reasons = reasons
            if rng.random() < 0.002:
                dev.ecc[(_COR, _VOL)] = dev.ecc.get((_COR, _VOL), 0) + 1  # the odd corrected error
                dev.ecc[(_COR, _AGG)] = dev.ecc.get((_COR, _AGG), 0) + 1


class SimulatedSysfs:
    """A sysfs tree of one simulated node: ``eth0`` and ``mlx5_0..n-1`` port 1 (400 Gb/s NDR)."""

    NET_STATS = ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets", "rx_errors", "tx_errors",
                 "rx_dropped", "tx_dropped", "rx_crc_errors", "collisions", "multicast")
    IB_COUNTERS = ("port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets",
                   "symbol_error", "port_rcv_errors", "link_error_recovery", "link_downed",
                   "port_xmit_discards", "local_link_integrity_errors", "excessive_buffer_overrun_errors")
    IB_HW = ("out_of_buffer", "out_of_sequence", "packet_seq_err", "rnr_nak_retry_err", "np_cnp_sent")
    IB_RATE_BPS = 40e9      # bytes per second of training traffic per port, each way

    def __init__(self, root: str, hcas: int = 2, seed: int | None = None) -> None:
        self.root = root
        self.hcas = [f"mlx5_{i}" for i in range(hcas)]
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._net = {"eth0": {k: 0 for k in self.NET_STATS}}
        self._ib = {h: {**{k: 0 for k in self.IB_COUNTERS + self.IB_HW}} for h in self.hcas}
        self._down_until: dict[str, float] = {}
        self._carrier_changes = {"eth0": 1, **{h: 1 for h in self.hcas}}
        self._last = time.monotonic()
        for name in self._net:
            os.makedirs(os.path.join(root, "class", "net", name, "statistics"), exist_ok=True)
        for h in self.hcas:
            for sub in ("counters", "hw_counters"):
                os.makedirs(os.path.join(root, "class", "infiniband", h, "ports", "1", sub), exist_ok=True)
        self.advance()

    def fault(self, f: Fault) -> None:
        device = f.device or self.hcas[0]
        with self._lock:
            if device not in self._net and device not in self._ib:
                log.warning("scenario: no simulated NIC %s (have %s)", device, ", ".join([*self._net, *self._ib]))
                return
            if f.kind == "nic_flap":
                self._down_until[device] = time.monotonic() + (f.duration if f.duration > 0 else 1e12)
                self._carrier_changes[device] += 1
            else:
                if device in self._ib:
                    c = self._ib[device]
                    c["symbol_error"] += f.count
                    c["port_rcv_errors"] += f.count
                    c["link_error_recovery"] += 1
                else:
                    self._net[device]["rx_errors"] += f.count
                    self._net[device]["rx_crc_errors"] += f.count

    def _write(self, path: str, text: str) -> None:
        with open(os.path.join(self.root, path), "w") as fh:
            fh.write(text + "\n")

    def advance(self) -> None:
        """Advance the counters by the time since the last call and rewrite the tree."""
        now = time.monotonic()
        with self._lock:
            dt, self._last = now - self._last, now
            for dev, until in list(self._down_until.items()):
                if until <= now:
                    del self._down_until[dev]
                    self._carrier_changes[dev] += 1
                    if dev in self._ib:
                        self._ib[dev]["link_downed"] += 1
            for name, c in self._net.items():
                up = name not in self._down_until
                if up:
                    c["rx_bytes"] += int(2e6 * dt)
                    c["tx_bytes"] += int(1e6 * dt)
                    c["rx_packets"] += int(2e3 * dt)
                    c["tx_packets"] += int(1e3 * dt)
                base = f"class/net/{name}"
                for k, v in c.items():
                    self._write(f"{base}/statistics/{k}", str(v))
                self._write(f"{base}/operstate", "up" if up else "down")
                if up:
                    self._write(f"{base}/carrier", "1")
                else:
                    try:
                        os.unlink(os.path.join(self.root, base, "carrier"))  # reading it fails while down
                    except FileNotFoundError:
                        pass
                self._write(f"{base}/carrier_changes", str(self._carrier_changes[name]))
            for h, c in self._ib.items():
                up = h not in self._down_until
                if up:
                    lanes = int(self.IB_RATE_BPS * dt * self._rng.uniform(0.95, 1.05) / 4)
                    c["port_xmit_data"] += lanes
                    c["port_rcv_data"] += lanes
                    c["port_xmit_packets"] += lanes // 1024
                    c["port_rcv_packets"] += lanes // 1024
                base = f"class/infiniband/{h}/ports/1"
                for k in self.IB_COUNTERS:
                    self._write(f"{base}/counters/{k}", str(c[k]))
                for k in self.IB_HW:
                    self._write(f"{base}/hw_counters/{k}", str(c[k]))
                self._write(f"{base}/state", "4: ACTIVE" if up else "1: DOWN")
                self._write(f"{base}/phys_state", "5: LinkUp" if up else "3: Disabled")
                self._write(f"{base}/rate", "400 Gb/sec (4X NDR)")
