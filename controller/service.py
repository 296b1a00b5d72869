"""The controller service: replays ``transom.lifecycle``, then drives jobs from Kafka events.

Order of work for every decision (see :mod:`transom.controller.state`): decide, record the
lifecycle event with the job's new snapshot (flushed to the broker), then carry out the actions.
A controller killed anywhere in between finds, on restart, a snapshot whose ``generation`` is
ahead of its ``launched_generation`` and finishes that launch; the backend adopts a launch that
had already happened, so nothing runs twice.

Inputs: ``transom.faults`` and ``transom.checkpoints`` from their beginning (decisions are
idempotent by fault id and checkpoint step), training samples on ``transom.metrics`` from now on,
and rank exits polled from the backend.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, TopicPartition

from transom import contracts
from transom.contracts import ContractError, Source
from transom.kafka import DeadLetterWriter, client_config, make_producer, publish, read_topic
from transom.log import get

from confluent_kafka import Consumer

from .backend import Backend
from .state import (CheckpointSeen, Cordon, Decision, FaultSeen, Job, JobSpec, JobState, Launch, Launched,
                    RanksExited, StepSeen, Stop, Submitted, decide)

__all__ = ["Controller", "replay"]

log = get("controller")
TERMINAL = (JobState.COMPLETED, JobState.FAILED)


def replay(bootstrap: str) -> tuple[dict[str, Job], dict[str, int]]:
    """Jobs and their next lifecycle seq, rebuilt from the lifecycle topic."""
    jobs: dict[str, Job] = {}
    seqs: dict[str, int] = {}
    for _k, value, _p, _o in read_topic(bootstrap, contracts.LIFECYCLE):
        try:
            ev = contracts.decode(contracts.LIFECYCLE, value)
        except ContractError as exc:
            log.warning("skipping a malformed lifecycle event: %s", exc)
            continue
        if ev.snapshot and ev.seq >= seqs.get(ev.job, 0):
            jobs[ev.job] = Job.from_dict(ev.snapshot)
            seqs[ev.job] = ev.seq + 1
    return jobs, seqs


class Controller:
    """Drives every job it knows through the state machine; one instance acts at a time."""

    def __init__(self, bootstrap: str, backend: Backend, *, poll_interval: float = 0.5) -> None:
        self.bootstrap = bootstrap
        self.backend = backend
        self.poll_interval = poll_interval
        self.producer = make_producer(bootstrap)
        self.deadletters = DeadLetterWriter(self.producer, "controller")
        self.jobs, self.seqs = replay(bootstrap)
        self.stopping = threading.Event()
        if self.jobs:
            log.info("replayed %d job(s) from %s: %s", len(self.jobs), contracts.LIFECYCLE,
                     ", ".join(f"{j.job}={j.state.value}/gen{j.generation}" for j in self.jobs.values()))

    # ------------------------------------------------------------------ submission
    def submit(self, job_id: str, spec: JobSpec, nodes: tuple[str, ...]) -> None:
        """Submit a job unless the lifecycle already knows it (so a restart does not resubmit)."""
        if job_id in self.jobs:
            log.info("job %s is already known (%s); not submitting again", job_id, self.jobs[job_id].state.value)
            return
        job = Job(job=job_id, spec=spec)
        self.jobs[job_id] = job
        self._record(Decision(job, (), "submitted", {}, {"command": list(spec.command), "nodes": list(nodes)}))
        self.apply(job_id, Submitted(tuple(nodes)))

    # ------------------------------------------------------------------ core
    def apply(self, job_id: str, event: Any) -> None:
        decision = decide(self.jobs[job_id], event)
        self.jobs[job_id] = decision.job
        if decision.name:
            self._record(decision)
        for action in decision.actions:
            self._execute(decision.job, action)

    def _record(self, d: Decision) -> None:
        seq = self.seqs.get(d.job.job, 0)
        ev = contracts.LifecycleEvent(job=d.job.job, seq=seq, ts=time.time(), name=d.name, state=d.job.state.value,
                                      cause=dict(d.cause), detail=dict(d.detail), snapshot=d.job.to_dict())
        publish(self.producer, contracts.LIFECYCLE, d.job.job, ev)
        remaining = self.producer.flush(30)
        if remaining:
            raise RuntimeError(f"could not write lifecycle event '{d.name}' of {d.job.job} to the broker; "
                               "refusing to act on an unrecorded decision")
        self.seqs[d.job.job] = seq + 1
        log.info("job %s: %s -> %s %s%s", d.job.job, d.name, d.job.state.value,
                 " ".join(f"{k}={v}" for k, v in d.detail.items() if k not in ("command",)),
                 f" cause={dict(d.cause)}" if d.cause else "")

    def _execute(self, job: Job, action: Any) -> None:
        if isinstance(action, Stop):
            self.backend.stop(job.job, action.generation)
        elif isinstance(action, Cordon):
            self.backend.cordon(action.node, action.reason)
        elif isinstance(action, Launch):
            handle = self.backend.launch(job.job, action.generation, action.nodes, job.spec.command,
                                         action.resume_step)
            self.apply(job.job, Launched(action.generation, time.time(), dict(handle)))
        else:
            raise TypeError(f"unknown action {action!r}")

    def reconcile(self) -> None:
        """Finish what a previous controller decided but did not carry out."""
        for job in list(self.jobs.values()):
            if job.state in TERMINAL or job.generation <= job.launched_generation:
                continue
            log.info("job %s: generation %d was decided but its launch not recorded; completing it",
                     job.job, job.generation)
            if job.launched_generation >= 0:
                self.backend.stop(job.job, job.launched_generation)
            for node in job.evicted:
                self.backend.cordon(node, "evicted")
            self._execute(job, Launch(job.generation, job.nodes, job.resume_step))

    # ------------------------------------------------------------------ inputs
    def _consumer(self) -> Consumer:
        consumer = Consumer(client_config(self.bootstrap, group_id="transom-controller", enable_auto_commit=False,
                                                 fetch_wait_max_ms=100))
        parts = []
        for topic, start in ((contracts.FAULTS, OFFSET_BEGINNING), (contracts.CHECKPOINTS, OFFSET_BEGINNING),
                             (contracts.METRICS, OFFSET_END)):
            md = consumer.list_topics(topic, timeout=30)
            parts += [TopicPartition(topic, p, start) for p in md.topics[topic].partitions]
        consumer.assign(parts)
        return consumer

    def _on_message(self, msg) -> None:
        topic = msg.topic()
        try:
            value = contracts.decode(topic, msg.value())
        except ContractError as exc:
            if topic != contracts.METRICS:      # the TEE dead-letters malformed metrics already
                self.deadletters.reject(topic=topic, key=msg.key(), value=msg.value(), reason=str(exc),
                                        partition=msg.partition(), offset=msg.offset())
            return
        if topic == contracts.FAULTS:
            for job_id, job in self.jobs.items():
                if value.job in (None, job_id) and job.state not in TERMINAL:
                    self.apply(job_id, FaultSeen(value))
        elif topic == contracts.CHECKPOINTS:
            if value.job in self.jobs:
                self.apply(value.job, CheckpointSeen(value))
        else:
            for sample in value.of(Source.TRAIN):
                job_id = sample.tags.get("job")
                if job_id in self.jobs and "step" in sample.fields and "generation" in sample.tags:
                    self.apply(job_id, StepSeen(int(sample.tags["generation"]), int(sample.fields["step"]),
                                                sample.ts or value.ts))

    def _poll_ranks(self) -> None:
        for job in list(self.jobs.values()):
            if job.state != JobState.RUNNING:
                continue
            statuses = self.backend.status(job.job, job.launched_generation)
            if not statuses:
                continue
            failed = {s.rank: s.exit_code for s in statuses if not s.running and s.exit_code != 0}
            if failed or all(not s.running for s in statuses):
                codes = {s.rank: (s.exit_code if s.exit_code is not None else 0) for s in statuses
                         if not s.running}
                self.apply(job.job, RanksExited(job.launched_generation, codes))

    # ------------------------------------------------------------------ loop
    def run(self, *, exit_when_done: bool = False) -> int:
        """Process events until stopped (or, with ``exit_when_done``, until every job has ended).

        Returns 0 when every job completed, 1 when one failed.
        """
        self.reconcile()
        consumer = self._consumer()
        next_poll = 0.0
        try:
            while not self.stopping.is_set():
                msg = consumer.poll(0.2)
                if msg is not None and not msg.error():
                    self._on_message(msg)
                now = time.monotonic()
                if now >= next_poll:
                    self._poll_ranks()
                    next_poll = now + self.poll_interval
                    if exit_when_done and self.jobs and all(j.state in TERMINAL for j in self.jobs.values()):
                        break
        finally:
            consumer.close()
            self.producer.flush(10)
        return 1 if any(j.state == JobState.FAILED for j in self.jobs.values()) else 0

    def stop(self) -> None:
        self.stopping.set()

    def snapshot(self) -> Mapping[str, Job]:
        return dict(self.jobs)
