"""The controller with the local backend: real broker, real agents, real 4-rank torch jobs, real files.

Faults are published to transom.faults the way the TEE publishes them, so these tests exercise
the controller alone; the end-to-end test runs the TEE too. Controllers are killed with SIGKILL
(by the test, or by themselves through the TRANSOM_TEST_CRASH_AT test hook) mid-recovery, and
launches are counted from the lifecycle and from the generations' launch records.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from transom import contracts as c
from transom.kafka import make_producer, publish
from transom.stack import LocalStack, train_command

from util import topic_values, until_alive, wait_until

pytestmark = pytest.mark.integration
NODES = [f"node{i}" for i in range(5)]


@pytest.fixture(scope="module")
def stack(broker, tmp_path_factory):
    """Real node agents (simulated GPUs) for node0..node4: the pre-check reads their heartbeats."""
    s = LocalStack(tmp_path_factory.mktemp("stack"), bootstrap=broker.bootstrap, nodes=len(NODES))
    try:
        s.start_agents()
        yield s
    finally:
        s.stop()
        from transom.controller.local import LocalBackend
        for gen_dir in s.run_dir.glob("runs/*/*/gen-*"):        # ranks a failed test may have left
            LocalBackend(gen_dir.parents[1], {}).stop(gen_dir.parent.name, int(gen_dir.name.split("-")[1]), 5)


def start_controller(stack: LocalStack, job: str | None, name: str, *, steps: int = 40, ckpt_every: int = 5,
                     crash_at: str | None = None, extra: tuple = ()) -> subprocess.Popen:
    """``transom controller`` started the way the demo starts it; ``crash_at`` sets the test hook."""
    old = os.environ.pop("TRANSOM_TEST_CRASH_AT", None)
    if crash_at:
        os.environ["TRANSOM_TEST_CRASH_AT"] = crash_at
    try:
        # each test its own run directory: cordoned nodes stay out of that test's launches only
        proc = stack.start_controller(job, train_command(steps, ckpt_every), world_size=4, name=name,
                                      extra=["--exit-when-done", "--run-dir", str(run_dir(stack, job)),
                                             "--heal", "relaunch", *extra])   # these test the relaunch path
    finally:
        os.environ.pop("TRANSOM_TEST_CRASH_AT", None)
        if old is not None:
            os.environ["TRANSOM_TEST_CRASH_AT"] = old
    return proc.popen


def run_dir(stack: LocalStack, job: str) -> Path:
    return stack.run_dir / "runs" / job


def lifecycle(bootstrap: str, job: str) -> list[c.LifecycleEvent]:
    return [e for e in topic_values(bootstrap, c.LIFECYCLE) if e.job == job]


def checkpoints(bootstrap: str, job: str) -> list[c.CheckpointReady]:
    return [e for e in topic_values(bootstrap, c.CHECKPOINTS) if e.job == job]


def fault(job: str, node: str, kind: c.FaultKind = c.FaultKind.XID) -> c.FaultEvent:
    now = time.time()
    return c.FaultEvent(fault_id=c.stable_id(job, node, kind.value, now), job=job, node=node, kind=kind,
                        severity=c.Severity.CRITICAL, detector=f"rule:{kind.value}",
                        action=c.Action.EVICT if kind == c.FaultKind.XID else c.Action.RESTART,
                        observed_ts=now, detected_ts=now, evidence={"xid": 79} if kind == c.FaultKind.XID else {},
                        summary=f"{kind.value} on {node}")


def send(bootstrap: str, *faults: c.FaultEvent) -> None:
    producer = make_producer(bootstrap)
    for f in faults:
        publish(producer, c.FAULTS, f.job, f)
    producer.flush(10)


def finish(proc: subprocess.Popen, timeout: float = 120) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def launches(events: list[c.LifecycleEvent]) -> list[int]:
    return [e.detail["generation"] for e in events if e.name == "launched"]


def test_xid_evicts_relaunches_on_the_spare_and_survives_a_controller_killed_after_eviction(broker, stack):
    job, bs = "ctl-xid", broker.bootstrap
    first = start_controller(stack, job, "ctl-xid-1", crash_at="evicting", extra=("--precheck", "health"))
    until_alive(first, lambda: any(e.step >= 10 for e in checkpoints(bs, job)), 90, "a checkpoint at step 10 or later")
    f = fault(job, "node1")
    send(bs, f, f)                                   # a redelivery: must not cause a second action
    assert first.wait(60) == -signal.SIGKILL         # the test hook killed it after the eviction
    events = lifecycle(bs, job)
    assert events[-1].name == "evicting" and events[-1].snapshot["step"] == "evicting"
    second = start_controller(stack, job, "ctl-xid-2", extra=("--precheck", "health"))
    assert finish(second) == 0
    events = lifecycle(bs, job)
    names = [e.name for e in events]
    relaunch = [e for e in events if e.name == "relaunching"]
    assert len(relaunch) == 1, names
    r = relaunch[0]
    assert r.cause["fault_id"] == f.fault_id
    assert r.detail["evicted"] == "node1" and r.detail["replacement"] == "node4"
    assert r.detail["nodes"] == ["node0", "node4", "node2", "node3"]
    # the newest checkpoint the controller had recorded when it decided (one published a moment
    # before the fault may still have been on its way to the controller: that is not a miss)
    seen = [e.detail["step"] for e in events[:events.index(r)] if e.name == "checkpoint"]
    newest_before = max(seen)
    assert r.detail["resume_step"] == newest_before
    assert r.detail["resume_step"] in {e.step for e in checkpoints(bs, job) if e.ts <= r.ts}
    # the recovery's steps, each once, in order, across the two controllers
    recovery = names[names.index("relaunching"):]
    assert [n for n in recovery if n in ("relaunching", "evicting", "replacing", "precheck_passed", "launched",
                                         "resumed")] == ["relaunching", "evicting", "replacing", "precheck_passed",
                                                         "launched", "resumed"]
    assert launches(events) == [0, 1] and names[-1] == "completed"
    resumed = next(e for e in events if e.name == "resumed")
    # the launch resumes from the newest checkpoint recorded before it: one completed after the fault
    # (a save in flight, finished by the daemons) moves the resume point while the relaunch has not started
    launched = next(e for e in events if e.name == "launched" and e.detail["generation"] == 1)
    resume = max(e.detail["step"] for e in events[:events.index(launched)] if e.name == "checkpoint")
    assert resume >= newest_before
    # the ranks keep training until they are stopped: one interval (+ the step in flight), or two when the
    # save in flight at the fault completed only after the relaunch had started
    assert 0 <= resumed.detail["steps_lost"] <= 2 * 5 + 1
    jobs_dir = run_dir(stack, job)
    assert "node1" in json.loads((jobs_dir / "cordoned.json").read_text())
    gen1 = jobs_dir / job / "gen-1"
    assert json.loads((gen1 / "launch.json").read_text())["resume_step"] == resume
    assert all((gen1 / f"rank-{r}.exit").read_text().strip() == "0" for r in range(4))
    assert sorted(p.name for p in (jobs_dir / job).glob("gen-*")) == ["gen-0", "gen-1"]
    assert f"resumed from step {resume} gen 1" in (gen1 / "rank-0.log").read_text()


def test_collective_precheck_runs_a_gloo_all_reduce_in_forks_of_one_zygote(tmp_path):
    from transom.controller.local import LocalBackend

    backend = LocalBackend(tmp_path, {n: "127.0.0.1:9" for n in NODES[:3]})
    try:
        assert backend.collective_test("j", 0, NODES[:2], 20) == {}
        zygote = backend._zygote.pid
        assert backend.collective_test("j", 1, [NODES[2], NODES[0]], 20) == {}
        assert backend._zygote.pid == zygote                  # reused, not started again
        backend._zygote.kill()
        backend._zygote.wait()
        assert backend.collective_test("j", 2, NODES[:2], 20) == {}          # a dead zygote is replaced
        assert backend._zygote.pid != zygote
        assert backend.health(["node1", "nodeX"]) == {"nodeX": "no agent address (give --node NAME=HOST:PORT)"}
    finally:
        backend.close()
    assert backend._zygote is None
    cold = LocalBackend(tmp_path / "cold", {n: "127.0.0.1:9" for n in NODES[:2]}, warm=False)
    assert cold.collective_test("j", 0, NODES[:2], 20) == {} and cold._zygote is None     # fresh interpreters


def test_a_forked_rank_finds_what_its_optimizer_imports_already_imported(tmp_path):
    """The zygote's default preload covers what a training script's optimizer imports (torch._dynamo: over
    a second of CPU that each rank and each warm spare would otherwise pay after its fork)."""
    import sys

    from transom.controller.local import LocalBackend

    backend = LocalBackend(tmp_path, {"node0": "127.0.0.1:9"})
    script = tmp_path / "job.py"
    script.write_text("import sys\nhad = 'torch._dynamo' in sys.modules\nimport torch\n"
                      "torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())\n"
                      "print('preloaded', had, flush=True)\n")
    try:
        backend.launch("j", 0, ("node0",), (sys.executable, str(script)), None)
        wait_until(lambda: not any(s.running for s in backend.status("j", 0)), 60, "the rank to end")
        assert [s.exit_code for s in backend.status("j", 0)] == [0]
        assert "preloaded True" in (tmp_path / "j" / "gen-0" / "rank-0.log").read_text()
    finally:
        backend.close()


def test_warm_ranks_are_forks_of_the_zygote(tmp_path):
    """A rank is a fork of the zygote (torch already imported) with the launch's environment, argv,
    log, pid and exit files; a command the zygote cannot run starts cold under rankwrap."""
    import sys

    import psutil

    from transom.controller.local import LocalBackend

    backend = LocalBackend(tmp_path, {n: "127.0.0.1:9" for n in NODES[:2]}, preload="json")
    go = tmp_path / "go"
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\nprint('rank', os.environ['RANK'], 'on', os.environ['TRANSOM_NODE'], sys.argv[1:])\n"
                      f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n"
                      "sys.exit(int(os.environ['RANK']) * 3)\n")
    try:
        handle = backend.launch("j", 0, tuple(NODES[:2]), (sys.executable, str(script), "--flag"), None)
        zygote = backend._zygote.pid
        for pid in handle["pids"]:
            assert os.getpgid(pid) == pid      # its own group at once: stop() reaches it, and only it
            proc = psutil.Process(pid)
            assert proc.ppid() == zygote and "transom.controller.zygote" in proc.cmdline()
        go.write_text("")
        wait_until(lambda: not any(s.running for s in backend.status("j", 0)), 30, "the forked ranks to end")
        assert [s.exit_code for s in backend.status("j", 0)] == [0, 3]
        gen = tmp_path / "j" / "gen-0"
        assert "rank 1 on node1 ['--flag']" in (gen / "rank-1.log").read_text()
        assert (gen / "rank-0.pid").read_text().split() == [str(handle["pids"][0])] * 2
        # -m modules too
        (tmp_path / "doc.json").write_text('{"a": 1}')
        handle = backend.launch("j", 1, (NODES[1],), (sys.executable, "-m", "json.tool", str(tmp_path / "doc.json")),
                                None)
        wait_until(lambda: not any(s.running for s in backend.status("j", 1)), 30, "the module rank to end")
        assert backend.status("j", 1)[0].exit_code == 0
        assert '"a": 1' in (tmp_path / "j" / "gen-1" / "rank-0.log").read_text()
        # interpreter flags: not something a fork can reproduce, so rankwrap runs it
        handle = backend.launch("j", 2, (NODES[0],), (sys.executable, "-u", str(script)), None)
        assert psutil.Process(handle["pids"][0]).ppid() != zygote
        wait_until(lambda: not any(s.running for s in backend.status("j", 2)), 30, "the cold rank to end")
        assert backend.status("j", 2)[0].exit_code == 0
    finally:
        backend.close()


def test_standby_takes_over_during_relaunch_hang_restarts_in_place_and_the_budget_fails_the_job(broker, stack):
    """Two controllers; the active one SIGKILLs itself right after launching generation 1 (a restart in
    place after a hang); the standby takes over, adopts that launch, and fails the job at the next hang."""
    job, bs = "ctl-standby", broker.bootstrap
    extra = ("--max-restarts", "1", "--precheck", "health")
    active = start_controller(stack, job, "ctl-standby-a", steps=400, crash_at="relaunching", extra=extra)
    until_alive(active, lambda: 0 in launches(lifecycle(bs, job)), 90, "the first launch")
    standby = start_controller(stack, job, "ctl-standby-b", steps=400, extra=extra)
    try:
        wait_until(lambda: "standby" in (stack.run_dir / "logs" / "ctl-standby-b.log").read_text(), 30,
                   "the second controller to stand by")
        send(bs, fault(job, "node2", c.FaultKind.HANG))
        assert active.wait(90) == -signal.SIGKILL
        died = time.time()
        until_alive(standby, lambda: 1 in launches(lifecycle(bs, job)), 60, "the standby to record the relaunch")
        took_over = time.time() - died
        send(bs, fault(job, "node3", c.FaultKind.HANG))
        assert finish(standby) == 1
    finally:
        if standby.poll() is None:
            os.killpg(standby.pid, signal.SIGKILL)
    log = (stack.run_dir / "logs" / "ctl-standby-b.log").read_text()
    assert "holds the lease (term" in log and "already known" in log
    events = lifecycle(bs, job)
    names = [e.name for e in events]
    assert names.count("submitted") == 1
    assert launches(events) == [0, 1], names                 # generation 1 adopted, not launched again
    assert sorted(p.name for p in (run_dir(stack, job) / job).glob("gen-*")) == ["gen-0", "gen-1"]
    relaunch = next(e for e in events if e.name == "relaunching")
    assert "evicted" not in relaunch.detail and relaunch.detail["nodes"] == NODES[:4]    # in place
    # the stopped ranks' in-flight saves may still complete (save at the fault): "checkpoint" may follow
    decisions = [e for e in events if e.name != "checkpoint"]
    assert decisions[-1].name == "failed" and "restart budget of 1" in decisions[-1].detail["reason"], names
    assert decisions[-1].cause["kind"] == "hang"
    assert all((run_dir(stack, job) / job / "gen-1" / f"rank-{r}.exit").exists() for r in range(4))
    print(f"the standby recorded the adopted launch {took_over:.1f}s after the active controller died")


def test_a_lifecycle_snapshot_that_is_not_a_job_is_skipped_and_every_other_job_is_replayed(fresh_broker):
    """A snapshot another tool (or a newer version) wrote on the lifecycle topic must not stop a controller
    from starting, nor `transom jobs` from listing the jobs it can read."""
    import sys

    from transom.controller.service import replay
    from transom.controller.state import Job, JobSpec, JobState

    bs, producer = fresh_broker.bootstrap, make_producer(fresh_broker.bootstrap)
    good = Job(job="good", spec=JobSpec(("python", "train.py"), 4), state=JobState.RUNNING, launched_generation=0)
    for seq, (job, snap) in enumerate([("good", good.to_dict()), ("odd", {"job": "odd", "state": "running"}),
                                       ("gone", good.to_dict() | {"job": "gone"}), ("gone", {"state": "x"})]):
        publish(producer, c.LIFECYCLE, job, c.LifecycleEvent(job=job, seq=seq, ts=time.time(), name="launched",
                                                             state="running", snapshot=snap))
    assert producer.flush(10) == 0
    jobs, seqs = replay(bs)
    # "gone": its newest word is unreadable, so it is not driven from the older one
    assert set(jobs) == {"good"} and jobs["good"] == good
    assert seqs == {"good": 1, "odd": 2, "gone": 4}       # a new event of any of them takes the next seq
    listed = subprocess.run([sys.executable, "-m", "transom.cli", "jobs", "--bootstrap", bs], capture_output=True,
                            text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert "good" in listed.stdout and "odd" not in listed.stdout


def test_stop_ends_a_warm_spare_whose_record_its_controller_never_wrote(tmp_path):
    """A controller killed between starting a warm spare and writing its spare.json leaves a spare no record
    names: stopping the generation still ends it (its pid file, as for ranks)."""
    import sys

    import psutil

    from transom.controller.local import LocalBackend

    backend = LocalBackend(tmp_path, {n: "127.0.0.1:9" for n in NODES[:2]}, preload="json")
    script = tmp_path / "spare.py"
    script.write_text("import time\nwhile True:\n    time.sleep(0.1)\n")
    procs = []
    try:
        for command in ((sys.executable, str(script)), (sys.executable, "-u", str(script))):   # forked; cold
            spare = backend.start_spare("j", 0, NODES[1], command)
            procs.append(proc := psutil.Process(spare["pid"]))
            # the controller died after the spare started (the fork, or the wrapper, has written its pid
            # file: milliseconds after the zygote answers, and a new controller takes seconds to start)
            wait_until(lambda: (Path(spare["dir"]) / "rank-0.pid").exists(), 30, "the spare's pid file")
            (Path(spare["dir"]) / "spare.json").unlink()
            backend.stop("j", 0, 5)
            wait_until(lambda: not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE, 10,
                       f"the unrecorded spare of {command} to end")
    finally:
        for proc in procs:
            if proc.is_running():
                proc.kill()
        backend.close()
