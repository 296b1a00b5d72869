"""The per-node temporal detector of the engine: :class:`~.scoring.TemporalScorer` on the live stream.

The same scorer, configuration and threshold rule that ``bench/tee_external.py`` grades on SMD and
ASD (``ScorerConfig()``: bagged kNN members over the errors of an autoregression of the node's columns
and over each row against its trailing levels, threshold by peaks over threshold on a held-out
validation split of the node's own history, then drift SPOT over the stream), fed one row per batch
of a node:

==========  ==========================================  ==========
column      what                                        from
==========  ==========================================  ==========
util        mean GPU utilisation                        GPU
temp        mean GPU temperature                        GPU
power       mean GPU power                              GPU
clock       mean SM clock                               GPU
nic_err     symbol + receive errors per second          NIC (sum)
nic_bw      mean receive rate of the up ports           NIC
==========  ==========================================  ==========

Rows of batches whose training step did not move (a pause, a hang) are left out of both history and
scoring (a slowdown needs a running job). Once a node has ``temporal_history`` rows the scorer is
fitted; from then on every ``temporal_every`` rows are scored together (the node keeps the rows before
them that the scorer's views read, ``ScorerConfig.context``: 3,000 by default, in a numpy ring of
about 150 KB a node) and passed, in order, to the scorer's thresholder (drift SPOT
started on the held-out scores, as the bench grades it: the threshold follows the level of the
node's scores that raised no alarm), and ``temporal_consecutive`` alarms in a row make one ANOMALY fault (class ``anomaly``), a WARNING to observe: this detector says that
a node left its own normal, not what is wrong, so it never asks for an eviction. The fault is
resolved after ``soft_clear`` blocks without an alarm (the scorer is not refitted). Opt in with
``soft_detectors=("peers", "temporal")``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from transom.contracts import DCGM, Action, FaultEvent, FaultKind, MetricBatch, Severity, Source, stable_id

from .config import TEEConfig
from .rules import NodeState, fault
from .scoring import ScorerConfig, TemporalScorer

__all__ = ["TemporalDetector", "COLUMNS"]

COLUMNS = ("util", "temp", "power", "clock", "nic_err", "nic_bw")


class _Ring:
    """The newest ``size`` rows of a node, in a fixed numpy buffer (a node keeps thousands of rows for
    the scorer's ``level_window``; a list of lists would cost a conversion at every scoring)."""

    def __init__(self, size: int, rows: np.ndarray) -> None:
        rows = rows[-size:]
        self.buf = np.zeros((size, rows.shape[1]))
        self.buf[:len(rows)] = rows
        self.n = len(rows)

    def append(self, row) -> None:
        self.buf[self.n % len(self.buf)] = row
        self.n += 1

    def rows(self) -> np.ndarray:
        """The rows kept, oldest first."""
        if self.n <= len(self.buf):
            return self.buf[:self.n]
        i = self.n % len(self.buf)
        return np.concatenate([self.buf[i:], self.buf[:i]])

    def last(self) -> np.ndarray:
        return self.buf[(self.n - 1) % len(self.buf)]


@dataclass
class _NodeTemporal:
    rows: list = field(default_factory=list)      # history until fitted
    ring: _Ring | None = None                     # then the trailing rows the scorer's views read
    ts: list = field(default_factory=list)        # times of the rows not scored yet
    scorer: TemporalScorer | None = None
    th: object = None                             # the scorer's stream thresholder (DSPOT)
    fresh: int = 0                                # rows not scored yet
    run: int = 0
    run_start: float = 0.0
    clean: int = 0
    open_fault: FaultEvent | None = None
    last_step: float | None = None


def row_of(batch: MetricBatch) -> list[float] | None:
    """The node's feature row of one batch (None without GPU values)."""
    g = [s.fields for s in batch.of(Source.GPU) if DCGM.GPU_UTIL in s.fields]
    if not g:
        return None
    n = len(g)
    nic = [s.fields for s in batch.of(Source.NIC) if s.fields.get("link_up", 1) == 1]
    bw = [f["port_rcv_bytes_per_s"] for f in nic if "port_rcv_bytes_per_s" in f]
    return [sum(f[DCGM.GPU_UTIL] for f in g) / n, sum(f.get(DCGM.GPU_TEMP, 0.0) for f in g) / n,
            sum(f.get(DCGM.POWER_USAGE, 0.0) for f in g) / n, sum(f.get(DCGM.SM_CLOCK, 0.0) for f in g) / n,
            sum(f.get("symbol_error_per_s", 0.0) + f.get("port_rcv_errors_per_s", 0.0) for f in nic),
            sum(bw) / len(bw) if bw else 0.0]


class TemporalDetector:
    name = "temporal"

    def __init__(self, config: TEEConfig, scorer: ScorerConfig | None = None) -> None:
        self.config = config
        self.scorer_config = scorer or ScorerConfig()
        #: rows kept before a block of new ones: what the scorer's views read before a row, and the
        #: warm-up of its smoothing
        self._warm = self.scorer_config.context + self.scorer_config.warmup

    def observe(self, state: NodeState, batch: MetricBatch, now: float) -> list[FaultEvent]:
        nt = state.detectors.get(self.name)
        if nt is None:
            nt = state.detectors[self.name] = _NodeTemporal()
        steps = [s.fields["step"] for s in batch.of(Source.TRAIN) if "step" in s.fields]
        if steps:
            moved = nt.last_step is None or steps[0] != nt.last_step
            nt.last_step = steps[0]
            if not moved:
                return []
        row = row_of(batch)
        if row is None:
            return []
        cfg = self.config
        if nt.scorer is None:
            nt.rows.append(row)
            if len(nt.rows) >= cfg.temporal_history:
                history = np.array(nt.rows)
                nt.scorer = TemporalScorer(self.scorer_config).fit(history)
                nt.th = nt.scorer.thresholder()
                nt.ring = _Ring(self._warm + cfg.temporal_every, history)
                nt.rows, nt.ts, nt.fresh = [], [], 0
            return []
        nt.ring.append(row)
        nt.ts.append(batch.ts)
        nt.fresh += 1
        if nt.fresh < cfg.temporal_every:
            return []
        scores = nt.scorer.score(nt.ring.rows(), last=nt.fresh)
        block_ts, nt.ts, nt.fresh = nt.ts, [], 0
        return self._advance(state, nt, scores, block_ts, now)

    def _advance(self, state: NodeState, nt: _NodeTemporal, scores, block_ts, now: float) -> list[FaultEvent]:
        out = []
        thr = nt.th.threshold
        alarms = nt.th.step(scores)
        for sc, ts, alarm in zip(scores, block_ts, alarms):
            if not alarm:
                nt.run = 0
                continue
            if nt.run == 0:
                nt.run_start = ts
            nt.run += 1
            if nt.run == self.config.temporal_consecutive and nt.open_fault is None:
                top = nt.scorer.contributions(nt.ring.last())
                order = np.argsort(-np.abs(top))[:3]
                f = fault(FaultKind.ANOMALY, Severity.WARNING, Action.OBSERVE,
                          fault_id=stable_id(state.node, "temporal", nt.run_start), node=state.node, job=state.job,
                          detector="scorer.temporal", observed_ts=ts, now=now, score=float(sc), threshold=float(thr),
                          evidence={"class": "anomaly", "since_ts": nt.run_start,
                                    "threshold_rule": self.scorer_config.threshold_rule,
                                    "top_columns": {COLUMNS[i]: round(float(top[i]), 2) for i in order
                                                    if i < len(COLUMNS)}},
                          summary=(f"{state.node} left its own normal: temporal score {sc:.2f} over its threshold "
                                   f"{thr:.2f} for {nt.run} samples (observe)."))
                nt.open_fault = f
                out.append(f)
        if nt.open_fault is not None:
            nt.clean = nt.clean + 1 if not alarms.any() else 0
            if nt.clean >= self.config.soft_clear:
                f, nt.open_fault, nt.clean = nt.open_fault, None, 0
                out.append(FaultEvent(**{**f.__dict__, "resolved": True, "detected_ts": now,
                                         "observed_ts": block_ts[-1], "summary": f"resolved: {f.summary}"}))
        return out
