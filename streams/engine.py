"""The TEE engine: every rule and detector over per-node state, with de-duplication (no Faust).

Contract::

    engine = TEEEngine(TEEConfig(...))
    engine.process(batch) -> list[FaultEvent]      # one node's batch, in the node's order
    engine.check_heartbeats(now) -> list[FaultEvent]   # call about once a second
    engine.forget(nodes)                           # the worker no longer owns these nodes

A fault id is emitted at most once per engine (the last ``dedup_capacity`` ids are remembered),
so a redelivered batch yields nothing new; in another process the same input yields the same
ids, for consumers to de-duplicate. The engine is not thread-safe: one worker, one engine.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Iterable, Mapping

from transom.contracts import FaultEvent, MetricBatch
from transom.log import get

from .config import TEEConfig
from .rules import GpuLostRule, HangRule, HeartbeatRule, NanLossRule, NodeState, Rule, XidRule

__all__ = ["TEEEngine"]

log = get("tee")


class TEEEngine:
    """Hard-fault rules and soft-fault detectors over each node's window."""

    def __init__(self, config: TEEConfig | None = None, *, clock: Callable[[], float] = time.time,
                 anomaly: bool = True) -> None:
        self.config = config or TEEConfig()
        self.clock = clock
        self.rules: list[Rule] = [XidRule(), GpuLostRule(), NanLossRule(), HangRule(self.config)]
        if anomaly:
            from .detectors import GpuAnomalyDetector
            self.rules.append(GpuAnomalyDetector(self.config))
        self.heartbeat = HeartbeatRule(self.config)
        self._nodes: dict[str, NodeState] = {}
        self._emitted: OrderedDict[str, None] = OrderedDict()
        self.counts = {"batches": 0, "faults": 0, "repeats": 0}

    @property
    def nodes(self) -> Mapping[str, NodeState]:
        return self._nodes

    def process(self, batch: MetricBatch, now: float | None = None) -> list[FaultEvent]:
        """Run every rule over ``batch``; return the faults not emitted before."""
        now = self.clock() if now is None else now
        state = self._nodes.get(batch.node)
        if state is None:
            state = self._nodes[batch.node] = NodeState(batch.node)
        state.last_batch_ts = max(state.last_batch_ts, batch.ts)
        state.last_received = now
        if batch.job:
            state.job = batch.job
        self.counts["batches"] += 1
        found: list[FaultEvent] = []
        for rule in self.rules:
            found.extend(rule.observe(state, batch, now))
        return self._new(found)

    def check_heartbeats(self, now: float | None = None) -> list[FaultEvent]:
        """Faults for nodes that went silent; drops nodes that are only replayed history."""
        now = self.clock() if now is None else now
        found, history = self.heartbeat.check(list(self._nodes.values()), now)
        if history:
            log.info("not watching %d node(s) whose newest metrics are older than %.0fs: %s",
                     len(history), self.config.heartbeat_horizon, ", ".join(sorted(history)[:10]))
            self.forget(history)
        return self._new(found)

    def forget(self, nodes: Iterable[str]) -> None:
        for node in nodes:
            self._nodes.pop(node, None)

    def _new(self, found: list[FaultEvent]) -> list[FaultEvent]:
        out = []
        for f in found:
            if f.fault_id in self._emitted:
                self.counts["repeats"] += 1
                continue
            self._emitted[f.fault_id] = None
            if len(self._emitted) > self.config.dedup_capacity:
                self._emitted.popitem(last=False)
            out.append(f)
        self.counts["faults"] += len(out)
        return out
