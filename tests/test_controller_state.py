"""The job state machine, driven directly: no Kafka, no processes."""

import dataclasses
import time

import pytest

from transom import contracts as c
from transom.controller.state import (FAULT_POLICY, CheckpointSeen, Cordon, FaultSeen, IllegalTransition, Job,
                                      JobSpec, JobState, Launch, Launched, Precheck, PrecheckDone, RanksExited,
                                      RecoveryStep, StartOverdue, StepDone, StepSeen, Stop, Submitted, Cancel, Then,
                                      decide, pending_actions)

NODES = ("node0", "node1", "node2", "node3", "node4")


def running_job(nodes=NODES, **spec):
    job = Job(job="j", spec=JobSpec(("python", "train.py"), 4, **spec))
    d = decide(job, Submitted(nodes))
    assert d.job.state == JobState.PRECHECKING and d.actions == (Precheck(0, nodes[:4]),)
    d = decide(d.job, PrecheckDone(0))
    assert d.name == "precheck_passed" and d.actions == (Launch(0, nodes[:4], None),)
    d = decide(d.job, Launched(0, ts=100.0))
    assert d.job.state == JobState.RUNNING and d.name == "launched"
    return d.job


def fault(node="node1", kind=c.FaultKind.XID, fid="f1", ts=200.0, severity=c.Severity.CRITICAL, **kw):
    return c.FaultEvent(fault_id=fid, job="j", node=node, kind=kind, severity=severity,
                        detector="rule", action=c.Action.EVICT, observed_ts=ts, detected_ts=ts + 0.5, **kw)


def ready(step, world=4, tier=c.Tier.SHARED, nodes=NODES):
    return c.CheckpointReady(job="j", step=step, world_size=world,
                             shards=tuple(c.Shard(r, f"r{r}", 1, "0" * 64) for r in range(world)),
                             copies=tuple(c.Copy(r, nodes[r], tier, f"/x/{r}") for r in range(world)),
                             replicated=False, persisted=True, ts=time.time())


def recover(job, first_event, *, precheck_failed=None):
    """Walk a recovery through its steps, as the service would; returns (decisions, job)."""
    seen = [decide(job, first_event)]
    job = seen[-1].job
    while job.state == JobState.RECOVERING and job.step != RecoveryStep.RESUMING:
        if job.step in (RecoveryStep.STOPPING, RecoveryStep.EVICTING):
            ev = StepDone(job.generation, job.step)
        elif job.step == RecoveryStep.REPLACING:
            ev = PrecheckDone(job.generation, (precheck_failed or {}).pop(job.generation, {}) if precheck_failed
                              else {})
        else:
            ev = Launched(job.generation, ts=300.0 + job.generation)
        seen.append(decide(job, ev))
        job = seen[-1].job
    return seen, job


def test_xid_walks_every_recovery_step_and_resumes_from_newest_checkpoint():
    job = running_job()
    for step in (20, 40, 30):                     # an older one arriving late changes nothing
        job = decide(job, CheckpointSeen(ready(step))).job
    seen, job = recover(job, FaultSeen(fault()))
    assert [d.name for d in seen] == ["relaunching", "evicting", "replacing", "precheck_passed", "launched"]
    assert [d.job.step for d in seen] == [RecoveryStep.STOPPING, RecoveryStep.EVICTING, RecoveryStep.REPLACING,
                                          RecoveryStep.RELAUNCHING, RecoveryStep.RESUMING]
    r = seen[0]
    assert r.job.state == JobState.RECOVERING and r.actions == (Stop(0),)
    assert r.detail["evicted"] == "node1" and r.detail["replacement"] == "node4" and r.detail["resume_step"] == 40
    assert r.cause["fault_id"] == "f1"
    assert seen[1].actions == (Cordon("node1", "xid on node1"),)
    assert seen[2].actions == (Precheck(1, ("node0", "node4", "node2", "node3")),)
    assert seen[3].actions == (Launch(1, ("node0", "node4", "node2", "node3"), 40, r.job.not_before),)
    d = decide(job, StepSeen(1, 41, 310.0))
    assert d.name == "resumed" and d.job.state == JobState.RUNNING and d.job.step is None


