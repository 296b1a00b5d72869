"""Hang detection that tells a hang from a pause (no Faust here).

A synchronous job whose steps stop is either paused (every rank checkpoints, evaluates, reloads
data, compiles, or starts slowly) or hung (one rank is stuck, and every other rank waits for it
inside a collective). Both look the same in the step counter. What tells them apart:

- **the stuck rank itself**: its heartbeat stopped (``heartbeat_age_s`` from the agent: a
  SIGSTOPped rank, or one holding the GIL in a C call) or the kernel says it is stopped
  (``stopped = 1``, only where the agent shares its PID namespace);
- **the GPUs**: ranks waiting in a collective spin their GPUs at full utilisation; the rank that
  never arrived leaves its GPUs idle (its node's, or, one rank per GPU, its own GPU while its node's
  other GPUs spin with the waiting ranks). A pause idles (or keeps busy) every node alike;
- **its peers**: a rank whose step stands still while the other ranks of its job step on;
- **what the job declares**: ``report(phase="checkpoint")`` (or eval, data, compile, startup,
  restore) raises the ceiling for that phase (``hang_phase_ceilings``);
- **what a rank writes**: a rank whose process writes at ``hang_save_write_mb_s`` or more (the agent's
  ``write_bytes_per_s``) saves a checkpoint, as if it declared the phase (rank 0 saving alone behind a
  barrier while the other ranks spin, the pattern of DDP's own examples, is no rank "not in the
  collective"), for ``_SAVE_GRACE_S`` after its last such report;
- **what the job has survived**: a stop with no stuck rank is a pause until
  ``max(hang_pause_floor_s, hang_pause_margin x the longest pause this job survived)`` (NVRx
  sets its timeouts from observed intervals the same way), then a job-level hang.

Rules, per rank, in sample time (``stall`` = how long its step has stood still):

===============================================  ==========================================
condition                                        the hang event names
===============================================  ==========================================
stall > step limit and the rank is stuck          that rank and its node (``cause: stuck``)
stall > step limit, peers stepped on meanwhile    that rank and its node (``cause: behind``)
stall > step limit, whole job still; this node's  this node's ranks (``cause: not in the
GPUs idle while at least 2x as many nodes spin    collective``)
(or, the one idle node, while all others spin;
or the job's only idle GPUs are this node's and
every other GPU spins, 2x as many),
no rank of the job declares a phase
stall > pause ceiling (nothing stands out)        the rank that stopped first (``cause:
                                                  pause ceiling``), its node only
===============================================  ==========================================

The step limit is ``max(hang_timeout, hang_step_factor x median step time)``, or ``hang_timeout``
where every node of the job whose GPUs spin draws a wait's power (60 % or less of what they drew
stepping: a job of long steps that stands in a collective computes nothing); a rank the kernel
reports stopped, while its peers are not all stuck, is judged after ``max(hang_stopped_s, its median
step time)`` instead (a stopped process has no pause of its own). A hang is reported
for a rank with the batch of its own node (one event per stall, id from job, generation, node,
rank, the time its step last moved), with the stuck rank's process state and stack and, as
evidence, where the waiting ranks are. Ranks are keyed by node too (two nodes may both call a
rank 0 when the agents do not know the global rank).

The detector also finds a node lost before the heartbeat timeout (:meth:`HangDetector._lost`): its ranks
silent for ``node_lost_fast_s`` (2 s) while every rank of its generation still heard from began to wait
as it fell silent, its GPUs spinning (ranks waiting in a collective for ranks that never come). Waiting
means standing still past a step (the job's median step or its latest ones, whichever is longer: the
first steps after a restore are slow), or spinning at a wait's power, a wait that began in power as the
node fell silent (not a hang's wait the node's silence came into). The silence must also be proven where
a worker's lag cannot fake it: the node's metrics partition was read that far past its newest batch, in
the sample time of the other nodes' batches on it (read marks: :meth:`TEEEngine.read_past` on the wall
clock, the partition's clock, :meth:`TEEEngine.read_up_to`, on the event clock; one engine reading every
node knows it itself); a node alone on its partition is left to the heartbeat timeout on the wall clock.
A silence while the job stands for something else is left to the heartbeat timeout too (a batch late or
lost then says nothing): another node found lost before the job stopped, or silent before this one (left
to the heartbeat timeout: long steps without power samples), a node that idled a GPU while the others
spun since it stopped (a stuck rank, a data-loader hiccup; unless the waiting GPUs draw a wait's power
once it is busy again), GPUs that took to a step's power as a pause ended (its first step computes), or
a job whose ranks have not stepped yet. A job that stands still because a node of it was lost as the
stall began is no pause-ceiling hang, also once the node is back and before the job steps again.

Where it runs: the rules compare a job's ranks across its nodes, so the detector must see every node
of the job. In one process (offline, tests) it is the engine's rule, ``observe(state, batch, now)``.
In the TEE workers a job's nodes are spread over the workers by node: the worker that reads a node
turns each batch into :class:`~transom.contracts.RankReport` values (:meth:`HangDetector.reports`) and
sends them keyed by job; the worker that owns the job feeds them, in each node's order, to
:meth:`HangDetector.take`, the same judgement (:mod:`.app`, :meth:`TEEEngine.job_feed`).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from transom.contracts import (DCGM, Action, FaultEvent, FaultKind, MetricBatch, RankReport, Severity, Source,
                               stable_id)
from transom.log import get

from .config import TEEConfig
from .rules import Cadence, NodeState, fault, node_lost

__all__ = ["HangDetector", "RankView", "JobView"]

log = get("tee")

_UTIL = DCGM.GPU_UTIL
_POWER = DCGM.POWER_USAGE
_FORGET_AFTER = 3600.0    # drop ranks not seen for this long (sample time)
#: a rank not heard from for this many heartbeat timeouts (30 s by default; the TEE has found its node
#: lost by then) is no peer of the ranks still reporting
_SILENT_PEER_TIMEOUTS = 5.0
#: GPUs that draw this share of their stepping power or more as a pause ends compute its first step: their
#: rank waits for no lost node (a spin-wait kernel draws a fraction of a step's power: ``hang_wait_power``)
_COMPUTE_POWER = 0.9
#: a rank whose step is longer than this is judged to wait for a silent node only by its GPUs' power: its stall
#: says only within a step when its wait began
_BLIND_STEP_S = 5.0
#: a rank is behind its peers once its own reports showed a peer past it for this long (its clock)
_BEHIND_HOLD_S = 2.0
#: a wait shown in power began at most this long before the silence of the node it waits for (a batch late or
#: lost, the nodes' clocks apart, a data-loader hiccup of that node before it was lost)
_WAIT_BEGAN_S = 5.0
#: a node stays apart (idle alone) through reports that say otherwise for less than this since its last one
#: that found it apart (its clock; not across a silence of its node)
_APART_GRACE_S = 2.0
#: a rank that wrote at a save's rate (``hang_save_write_mb_s``) is saving for this long after (its clock): a
#: save's writes pause while it copies the next tensor off the GPU or serialises it
_SAVE_GRACE_S = 5.0
_PAUSE_MIN = 3.0          # stalls shorter than this many step times are not pauses worth learning
#: seconds of a job's step moves kept (:attr:`JobView.tally`): past the heartbeat horizon and timeout
_TALLY = 300
#: the most steps one report of a rank counts for the job's tally (a counter that jumps is no proof of progress)
_MOVES_MAX = 1000


def _held_since(marks: dict, key: tuple, r: "RankView") -> float:
    """Since when (``r``'s clock) a condition marked in ``marks`` holds for rank ``key`` in its current stall:
    from its last sample where the stall is a new one."""
    stall, since = marks.get(key, (None, r.last_seen))
    if stall != r.since:                # a new stall: it holds from now
        marks[key] = (r.since, since := r.last_seen)
    return since


@dataclass
class RankView:
    """Where one rank stands (sample time)."""

    node: str
    step: float
    since: float                       # ts of the first sample that showed ``step``
    last_seen: float
    heard: float = 0.0                 # the detector's clock when its last report was taken
    moved_at: float = 0.0              # the detector's clock when the report that first showed ``step`` was taken
    step_times: deque = field(default_factory=lambda: deque(maxlen=20))
    heartbeat_age: float | None = None
    stopped: bool = False
    moved: bool = False                # its step moved since it was first heard (not starting up)
    phase: str = ""
    stack: str = ""
    state: str = ""
    pid: str = ""
    wrote: float = float("-inf")       # sample time of its last report that wrote at a save's rate
    write_rate: float | None = None    # bytes per second its process wrote, as its last report said

    @property
    def stall(self) -> float:
        return self.last_seen - self.since

    @property
    def doing(self) -> str:
        """The phase it declared, or "checkpoint" while its process writes at a save's rate (and for
        ``_SAVE_GRACE_S`` after): a rank that saves is at work, not hung."""
        return self.phase or ("checkpoint" if self.last_seen - self.wrote <= _SAVE_GRACE_S else "")

    def median_step(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None

    def recent_step(self) -> float:
        """Its step time: the median or the longest of its latest three, whichever is longer (the slow steps
        after a restore or in an evaluation); 1 s before any."""
        median = self.median_step() or 1.0
        return max(median, *list(self.step_times)[-3:]) if self.step_times else median


@dataclass
class JobView:
    """One job as this worker sees it: its ranks (keyed node, generation, rank) and its nodes' GPUs."""

    ranks: dict[tuple[str, str, int], RankView] = field(default_factory=dict)
    gpu_util: dict[str, tuple[float, float]] = field(default_factory=dict)   # node -> (ts, mean util)
    #: node -> (GPUs, idle, spinning) of that ts; None: its worker did not count (the node's mean alone)
    gpus: dict[str, tuple[int, int, int] | None] = field(default_factory=dict)
    #: node -> how many of its GPUs idled at its last step moves (GPUs of the node the job does not use)
    idle_stepping: dict[str, deque] = field(default_factory=dict)
    longest_pause: float = 0.0         # the longest stall this job survived (sample time)
    reported: set = field(default_factory=set)     # (node, generation, rank, since) reported hung
    apart_since: dict[tuple, tuple] = field(default_factory=dict)   # rank -> (its stall, since when its node idles alone)
    apart_last: dict[tuple, float] = field(default_factory=dict)    # rank -> its last sample that found it apart
    behind_since: dict[tuple, tuple] = field(default_factory=dict)  # rank -> (its stall, since when a peer is past it)
    #: node -> the last sample time of its ranks before their latest silence of the heartbeat timeout or more
    #: (its node lost): the job may stand still from then on, waiting for it
    gone: dict[str, float] = field(default_factory=dict)
    #: node -> the detector's clock when its ranks were last heard before that silence (``gone``'s, compared
    #: with other nodes' times: node clocks skew)
    gone_heard: dict[str, float] = field(default_factory=dict)
    lost: dict[str, float] = field(default_factory=dict)   # node -> the report ts it was found lost after
    #: node -> its last report ts before a silence its job stepped on through (its agent silent, not lost)
    held: dict[str, float] = field(default_factory=dict)
    #: node -> ts of its agent's goodbye (its newest report says ``agent_stopping``: a restart, an upgrade)
    bye: dict[str, float] = field(default_factory=dict)
    busy_since: dict[str, float] = field(default_factory=dict)   # node -> ts since which its GPUs spin
    #: node -> the last ts a GPU of the job idled there (every GPU in a pause; a stuck rank's, a hiccup's)
    idle_to: dict[str, float] = field(default_factory=dict)
    gpu_power: dict[str, tuple[float, float]] = field(default_factory=dict)   # node -> (ts, mean power draw)
    #: node -> ts since which its GPUs, spinning, draw a wait's power (``hang_wait_power`` of their stepping power)
    wait_power_since: dict[str, float] = field(default_factory=dict)
    #: node -> how often its reports come (:meth:`beats`)
    cadence: dict[str, Cadence] = field(default_factory=dict)
    #: node -> its GPUs' mean power draw at its rank's last step moves (what they draw stepping)
    step_power: dict[str, deque] = field(default_factory=dict)
    #: node -> how far its metrics partition was read (the node's own sample time: its newest batch plus the
    #: other nodes' progress read after it; on the event clock, the partition's clock), from the read marks
    #: of its worker
    read: dict[str, float] = field(default_factory=dict)
    #: node -> the detector's clock when its ranks were last heard, the longest silent first
    heard: OrderedDict = field(default_factory=OrderedDict)
    #: steps of the job's ranks taken so far (every rank, each report counting the steps it moved), and (the
    #: detector's clock, that count) about once a second: how many steps the job made since a node fell silent
    #: (:meth:`moves_since`)
    moves: int = 0
    tally: deque = field(default_factory=lambda: deque(maxlen=_TALLY))

    def note_move(self, now: float, steps: int = 1) -> None:
        """A rank of the job moved its step by ``steps`` (taken at ``now``, the detector's clock)."""
        self.moves += steps
        if not self.tally or now - self.tally[-1][0] >= 1.0:
            self.tally.append((now, self.moves))
        else:
            self.tally[-1] = (self.tally[-1][0], self.moves)

    def moves_since(self, t: float) -> int:
        """Steps of the job's ranks taken after ``t`` (the detector's clock), to about a second."""
        oldest = self.tally[0][1] if self.tally else 0
        return self.moves - next((n for at, n in reversed(self.tally) if at <= t), oldest)

    def note_cadence(self, node: str, ts: float) -> None:
        """A report of ``node``'s batch of sample time ``ts``: learn how often the node reports."""
        if (c := self.cadence.get(node)) is None:
            c = self.cadence[node] = Cadence()
        c.note(ts)

    def beats(self, node: str) -> float:
        """How many seconds apart ``node`` reports (:attr:`Cadence.interval` of its reports; 1 at most once a
        second): a silence is judged in as many times the limits set for 1 s reports."""
        c = self.cadence.get(node)
        return 1.0 if c is None else max(1.0, c.interval)


