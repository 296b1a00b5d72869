"""The controller service: holds the lease, replays ``transom.lifecycle``, then drives jobs.

Order of work for every decision (see :mod:`transom.controller.state`): decide, record the
lifecycle event with the job's new snapshot (flushed to the broker), then carry out the actions,
then feed their outcome back (``StepDone``, ``PrecheckDone``, ``Launched``). A controller killed
anywhere in between finds, on restart, the snapshot of the step it was in and carries out that
step's actions again (:func:`~transom.controller.state.pending_actions`); every action is
idempotent by job generation (a launch that already happened is adopted), so nothing is done
twice and nothing is lost.

Only the lease holder (:mod:`transom.controller.lease`) replays and acts; a standby keeps its
node-health view warm from ``transom.metrics`` and takes over when the lease lapses.

Inputs: ``transom.faults`` and ``transom.checkpoints`` from their beginning (decisions are
idempotent by fault id and checkpoint step), ``transom.metrics`` from now on (training steps and
node health for the pre-check), rank exits polled from the backend (every ``poll_interval``, and at
once, then every :data:`HURRY_EVERY_S` for :data:`HURRY_FOR_S`, when a rank says its collective
failed: a peer is gone), and the ranks' words of the elastic API on ``transom.lifecycle`` (key
``__elastic__JOB``: ``elastic_joined``, ``spare_ready``, ``elastic_synced``, ``collective_failed``;
:mod:`transom.elastic`). While a job that heals in the job runs, the service keeps a warm spare on
each of its spare nodes (:meth:`Controller._keep_spares`); a rank's word is also when it looks.

Fault events are checked before anything is done with them (:meth:`Controller._on_fault`): with
fault authentication on (``TRANSOM_FAULT_PRINCIPALS``, :mod:`transom.security`) a fault whose
principal is not listed or whose HMAC does not verify goes to ``transom.deadletter`` with the
reason; so does a fault whose node is not a plain node name (letters, digits, ``.``, ``_``,
``-``); a fault naming a node that does not run the job is ignored with a warning. Nothing taken
from an event is ever run through a shell: backends start argv lists.

Test hook: ``TRANSOM_TEST_CRASH_AT=STEP`` (off by default; for crash-safety tests only) makes the
controller SIGKILL itself right after carrying out the actions of ``STEP`` (a recovery step such
as ``evicting`` or ``relaunching``, or ``prechecking``), before their outcome is recorded.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, TopicPartition

from transom import contracts
from transom.contracts import ContractError, Source
from transom.kafka import (QUIET_FETCH_WAIT_MS, RECOVERY_FETCH_WAIT_MS, DeadLetterWriter, client_config, make_producer,
                           publish, read_topic)
from transom.log import get
from transom.security import FaultVerifier, fault_verifier, valid_name

from .backend import Backend
from .health import HealthBook
from .lease import LEASE_KEY, Lease, LeaseLost
from .state import (TERMINAL_STATES, Cancel, CheckpointSeen, CollectiveFailed, Cordon, Decision, ElasticJoined,
                    ElasticSynced, FaultSeen, Heal, HealOverdue, HealStarted, Job, JobSpec, JobState, Launch, Launched,
                    Precheck, PrecheckDone, RanksExited, Reconsider, RecoveryStep, SpareReady, StartOverdue, StepDone,
                    StepSeen, Stop, Submitted, Then, decide, pending_actions)

__all__ = ["Controller", "PrecheckConfig", "replay", "job_of", "CRASH_ENV", "NODES_KEY", "request_key"]

log = get("controller")
TERMINAL = TERMINAL_STATES
CRASH_ENV = "TRANSOM_TEST_CRASH_AT"
EXIT_LEASE_LOST = 3
#: after a rank's ``collective_failed``: look at the ranks every HURRY_EVERY_S for HURRY_FOR_S seconds (a
#: backend may record the exit a moment after the survivors saw their peer go)
HURRY_EVERY_S = 0.05
HURRY_FOR_S = 2.0


#: Lifecycle key of the node view the controller publishes and of the operators' node requests.
NODES_KEY = "__nodes__"


def request_key(job: str) -> str:
    """Lifecycle key of ``transom run``/``cancel`` requests for ``job``: not the job's own key, so a
    request never shadows the job's snapshot when the broker compacts the topic."""
    return f"__request__{job}"


