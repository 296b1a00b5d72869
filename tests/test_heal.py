"""In-job recovery with real ranks (issue 17): real broker, real agents, real 4-rank gloo jobs of
``transom.examples.train_lm`` under ``transom controller``, a warm spare on the fifth node.

The jobs are held at a step with the example's pause hook (``--slowdown-dir D``, ``D/pause`` =
``T STEP``), so a fault always lands while the job trains, whatever the machine's load: the test
signals a rank while the others sleep in the hook, then releases them into the collective that fails.
"""

from __future__ import annotations

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


def start(stack: LocalStack, job: str, steps: int, hold: Path) -> tuple:
    hold.mkdir(parents=True, exist_ok=True)
    (hold / "pause").write_text(f"{time.time() + 3600} 6\n")   # every rank stops after step 6 (saved step 5)
    run_dir = stack.run_dir / "runs" / job
    proc = stack.start_controller(job, train_command(steps, 5, "--slowdown-dir", str(hold), *TINY), world_size=4,
                                  name=job, extra=["--exit-when-done", "--run-dir", str(run_dir), "--precheck",
                                                   "health", "--heal-timeout", "40"])
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
    out = {}
    for log in logs:
        for m in re.finditer(r"elastic: rank (\d+) epoch (\d+) step \d+ params sha256 ([0-9a-f]+)", log.read_text()):
            if int(m.group(2)) == epoch:
                out[int(m.group(1))] = m.group(3)
    return out


def test_crash_and_hang_are_healed_in_the_job_survivors_keep_their_processes(broker, stack):
    job, bs = "heal-a", broker.bootstrap
    hold = stack.run_dir / "hold-a"
    proc, jobdir = start(stack, job, 30, hold)
    gen = jobdir / "gen-0"
    try:
        until_alive(proc, lambda: at_step(gen, 5) and "spare_ready" in names(bs, job), 60,
                    "step 5 and a warm spare on node4")
        before = pids(gen)
        os.kill(before[1], signal.SIGKILL)                      # (a) a crash of rank 1, while the others wait
        hold_from(hold, 12)
        until_alive(proc, lambda: "healed" in names(bs, job), 60, "the in-job heal of the crash")
        # the crashed node went back to the pool: a new warm spare there; then (d) a hang of rank 2
        until_alive(proc, lambda: names(bs, job).count("spare_ready") >= 2 and at_step(gen, 10), 60,
                    "a new warm spare on node1")
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
    # (b) each spare's parameters equal the survivors' bit for bit after it joined
    logs = [gen / f"rank-{r}.log" for r in range(4)] + sorted(gen.glob("spare-*/rank-0.log"))
    for epoch in (1, 2):
        hashes = sync_hashes(logs, epoch)
        assert sorted(hashes) == [0, 1, 2, 3] and len(set(hashes.values())) == 1, (epoch, hashes)
    spare_log = (gen / "spare-node4-0" / "rank-0.log").read_text()
    assert "took rank 1" in spare_log and "data position of step 6 from checkpoint step 5 + 1 batches" in spare_log


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
