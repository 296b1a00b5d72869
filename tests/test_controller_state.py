"""The job state machine, driven directly: no Kafka, no processes."""

import time

import pytest

from transom import contracts as c
from transom.controller.state import (FAULT_POLICY, CheckpointSeen, Cordon, FaultSeen, IllegalTransition, Job,
                                      JobSpec, JobState, Launch, Launched, RanksExited, StepSeen, Stop, Submitted,
                                      decide)

NODES = ("node0", "node1", "node2", "node3", "node4")


def running_job(**spec):
    job = Job(job="j", spec=JobSpec(("python", "train.py"), 4, **spec))
    d = decide(job, Submitted(NODES))
    assert d.actions == (Launch(0, NODES[:4], None),)
    d = decide(d.job, Launched(0, ts=100.0))
    assert d.job.state == JobState.RUNNING
    return d.job


def fault(node="node1", kind=c.FaultKind.XID, fid="f1", ts=200.0, **kw):
    return c.FaultEvent(fault_id=fid, job="j", node=node, kind=kind, severity=c.Severity.CRITICAL,
                        detector="rule", action=c.Action.EVICT, observed_ts=ts, detected_ts=ts + 0.5, **kw)


def ready(step, world=4, tier=c.Tier.SHARED, nodes=NODES):
    return c.CheckpointReady(job="j", step=step, world_size=world,
                             shards=tuple(c.Shard(r, f"r{r}", 1, "0" * 64) for r in range(world)),
                             copies=tuple(c.Copy(r, nodes[r], tier, f"/x/{r}") for r in range(world)),
                             replicated=False, persisted=True, ts=time.time())


def test_xid_evicts_the_node_takes_the_spare_and_resumes_from_newest_checkpoint():
    job = running_job()
    job = decide(job, CheckpointSeen(ready(20))).job
    job = decide(job, CheckpointSeen(ready(40))).job
    job = decide(job, CheckpointSeen(ready(30))).job          # an older one arriving late changes nothing
    d = decide(job, FaultSeen(fault()))
    assert d.name == "relaunching" and d.job.state == JobState.RECOVERING
    assert d.actions == (Stop(0), Cordon("node1", "xid on node1"), Launch(1, ("node0", "node4", "node2", "node3"), 40))
    assert d.job.evicted == ("node1",) and d.job.spares == ()
    assert d.cause["fault_id"] == "f1"


def test_duplicate_and_stale_faults_cause_no_second_action():
    job = running_job()
    d = decide(job, FaultSeen(fault()))
    job = decide(d.job, Launched(1, ts=300.0)).job
    assert decide(job, FaultSeen(fault())).actions == ()                        # same fault id
    assert decide(job, FaultSeen(fault(node="node1", fid="f2", ts=301))).actions == ()   # evicted node
    assert decide(job, FaultSeen(fault(node="node2", fid="f3", ts=250))).actions == ()   # before this launch


def test_no_spare_left_fails_the_job_with_the_reason():
    job = running_job()
    job = decide(decide(job, FaultSeen(fault())).job, Launched(1, ts=300.0)).job
    d = decide(job, FaultSeen(fault(node="node2", fid="f2", ts=400.0)))
    assert d.job.state == JobState.FAILED
    assert "no spare is left" in d.job.failure


def test_hang_restarts_in_place_and_rank_exit_counts_against_the_budget():
    job = running_job(max_restarts=1)
    d = decide(job, FaultSeen(fault(kind=c.FaultKind.HANG, node="node2")))
    assert [type(a) for a in d.actions] == [Stop, Launch] and d.actions[1].nodes == NODES[:4]
    job = decide(d.job, Launched(1, ts=300.0)).job
    d = decide(job, RanksExited(1, {0: 0, 1: -9, 2: 0, 3: 0}))
    assert d.job.state == JobState.FAILED and "restart budget of 1 spent" in d.job.failure


def test_all_ranks_exiting_zero_completes_the_job():
    job = running_job()
    d = decide(job, RanksExited(0, {r: 0 for r in range(4)}))
    assert d.job.state == JobState.COMPLETED and d.name == "completed"


def test_first_step_after_relaunch_is_recorded_with_steps_lost():
    job = running_job()
    job = decide(job, CheckpointSeen(ready(40))).job
    for step in range(1, 48):
        job = decide(job, StepSeen(0, step, 100.0 + step)).job
    job = decide(decide(job, FaultSeen(fault())).job, Launched(1, ts=300.0)).job
    job = decide(job, StepSeen(0, 49, 301.0)).job      # a late report of the stopped generation
    d = decide(job, StepSeen(1, 41, 310.0))
    assert d.name == "resumed" and d.detail["steps_lost"] == 49 - 40
    assert decide(d.job, StepSeen(0, 50, 311.0)).job == d.job   # too late: recovery already recorded


def test_evicted_nodes_memory_copies_do_not_count_as_surviving():
    job = running_job()
    job = decide(job, CheckpointSeen(ready(40, tier=c.Tier.MEMORY))).job
    d = decide(job, FaultSeen(fault()))
    assert d.actions[-1].resume_step is None       # rank 1's only copy was on the evicted node


def test_observe_only_faults_record_without_action():
    assert FAULT_POLICY[c.FaultKind.ANOMALY] == c.Action.OBSERVE
    d = decide(running_job(), FaultSeen(fault(kind=c.FaultKind.ANOMALY)))
    assert d.name == "fault_observed" and d.actions == ()


def test_illegal_transition_raises():
    done = decide(running_job(), RanksExited(0, {r: 0 for r in range(4)})).job
    with pytest.raises(IllegalTransition, match="completed -> running"):
        done.moved(JobState.RUNNING)


def test_snapshot_round_trips():
    job = decide(running_job(), CheckpointSeen(ready(40))).job
    assert Job.from_dict(c.decode(c.LIFECYCLE, c.encode(c.LifecycleEvent(
        job="j", seq=0, ts=1.0, name="x", state=job.state.value, snapshot=job.to_dict()))).snapshot) == job
