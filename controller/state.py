"""The job state machine of the controller (TOL), as data and one pure function.

States (``TRANSITIONS`` is the table; anything else raises :class:`IllegalTransition`)::

    PENDING ──▶ PRECHECKING ──▶ RUNNING ──▶ COMPLETED
                    │             │  ▲
                    │             ▼  │ (first step of the new generation)
                    └──────▶  RECOVERING ──▶ FAILED  (budget spent, no node to replace with)

Two recovery paths (``path`` in the lifecycle events ``healing``/``relaunching`` and in the report):

- **in-job** (``HEALING``): the job's ranks joined the elastic API (:mod:`transom.elastic`), a warm
  spare is ready and the fault's kind is in ``IN_JOB_KINDS``: the failed rank is killed (a hung one
  too), its node cordoned when the policy evicts it (else it goes back to the spare pool), the spare
  takes its rank, and the survivors, who keep their processes and state, are told the new group
  (``reforming``: epoch, master, assignment). The first step after it ends the heal (``healed``, with
  its cost in seconds). A survivor that fails meanwhile (it exits, or a fault event names its node:
  a hang, an XID; its node evicted where the policy evicts), or a group that has not stepped within
  ``JobSpec.heal_timeout_s``, falls back to the relaunch (``relaunching`` with ``fallback``).
- **relaunch**: the steps below, from the newest checkpoint.

A recovering job walks the steps of :class:`RecoveryStep` along the table ``RECOVERY_STEPS``
(``EVICTING`` is skipped when nothing is evicted; a fault while RESUMING starts over)::

    HEALING ─▶ (RUNNING)      in-job; its fallback: ─▶ STOPPING
    STOPPING ─▶ EVICTING ─▶ REPLACING ─▶ RELAUNCHING ─▶ RESUMING ─▶ (RUNNING)
                                │  ▲
                                └──┘ a node failed its pre-check: evict it, take another spare

``decide(job, event)`` returns the new job record, the actions to carry out and the lifecycle
event to record; it touches no Kafka and no process. The actions of a job follow from its
state alone (:func:`pending_actions`), and each is idempotent by job generation, so a controller
that restarts from the last recorded snapshot carries out the actions of that step again without
doing anything twice (a launch that already happened is adopted by the backend).

Policy is data: ``FAULT_POLICY`` maps a fault kind and severity to evict, restart or observe;
``JobSpec`` carries the restart budget (``max_restarts`` per ``restart_window_s``), the backoff
between restarts and the smallest world size the job accepts when no spare is left.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from transom.contracts import Action, CheckpointReady, FaultEvent, FaultKind, Severity, Tier, encode

__all__ = [
    "JobState", "RecoveryStep", "TRANSITIONS", "RECOVERY_STEPS", "IllegalTransition", "FAULT_POLICY",
    "policy_for", "IN_JOB_KINDS", "HEAL_PATHS", "JobSpec", "Job", "ElasticJoined", "SpareReady", "ElasticSynced", "HealStarted",
    "HealOverdue", "Heal", "Reconsider", "Then",
    "Submitted", "PrecheckDone", "StepDone", "Launched", "FaultSeen", "CollectiveFailed", "CheckpointSeen",
    "RanksExited", "StepSeen",
    "Cancel", "StartOverdue", "TERMINAL_STATES",
    "Precheck", "Launch", "Stop", "Cordon", "Decision", "decide", "pending_actions", "surviving_checkpoint",
]


class JobState(str, enum.Enum):
    PENDING = "pending"
    PRECHECKING = "prechecking"     # first launch: checking the chosen nodes
    RUNNING = "running"
    RECOVERING = "recovering"       # see Job.step for where in the recovery
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"         # `transom cancel`: every rank stopped


class RecoveryStep(str, enum.Enum):
    HEALING = "healing"             # in-job: a warm spare takes the failed rank, the survivors re-form the group
    STOPPING = "stopping"           # stop every rank of the faulty generation
    EVICTING = "evicting"           # cordon the faulty node(s)
    REPLACING = "replacing"         # pre-check the new node set (spares in place of the evicted)
    RELAUNCHING = "relaunching"     # launch the new generation (after the backoff)
    RESUMING = "resuming"           # launched; waiting for its first training step


TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.PRECHECKING, JobState.FAILED, JobState.CANCELLED}),
    JobState.PRECHECKING: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset({JobState.RECOVERING, JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED}),
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED}),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}
TERMINAL_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})

#: The steps of a recovery and where each may go next (a fault while RESUMING starts a new recovery).
RECOVERY_STEPS: Mapping[RecoveryStep, frozenset[RecoveryStep]] = {
    RecoveryStep.HEALING: frozenset({RecoveryStep.STOPPING}),        # the fallback to a relaunch
    RecoveryStep.STOPPING: frozenset({RecoveryStep.EVICTING, RecoveryStep.REPLACING}),
    RecoveryStep.EVICTING: frozenset({RecoveryStep.REPLACING}),
    RecoveryStep.REPLACING: frozenset({RecoveryStep.RELAUNCHING}),
    RecoveryStep.RELAUNCHING: frozenset({RecoveryStep.RESUMING}),
    RecoveryStep.RESUMING: frozenset({RecoveryStep.STOPPING}),
}


class IllegalTransition(RuntimeError):
    """A decision tried to move a job along an edge that ``TRANSITIONS`` does not have."""


_EVICT_ON_CRITICAL = {Severity.CRITICAL: Action.EVICT, Severity.WARNING: Action.OBSERVE, Severity.INFO: Action.OBSERVE}
_RESTART = {Severity.CRITICAL: Action.RESTART, Severity.WARNING: Action.RESTART, Severity.INFO: Action.OBSERVE}
_OBSERVE = {s: Action.OBSERVE for s in Severity}

#: What the controller does about a fault, by kind and severity (the TEE's suggestion is evidence,
#: not orders). A kind missing here falls back to the fault's own suggested action.
FAULT_POLICY: Mapping[FaultKind, Mapping[Severity, Action]] = {
    FaultKind.XID: _EVICT_ON_CRITICAL,
    FaultKind.GPU_LOST: {s: Action.EVICT for s in Severity},
    FaultKind.NODE_LOST: {**_EVICT_ON_CRITICAL, Severity.WARNING: Action.EVICT},
    FaultKind.HANG: _RESTART,
    FaultKind.NAN_LOSS: _RESTART,
    FaultKind.RANK_EXIT: _RESTART,
    FaultKind.ANOMALY: _OBSERVE,
    FaultKind.STRAGGLER: _EVICT_ON_CRITICAL,   # and only while a spare is free (see decide)
}


#: Faults healed in the job when it can be (ranks joined the elastic API, a warm spare is ready): one rank or node
#: failed and the others' state is good. A NaN loss is not (every replica took the same bad step): relaunch.
IN_JOB_KINDS = frozenset({FaultKind.RANK_EXIT, FaultKind.XID, FaultKind.GPU_LOST, FaultKind.NODE_LOST,
                          FaultKind.HANG, FaultKind.STRAGGLER})
#: ``JobSpec.heal``: "in-job" tries the in-job path first (the default), "relaunch" always relaunches.
HEAL_PATHS = ("in-job", "relaunch")


def policy_for(fault: FaultEvent) -> Action:
    return FAULT_POLICY.get(fault.kind, {}).get(fault.severity, fault.action)


@dataclass(frozen=True)
class JobSpec:
    """What the user asked for, and the job's healing policy."""

    command: tuple[str, ...]
    world_size: int
    max_restarts: int = 5             # relaunches allowed within restart_window_s ...
    restart_window_s: float = 3600.0  # ... after which the job fails with the reason
    backoff_s: float = 1.0            # delay before a restart (not before the first one that replaced a node);
    backoff_max_s: float = 60.0       # doubles with each restart in the window, up to backoff_max_s
    min_world_size: int = 0           # 0: same as world_size (never shrink)
    spares: int = 0                   # spare nodes asked for (fewer free: a warning event)
    report_warn_s: float = 60.0       # no training report from a generation this long after its launch: a warning
    start_timeout_s: float = 600.0    # no first step this long after a launch: that launch failed
    workdir: str = ""                 # the ranks' working directory ("": the backend's own)
    env: Mapping[str, str] = field(default_factory=dict)   # set for the ranks over the backend's environment
    heal: str = "in-job"              # HEAL_PATHS: try the in-job path first, or always relaunch
    heal_timeout_s: float = 60.0      # the in-job path falls back to a relaunch when no step came this long after

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["command"] = list(self.command)
        d["env"] = dict(self.env)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JobSpec":
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        kw["command"] = tuple(d["command"])
        kw["env"] = {str(k): str(v) for k, v in dict(d.get("env") or {}).items()}
        return cls(**kw)

    @property
    def smallest(self) -> int:
        return self.min_world_size or self.world_size


