"""End to end on the test bed: `transom run` submits a 4-rank job with two spares; the controller (on the
control host) finds the node hosts' launchers in the service registry and places one rank on each of
four node hosts. Two faults in one job:

1. a whole node host is killed mid-training (its processes, memory and /dev/shm gone): the job resumes
   on a spare from the newest checkpoint, the lost host's shard restored from a neighbour's memory
   over the bed's network;
2. another node host is partitioned for 30 s: its launcher stops answering (the node is lost: its
   ranks count as killed), the controller stops the generation, evicts (cordons) the host and
   relaunches on the remaining spare. When the link returns, the old host's ranks are stopped by
   its launcher, and a late checkpoint write stamped with the old generation through the old host's
   own daemon (a stand-in for the old rank, which is stuck in its all-reduce and never gets to write
   on its own) is refused as a stale generation; the new generation's checkpoints go on and the job
   completes.

From the first checkpoint until the partition's checks are done, the ranks are held to a slow pace
through train_lm's ``--slowdown-dir`` pause file (a condition the test lifts, not a timing guess):
each fault lands within a few steps of the checkpoint the test saw, and the job is still running
when the link returns. Skips where namespaces cannot be made.

The controller runs with ``--heal relaunch``: this is the relaunch path on the bed (also the in-job
path's fallback) and its generation fencing; the in-job path on the bed (a warm spare on a spare host
takes the failed rank, no relaunch) is tests/test_hosts_heal.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest

from transom import contracts
from util import bed_stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

CKPT_EVERY = 10
STEPS = 150
PARTITION_S = 30.0
JOB = "hosts-e2e"

# the old generation's late write, run on the old host with the old rank's own environment
_STALE_WRITE = """
import sys
from checkpoint.engine import CheckpointEngine
from checkpoint.errors import CheckpointError
engine = CheckpointEngine.from_env(stop_grace=None)
try:
    engine.save(int(sys.argv[1]), {"stale": True})
    engine.close()
except CheckpointError as exc:
    print("REFUSED", exc, flush=True)
    sys.exit(3)
print("ACCEPTED", flush=True)
"""


@pytest.fixture()
def stack(tmp_path):
    with bed_stack(tmp_path / "run", nodes=6) as s:
        yield s


class _Pace:
    """Holds every rank to about one step per ``every`` seconds once started: train_lm's ``--slowdown-dir``
    pause file ``T S`` (T far ahead) lets the ranks run the steps before S only, and S moves on by one
    step each ``every`` seconds (a rank waiting in the hook reads the file again), never more than
    ``ahead`` steps past the newest checkpoint seen (a relaunched job does not race to catch up)."""

    def __init__(self, directory, every: float = 0.4, ahead: int = CKPT_EVERY + 2) -> None:
        self.file, self.every, self.ahead = directory / "pause", every, ahead
        self.cap = 0
        self.released = False
        directory.mkdir(parents=True, exist_ok=True)
        self.on, self.done = threading.Event(), threading.Event()
        self.next = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def start(self, step: int) -> None:
        """Called with each checkpoint's step: starts the pace at the first, and moves the cap."""
        self.cap = max(self.cap, step + self.ahead)
        if not self.on.is_set():
            self.next = step + 1
            self.on.set()

    def _run(self) -> None:
        while not self.done.is_set():
            with self.lock:
                if self.on.is_set():
                    tmp = self.file.with_suffix(".tmp")
                    tmp.write_text(f"{time.time() + 3600:.3f} {self.next}\n")
                    tmp.replace(self.file)
                    self.next = min(self.next + 1, self.cap)
            self.done.wait(self.every)

    def release(self) -> None:
        with self.lock:
            self.released = True
            self.on.clear()
            self.file.unlink(missing_ok=True)

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.release()


def _old_ranks_running(stack, node: str, generation: int) -> list:
    """The ranks of ``generation`` that ``node``'s launcher still runs ([] when it runs none)."""
    from transom.channel import call, cluster_key

    got = call(stack.launchers[node], cluster_key({"TRANSOM_CLUSTER_KEY": stack.cluster_key}), "health",
               {"want": [[JOB, generation]]}, timeout=5.0)
    return [r for r, running, _code in got["statuses"].get(f"{JOB}/{generation}", []) if running]


