"""A labelled fault corpus: simulated GPU nodes at 1 Hz with every fault class injected at known times.

Contract::

    spec = CorpusSpec(nodes=64, hours=2.0, seed=7)
    corpus = Corpus(spec)
    corpus.injections            # list[Injection]: node, class, start, end, severity, detail
    for batch in corpus.batches():   # MetricBatch in time order (node by node within a second)
        ...

The same spec gives the same batches and labels in any process (everything is drawn from ``seed``).
Nodes form synchronous data-parallel jobs of ``job_size`` nodes, ``gpus`` GPUs each (8), each job
stepping at a step time drawn from ``step_s`` (0.6-1.4 s); values move like a
busy H100 node (as :mod:`transom.agents.simulated`, same DCGM field names), with the ordinary life
of a real job (``ordinary``, :attr:`Corpus.ordinary` lists it), which a detector must not take for
a fault:

- job-wide synchronous checkpoints every ``checkpoint_every_s`` (15 s, no step progress, GPUs idle)
  and other job-wide pauses of 10-120 s (evaluation without a phase marker, a data reload);
- evaluation phases (60-300 s: slower steps, utilisation about 65 %; half declare ``phase=eval``);
- slow first steps: 20-90 s without a step at the start and after a restore, then slower steps;
- one-node data-loader hiccups (1-3 s: that node idles, the job stands still with it);
- single-bit ECC ticks (``ECC_SBE_VOL_TOTAL`` rises by one now and then).

Faults act on the whole job where a real one would: a hang freezes every rank's step (the hung
node's GPUs idle, or only the stuck rank's GPU while its node's others spin, ``hang_gpus``; the
waiting ranks' spin at 100 % at low power, and its rank's heartbeat stops); a lost node sends
nothing and its job stops with it (the other ranks spin, waiting for it, until it is back);
a straggler, power cap or hot node slows the whole job (its peers' utilisation falls as they wait).
Half of the jobs come from agents that report ``heartbeat_age_s``, half from ones that do not.

Telemetry as a real cluster delivers it (all off by default; ``bench/tee_quality.py --clock-skew-s
--jitter-s --late-s --lost-batches``): each node's clock off the corpus's by ``clock_skew_s`` (a normal
draw per node), each batch's time off its node's tick by up to ``jitter_s``, a share ``lost_batches`` of
the batches never delivered (an agent that missed a beat; not one that carries an XID, which the agent
sends at once in a batch of its own that its spool never drops), and each batch delivered after an exponential
delay of mean ``late_s`` (a node's batches keep their order: :meth:`Corpus.deliveries`).
:meth:`Corpus.true_time` takes a node's sample time back to the corpus clock, where the labels are.
``util_noise`` (``--util-noise``; 0 by default) scatters every busy GPU's utilisation sample, the waiting
ranks' spin at 100 % too, by a normal draw of that spread (points, clipped to 0-100 %).
``interval_s`` (``--interval-s``; 1 by default): each node's agent reports every that many seconds, at a
phase of its own, what its node shows at that second (a link down between two reports shows in the port's
own count of its downs, ``link_downed``, as on a real IB port); an XID goes out at once, in a batch of its
own; the agents say their interval in their self-metrics (``interval_s``, as the real agent does; agents of
1 s leave those out). ``agent_restarts`` (``--agent-restarts``, per node-hour; 0 by default): a node's agent
silent for 7-30 s (restarted, upgraded, cut off from Kafka) while its job trains on (an ``Ordinary`` of kind
``agent_restart``; drawn after the faults, clear of them, so the other draws stay as they were).
``agent_goodbyes`` (``--agent-goodbyes``, a share of those restarts; 0 by default): the agent stops on
purpose (SIGTERM: systemd's restart, an upgrade) and its last batch before the silence says so, as the real
agent's goodbye does (``agent_stopping`` on its ranks' samples; ``Ordinary.goodbye``).
``rank0_saves`` (``--rank0-saves``, per job-hour; 0 by default): rank 0 saves a checkpoint alone behind a
barrier, undeclared (DDP's ``if rank == 0: torch.save(...)``), for 15-120 s: the job's steps stop, rank 0's
GPUs idle (or only its own GPU, its node's others spinning with the waiting ranks, by the save's start
second) while every other GPU spins in the barrier, and rank 0's process writes 0.3-2 GB/s (a second
without writes now and then, between two files). With the option on, every rank's sample carries
``write_bytes_per_s`` as the agent measures it (a log's trickle outside a save). Drawn after the agent
restarts, clear of the faults of the job's nodes, of its job-wide ordinary events, its periodic checkpoints and
its agents' restarts.

The fault mix follows the real GPU-cluster trace in ``shared/data/infinitehbd_faults``
(:func:`trace_mix`; the mix derived from it ships as ``fault_mix.json``, so no copy of the trace is
needed at run time): each trace description maps onto a :class:`FaultClass`; every class gets at
least ``min_per_class`` injections. The real rate (about 2e-4 faults per node-hour) is far too low
to measure anything, so faults are injected at ``faults_per_node_hour``; their durations are the
trace's repair times scaled by ``seconds_per_trace_day`` and clamped per class. Each injection has
a severity level 1..3 (see :data:`SEVERITIES`); nothing else happens on its node from ``gap_s``
before it starts until ``gap_s`` after it ends, and faults that act on the whole job (a hang, a
straggler, a power cap, a hot node, a node lost) keep that far apart within a job (one would hide the
other).

Command: ``python -m transom.streams.corpus --help`` writes a corpus as JSON lines.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import heapq
import json
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from itertools import groupby
from typing import Iterator, Mapping

import numpy as np
import orjson

from transom.contracts import DCGM, SCHEMA_VERSION, MetricBatch

from .classes import FaultClass

__all__ = ["CorpusSpec", "Injection", "Ordinary", "Corpus", "trace_mix", "SEVERITIES", "NIC_FIELDS", "REASON_SW_POWER",
           "REASON_THERMAL", "main"]

CLOCKS_EVENT_REASONS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
ROW_REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
#: NVML clock event reason bits (nvmlClocksEventReasonSwPowerCap, HW + SW thermal slowdown).
REASON_SW_POWER = 0x4
REASON_THERMAL = 0x20 | 0x40
#: NIC fields of an InfiniBand port sample, as the agent's NIC collector names them.
NIC_FIELDS = ("link_up", "state", "phys_state", "symbol_error_per_s", "port_rcv_errors_per_s",
              "port_rcv_bytes_per_s", "link_downed")

#: What each class looks like at severity 1, 2, 3.
SEVERITIES: Mapping[FaultClass, tuple] = {
    FaultClass.XID: (13, 43, 74),                         # XID code raised (no finer class)
    FaultClass.ECC_DBE: (1, 2, 8),                        # DBE errors counted
    FaultClass.ROW_REMAP_FAILURE: (1, 1, 1),
    FaultClass.GPU_LOST: (1, 1, 1),
    FaultClass.LINK_DOWN: (1, 1, 1),
    FaultClass.LINK_FLAP: (3, 5, 10),                     # down transitions
    FaultClass.NAN_LOSS: (1, 1, 1),
    FaultClass.NODE_LOST: (1, 1, 1),
    FaultClass.HANG: (1, 1, 1),
    FaultClass.THERMAL: (8.0, 14.0, 22.0),                # degrees C hotter (clock down 1/2 % per degree)
    FaultClass.POWER_CAP: (0.85, 0.75, 0.6),              # share of the usual power, clocks follow
    FaultClass.STRAGGLER: (0.9, 0.8, 0.65),               # share of the usual SM clock and power
    FaultClass.LINK_DEGRADED: (3.0, 15.0, 60.0),          # symbol errors per second, bandwidth down
}

#: Trace description -> class (descriptions not named here are not GPU-node faults we model).
_TRACE_CLASS = {
    "GPU DBE(Double Bit ECC) > Threshold": FaultClass.ECC_DBE, "GPU xid Error": FaultClass.XID,
    "GPU device unknow error": FaultClass.XID, "GPU Lost": FaultClass.GPU_LOST,
    "GPU device not found": FaultClass.GPU_LOST, "nvidia-smi Timeout": FaultClass.GPU_LOST,
    "GPU Temperature High": FaultClass.THERMAL, "GPU PCI link width low": FaultClass.STRAGGLER,
    "GPU P2P Bandwidth Low": FaultClass.STRAGGLER, "Link Down": FaultClass.LINK_DOWN,
    "NIC Lost": FaultClass.LINK_DOWN, "NIC Link Speed low": FaultClass.LINK_DEGRADED,
    "NIC PCI link Width low": FaultClass.LINK_DEGRADED, "Rnic Gid Error": FaultClass.LINK_FLAP,
    "Silent Data Corruption": FaultClass.NAN_LOSS, "GPU SBE(Single Bit ECC) > Threshold": FaultClass.ROW_REMAP_FAILURE,
}
_TRACE_CLASS_BY_CLASS = {"Fan": FaultClass.THERMAL, "Power Supply": FaultClass.POWER_CAP,
                         "Training Task Troubleshooting": FaultClass.HANG, "Unknown Error": FaultClass.NODE_LOST}
#: Duration limits (s) per class after scaling the trace's repair times.
_DURATION = {c: (60.0, 600.0) for c in FaultClass}
_DURATION.update({FaultClass.LINK_DOWN: (20.0, 300.0), FaultClass.NODE_LOST: (30.0, 300.0),
                  FaultClass.HANG: (60.0, 300.0), FaultClass.LINK_FLAP: (60.0, 180.0)})

#: The fault mix derived from the trace, shipped with the package (written by :func:`write_mix`).
PACKAGED_MIX = os.path.join(os.path.dirname(__file__), "fault_mix.json")


def trace_mix(path: str | None = None) -> tuple[dict[FaultClass, float], dict[FaultClass, list[float]], dict]:
    """Class shares, repair times (days) per class and summary figures from the fault trace.

    ``path`` (or env TRANSOM_FAULT_TRACE): the trace itself (shared/data/infinitehbd_faults/
    fault_trace.json); without either, the mix derived from it that ships as ``fault_mix.json``.
    """
    path = path or os.environ.get("TRANSOM_FAULT_TRACE") or None
    if path is None:
        with open(PACKAGED_MIX) as fh:
            doc = json.load(fh)
        return ({FaultClass(k): v for k, v in doc["shares"].items()},
                {FaultClass(k): v for k, v in doc["durations_days"].items()}, doc["summary"])
    with open(path) as fh:
        events = json.load(fh)
    open_: dict[tuple[str, str], float] = {}
    counts: Counter = Counter()
    durations: dict[FaultClass, list[float]] = {c: [] for c in FaultClass}
    nodes, last = set(), 0.0
    for ev in sorted(events, key=lambda e: e["event_time"]):
        ft = ev["fault_type"]
        cls = _TRACE_CLASS.get(ft.get("Desc")) or _TRACE_CLASS_BY_CLASS.get(ft.get("Class"))
        nodes.add(ev["node_id"])
        last = max(last, ev["event_time"])
        if cls is None:
            continue
        key = (ev["node_id"], ft.get("Desc"))
        if ev["event_type"] == "fault_start":
            counts[cls] += 1
            open_[key] = ev["event_time"]
        elif key in open_:
            durations[cls].append(ev["event_time"] - open_.pop(key))
    total = sum(counts.values())
    shares = {c: counts[c] / total for c in FaultClass}
    summary = {"trace_faults_mapped": total, "trace_nodes": len(nodes), "trace_days": round(last, 1),
               "trace_rate_per_node_hour": round(total / (400 * max(last, 1.0) * 24), 6)}
    return shares, durations, summary


def write_mix(trace: str, out: str = PACKAGED_MIX) -> None:
    """Write the mix of ``trace`` as the packaged ``fault_mix.json`` (run once when the trace changes)."""
    shares, durations, summary = trace_mix(trace)
    doc = {"source": "InfiniteHBD fault trace (github.com/stepfun-ai/InfiniteHBD-Trace, Apache-2.0), "
                     "derived by transom.streams.corpus.write_mix",
           "shares": {c.value: v for c, v in shares.items()},
           "durations_days": {c.value: v for c, v in durations.items()}, "summary": summary}
    with open(out, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")


@dataclass(frozen=True)
class CorpusSpec:
    nodes: int = 32
    hours: float = 1.0
    seed: int = 0
    gpus: int = 8
    job_size: int = 8
    faults_per_node_hour: float = 0.6
    min_per_class: int = 4
    gap_s: float = 120.0
    warmup_s: float = 300.0            # no faults in the first minutes (detectors learn the baseline)
    seconds_per_trace_day: float = 240.0
    checkpoint_every_s: float = 900.0  # job-wide pauses: every node of a job idles together
    trace: str | None = None
    ordinary: bool = True              # ordinary life (pauses, evals, slow starts, hiccups, SBE ticks)
    step_s: tuple[float, float] = (0.6, 1.4)   # each job's step time is drawn uniformly from this range
    hang_gpus: str = "mix"             # a hang idles the hung node's GPUs ("node"), only the stuck rank's GPU ("one",
                                       # its node's other GPUs spin with the waiting ranks), or either ("mix")
    clock_skew_s: float = 0.0          # each node's clock is off by a normal draw of this spread (seconds)
    jitter_s: float = 0.0              # each batch's sample time is off its node's tick by up to this (uniform)
    late_s: float = 0.0                # mean delivery delay of a batch (exponential; a node's batches keep order)
    lost_batches: float = 0.0          # share of batches never delivered
    util_noise: float = 0.0            # more noise on each busy GPU's utilisation sample, spins too (points, normal)
    interval_s: int = 1                # each node's agent reports every this many seconds (its own phase); an XID at once
    agent_restarts: float = 0.0        # per node-hour: its agent silent for 7-30 s while its job trains on (a restart)
    agent_goodbyes: float = 0.0        # share of those whose agent says it stops first (SIGTERM: a restart, an upgrade)
    rank0_saves: float = 0.0           # per job-hour: rank 0 saves alone behind a barrier for 15-120 s, undeclared


@dataclass(frozen=True)
class Injection:
    node: str
    cls: FaultClass
    start: float
    end: float
    severity: int
    gpu: int = 0
    detail: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cls"] = self.cls.value
        return d


@dataclass(frozen=True)
class Ordinary:
    """One ordinary event (not a fault): ``node`` None for the whole ``job``."""

    kind: str          # startup, pause, eval, restore (job-wide); hiccup, sbe, agent_restart, rank0_save (one node)
    job: str
    node: str | None
    start: float
    end: float
    phase: str = ""    # the phase the ranks declare ("" = none)
    goodbye: bool = False   # agent_restart: its agent said it stops (its last batch before the silence)


_JOB_WIDE = frozenset({"startup", "pause", "eval", "restore"})
#: Faults whose effect reaches the whole job (it stops, or waits for the slow node); one at a time per job.
_JOB_FAULTS = frozenset({FaultClass.HANG, FaultClass.STRAGGLER, FaultClass.POWER_CAP, FaultClass.THERMAL,
                         FaultClass.NODE_LOST})

T0 = 1_750_000_000.0


def _sample(source: str, fields: dict, index: int | None = None, *, tags: dict | None = None,
            ts: float | None = None) -> dict:
    """One sample as ``contracts.encode`` writes it."""
    return {"source": source, "fields": fields, "index": index, "tags": tags or {}, "ts": ts}


class Corpus:
    """The batches and labels of one :class:`CorpusSpec` (see the module docstring)."""

    def __init__(self, spec: CorpusSpec) -> None:
        if spec.hang_gpus not in ("mix", "node", "one"):
            raise ValueError(f"CorpusSpec.hang_gpus={spec.hang_gpus!r}: expected 'mix', 'node' or 'one'")
        for key in ("clock_skew_s", "jitter_s", "late_s"):
            if not 0 <= getattr(spec, key) < 60:
                raise ValueError(f"CorpusSpec.{key}={getattr(spec, key)!r}: expected seconds, 0 <= value < 60")
        if not 0 <= spec.lost_batches < 1:
            raise ValueError(f"CorpusSpec.lost_batches={spec.lost_batches!r}: expected a share, 0 <= value < 1")
        if not 0 <= spec.util_noise <= 50:
            raise ValueError(f"CorpusSpec.util_noise={spec.util_noise!r}: expected percentage points, 0 <= value <= 50")
        if not (isinstance(spec.interval_s, int) and 1 <= spec.interval_s <= 60):
            raise ValueError(f"CorpusSpec.interval_s={spec.interval_s!r}: expected whole seconds, 1 <= value <= 60")
        if not 0 <= spec.agent_restarts <= 10:
            raise ValueError(f"CorpusSpec.agent_restarts={spec.agent_restarts!r}: expected restarts per node-hour, "
                             "0 <= value <= 10")
        if not 0 <= spec.agent_goodbyes <= 1:
            raise ValueError(f"CorpusSpec.agent_goodbyes={spec.agent_goodbyes!r}: expected a share of the agent "
                             "restarts, 0 <= value <= 1")
        if not 0 <= spec.rank0_saves <= 10:
            raise ValueError(f"CorpusSpec.rank0_saves={spec.rank0_saves!r}: expected saves per job-hour, "
                             "0 <= value <= 10")
        self.spec = spec
        self.t0 = T0 + spec.seed * 1_000_000
        self.duration = int(spec.hours * 3600)
        self.node_ids = [f"n{spec.seed:03d}-{i:04d}" for i in range(spec.nodes)]
        self.job_of = {n: f"job{spec.seed:03d}-{i // spec.job_size:03d}" for i, n in enumerate(self.node_ids)}
        self.nodes_of: dict[str, list[str]] = {}
        for n in self.node_ids:
            self.nodes_of.setdefault(self.job_of[n], []).append(n)
        self.shares, self.durations, self.trace_summary = trace_mix(spec.trace)
        self.ordinary = self._ordinary() if spec.ordinary else []
        self.injections = self._schedule()
        if spec.agent_restarts:     # after the faults (which they keep clear of): the other draws stay as they were
            self.ordinary = sorted(self.ordinary + self._agent_restarts(), key=lambda o: (o.start, o.job, o.node or ""))
            if spec.agent_goodbyes:     # drawn apart: the restarts stay as they were
                bye = np.random.default_rng([spec.seed, 13])
                self.ordinary = [replace(o, goodbye=True) if o.kind == "agent_restart" and
                                 bye.random() < spec.agent_goodbyes else o for o in self.ordinary]
        if spec.rank0_saves:        # after those (and clear of them): the other draws stay as they were
            self.ordinary = sorted(self.ordinary + self._rank0_saves(), key=lambda o: (o.start, o.job, o.node or ""))
        skew = np.random.default_rng([spec.seed, 5]).normal(0.0, spec.clock_skew_s, spec.nodes) \
            if spec.clock_skew_s else np.zeros(spec.nodes)
        self.skew = dict(zip(self.node_ids, skew.tolist()))     # node -> its clock minus the corpus's

    def true_time(self, node: str, ts: float) -> float:
        """A sample time of ``node`` (its clock) on the corpus's clock, where the labels are."""
        return ts - self.skew.get(node, 0.0)

    # ------------------------------------------------------------------ schedule
    def _schedule(self) -> list[Injection]:
        s = self.spec
        rng = np.random.default_rng([s.seed, 1])
        classes = list(FaultClass)
        n_total = max(int(round(s.faults_per_node_hour * s.nodes * s.hours)), s.min_per_class * len(classes))
        want = {c: max(s.min_per_class, int(round(self.shares[c] * n_total))) for c in classes}
        todo = [c for c in classes for _ in range(want[c])]
        rng.shuffle(todo)
        busy: dict[str, list[tuple[float, float]]] = {n: [] for n in self.node_ids}
        for o in self.ordinary:          # faults keep clear of the job-wide ordinary events (clean labels)
            if o.kind in _JOB_WIDE:
                for node in self.nodes_of[o.job]:
                    busy[node].append((o.start - self.t0, o.end - self.t0))
        # a hang or a lost node stops the whole job and a slow node slows all of it: two of these at once in one job would
        # hide each other (a straggler in a hung job shows no slowdown), so they keep apart per job
        job_busy: dict[str, list[tuple[float, float]]] = {j: [] for j in self.nodes_of}
        out: list[Injection] = []
        for cls in todo:
            lo, hi = _DURATION[cls]
            pool = self.durations.get(cls) or [d for v in self.durations.values() for d in v]
            dur = float(np.clip(rng.choice(pool) * s.seconds_per_trace_day, lo, hi)) if pool else lo
            for _ in range(50):
                node = self.node_ids[int(rng.integers(len(self.node_ids)))]
                start = float(rng.uniform(s.warmup_s, max(s.warmup_s + 1, self.duration - dur - s.gap_s)))
                end = start + dur
                spans = busy[node] + (job_busy[self.job_of[node]] if cls in _JOB_FAULTS else [])
                if all(end + s.gap_s < a or start > b + s.gap_s for a, b in spans):
                    break
            else:
                continue
            busy[node].append((start, end))
            if cls in _JOB_FAULTS:
                job_busy[self.job_of[node]].append((start, end))
            sev = int(rng.integers(1, 4))
            out.append(Injection(node, cls, self.t0 + round(start), self.t0 + round(end), sev,
                                 gpu=int(rng.integers(s.gpus)), detail={"level": float(SEVERITIES[cls][sev - 1])}))
        out.sort(key=lambda i: i.start)
        return out

    def _ordinary(self) -> list["Ordinary"]:
        """Ordinary events of every job and node, drawn from the seed (see the module docstring)."""
        s = self.spec
        rng = np.random.default_rng([s.seed, 4])
        out: list[Ordinary] = []
        hours = s.hours
        for job in sorted(self.nodes_of):
            first = float(rng.uniform(20, 90))
            out.append(Ordinary("startup", job, None, self.t0, self.t0 + round(first)))
            for kind, per_hour, lo, hi in (("pause", 1.0, 10, 120), ("eval", 0.7, 60, 300), ("restore", 0.3, 20, 90)):
                for _ in range(int(rng.poisson(per_hour * hours))):
                    dur = float(rng.uniform(lo, hi))
                    start = float(rng.uniform(s.warmup_s, max(s.warmup_s + 1, self.duration - dur)))
                    declared = kind == "eval" and bool(rng.random() < 0.5)
                    out.append(Ordinary(kind, job, None, self.t0 + round(start), self.t0 + round(start + dur),
                                        phase="eval" if declared else ""))
        for node in self.node_ids:
            for kind, per_hour, lo, hi in (("hiccup", 6.0, 1, 3), ("sbe", 2.0, 1, 1)):
                for _ in range(int(rng.poisson(per_hour * hours))):
                    start = float(rng.uniform(0, self.duration - 5))
                    out.append(Ordinary(kind, self.job_of[node], node, self.t0 + round(start),
                                        self.t0 + round(start) + int(rng.integers(lo, hi + 1))))
        out.sort(key=lambda o: (o.start, o.job, o.node or ""))
        return out

    def _agent_restarts(self) -> list["Ordinary"]:
        """Each node's agent silent now and then (``agent_restarts`` per node-hour, 7-30 s: restarted by systemd
        after its RestartSec, upgraded, or cut off from Kafka) while its ranks train on: the job steps on. Clear by
        ``gap_s`` of the faults of the node and of those acting on its job; anywhere else (a pause too)."""
        s = self.spec
        rng = np.random.default_rng([s.seed, 11])
        out = []
        for node in self.node_ids:
            job = self.job_of[node]
            spans = [(i.start - self.t0, i.end - self.t0) for i in self.injections
                     if i.node == node or i.cls in _JOB_FAULTS and self.job_of[i.node] == job]
            for _ in range(int(rng.poisson(s.agent_restarts * s.hours))):
                dur = float(rng.uniform(7, 30))
                for _ in range(50):
                    start = float(rng.uniform(s.warmup_s, max(s.warmup_s + 1, self.duration - dur - 1)))
                    if all(start + dur + s.gap_s < a or start > b + s.gap_s for a, b in spans):
                        out.append(Ordinary("agent_restart", job, node, self.t0 + round(start),
                                            self.t0 + round(start + dur)))
                        spans.append((start, start + dur))
                        break
        return out

    def _rank0_saves(self) -> list["Ordinary"]:
        """Rank 0 of each job saving alone behind a barrier now and then (``rank0_saves`` per job-hour, 15-120 s,
        undeclared): clear by ``gap_s`` of the faults of the job's nodes, of its job-wide ordinary events and of its
        agents' restarts, and by 30 s of its periodic checkpoints (a node's hiccup or ECC tick may fall inside)."""
        s = self.spec
        rng = np.random.default_rng([s.seed, 12])
        phase = self._bases()[3]
        out = []
        for job, nodes in self.nodes_of.items():
            spans = [(i.start - self.t0, i.end - self.t0) for i in self.injections if self.job_of[i.node] == job]
            spans += [(o.start - self.t0, o.end - self.t0) for o in self.ordinary
                      if o.job == job and (o.node is None or o.kind == "agent_restart")]
            for _ in range(int(rng.poisson(s.rank0_saves * s.hours))):
                dur = float(rng.uniform(15, 120))
                for _ in range(50):
                    start = round(float(rng.uniform(s.warmup_s, max(s.warmup_s + 1, self.duration - dur - 1))))
                    end = round(start + dur)
                    ck = (np.arange(start - 45, end + 30) + phase[job]) % s.checkpoint_every_s < 15
                    if not ck.any() and all(end + s.gap_s < a or start > b + s.gap_s for a, b in spans):
                        out.append(Ordinary("rank0_save", job, nodes[0], self.t0 + start, self.t0 + end))
                        spans.append((start, end))
                        break
        return out

    def _bases(self) -> tuple[np.ndarray, np.ndarray, dict[str, float], dict[str, float]]:
        """Each GPU's utilisation baseline and temperature offset, each job's step time and its offset into
        ``checkpoint_every_s`` (its periodic synchronous checkpoints)."""
        s = self.spec
        base_rng = np.random.default_rng([s.seed, 2])
        util_base = base_rng.normal(93.0, 1.0, (s.nodes, s.gpus))
        temp_off = base_rng.normal(0.0, 2.0, (s.nodes, s.gpus))
        step_time = {j: float(base_rng.uniform(*s.step_s)) for j in sorted(set(self.job_of.values()))}
        phase = {j: float(base_rng.uniform(0, s.checkpoint_every_s)) for j in step_time}
        return util_base, temp_off, step_time, phase

    # ------------------------------------------------------------------ batches
    def batches(self, start_s: int = 0, stop_s: int | None = None) -> Iterator[MetricBatch]:
        """Every batch from second ``start_s`` to ``stop_s`` (default: the end), in time order."""
        for d in self._wire(start_s, stop_s):
            yield MetricBatch.from_dict(d, owned=True)

    def encoded(self, start_s: int = 0, stop_s: int | None = None) -> Iterator[tuple[str, bytes]]:
        """``(node, value)`` of every batch, as :meth:`batches` but already encoded for
        ``transom.metrics`` (``contracts.encode`` of the same batch, without building it first:
        several times faster, for replays of many node-hours)."""
        for d in self._wire(start_s, stop_s):
            yield d["node"], orjson.dumps(d)    # every number is finite (checked in _wire): orjson is safe

    def encoded_slices(self, seconds: int, start_s: int = 0,
                       stop_s: int | None = None) -> Iterator[list[tuple[str, bytes]]]:
        """:meth:`encoded` in lists of ``seconds`` of sample time each, in time order (a replay that
        delivers one list before it sends the next keeps every partition within ``seconds`` of the others)."""
        for _slice, wire in groupby(self._wire(start_s, stop_s), key=lambda d: int(d["ts"] - self.t0) // seconds):
            yield [(d["node"], orjson.dumps(d)) for d in wire]

    def deliveries(self, lag: float = 0.0) -> Iterator[tuple[float, MetricBatch]]:
        """``(arrival, batch)`` in the order a consumer gets them: each batch ``lag`` after its node's tick
        (the corpus clock) plus an exponential delay of mean ``late_s``, a node's batches in their order."""
        s = self.spec
        if not s.late_s:
            for tick, d in self._wire_ticks(0, None):
                yield tick + lag, MetricBatch.from_dict(d, owned=True)
            return
        heap: list = []
        after: dict[str, float] = {}
        index = {nid: i for i, nid in enumerate(self.node_ids)}
        last, k, delays = None, 0, None
        for tick, d in self._wire_ticks(0, None):
            if tick != last:
                while heap and heap[0][0] <= tick + lag:
                    arrival, _, b = heapq.heappop(heap)
                    yield arrival, MetricBatch.from_dict(b, owned=True)
                last = tick
                delays = np.random.default_rng([s.seed, 7, int(tick - self.t0)]).exponential(s.late_s, s.nodes)
            node = d["node"]
            arrival = after[node] = max(tick + lag + float(delays[index[node]]), after.get(node, 0.0))
            k += 1
            heapq.heappush(heap, (arrival, k, d))
        while heap:
            arrival, _, b = heapq.heappop(heap)
            yield arrival, MetricBatch.from_dict(b, owned=True)

    def _wire(self, start_s: int, stop_s: int | None) -> Iterator[dict]:
        """The batches as the plain dicts ``contracts.encode`` writes."""
        for _tick, d in self._wire_ticks(start_s, stop_s):
            yield d

    def _wire_ticks(self, start_s: int, stop_s: int | None) -> Iterator[tuple[float, dict]]:
        """``(tick, batch dict)``: the corpus second each batch was made in, and the batch."""
        s = self.spec
        stop_s = self.duration if stop_s is None else min(stop_s, self.duration)
        n, g = s.nodes, s.gpus
        util_base, temp_off, step_time, phase = self._bases()
        by_node: dict[str, list[Injection]] = {}
        for inj in self.injections:
            by_node.setdefault(inj.node, []).append(inj)
        seqs = {nid: start_s for nid in self.node_ids}
        pending = sorted(self.injections, key=lambda x: x.start)
        live: list[Injection] = []
        k = 0
        index = {nid: i for i, nid in enumerate(self.node_ids)}
        tl = self._timeline(phase, index)
        timed = bool(s.clock_skew_s or s.jitter_s or s.lost_batches)
        beats = {j: k % 2 == 0 for k, j in enumerate(sorted(self.nodes_of))}   # agents that report heartbeats
        every = s.interval_s
        tick_of = np.random.default_rng([s.seed, 8]).integers(0, every, n).tolist() if every > 1 else [0] * n
        downed = [[0.0, 0.0] for _ in range(n)]        # each port's own count of its downs (an IB port's link_downed)
        agent_down: dict[int, list[tuple[float, float]]] = {}     # node -> its agent's silences (corpus seconds)
        goodbye: set[tuple[int, int]] = set()      # (node, second) of an agent's last batch before it stops
        for o in self.ordinary:
            if o.kind == "agent_restart":
                i = index[o.node]
                agent_down.setdefault(i, []).append((o.start - self.t0, o.end - self.t0))
                if o.goodbye:
                    last = int(o.start - self.t0) - 1
                    goodbye.add((i, last - (last - tick_of[i]) % every))
        was_down: list[set] = [set() for _ in range(n)]
        for t in range(start_s, stop_s):
            ts = self.t0 + t
            rng = np.random.default_rng([s.seed, 3, t])
            util = np.clip(rng.normal(util_base, 2.0), 0, 100)
            power = 90.0 + util / 100.0 * 480.0 + rng.normal(0, 12.0, (n, g))
            sm = 1980.0 - np.abs(rng.normal(0, 20.0, (n, g)))
            temp_add = temp_off + rng.normal(0, 0.7, (n, g))
            bw = 4e10 * (1 + rng.normal(0, 0.02, (n, 2)))
            for i, node in enumerate(self.node_ids):
                j = tl[self.job_of[node]]
                nu = j["node_util"].get(i)
                f = j["util_l"][t] * (nu[t] if nu is not None else 1.0)
                apart, slow = j["apart_l"][t], j["slow_l"][t]
                if apart >= 0 or j["lost_l"][t] >= 0:
                    # a hang, a lost node (which sends nothing) or rank 0 saving behind a barrier: the waiting ranks
                    # spin in the collective, the hung (or saving) one idles, its node's GPUs or only its own
                    util[i], power[i] = 100.0, 150.0
                    if i == apart and (g1 := j["apart_gpu_l"][t]) >= 0:
                        util[i, g1], power[i, g1] = 0.0, 90.0
                    elif i == apart:
                        util[i], power[i] = 0.0, 90.0
                    continue
                if slow >= 0:               # every GPU but the slow one waits for it at the all-reduce
                    f2 = np.full(g, f * j["wait"][t])
                    if i == slow:
                        f2[int(j["slow_gpu"][t])] = f
                    util[i] = util[i] * f2
                    power[i] = 90.0 + util[i] / 100.0 * 480.0
                elif f != 1.0:
                    util[i] = util[i] * f
                    power[i] = 90.0 + util[i] / 100.0 * 480.0
            while k < len(pending) and pending[k].start <= ts:
                live.append(pending[k])
                k += 1
            live = [x for x in live if x.end > ts]
            fx: dict[str, dict] = {}
            reasons = np.zeros((n, g))
            for inj in live:
                i = index[inj.node]
                e = fx.setdefault(inj.node, {})
                self._apply(inj, i, ts, util, power, sm, temp_add, reasons, bw, e)
            if s.util_noise:        # a busy GPU's samples, a spin's 100 % too, scattered (clipped); idle ones stay idle
                noise = np.random.default_rng([s.seed, 7, t]).normal(0.0, s.util_noise, (n, g))
                util = np.where(util > 5.0, np.clip(util + noise, 0.0, 100.0), util)
            temp = 33.0 + 0.05 * power + temp_add
            if not all(np.isfinite(a).all() for a in (util, power, sm, temp, reasons, bw)):
                raise ValueError(f"corpus seed {s.seed}: a non-finite metric at second {t} (JSON has none)")
            U, P, S, T, R, B = (np.round(util).tolist(), np.round(power, 1).tolist(), sm.astype(int).tolist(),
                                np.round(temp).tolist(), reasons.tolist(), np.round(bw).tolist())
            if timed:
                trng = np.random.default_rng([s.seed, 6, t])
                off = [self.skew[nid] for nid in self.node_ids]
                if s.jitter_s:
                    off = (np.asarray(off) + trng.uniform(-s.jitter_s, s.jitter_s, n)).tolist()
                gone = (trng.random(n) < s.lost_batches).tolist() if s.lost_batches else None
            for i, node in enumerate(self.node_ids):
                e = fx.get(node, {})
                if e.get("silent") or i in agent_down and any(a <= t < b for a, b in agent_down[i]):
                    continue
                down = e.get("down", set())
                for p in down - was_down[i]:
                    downed[i][p] += 1.0
                was_down[i] = set(down)
                its = ts + off[i] if timed else ts      # the node's clock
                xids = [_sample("gpu", {DCGM.XID_ERRORS: code}, gi, ts=its - 0.3)
                        for gi, code in e.get("xid", {}).items()]
                if every > 1 and (t - tick_of[i]) % every:
                    if xids:      # a push sample: the agent publishes it at once, in a batch of its own
                        yield ts, {"node": node, "ts": its, "seq": seqs[node], "job": self.job_of[node],
                                   "v": SCHEMA_VERSION, "samples": xids}
                        seqs[node] += 1
                    continue
                if timed and gone is not None and gone[i] and not xids:
                    # sent, never delivered (not an XID: the agent sends one at once, in a batch its spool never drops)
                    seqs[node] += 1
                    continue
                job = self.job_of[node]
                samples = []
                sbe = tl[job]["sbe"].get(i)
                sbe = float(bisect.bisect_right(sbe, t)) if sbe is not None else 0.0
                for gi in range(g):
                    if e.get("lost") == gi:
                        samples.append(_sample("gpu", {DCGM.GPU_LOST: 1.0}, gi))
                    else:
                        samples.append(_sample("gpu", {
                            DCGM.GPU_UTIL: U[i][gi], DCGM.GPU_TEMP: T[i][gi], DCGM.POWER_USAGE: P[i][gi],
                            DCGM.SM_CLOCK: float(S[i][gi]), DCGM.FB_USED: 71000.0, CLOCKS_EVENT_REASONS: R[i][gi],
                            DCGM.ECC_DBE_VOL_TOTAL: e.get("dbe", {}).get(gi, 0.0),
                            DCGM.ECC_SBE_VOL_TOTAL: sbe if gi == 0 else 0.0,
                            ROW_REMAP_FAILURE: e.get("remap", {}).get(gi, 0.0)}, gi))
                samples += xids
                errors = e.get("errors", 0.0)
                for p in range(2):
                    up = 0.0 if p in e.get("down", ()) else 1.0
                    samples.append(_sample("nic", {
                        "link_up": up, "state": 4.0 if up else 1.0, "phys_state": 5.0 if up else 2.0,
                        "symbol_error_per_s": errors if p == 0 else 0.0,
                        "port_rcv_errors_per_s": round(errors / 3, 2) if p == 0 else 0.0,
                        "port_rcv_bytes_per_s": B[i][p] * up, "link_downed": downed[i][p]},
                        1, tags={"device": f"mlx5_{p}", "port": "1", "kind": "ib"}))
                st = step_time[job]
                j = tl[job]
                rate = j["rate_l"][t]
                step = int(j["progress_l"][t] / st)
                fields = {"step": float(step), "step_time": round(st / rate, 3) if rate > 0.05 else st, "loss": 2.0,
                          "alive": 1.0, "loss_nonfinite": 1.0 if e.get("nan") else 0.0}
                if beats[job]:
                    fields["heartbeat_age_s"] = float(ts - e["hung_since"]) if "hung_since" in e else 0.1 * (1 + t % 7)
                if goodbye and (i, t) in goodbye:
                    fields["agent_stopping"] = 1.0
                if s.rank0_saves:   # what the agent measures of the rank's process: a save's rate, else a log's trickle
                    saving = j["saver_l"][t] == i and t % 20 != 7
                    fields["write_bytes_per_s"] = float(3e8 + 17e8 * ((t * 7919 + i) % 101) / 100) if saving \
                        else float(1000 * (1 + (t + i) % 50))
                tags = {"job": job, "generation": "0"}
                if j["declared_l"][t]:
                    tags["phase"] = "eval"
                samples.append(_sample("train", fields, 0, tags=tags))
                samples.append(_sample("host", {"cpu_percent": 30.0}))
                if every > 1:       # the agent's self-metrics say how often it reports (1 s agents leave them out)
                    samples.append(_sample("agent", {"interval_s": float(every)}))
                yield ts, {"node": node, "ts": its, "seq": seqs[node], "samples": samples, "job": job,
                           "v": SCHEMA_VERSION}
                seqs[node] += 1

    def _timeline(self, phase: Mapping[str, float], index: Mapping[str, int]) -> dict[str, dict]:
        """Per job and second: step rate and progress, utilisation factors, the node that idles while the others
        spin (hung, or saving behind a barrier) and the slow node."""
        s, D = self.spec, self.duration
        sec = np.arange(D)
        out: dict[str, dict] = {}
        for job in self.nodes_of:
            ck = (sec + phase[job]) % s.checkpoint_every_s < 15        # synchronous checkpoints
            j = {"rate": np.where(ck, 0.0, 1.0), "util": np.where(ck, 0.1, 1.0), "declared": np.zeros(D, bool),
                 "apart": np.full(D, -1), "apart_gpu": np.full(D, -1), "lost": np.full(D, -1),
                 "saver": np.full(D, -1), "slow": np.full(D, -1), "slow_gpu": np.zeros(D, int), "wait": np.ones(D),
                 "node_util": {}, "sbe": {}}
            out[job] = j
        for o in self.ordinary:
            j = out[o.job]
            a, b = int(o.start - self.t0), min(D, int(o.end - self.t0))
            if o.kind == "pause":
                j["rate"][a:b], j["util"][a:b] = 0.0, 0.03
            elif o.kind in ("startup", "restore"):
                j["rate"][a:b], j["util"][a:b] = 0.0, 0.15
                j["rate"][b:b + 60] = np.minimum(j["rate"][b:b + 60], 1 / 1.5)   # slow first steps
            elif o.kind == "eval":
                j["rate"][a:b] = np.minimum(j["rate"][a:b], 1 / 1.6)
                j["util"][a:b] = np.minimum(j["util"][a:b], 0.68)
                j["declared"][a:b] = bool(o.phase)
            elif o.kind == "hiccup":
                j["rate"][a:b] = 0.0
                j["node_util"].setdefault(index[o.node], np.ones(D))[a:b] = 0.1
            elif o.kind == "sbe":
                j["sbe"].setdefault(index[o.node], []).append(a)
            elif o.kind == "rank0_save":     # the job waits at a barrier while rank 0 writes (its own GPU, or its node's)
                j["rate"][a:b], j["saver"][a:b], j["apart"][a:b] = 0.0, index[o.node], index[o.node]
                j["apart_gpu"][a:b] = 0 if int(o.start) % 2 == 0 else -1
        for inj in self.injections:
            j = out[self.job_of[inj.node]]
            a, b = int(inj.start - self.t0), min(D, int(inj.end - self.t0))
            lvl = inj.detail["level"]
            if inj.cls is FaultClass.NODE_LOST:
                # a synchronous job waits for its lost node: no step, the other ranks spin in the collective
                j["rate"][a:b], j["lost"][a:b] = 0.0, index[inj.node]
            elif inj.cls is FaultClass.HANG:
                one = s.hang_gpus == "one" or s.hang_gpus == "mix" and int(inj.start) % 2 == 0
                j["rate"][a:b], j["apart"][a:b], j["apart_gpu"][a:b] = 0.0, index[inj.node], inj.gpu if one else -1
            elif inj.cls in (FaultClass.STRAGGLER, FaultClass.POWER_CAP, FaultClass.THERMAL):
                f = {FaultClass.STRAGGLER: lvl, FaultClass.POWER_CAP: 0.5 + 0.5 * lvl,
                     FaultClass.THERMAL: 1 - 0.012 * lvl}[inj.cls]
                j["rate"][a:b] *= f
                j["wait"][a:b] = np.minimum(j["wait"][a:b], f)
                j["slow"][a:b], j["slow_gpu"][a:b] = index[inj.node], inj.gpu
        for j in out.values():
            j["progress"] = np.concatenate([[0.0], np.cumsum(j["rate"])])[:D]
            j["sbe"] = {i: sorted(v) for i, v in j["sbe"].items()}
            for k in ("rate", "progress", "util", "apart", "apart_gpu", "lost", "slow", "declared", "saver"):   # plain lists: fast per-second reads
                j[k + "_l"] = j[k].tolist()
        return out

    def _apply(self, inj: Injection, i: int, ts: float, util, power, sm, temp_add, reasons, bw, e: dict) -> None:
        """Apply one live injection to node ``i``'s arrays (and its effects dict ``e``)."""
        c, lvl, gpu, since = inj.cls, inj.detail["level"], inj.gpu, ts - inj.start
        if c is FaultClass.NODE_LOST:
            e["silent"] = True
        elif c is FaultClass.THERMAL:
            temp_add[i, gpu] += lvl
            sm[i, gpu] *= 1.0 - 0.012 * lvl
            if lvl >= 14:
                reasons[i, gpu] = REASON_THERMAL
        elif c is FaultClass.POWER_CAP:
            power[i, gpu] = min(power[i, gpu], lvl * 570.0)
            sm[i, gpu] *= 0.5 + 0.5 * lvl
            reasons[i, gpu] = REASON_SW_POWER
        elif c is FaultClass.STRAGGLER:
            sm[i, gpu] *= lvl
            power[i, gpu] = 90.0 + (power[i, gpu] - 90.0) * lvl
        elif c is FaultClass.LINK_DEGRADED:
            e["errors"] = float(lvl)
            bw[i, 0] *= 1.0 - min(0.6, lvl / 100.0)
        elif c is FaultClass.ECC_DBE:
            e.setdefault("dbe", {})[gpu] = float(lvl)
            if since == 0:
                e.setdefault("xid", {})[gpu] = 48.0
        elif c is FaultClass.ROW_REMAP_FAILURE:
            e.setdefault("remap", {})[gpu] = 1.0
            if since == 0:
                e.setdefault("xid", {})[gpu] = 64.0
        elif c is FaultClass.XID:
            if since == 0:
                e.setdefault("xid", {})[gpu] = float(lvl)
        elif c is FaultClass.GPU_LOST:
            e["lost"] = gpu      # as the trace's "GPU lost" / "nvidia-smi timeout": no XID 79 first
        elif c is FaultClass.LINK_DOWN:
            e.setdefault("down", set()).add(gpu % 2)
        elif c is FaultClass.LINK_FLAP:
            period = 60.0 / lvl      # ``lvl`` one-second outages over the first minute
            if since < 60.0 and since % period < 1.0:
                e.setdefault("down", set()).add(gpu % 2)
        elif c is FaultClass.HANG:
            e["hung_since"] = inj.start       # its heartbeat stops; the job-wide effects are in _timeline
        elif c is FaultClass.NAN_LOSS:
            e["nan"] = True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m transom.streams.corpus",
                                description="Write a labelled fault corpus: metrics as JSON lines (one MetricBatch "
                                            "a line, gzip) and the injected faults as JSON.")
    p.add_argument("--nodes", type=int, default=32)
    p.add_argument("--hours", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=0.6, help="injected faults per node-hour (default 0.6)")
    p.add_argument("--out", required=True, help="output directory (metrics.jsonl.gz, labels.json)")
    a = p.parse_args(argv)
    corpus = Corpus(CorpusSpec(nodes=a.nodes, hours=a.hours, seed=a.seed, faults_per_node_hour=a.rate))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "labels.json"), "w") as fh:
        json.dump({"spec": asdict(corpus.spec), "trace": corpus.trace_summary,
                   "injections": [i.to_dict() for i in corpus.injections]}, fh, indent=1)
    n = 0
    with gzip.open(os.path.join(a.out, "metrics.jsonl.gz"), "wb") as fh:
        for _node, value in corpus.encoded():
            fh.write(value + b"\n")
            n += 1
            if n % 100_000 == 0:
                print(f"{n} batches", file=sys.stderr)
    print(json.dumps({"batches": n, "injections": len(corpus.injections), "out": a.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