def test_a_checkpoint_completed_before_the_relaunch_moves_the_resume_point_and_one_after_does_not():
    job = running_job()
    job = decide(job, CheckpointSeen(ready(40))).job
    d = decide(job, FaultSeen(fault()))                       # the save of step 60 is still in flight
    assert d.job.step == RecoveryStep.STOPPING and d.job.resume_step == 40
    d = decide(d.job, CheckpointSeen(ready(60, tier=c.Tier.MEMORY, nodes=("node0", "node2", "node2", "node3"))))
    assert d.name == "checkpoint" and d.detail["resume_step"] == 60 and d.job.resume_step == 60
    d = decide(d.job, CheckpointSeen(ready(50, tier=c.Tier.MEMORY, nodes=("node0", "node1", "node2", "node3"))))
    assert d.job.resume_step == 60 and "resume_step" not in d.detail      # older, and rank 1 only on node1
    job = d.job
    while job.step != RecoveryStep.RELAUNCHING:
        ev = StepDone(job.generation, job.step) if job.step != RecoveryStep.REPLACING else PrecheckDone(job.generation, {})
        job = decide(job, ev).job
    assert pending_actions(job) == (Launch(1, job.nodes, 60, job.not_before),)
    d = decide(job, CheckpointSeen(ready(70)))                # the launch is under way: too late
    assert d.job.resume_step == 60 and "resume_step" not in d.detail


def test_actions_follow_from_the_state_alone_so_a_restart_repeats_the_step():
    job = running_job()
    seen, _ = recover(job, FaultSeen(fault()))
    for d in seen:
        # what a restarted controller carries out from the recorded snapshot == what was decided
        assert pending_actions(Job.from_dict(d.job.to_dict())) == d.actions


def test_duplicate_and_stale_faults_cause_no_second_action():
    job = running_job()
    _, job = recover(job, FaultSeen(fault()))
    assert decide(job, FaultSeen(fault())).actions == ()                                  # same fault id
    assert decide(job, FaultSeen(fault(node="node1", fid="f2", ts=401))).actions == ()     # evicted node
    assert decide(job, FaultSeen(fault(node="node2", fid="f3", ts=250))).actions == ()     # before this launch
    mid = decide(running_job(), FaultSeen(fault())).job                                  # while stopping
    assert decide(mid, FaultSeen(fault(node="node2", fid="f4", ts=400))).actions == ()


def test_precheck_failure_evicts_the_node_and_takes_the_next_spare():
    job = running_job(nodes=NODES + ("node5",))
    seen, job = recover(job, FaultSeen(fault()), precheck_failed={1: {"node4": "XID 79 on GPU 0 3s ago"}})
    names = [d.name for d in seen]
    assert names == ["relaunching", "evicting", "replacing", "precheck_failed", "precheck_passed", "launched"]
    failed = seen[3]
    assert failed.actions == (Cordon("node4", "pre-check: XID 79 on GPU 0 3s ago"),
                              Precheck(1, ("node0", "node5", "node2", "node3")))
    assert job.nodes == ("node0", "node5", "node2", "node3") and set(job.evicted) == {"node1", "node4"}


def test_initial_precheck_failure_with_no_spare_fails_the_job():
    job = decide(Job(job="j", spec=JobSpec(("x",), 4)), Submitted(NODES[:4])).job
    d = decide(job, PrecheckDone(0, {"node2": "no fresh heartbeat"}))
    assert d.job.state == JobState.FAILED and "node2" in d.job.failure and "no spare" in d.job.failure
    assert Cordon("node2", "no fresh heartbeat") in d.actions