def test_a_killed_host_and_a_partitioned_host_are_replaced_by_spares_and_the_old_generation_cannot_write(stack):
    from checkpoint import layout
    from transom.stack import Monitor, train_command
    from transom.testbed import python_env

    bootstrap = stack.start_broker()
    monitor = Monitor(bootstrap, (contracts.LIFECYCLE, contracts.CHECKPOINTS))
    pace = _Pace(stack.run_dir / "slow")
    ckpt_dir = stack.run_dir / "jobs" / JOB / "ckpt"
    try:
        stack.start_agents()
        # the pre-check's all-reduce through launchers has its own test (test_launcher.py); here the
        # node's health (agent heartbeat, launcher answering) decides, and the training's gloo crosses hosts
        ctl = stack.start_controller(extra=["--exit-when-done", "--unreachable", "4", "--precheck", "health"])
        submit = subprocess.run([sys.executable, "-m", "transom.cli", "run", "--bootstrap", bootstrap, "--nodes", "4",
                                 "--spares", "2", "--job-id", JOB, "--heal", "relaunch", "--",
                                 *train_command(STEPS, CKPT_EVERY, "--slowdown-dir", str(stack.run_dir / "slow"))],
                                capture_output=True, text=True, timeout=60)
        assert submit.returncode == 0, submit.stderr
        events: list = []
        killed_at = cut_at = cut_node = cut_gen = None
        cut_t = healed_t = None
        stale = None
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline and ctl.popen.poll() is None:
            if cut_t is not None and healed_t is None and time.monotonic() - cut_t >= PARTITION_S:
                stack.heal(cut_node)                               # the link returns after 30 s
                healed_t = time.monotonic()
                healed_index = len(events)
            got = monitor.poll(0.5)
            if got is None:
                continue
            topic, ev = got
            if topic != contracts.LIFECYCLE or ev.job != JOB:
                continue
            events.append(ev)
            if ev.name == "checkpoint" and stale is None and not pace.released:
                pace.start(ev.detail["step"])   # from the first checkpoint on, each fault lands within a few steps
            if killed_at is None and ev.name == "checkpoint" and ev.detail["step"] >= 2 * CKPT_EVERY:
                stack.kill_host("node1")           # a node lost for real, right after a checkpoint
                killed_at = ev.detail["step"]
            elif (killed_at is not None and cut_at is None and ev.name == "checkpoint"
                  and any(e.name == "resumed" for e in events)):
                gen1 = next(e for e in reversed(events) if e.name == "launched")
                cut_node, cut_gen = "node2", gen1.detail["generation"]
                assert cut_node in gen1.detail["nodes"], gen1.detail
                stack.partition(cut_node)          # right after a checkpoint of the resumed generation
                cut_at, cut_t, cut_index = ev.detail["step"], time.monotonic(), len(events)
            elif healed_t is not None and stale is None:
                stale = _after_heal(stack, cut_node, cut_gen, ckpt_dir, python_env)
                pace.release()                     # the new generation runs to the end at full speed
        assert ctl.popen.wait(60) == 0, (stack.run_dir / "logs" / "controller.log").read_text()[-4000:]
        drain = time.monotonic() + 30                  # the controller's last events, read after it exited
        while time.monotonic() < drain and not (events and events[-1].name == "completed"):
            got = monitor.poll(0.5)
            if got is not None and got[0] == contracts.LIFECYCLE and got[1].job == JOB:
                events.append(got[1])
    finally:
        pace.close()
        monitor.close()
    assert killed_at is not None and cut_at is not None and stale is not None, [e.name for e in events]
    names = [e.name for e in events]
    print(" ".join(f"{e.name}{'/' + str(e.detail.get('step', '')) if e.name == 'checkpoint' else ''}" for e in events))
    assert names[-1] == "completed", names
    first = next(e for e in events if e.name == "launched")
    assert first.detail["nodes"] == ["node0", "node1", "node2", "node3"]             # the registry's launchers
    assert set(first.detail["hosts"].values()) == {stack.launchers[n] for n in first.detail["nodes"]}
    launches = [e for e in events if e.name == "launched"]
    relaunch = next(e for e in launches if e.detail["generation"] >= 1)
    assert "node1" not in relaunch.detail["nodes"] and "node4" in relaunch.detail["nodes"]
    assert relaunch.detail["master"].startswith("198.18.")            # rank 0's host on the bed, not loopback
    resumes = [e for e in events if e.name == "resumed"]
    resumed = resumes[0]
    assert resumed.detail["resume_step"] >= killed_at                  # the newest checkpoint, not an older one
    assert 0 <= resumed.detail["steps_lost"] <= CKPT_EVERY
    # the spare's rank restored node1's shard from a neighbour's memory (node1's memory is gone), over the
    # bed's network, and the job finished on the bed's hosts
    rank = relaunch.detail["nodes"].index("node4")
    gen = relaunch.detail["generation"]
    log = (stack.run_dir / "hosts" / "node4" / JOB / f"gen-{gen}" / f"rank-{rank}.log").read_text()
    restored = re.search(r"restored step (\d+) from (\S+) on (\S+)", log)
    assert restored and int(restored.group(1)) == resumed.detail["resume_step"], log[-2000:]
    print(f"\nrank {rank} on node4 restored step {restored.group(1)} from {restored.group(2)} on {restored.group(3)}")
    assert restored.group(2) == "peer-memory" and restored.group(3) != "node1"   # a neighbour's memory, over the bed

    # --- the partition: the node is lost (its launcher silent: its ranks count as killed), the generation
    # is stopped, the host evicted (cordoned) and the job relaunched on the remaining spare
    ctl_log = (stack.run_dir / "logs" / "controller.log").read_text()
    assert re.search(rf"generation {cut_gen}: the launcher of {cut_node} has not answered .* \(node lost\)", ctl_log)
    lost = next(e for e in events[cut_index:] if e.name == "relaunching")
    assert f"on {cut_node} exited with code -9" in lost.detail.get("reason", ""), lost.detail
    cordoned = json.loads((stack.run_dir / "jobs" / "cordoned.json").read_text())
    assert cut_node in cordoned and "node1" in cordoned, cordoned                      # evicted, both
    final = next(e for e in launches if e.detail["generation"] > cut_gen)
    assert cut_node not in final.detail["nodes"] and "node5" in final.detail["nodes"], final.detail
    assert cut_node not in [n for e in launches[launches.index(final):] for n in e.detail["nodes"]]
    resumed2 = next(e for e in resumes if e.detail["generation"] == final.detail["generation"])
    assert resumed2.detail["resume_step"] >= cut_at and 0 <= resumed2.detail["steps_lost"] <= CKPT_EVERY
    # relaunched while the link was still down, not after it came back
    assert events.index(final) < healed_index, (events.index(final), healed_index, names)

    # --- after the heal: the old ranks were stopped, the old generation's late write was refused, and the
    # new generation's checkpoints went on past it, each step committed by the new generation alone
    step_written, answer = stale
    assert answer.startswith("REFUSED") and "stale generation" in answer, answer
    daemon_log = (stack.run_dir / "logs" / f"ckpt-{cut_node}.log").read_text()
    assert re.search(rf"stale generation: the save of step {step_written} of rank \d+ of job {JOB} is stamped "
                     rf"generation {cut_gen}, but generation {final.detail['generation']}", daemon_log), daemon_log[-3000:]
    after = [e.detail["step"] for e in events[healed_index:] if e.name == "checkpoint"]
    assert after and max(after) > max(cut_at, resumed2.detail["resume_step"]), after
    last = layout.step_dir(ckpt_dir, STEPS)          # the step the old generation tried to write first
    assert layout.read_manifest(last).generation == final.detail["generation"]
    shards = [layout.read_rank_manifest(f) for f in sorted(last.glob("rank-*.json"))]
    assert len(shards) == 4 and {s["generation"] for s in shards} == {final.detail["generation"]}, shards
    host0 = final.detail["nodes"][0]
    gen = final.detail["generation"]
    assert f"done: {STEPS} steps" in (stack.run_dir / "hosts" / host0 / JOB / f"gen-{gen}" / "rank-0.log").read_text()


