"""The job state machine of the controller (TOL), as data and one pure function.

States and their transitions (``TRANSITIONS`` is the table; anything else raises
:class:`IllegalTransition`)::

    PENDING ──▶ RUNNING ──▶ COMPLETED
                  │  ▲
                  ▼  │ (relaunched)
               RECOVERING ──▶ FAILED        (restart budget spent, or no node to replace with)

``decide(job, event)`` returns the new job record and the actions to carry out; it touches no
Kafka and no process, so tests drive it directly. The controller writes one lifecycle event per
decision (with the job snapshot) *before* carrying out its actions, which makes every action
idempotent by job generation: on restart the controller sees what it had decided and whether the
launch of that generation already happened.

Policy (what a fault kind does) is the table ``FAULT_POLICY``; a fault on a node that is not in
the job, observed before the current generation started, or already handled is ignored.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from transom.contracts import Action, CheckpointReady, FaultEvent, FaultKind, Tier

__all__ = [
    "JobState", "TRANSITIONS", "IllegalTransition", "FAULT_POLICY", "JobSpec", "Job",
    "Submitted", "Launched", "FaultSeen", "CheckpointSeen", "RanksExited", "StepSeen",
    "Launch", "Stop", "Cordon", "Decision", "decide", "surviving_checkpoint",
]


class JobState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    RECOVERING = "recovering"
    COMPLETED = "completed"
    FAILED = "failed"


TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.FAILED}),
    JobState.RUNNING: frozenset({JobState.RECOVERING, JobState.COMPLETED, JobState.FAILED}),
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.FAILED}),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A decision tried to move a job along an edge that ``TRANSITIONS`` does not have."""


#: What the controller does about each fault kind (the TEE's suggestion is evidence, not orders).
FAULT_POLICY: Mapping[FaultKind, Action] = {
    FaultKind.XID: Action.EVICT,
    FaultKind.GPU_LOST: Action.EVICT,
    FaultKind.NODE_LOST: Action.EVICT,
    FaultKind.HANG: Action.RESTART,
    FaultKind.NAN_LOSS: Action.RESTART,
    FaultKind.RANK_EXIT: Action.RESTART,
    FaultKind.ANOMALY: Action.OBSERVE,
}


@dataclass(frozen=True)
class JobSpec:
    command: tuple[str, ...]
    world_size: int
    max_restarts: int = 5


@dataclass(frozen=True)
class Job:
    """Everything the controller knows about one job; serialised whole into each lifecycle event."""

    job: str
    spec: JobSpec
    state: JobState = JobState.PENDING
    generation: int = -1                      # generation decided most recently (-1: none yet)
    launched_generation: int = -1             # generation whose launch has been carried out
    launched_ts: float = 0.0                  # when the current generation was launched
    nodes: tuple[str, ...] = ()               # rank -> node for the current generation
    spares: tuple[str, ...] = ()
    evicted: tuple[str, ...] = ()
    resume_step: int | None = None
    checkpoint: Mapping[str, Any] | None = None   # newest checkpoint-ready event (as a dict)
    handled_faults: tuple[str, ...] = ()
    restarts: int = 0
    last_step: int = -1                       # newest training step seen in the launched generation
    prev_last_step: int = -1                  # newest step seen in the generation before it
    stepped_generation: int = -1              # newest generation whose first step has been seen
    failure: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["state"] = self.state.value
        d["spec"] = {"command": list(self.spec.command), "world_size": self.spec.world_size,
                     "max_restarts": self.spec.max_restarts}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Job":
        spec = d["spec"]
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        kw["spec"] = JobSpec(tuple(spec["command"]), int(spec["world_size"]), int(spec.get("max_restarts", 5)))
        kw["state"] = JobState(d["state"])
        for name in ("nodes", "spares", "evicted", "handled_faults"):
            kw[name] = tuple(d.get(name, ()))
        return cls(**kw)

    def moved(self, to: JobState, **changes: Any) -> "Job":
        if to != self.state and to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"job {self.job}: {self.state.value} -> {to.value} is not allowed")
        return dataclasses.replace(self, state=to, **changes)