def test_no_spare_left_fails_the_job_with_the_reason():
    _, job = recover(running_job(), FaultSeen(fault()))
    job = decide(job, StepSeen(1, 41, 310.0)).job
    d = decide(job, FaultSeen(fault(node="node2", fid="f2", ts=400.0)))
    assert d.job.state == JobState.FAILED and "no spare is left" in d.job.failure
    assert d.actions == (Stop(1), Cordon("node2", "xid on node2"))


def test_no_spare_shrinks_the_job_when_it_allows():
    _, job = recover(running_job(min_world_size=3), FaultSeen(fault()))
    job = decide(job, StepSeen(1, 41, 310.0)).job
    seen, job = recover(job, FaultSeen(fault(node="node2", fid="f2", ts=400.0)))
    assert seen[0].detail["dropped"] == ["node2"] and job.nodes == ("node0", "node4", "node3")
    assert seen[-1].name == "launched"


def test_hang_restarts_in_place_and_rank_exit_counts_against_the_budget():
    job = running_job(max_restarts=1)
    seen, job = recover(job, FaultSeen(fault(kind=c.FaultKind.HANG, node="node2")))
    assert [d.name for d in seen] == ["relaunching", "replacing", "precheck_passed", "launched"]   # no eviction
    assert seen[-2].actions[0].nodes == NODES[:4]
    d = decide(job, RanksExited(1, {0: 0, 1: -9, 2: 0, 3: 0}, ts=320.0))
    assert d.job.state == JobState.FAILED and "restart budget of 1 per 3600s spent" in d.job.failure
    assert d.actions == (Stop(1),)


def test_restart_budget_is_per_window_and_backs_off():
    job = running_job(max_restarts=2, restart_window_s=100.0, backoff_s=2.0)
    seen, job = recover(job, FaultSeen(fault(kind=c.FaultKind.HANG, fid="a", ts=200.0), ts=200.0))
    assert seen[0].detail["backoff_s"] == 2.0          # same nodes again: never a tight restart loop
    seen, job = recover(job, FaultSeen(fault(kind=c.FaultKind.HANG, fid="b", ts=350.0), ts=350.0))
    assert seen[0].detail["backoff_s"] == 2.0          # the first restart fell out of the window
    seen, job = recover(job, FaultSeen(fault(kind=c.FaultKind.HANG, fid="c", ts=400.0), ts=400.0))
    assert seen[0].detail["backoff_s"] == 4.0 and job.not_before == 404.0
    d = decide(job, FaultSeen(fault(kind=c.FaultKind.HANG, fid="d", ts=420.0), ts=420.0))
    assert d.job.state == JobState.FAILED and "restart budget of 2 per 100s" in d.job.failure
    job = running_job(backoff_s=2.0)
    seen, job = recover(job, FaultSeen(fault(fid="e", ts=200.0), ts=200.0))
    assert seen[0].detail["backoff_s"] == 0.0          # a node was replaced: the first relaunch does not wait


def test_a_rank_that_fails_before_its_first_step_fails_the_job_with_its_log():
    job = running_job()
    logs = {1: {"log": "runs/j/gen-0/rank-1.log", "tail": ["Traceback", "FileNotFoundError: train.py"]}}
    d = decide(job, RanksExited(0, {0: 0, 1: 2}, ts=101.0, logs=logs))
    assert d.job.state == JobState.FAILED and d.actions == (Stop(0),)
    assert d.detail["reason"] == ("rank 1 on node1 exited with code 2 (log: runs/j/gen-0/rank-1.log) before its "
                                  "first training step; last lines: Traceback | FileNotFoundError: train.py")
    job = decide(job, StepSeen(0, 1, 102.0)).job            # once it trained, a crash is healed
    seen, job = recover(job, RanksExited(0, {0: 0, 1: 2}, ts=110.0, logs=logs))
    assert seen[0].name == "relaunching" and "rank-1.log" in seen[0].detail["reason"]


