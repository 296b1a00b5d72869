"""TEE ("Eagle Eye"): fault detection over the metrics stream.

Modules: :mod:`.config` (``TEEConfig``), :mod:`.classes` (fault classes), :mod:`.rules` (hard-fault
rules, per-node state), :mod:`.peers` (per-window soft faults: own history and job peers),
:mod:`.detectors` (per-sample ECOD), :mod:`.scoring` (the per-node temporal scorer of
bench/tee_external), :mod:`.corpus` (the labelled fault corpus), :mod:`.engine` (``TEEEngine``: rules +
detectors + merging), all free of Faust; :mod:`.app` (the faust-streaming worker) and :mod:`.cli` (``transom tee``).
``TEEEngine`` and ``TEEConfig`` are importable from here; nothing heavy is imported until used.
"""

from __future__ import annotations

__all__ = ["TEEConfig", "TEEEngine"]


def __getattr__(name: str):
    if name == "TEEConfig":
        from .config import TEEConfig
        return TEEConfig
    if name == "TEEEngine":
        from .engine import TEEEngine
        return TEEEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
