"""The node agent: collectors -> one MetricBatch per interval on ``transom.metrics``.

Modules:

- ``collectors``  the Collector protocol, the registry by name, the runner (interval, tags, error policy)
- ``config``      AgentConfig from a TOML file, TRANSOM_AGENT__* variables and flags
- ``host``        host metrics (psutil)
- ``gpu``         GPU metrics (DCGM names) and XID events over an NVML-like module; ``open_nvml``
- ``nic``         Ethernet and InfiniBand counters, rates and link state from sysfs
- ``fakenvml``    FakeNVML: a named fake of pynvml for tests (never a default)
- ``simulated``   SimulatedGPUSource (FakeNVML with noise and a fault scenario), SimulatedSysfs
- ``intake``      training intake: ``report()`` (client, stdlib only) and the UDP server
- ``training``    the latest report and liveness of each training rank
- ``spool``       the bounded on-disk spool and the node's sequence state
- ``delivery``    Publisher: producer, spool, replay in order, flush on stop
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