class HangDetector:
    """The hang rule (``observe(state, batch, now)``, or ``take(job, report, now)`` on the job's worker),
    with per-job state."""

    name = "hang"

    def __init__(self, config: TEEConfig) -> None:
        self.config = config
        self.jobs: dict[str, JobView] = {}
        self._ceilings = dict(config.hang_phase_ceilings)
        self._idle_at, self._busy_at = config.hang_idle_util, config.hang_busy_util
        self._saving_at = config.hang_save_write_mb_s * 1e6 if config.hang_save_write_mb_s > 0 else float("inf")
        self._hung: dict[str, list] = {}         # node -> the (job, rank key, since) of its last reported hangs
        self._seeded: dict[tuple, float] = {}    # (node, job, generation, rank) -> step an earlier worker reported
        self._swept = 0.0
        #: where one engine reads every node (not split): node -> how far it read past the node's newest batch
        #: (the other nodes' sample time); else the read marks of the nodes' workers say it (``JobView.read``)
        self.read_past_of: Callable[[str], float] | None = None

    # ------------------------------------------------------------------ limits

    def step_limit(self, r: RankView) -> float:
        median = r.median_step()
        base = self.config.hang_timeout
        return base if median is None else max(base, self.config.hang_step_factor * median)

    def stopped_limit(self, r: RankView) -> float:
        """How long a rank the kernel reports stopped may stand still (``hang_stopped_s``, or a step)."""
        median = r.median_step()
        return self.config.hang_stopped_s if median is None else max(self.config.hang_stopped_s, median)

    def pause_limit(self, job: JobView, phase: str) -> float:
        """How long the whole job may stand still with no rank standing out."""
        learned = max(self.config.hang_pause_floor_s, self.config.hang_pause_margin * job.longest_pause)
        if phase:
            return max(learned, self._ceilings.get(phase, self._ceilings.get("default", 0.0)))
        return learned

    def stuck(self, r: RankView) -> bool:
        if r.stopped:
            return True
        if r.heartbeat_age is None:
            return False
        stale = self.config.hang_stale_s * (4 if r.doing else 1)   # a declared phase may hold the GIL longer
        return r.heartbeat_age >= stale

    def ongoing(self, node: str, ts: float) -> bool:
        """Whether a hang of ``node`` is going on at ``ts`` (its soft symptoms are explained by it)."""
        for job_id, key, since in self._hung.get(node, ()):
            job = self.jobs.get(job_id)
            r = job.ranks.get(key) if job is not None else None
            if r is not None and r.since == since and ts - since > self.step_limit(r):
                return True
        return False

    # ------------------------------------------------------------------ observe

    def observe(self, state: NodeState, batch: MetricBatch, now: float) -> list[FaultEvent]:
        """The engine's rule where one process sees every node of the job (offline, tests)."""
        out: list[FaultEvent] = []
        for job_id, report in self.reports(batch):
            out += self.take(job_id, report, now)
        return out

    def reports(self, batch: MetricBatch) -> list[tuple[str, RankReport]]:
        """What of ``batch`` the judgement of each of its jobs needs: (job, report) pairs. On the
        worker that reads the node; the job's worker passes them to :meth:`take` (``transom.peer-windows``)."""
        trains = batch.of(Source.TRAIN)
        gpu_samples = batch.of(Source.GPU)
        utils = [s.fields[_UTIL] for s in gpu_samples if _UTIL in s.fields]
        powers = [s.fields[_POWER] for s in gpu_samples if _POWER in s.fields]
        power = sum(powers) / len(powers) if powers else None
        if utils:
            util = sum(utils) / len(utils)
            idle = busy = 0
            for u in utils:
                if u <= self._idle_at:
                    idle += 1
                elif u >= self._busy_at:
                    busy += 1
            gpus = (len(utils), idle, busy)
        else:
            util = gpus = None
        if not trains:
            return [] if util is None or batch.job is None else \
                [(batch.job, RankReport(batch.node, batch.ts, util, gpus=gpus, gpu_power=power))]
        if len(trains) == 1 and not trains[0].tags.get("event"):      # the common case: one rank per node
            report = object.__new__(RankReport)      # from a validated batch: no frozen __init__
            report.__dict__.update(node=batch.node, ts=batch.ts, gpu_util=util, samples=trains, gpus=gpus,
                                   gpu_power=power)
            return [(trains[0].tags.get("job") or batch.job or "", report)]
        by_job: dict[str, list] = {}
        for s in trains:
            if not s.tags.get("event"):      # a one-off event (a save, a restore), not the rank's progress
                by_job.setdefault(s.tags.get("job") or batch.job or "", []).append(s)
        return [(job_id, RankReport(batch.node, batch.ts, util, tuple(samples), gpus, power))
                for job_id, samples in by_job.items()]

    def read_to(self, job_id: str, node: str, ts: float) -> None:
        """Job side: ``node``'s worker read its partition up to ``ts`` (a read mark: the proof of a silence
        that :meth:`_lost` asks for; on the event clock the job's reports wait for the marks too,
        :class:`.jobwindows.JobReports`)."""
        job = self.jobs.get(job_id)
        if job is not None:
            job.read[node] = max(job.read.get(node, ts), ts)

    def take(self, job_id: str, report: RankReport, now: float) -> list[FaultEvent]:
        """Judge ``job_id``'s ranks with one node batch's ``report`` (in the node's order)."""
        node = report.node
        if not report.samples:
            if report.silent_s is not None:    # its worker leaves the node's silence to this one
                return self.silent(job_id, report, now)
            if (job := self.jobs.get(job_id)) is not None:
                if report.gpu_util is not None:
                    job.note_cadence(node, report.ts)
                    self._util(job, node, report)
                    if node in job.heard:          # its agent reports: not lost, whatever its ranks do
                        job.heard[node] = now
                        job.heard.move_to_end(node)
                else:            # a read mark: its partition was read this far past its newest batch
                    self.read_to(job_id, node, report.ts)
                    if len(job.ranks) > 1:
                        return self._lost(now, job_id, job)
            return []
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = JobView()
        job.note_cadence(node, report.ts)
        if report.gpu_util is not None:
            self._util(job, node, report)
        mine: list[tuple[tuple[str, str, int], RankView]] = []
        bye = False
        for s in report.samples:
            key = (node, s.tags.get("generation", "0"), s.index if s.index is not None else -1)
            if s.fields.get("alive") == 0:
                job.ranks.pop(key, None)
                continue
            step = s.fields.get("step")
            if step is None:
                continue
            ts = float(s.ts) if s.ts is not None else report.ts
            seen = max(ts, report.ts)
            r = job.ranks.get(key)
            if r is None:
                r = job.ranks[key] = RankView(node=node, step=step, since=ts, last_seen=seen, heard=now, moved_at=now)
            elif now - r.heard >= self.config.heartbeat_timeout * job.beats(node) or node in job.lost:
                job.gone[node] = r.last_seen      # back from a silence its job may still stand still for
                job.gone_heard[node] = r.heard
            if step != r.step:
                # the time it was seen standing still: a node silent for a while (its agent down, the node
                # lost and back) comes back at a new step, and that gap is no pause the job survived
                stalled = r.last_seen - r.since
                median = r.median_step() or 0.0
                if (node, key[1], key[2], r.since) not in job.reported and stalled > max(_PAUSE_MIN * median, 1.0):
                    job.longest_pause = max(job.longest_pause, stalled)
                # the steps it made since its last report (several where its node reports less often than it
                # steps; one where its step went back, a restore)
                job.note_move(now, min(max(int(step - r.step), 1), _MOVES_MAX))
                r.step, r.since, r.last_seen, r.moved, r.moved_at = step, ts, seen, True, now
                if report.gpus is not None:
                    if (idle := job.idle_stepping.get(node)) is None:
                        idle = job.idle_stepping[node] = deque(maxlen=8)
                    idle.append(report.gpus[1])
                if report.gpu_power is not None:
                    if (drew := job.step_power.get(node)) is None:
                        drew = job.step_power[node] = deque(maxlen=8)
                    drew.append(report.gpu_power)
                step_time = s.fields.get("step_time")
                if step_time is not None and step_time > 0:
                    r.step_times.append(float(step_time))
            else:
                r.last_seen = max(r.last_seen, seen)
            r.heard = now
            r.heartbeat_age = s.fields.get("heartbeat_age_s")
            r.stopped = s.fields.get("stopped") == 1
            r.phase, r.stack, r.state, r.pid = (s.tags.get("phase", ""), s.tags.get("stack", ""),
                                                s.tags.get("state", ""), s.tags.get("pid", ""))
            if (wrote := s.fields.get("write_bytes_per_s")) is not None:
                r.write_rate = wrote
                if wrote >= self._saving_at:
                    r.wrote = seen
            if s.fields.get("alive") == 1:
                mine.append((key, r))
            if s.fields.get("agent_stopping") == 1:
                bye = True
        job.lost.pop(node, None)
        job.held.pop(node, None)
        if bye:
            job.bye[node] = report.ts
        else:
            job.bye.pop(node, None)
        job.heard[node] = now
        job.heard.move_to_end(node)
        out = []
        if mine and mine[0][1].stall >= 1.0 and len(job.ranks) > 1:      # it stands still: is a node of it lost?
            out += self._lost(now, job_id, job)
        for key, r in mine:
            f = self._decide(now, job_id, key, r)
            if f is not None:
                out.append(f)
        if report.ts - self._swept >= 60.0:
            self._sweep(report.ts)
        return out

    def _sweep(self, ts: float) -> None:
        self._swept = ts
        cutoff = ts - _FORGET_AFTER
        for job_id, job in list(self.jobs.items()):
            for key in [k for k, v in job.ranks.items() if v.last_seen < cutoff]:
                del job.ranks[key]
                job.apart_since.pop(key, None)
                job.apart_last.pop(key, None)
                job.behind_since.pop(key, None)
            for n in [n for n, t in job.gone.items() if t < cutoff]:
                del job.gone[n]
                job.gone_heard.pop(n, None)
            for n in [n for n, (t, _) in job.gpu_util.items() if t < cutoff]:
                job.heard.pop(n, None)
                job.bye.pop(n, None)
                job.busy_since.pop(n, None)
                job.idle_to.pop(n, None)
                job.read.pop(n, None)
                job.lost.pop(n, None)
                job.held.pop(n, None)
                job.cadence.pop(n, None)
            if not job.ranks and all(t < cutoff for t, _ in job.gpu_util.values()):
                del self.jobs[job_id]

    def seed(self, node: str, job_id: str, generation: str, rank: int, step: float) -> None:
        """An earlier worker reported this rank hung at ``step``: not again for the same stall."""
        self._seeded[(node, job_id, generation, rank)] = step

    def forget(self, jobs) -> None:
        """These jobs are another worker's now."""
        for job_id in jobs:
            self.jobs.pop(job_id, None)

    # ------------------------------------------------------------------ decide

    def _decide(self, now: float, job_id: str, key: tuple[str, str, int], r: RankView) -> FaultEvent | None:
        job = self.jobs[job_id]
        node, generation, rank = key
        limit = self.step_limit(r)
        wait = self.config.hang_timeout
        if limit > wait and r.stall > wait and self._waits_at_low_power(job, r):
            limit = wait        # a job of long steps whose spinning GPUs draw a wait's power: no rank of it is
                                # in a long compute step, it waits (module doc)
        idle = job.gpu_util.get(node, (0.0, 100.0))[1] <= self.config.hang_idle_util \
            or (job.gpus.get(node) or (0, 0, 0))[1] > 0
        if r.stall > 0 and (idle or key in job.apart_since):
            self._apart(job, key, r)        # how long its node has idled alone, from the start (idle nodes only: cheap)
        # a rank the kernel reports stopped has no pause of its own: only its peers wait, so it is judged
        # after the shorter stopped limit (when its peers are not all stuck too)
        short = self.stopped_limit(r) if r.stopped else None
        early = short is not None and r.stall > short
        if (r.stall <= limit and not early) or (node, generation, rank, r.since) in job.reported:
            return None
        if self._seeded.get((node, job_id, generation, rank)) == r.step:     # an earlier worker reported it
            return None
        # its peers: the ranks of its generation heard from lately, on this detector's clock (node clocks
        # skew: sample times of two nodes are not comparable); one silent longer (its node lost, its agent
        # down) says nothing about this stall, and would hold every rule below for good
        silent = _SILENT_PEER_TIMEOUTS * self.config.heartbeat_timeout      # (in reports of its node)
        peers = [(k, v) for k, v in job.ranks.items() if k != key and k[1] == generation
                 and v.heard >= now - silent * job.beats(k[0])]
        cause = None
        if self.stuck(r) and not (peers and all(self.stuck(v) for _, v in peers)):
            cause = "stuck"           # (every rank stuck at once is the whole job frozen: a pause, below)
            if r.stall <= limit:
                limit = short
        elif r.stall <= limit:
            return None               # stopped, and so is every peer (the job suspended): the step limit and
                                      # the rules below decide
        elif self._behind(job, key, r, peers, limit):
            cause = "behind"
        elif not (phase := r.doing or next((d for _, v in peers if (d := v.doing)), "")) \
                and self._not_in_collective(job, key, r, peers, limit):
            # (in a declared phase, one node idle while the others spin is the phase's work: rank 0 saving or
            # scoring while the others wait at a barrier; the phase's ceiling below bounds it; so is a rank that
            # writes at a save's rate, declared or not)
            if any(k[0] == node and k[2] < rank and v.stall > limit for k, v in peers):
                return None           # one event per idle node: its lowest rank
            cause = "not in the collective"
        else:
            if any((k[0], k[1], k[2], v.since) in job.reported for k, v in peers):
                return None           # a rank of this stall is reported hung already: the job waits for it
            if any(ts >= r.since - 5.0 - (job.beats(n) - 1.0) - (job.beats(node) - 1.0)
                   for n, ts in self._gone_since(job, now)):
                return None           # a node of the job was lost as the stall began (5 s of clock skew allowed,
                                      # and each node's report interval over 1 s: a last report before the loss,
                                      # a first one at the step the job stood at after it): the job waits for it
                                      # (the node_lost event), no rank of it is hung; this rank's own node too,
                                      # back at the step it was lost at (its stall is the loss)
            ceiling = self.pause_limit(job, phase)
            first = min([(r.since, key), *((v.since, k) for k, v in peers)])[1]
            if r.stall <= ceiling or first != key:
                return None           # one event for the job: the rank that stopped first
            limit, cause = ceiling, "pause ceiling"
        job.reported.add((node, generation, rank, r.since))
        self._hung[node] = [*self._hung.get(node, [])[-7:], (job_id, key, r.since)]
        return self._event(now, job_id, key, r, job, peers, cause, limit)

    @staticmethod
    def _behind(job: JobView, key: tuple[str, str, int], r: RankView, peers, limit: float) -> bool:
        """A peer stepped past this rank while it was seen standing still (a peer read further ahead in time,
        or one back from an outage catching up to the same step, proves nothing), and its own reports have
        said so for ``_BEHIND_HOLD_S`` of its clock: sample times of two nodes compare only as far as their
        clocks agree, and as a job-wide pause ends, a peer's first step may carry a time before this rank's
        last report of the pause when the peer's clock runs behind this rank's (the rank's next report shows the
        step)."""
        if not any(r.since + limit < v.since <= r.last_seen and v.step > r.step for _, v in peers):
            job.behind_since.pop(key, None)
            return False
        return r.last_seen - _held_since(job.behind_since, key, r) >= _BEHIND_HOLD_S

    def _gone_since(self, job: JobView, now: float) -> list[tuple[str, float]]:
        """The job's nodes that are, or were lately, lost (their ranks silent for the heartbeat timeout, on this
        detector's clock), each with when it last showed its ranks before it."""
        out = list(job.gone.items())
        out += [(n, v.last_seen) for (n, _, _), v in job.ranks.items()
                if now - v.heard >= self.config.heartbeat_timeout * job.beats(n) or n in job.lost]
        return out

    def _util(self, job: JobView, node: str, report: RankReport) -> None:
        """A report of ``node``'s GPUs: their mean and counts, and since when they spin."""
        job.gpu_util[node] = (report.ts, report.gpu_util)
        job.gpus[node] = report.gpus
        if report.gpu_power is not None:
            job.gpu_power[node] = (report.ts, report.gpu_power)
        if not self._spins(job, node):
            job.busy_since.pop(node, None)
            job.wait_power_since.pop(node, None)
        else:
            if node not in job.busy_since:
                job.busy_since[node] = report.ts
            if not self._spins_waiting(job, node, report.ts):
                job.wait_power_since.pop(node, None)
            elif node not in job.wait_power_since:
                job.wait_power_since[node] = report.ts
        g = report.gpus
        if report.gpu_util <= self.config.hang_idle_util \
                or g is not None and g[1] > min(job.idle_stepping.get(node) or (0,)):
            job.idle_to[node] = report.ts

    def _spins(self, job: JobView, node: str) -> bool:
        """The node's GPUs are busy (their mean at ``hang_busy_util`` or more, or every GPU the job uses)."""
        if job.gpu_util[node][1] >= self.config.hang_busy_util:
            return True
        g = job.gpus.get(node)      # one rank per GPU, some GPUs not the job's: those that idled while it stepped
        return g is not None and g[2] > 0 and g[2] + min(job.idle_stepping.get(node) or (0,)) >= g[0]

    def _lost(self, now: float, job_id: str, job: JobView) -> list[FaultEvent]:
        """Nodes of the job whose ranks are silent for ``node_lost_fast_s`` (this detector's clock) while every
        rank of their generation still heard from began to wait as they fell silent, its node's GPUs spinning
        (waiting in a collective for the ranks that never come): those nodes are lost, found before the
        heartbeat timeout, with the heartbeat rule's fault id. Late metrics leave the job stepping, and a
        job-wide pause idles its GPUs: the heartbeat timeout decides those. Of two nodes silent at once, the
        one that fell silent last is decided first (the other may be late as the job stopped for it; once it is
        found lost, the job stands for it). The silence must also show in the node's read marks (its partition
        read ``node_lost_fast_s`` past its newest batch; on either clock), so that a worker reading the
        partition late finds no node lost."""
        silent = []
        for n, heard in job.heard.items():     # the longest silent first: a look costs the silent nodes only
            if now - heard < self.config.node_lost_fast_s:
                break
            if self._fast(job, n) <= now - heard <= self.config.heartbeat_timeout * job.beats(n) and n not in job.lost:
                silent.append((n, now - heard))
        out = []
        for i, (n, quiet) in enumerate(silent):
            seen, generation = max(((v.last_seen, k[1]) for k, v in job.ranks.items() if k[0] == n),
                                   default=(None, None))
            if seen is None:
                continue            # its ranks left the job
            if n in job.bye:
                continue            # its agent said it stops: a wait of its peers as it fell silent may be its own
                                    # rank's data-loader hiccup; the silence marks decide (`_after_bye`: a wait of
                                    # the heartbeat timeout and two steps)
            if any(m != n and any(k[0] == m for k in job.ranks) for m, _ in silent[i + 1:]):
                continue            # another node fell silent after it and is silent too: that one may be what
                                    # the job stands for, and this one only late (decided once either is back)
            ts = max(seen, job.gpu_util.get(n, (seen,))[0])     # its newest report: the heartbeat rule's id
            past = self.read_past_of(n) if self.read_past_of is not None else job.read.get(n, ts) - ts
            fast, timeout = self._fast(job, n), self.config.heartbeat_timeout * job.beats(n)
            if past < fast:
                continue        # its partition was not read that far past it: the worker may only be late
            waiting = [(k, v) for k, v in job.ranks.items() if k[0] != n and k[1] == generation
                       and now - v.heard < self._fast(job, k[0])]
            if not waiting or not all(self._waits_for(job, v, quiet) for _, v in waiting):
                continue
            start = min(v.since for _, v in waiting)
            if self._stands_for_other(job, n, quiet, now, max(v.moved_at for _, v in waiting)):
                continue
            if self._stands_for_idle(job, n, start, waiting):
                continue
            job.lost[n] = ts
            shown = [{"node": k[0], "rank": k[2], "stall_s": round(v.stall, 1),
                      **({"gpu_util": round(job.gpu_util[k[0]][1], 1)} if k[0] in job.gpu_util else {})}
                     for k, v in sorted(waiting, key=lambda kv: kv[0])[:8]]
            out.append(fault(
                FaultKind.NODE_LOST, Severity.CRITICAL, Action.EVICT,
                fault_id=stable_id(n, "node_lost", ts), node=n, job=job_id or None, detector="rule.heartbeat",
                observed_ts=ts, now=now, score=quiet, threshold=fast,
                evidence={"last_batch_ts": ts, "silent_s": round(quiet, 3), "heartbeat_timeout_s": timeout,
                          "corroborated_after_s": fast, "cause": "its job stopped as it fell silent",
                          "read_past_s": round(past, 3),
                          "waiting_ranks": shown},
                summary=(f"Node {n} has sent no metrics for {quiet:.1f}s and job {job_id} stopped stepping as it "
                         f"fell silent: its other {len(waiting)} rank(s) spin, waiting for it (found before the "
                         f"{timeout:g}s heartbeat timeout)."),
            ))
        return out

    def silent(self, job_id: str, mark: RankReport, now: float) -> list[FaultEvent]:
        """A silence mark (:attr:`RankReport.silent_s`): ``mark.node``, whose ranks trained in the job, has sent
        nothing for its heartbeat timeout or more. It is lost (the heartbeat's NODE_LOST, evict) unless its job
        steps on without a pause (:meth:`_steps_on`): a synchronous job cannot step without the node's ranks,
        so the node computes and only its agent is silent (restarted, upgraded, cut off from Kafka); that is
        logged once per silence, and the node is lost after all if its job then stands, waiting, for the
        heartbeat timeout while the node is still silent. While its peers are within a step that cannot tell,
        nothing is decided: the next mark (each check while the node is silent) decides, up to the time its job
        takes for the steps asked for, plus one, into the silence (twice the timeout at least; then it is lost)."""
        node, silent = mark.node, float(mark.silent_s or 0.0)
        last = mark.ts - silent                    # the node's newest batch: the heartbeat's fault id
        job = self.jobs.get(job_id)
        out: list[FaultEvent] = []
        if job is not None:
            self.read_to(job_id, node, mark.ts)
            if len(job.ranks) > 1:
                out += self._lost(now, job_id, job)     # the fast rule's cases, with its evidence
            if job.lost.get(node, -1.0) >= last:
                return out                              # found lost for this silence
        timeout = self.config.heartbeat_timeout * (job.beats(node) if job is not None else 1.0)
        verdict, why = self._steps_on(job, node, last, timeout, now) if job is not None else ("lost", {})
        if verdict != "steps on" and job is not None and node in job.bye:
            verdict, why = self._after_bye(job_id, job, node, last, silent, timeout, now, why)
            if verdict == "held":
                return out
        if verdict == "wait":
            if silent < why["wait_s"]:
                return out                          # a peer within a step: the next mark decides
            why = {**why, "cause": "its job did not step on without it",
                   "summary": f"; its job made {why['steps_on']} step(s) in {why['wait_s']:g}s"}
        if verdict == "steps on":
            if job.held.get(node) != last:
                job.held[node] = last
                log.warning("node %s has sent no metrics for %.1f s, but job %s made %d steps since its last report "
                            "(%d needed): its ranks compute, only its agent is silent (restarted, or cut off from "
                            "Kafka); not lost", node, silent, job_id, why["steps_on"], why["steps_needed"])
            return out
        if job is not None:
            job.lost[node] = last
        return out + [node_lost(node, job_id or None, last, silent, timeout, now,
                                {"batch_age_s": round(now - last, 3), "decided_by": "its job's worker",
                                 **({"report_interval_s": job.cadence[node].interval}
                                    if job is not None and node in job.cadence else {}), **why},
                                summary=why.get("summary", ""))]

    def _after_bye(self, job_id: str, job: JobView, node: str, last: float, silent: float, timeout: float, now: float,
                   why: dict) -> tuple[str, dict]:
        """``node`` said its agent stops (its goodbye) and its job does not step on: "lost" once every rank of
        its other nodes still heard from stands waiting for it (:meth:`_stood_waiting`), or once it was silent
        for ``heartbeat_bye_grace_s``; else "held" (a pause, a job of long steps: nothing tells a restarting
        agent from a lost node, and the agent said it restarts), logged once per silence."""
        peers = [v for k, v in job.ranks.items() if k[0] != node
                 and now - v.heard < self.config.heartbeat_timeout * job.beats(k[0])]
        if peers and not any(self._computing(job, v) for v in peers) and all(
                self._stood_waiting(job, v, timeout) for v in peers):
            return "lost", {**why, "cause": "its agent said it stops, then its job stood waiting while it stayed "
                                            "silent", "summary": "; its agent said it stops, then its job stood "
                                                                 "waiting for it"}
        grace = self.config.heartbeat_bye_grace_s
        if silent >= grace:
            return "lost", {**why, "cause": "its agent said it stops and did not come back",
                            "summary": f"; its agent said it stops and did not come back within {grace:g}s"}
        if job.held.get(node) != last:
            job.held[node] = last
            log.warning("node %s has sent no metrics for %.1f s since its agent said it stops (a restart, an upgrade);"
                        " job %s does not stand waiting for it: not lost unless it does, or the agent is not back "
                        "within %gs", node, silent, job_id, grace)
        return "held", why

    def _stood_waiting(self, job: JobView, v: RankView, timeout: float) -> bool:
        """Rank ``v`` waits in a collective: its GPUs have drawn a wait's power for ``timeout``, or have spun
        without its step moving for ``timeout`` and two of its steps (the first step after a pause spins its
        GPUs too, for one step or a little more)."""
        if (at := job.wait_power_since.get(v.node)) is not None and v.last_seen - at >= timeout:
            return True
        spun = v.last_seen - job.busy_since.get(v.node, v.last_seen)      # (the node's own clock, both)
        return min(spun, v.stall) >= max(timeout, 2.0 * v.recent_step())

    def _steps_on(self, job: JobView, node: str, last: float, timeout: float, now: float) -> tuple[str, dict]:
        """Whether ``node``'s job steps on while the node is silent: "steps on" where the ranks of its other nodes
        (of the generation the node's ranks were in, heard within their own heartbeat timeout) made more steps
        since the node's last report was taken (:meth:`JobView.moves_since`, per rank) than two report
        intervals of the node hold (a batch lost before its silence), plus two (the step in flight as it fell
        silent, and one more, which the node's ranks took part in); "wait" where they did not yet but one of
        them computes (stood for less than 1.5 steps, its node's GPUs busy and not at a wait's power), or they
        made two steps or more and stand for less than ``timeout`` (a peer's data-loader hiccup): a step may
        yet come; "lost" otherwise (its job stood with it, or no peer vouches for it). A node held as
        stepping on is lost once every such rank has stood, its GPUs not idle, for ``timeout``."""
        mine = [(k, v) for k, v in job.ranks.items() if k[0] == node]
        if not mine:
            return "lost", {"cause": "its ranks left the job"}
        generation = max(mine, key=lambda kv: kv[1].last_seen)[0][1]
        peers = [v for k, v in job.ranks.items() if k[0] != node and k[1] == generation
                 and now - v.heard < self.config.heartbeat_timeout * job.beats(k[0])]
        if not peers:
            return "lost", {"cause": "no other node of its job is heard from"}
        # the steps its job made since the node's last report was taken (this detector's clock: node clocks
        # skew), each rank's moves counted, per rank of the job still heard from
        ahead = job.moves_since(job.heard.get(node, now)) // len(peers)
        steps = [m for v in peers if (m := v.median_step())]
        step = statistics.median(steps) if steps else 1.0
        need = int(-(-2.0 * job.beats(node) // max(step, 0.05))) + 2
        why = {"steps_on": int(ahead), "steps_needed": need}
        computing = [v for v in peers if self._computing(job, v)]
        if ahead >= need:
            if job.held.get(node) == last and not computing and all(
                    v.stall >= timeout and job.gpu_util.get(v.node, (0.0, 0.0))[1] > self._idle_at for v in peers):
                return "lost", {**why, "cause": "its job stepped on, then stood waiting while it stayed silent",
                                "summary": f"; its job {why['steps_on']} steps on, then stood waiting for it"}
            return "steps on", why
        if computing or ahead >= 2 and all(v.stall < timeout for v in peers):
            # (a job that stepped after it fell silent and stands briefly: a hiccup of a peer) decided by the time
            # the steps asked for take, one more for the step in flight, or twice the timeout if that is longer
            # (short of the heartbeat horizon, past which the node's worker sends no more silence marks)
            limit = min(timeout + (need + 1) * step, self.config.heartbeat_horizon - 2 * job.beats(node))
            return "wait", {**why, "wait_s": round(max(2 * timeout, limit), 1)}
        return "lost", {**why, "cause": "its job stopped with it",
                        "summary": f"; its job did not step on without it ({int(ahead)} step(s) since its last report)"}

    def _computing(self, job: JobView, v: RankView) -> bool:
        """Rank ``v`` is within a step (it moved, and stood for less than 1.5 of its steps, its latest three
        included) on busy GPUs that do not draw a wait's power: a step may still come from it."""
        if not v.moved:
            return False
        step = v.recent_step()
        if v.stall >= max(1.5 * step, step + 0.5):
            return False
        if job.gpu_util.get(v.node, (0.0, 0.0))[1] <= self._idle_at:
            return False
        return not self._spins_waiting(job, v.node, v.last_seen)

    def _stands_for_other(self, job: JobView, silent: str, quiet: float, now: float, stood: float) -> bool:
        """The job has stood (since ``stood``, when the latest of its waiting ranks' stops was heard) since another
        node was found lost, or fell silent before ``silent`` did (``quiet`` seconds ago), whether it was found
        lost by the fast rule or is left to the heartbeat timeout, or was lost and is back (``JobView.gone``,
        ``silent`` itself too: the job stands for it, or computes the step it stood at, until its step moves):
        the job waits for that node, and ``silent`` may only be late. Every time here is the detector's clock
        (when a report was taken), never a node's own: the nodes' clocks skew by seconds, and a job that stood
        for a lost node must not look as if it stood later, for the next node whose batch is late."""
        if any(m != silent and (h := job.heard.get(m)) is not None and stood <= h + 2 * self._fast(job, m)
               for m in job.lost):
            return True
        if any(stood <= at + 2 * self._fast(job, m) for m, at in job.gone_heard.items()):
            return True         # (the silent node too: the job stood for its last silence, not for this one)
        for m, heard in job.heard.items():      # the longest silent first
            if now - heard <= quiet:
                break
            if m != silent and any(k[0] == m for k in job.ranks) and stood <= heard + 2 * self._fast(job, m):
                return True
        return False

    def _fast(self, job: JobView, node: str) -> float:
        """How long ``node`` must be silent for the fast rule: ``node_lost_fast_s`` past its next report (one
        report interval, :meth:`JobView.beats`, after its last)."""
        return self.config.node_lost_fast_s + job.beats(node) - 1.0

    def _stands_for_idle(self, job: JobView, silent: str, start: float, waiting) -> bool:
        """Since the job's ranks stopped (``start``), a GPU of the job idled on a node while the waiting ranks'
        GPUs spun: a stuck rank, or a data-loader hiccup, that the job stands for; the ``silent`` node may only
        be late. Once that node's GPUs are busy again (or it is the silent one), every waiting node's GPUs
        drawing a wait's power (:meth:`_spins_waiting`) says the job still waits, and for the silent node
        (without power samples the heartbeat timeout decides)."""
        for m, at in job.idle_to.items():
            if at < start or not all(job.busy_since.get(v.node, at) < at for _, v in waiting if v.node != m):
                continue
            if m == silent and (g := job.gpus.get(m)) is not None and g[1] > 0 and g[2] > 0:
                return True     # its last report: a stuck rank's GPU idle among its node's spinning ones (a hang)
            if m != silent and job.gpu_util[m][0] <= at \
                    or not all(self._spins_waiting(job, v.node, v.last_seen) for _, v in waiting):
                return True
        return False

    def _waits_for(self, job: JobView, v: RankView, quiet: float) -> bool:
        """Rank ``v``, in no declared phase, stands still with its node's GPUs spinning, and began to wait about
        when a node fell silent ``quiet`` seconds ago: its step stopped then, or (the job paused with idle GPUs
        until then) its GPUs took to spinning then, or (at a wait's power) its GPUs took to that power then; not
        a wait that began long before (a barrier while rank 0 saves, a hang), where a node's metrics late for a
        moment say nothing. Standing still means for a step plus half a second (1.5 steps where that is less),
        a step being the median or the latest three (the slow steps after a restore or in an evaluation), or,
        its GPUs drawing a fraction of their stepping power (:meth:`_spins_waiting`), for a second: a job of
        long steps shows its stop in power first. A rank of steps longer than ``_BLIND_STEP_S`` without that
        power evidence (before its third step move) waits for no one the fast rule can tell: its stall says only
        within a step when a wait began, so the heartbeat timeout decides."""
        median = v.median_step() or 1.0
        if v.doing or not v.moved or v.stall < 1.0 or v.node not in job.busy_since \
                or abs(job.gpu_util.get(v.node, (0.0, 0.0))[0] - v.last_seen) > 5.0:
            return False
        share = self._power_share(job, v.node, v.last_seen)
        low = share is not None and share <= self.config.hang_wait_power
        step = v.recent_step()      # its latest steps may be slow
        if v.stall < min(1.5 * step, step + 0.5) and not low or share is None and step > _BLIND_STEP_S:
            return False
        busy = v.last_seen - job.busy_since[v.node]       # both on the rank's node's clock
        if busy < v.stall and share is not None and share >= _COMPUTE_POWER:
            return False        # a pause ended and its GPUs draw what they drew stepping: its first step computes
        if low and (since := job.wait_power_since.get(v.node)) is not None:
            return v.last_seen - since <= quiet + _WAIT_BEGAN_S     # its wait in power began as the node fell silent
        return min(v.stall, busy) <= quiet + max(2.0, 2.0 * median) + 1.0

    def _power_share(self, job: JobView, node: str, ts: float) -> float | None:
        """What the node's GPUs, heard within 2 s of ``ts``, draw as a share of what they drew at its rank's last
        step moves (3 of them at least); None where that cannot be told (no power samples, too few step moves,
        ``hang_wait_power`` 0: the power evidence turned off)."""
        drew = job.step_power.get(node)
        now = job.gpu_power.get(node)
        if self.config.hang_wait_power <= 0 or drew is None or len(drew) < 3 or now is None or abs(now[0] - ts) > 2.0:
            return None
        return now[1] / max(statistics.median(drew), 1e-9)

    def _spins_waiting(self, job: JobView, node: str, ts: float) -> bool:
        """The node's GPUs draw ``hang_wait_power`` or less of their stepping power (:meth:`_power_share`): busy,
        but on a spin-wait kernel, not on compute."""
        share = self._power_share(job, node, ts)
        return share is not None and share <= self.config.hang_wait_power

    def _not_in_collective(self, job: JobView, key: tuple[str, str, int], r: RankView, peers, limit: float) -> bool:
        """Every rank stands still; this node's GPUs idle while at least twice as many nodes' GPUs spin (or,
        the one idle node, while every other node's spin; or its idle GPUs are the job's only ones, every
        other GPU spinning: :meth:`_gpus_apart`), and have done so for the step limit (``limit``: the rank's,
        or ``hang_timeout`` where the spinning GPUs draw a wait's power)."""
        if any(v.stall < min(self.step_limit(v), limit) / 2 for _, v in peers):
            return False
        if not peers:       # one rank reports (a one-node job): its own GPUs are the evidence, one idle among spinning
            if not self._gpus_apart(job, key[0], self._fresh(job, r)):
                return False
        stall, since = job.apart_since.get(key, (None, 0.0))    # kept by _decide for this very batch
        # the node must stay apart for the step limit itself: a job-wide pause (a checkpoint) followed by a
        # one-node data-loader hiccup of a few seconds has a long stall but only a moment of idling alone
        return stall == r.since and r.last_seen - since >= limit and job.apart_last.get(key) == r.last_seen

    def _waits_at_low_power(self, job: JobView, r: RankView) -> bool:
        """The job's nodes heard within 5 s of ``r``'s last sample whose GPUs spin (one at least) all draw a
        wait's power (:meth:`_spins_waiting`): the job stands in a collective, not in a long compute step."""
        fresh = self._fresh(job, r)
        spinning = [n for n in fresh if self._spins(job, n)]
        return bool(spinning) and all(self._spins_waiting(job, n, job.gpu_util[n][0]) for n in spinning)

    def _apart(self, job: JobView, key: tuple[str, str, int], r: RankView) -> float | None:
        """Since when, in this stall of rank ``key``, its node has idled alone (its GPUs idle while at least twice
        as many nodes' spin, or the one idle node while every other node's spin); None: it does not now.
        Kept from the first batch it does, not only once the stall passed the step limit: then a hang was
        named only after twice the limit (the stall's, then the idling's)."""
        fresh = self._fresh(job, r)
        mine = fresh.get(key[0])
        idle = sum(1 for u in fresh.values() if u <= self.config.hang_idle_util)
        busy = sum(1 for u in fresh.values() if u >= self.config.hang_busy_util)
        # (in a job of two nodes, the other one spinning is the whole job waiting for this one: every node of
        # the job heard from within 5 s, not two of many that a replay happened to read at the same moment)
        alone = idle == 1 and busy == len(fresh) - 1 and len(fresh) == len(job.gpu_util)
        if mine is None or (mine > self.config.hang_idle_util or (busy < 2 * idle and not alone)) \
                and not self._gpus_apart(job, key[0], fresh):
            held = job.apart_since.get(key)
            if held is not None and held[0] == r.since \
                    and r.last_seen - job.apart_last.get(key, held[1]) < _APART_GRACE_S:
                return None         # a report in between (a spin sampled with noise) does not end it, nor decide
            job.apart_since.pop(key, None)
            job.apart_last.pop(key, None)
            return None
        job.apart_last[key] = r.last_seen
        return _held_since(job.apart_since, key, r)

    @staticmethod
    def _fresh(job: JobView, r: RankView) -> dict[str, float]:
        """The mean GPU utilisation of the job's nodes heard from within 5 s (sample time) of ``r``'s last sample."""
        return {n: u for n, (ts, u) in job.gpu_util.items() if abs(ts - r.last_seen) <= 5.0}

    @staticmethod
    def _gpus_apart(job: JobView, node: str, fresh: dict[str, float]) -> bool:
        """One rank per GPU: the idle GPUs of the job are all on ``node`` and every other GPU of the job spins (at
        least twice as many, or one against one; a tenth of them at most neither idle nor spinning), among the
        nodes of the job heard from within 5 s (``fresh``; a lost node's last report is not). The stuck rank's
        GPU idles; the waiting ranks, on its node too, spin in the collective (the node's mean says little).
        GPUs that idled while the node's rank stepped (a GPU the job does not use) are left out."""
        count = idle = busy = mine = 0
        for n in fresh:
            g = job.gpus.get(n)
            if g is None:
                return False
            base = min(job.idle_stepping.get(n) or (0,))
            extra = max(0, g[1] - base)
            count, idle, busy = count + g[0] - base, idle + extra, busy + g[2]
            if n == node:
                mine = extra
        # (one idle GPU against one spinning: the whole rest of a two-rank job waits for it, as two nodes do)
        # (a tenth of the other GPUs at most in between, neither idle nor spinning: a spin's utilisation sampled
        # with noise; an evaluation's or a slow step's are all in between)
        return mine > 0 and idle == mine and idle + busy >= count - (count - idle) // 10 \
            and (busy >= 2 * idle or idle == 1 <= busy)

    def _event(self, now: float, job_id: str, key, r: RankView, job: JobView, peers,
               cause: str, limit: float) -> FaultEvent:
        node, generation, rank = key
        waiting = [{"node": k[0], "rank": k[2], "stall_s": round(v.stall, 1),
                    **({"stack": v.stack[:400]} if v.stack else {}),
                    **({"gpu_util": round(job.gpu_util[k[0]][1], 1)} if k[0] in job.gpu_util else {})}
                   for k, v in sorted(peers, key=lambda kv: kv[0])[:8]]
        evidence: dict[str, Any] = {
            "step": r.step, "generation": generation, "last_progress_ts": r.since, "stalled_s": round(r.stall, 3),
            "limit_s": round(limit, 3), "cause": cause, "hang_timeout_s": self.config.hang_timeout,
            "median_step_time_s": r.median_step(), "pid": r.pid or None, "phase": r.doing or None,
            "heartbeat_age_s": r.heartbeat_age, "stopped": r.stopped, "process_state": r.state or None,
            "stack": r.stack or None, "longest_pause_survived_s": round(job.longest_pause, 1),
            "waiting_ranks": waiting,
        }
        if node in job.gpu_util:
            evidence["gpu_util"] = round(job.gpu_util[node][1], 1)
        if r.write_rate is not None:
            evidence["write_bytes_per_s"] = r.write_rate
        if (gpus := job.gpus.get(node)) is not None:
            evidence["gpus_idle"] = f"{gpus[1]} of {gpus[0]}"
        how = {"stuck": "is stuck (" + ("stopped" if r.stopped else f"no heartbeat for {r.heartbeat_age or 0:.0f}s") + ")",
               "behind": "stands still while its peers step on",
               "not in the collective": "idles its GPUs while its peers spin in a collective",
               "pause ceiling": f"and the whole job stand still longer than any pause it survived"}[cause]
        return fault(
            FaultKind.HANG, Severity.CRITICAL, Action.RESTART,
            fault_id=stable_id(job_id, generation, "hang", node, rank, r.since), node=node,
            job=job_id or None, rank=rank, detector="rule.hang", observed_ts=r.last_seen, now=now,
            score=r.stall, threshold=limit, evidence=evidence,
            summary=(f"Rank {rank} of job {job_id} on {node} {how}: at step {r.step:g} for {r.stall:.0f}s "
                     f"(limit {limit:.0f}s)."),
        )