# --------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Submitted:
    nodes: tuple[str, ...]      # every node the job may use: the first world_size run it, the rest are spares


@dataclass(frozen=True)
class Launched:
    generation: int
    ts: float
    handle: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FaultSeen:
    fault: FaultEvent


@dataclass(frozen=True)
class CheckpointSeen:
    ready: CheckpointReady


@dataclass(frozen=True)
class RanksExited:
    generation: int
    codes: Mapping[int, int]    # rank -> exit code, for every rank once all have exited or one failed


@dataclass(frozen=True)
class StepSeen:
    generation: int
    step: int
    ts: float


Event = Union[Submitted, Launched, FaultSeen, CheckpointSeen, RanksExited, StepSeen]


# --------------------------------------------------------------------------- actions

@dataclass(frozen=True)
class Launch:
    generation: int
    nodes: tuple[str, ...]
    resume_step: int | None


@dataclass(frozen=True)
class Stop:
    generation: int


@dataclass(frozen=True)
class Cordon:
    node: str
    reason: str


@dataclass(frozen=True)
class Decision:
    job: Job
    actions: tuple[Any, ...] = ()
    name: str = ""                           # the lifecycle event name; "" = nothing to record
    cause: Mapping[str, Any] = field(default_factory=dict)
    detail: Mapping[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- policy

def surviving_checkpoint(ready: Mapping[str, Any] | None, evicted: tuple[str, ...]) -> int | None:
    """The step of ``ready`` if every rank still has a copy outside the evicted nodes, else None."""
    if not ready:
        return None
    alive: set[int] = set()
    for copy in ready.get("copies", ()):
        if copy["tier"] == Tier.SHARED.value or copy["node"] not in evicted:
            alive.add(int(copy["rank"]))
    return int(ready["step"]) if alive >= set(range(int(ready["world_size"]))) else None


def _relaunch(job: Job, *, evict: str | None, why: str, cause: Mapping[str, Any]) -> Decision:
    if job.restarts >= job.spec.max_restarts:
        failed = job.moved(JobState.FAILED, failure=f"restart budget of {job.spec.max_restarts} spent; last: {why}")
        return Decision(failed, (Stop(job.generation),), "failed", cause, {"reason": failed.failure})
    nodes, spares, evicted, actions = list(job.nodes), list(job.spares), list(job.evicted), [Stop(job.generation)]
    detail: dict[str, Any] = {"reason": why}
    if evict is not None:
        if not spares:
            failed = job.moved(JobState.FAILED, failure=f"node {evict} must be evicted ({why}) and no spare is left")
            return Decision(failed, (Stop(job.generation), Cordon(evict, why)), "failed", cause,
                            {"reason": failed.failure})
        spare = spares.pop(0)
        nodes[nodes.index(evict)] = spare
        evicted.append(evict)
        actions.append(Cordon(evict, why))
        detail.update(evicted=evict, replacement=spare)
    resume = surviving_checkpoint(job.checkpoint, tuple(evicted))
    generation = job.generation + 1
    actions.append(Launch(generation, tuple(nodes), resume))
    detail.update(generation=generation, nodes=nodes, resume_step=resume)
    new = job.moved(JobState.RECOVERING, generation=generation, nodes=tuple(nodes), spares=tuple(spares),
                    evicted=tuple(evicted), resume_step=resume, restarts=job.restarts + 1,
                    prev_last_step=job.last_step)
    return Decision(new, tuple(actions), "relaunching", cause, detail)


def decide(job: Job, event: Event) -> Decision:
    """The pure transition function: ``(job, event) -> Decision(job', actions, lifecycle name)``."""
    if isinstance(event, Submitted):
        if job.state != JobState.PENDING or job.generation >= 0:
            return Decision(job)
        if len(event.nodes) < job.spec.world_size:
            failed = job.moved(JobState.FAILED, failure=f"{job.spec.world_size} ranks need {job.spec.world_size}"
                                                        f" nodes, only {len(event.nodes)} given")
            return Decision(failed, (), "failed", {}, {"reason": failed.failure})
        nodes = tuple(event.nodes[: job.spec.world_size])
        new = dataclasses.replace(job, generation=0, nodes=nodes, spares=tuple(event.nodes[job.spec.world_size:]))
        return Decision(new, (Launch(0, nodes, None),), "launching", {}, {"nodes": list(nodes),
                                                                          "spares": list(new.spares)})

    if isinstance(event, Launched):
        if event.generation != job.generation or job.launched_generation >= event.generation:
            return Decision(job)
        new = job.moved(JobState.RUNNING, launched_generation=event.generation, launched_ts=event.ts)
        return Decision(new, (), "launched", {}, {"generation": event.generation, **event.handle})

    if isinstance(event, CheckpointSeen):
        ready = event.ready
        if ready.job != job.job or (job.checkpoint and job.checkpoint["step"] >= ready.step):
            return Decision(job)
        from transom.contracts import _plain  # the contract's own dict form
        new = dataclasses.replace(job, checkpoint=_plain(ready))
        return Decision(new, (), "checkpoint", {"checkpoint_id": ready.checkpoint_id},
                        {"step": ready.step, "persisted": ready.persisted, "replicated": ready.replicated})

    if isinstance(event, StepSeen):
        if (event.generation == job.launched_generation - 1 and job.stepped_generation < job.launched_generation):
            # late reports of the generation that was just stopped: they count towards steps lost
            return Decision(dataclasses.replace(job, prev_last_step=max(job.prev_last_step, event.step)))
        if event.generation != job.launched_generation or job.state not in (JobState.RUNNING, JobState.RECOVERING):
            return Decision(job)
        if event.generation > job.stepped_generation:
            # the first step of a generation: for a relaunch, this is where recovery ends
            new = dataclasses.replace(job, stepped_generation=event.generation, last_step=event.step)
            name = "resumed" if event.generation > 0 else "first_step"
            detail = {"generation": event.generation, "step": event.step, "resume_step": job.resume_step}
            if event.generation > 0:
                # steps done before the fault that the relaunch has to compute again
                detail["steps_lost"] = max(job.prev_last_step - (job.resume_step or 0), 0)
            return Decision(new, (), name, {}, detail)
        return Decision(dataclasses.replace(job, last_step=max(job.last_step, event.step)))

    if isinstance(event, FaultSeen):
        f = event.fault
        if job.state != JobState.RUNNING or f.fault_id in job.handled_faults or f.resolved:
            return Decision(job)
        if f.node not in job.nodes or f.observed_ts < job.launched_ts:
            return Decision(job)   # not this job's node any more, or older than this generation
        gen = f.evidence.get("generation") if isinstance(f.evidence, Mapping) else None
        if gen is not None and int(gen) != job.launched_generation:
            return Decision(job)
        action = FAULT_POLICY.get(f.kind, f.action)
        handled = (job.handled_faults + (f.fault_id,))[-200:]
        cause = {"fault_id": f.fault_id, "kind": f.kind.value, "node": f.node}
        if action == Action.OBSERVE:
            return Decision(dataclasses.replace(job, handled_faults=handled), (), "fault_observed", cause,
                            {"summary": f.summary})
        job = dataclasses.replace(job, handled_faults=handled)
        why = f.summary or f"{f.kind.value} on {f.node}"
        return _relaunch(job, evict=f.node if action == Action.EVICT else None, why=why, cause=cause)

    if isinstance(event, RanksExited):
        if event.generation != job.launched_generation or job.state != JobState.RUNNING:
            return Decision(job)
        failed = {r: c for r, c in event.codes.items() if c != 0}
        if not failed:
            new = job.moved(JobState.COMPLETED)
            return Decision(new, (), "completed", {}, {"generation": job.generation, "last_step": job.last_step})
        rank = min(failed)
        why = f"rank {rank} on {job.nodes[rank]} exited with code {failed[rank]}"
        return _relaunch(job, evict=None, why=why, cause={"kind": FaultKind.RANK_EXIT.value,
                                                           "node": job.nodes[rank], "rank": rank})
    raise TypeError(f"unknown event {event!r}")