def replay(bootstrap: str) -> tuple[dict[str, Job], dict[str, int]]:
    """Jobs and their next lifecycle seq, rebuilt from the lifecycle topic."""
    jobs: dict[str, Job] = {}
    seqs: dict[str, int] = {}
    for key, value, _p, _o in read_topic(bootstrap, contracts.LIFECYCLE):
        if key is None or key.startswith(b"__"):           # the lease, the node view
            continue
        try:
            ev = contracts.decode(contracts.LIFECYCLE, value)
        except ContractError as exc:
            log.warning("skipping a malformed lifecycle event: %s", exc)
            continue
        if ev.snapshot and ev.seq >= seqs.get(ev.job, 0):
            seqs[ev.job] = ev.seq + 1
            job = job_of(ev)
            if job is None:
                jobs.pop(ev.job, None)          # its newest word is unreadable: not driven from an older one
            else:
                jobs[ev.job] = job
    return jobs, seqs


def job_of(ev: contracts.LifecycleEvent) -> Job | None:
    """The job a lifecycle event's snapshot holds; None, with a warning, when the snapshot is not one this
    controller wrote (another tool's, a newer version's): that job is left alone, every other one goes on."""
    try:
        return Job.from_dict(ev.snapshot)
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("skipping lifecycle event %d of job %s: its snapshot is not a job (%s: %s)", ev.seq, ev.job,
                    type(exc).__name__, exc)
        return None


@dataclass(frozen=True)
class PrecheckConfig:
    """How the pre-check before every launch judges the chosen nodes."""

    metrics: bool = True              # node health from the agents' newest batches
    collective: bool = True           # a tiny gloo all-reduce across the chosen nodes
    wait_s: float = 4.0               # how long to wait for a first heartbeat of a node not seen yet
    collective_timeout_s: float = 15.0