@dataclass(frozen=True)
class Job:
    """Everything the controller knows about one job; serialised whole into each lifecycle event."""

    job: str
    spec: JobSpec
    state: JobState = JobState.PENDING
    step: RecoveryStep | None = None          # where in the recovery, while RECOVERING
    generation: int = -1                      # generation decided most recently (-1: none yet)
    launched_generation: int = -1             # generation whose launch has been carried out
    prechecked_generation: int = -1           # generation whose nodes passed the pre-check
    stop_generation: int = -1                 # generation the recovery stops
    launched_ts: float = 0.0                  # when the current generation was launched
    not_before: float = 0.0                   # the relaunch waits until then (backoff)
    nodes: tuple[str, ...] = ()               # rank -> node for the current generation
    spares: tuple[str, ...] = ()
    evicted: tuple[str, ...] = ()
    to_evict: tuple[str, ...] = ()            # nodes the EVICTING step cordons
    evict_reasons: tuple[str, ...] = ()       # one per to_evict
    resume_step: int | None = None
    checkpoints: tuple[Mapping[str, Any], ...] = ()   # newest checkpoint-ready events (dicts), oldest first
    handled_faults: tuple[str, ...] = ()
    restart_times: tuple[float, ...] = ()     # when each relaunch was decided (within the window)
    restarts: int = 0
    last_step: int = -1                       # newest training step seen in the launched generation
    prev_last_step: int = -1                  # newest step seen in the generation before it
    stepped_generation: int = -1              # newest generation whose first step has been seen
    warned_generation: int = -1               # newest generation warned about for sending no report
    submitted_ts: float = 0.0                 # when the controller accepted it (orders `transom jobs`)
    failure: str = ""
    joined: tuple[int, ...] = ()              # ranks of the launched generation that joined the elastic API
    warm: tuple[str, ...] = ()                # spare nodes whose warm rank (launched generation) is ready
    heal_epoch: int = 0                       # group epoch of the newest in-job heal of this generation
    heal_rank: int = -1                       # the rank it replaced
    heal_step: int = -1                       # newest step seen when it was decided
    heal_ts: float = 0.0                      # when it was decided
    healed_ts: float = 0.0                    # when it ended (faults detected before are about the old group)
    heals: int = 0
    deferred: tuple[Mapping[str, Any], ...] = ()   # stragglers found during the heal (fault events as dicts)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["state"] = self.state.value
        d["step"] = self.step.value if self.step else None
        d["spec"] = self.spec.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Job":
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        kw["spec"] = JobSpec.from_dict(d["spec"])
        kw["state"] = JobState(d["state"])
        kw["step"] = RecoveryStep(d["step"]) if d.get("step") else None
        for name in ("nodes", "spares", "evicted", "to_evict", "evict_reasons", "handled_faults", "restart_times",
                     "checkpoints", "joined", "warm", "deferred"):
            kw[name] = tuple(d.get(name, ()))
        return cls(**kw)

    def moved(self, to: JobState, step: RecoveryStep | None = None, **changes: Any) -> "Job":
        if to != self.state and to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"job {self.job}: {self.state.value} -> {to.value} is not allowed")
        if to == JobState.RECOVERING and self.state == JobState.RECOVERING and step and self.step:
            if step != self.step and step not in RECOVERY_STEPS[self.step]:
                raise IllegalTransition(f"job {self.job}: recovery step {self.step.value} -> {step.value} "
                                        "is not allowed")
        if to == JobState.RECOVERING and step is None:
            raise IllegalTransition(f"job {self.job}: recovering needs a recovery step")
        return dataclasses.replace(self, state=to, step=step if to == JobState.RECOVERING else None, **changes)


