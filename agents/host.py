"""Host collector: one ``Source.HOST`` sample per collect from psutil.

Fields: ``cpu_percent`` (all cores, since the previous collect), ``mem_used_percent``,
``mem_available_mib``, ``swap_used_percent``, ``load1``/``load5``/``load15``, ``procs``, and
from the second collect on the IO rates of the whole host: ``disk_read_bytes_per_s``,
``disk_write_bytes_per_s``, ``net_recv_bytes_per_s``, ``net_sent_bytes_per_s`` (a counter
that went backwards, e.g. a device removed, gives no rate that time).
Liveness of the training ranks is the ``train`` collector's (``alive`` per rank).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

from transom import contracts

__all__ = ["HostCollector", "HostSettings"]

_MEMINFO = {b"MemTotal", b"MemAvailable", b"SwapTotal", b"SwapFree"}


@dataclass
class HostSettings:
    """``[collectors.host]``"""

    #: include disk and network IO rates
    io: bool = True


class HostCollector:
    name = "host"
    Settings = HostSettings

    def __init__(self, settings: HostSettings | None = None) -> None:
        self.settings = settings or HostSettings()
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement window
        self._last: tuple[float, dict[str, float]] | None = None
        self._disks: tuple[float, set[str]] | None = None

    def _disk_bytes(self) -> tuple[int, int] | None:
        """Bytes read and written by the whole disks (those in /sys/block, rescanned every minute),
        from /proc/diskstats, whose sectors are 512 bytes whatever the device's own sector size."""
        now = time.monotonic()
        if self._disks is None or now - self._disks[0] > 60:
            try:
                self._disks = (now, set(os.listdir("/sys/block")))
            except OSError:
                self._disks = (now, set())
        read = written = 0
        try:
            with open("/proc/diskstats", "rb") as fh:
                for line in fh:
                    f = line.split()
                    if len(f) >= 10 and f[2].decode() in self._disks[1]:
                        read += int(f[5]) * 512
                        written += int(f[9]) * 512
        except OSError:
            return None
        return read, written

    def _io(self) -> dict[str, float]:
        now = time.monotonic()
        totals: dict[str, float] = {}
        disk = self._disk_bytes()
        if disk is not None:
            totals["disk_read_bytes"], totals["disk_write_bytes"] = disk
        net = psutil.net_io_counters()
        if net is not None:
            totals["net_recv_bytes"], totals["net_sent_bytes"] = net.bytes_recv, net.bytes_sent
        last, self._last = self._last, (now, totals)
        if last is None or now <= last[0]:
            return {}
        dt = now - last[0]
        return {f"{k}_per_s": (v - last[1][k]) / dt for k, v in totals.items()
                if k in last[1] and v >= last[1][k]}

    def _memory(self) -> dict[str, float]:
        """From one read of /proc/meminfo (psutil reads it, and /proc/vmstat, once per function);
        the same definitions as psutil: used = total - available."""
        kb: dict[str, int] = {}
        try:
            with open("/proc/meminfo", "rb") as fh:
                for line in fh:
                    name, _, rest = line.partition(b":")
                    if name in _MEMINFO:
                        kb[name.decode()] = int(rest.split()[0])
        except OSError:
            kb = {}
        if "MemTotal" not in kb or "MemAvailable" not in kb:  # not Linux, or an old kernel: psutil's way
            mem, swap = psutil.virtual_memory(), psutil.swap_memory()
            return {"mem_used_percent": float(mem.percent), "mem_available_mib": mem.available / 2**20,
                    "swap_used_percent": float(swap.percent)}
        total, avail = kb["MemTotal"], kb["MemAvailable"]
        swap_total, swap_free = kb.get("SwapTotal", 0), kb.get("SwapFree", 0)
        return {"mem_used_percent": round(100.0 * (total - avail) / total, 1) if total else 0.0,
                "mem_available_mib": avail / 1024.0,
                "swap_used_percent": round(100.0 * (swap_total - swap_free) / swap_total, 1) if swap_total else 0.0}

    def collect(self) -> list[contracts.Sample]:
        load1, load5, load15 = os.getloadavg()
        fields = {
            "cpu_percent": float(psutil.cpu_percent(interval=None)),
            **self._memory(),
            "load1": load1, "load5": load5, "load15": load15,
            "procs": len(psutil.pids()),
        }
        if self.settings.io:
            fields.update(self._io())
        return [contracts.Sample(contracts.Source.HOST, fields)]