def test_no_report_warns_once_then_a_launch_without_a_first_step_fails():
    job = running_job(report_warn_s=60, start_timeout_s=300, max_restarts=1)
    assert decide(job, StartOverdue(0, 30.0)).name == ""
    d = decide(job, StartOverdue(0, 61.0))
    assert d.name == "warning" and "no training report from generation 0 within 60s" in d.detail["warning"]
    assert decide(d.job, StartOverdue(0, 70.0)).name == ""              # once per generation
    seen, job = recover(d.job, StartOverdue(0, 301.0, ts=401.0))
    assert seen[0].name == "relaunching" and "did not reach its first training step within 300s" in \
        seen[0].detail["reason"]
    d = decide(job, StartOverdue(1, 301.0, ts=800.0))
    assert d.job.state == JobState.FAILED and "restart budget" in d.job.failure


def test_cancel_stops_the_ranks_and_ends_the_job():
    d = decide(running_job(), Cancel("by alice"))
    assert d.job.state == JobState.CANCELLED and d.name == "cancelled" and d.actions == (Stop(0),)
    assert decide(d.job, Cancel("again")).name == ""


def test_all_ranks_exiting_zero_completes_the_job():
    d = decide(running_job(), RanksExited(0, {r: 0 for r in range(4)}))
    assert d.job.state == JobState.COMPLETED and d.name == "completed"


def test_first_step_after_relaunch_is_recorded_with_steps_lost():
    job = decide(running_job(), CheckpointSeen(ready(40))).job
    for step in range(1, 48):
        job = decide(job, StepSeen(0, step, 100.0 + step)).job
    _, job = recover(job, FaultSeen(fault()))
    job = decide(job, StepSeen(0, 49, 301.0)).job      # a late report of the stopped generation
    d = decide(job, StepSeen(1, 41, 310.0))
    assert d.name == "resumed" and d.detail["steps_lost"] == 49 - 40
    assert decide(d.job, StepSeen(0, 50, 311.0)).job == d.job   # too late: recovery already recorded


def test_a_relaunch_that_ends_before_a_step_of_it_is_seen_resumed_then_completed():
    # a controller that took over while the relaunched generation ran sees only its ranks exit
    job = decide(running_job(), CheckpointSeen(ready(40))).job
    job = decide(job, StepSeen(0, 45, 150.0)).job
    _, job = recover(job, FaultSeen(fault()))
    exited = RanksExited(1, {r: 0 for r in range(4)}, 330.0)
    d = decide(job, exited)
    assert d.name == "resumed" and d.job.state == JobState.RUNNING and d.actions == (Then(exited),)
    assert d.detail["seen"] == "exit" and d.detail["step"] is None and d.detail["steps_lost"] == 45 - 40
    d = decide(d.job, exited)
    assert d.name == "completed" and d.job.state == JobState.COMPLETED


def test_evicted_nodes_memory_copies_do_not_count_as_surviving():
    job = decide(running_job(), CheckpointSeen(ready(40, tier=c.Tier.MEMORY))).job
    d = decide(job, FaultSeen(fault()))
    assert d.job.resume_step is None               # rank 1's only copy was on the evicted node


def test_policy_by_kind_and_severity():
    assert FAULT_POLICY[c.FaultKind.ANOMALY][c.Severity.CRITICAL] == c.Action.OBSERVE
    assert FAULT_POLICY[c.FaultKind.XID][c.Severity.WARNING] == c.Action.OBSERVE
    d = decide(running_job(), FaultSeen(fault(kind=c.FaultKind.ANOMALY)))
    assert d.name == "fault_observed" and d.actions == ()
    d = decide(running_job(), FaultSeen(fault(severity=c.Severity.WARNING)))
    assert d.name == "fault_observed"


