"""Host collector: one ``Source.HOST`` sample per interval from psutil.

Fields: ``cpu_percent`` (all cores, since the previous collect), ``mem_used_percent``,
``mem_available_mib``, ``swap_used_percent``, ``load1``/``load5``/``load15``, ``procs``.
"""

from __future__ import annotations

import os

import psutil

from transom import contracts

__all__ = ["HostCollector"]


class HostCollector:
    name = "host"

    def __init__(self) -> None:
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement window

    def collect(self) -> list[contracts.Sample]:
        mem = psutil.virtual_memory()
        swap = psutil.swap_memory()
        load1, load5, load15 = os.getloadavg()
        return [contracts.Sample(contracts.Source.HOST, {
            "cpu_percent": float(psutil.cpu_percent(interval=None)),
            "mem_used_percent": float(mem.percent),
            "mem_available_mib": mem.available / 2**20,
            "swap_used_percent": float(swap.percent),
            "load1": load1, "load5": load5, "load15": load15,
            "procs": len(psutil.pids()),
        })]