# --------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Submitted:
    nodes: tuple[str, ...]      # every node the job may use: the first world_size run it, the rest are spares


@dataclass(frozen=True)
class PrecheckDone:
    generation: int
    failed: Mapping[str, str] = field(default_factory=dict)   # node -> why it failed; empty: all passed


@dataclass(frozen=True)
class StepDone:
    """The actions of recovery step ``step`` of ``generation`` have been carried out."""

    generation: int
    step: RecoveryStep


@dataclass(frozen=True)
class Launched:
    generation: int
    ts: float
    handle: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FaultSeen:
    fault: FaultEvent
    ts: float = 0.0             # when the controller saw it (for the restart window); 0: the fault's time
    deferred: bool = False      # held back during an in-job heal, decided now that the heal ended


@dataclass(frozen=True)
class CheckpointSeen:
    ready: CheckpointReady


@dataclass(frozen=True)
class RanksExited:
    generation: int
    codes: Mapping[int, int]    # rank -> exit code, for every rank once all have exited or one failed
    ts: float = 0.0
    nodes: Mapping[int, str] = field(default_factory=dict)   # rank -> node where the backend knows (Slurm: srun's order)
    logs: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)   # rank -> {"log": path, "tail": [lines]}


@dataclass(frozen=True)
class Cancel:
    """`transom cancel`: stop every rank and end the job."""

    reason: str = "cancelled"


@dataclass(frozen=True)
class StartOverdue:
    """``waited_s`` since ``generation`` was launched and no training step seen (from the service's clock)."""

    generation: int
    waited_s: float
    ts: float = 0.0


@dataclass(frozen=True)
class StepSeen:
    generation: int
    step: int
    ts: float


@dataclass(frozen=True)
class CollectiveFailed:
    """A rank of ``generation`` says its collective failed at ``step``: it finished the steps before it, so the
    generation trains, whether or not the agents' reports of those steps have come yet."""

    generation: int
    step: int
    ts: float


@dataclass(frozen=True)
class ElasticJoined:
    """Rank ``rank`` of ``generation`` joined the elastic API (it can re-form its group in the job)."""

    generation: int
    rank: int


@dataclass(frozen=True)
class SpareReady:
    """The warm spare of ``generation`` on ``node`` waits at the join point."""

    generation: int
    node: str


@dataclass(frozen=True)
class ElasticSynced:
    """The new group of heal ``epoch`` holds one state (its ranks synced at ``step``): the heal is done."""

    generation: int
    epoch: int
    step: int
    ts: float = 0.0


@dataclass(frozen=True)
class HealStarted:
    """The heal's actions are carried out: the spare took the rank; the new group's rendezvous is ``master``."""

    generation: int
    epoch: int
    master: str
    ts: float = 0.0


@dataclass(frozen=True)
class HealOverdue:
    """``waited_s`` since heal ``epoch`` was decided and no step of the new group seen (service's clock)."""

    epoch: int
    waited_s: float
    ts: float = 0.0


Event = Union[ElasticJoined, SpareReady, ElasticSynced, HealStarted, HealOverdue, Submitted, PrecheckDone, StepDone, Launched, FaultSeen, CheckpointSeen, RanksExited, StepSeen, Cancel,
              StartOverdue]


# --------------------------------------------------------------------------- actions

@dataclass(frozen=True)
class Precheck:
    generation: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Launch:
    generation: int
    nodes: tuple[str, ...]
    resume_step: int | None
    not_before: float = 0.0     # epoch seconds; the executor waits until then (restart backoff)


@dataclass(frozen=True)
class Stop:
    generation: int


@dataclass(frozen=True)
class Cordon:
    node: str
    reason: str


@dataclass(frozen=True)
class Heal:
    """Kill rank ``rank`` of ``generation`` if it still runs, give its place to the warm spare on ``node``,
    choose the new group's rendezvous (on ``nodes[0]``, rank 0's node)."""

    generation: int
    epoch: int
    rank: int
    node: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Reconsider:
    """Decide ``fault`` again (as :class:`FaultSeen` with ``deferred``): a straggler found during an in-job
    heal, held back until the new group trains."""

    fault: FaultEvent


