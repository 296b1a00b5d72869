"""Chaos: the controller is killed in every recovery state of one recovery, and each action happens once.

Promise: a controller killed anywhere in a recovery leaves a successor that finishes it, and every
recovery action is carried out exactly once: the old generation's ranks are stopped once, the
faulty node cordoned once, one launch per generation, each recovery step recorded once, and the
job completes.

How: real node agents and checkpoint daemons (``LocalStack``), a real 4-rank ``train_lm`` job on
the local backend, a spare node. Once a checkpoint exists an XID 79 fault on node1 is published
(the way the TEE publishes it). Controllers run one after another, each with the test hook
``TRANSOM_TEST_CRASH_AT`` set to the next recovery step, so that each SIGKILLs itself right after
carrying out that step's actions and before recording their outcome: the 1st dies in
``stopping``, the 2nd (which stops again: a no-op) in ``evicting``, the 3rd in ``replacing``
(after the pre-check), the 4th in ``relaunching`` (right after starting generation 1); the 5th
adopts that launch, sees its first step (``resuming``) and runs the job to completion.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from transom import contracts as c
from transom.kafka import make_producer, publish
from transom.stack import LocalStack, train_command

from util import topic_values, until_alive

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

JOB = "chaos-ctl"
CRASH_STEPS = ("stopping", "evicting", "replacing", "relaunching")


def lifecycle(bootstrap: str) -> list[c.LifecycleEvent]:
    """The controller's timeline of JOB (the ranks' elastic messages share the topic under their own key)."""
    return [e for e in topic_values(bootstrap, c.LIFECYCLE) if e.job == JOB and e.name not in c.RANK_LIFECYCLE_EVENTS]


def test_controller_killed_in_each_recovery_step_finishes_the_recovery_once(fresh_broker, tmp_path):
    # a broker of its own: each controller replays the whole lifecycle topic, and would adopt (and keep warm
    # spares for) the jobs other tests left running on the suite's shared one
    bs = fresh_broker.bootstrap
    stack = LocalStack(tmp_path / "stack", bootstrap=bs, nodes=5)
    run_dir = tmp_path / "runs"
    procs: list[subprocess.Popen] = []

    def controller(i: int, crash_at: str | None) -> subprocess.Popen:
        env_old = os.environ.pop("TRANSOM_TEST_CRASH_AT", None)
        if crash_at:
            os.environ["TRANSOM_TEST_CRASH_AT"] = crash_at
        try:
            p = stack.start_controller(JOB, train_command(45, 5), world_size=4, name=f"ctl-{i}",
                                       extra=["--exit-when-done", "--run-dir", str(run_dir), "--precheck", "health",
                                              "--heal", "relaunch"])   # the relaunch path's steps (a warm spare
                                                                       # ready in time would heal in the job)
        finally:
            os.environ.pop("TRANSOM_TEST_CRASH_AT", None)
            if env_old is not None:
                os.environ["TRANSOM_TEST_CRASH_AT"] = env_old
        procs.append(p.popen)
        return p.popen

    try:
        stack.start_agents()
        first = controller(1, CRASH_STEPS[0])
        until_alive(first, lambda: any(e.name == "checkpoint" and e.detail["step"] >= 5 for e in lifecycle(bs)), 120,
              "a checkpoint recorded by the controller")
        now = time.time()
        fault = c.FaultEvent(fault_id=c.stable_id(JOB, "node1", "xid", now), job=JOB, node="node1",
                             kind=c.FaultKind.XID, severity=c.Severity.CRITICAL, detector="rule.xid",
                             action=c.Action.EVICT, observed_ts=now, detected_ts=now,
                             evidence={"xid": 79, "gpu": 0}, summary="GPU 0 of node1 reported XID 79")
        producer = make_producer(bs)
        publish(producer, c.FAULTS, JOB, fault)
        assert producer.flush(10) == 0
        last_at_death = []
        proc = first
        for i, step in enumerate(CRASH_STEPS, start=1):
            if i > 1:
                proc = controller(i, step)
            try:
                code = proc.wait(90)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"controller {i} did not die in {step}") from None
            assert code == -signal.SIGKILL, f"controller {i} exited with {code}, expected to die in {step}"
            events = lifecycle(bs)
            last_at_death.append((events[-1].name, events[-1].snapshot.get("step")))
        last = controller(len(CRASH_STEPS) + 1, None)
        try:
            assert last.wait(150) == 0
        except subprocess.TimeoutExpired:
            raise AssertionError("the last controller did not finish the job") from None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        stack.stop()
        from transom.controller.local import LocalBackend
        for gen_dir in run_dir.glob("*/gen-*"):            # ranks and spares a failed test may have left
            LocalBackend(run_dir, {}).stop(gen_dir.parent.name, int(gen_dir.name.split("-")[1]), 5)

    # each controller died in the step it was told to, right after that step's actions, before their outcome
    assert last_at_death == [("relaunching", "stopping"), ("evicting", "evicting"), ("replacing", "replacing"),
                             ("precheck_passed", "relaunching")]
    events = lifecycle(bs)
    names = [e.name for e in events]
    print("timeline:", ", ".join(f"{e.name}@{e.ts - events[0].ts:.1f}s" for e in events if e.name != "checkpoint"))
    assert [e.seq for e in events] == list(range(len(events))), "lifecycle seq has a gap or a repeat"
    start = names.index("relaunching")
    assert [n for n in names[start:] if n not in ("checkpoint", "fault_observed")] == [
        "relaunching", "evicting", "replacing", "precheck_passed", "launched", "resumed", "completed"], names
    assert names.count("submitted") == 1 and names.count("prechecking") == 1 and names.count("first_step") == 1
    assert [e.detail["generation"] for e in events if e.name == "launched"] == [0, 1]
    relaunch = events[start]
    assert relaunch.cause["fault_id"] == fault.fault_id
    assert relaunch.detail["evicted"] == "node1" and relaunch.detail["replacement"] == "node4"
    logs = {i: (stack.run_dir / "logs" / f"ctl-{i}.log").read_text() for i in range(1, len(CRASH_STEPS) + 2)}
    everything = "".join(logs.values())
    # the old generation's ranks stopped once (a repeated stop finds nothing alive and does nothing)
    assert everything.count(f"stopped job {JOB} generation 0") == 1 and f"stopped job {JOB} generation 0" in logs[1]
    assert everything.count("cordoned node1") == 1 and "cordoned node1" in logs[2]
    assert everything.count(f"launched job {JOB} generation 1") == 1 and f"launched job {JOB} generation 1" in logs[4]
    assert f"job {JOB} generation 1 was already launched: adopting it" in logs[5]
    job_dir = run_dir / JOB
    assert sorted(p.name for p in job_dir.glob("gen-*")) == ["gen-0", "gen-1"]
    assert "node1" in json.loads((run_dir / "cordoned.json").read_text())
    launch1 = json.loads((job_dir / "gen-1" / "launch.json").read_text())
    assert launch1["nodes"] == ["node0", "node4", "node2", "node3"] and len(launch1["pids"]) == 4
    # the newest checkpoint recorded before the launch (a save in flight at the fault may complete meanwhile)
    launched = next(e for e in events if e.name == "launched" and e.detail["generation"] == 1)
    recorded = [e.detail["step"] for e in events[:events.index(launched)] if e.name == "checkpoint"]
    assert launch1["resume_step"] == max(recorded) and launch1["resume_step"] >= relaunch.detail["resume_step"]
    for r in range(4):
        assert (job_dir / "gen-0" / f"rank-{r}.exit").exists()            # stopped, not left running
        assert (job_dir / "gen-1" / f"rank-{r}.exit").read_text().strip() == "0"
        assert int((job_dir / "gen-1" / f"rank-{r}.pid").read_text().split()[0]) == launch1["pids"][r]
    rank0 = (job_dir / "gen-1" / "rank-0.log").read_text()
    assert rank0.count(f"resumed from step {launch1['resume_step']} gen 1") == 1


def test_a_fault_from_a_node_whose_clock_runs_behind_is_not_taken_for_an_old_one():
    """A node 5 s behind reports an XID 2 s after the launch: its sample time lies before the launch,
    the TEE's decision after it; the controller acts on it (pure, no broker)."""
    from transom.controller.state import FaultSeen, Job, JobSpec, JobState, Launched, PrecheckDone, Submitted, decide

    job = decide(Job(job=JOB, spec=JobSpec(("x",), 2)), Submitted(("node0", "node1", "node2"))).job
    job = decide(job, PrecheckDone(0)).job
    job = decide(job, Launched(0, ts=1000.0)).job
    assert job.state == JobState.RUNNING

    def xid(fid, observed, detected):
        return c.FaultEvent(fault_id=fid, job=JOB, node="node1", kind=c.FaultKind.XID, severity=c.Severity.CRITICAL,
                            detector="rule.xid", action=c.Action.EVICT, observed_ts=observed, detected_ts=detected)

    assert decide(job, FaultSeen(xid("old", 990.0, 990.4))).name == ""          # decided before the launch
    d = decide(job, FaultSeen(xid("skewed", 1002.0 - 5.0, 1002.3)))
    assert d.name == "relaunching" and d.detail["evicted"] == "node1" and d.detail["replacement"] == "node2"