def test_a_critical_straggler_is_replaced_by_a_spare_and_kept_without_one():
    d = decide(running_job(), FaultSeen(fault(kind=c.FaultKind.STRAGGLER, node="node2")))
    assert d.name == "relaunching" and d.detail["evicted"] == "node2" and d.detail["replacement"] == NODES[4]
    d = decide(running_job(), FaultSeen(fault(kind=c.FaultKind.STRAGGLER, severity=c.Severity.WARNING)))
    assert d.name == "fault_observed" and d.actions == ()
    alone = running_job(nodes=NODES[:4])
    d = decide(alone, FaultSeen(fault(kind=c.FaultKind.STRAGGLER, node="node2")))
    assert d.name == "fault_observed" and d.detail["kept"] == "no spare node" and d.job.nodes == alone.nodes
    assert d.job.state == JobState.RUNNING


def test_illegal_transitions_raise():
    done = decide(running_job(), RanksExited(0, {r: 0 for r in range(4)})).job
    with pytest.raises(IllegalTransition, match="completed -> running"):
        done.moved(JobState.RUNNING)
    mid = decide(running_job(), FaultSeen(fault())).job
    later = mid.moved(JobState.RECOVERING, RecoveryStep.REPLACING)
    with pytest.raises(IllegalTransition, match="replacing -> stopping is not allowed"):
        later.moved(JobState.RECOVERING, RecoveryStep.STOPPING)


def test_snapshot_round_trips():
    job = decide(running_job(), CheckpointSeen(ready(40))).job
    job = decide(job, FaultSeen(fault())).job
    assert Job.from_dict(c.decode(c.LIFECYCLE, c.encode(c.LifecycleEvent(
        job="j", seq=0, ts=1.0, name="x", state=job.state.value, snapshot=job.to_dict()))).snapshot) == job


def test_resume_point_is_the_newest_checkpoint_that_survives_the_eviction():
    job = running_job()
    job = decide(job, CheckpointSeen(ready(20, tier=c.Tier.DISK))).job     # rank r's copy on node r only
    job = decide(job, CheckpointSeen(ready(10, tier=c.Tier.SHARED))).job   # arriving late, older, shared
    job = decide(job, CheckpointSeen(ready(30, tier=c.Tier.MEMORY))).job
    assert decide(job, FaultSeen(fault())).job.resume_step == 10           # node1 held 20's and 30's rank 1
    assert decide(job, FaultSeen(fault(kind=c.FaultKind.HANG))).job.resume_step == 30    # nothing evicted


def test_a_checkpoint_of_a_replaced_generation_is_ignored():
    job = running_job()
    seen, job = recover(job, FaultSeen(fault()))            # generation 1 launched
    assert job.launched_generation == 1
    stale = dataclasses.replace(ready(90), generation=0)     # the old host's daemon, back after a partition
    d = decide(job, CheckpointSeen(stale))
    assert d.name == "" and d.job.checkpoints == job.checkpoints and d.detail["stale_generation"] == 0
    d = decide(job, CheckpointSeen(dataclasses.replace(ready(90), generation=1)))
    assert d.name == "checkpoint" and int(d.job.checkpoints[-1]["step"]) == 90


def test_a_rank_exit_names_the_node_the_backend_says_it_ran_on():
    """Slurm orders a step's tasks itself: rank 0 of a launch on node4,node1,... ran on node1."""
    nodes = {0: "node1", 1: "node2", 2: "node3", 3: "node0"}
    trained = decide(running_job(), StepSeen(0, 5, 150.0)).job      # (an exit before any step fails the job)
    d = decide(trained, RanksExited(0, {0: 1, 1: 0, 2: 0, 3: 0}, ts=300.0, nodes=nodes))
    assert d.name == "relaunching" and "rank 0 on node1 exited with code 1" in d.detail["reason"], d.detail
    assert d.cause == {"kind": "rank_exit", "node": "node1", "rank": 0}
    plain = decide(trained, RanksExited(0, {0: 0, 1: 0, 2: 1, 3: 0}, ts=300.0))
    assert plain.cause["node"] == running_job().nodes[2]          # no word from the backend: nodes[r]