class Controller:
    """Drives every job it knows through the state machine, while it holds the lease."""

    def __init__(self, bootstrap: str, backend: Backend, *, poll_interval: float = 0.5,
                 precheck: PrecheckConfig | None = None, health: HealthBook | None = None,
                 lease: Lease | None = None, holder: str | None = None,
                 verifier: FaultVerifier | None | bool = True) -> None:
        """``verifier``: True (default) reads ``TRANSOM_FAULT_PRINCIPALS``; None turns fault authentication off."""
        self.bootstrap = bootstrap
        self.verifier = fault_verifier() if verifier is True else (verifier or None)
        if self.verifier is None:
            log.warning("fault authentication is OFF: any client that can write %s can make this controller evict "
                        "nodes (set TRANSOM_FAULT_PRINCIPALS; see docs/security.md)", contracts.FAULTS)
        else:
            log.info("fault authentication is on: faults must be signed by one of %s",
                     ", ".join(sorted(self.verifier.principals)))
        self.backend = backend
        self.poll_interval = poll_interval
        self._look_now = False            # a rank's word came: look at the ranks (and the spares) now
        self._hurry_until = 0.0           # a collective failed: look every HURRY_EVERY_S until then
        self.precheck = precheck or PrecheckConfig()
        self.health = health or HealthBook()
        self.lease = lease or Lease(bootstrap, holder)
        self.producer = make_producer(bootstrap)
        self.deadletters = DeadLetterWriter(self.producer, "controller")
        self.jobs: dict[str, Job] = {}
        self.seqs: dict[str, int] = {}
        self.submissions: list[tuple[str, JobSpec, tuple[str, ...]]] = []
        self.stopping = threading.Event()
        self.crash_at = os.environ.get(CRASH_ENV) or None
        self._metrics: Consumer | None = None
        self._started_ts = time.time()
        self._nodes_at, self._nodes_last, self._node_error = 0.0, None, ""
        self._node_answered = 0.0        # ts of the newest cordon/uncordon request carried out (in the view)
        self._driven: set[str] = set()
        self._spares_started: set[tuple[str, int, str]] = set()     # (job, generation, node) asked for a warm spare

    # ------------------------------------------------------------------ submission
    def submit(self, job_id: str, spec: JobSpec, nodes: tuple[str, ...]) -> None:
        """Submit a job once this controller holds the lease, unless the lifecycle already knows it."""
        self.submissions.append((job_id, spec, tuple(nodes)))

    def _submit_now(self, job_id: str, spec: JobSpec, nodes: tuple[str, ...]) -> None:
        if job_id in self.jobs:
            log.info("job %s is already known (%s); not submitting again", job_id, self.jobs[job_id].state.value)
            return
        job = Job(job=job_id, spec=spec, submitted_ts=time.time())
        self.jobs[job_id] = job
        self._record(Decision(job, (), "submitted", {}, {"command": list(spec.command), "nodes": list(nodes),
                                                         "spec": spec.to_dict()}))
        self.apply(job_id, Submitted(tuple(nodes)))

    # ------------------------------------------------------------------ core
    def apply(self, job_id: str, event: Any) -> None:
        decision = decide(self.jobs[job_id], event)
        self.jobs[job_id] = decision.job
        if decision.name:
            self._record(decision)
        self._act(decision.job, decision.actions)

    def _act(self, job: Job, actions: tuple[Any, ...]) -> None:
        """Carry out ``actions`` of ``job``'s current step, then feed their outcome back."""
        if not actions:
            return
        outcome: list[Any] = []
        for action in actions:
            if isinstance(action, Stop):
                self.backend.stop(job.job, action.generation)
            elif isinstance(action, Heal):
                try:
                    master = self.backend.heal(job.job, action.generation, action.rank, action.node, action.nodes)
                except (OSError, RuntimeError, ValueError, NotImplementedError) as exc:
                    log.warning("job %s: in-job heal epoch %d failed (%s): falling back to a relaunch", job.job,
                                action.epoch, exc)
                    outcome.append(HealOverdue(action.epoch, float("inf"), time.time()))
                else:
                    outcome.append(HealStarted(action.generation, action.epoch, master, time.time()))
            elif isinstance(action, Cordon):
                self.backend.cordon(action.node, action.reason)
            elif isinstance(action, Reconsider):
                outcome.append(FaultSeen(action.fault, time.time(), deferred=True))
            elif isinstance(action, Then):
                outcome.append(action.event)
            elif isinstance(action, Precheck):
                outcome.append(PrecheckDone(action.generation, self._precheck(job, action)))
            elif isinstance(action, Launch):
                self._wait_until(action.not_before)
                handle = self.backend.launch(job.job, action.generation, action.nodes, job.spec.command,
                                             action.resume_step, workdir=job.spec.workdir or None,
                                             env=dict(job.spec.env) or None)
                outcome.append(Launched(action.generation, time.time(), dict(handle)))
            else:
                raise TypeError(f"unknown action {action!r}")
        label = job.step.value if job.state == JobState.RECOVERING and job.step else job.state.value
        if self.crash_at == label:
            log.warning("%s=%s: killing this controller with SIGKILL (a test hook)", CRASH_ENV, label)
            os.kill(os.getpid(), signal.SIGKILL)
        if not outcome and job.state == JobState.RECOVERING and job.step in (RecoveryStep.STOPPING,
                                                                            RecoveryStep.EVICTING):
            outcome.append(StepDone(job.generation, job.step))
        for event in outcome:
            self.apply(job.job, event)

    def _record(self, d: Decision) -> None:
        self.lease.check()
        seq = self.seqs.get(d.job.job, 0)
        ev = contracts.LifecycleEvent(job=d.job.job, seq=seq, ts=time.time(), name=d.name, state=d.job.state.value,
                                      cause=dict(d.cause), detail=dict(d.detail), snapshot=d.job.to_dict())
        publish(self.producer, contracts.LIFECYCLE, d.job.job, ev)     # compacted: the newest snapshot
        publish(self.producer, contracts.HISTORY, d.job.job, ev)       # the timeline users read
        remaining = self.producer.flush(30)
        if remaining:
            raise RuntimeError(f"could not write lifecycle event '{d.name}' of {d.job.job} to the broker; "
                               "refusing to act on an unrecorded decision")
        self.seqs[d.job.job] = seq + 1
        step = f"/{d.job.step.value}" if d.job.step else ""
        log.info("job %s: %s -> %s%s %s%s", d.job.job, d.name, d.job.state.value, step,
                 " ".join(f"{k}={v}" for k, v in d.detail.items() if k not in ("command", "spec")),
                 f" cause={dict(d.cause)}" if d.cause else "")

    def _wait_until(self, ts: float) -> None:
        while time.time() < ts and not self.stopping.is_set():
            self._pump_metrics(min(0.2, ts - time.time()))

    def reconcile(self) -> None:
        """Carry out again the actions of the step each job was in when the last controller stopped."""
        for job in list(self.jobs.values()):
            actions = pending_actions(job)
            if actions and job.state != JobState.FAILED:
                log.info("job %s: resuming %s%s of generation %d after a controller restart", job.job,
                         job.state.value, f"/{job.step.value}" if job.step else "", job.generation)
            self._act(job, actions)

    # ------------------------------------------------------------------ pre-check
    def _precheck(self, job: Job, action: Precheck) -> dict[str, str]:
        nodes = list(action.nodes)
        failed = dict(self.backend.health(nodes))
        if self.precheck.metrics:
            deadline = time.monotonic() + self.precheck.wait_s
            while time.monotonic() < deadline and any(not self.health.fresh(n) for n in nodes if n not in failed):
                self._pump_metrics(0.2)
            for node in nodes:
                if node not in failed and (why := self.health.problem(node)):
                    failed[node] = why
        if not failed and self.precheck.collective:
            got = self.backend.collective_test(job.job, action.generation, nodes, self.precheck.collective_timeout_s)
            failed.update(got or {})
        if failed:
            log.warning("job %s: pre-check of generation %d failed: %s", job.job, action.generation,
                        "; ".join(f"{n}: {r}" for n, r in failed.items()))
        return failed

    # ------------------------------------------------------------------ inputs
    def _metrics_consumer(self) -> Consumer:
        # progress and node health: news a fraction of a second late is fine, an idle fetch costs the broker
        consumer = Consumer(client_config(self.bootstrap, group_id="transom-controller", enable_auto_commit=False,
                                          fetch_wait_max_ms=QUIET_FETCH_WAIT_MS))
        md = consumer.list_topics(contracts.METRICS, timeout=30)
        consumer.assign([TopicPartition(contracts.METRICS, p, OFFSET_END)
                         for p in md.topics[contracts.METRICS].partitions])
        return consumer

    def _events_consumer(self) -> Consumer:
        # faults: on the path from detection to recovery
        consumer = Consumer(client_config(self.bootstrap, group_id="transom-controller", enable_auto_commit=False,
                                          fetch_wait_max_ms=RECOVERY_FETCH_WAIT_MS))
        parts = []
        for topic in (contracts.FAULTS, contracts.CHECKPOINTS, contracts.LIFECYCLE):
            md = consumer.list_topics(topic, timeout=30)
            parts += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.topics[topic].partitions]
        consumer.assign(parts)
        return consumer

    def _pump_metrics(self, timeout: float) -> None:
        if self._metrics is None:
            time.sleep(max(timeout, 0))
            return
        msg = self._metrics.poll(max(timeout, 0))
        while msg is not None:
            if not msg.error():
                self._on_metrics(msg)
            msg = self._metrics.poll(0)

    def _on_metrics(self, msg) -> None:
        try:
            batch = contracts.decode(contracts.METRICS, msg.value())
        except ContractError:
            return          # the TEE dead-letters malformed metrics already
        self.health.observe(batch)
        for sample in batch.of(Source.TRAIN):
            job_id = sample.tags.get("job")
            if job_id in self.jobs and "step" in sample.fields and "generation" in sample.tags \
                    and not sample.tags.get("event"):        # a one-off event is not the rank's progress
                self.apply(job_id, StepSeen(int(sample.tags["generation"]), int(sample.fields["step"]),
                                            sample.ts or batch.ts))

    def _on_event(self, msg) -> None:
        topic = msg.topic()
        if topic == contracts.LIFECYCLE:
            if msg.key() == NODES_KEY.encode():
                self._on_node_request(msg)
            elif msg.key() != LEASE_KEY.encode():
                self._on_lifecycle(msg)
            return
        if topic == contracts.FAULTS and self.verifier is not None:
            why = self.verifier.check(topic, msg.key(), msg.value(), msg.headers())
            if why:
                self.deadletters.reject(topic=topic, key=msg.key(), value=msg.value(), reason=f"fault not acted on: {why}",
                                        partition=msg.partition(), offset=msg.offset())
                return
        try:
            value = contracts.decode(topic, msg.value())
        except ContractError as exc:
            self.deadletters.reject(topic=topic, key=msg.key(), value=msg.value(), reason=str(exc),
                                    partition=msg.partition(), offset=msg.offset())
            return
        if topic == contracts.FAULTS:
            self._on_fault(msg, value)
        elif topic == contracts.CHECKPOINTS and value.job in self.jobs:
            job = self.jobs[value.job]
            if value.generation < job.launched_generation:
                log.warning("job %s: checkpoint step %d of generation %d ignored: generation %d replaced that "
                            "launch (a stale writer, e.g. a host that was cut off and came back)",
                            value.job, value.step, value.generation, job.launched_generation)
            self.apply(value.job, CheckpointSeen(value))

    def _on_fault(self, msg, fault: contracts.FaultEvent) -> None:
        """Act on ``fault`` for every live job it concerns that runs its node; dead-letter a bad node name."""
        if not valid_name(fault.node):
            self.deadletters.reject(topic=msg.topic(), key=msg.key(), value=msg.value(),
                                    reason=f"fault not acted on: node {fault.node[:80]!r} is not a node name "
                                           "(letters, digits, '.', '_', '-')",
                                    partition=msg.partition(), offset=msg.offset())
            return
        for job_id, job in list(self.jobs.items()):
            if fault.job not in (None, job_id) or job.state in TERMINAL:
                continue
            if fault.node not in job.nodes and fault.node not in job.spares:
                if fault.job == job_id:    # a fault that claims the job but names a foreign node: say so
                    log.warning("fault %s names node %s, which does not run job %s (nodes %s): ignored",
                                fault.fault_id, fault.node, job_id, ",".join(job.nodes) or "-")
                continue
            self.apply(job_id, FaultSeen(fault, time.time()))

    def _on_lifecycle(self, msg) -> None:
        """Pick up a job submitted with ``transom run`` (a ``submit_requested`` event) once."""
        try:
            ev = contracts.decode(contracts.LIFECYCLE, msg.value())
        except ContractError:
            return
        if ev.name in contracts.RANK_LIFECYCLE_EVENTS:
            # a rank's word on the control channel (transom.elastic): it can re-form its group, waits as a
            # spare, its new group holds one state, or its collective failed (a peer is gone)
            if ev.job in self.jobs and self.jobs[ev.job].state not in TERMINAL:
                gen, d = int(ev.detail.get("generation", -1)), ev.detail
                self._look_now = True     # the job changed: its spares, or a rank that exited
                if ev.name == "collective_failed":
                    # the backend may record the exit a moment after the survivors see it: look again, briefly
                    self._hurry_until = time.monotonic() + HURRY_FOR_S
                    log.info("job %s: rank %s's collective failed at step %s (generation %d): looking at the "
                             "ranks now", ev.job, d.get("rank"), d.get("step"), gen)
                    self.apply(ev.job, CollectiveFailed(gen, int(d.get("step", 0) or 0), ev.ts))
                elif ev.name == "elastic_joined":
                    self.apply(ev.job, ElasticJoined(gen, int(d.get("rank", -1))))
                elif ev.name == "spare_ready":
                    self.apply(ev.job, SpareReady(gen, str(d.get("node", ""))))
                else:
                    self.apply(ev.job, ElasticSynced(gen, int(d.get("epoch", -1)), int(d.get("step", -1)), ev.ts))
            return
        if ev.name == "cancel_requested":
            if ev.job in self.jobs:
                self.apply(ev.job, Cancel(str(ev.detail.get("reason") or "cancelled")))
            return
        if ev.name != "submit_requested" or ev.job in self.jobs:
            return
        try:
            spec = JobSpec.from_dict({**ev.detail["spec"], "spares": int(ev.detail.get("spares", 0))})
        except (KeyError, TypeError, ValueError) as exc:
            self.deadletters.reject(topic=msg.topic(), key=msg.key(), value=msg.value(),
                                    reason=f"submit_requested: bad spec ({exc!r})", offset=msg.offset())
            return
        schedulable = self.backend.nodes()
        if len(schedulable) < spec.world_size:
            why = (f"{spec.world_size} ranks need {spec.world_size} nodes; this cluster has {len(schedulable)} "
                   f"schedulable ({', '.join(schedulable) or 'none'}): not queued")
            failed = Job(job=ev.job, spec=spec, submitted_ts=time.time()).moved(JobState.FAILED, failure=why)
            self.jobs[ev.job] = failed
            self._record(Decision(failed, (), "failed", {}, {"reason": why}))
            return
        job = Job(job=ev.job, spec=spec, submitted_ts=time.time())
        self.jobs[ev.job] = job
        self._driven.add(ev.job)
        self._record(Decision(job, (), "queued", {}, {"command": list(spec.command), "spec": spec.to_dict()}))
        self._start_queued()

    def _on_node_request(self, msg) -> None:
        """`transom nodes cordon|uncordon NODE --reason R`: carried out once (requests after this controller
        took the lease; older ones were answered by the view of the controller before it)."""
        try:
            ev = contracts.decode(contracts.LIFECYCLE, msg.value())
        except ContractError:
            return
        if ev.name not in ("cordon_requested", "uncordon_requested") or ev.ts < self._started_ts:
            return
        node, reason = str(ev.detail.get("node", "")), str(ev.detail.get("reason") or "operator")
        known = set(self.backend.nodes()) | set(self.backend.cordoned())
        try:
            if node not in known:
                raise RuntimeError(f"no node {node!r} (known: {', '.join(sorted(known)) or 'none'})")
            if ev.name == "cordon_requested":
                self.backend.cordon(node, f"operator: {reason}")
            else:
                self.backend.uncordon(node, reason)
            self._node_error = ""
        except (NotImplementedError, OSError, RuntimeError) as exc:
            self._node_error = f"{ev.name.split('_')[0]} {node}: {exc}"
        self._node_answered = max(self._node_answered, ev.ts)
        self._publish_nodes(force=True)

    def node_view(self) -> dict[str, dict[str, Any]]:
        cordoned = self.backend.cordoned()
        names = list(dict.fromkeys([*self.backend.nodes(), *cordoned]))
        problems = self.backend.health(names) if names else {}
        running = {n: j.job for j in self.jobs.values() if j.state not in TERMINAL for n in j.nodes}
        spare = {n: j.job for j in self.jobs.values() if j.state not in TERMINAL for n in j.spares}
        return {n: {"health": problems.get(n) or self.health.problem(n) or "ok", "cordoned": cordoned.get(n),
                    "job": running.get(n), "spare_for": spare.get(n)} for n in names}

    def _publish_nodes(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._nodes_at < 5.0:
            return
        self._nodes_at = now
        view = self.node_view()
        if not force and view == self._nodes_last:
            return
        self._nodes_last = view
        ev = contracts.LifecycleEvent(job=NODES_KEY, seq=0, ts=time.time(), name="nodes", state="view",
                                      detail={"nodes": view, "holder": self.lease.holder, "error": self._node_error,
                                              "answered": self._node_answered})
        publish(self.producer, contracts.LIFECYCLE, NODES_KEY, ev)
        self.producer.poll(0)

    def _free_nodes(self) -> list[str]:
        busy = {n for j in self.jobs.values() if j.state not in TERMINAL for n in j.nodes + j.spares}
        return [n for n in self.backend.nodes() if n not in busy]

    def _start_queued(self) -> None:
        """Start the queued jobs (PENDING, never launched) in submission order while enough nodes are free."""
        for job in list(self.jobs.values()):
            if job.state != JobState.PENDING or job.generation >= 0:
                continue
            free = self._free_nodes()
            if len(free) < job.spec.world_size:
                return                       # first come, first served: later jobs wait behind it
            nodes = tuple(free[: job.spec.world_size + job.spec.spares])
            self.apply(job.job, Submitted(nodes))
            got = len(nodes) - job.spec.world_size
            if got < job.spec.spares and self.jobs[job.job].state not in TERMINAL:
                self._record(Decision(self.jobs[job.job], (), "warning", {}, {
                    "warning": f"asked for {job.spec.spares} spare node(s), got {got}: no other node is free; "
                               "a faulty node is replaced only while a spare is free"}))

    def _keep_spares(self) -> None:
        """Keep a warm spare rank waiting on every spare node of each running job that heals in the job."""
        if not self.backend.warm_spares:
            return
        for job in list(self.jobs.values()):
            # a node that left the pool (its spare took a rank) gets a new spare when it comes back to it
            self._spares_started -= {k for k in self._spares_started if k[0] == job.job and k[2] not in job.spares}
            if job.state != JobState.RUNNING or job.spec.heal != "in-job" or job.launched_generation < 0 \
                    or not set(job.joined) >= set(range(len(job.nodes))):    # a script without the elastic API
                continue
            for node in job.spares:
                if node in job.warm or (job.job, job.launched_generation, node) in self._spares_started:
                    continue
                try:
                    self.backend.start_spare(job.job, job.launched_generation, node, job.spec.command,
                                             workdir=job.spec.workdir or None, env=dict(job.spec.env) or None)
                    self._spares_started.add((job.job, job.launched_generation, node))
                except (OSError, ValueError, RuntimeError) as exc:
                    log.warning("job %s: could not start a warm spare on %s: %s", job.job, node, exc)

    def _poll_ranks(self) -> None:
        for job in list(self.jobs.values()):
            if job.step == RecoveryStep.HEALING:
                if time.time() - job.heal_ts >= job.spec.heal_timeout_s:
                    self.apply(job.job, HealOverdue(job.heal_epoch, time.time() - job.heal_ts, time.time()))
                    continue
            elif not (job.state == JobState.RUNNING or job.step == RecoveryStep.RESUMING):
                continue
            statuses = self.backend.status(job.job, job.launched_generation)
            failed = {s.rank: s.exit_code for s in statuses if not s.running and s.exit_code != 0}
            if statuses and (failed or all(not s.running for s in statuses)):
                codes = {s.rank: (s.exit_code if s.exit_code is not None else 0) for s in statuses
                         if not s.running}
                logs = {r: self.backend.rank_log(job.job, job.launched_generation, r) for r in failed}
                self.apply(job.job, RanksExited(job.launched_generation, codes, time.time(),
                                                nodes={s.rank: s.node for s in statuses if s.node}, logs=logs))
            elif job.stepped_generation < job.launched_generation and job.launched_ts:
                self.apply(job.job, StartOverdue(job.launched_generation, time.time() - job.launched_ts, time.time()))

    # ------------------------------------------------------------------ loop
    def run(self, *, exit_when_done: bool = False) -> int:
        """Wait for the lease, then process events until stopped (or, with ``exit_when_done``, until the
        jobs submitted on the command line, or every job when none was, have ended).

        Returns 0 when those jobs completed, 1 when one failed, 3 when the lease was lost.
        """
        self._metrics = self._metrics_consumer()
        events: Consumer | None = None
        try:
            if not self.lease.acquire(self.stopping, idle=lambda: self._pump_metrics(0)):
                return 0
            self._started_ts = time.time()
            self.jobs, self.seqs = replay(self.bootstrap)
            if self.jobs:
                log.info("replayed %d job(s) from %s: %s", len(self.jobs), contracts.LIFECYCLE,
                         ", ".join(f"{j.job}={j.state.value}/gen{j.generation}" for j in self.jobs.values()))
            self._driven = {j.job for j in self.jobs.values() if j.state not in TERMINAL}
            self.reconcile()
            for submission in self.submissions:
                self._submit_now(*submission)
            events = self._events_consumer()
            next_poll = 0.0
            while not self.stopping.is_set():
                self.lease.check()
                msg, handled = events.poll(0.1), 0
                while msg is not None and handled < 500:      # drain what is there, then see to the rest
                    if not msg.error():
                        self._on_event(msg)
                    msg, handled = events.poll(0), handled + 1
                self._pump_metrics(0.05)
                now = time.monotonic()
                if now >= next_poll or self._look_now:
                    self._look_now = False
                    self._poll_ranks()
                    self._keep_spares()
                    self._start_queued()
                    self._publish_nodes()
                    next_poll = now + (min(HURRY_EVERY_S, self.poll_interval) if now < self._hurry_until
                                       else self.poll_interval)
                    if exit_when_done and self._watched() and all(j.state in TERMINAL for j in self._watched()):
                        break
        except LeaseLost as exc:
            log.error("%s", exc)
            return EXIT_LEASE_LOST
        finally:
            if events is not None:
                events.close()
            self._metrics.close()
            self.backend.close()
            self.lease.release()
            self.producer.flush(10)
        return 1 if any(j.state == JobState.FAILED for j in self._watched()) else 0

    def _watched(self) -> list[Job]:
        """The jobs submitted on this controller's command line, or, without any, every job it has driven
        (live when it took over, or submitted since): jobs that had ended before it started do not count."""
        mine = {s[0] for s in self.submissions} or self._driven
        return [j for j in self.jobs.values() if j.job in mine]

    def stop(self) -> None:
        self.stopping.set()

    def snapshot(self) -> Mapping[str, Job]:
        return dict(self.jobs)