@dataclass(frozen=True)
class Then:
    """Decide ``event`` next, once this decision is recorded: one event that makes two lifecycle entries."""

    event: Any


@dataclass(frozen=True)
class Decision:
    job: Job
    actions: tuple[Any, ...] = ()
    name: str = ""                           # the lifecycle event name; "" = nothing to record
    cause: Mapping[str, Any] = field(default_factory=dict)
    detail: Mapping[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- policy

KEEP_CHECKPOINTS = 8


def surviving_checkpoint(checkpoints: tuple[Mapping[str, Any], ...], evicted: tuple[str, ...]) -> int | None:
    """The newest step whose every rank still has a copy outside the evicted nodes (shared storage
    survives any eviction), or None."""
    for ready in sorted(checkpoints, key=lambda r: int(r["step"]), reverse=True):
        alive: set[int] = set()
        for copy in ready.get("copies", ()):
            if copy["tier"] == Tier.SHARED.value or copy["node"] not in evicted:
                alive.add(int(copy["rank"]))
        if alive >= set(range(int(ready["world_size"]))):
            return int(ready["step"])
    return None


def pending_actions(job: Job) -> tuple[Any, ...]:
    """The actions the job's current state asks for (all idempotent: safe to carry out again)."""
    if job.state == JobState.PRECHECKING:
        if job.prechecked_generation < job.generation:
            return (Precheck(job.generation, job.nodes),)
        if job.launched_generation < job.generation:
            return (Launch(job.generation, job.nodes, job.resume_step),)
        return ()
    if job.state in (JobState.FAILED, JobState.CANCELLED):
        return (Stop(job.launched_generation),) if job.launched_generation >= 0 else ()
    if job.state != JobState.RECOVERING:
        return ()
    if job.step == RecoveryStep.HEALING:
        return (Heal(job.launched_generation, job.heal_epoch, job.heal_rank, job.nodes[job.heal_rank], job.nodes),)
    if job.step == RecoveryStep.STOPPING:
        return (Stop(job.stop_generation),)
    if job.step == RecoveryStep.EVICTING:
        return tuple(Cordon(n, r) for n, r in zip(job.to_evict, job.evict_reasons))
    if job.step == RecoveryStep.REPLACING:
        return (Precheck(job.generation, job.nodes),)
    if job.step == RecoveryStep.RELAUNCHING:
        return (Launch(job.generation, job.nodes, job.resume_step, job.not_before),)
    return ()


def _decision(job: Job, name: str, cause: Mapping[str, Any] | None = None,
              detail: Mapping[str, Any] | None = None) -> Decision:
    return Decision(job, pending_actions(job), name, dict(cause or {}), dict(detail or {}))


def _first_step(job: Job, generation: int, step: int | None) -> dict[str, Any]:
    """The detail of a generation's first step (``first_step``, or ``resumed`` after a relaunch)."""
    detail: dict[str, Any] = {"generation": generation, "step": step, "resume_step": job.resume_step}
    if generation > 0:
        # steps done before the fault that the relaunch has to compute again
        detail["steps_lost"] = max(job.prev_last_step - (job.resume_step or 0), 0)
    return detail


def _fail(job: Job, why: str, cause: Mapping[str, Any] | None = None) -> Decision:
    failed = job.moved(JobState.FAILED, failure=why)
    return _decision(failed, "failed", cause, {"reason": why})


def _replace(job: Job, bad: Mapping[str, str]) -> tuple[list[str], list[str], dict[str, Any]] | str:
    """New (nodes, spares, detail) with every ``bad`` node replaced by a spare or dropped; or why not."""
    nodes, spares = list(job.nodes), [s for s in job.spares if s not in bad]
    detail: dict[str, Any] = {}
    for node in bad:
        if node not in nodes:
            continue
        if spares:
            spare = spares.pop(0)
            nodes[nodes.index(node)] = spare
            detail.setdefault("replacements", {})[node] = spare
        elif len(nodes) - 1 >= job.spec.smallest:
            nodes.remove(node)
            detail.setdefault("dropped", []).append(node)
        else:
            return (f"node {node} must be evicted ({bad[node]}) and no spare is left"
                    + (f" (the job may not shrink below {job.spec.smallest} ranks)" if job.spec.min_world_size else ""))
    return nodes, spares, detail


def _recover(job: Job, *, evict: str | None, why: str, cause: Mapping[str, Any], now: float,
             not_in_job: str = "") -> Decision:
    recent = tuple(t for t in job.restart_times if now - t < job.spec.restart_window_s)
    if len(recent) >= job.spec.max_restarts:
        return _fail(job, f"restart budget of {job.spec.max_restarts} per {job.spec.restart_window_s:.0f}s "
                          f"spent; last: {why}", cause)
    bad = {evict: why} if evict else {}
    replaced = _replace(job, bad)
    if isinstance(replaced, str):
        failed = _fail(job, replaced, cause)
        # still keep the faulty node out of every later launch
        return dataclasses.replace(failed, actions=failed.actions + (Cordon(evict, why),) if evict else failed.actions)
    nodes, spares, detail = replaced
    evicted = job.evicted + ((evict,) if evict else ())
    resume = surviving_checkpoint(job.checkpoints, evicted)
    # a restart on the same nodes (a crash, a hang) waits from the first one on: a script that fails at
    # start must not be relaunched in a tight loop; the first restart that replaced a node does not wait
    doublings = len(recent) - (1 if evict else 0)
    backoff = 0.0 if doublings < 0 else min(job.spec.backoff_s * 2 ** doublings, job.spec.backoff_max_s)
    generation = job.generation + 1
    new = job.moved(JobState.RECOVERING, RecoveryStep.STOPPING, generation=generation, nodes=tuple(nodes),
                    spares=tuple(spares), evicted=evicted, to_evict=(evict,) if evict else (),
                    evict_reasons=(why,) if evict else (), resume_step=resume,
                    stop_generation=job.launched_generation, restarts=job.restarts + 1,
                    restart_times=recent + (now,), not_before=now + backoff, prev_last_step=job.last_step,
                    joined=(), warm=(), deferred=())
    out: dict[str, Any] = {"reason": why, "path": "relaunch"}
    if not_in_job:
        out["not_in_job"] = not_in_job          # why the in-job path could not take this fault
    if job.step == RecoveryStep.HEALING:
        out["fallback"] = f"in-job heal epoch {job.heal_epoch} did not complete"
    if evict:
        out["evicted"] = evict
        if evict in detail.get("replacements", {}):
            out["replacement"] = detail["replacements"][evict]
    if detail.get("dropped"):
        out["dropped"] = detail["dropped"]
    out.update(generation=generation, nodes=nodes, resume_step=resume, backoff_s=backoff,
               checkpoint_id=f"{job.job}@{resume}" if resume is not None else None)
    return _decision(new, "relaunching", cause, out)


def can_heal(job: Job, kind: FaultKind, rank: int) -> str:
    """Why the in-job path cannot take this fault ("" when it can)."""
    if job.spec.heal != "in-job":
        return "the job's heal policy is relaunch"
    if kind not in IN_JOB_KINDS:
        return f"{kind.value} is not healed in the job"
    if job.state != JobState.RUNNING or job.stepped_generation < job.launched_generation:
        return "the job is not training"
    if not 0 <= rank < len(job.nodes):
        return "the failed rank is unknown"
    if set(job.joined) < set(range(len(job.nodes))):
        return "not every rank joined the elastic API"
    if not [n for n in job.warm if n in job.spares]:
        return "no warm spare is ready"
    return ""


def _heal(job: Job, rank: int, *, evict: bool, why: str, cause: Mapping[str, Any], now: float) -> Decision:
    failed = job.nodes[rank]
    spare = next(n for n in job.warm if n in job.spares)
    nodes = list(job.nodes)
    nodes[rank] = spare
    spares = [n for n in job.spares if n != spare] + ([] if evict else [failed])   # a healthy node: a spare again
    epoch = job.heal_epoch + 1
    new = job.moved(JobState.RECOVERING, RecoveryStep.HEALING, nodes=tuple(nodes), spares=tuple(spares),
                    warm=tuple(n for n in job.warm if n != spare), heal_epoch=epoch, heal_rank=rank,
                    heal_step=job.last_step, heal_ts=now, heals=job.heals + 1,
                    evicted=job.evicted + ((failed,) if evict else ()))
    actions = ((Cordon(failed, why),) if evict else ()) + pending_actions(new)
    detail = {"path": "in-job", "reason": why, "generation": job.launched_generation, "epoch": epoch,
              "rank": rank, "failed_node": failed, "spare": spare, "nodes": nodes, "step": job.last_step}
    if evict:
        detail["evicted"] = failed
    return Decision(new, actions, "healing", dict(cause), detail)


def _handled(job: Job, f: FaultEvent) -> tuple[str, ...]:
    """The job's handled fault ids with ``f``'s (the newest 200: a redelivered event is dropped by id)."""
    return (job.handled_faults + (f.fault_id,))[-200:]


def _cause(f: FaultEvent) -> dict[str, Any]:
    """A decision's cause when a fault event makes it."""
    return {"fault_id": f.fault_id, "kind": f.kind.value, "severity": f.severity.value, "node": f.node}


def _held_without(job: Job, f: FaultEvent) -> tuple[Mapping[str, Any], ...]:
    """The job's deferred faults less ``f`` (the same tuple when ``f`` is not held)."""
    return tuple(d for d in job.deferred if d.get("fault_id") != f.fault_id)


def _fault_during_heal(job: Job, f: FaultEvent, now: float) -> Decision:
    """A fault on a node of the group being re-formed: a rank that is lost or stuck never joins, so the
    heal falls back to the relaunch now rather than after ``heal_timeout_s`` (evicting the node where the
    policy evicts). A straggler to evict is held back (``deferred``) and decided once the heal ends: the
    group can re-form with a slow node, and the TEE reports an ongoing straggler once. A warning or a
    fault decided before the heal started changes nothing."""
    gen = f.evidence.get("generation") if isinstance(f.evidence, Mapping) else None
    action = policy_for(f)
    if f.kind == FaultKind.STRAGGLER and action == Action.EVICT:
        held = _held_without(job, f)
        if f.resolved:                                      # it ended before the heal did
            return Decision(dataclasses.replace(job, deferred=held))
        if (f.node not in job.nodes or f.fault_id in job.handled_faults or len(held) != len(job.deferred)
                or (gen is not None and int(gen) != job.launched_generation)):
            return Decision(job)
        new = dataclasses.replace(job, deferred=job.deferred + (json.loads(encode(f)),))
        return Decision(new, (), "fault_observed", _cause(f),
                        {"summary": f.summary, "deferred": f"until in-job heal epoch {job.heal_epoch} ends"})
    if (f.node not in job.nodes or f.fault_id in job.handled_faults or f.resolved or f.detected_ts < job.heal_ts
            or (gen is not None and int(gen) != job.launched_generation)
            or action == Action.OBSERVE or f.kind == FaultKind.STRAGGLER):
        return Decision(job)
    job = dataclasses.replace(job, handled_faults=_handled(job, f))
    why = f"{f.summary or f'{f.kind.value} on {f.node}'} (during in-job heal epoch {job.heal_epoch})"
    return _recover(job, evict=f.node if action == Action.EVICT else None, why=why, cause=_cause(f), now=now)


def _on_precheck(job: Job, ev: PrecheckDone) -> Decision:
    if ev.generation != job.generation or job.prechecked_generation >= ev.generation:
        return Decision(job)
    if not (job.state == JobState.PRECHECKING or job.step == RecoveryStep.REPLACING):
        return Decision(job)
    if not ev.failed:
        new = dataclasses.replace(job, prechecked_generation=ev.generation)
        if job.state == JobState.RECOVERING:
            new = new.moved(JobState.RECOVERING, RecoveryStep.RELAUNCHING)
        return _decision(new, "precheck_passed", {}, {"generation": ev.generation, "nodes": list(job.nodes)})
    bad = {n: r for n, r in ev.failed.items() if n in job.nodes}
    replaced = _replace(job, bad)
    cause = {"precheck": dict(ev.failed)}
    if isinstance(replaced, str):
        failed = _fail(job, f"pre-check failed: {replaced}", cause)
        return dataclasses.replace(failed, actions=failed.actions + tuple(Cordon(n, r) for n, r in bad.items()))
    nodes, spares, detail = replaced
    evicted = job.evicted + tuple(bad)
    new = dataclasses.replace(job, nodes=tuple(nodes), spares=tuple(spares), evicted=evicted,
                              resume_step=surviving_checkpoint(job.checkpoints, evicted))
    # evict the failed nodes now, then the actions of the (unchanged) state: pre-check the new set
    actions = tuple(Cordon(n, f"pre-check: {r}") for n, r in bad.items()) + pending_actions(new)
    return Decision(new, actions, "precheck_failed", cause,
                    {"generation": job.generation, "failed": dict(ev.failed), "nodes": nodes, **detail})


#: Recovery steps before the relaunch starts: a checkpoint completed now still moves the resume point.
_BEFORE_LAUNCH = frozenset({RecoveryStep.STOPPING, RecoveryStep.EVICTING, RecoveryStep.REPLACING})


def decide(job: Job, event: Event) -> Decision:
    """The pure transition function: ``(job, event) -> Decision(job', actions, lifecycle name)``."""
    if isinstance(event, Submitted):
        if job.state != JobState.PENDING or job.generation >= 0:
            return Decision(job)
        if len(event.nodes) < job.spec.world_size:
            return _fail(job, f"{job.spec.world_size} ranks need {job.spec.world_size} nodes, "
                              f"only {len(event.nodes)} given")
        nodes = tuple(event.nodes[: job.spec.world_size])
        new = job.moved(JobState.PRECHECKING, generation=0, nodes=nodes,
                        spares=tuple(event.nodes[job.spec.world_size:]))
        return _decision(new, "prechecking", {}, {"generation": 0, "nodes": list(nodes), "spares": list(new.spares)})

    if isinstance(event, PrecheckDone):
        return _on_precheck(job, event)

    if isinstance(event, ElasticJoined):
        if event.generation != job.launched_generation or event.rank in job.joined:
            return Decision(job)
        return Decision(dataclasses.replace(job, joined=tuple(sorted(job.joined + (event.rank,)))))

    if isinstance(event, SpareReady):
        if event.generation != job.launched_generation or event.node in job.warm or event.node not in job.spares:
            return Decision(job)
        new = dataclasses.replace(job, warm=job.warm + (event.node,))
        return Decision(new, (), "spare_ready", {}, {"node": event.node, "generation": event.generation,
                                                     "warm": list(new.warm)})

    if isinstance(event, HealStarted):
        if job.step != RecoveryStep.HEALING or event.epoch != job.heal_epoch or event.generation != job.launched_generation:
            return Decision(job)
        return Decision(job, (), "reforming", {}, {
            "path": "in-job", "generation": event.generation, "epoch": event.epoch, "master": event.master,
            "world": len(job.nodes), "nodes": list(job.nodes), "assign": {job.nodes[job.heal_rank]: job.heal_rank},
            "rank": job.heal_rank})

    if isinstance(event, HealOverdue):
        if job.step != RecoveryStep.HEALING or event.epoch != job.heal_epoch or event.waited_s < job.spec.heal_timeout_s:
            return Decision(job)
        return _recover(job, evict=None, why=f"the group did not re-form within {job.spec.heal_timeout_s:.0f}s "
                                              f"of in-job heal epoch {job.heal_epoch}",
                        cause={"kind": "heal_timeout"}, now=event.ts)

    if isinstance(event, StepDone):
        if job.state != JobState.RECOVERING or event.generation != job.generation or event.step != job.step:
            return Decision(job)
        if job.step == RecoveryStep.STOPPING:
            nxt = RecoveryStep.EVICTING if job.to_evict else RecoveryStep.REPLACING
            new = job.moved(JobState.RECOVERING, nxt)
            return _decision(new, nxt.value, {}, {"generation": job.generation, "stopped": job.stop_generation,
                                                  "evict": list(job.to_evict)})
        if job.step == RecoveryStep.EVICTING:
            new = job.moved(JobState.RECOVERING, RecoveryStep.REPLACING)
            return _decision(new, "replacing", {}, {"generation": job.generation, "nodes": list(job.nodes),
                                                    "evicted": list(job.to_evict)})
        return Decision(job)

    if isinstance(event, Launched):
        if event.generation != job.generation or job.launched_generation >= event.generation:
            return Decision(job)
        changes = dict(launched_generation=event.generation, launched_ts=event.ts)
        if job.state == JobState.PRECHECKING:
            new = job.moved(JobState.RUNNING, **changes)
        elif job.step == RecoveryStep.RELAUNCHING:
            new = job.moved(JobState.RECOVERING, RecoveryStep.RESUMING, **changes)
        else:
            return Decision(job)
        return _decision(new, "launched", {}, {"generation": event.generation, **event.handle})

    if isinstance(event, CheckpointSeen):
        ready = event.ready
        if ready.job != job.job or any(int(r["step"]) == ready.step for r in job.checkpoints):
            return Decision(job)
        if ready.generation < job.launched_generation:
            # written by a launch that was replaced (a host cut off, then back): not a resume point
            return Decision(job, (), "", {}, {"stale_generation": ready.generation, "step": ready.step})
        from transom.contracts import _plain  # the contract's own dict form
        kept = sorted(job.checkpoints + (_plain(ready),), key=lambda r: int(r["step"]))[-KEEP_CHECKPOINTS:]
        new = dataclasses.replace(job, checkpoints=tuple(kept))
        detail = {"step": ready.step, "persisted": ready.persisted, "replicated": ready.replicated}
        if job.state == JobState.RECOVERING and job.step in _BEFORE_LAUNCH:
            # a save that was in flight when the fault came completed (its daemons finish it): the
            # relaunch has not started yet, so it resumes from there instead of an interval earlier
            resume = surviving_checkpoint(new.checkpoints, job.evicted)
            if resume is not None and (job.resume_step is None or resume > job.resume_step):
                new = dataclasses.replace(new, resume_step=resume)
                detail["resume_step"] = resume
        return Decision(new, (), "checkpoint", {"checkpoint_id": ready.checkpoint_id}, detail)

    if isinstance(event, CollectiveFailed):
        done = event.step - 1
        if event.generation != job.launched_generation or done <= (job.resume_step or 0):
            return Decision(job)
        # a crash seconds after a launch, before the first step report, heals in the job
        return decide(job, StepSeen(event.generation, done, event.ts))

    if isinstance(event, StepSeen) and job.step == RecoveryStep.HEALING:
        if event.generation != job.launched_generation:
            return Decision(job)
        return Decision(dataclasses.replace(job, last_step=max(job.last_step, event.step)))

    if isinstance(event, ElasticSynced):
        if job.step != RecoveryStep.HEALING or event.generation != job.launched_generation \
                or event.epoch != job.heal_epoch:
            return Decision(job)
        new = job.moved(JobState.RUNNING, healed_ts=event.ts)
        again = tuple(Reconsider(FaultEvent.from_dict(d)) for d in job.deferred)
        return Decision(new, again, "healed", {}, {
            "path": "in-job", "generation": job.launched_generation, "epoch": job.heal_epoch, "rank": job.heal_rank,
            "node": job.nodes[job.heal_rank], "step": event.step, "seconds": round(event.ts - job.heal_ts, 3),
            "steps_redone": 1})

    if isinstance(event, StepSeen):
        if (event.generation == job.launched_generation - 1 and job.stepped_generation < job.launched_generation):
            # late reports of the generation that was just stopped: they count towards steps lost
            return Decision(dataclasses.replace(job, prev_last_step=max(job.prev_last_step, event.step)))
        if event.generation != job.launched_generation or job.state not in (JobState.RUNNING, JobState.RECOVERING):
            return Decision(job)
        if job.state == JobState.RECOVERING and job.step != RecoveryStep.RESUMING:
            return Decision(job)
        if event.generation > job.stepped_generation:
            # the first step of a generation: for a relaunch, this is where recovery ends
            changes = dict(stepped_generation=event.generation, last_step=event.step)
            new = job.moved(JobState.RUNNING, **changes) if job.state == JobState.RECOVERING \
                else dataclasses.replace(job, **changes)
            name = "resumed" if event.generation > 0 else "first_step"
            return Decision(new, (), name, {}, _first_step(job, event.generation, event.step))
        return Decision(dataclasses.replace(job, last_step=max(job.last_step, event.step)))

    if isinstance(event, FaultSeen):
        f = event.fault
        if (f.node in job.spares and f.node not in job.nodes and policy_for(f) == Action.EVICT
                and job.state not in TERMINAL_STATES and f.fault_id not in job.handled_faults and not f.resolved):
            # a spare node (one a heal just gave back to the pool, its XID a second late): out of the pool
            why = f.summary or f"{f.kind.value} on {f.node}"
            new = dataclasses.replace(job, spares=tuple(n for n in job.spares if n != f.node),
                                      warm=tuple(n for n in job.warm if n != f.node), evicted=job.evicted + (f.node,),
                                      handled_faults=_handled(job, f))
            return Decision(new, (Cordon(f.node, why),), "spare_evicted",
                            {"fault_id": f.fault_id, "kind": f.kind.value, "node": f.node}, {"node": f.node, "reason": why})
        if job.step == RecoveryStep.HEALING:
            return _fault_during_heal(job, f, event.ts or f.detected_ts)
        if event.deferred:                 # a straggler held back during the heal: decided now, once
            held = _held_without(job, f)
            if len(held) == len(job.deferred):
                return Decision(job)
            job = dataclasses.replace(job, deferred=held)
        live = job.state == JobState.RUNNING or job.step == RecoveryStep.RESUMING
        if not live or f.fault_id in job.handled_faults or f.resolved:
            return Decision(job)
        # not this job's node any more, or decided before this generation was launched: the TEE's decision
        # time, not the sample's, which is the node's clock (one running 5 s behind would otherwise have
        # its faults of a generation's first 5 s ignored); a deferred one was decided during the heal
        if f.node not in job.nodes or (f.detected_ts < max(job.launched_ts, job.healed_ts) and not event.deferred):
            return Decision(job)
        gen = f.evidence.get("generation") if isinstance(f.evidence, Mapping) else None
        if gen is not None and int(gen) != job.launched_generation:
            return Decision(job)
        action = policy_for(f)
        handled = _handled(job, f)
        cause = _cause(f)
        job = dataclasses.replace(job, handled_faults=handled)
        if action == Action.EVICT and f.kind == FaultKind.STRAGGLER and not job.spares:
            # a slow node still trains: never shrink or fail a job for one, keep it until a spare is free
            return Decision(job, (), "fault_observed", cause, {"summary": f.summary, "kept": "no spare node"})
        if action == Action.OBSERVE:
            return Decision(job, (), "fault_observed", cause, {"summary": f.summary})
        why = f.summary or f"{f.kind.value} on {f.node}"
        blocked = can_heal(job, f.kind, job.nodes.index(f.node))
        if not blocked:
            return _heal(job, job.nodes.index(f.node), evict=action == Action.EVICT, why=why, cause=cause,
                         now=event.ts or f.detected_ts)
        return _recover(job, evict=f.node if action == Action.EVICT else None, why=why, cause=cause,
                        now=event.ts or f.detected_ts, not_in_job=blocked)

    if isinstance(event, RanksExited):
        if job.step == RecoveryStep.HEALING and event.generation == job.launched_generation:
            failed = {r: c for r, c in event.codes.items() if c != 0}
            if not failed:
                return Decision(job)
            rank = min(failed)
            why = (f"rank {rank} on {event.nodes.get(rank) or job.nodes[rank]} exited with code {failed[rank]} "
                   f"during in-job heal epoch {job.heal_epoch}")
            return _recover(job, evict=None, why=why, now=event.ts,
                            cause={"kind": FaultKind.RANK_EXIT.value, "rank": rank, "node": job.nodes[rank]})
        live = job.state == JobState.RUNNING or job.step == RecoveryStep.RESUMING
        if event.generation != job.launched_generation or not live:
            return Decision(job)
        failed = {r: c for r, c in event.codes.items() if c != 0}
        unseen = job.launched_generation > max(job.stepped_generation, 0)
        if not failed and job.step == RecoveryStep.RESUMING and unseen:
            # the relaunched generation ran to its end before this controller saw a step of it (one that took
            # over while it ran): it resumed, and it completed; when it first stepped is not known
            new = job.moved(JobState.RUNNING, stepped_generation=job.launched_generation)
            return Decision(new, (Then(event),), "resumed", {},
                            {**_first_step(job, job.launched_generation, None), "seen": "exit"})
        if not failed:
            new = job.moved(JobState.COMPLETED)
            return Decision(new, (), "completed", {}, {"generation": job.generation, "last_step": job.last_step})
        rank = min(failed)
        node = event.nodes.get(rank) or job.nodes[rank]
        why = f"rank {rank} on {node} exited with code {failed[rank]}"
        log = event.logs.get(rank) or {}
        cause = {"kind": FaultKind.RANK_EXIT.value, "node": node, "rank": rank, **log}
        if log.get("log"):
            why += f" (log: {log['log']})"
        if failed[rank] > 0 and job.stepped_generation < 0:
            # the script itself failed before it ever trained (a typo, a missing file): relaunching it
            # cannot help; say where its output is
            tail = " | ".join(log.get("tail", ())[-3:])
            return _fail(job, f"{why} before its first training step" + (f"; last lines: {tail}" if tail else ""),
                         cause)
        blocked = can_heal(job, FaultKind.RANK_EXIT, rank) if len(failed) == 1 else f"{len(failed)} ranks exited"
        if not blocked:
            return _heal(job, rank, evict=False, why=why, cause=cause, now=event.ts)
        return _recover(job, evict=None, why=why, now=event.ts, cause=cause, not_in_job=blocked)

    if isinstance(event, Cancel):
        if job.state in TERMINAL_STATES:
            return Decision(job)
        new = job.moved(JobState.CANCELLED, failure=event.reason)
        return _decision(new, "cancelled", {}, {"reason": event.reason})

    if isinstance(event, StartOverdue):
        live = job.state == JobState.RUNNING or job.step == RecoveryStep.RESUMING
        if not live or event.generation != job.launched_generation or job.stepped_generation >= event.generation:
            return Decision(job)
        if event.waited_s >= job.spec.start_timeout_s:
            why = (f"generation {event.generation} did not reach its first training step within "
                   f"{job.spec.start_timeout_s:.0f}s of its launch (stuck in rendezvous, pods Pending, a "
                   "scheduler queue, or a script that never calls report())")
            return _recover(job, evict=None, why=why, now=event.ts, cause={"kind": "start_timeout"})
        if event.waited_s >= job.spec.report_warn_s and job.warned_generation < event.generation:
            new = dataclasses.replace(job, warned_generation=event.generation)
            return Decision(new, (), "warning", {}, {
                "generation": event.generation,
                "warning": f"no training report from generation {event.generation} within "
                           f"{job.spec.report_warn_s:.0f}s of its launch: hang detection is off until the "
                           "script calls transom's report() (docs: README, 'Run your own script'); the launch "
                           f"fails after {job.spec.start_timeout_s:.0f}s without one"})
        return Decision(job)
    raise TypeError(f"unknown event {event!r}")
