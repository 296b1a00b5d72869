"""Soft-fault detectors of the TEE: pyod models over a node's own history (no Faust here).

:class:`GpuAnomalyDetector` follows the rule protocol of :mod:`transom.streams.rules`
(``observe(state, batch, now) -> list[FaultEvent]``) and keeps one :class:`EcodWindow` per node
in ``NodeState.detectors``. The window holds the node's recent GPU feature vectors, each the mean
across the node's GPUs of utilisation, temperature, power and SM clock.

Contract of :meth:`EcodWindow.update`:

- nothing is scored until the window holds ``ecod_min_samples`` clean vectors;
- the ECOD model is fitted on the window (never on the vector being scored) and refitted once
  every ``ecod_refit_every`` scored vectors; the threshold is pyod's ``threshold_`` for
  ``ecod_contamination``;
- ``ecod_consecutive`` vectors in a row above the threshold make one ANOMALY (WARNING, OBSERVE);
  the run's vectors stay out of the window, so a transient outlier does not teach the model;
- a run that lasts ``ecod_min_samples`` vectors is a new normal level: the window restarts
  from it, and the detector re-arms.

Importing pyod and compiling its numba kernels takes seconds (it pulls in scikit-learn and
matplotlib), so it happens once per process when the first detector is built, never in the
middle of a stream. Scoring costs a few milliseconds per node and sample (mostly scipy's skew).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from transom.contracts import DCGM, Action, FaultEvent, FaultKind, MetricBatch, Severity, Source, stable_id

from .config import TEEConfig
from .rules import NodeState, fault

__all__ = ["FEATURES", "gpu_features", "Verdict", "EcodWindow", "GpuAnomalyDetector"]

#: The GPU fields a node's feature vector is made of (each averaged over the node's GPUs).
FEATURES: tuple[str, ...] = (DCGM.GPU_UTIL, DCGM.GPU_TEMP, DCGM.POWER_USAGE, DCGM.SM_CLOCK)


def gpu_features(batch: MetricBatch) -> np.ndarray | None:
    """The node's feature vector, or None when no GPU sample carries every feature."""
    rows = [[float(s.fields[f]) for f in FEATURES] for s in batch.of(Source.GPU)
            if all(f in s.fields for f in FEATURES)]
    if not rows:
        return None
    return np.asarray(rows, dtype=float).mean(axis=0)


@dataclass(frozen=True)
class Verdict:
    """An anomalous run: its first timestamp, the latest score and threshold, and the features."""

    start_ts: float
    score: float
    threshold: float
    features: Mapping[str, Mapping[str, float]]   # name -> {"value", "median"}


class EcodWindow:
    """One node's ECOD state: the window of clean vectors, the fitted model, the outlier run."""

    def __init__(self, config: TEEConfig, ecod_cls: Any) -> None:
        self.config = config
        self._ecod_cls = ecod_cls
        self.window: deque[np.ndarray] = deque(maxlen=config.ecod_window)
        self.run: list[tuple[float, np.ndarray]] = []
        self.model: Any = None
        self.threshold = float("nan")
        self.since_fit = 0

    def _fit(self) -> None:
        model = self._ecod_cls(contamination=self.config.ecod_contamination)
        model.fit(np.vstack(self.window))
        self.model, self.threshold, self.since_fit = model, float(model.threshold_), 0

    def update(self, x: np.ndarray, ts: float) -> Verdict | None:
        cfg = self.config
        if len(self.window) < cfg.ecod_min_samples:
            self.window.append(x)
            return None
        if self.model is None or self.since_fit >= cfg.ecod_refit_every:
            self._fit()
        score = float(self.model.decision_function(x.reshape(1, -1))[0])
        self.since_fit += 1
        if score <= self.threshold:
            self.run.clear()
            self.window.append(x)
            return None
        self.run.append((ts, x))
        verdict = None
        if len(self.run) == cfg.ecod_consecutive:
            median = np.median(np.vstack(self.window), axis=0)
            verdict = Verdict(start_ts=self.run[0][0], score=score, threshold=self.threshold,
                              features={name: {"value": round(float(v), 3), "median": round(float(m), 3)}
                                        for name, v, m in zip(FEATURES, x, median)})
        if len(self.run) >= cfg.ecod_min_samples:
            self.window.clear()
            self.window.extend(v for _, v in self.run)
            self.run.clear()
            self.model = None
        return verdict


_ECOD: Any = None


def _load_ecod() -> Any:
    """Import pyod's ECOD and compile its numba kernels now, not in the middle of a stream."""
    global _ECOD
    if _ECOD is None:
        from pyod.models.ecod import ECOD

        ECOD().fit(np.random.default_rng(0).normal(size=(8, len(FEATURES))))
        _ECOD = ECOD
    return _ECOD


def _most_off(features: Mapping[str, Mapping[str, float]]) -> str:
    def rel(item):
        v, m = item[1]["value"], item[1]["median"]
        return abs(v - m) / max(abs(m), 1e-9)
    name, f = max(features.items(), key=rel)
    return f"{name} {f['value']:g} against a median of {f['median']:g}"


class GpuAnomalyDetector:
    """ECOD (pyod) over each node's window of GPU feature vectors; kind ANOMALY, WARNING, OBSERVE."""

    name = "ecod"

    def __init__(self, config: TEEConfig) -> None:
        self.config = config
        self._ecod_cls = _load_ecod()

    def window(self, state: NodeState) -> EcodWindow:
        win = state.detectors.get(self.name)
        if win is None:
            win = state.detectors[self.name] = EcodWindow(self.config, self._ecod_cls)
        return win

    def observe(self, state: NodeState, batch: MetricBatch, now: float) -> list[FaultEvent]:
        x = gpu_features(batch)
        if x is None:
            return []
        verdict = self.window(state).update(x, batch.ts)
        if verdict is None:
            return []
        n = self.config.ecod_consecutive
        return [fault(
            FaultKind.ANOMALY, Severity.WARNING, Action.OBSERVE,
            fault_id=stable_id(batch.node, "anomaly", "ecod", verdict.start_ts), node=batch.node, job=batch.job,
            detector="pyod.ecod", observed_ts=batch.ts, now=now, score=verdict.score, threshold=verdict.threshold,
            evidence={"score": round(verdict.score, 4), "threshold": round(verdict.threshold, 4),
                      "consecutive": n, "since_ts": verdict.start_ts, "window": len(self.window(state).window),
                      "features": {k: dict(v) for k, v in verdict.features.items()},
                      "aggregate": "mean over the node's GPUs"},
            summary=(f"GPU metrics of {batch.node} look anomalous for {n} samples in a row (ECOD score "
                     f"{verdict.score:.1f} above {verdict.threshold:.1f}); most off: "
                     f"{_most_off(verdict.features)}."),
        )]
