"""In-job recovery on the test bed (issue 17): a 2-rank job of ``transom.examples.train_lm`` on node0 and
node1, each rank started by its host's launcher, a warm spare waiting on node2 (started by node2's
launcher). Rank 1's process is SIGKILLed inside node1: the survivor keeps its process and its state, the
spare on node2 takes rank 1 over the bed's network (the new group's rendezvous on rank 0's host address,
not loopback), its parameters equal the survivor's, and the job completes without a relaunch.

The job is held at a step with the example's pause hook (as in test_heal), so the kill lands while the
job trains whatever the machine's load. Skips where namespaces cannot be made."""

from __future__ import annotations

import time

import pytest

from test_controller import finish, lifecycle
from test_heal import TINY, at_step, hold_from, names, release, sync_hashes
from util import bed_stack, until_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
JOB = "hosts-heal"
STEPS = 16


@pytest.fixture()
def stack(tmp_path):
    with bed_stack(tmp_path / "run", nodes=3) as s:
        yield s


def _pid(path) -> int:
    return int(path.read_text().split()[0])


def test_a_killed_rank_on_a_host_is_healed_by_the_warm_spare_on_a_spare_host(stack):
    from transom.stack import train_command

    bs = stack.start_broker()
    stack.start_agents()
    hold = stack.run_dir / "hold"
    hold.mkdir()
    (hold / "pause").write_text(f"{time.time() + 3600} 6\n")      # every rank stops after step 6
    # the default checkpoint cadence (auto), agreed by the ranks every step across the hosts, the spare among them
    proc = stack.start_controller(JOB, train_command(STEPS, "auto", "--slowdown-dir", str(hold), *TINY), world_size=2,
                                  extra=["--exit-when-done", "--precheck", "health", "--heal-timeout", "60"]).popen
    hosts = stack.run_dir / "hosts"
    gen0, gen1 = hosts / "node0" / JOB / "gen-0", hosts / "node1" / JOB / "gen-0"
    try:
        until_alive(proc, lambda: at_step(gen0, 5) and "spare_ready" in names(bs, JOB), 150,
                    "step 5 and a warm spare on node2")
        survivor = _pid(gen0 / "rank-0.pid")
        victim = _pid(gen1 / "rank-1.pid")                      # its PID inside node1
        stack.bed.sh("node1", f"kill -KILL {victim}", check=True, timeout=30)
        hold_from(hold, 12)
        until_alive(proc, lambda: "healed" in names(bs, JOB), 90, "the in-job heal on node2")
        release(hold)
        assert finish(proc, 120) == 0
    finally:
        release(hold)
        if proc.poll() is None:
            proc.kill()
    events = [e for e in lifecycle(bs, JOB) if e.state != "request"]
    seen = [e.name for e in events]
    assert "relaunching" not in seen and "healed" in seen, seen
    (heal,) = [e for e in events if e.name == "healing"]
    assert (heal.detail["rank"], heal.detail["failed_node"], heal.detail["spare"]) == (1, "node1", "node2")
    (reform,) = [e for e in events if e.name == "reforming"]
    assert reform.detail["master"].startswith(stack.bed.addr("node0") + ":"), reform.detail   # rank 0's host
    # the survivor is the same process and finished the job; no generation but the first
    assert _pid(gen0 / "rank-0.pid") == survivor and (gen0 / "rank-0.exit").read_text().strip() == "0"
    assert "restored step" not in (gen0 / "rank-0.log").read_text()
    assert f"done: {STEPS} steps, last checkpoint step {STEPS}" in (gen0 / "rank-0.log").read_text()
    assert not list((hosts / "node0" / JOB).glob("gen-1"))
    # the spare on node2 took rank 1 with the survivor's parameters, bit for bit
    (spare_log,) = sorted((hosts / "node2" / JOB / "gen-0").glob("spare-*/rank-0.log"))
    assert "took rank 1" in spare_log.read_text()
    hashes = sync_hashes([gen0 / "rank-0.log", spare_log], 1)
    assert sorted(hashes) == [0, 1] and len(set(hashes.values())) == 1, hashes