def _after_heal(stack, node: str, generation: int, ckpt_dir, python_env) -> tuple[int, str]:
    """The link is back: wait for ``node``'s launcher to stop the old generation's ranks, then write a
    checkpoint of the job's last step stamped with that old generation, through ``node``'s own daemon,
    with the old rank's environment; (step, the writer's answer)."""
    from controller.local import rank_env
    from util import wait_until

    wait_until(lambda: _answers(stack, node, generation) == [], 90, f"the old ranks on {node} stopped")
    # and the healed host's services are back in the registry (their heartbeats are delivered again)
    from transom import registry
    from transom.contracts import ServiceKind

    healed = time.time()
    with registry.RegistryReader(stack.bootstrap, cluster=stack.cluster).start() as reader:
        wait_until(lambda: all(node in reader.live(kind) and reader.live(kind)[node].heartbeat_ts > healed
                               for kind in (ServiceKind.LAUNCHER, ServiceKind.CKPT_DAEMON)),
                   60, f"{node}'s launcher and checkpoint daemon heartbeating in the registry again")
    launch = json.loads((stack.run_dir / "jobs" / JOB / f"gen-{generation}" / "launch.json").read_text())
    rank = launch["ranks"][node][0]
    host, port = launch["master"].rsplit(":", 1)
    env = {**python_env(), "TRANSOM_BOOTSTRAP": stack.bootstrap, "TRANSOM_CKPT_RUNTIME": str(stack.ckpt_runtime),
           "TRANSOM_CLUSTER": stack.cluster, "TRANSOM_CLUSTER_KEY": stack.cluster_key,
           **rank_env(JOB, generation, rank, node, len(launch["nodes"]), host, int(port), str(ckpt_dir),
                      launch.get("resume_step"), stack.bootstrap)}
    proc = stack.bed.python(node, ["-c", _STALE_WRITE, str(STEPS)], env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=120)
    text = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
    answer = next((line for line in text.splitlines() if line.startswith(("REFUSED", "ACCEPTED"))), text[-2000:])
    return STEPS, answer


def _answers(stack, node: str, generation: int):
    try:
        return _old_ranks_running(stack, node, generation)
    except Exception:                  # noqa: BLE001 - the launcher may not answer yet right after the heal
        return None
