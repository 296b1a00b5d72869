"""In-job recovery with real ranks (issue 17): real broker, real agents, real 4-rank gloo jobs of
``transom.examples.train_lm`` under ``transom controller``, a warm spare on the fifth node.

The jobs are held at a step with the example's pause hook (``--slowdown-dir D``, ``D/pause`` =
``T STEP``), so a fault always lands while the job trains, whatever the machine's load: the test
signals a rank while the others sleep in the hook, then releases them into the collective that fails.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
from pathlib import Path

import pytest

from transom import contracts as c
from transom.stack import LocalStack, train_command

from test_controller import fault, finish, lifecycle, send
from util import until_alive

pytestmark = pytest.mark.integration
NODES = [f"node{i}" for i in range(5)]
TINY = ("--width", "16", "--layers", "1", "--heads", "2", "--seq-len", "16", "--batch-size", "2", "--log-every", "5")


@pytest.fixture(scope="module")
def stack(broker, tmp_path_factory):
    s = LocalStack(tmp_path_factory.mktemp("heal"), bootstrap=broker.bootstrap, nodes=len(NODES))
    try:
        s.start_agents()
        yield s
    finally:
        s.stop()
        from transom.controller.local import LocalBackend
        for gen_dir in s.run_dir.glob("runs/*/*/gen-*"):        # ranks and spares a failed test may have left
            LocalBackend(gen_dir.parents[1], {}).stop(gen_dir.parent.name, int(gen_dir.name.split("-")[1]), 5)


def start(stack: LocalStack, job: str, steps: int, hold: Path, extra: tuple = ()) -> tuple:
    hold.mkdir(parents=True, exist_ok=True)
    (hold / "pause").write_text(f"{time.time() + 3600} 6\n")   # every rank stops after step 6 (saved step 5)
    run_dir = stack.run_dir / "runs" / job
    proc = stack.start_controller(job, train_command(steps, 5, "--slowdown-dir", str(hold), *TINY), world_size=4,
                                  name=job, extra=["--exit-when-done", "--run-dir", str(run_dir), "--precheck",
                                                   "health", "--heal-timeout", "40", *extra])
    return proc.popen, run_dir / job


def hold_from(hold: Path, step: int) -> None:
    (hold / "pause").write_text(f"{time.time() + 3600} {step}\n")


def release(hold: Path) -> None:
    (hold / "pause").write_text("0\n")


def decisions(bs: str, job: str) -> list[c.LifecycleEvent]:
    """The controller's events of ``job`` (not the ranks' own words on the control channel)."""
    return [e for e in lifecycle(bs, job) if e.state != "request"]


def names(bs: str, job: str) -> list[str]:
    return [e.name for e in decisions(bs, job)]


def pids(gen: Path) -> dict[int, int]:
    return {r: int((gen / f"rank-{r}.pid").read_text().split()[0]) for r in range(4)}


def at_step(gen: Path, step: int) -> bool:
    return f"step {step}/" in (gen / "rank-0.log").read_text() if (gen / "rank-0.log").exists() else False


def sync_hashes(logs: list[Path], epoch: int) -> dict[int, str]:
    """Per rank, the digests of its parameters and of its optimizer state after the sync of ``epoch``."""
    out = {}
    for log in logs:
        for m in re.finditer(r"elastic: rank (\d+) epoch (\d+) step \d+ params sha256 ([0-9a-f]+) "
                             r"optimizer xxh3 ([0-9a-f]+)", log.read_text()):
            if int(m.group(2)) == epoch:
                out[int(m.group(1))] = m.group(3) + " " + m.group(4)
    return out


def story(stack: LocalStack, bs: str, job: str, jobdir: Path) -> str:
    """What a failed wait shows: the controller's decisions and the last lines of its log and of every rank's."""
    lines = [f"{e.name} {e.cause} {e.detail}" for e in decisions(bs, job)]
    logs = [stack.run_dir / "logs" / f"{job}.log", *sorted(jobdir.glob("gen-*/rank-*.log")),
            *sorted(jobdir.glob("gen-*/spare-*/rank-*.log"))]
    for log in logs:
        if log.exists():
            lines += [f"--- {log.relative_to(stack.run_dir)}", *log.read_text(errors="replace").splitlines()[-15:]]
    return "\n".join(lines)


def wait_for(stack: LocalStack, bs: str, job: str, jobdir: Path, proc, check, timeout: float, what: str) -> None:
    try:
        until_alive(proc, check, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{story(stack, bs, job, jobdir)}") from None


def test_crash_and_hang_are_healed_in_the_job_survivors_keep_their_processes(broker, stack):
    job, bs = "heal-a", broker.bootstrap
    hold = stack.run_dir / "hold-a"
    proc, jobdir = start(stack, job, 30, hold)
    gen = jobdir / "gen-0"
    try:
        until_alive(proc, lambda: at_step(gen, 5) and "spare_ready" in names(bs, job), 60,
                    "step 5 and a warm spare on node4")
        before = pids(gen)
        # rank 3 comes out of the pause 3 s after the others (its data loader, say): the new group is named
        # while it is between steps, and it must give up the old group's all-reduce it starts afterwards
        (hold / "node3").write_text("0.5 3\n")
        os.kill(before[1], signal.SIGKILL)                      # (a) a crash of rank 1, while the others wait
        hold_from(hold, 12)
        wait_for(stack, bs, job, jobdir, proc, lambda: "healed" in names(bs, job), 60, "the in-job heal of the crash")
        (hold / "node3").unlink()
        # the crashed node went back to the pool: a new warm spare there; then (d) a hang of rank 2
        wait_for(stack, bs, job, jobdir, proc, lambda: names(bs, job).count("spare_ready") >= 2 and at_step(gen, 10),
                 60, "a new warm spare on node1")
        os.kill(before[2], signal.SIGSTOP)
        release(hold)
        send(bs, fault(job, "node2", c.FaultKind.HANG))         # what the TEE raises for the stopped rank
        assert finish(proc, 90) == 0
    finally:
        release(hold)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    events = decisions(bs, job)
    seen = [e.name for e in events]
    assert "relaunching" not in seen and seen[-1] in ("completed", "checkpoint"), seen
    heals = [e for e in events if e.name == "healing"]
    assert [(h.detail["rank"], h.detail["failed_node"], h.detail["spare"]) for h in heals] == \
        [(1, "node1", "node4"), (2, "node2", "node1")]
    assert heals[1].cause["kind"] == "hang"
    healed = [e for e in events if e.name == "healed"]
    assert len(healed) == 2 and all(h.detail["path"] == "in-job" and h.detail["seconds"] >= 0 for h in healed)
    # (a) the survivors are the same processes, and they finished the job
    assert [p for p in (jobdir).glob("gen-*")] == [gen]
    for r in (0, 3):
        assert int((gen / f"rank-{r}.pid").read_text().split()[0]) == before[r]
        assert (gen / f"rank-{r}.exit").read_text().strip() == "0"
        assert "restored step" not in (gen / f"rank-{r}.log").read_text()      # no checkpoint loaded
    assert "done: 30 steps" in (gen / "rank-0.log").read_text()
    assert "all-reduce of rank 3 given up: group epoch 1 was named" in (gen / "rank-3.log").read_text()
    # (b) each spare's parameters and optimizer state equal the survivors' bit for bit after it joined
    logs = [gen / f"rank-{r}.log" for r in range(4)] + sorted(gen.glob("spare-*/rank-0.log"))
    for epoch in (1, 2):
        hashes = sync_hashes(logs, epoch)
        assert sorted(hashes) == [0, 1, 2, 3] and len(set(hashes.values())) == 1, (epoch, hashes)
    spare_log = (gen / "spare-node4-0" / "rank-0.log").read_text()
    assert "took rank 1" in spare_log and "data position of step 6 from checkpoint step 5 + 1 batches" in spare_log
    # (c) a group left with a collective pending on the dead peer is released once that collective ends:
    # its gloo threads and sockets do not pile up, one group per heal
    for log in logs:
        text = log.read_text()
        kept = {int(e) for e in re.findall(r"the group of epoch (\d+) keeps a pending collective", text)}
        released = {int(e) for m in re.findall(r"released the group\(s\) of epoch ([\d, ]+) ", text)
                    for e in m.split(", ")}
        assert kept <= released, (log.name, kept, released)


def test_a_survivor_lost_during_the_reform_falls_back_to_a_relaunch(broker, stack):
    job, bs = "heal-c", broker.bootstrap
    hold = stack.run_dir / "hold-c"
    proc, jobdir = start(stack, job, 12, hold)
    gen = jobdir / "gen-0"
    try:
        until_alive(proc, lambda: at_step(gen, 5) and "spare_ready" in names(bs, job), 60,
                    "step 5 and a warm spare on node4")
        before = pids(gen)
        os.kill(before[2], signal.SIGSTOP)                      # rank 2 will never join the new group
        os.kill(before[1], signal.SIGKILL)
        release(hold)
        until_alive(proc, lambda: "reforming" in names(bs, job), 60, "the new group to be named")
        os.kill(before[2], signal.SIGKILL)                      # (c) a survivor lost during the re-form
        assert finish(proc, 90) == 0
    finally:
        release(hold)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    events = decisions(bs, job)
    relaunch = [e for e in events if e.name == "relaunching"]
    assert len(relaunch) == 1 and relaunch[0].detail["path"] == "relaunch" and "fallback" in relaunch[0].detail
    assert "healed" not in [e.name for e in events]
    assert "resumed from step 5 gen 1" in (jobdir / "gen-1" / "rank-0.log").read_text()
    assert "done: 12 steps" in (jobdir / "gen-1" / "rank-0.log").read_text()


def test_a_failed_collective_makes_the_controller_look_at_the_ranks_at_once(broker, stack):
    """The controller looks at the backend for exited ranks every --poll-interval, here an hour, so it
    sees the crash only because the survivors, whose all-reduce failed, said so on the control channel."""
    job, bs = "heal-d", broker.bootstrap
    hold = stack.run_dir / "hold-d"
    proc, jobdir = start(stack, job, 12, hold, extra=("--poll-interval", "3600"))
    gen = jobdir / "gen-0"
    try:
        # the ranks' own words (joined) are also when it looks: the warm spare starts without a poll
        until_alive(proc, lambda: at_step(gen, 5) and "spare_ready" in names(bs, job), 60,
                    "step 5 and a warm spare on node4")
        before = pids(gen)
        os.kill(before[1], signal.SIGKILL)
        release(hold)
        wait_for(stack, bs, job, jobdir, proc, lambda: "healed" in names(bs, job), 60, "the in-job heal of the crash")
    finally:
        release(hold)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)         # it would not look at the ranks again to see them finish
        from transom.controller.local import LocalBackend
        LocalBackend(jobdir.parent, {}).stop(job, 0, 5)
    heal = next(e for e in decisions(bs, job) if e.name == "healing")
    assert (heal.detail["rank"], heal.cause["kind"]) == (1, "rank_exit")
    words = [e for e in lifecycle(bs, job) if e.state == "request" and e.name == "collective_failed"]
    assert words and {w.detail["rank"] for w in words} <= {0, 2, 3}
    assert all(w.detail["epoch"] == 0 and w.detail["generation"] == 0 for w in words)
    assert "collective failed at step" in (stack.run_dir / "logs" / f"{job}.log").read_text()


def test_a_poll_interval_that_is_not_seconds_is_refused_with_the_flag_named():
    import subprocess
    import sys
    for bad in ("0", "-1", "abc", "inf"):
        done = subprocess.run([sys.executable, "-m", "transom.cli", "controller", "--poll-interval", bad],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and f"--poll-interval: expected seconds > 0, got {bad}" in done.stderr


# --------------------------------------------------------------------------- the policy, driven directly

def _running(**spec):
    from transom.controller.state import ElasticJoined, Job, JobSpec, Launched, PrecheckDone, SpareReady, StepSeen, \
        Submitted, decide
    job = Job(job="j", spec=JobSpec(("python", "train.py"), 4, **spec))
    for ev in (Submitted(tuple(NODES)), PrecheckDone(0), Launched(0, ts=100.0), StepSeen(0, 1, 101.0),
               *(ElasticJoined(0, r) for r in range(4)), SpareReady(0, "node4")):
        job = decide(job, ev).job
    return job


def test_policy_heals_in_the_job_only_with_a_warm_spare_and_falls_back_to_a_relaunch():
    from transom.controller.state import (CollectiveFailed, Cordon, ElasticSynced, FaultSeen, Heal, HealOverdue,
                                          HealStarted, JobState, RanksExited, RecoveryStep, Stop, decide)
    job = _running()
    assert job.warm == ("node4",) and job.joined == (0, 1, 2, 3)
    d = decide(job, RanksExited(0, {1: -9}, ts=110.0))
    assert d.name == "healing" and d.detail["path"] == "in-job" and d.job.step == RecoveryStep.HEALING
    assert d.actions == (Heal(0, 1, 1, "node4", ("node0", "node4", "node2", "node3")),)
    assert d.job.spares == ("node1",) and d.job.warm == () and d.job.restarts == 0     # node1 is a spare again
    d = decide(d.job, HealStarted(0, 1, "127.0.0.1:5", 110.1))
    assert d.name == "reforming" and d.detail["assign"] == {"node4": 1} and d.detail["master"] == "127.0.0.1:5"
    healed = decide(d.job, ElasticSynced(0, 1, 6, 112.0))
    assert healed.name == "healed" and healed.job.state == JobState.RUNNING and healed.detail["seconds"] == 2.0
    # a survivor lost during the re-form, or no step in time: the relaunch, from the checkpoint
    lost = decide(d.job, RanksExited(0, {2: -9}, ts=111.0))
    assert lost.name == "relaunching" and lost.detail["path"] == "relaunch" and "fallback" in lost.detail
    assert lost.actions == (Stop(0),) and lost.job.nodes == ("node0", "node4", "node2", "node3")
    late = decide(d.job, HealOverdue(1, 61.0, 171.0))
    assert late.name == "relaunching" and late.cause["kind"] == "heal_timeout"
    # a survivor found hung, or its GPU lost, during the re-form never joins: the relaunch at once (the XID's
    # node evicted), not after the heal's timeout; a straggler or a fault on a node out of the group waits
    def at(f, ts=111.0):
        return dataclasses.replace(f, detected_ts=ts)

    hung = at(fault("j", "node2", c.FaultKind.HANG))
    h = decide(d.job, FaultSeen(hung, 111.0))
    assert h.name == "relaunching" and "fallback" in h.detail and h.cause["kind"] == "hang"
    assert "during in-job heal epoch 1" in h.detail["reason"] and "node2" in h.job.nodes
    e = decide(d.job, FaultSeen(at(fault("j", "node3", c.FaultKind.XID)), 111.0))
    assert e.name == "relaunching" and e.detail["evicted"] == "node3" and "node3" not in e.job.nodes
    seen = dataclasses.replace(d.job, handled_faults=h.job.handled_faults)
    for quiet, job_ in ((hung, seen),                                                   # once
                        (at(fault("j", "node2", c.FaultKind.STRAGGLER)), d.job),
                        (at(fault("j", "node1", c.FaultKind.HANG)), d.job),             # the node it replaced
                        (at(fault("j", "node2", c.FaultKind.HANG), 109.0), d.job)):     # before the heal began
        assert decide(job_, FaultSeen(quiet, 111.0)).job.step == RecoveryStep.HEALING, quiet
    # an XID evicts: the node is cordoned and does not go back to the pool
    f = fault("j", "node2", c.FaultKind.XID)
    x = decide(job, FaultSeen(f, f.detected_ts))
    assert x.name == "healing" and x.actions[0] == Cordon("node2", f.summary) and x.job.spares == ()
    # no warm spare, a relaunch policy, or a NaN loss: today's relaunch, which says why it was not in the job
    r = decide(dataclasses.replace(job, warm=()), RanksExited(0, {1: -9}, ts=110.0))
    assert r.name == "relaunching" and r.detail["not_in_job"] == "no warm spare is ready"
    r = decide(_running(heal="relaunch"), RanksExited(0, {1: -9}, ts=110.0))
    assert r.name == "relaunching" and r.detail["not_in_job"] == "the job's heal policy is relaunch"
    r = decide(job, RanksExited(0, {1: -9, 2: -9}, ts=110.0))
    assert r.name == "relaunching" and r.detail["not_in_job"] == "2 ranks exited"
    r = decide(dataclasses.replace(job, stepped_generation=-1), RanksExited(0, {1: -9}, ts=110.0))
    assert r.name == "relaunching" and r.detail["not_in_job"] == "the job is not training"
    # ... unless a survivor's word says it trained: its collective failed at step 4, so steps 1-3 were done
    # (the agents' first step report may come seconds after a launch)
    fresh = dataclasses.replace(job, stepped_generation=-1)
    assert decide(fresh, CollectiveFailed(0, 1, 105.0)).job == fresh          # failed in its first step
    assert decide(fresh, CollectiveFailed(1, 4, 105.0)).job == fresh          # another generation's word
    w = decide(fresh, CollectiveFailed(0, 4, 105.0))
    assert w.name == "first_step" and w.job.stepped_generation == 0 and w.job.last_step == 3
    assert decide(w.job, RanksExited(0, {1: -9}, ts=110.0)).name == "healing"
    nan = fault("j", "node2", c.FaultKind.NAN_LOSS)
    r = decide(job, FaultSeen(nan, nan.detected_ts))
    assert r.name == "relaunching" and r.detail["not_in_job"] == "nan_loss is not healed in the job"


def test_a_straggler_found_during_a_heal_is_decided_once_the_heal_ends():
    from transom.controller.state import (ElasticSynced, FaultSeen, Heal, HealStarted, JobState, RanksExited,
                                          Reconsider, RecoveryStep, SpareReady, decide)
    d = decide(_running(), RanksExited(0, {1: -9}, ts=110.0))
    d = decide(d.job, HealStarted(0, 1, "127.0.0.1:5", 110.1))
    slow = dataclasses.replace(fault("j", "node2", c.FaultKind.STRAGGLER), detected_ts=111.0)
    held = decide(d.job, FaultSeen(slow, 111.0))
    assert held.name == "fault_observed" and held.detail["deferred"] == "until in-job heal epoch 1 ends"
    assert held.job.step == RecoveryStep.HEALING and held.actions == ()
    assert decide(held.job, FaultSeen(slow, 111.5)).job == held.job            # redelivered: held once
    warm = decide(held.job, SpareReady(0, "node1")).job                         # the pool's spare is warm again
    healed = decide(warm, ElasticSynced(0, 1, 6, 112.0))
    assert healed.name == "healed" and healed.job.state == JobState.RUNNING
    assert healed.actions == (Reconsider(slow),)
    again = decide(healed.job, FaultSeen(slow, 112.1, deferred=True))
    assert again.name == "healing" and again.cause["kind"] == "straggler" and again.job.deferred == ()
    assert again.actions[-1] == Heal(0, 2, 2, "node1", ("node0", "node4", "node1", "node3"))
    assert decide(again.job, FaultSeen(slow, 112.2, deferred=True)).job == again.job    # decided once
    # without a free spare it is kept and observed, as any straggler is
    kept = decide(dataclasses.replace(healed.job, spares=(), warm=()), FaultSeen(slow, 112.1, deferred=True))
    assert kept.name == "fault_observed" and kept.detail["kept"] == "no spare node"
    # one that ended before the heal did is forgotten
    over = decide(held.job, FaultSeen(dataclasses.replace(slow, resolved=True), 111.8))
    assert over.job.deferred == () and decide(over.job, ElasticSynced(0, 1, 6, 112.0)).actions == ()


def test_report_lists_each_recovery_with_its_path_and_cost():
    from transom.report import RunData, recoveries

    def ev(seq, name, ts, **detail):
        return c.LifecycleEvent(job="j", seq=seq, ts=ts, name=name, state="x", detail=detail)

    data = RunData("j")
    data.lifecycle = [ev(0, "healing", 10.0, reason="rank 1 exited", spare="node4"), ev(1, "healed", 11.5),
                      ev(2, "healing", 20.0, reason="hang", spare="node1"),
                      ev(3, "relaunching", 30.0, reason="no step", fallback="epoch 2"), ev(4, "resumed", 36.0),
                      ev(5, "relaunching", 50.0, reason="nan", replacement=None), ev(6, "resumed", 55.0),
                      ev(7, "relaunching", 70.0, reason="xid"), ev(8, "resumed", 90.0, seen="exit", step=None)]
    got = [(r["path"], r["seconds"]) for r in recoveries(data)]
    # a relaunch that ran to its end unseen has no cost to tell (its exit is not its first step)
    assert got == [("in-job", 1.5), ("in-job -> relaunch", 16.0), ("relaunch", 5.0), ("relaunch", None)]
    assert "before a step of it was reported" in recoveries(data)[-1]["reason"]
    from transom.report import render
    page = render(data)
    assert "<h2>Recoveries</h2>" in page and "in-job -&gt; relaunch" in page and "healed in job" in page


def test_only_a_failed_collective_is_healed_an_error_of_the_step_itself_is_raised():
    from transom.elastic import collective_failure
    assert collective_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert collective_failure(RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
    assert not collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))


def test_a_rank_whose_rank_was_given_to_a_spare_leaves_instead_of_joining_twice():
    import queue

    from transom.elastic import ElasticGroup, ReformFailed

    group = object.__new__(ElasticGroup)            # the waiting logic alone: no broker, no process group
    group.job, group.node, group.generation, group.epoch, group.rank = "j", "node2", 0, 0, 2
    group._events = queue.Queue()
    reform = {"name": "reforming", "detail": {"generation": 0, "epoch": 1, "master": "198.18.0.3:5", "world": 4}}
    group._events.put({**reform, "detail": {**reform["detail"], "assign": {"node4": 1}}})
    assert group._wait_group(5)["assign"] == {"node4": 1}              # another rank healed: this one joins
    group._events.put({**reform, "detail": {**reform["detail"], "epoch": 2, "assign": {"node5": 2}}})
    with pytest.raises(ReformFailed, match="given to the spare on node5"):
        group._wait_group(5)                                            # its own rank healed: a stale process


def test_a_rank_connects_to_the_new_groups_store_only_once_rank_0_listens():
    """A rank that reaches the rendezvous before rank 0 has started its store waits for the store to listen
    (else torch's client backs off ~0.5 s and the whole group waits for it); nothing listening: it gives up
    at the timeout without raising, and the rendezvous reports its own error."""
    import socket
    import threading

    from transom.elastic import _await_listener

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    listening, accepted = threading.Event(), []

    def rank0() -> None:
        time.sleep(0.3)                                   # rank 0 arrives late
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen()
        listening.set()
        srv.settimeout(10)
        conn, _ = srv.accept()
        accepted.append(conn)
        srv.close()

    t = threading.Thread(target=rank0)
    t.start()
    _await_listener(f"127.0.0.1:{port}", 30)
    assert listening.is_set(), "returned before rank 0's store listened"
    t.join(10)
    assert accepted, "the store never saw the waiting rank connect"
    accepted[0].close()
    _await_listener(f"127.0.0.1:{port}", 0.2)            # no store at all: returns at the timeout
    _await_listener("no-port-here", 30)                   # not HOST:PORT: nothing to wait for


SPARE = """
import sys
from transom.elastic import ElasticGroup, SpareReleased
group = ElasticGroup(sys.argv[1], "node9", 0, sys.argv[2], spare=True)
try:
    group.join()
except SpareReleased as exc:
    print("released:", exc, flush=True)
    sys.exit(0)
sys.exit(2)
"""


def test_a_spare_started_as_its_job_ended_is_released_and_one_of_a_running_job_waits(fresh_broker):
    """A warm spare reads the job's news from the moment it starts; one started just after its job completed
    (a refill racing the job's last step) learns it from the job's snapshot instead of waiting forever."""
    import subprocess
    import sys

    from transom.kafka import make_producer, publish

    from transom.controller.state import Job, JobSpec, JobState

    bs, producer = fresh_broker.bootstrap, make_producer(fresh_broker.bootstrap)

    def news(job: str, name: str, state: str) -> None:
        snap = Job(job=job, spec=JobSpec(("python", "train.py"), 4), state=JobState(state), launched_generation=0)
        ev = c.LifecycleEvent(job=job, seq=len(sent), ts=time.time(), name=name, state=state,
                              snapshot=snap.to_dict())
        sent.append(ev)
        publish(producer, c.LIFECYCLE, job, ev)
        publish(producer, c.HISTORY, job, ev)
        assert producer.flush(10) == 0

    sent: list = []
    news("ended", "launched", "running")
    news("ended", "completed", "completed")
    news("running", "launched", "running")
    spares = {job: subprocess.Popen([sys.executable, "-c", SPARE, job, bs], stdout=subprocess.PIPE, text=True)
              for job in ("ended", "running")}
    try:
        assert spares["ended"].wait(60) == 0
        assert "job ended completed" in spares["ended"].stdout.read()
        time.sleep(2)
        assert spares["running"].poll() is None, "the spare of a running job left"
        news("running", "cancelled", "cancelled")                 # its news, while it waits, releases it too
        assert spares["running"].wait(60) == 0
    finally:
        for p in spares.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
