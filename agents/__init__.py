"""The node agent: collectors -> one MetricBatch per interval on ``transom.metrics``.

Modules:

- ``collectors``  the Collector protocol, the registry by name, the error policy (RunningCollector)
- ``host``        host metrics (psutil)
- ``gpu``         GPU metrics and XID events over an NVML-like module; ``open_nvml``
- ``simulated``   SimulatedGPUSource: a named fake of NVML with fault injection
- ``intake``      training intake: ``report()`` (client, stdlib only) and the UDP server
- ``training``    the latest report and liveness of each training rank
- ``agent``       Agent: runs the collectors and publishes
- ``cli``         ``transom agent`` and ``transom inject``

Training scripts import only ``transom.agents.intake``; this package imports nothing heavy at
import time, and resolves the names below on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Agent", "SimulatedGPUSource", "GPUCollector", "report"]

_WHERE = {"Agent": "agent", "SimulatedGPUSource": "simulated", "GPUCollector": "gpu", "report": "intake"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
