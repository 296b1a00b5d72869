"""End to end on the test bed: `transom run` submits a 4-rank job with a spare; the controller (on the
control host) finds the node hosts' launchers in the service registry and places one rank on each of
four node hosts; a whole node host is killed mid-training (its processes, memory and /dev/shm gone)
and the job resumes on the spare from the newest checkpoint, the lost host's shard restored from a
neighbour's memory over the bed's network. Skips where namespaces cannot be made."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from transom import contracts

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

CKPT_EVERY = 10


@pytest.fixture()
def stack(tmp_path):
    from transom import testbed
    from transom.stack import LocalStack

    ok, reason = testbed.available()
    if not ok:
        pytest.skip(f"test bed unavailable: {reason}")
    s = LocalStack(tmp_path / "run", nodes=5, hosts=True)
    index = s.bed.index
    try:
        yield s
    finally:
        s.stop()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"tb{index}-" not in left, f"namespaces of bed {index} left behind:\n{left}"


def test_a_killed_node_host_is_replaced_by_the_spare_and_the_job_resumes_from_the_newest_checkpoint(stack):
    from transom.stack import Monitor, train_command

    bootstrap = stack.start_broker()
    monitor = Monitor(bootstrap, (contracts.LIFECYCLE, contracts.CHECKPOINTS))
    try:
        stack.start_agents()
        # the pre-check's all-reduce through launchers has its own test (test_launcher.py); here the
        # node's health (agent heartbeat, launcher answering) decides, and the training's gloo crosses hosts
        ctl = stack.start_controller(extra=["--exit-when-done", "--unreachable", "4", "--precheck", "health"])
        submit = subprocess.run([sys.executable, "-m", "transom.cli", "run", "--bootstrap", bootstrap, "--nodes", "4",
                                 "--spares", "1", "--job-id", "hosts-e2e", "--", *train_command(70, CKPT_EVERY)],
                                capture_output=True, text=True, timeout=60)
        assert submit.returncode == 0, submit.stderr
        events: list = []
        killed_at = None
        deadline = time.monotonic() + 360
        while time.monotonic() < deadline and ctl.popen.poll() is None:
            got = monitor.poll(0.5)
            if got is None:
                continue
            topic, ev = got
            if topic != contracts.LIFECYCLE or ev.job != "hosts-e2e":
                continue
            events.append(ev)
            if killed_at is None and ev.name == "checkpoint" and ev.detail["step"] >= 2 * CKPT_EVERY:
                stack.kill_host("node1")           # a node lost for real, right after a checkpoint
                killed_at = ev.detail["step"]
        assert ctl.popen.wait(60) == 0, (stack.run_dir / "logs" / "controller.log").read_text()[-4000:]
    finally:
        monitor.close()
    assert killed_at is not None, [e.name for e in events]
    names = [e.name for e in events]
    print(" ".join(f"{e.name}{'/' + str(e.detail.get('step', '')) if e.name == 'checkpoint' else ''}" for e in events))
    assert names[-1] == "completed", names
    first = next(e for e in events if e.name == "launched")
    assert first.detail["nodes"] == ["node0", "node1", "node2", "node3"]             # the registry's launchers
    assert set(first.detail["hosts"].values()) == {stack.launchers[n] for n in first.detail["nodes"]}
    relaunch = next(e for e in events if e.name == "launched" and e.detail["generation"] >= 1)
    assert "node1" not in relaunch.detail["nodes"] and "node4" in relaunch.detail["nodes"]
    assert relaunch.detail["master"].startswith("198.18.")            # rank 0's host on the bed, not loopback
    resumed = next(e for e in events if e.name == "resumed")
    assert resumed.detail["resume_step"] >= killed_at                  # the newest checkpoint, not an older one
    assert 0 <= resumed.detail["steps_lost"] <= CKPT_EVERY
    # the spare's rank restored node1's shard from a neighbour's memory (node1's memory is gone), over the
    # bed's network, and the job finished on the bed's hosts
    rank = relaunch.detail["nodes"].index("node4")
    gen = relaunch.detail["generation"]
    log = (stack.run_dir / "hosts" / "node4" / "hosts-e2e" / f"gen-{gen}" / f"rank-{rank}.log").read_text()
    restored = re.search(r"restored step (\d+) from (\S+) on (\S+)", log)
    assert restored and int(restored.group(1)) == resumed.detail["resume_step"], log[-2000:]
    print(f"\nrank {rank} on node4 restored step {restored.group(1)} from {restored.group(2)} on {restored.group(3)}")
    assert restored.group(2) == "peer-memory" and restored.group(3) != "node1"   # a neighbour's memory, over the bed
    host0 = relaunch.detail["nodes"][0]
    assert "done: 70 steps" in (stack.run_dir / "hosts" / host0 / "hosts-e2e" / f"gen-{gen}" / "rank-0.log").read_text()
