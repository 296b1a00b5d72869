"""Hard-fault rules of the TEE: plain classes over one node's batches (no Faust here).

A rule sees each :class:`~transom.contracts.MetricBatch` of a node together with that node's
:class:`NodeState` and returns the :class:`~transom.contracts.FaultEvent` s it decides on::

    rule.observe(state, batch, now) -> list[FaultEvent]

``now`` is the wall-clock time of the decision (``detected_ts``); everything else a rule uses
comes from the batch, so fault ids are stable: the same input gives the same id in any process.
The heartbeat rule is driven by time instead (:meth:`HeartbeatRule.check`).

=============  ===============================  ========  =======  ===============================
rule           fires on                         severity  action   fault id from
=============  ===============================  ========  =======  ===============================
XidRule        GPU sample, XID_ERRORS > 0       table     table    node, gpu, code, sample ts
GpuLostRule    GPU sample, GPU_LOST == 1        critical  evict    node, gpu, sample ts (once/loss)
NanLossRule    train sample, loss_nonfinite==1  critical  restart  job, gen, node, rank, step
(hang)         see :mod:`.hangs` (a hang told from a pause)
HeartbeatRule  silent for heartbeat_timeout     critical  evict    node, last batch ts
EccRule        ECC_DBE_VOL_TOTAL rises (or >0)  critical  evict    node, gpu, "ecc_dbe", sample ts
RowRemapRule   ROW_REMAP_FAILURE == 1           critical  evict    node, gpu, "row_remap", sample ts
LinkRule       port down > link_down_hold_s     critical  evict    node, device, port, down ts
               or link_flap_count shorter downs warning   evict    node, device, port, first down ts
               within link_flap_window_s
=============  ===============================  ========  =======  ===============================

Every event carries its :class:`~.classes.FaultClass` in ``evidence["class"]``; XIDs take the class
of their code from :data:`XID_POLICY` (48/94/95: ecc_dbe, 64: row_remap_failure, others: xid), so
an XID 48 and the DBE counter that moves with it merge into one fault in the engine's cool-down.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol

from transom.contracts import (DCGM, Action, FaultEvent, FaultKind, MetricBatch, Sample, Severity, Source,
                               stable_id)

from .classes import FaultClass
from .config import TEEConfig

__all__ = ["NodeState", "Cadence", "Rule", "fault", "node_lost", "XID_POLICY", "XID_CLASS", "XidRule", "GpuLostRule",
           "NanLossRule", "HeartbeatRule", "EccRule", "RowRemapRule", "LinkRule"]


@dataclass
class NodeState:
    """Everything the TEE remembers about one node (one worker owns a node: metrics are keyed by it)."""

    node: str
    job: str | None = None
    last_batch_ts: float = 0.0         # newest batch ts (sample time)
    last_received: float = 0.0         # wall clock when the newest batch arrived here
    partition: int = 0                 # the metrics partition its batches are read from
    read_mark: float = 0.0             # the newest sample time read on that partition at its newest batch
    lost_reported_for: float | None = None   # last_batch_ts a NODE_LOST was emitted for
    lost_gpus: set[int] = field(default_factory=set)
    nan_ranks: set[tuple[str, str, int]] = field(default_factory=set)
    detectors: dict[str, Any] = field(default_factory=dict)   # per-node state of soft detectors
    ecc_dbe: dict[int, float] = field(default_factory=dict)   # gpu -> last DBE count seen
    remap_failed: set[int] = field(default_factory=set)
    hung_at: dict[tuple[str, str, int], float] = field(default_factory=dict)   # rank -> step reported hung
    links: dict[tuple[str, str], Any] = field(default_factory=dict)   # (device, port) -> _LinkState
    cadence: "Cadence" = field(default_factory=lambda: Cadence())   # the gaps between its batches, per seq
    declared_interval: float | None = None    # its agent's ``interval_s`` (self-metrics), where it says it
    #: the job whose ranks its newest batch with training samples showed alive (None: none): a silence of the
    #: node is then its job's worker's to judge (:class:`HeartbeatRule`)
    trains_in: str | None = None
    deferred_for: float | None = None         # last_batch_ts whose silence was handed to its job's worker
    #: ts of its agent's goodbye batch (the agent stopped on purpose: a restart, an upgrade); a silence after
    #: it (``bye_for == last_batch_ts``) is the agent's until ``heartbeat_bye_grace_s``
    bye_for: float | None = None

    @property
    def report_interval(self) -> float:
        """Seconds between the node's batches: its agent's ``interval_s`` where it says it, else
        :attr:`Cadence.interval` of its batches (per seq: a batch never delivered does not count)."""
        return self.declared_interval if self.declared_interval is not None else self.cadence.interval

    def beats(self) -> float:
        """The node's report interval in the 1 s the time limits are set for (1 at most once a second): the
        heartbeat timeout waits this many times as long."""
        return max(1.0, self.report_interval)

    def note_cadence(self, batch: MetricBatch) -> None:
        """Learn the node's report interval from ``batch`` (its agent's self-metrics, or its gap to the last)."""
        for s in batch.of(Source.AGENT):      # (grouped once per batch: the rules ask for their sources too)
            if (v := s.fields.get("interval_s")) is not None and v > 0:
                self.declared_interval = float(v)
            if s.fields.get("stopping") == 1:
                self.bye_for = batch.ts
        self.cadence.note(batch.ts, batch.seq)


@dataclass
class Cadence:
    """How often a node reports, from the sample times of its batches (or of its rank reports) in its order:
    :attr:`interval` is the median of the last 9 gaps (the longest while fewer than three are known) to 0.5 s (a
    batch's jitter aside); 1 s until its second batch. With seqs, a gap is divided by the seqs it spans (a batch
    never delivered does not count), and a lower seq (its agent started afresh) makes no gap; an older batch
    delivered again makes none either."""

    last_ts: float | None = None
    last_seq: int | None = None
    gaps: deque = field(default_factory=lambda: deque(maxlen=9))
    interval: float = 1.0

    def note(self, ts: float, seq: int | None = None) -> None:
        if self.last_ts is not None and ts <= self.last_ts:
            return
        if self.last_ts is not None and (seq is None or seq > self.last_seq):
            self.gaps.append((ts - self.last_ts) / (1 if seq is None else seq - self.last_seq))
            g = sorted(self.gaps)
            self.interval = round(2.0 * g[len(g) // 2 if len(g) >= 3 else -1]) / 2.0
        self.last_ts, self.last_seq = ts, seq


class Rule(Protocol):
    name: str

    def observe(self, state: NodeState, batch: MetricBatch, now: float) -> list[FaultEvent]: ...


def fault(kind: FaultKind, severity: Severity, action: Action, *, fault_id: str, node: str,
          job: str | None, detector: str, observed_ts: float, now: float, summary: str,
          evidence: Mapping[str, Any], rank: int | None = None, score: float | None = None,
          threshold: float | None = None) -> FaultEvent:
    return FaultEvent(fault_id=fault_id, job=job, node=node, kind=kind, severity=severity, detector=detector,
                      action=action, observed_ts=observed_ts, detected_ts=now, rank=rank, score=score,
                      threshold=threshold, evidence={"class": _CLASS_OF_KIND.get(kind.value, kind.value),
                                                     **dict(evidence)}, summary=summary)


_CLASS_OF_KIND = {"xid": "xid", "gpu_lost": "gpu_lost", "node_lost": "node_lost", "hang": "hang",
                  "nan_loss": "nan_loss"}


_XID, _LOST, _DBE = DCGM.XID_ERRORS, DCGM.GPU_LOST, DCGM.ECC_DBE_VOL_TOTAL
#: GPU fields that record an event rather than a reading: a sample of only these does not show the GPU answering
_EVENT_FIELDS = frozenset({_XID, _LOST, "transom_nvml_error"})


def _ts(sample: Sample, batch: MetricBatch) -> float:
    return float(sample.ts) if sample.ts is not None else batch.ts


def _train_key(sample: Sample, batch: MetricBatch) -> tuple[str, str, int]:
    job = sample.tags.get("job") or batch.job or ""
    return job, sample.tags.get("generation", "0"), sample.index if sample.index is not None else -1


# --------------------------------------------------------------------------- GPU rules

#: XID code -> (severity, action, meaning), after NVIDIA's XID catalogue. Codes that are mostly
#: the application's own fault (13, 31, 43) are only observed: the rank's exit is what matters.
XID_POLICY: Mapping[int, tuple[Severity, Action, str]] = {
    13: (Severity.WARNING, Action.OBSERVE, "graphics engine exception (often an application error)"),
    31: (Severity.WARNING, Action.OBSERVE, "GPU memory page fault (often an application error)"),
    43: (Severity.WARNING, Action.OBSERVE, "GPU stopped processing"),
    48: (Severity.CRITICAL, Action.EVICT, "double-bit ECC error"),
    63: (Severity.WARNING, Action.OBSERVE, "ECC page retirement or row remap recorded"),
    64: (Severity.CRITICAL, Action.EVICT, "ECC page retirement or row remap failed"),
    45: (Severity.WARNING, Action.OBSERVE, "preemptive cleanup (follows another error)"),
    61: (Severity.CRITICAL, Action.RESTART, "internal micro-controller breakpoint"),
    62: (Severity.CRITICAL, Action.RESTART, "internal micro-controller halt"),
    74: (Severity.CRITICAL, Action.EVICT, "NVLink error"),
    79: (Severity.CRITICAL, Action.EVICT, "GPU has fallen off the bus"),
    92: (Severity.WARNING, Action.OBSERVE, "high single-bit ECC error rate"),
    94: (Severity.CRITICAL, Action.RESTART, "contained ECC error"),
    95: (Severity.CRITICAL, Action.EVICT, "uncontained ECC error"),
    119: (Severity.CRITICAL, Action.EVICT, "GSP RPC timeout"),
    120: (Severity.CRITICAL, Action.EVICT, "GSP error"),
}
_XID_DEFAULT = (Severity.WARNING, Action.OBSERVE, "XID error")
#: XID codes that belong to a finer fault class (merged with that class's counter rule).
XID_CLASS: Mapping[int, FaultClass] = {48: FaultClass.ECC_DBE, 94: FaultClass.ECC_DBE, 95: FaultClass.ECC_DBE,
                                       64: FaultClass.ROW_REMAP_FAILURE}


class XidRule:
    """A GPU sample with ``DCGM_FI_DEV_XID_ERRORS > 0`` is an XID event (value = the XID code)."""

    name = "xid"

    def observe(self, state: NodeState, batch: MetricBatch, now: float) -> list[FaultEvent]:
        out = []
        for s in batch.of(Source.GPU):
            if _XID not in s.fields:      # the common case: one lookup
                continue
            value = s.fields[_XID]
            if value <= 0:
                continue
            code, ts = int(value), _ts(s, batch)
            severity, action, meaning = XID_POLICY.get(code, _XID_DEFAULT)
            out.append(fault(
                FaultKind.XID, severity, action, fault_id=stable_id(batch.node, "xid", s.index, code, ts),
                node=batch.node, job=batch.job, detector="rule.xid", observed_ts=ts, now=now,
                score=float(code), evidence={"class": XID_CLASS.get(code, FaultClass.XID).value,
                                             "gpu": s.index, "xid": code, "meaning": meaning,
                                             "field": DCGM.XID_ERRORS},
                summary=f"GPU {s.index} of {batch.node} reported XID {code} ({meaning}).",
            ))
        return out


class GpuLostRule:
    """``transom_gpu_lost == 1``: the GPU no longer answers; reported once per loss. A GPU that answers again
    (a sample of its metrics without ``transom_gpu_lost``: reset, or its node back) and is lost later is a
    new fault."""

    name = "gpu_lost"

    def observe(self, state: NodeState, batch: MetricBatch, now: float) -> list[FaultEvent]:
        out = []
        for s in batch.of(Source.GPU):
            if s.fields.get(_LOST) != 1:
                if s.index in state.lost_gpus and any(k not in _EVENT_FIELDS for k in s.fields):
                    state.lost_gpus.discard(s.index)     # it answers again: the next loss is a new fault
                continue
            if s.index in state.lost_gpus:
                continue
            state.lost_gpus.add(s.index)
            ts = _ts(s, batch)
            out.append(fault(
                FaultKind.GPU_LOST, Severity.CRITICAL, Action.EVICT,
                fault_id=stable_id(batch.node, "gpu_lost", s.index, ts), node=batch.node, job=batch.job,
                detector="rule.gpu_lost", observed_ts=ts, now=now,
                evidence={"gpu": s.index, "field": DCGM.GPU_LOST, "value": 1},
                summary=f"GPU {s.index} of {batch.node} is lost (the driver no longer reaches it).",
            ))
        return out


# --------------------------------------------------------------------------- training rules

class NanLossRule:
    """``loss_nonfinite == 1`` on a train sample: the loss diverged. Once per occurrence: a rank that
    reports a finite loss again and later a NaN again (a second divergence) is a new fault."""

    name = "nan_loss"

    def observe(self, state: NodeState, batch: MetricBatch, now: float) -> list[FaultEvent]:
        out = []
        for s in batch.of(Source.TRAIN):
            key = _train_key(s, batch)
            if s.fields.get("loss_nonfinite") != 1:
                if "loss" in s.fields:
                    state.nan_ranks.discard(key)      # finite again: the next NaN is a new fault
                continue
            if key in state.nan_ranks:
                continue
            state.nan_ranks.add(key)
            job, generation, rank = key
            step = s.fields.get("step")
            ts = _ts(s, batch)
            out.append(fault(
                FaultKind.NAN_LOSS, Severity.CRITICAL, Action.RESTART,
                fault_id=stable_id(job, generation, "nan_loss", batch.node, rank, step if step is not None else ts),
                node=batch.node, job=job or batch.job, rank=rank, detector="rule.nan_loss", observed_ts=ts,
                now=now, evidence={"step": step, "generation": generation, "field": "loss_nonfinite", "value": 1},
                summary=f"Rank {rank} of job {job} on {batch.node} reported a NaN/Inf loss at step {step}.",
            ))
        return out


# --------------------------------------------------------------------------- heartbeat

class HeartbeatRule:
    """A node from which nothing has arrived for ``heartbeat_timeout`` (this worker's clock) is lost; for a node
    whose agent reports every N > 1 seconds (:meth:`NodeState.beats`), N times as long: as many missed reports.

    Silence is measured on the TEE's own clock only (when the node's newest batch arrived here),
    never by comparing the node's sample time with this clock: node clocks may be skewed by
    seconds, and a node whose clock runs ahead would otherwise be found lost late, one running
    behind early. Sample time only tells history apart: when the TEE replays old metrics (after a
    restart, or a new consumer group reading from the beginning), a node whose newest batch is
    older than ``heartbeat_horizon`` is history, dropped without a fault (a replay in progress keeps
    arriving, so it is never silent). A node is reported once per newest batch; if it comes back
    and goes silent again, it is reported again.

    A node whose ranks train in a job (:attr:`NodeState.trains_in`) is not decided here where ``defer`` is
    given: it gets ``defer(state, silent)`` at every check while it is silent past the timeout, up to
    ``heartbeat_horizon`` (then it is kept, as a node reported), and its job's worker decides
    (:meth:`.hangs.HangDetector.silent`): lost where its job stopped with it, only its agent silent where its
    job steps on (a synchronous job cannot step without the node's ranks).

    A node whose newest batch is its agent's goodbye (``stopping``: the agent stopped on purpose, a restart or
    an upgrade) and that trains in no job is lost after ``heartbeat_bye_grace_s`` instead of the timeout.
    """

    name = "heartbeat"

    def __init__(self, config: TEEConfig) -> None:
        self.config = config

    def check(self, states: Iterable[NodeState], now: float,
              defer: Callable[[NodeState, float], None] | None = None) -> tuple[list[FaultEvent], list[str]]:
        """Return the faults to emit and the nodes to forget (history)."""
        out, forget = [], []
        for st in states:
            timeout = self.config.heartbeat_timeout * st.beats()   # an agent that reports every 5 s: 30 s
            bye = st.bye_for is not None and st.bye_for == st.last_batch_ts
            if bye and (defer is None or st.trains_in is None):
                timeout = max(timeout, self.config.heartbeat_bye_grace_s)
            silent, age = now - st.last_received, now - st.last_batch_ts
            if silent <= timeout or st.lost_reported_for == st.last_batch_ts:
                continue
            if age > self.config.heartbeat_horizon + timeout:
                if st.deferred_for == st.last_batch_ts:      # its job's worker has judged it: kept, as one reported
                    st.lost_reported_for = st.last_batch_ts
                else:
                    forget.append(st.node)
                continue
            if defer is not None and st.trains_in is not None:
                st.deferred_for = st.last_batch_ts
                defer(st, silent)
                continue
            st.lost_reported_for = st.last_batch_ts
            out.append(node_lost(st.node, st.job, st.last_batch_ts, silent, timeout, now,
                                 {"batch_age_s": round(age, 3), "report_interval_s": st.report_interval,
                                  **({"cause": "its agent said it stops and did not come back"} if bye else {})},
                                 summary="; its agent said it stops and did not come back" if bye else ""))
        return out, forget


def node_lost(node: str, job: str | None, last_ts: float, silent: float, timeout: float, now: float,
              evidence: Mapping[str, Any], summary: str = "") -> FaultEvent:
    """The heartbeat's NODE_LOST event (evict) for ``node``, silent ``silent`` s since its batch of ``last_ts``
    (its fault id), decided at ``now`` (the heartbeat rule's, or the job's worker's for a node of a job)."""
    return fault(
        FaultKind.NODE_LOST, Severity.CRITICAL, Action.EVICT,
        fault_id=stable_id(node, "node_lost", last_ts), node=node, job=job,
        detector="rule.heartbeat", observed_ts=last_ts, now=now, score=silent, threshold=timeout,
        evidence={"last_batch_ts": last_ts, "silent_s": round(silent, 3), "heartbeat_timeout_s": timeout,
                  **evidence},
        summary=f"Node {node} has sent no metrics for {silent:.1f}s (timeout {timeout:g}s){summary}.",
    )


# --------------------------------------------------------------------------- GPU memory rules

_ROW_REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"


class EccRule:
    """Double-bit ECC: ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`` above 0 when first seen, or rising."""

    name = "ecc_dbe"

    def observe(self, state: NodeState, batch: MetricBatch, now: float) -> list[FaultEvent]:
        out = []
        seen = state.ecc_dbe
        for s in batch.of(Source.GPU):
            if _DBE not in s.fields or s.index is None:
                continue
            value = s.fields[_DBE]
            last = seen.get(s.index, 0.0)
            if value <= last:
                if value != last:
                    seen[s.index] = float(value)
                continue
            seen[s.index] = float(value)
            ts = _ts(s, batch)
            out.append(fault(
                FaultKind.XID, Severity.CRITICAL, Action.EVICT,
                fault_id=stable_id(batch.node, "ecc_dbe", s.index, ts), node=batch.node, job=batch.job,
                detector="rule.ecc_dbe", observed_ts=ts, now=now, score=float(value), threshold=last,
                evidence={"class": FaultClass.ECC_DBE.value, "gpu": s.index, "field": DCGM.ECC_DBE_VOL_TOTAL,
                          "value": value, "previous": last, "meaning": "uncorrectable (double-bit) ECC error"},
                summary=f"GPU {s.index} of {batch.node} counted {value - last:g} double-bit ECC error(s).",
            ))
        return out


class RowRemapRule:
    """``DCGM_FI_DEV_ROW_REMAP_FAILURE == 1``: the GPU could not remap a failing memory row."""

    name = "row_remap"

    def observe(self, state: NodeState, batch: MetricBatch, now: float) -> list[FaultEvent]:
        out = []
        failed = state.remap_failed
        for s in batch.of(Source.GPU):
            if _ROW_REMAP_FAILURE not in s.fields or s.index is None:
                continue
            if s.fields[_ROW_REMAP_FAILURE] != 1:
                if failed:
                    failed.discard(s.index)
                continue
            if s.index in state.remap_failed:
                continue
            state.remap_failed.add(s.index)
            ts = _ts(s, batch)
            out.append(fault(
                FaultKind.XID, Severity.CRITICAL, Action.EVICT,
                fault_id=stable_id(batch.node, "row_remap", s.index, ts), node=batch.node, job=batch.job,
                detector="rule.row_remap", observed_ts=ts, now=now,
                evidence={"class": FaultClass.ROW_REMAP_FAILURE.value, "gpu": s.index, "field": _ROW_REMAP_FAILURE,
                          "value": 1, "meaning": "row remapping failed: the GPU needs a reset and service"},
                summary=f"GPU {s.index} of {batch.node} failed to remap a memory row.",
            ))
        return out


# --------------------------------------------------------------------------- links

@dataclass
class _LinkState:
    up: bool | None = None          # None until the first sample: a port first seen down is not watched
    down_since: float | None = None
    reported_down: bool = False
    downs: deque = field(default_factory=lambda: deque(maxlen=64))   # down ts of each down shorter than the hold
    flapping: bool = False          # a flap episode reported and not over (no down for a whole window)
    counted: float | None = None    # the port's own count of its downs at the last sample (link_downed, carrier)


class LinkRule:
    """NIC/IB port state (``link_up``): down for longer than ``link_down_hold_s`` is LINK_DOWN (and a
    resolution event when it comes back); ``link_flap_count`` (1) downs shorter than that within
    ``link_flap_window_s`` is LINK_FLAP, reported as the port comes back up (once per episode: a port that
    has no down for a whole window ends it, and its next burst of downs is a new fault). A down between
    two samples that both read up counts too: the port's own count of its downs rose (``link_downed`` of
    an IB port, ``carrier_changes`` of an interface, two per down). Only ports seen up are watched: a port
    down since the TEE first saw it (no cable, unused) and one administratively down
    (``admin_up == 0``) raise nothing."""

    name = "link"

    def __init__(self, config: TEEConfig) -> None:
        self.config = config

    def observe(self, state: NodeState, batch: MetricBatch, now: float) -> list[FaultEvent]:
        out = []
        cfg = self.config
        for s in batch.of(Source.NIC):
            up = s.fields.get("link_up")
            if up is None or s.fields.get("admin_up") == 0:
                continue          # an interface the operator left down is not a fault
            key = (s.tags.get("device", "?"), s.tags.get("port", str(s.index)))
            st = state.links.get(key)
            if st is None:
                st = state.links[key] = _LinkState()
            if st.up is None and up != 1:
                continue          # never seen up (an unused port): watched from its first up
            ts = _ts(s, batch)
            where = f"{key[0]} port {key[1]}"
            base = {"device": key[0], "port": key[1], "field": "link_up"}
            # the port's own count of its downs: an IB port's link_downed, an interface's carrier changes (a
            # down and an up each); it rising between two samples that both read up is a down shorter than
            # the sampling interval, which the state alone never shows
            total, counter = s.fields.get("link_downed"), "link_downed"
            if total is None and (changes := s.fields.get("carrier_changes")) is not None:
                total, counter = changes // 2, "carrier_changes"
            missed = 0
            if total is not None:
                if up == 1 and st.up and st.counted is not None and total > st.counted:
                    missed = int(total - st.counted)
                st.counted = total
            if missed:
                out += self._short_down(st, batch, key, now, ts, ts, {**base, "field": counter,
                                                                       "downs_between_samples": missed}, where, missed)
                continue
            if up == 1:
                if not st.up and st.reported_down:
                    out.append(dataclasses.replace(
                        self._last_down(st, batch, key, now), resolved=True, observed_ts=ts, detected_ts=now,
                        summary=f"resolved: {where} of {batch.node} is up again after {ts - st.down_since:.0f}s."))
                elif st.up is False and st.down_since is not None:
                    out += self._short_down(st, batch, key, now, ts, st.down_since, base, where)
                st.up, st.down_since, st.reported_down = True, None, False
                continue
            if st.up:
                st.up, st.down_since = False, ts
            if not st.reported_down and st.down_since is not None and ts - st.down_since >= cfg.link_down_hold_s:
                st.reported_down = True
                out.append(self._last_down(st, batch, key, now, ts))
        return out

    def _short_down(self, st: _LinkState, batch: MetricBatch, key, now: float, ts: float, down: float, base: dict,
                    where: str, n: int = 1) -> list[FaultEvent]:
        """The port is up again at ``ts`` after ``n`` downs (the last from ``down``) shorter than the hold (a link
        down is reported at the hold): ``link_flap_count`` of them within ``link_flap_window_s`` is a flap,
        reported as it comes back up."""
        cfg = self.config
        last = st.downs[-1] if st.downs else None
        st.downs.extend([down] * n)
        recent = [d for d in st.downs if d > ts - cfg.link_flap_window_s]
        if st.flapping and last is not None and last <= down - cfg.link_flap_window_s:
            st.flapping = False        # a whole window without a down ended the last episode
        if len(recent) < cfg.link_flap_count or st.flapping:
            return []
        st.flapping = True
        times = "once" if len(recent) == 1 else f"{len(recent)} times in {cfg.link_flap_window_s:g}s"
        return [fault(
            FaultKind.NODE_LOST, Severity.WARNING, Action.EVICT,
            fault_id=stable_id(batch.node, "link_flap", *key, recent[0]), node=batch.node,
            job=batch.job, detector="rule.link", observed_ts=ts, now=now,
            score=float(len(recent)), threshold=float(cfg.link_flap_count),
            evidence={"class": FaultClass.LINK_FLAP.value, **base, "downs": len(recent),
                      "window_s": cfg.link_flap_window_s, "first_down_ts": recent[0], "down_s": round(ts - down, 3)},
            summary=(f"{where} of {batch.node} went down and came back {times}, each time for less than "
                     f"{cfg.link_down_hold_s:g}s (flapping)."),
        )]

    def _last_down(self, st: _LinkState, batch: MetricBatch, key, now: float, ts: float | None = None) -> FaultEvent:
        where = f"{key[0]} port {key[1]}"
        ts = st.down_since if ts is None else ts
        return fault(
            FaultKind.NODE_LOST, Severity.CRITICAL, Action.EVICT,
            fault_id=stable_id(batch.node, "link_down", *key, st.down_since), node=batch.node, job=batch.job,
            detector="rule.link", observed_ts=ts, now=now, score=round(ts - st.down_since, 3),
            threshold=self.config.link_down_hold_s,
            evidence={"class": FaultClass.LINK_DOWN.value, "device": key[0], "port": key[1], "field": "link_up",
                      "down_since": st.down_since, "hold_s": self.config.link_down_hold_s},
            summary=f"{where} of {batch.node} has been down since {st.down_since:.0f} (link down).",
        )
