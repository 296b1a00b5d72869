"""Chaos for the checkpoint engine (TCE): a node's daemon killed, a disk that fills up.

Real ``transom ckpt-server`` processes, real shared memory and files (see tests/test_checkpoint.py
for the :class:`Cluster` these build on); the disk that fills up is a real, small tmpfs mounted
for the test, so the write fails with the kernel's ENOSPC.
"""

from __future__ import annotations

import errno
import signal
import subprocess
import uuid

import pytest
import torch

from transom import contracts
from transom.checkpoint import complete_steps, step_dir
from transom.checkpoint.layout import read_manifest

from test_checkpoint import Cluster, assert_same
from util import topic_values, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.integration]


@pytest.fixture()
def cluster_of(tmp_path):
    made: list[Cluster] = []

    def make(nodes, **kw) -> Cluster:
        made.append(Cluster(tmp_path, nodes, transport="tcp", **kw))
        return made[-1]
    yield make
    for c in made:
        c.close()


def test_daemon_killed_its_shards_are_recovered_from_the_neighbour(tmp_path, cluster_of):
    """kill -9 node0's ckpt-server. Its segments are files on /dev/shm and outlive the process, but
    nobody serves them and the restarted daemon sweeps them: node0's memory tier is gone. A rank on
    node0 then loads its shard from the neighbour's (node1's) memory, bit for bit, and saves again."""
    c = cluster_of(["node0", "node1", "node2"])
    job, ckpt = f"job-{uuid.uuid4().hex[:8]}", tmp_path / "ckpt"
    torch.manual_seed(1)
    states = [{"w": torch.randn(512, 1024), "b": torch.randn(7, dtype=torch.float64), "rank": r} for r in range(2)]
    ranks = [c.engine(ckpt, job, r, 2, f"node{r}") for r in range(2)]
    for step in (5, 10):
        for e in ranks:
            assert e.save(step, states[e.rank] | {"step": step})
        for e in ranks:
            e.wait()
    for e in ranks:
        e.close()
    seg_dir = c.runtime / "node0"
    own = [f for f in seg_dir.iterdir() if f.name.startswith(f"own-{job}-r0-")]
    assert own, "node0's daemon held rank 0's shards in shared memory"

    c.signal("node0", signal.SIGKILL)                        # the daemon dies, the node lives
    assert all(f.exists() for f in own), "tmpfs segments outlive the daemon process"
    c.restart("node0")                                       # its supervisor starts it again
    assert not any(f.exists() for f in own), "the new daemon sweeps the dead one's segments"
    assert "left by a daemon that is gone" in c.log("node0")

    again = c.engine(ckpt, job, 0, 2, "node0", generation=1)  # rank 0 relaunched on node0
    step, state = again.load()
    assert (step, again.last_restore["tier_name"], again.last_restore["node"]) == (10, "peer-memory", "node1")
    assert_same(states[0] | {"step": 10}, state)
    # the next checkpoint goes through the restarted daemon and is replicated again
    peer = c.engine(ckpt, job, 1, 2, "node1", generation=1)
    for e in (again, peer):
        assert e.save(15, states[e.rank] | {"step": 15})
    for e in (again, peer):
        e.wait()
    man = read_manifest(step_dir(ckpt, 15))
    assert man.replicated and man.persisted
    assert {cp.node for cp in man.copies if cp.rank == 0 and cp.tier == contracts.Tier.MEMORY} == {"node0", "node1"}


@pytest.fixture()
def small_disk(tmp_path):
    """A 16 MiB tmpfs: writing more than fits fails with ENOSPC."""
    where = tmp_path / "small-disk"
    where.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN): {got.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_disk_full_while_persisting_memory_copies_stay_and_training_goes_on(tmp_path, cluster_of, small_disk,
                                                                            broker):
    c = cluster_of(["node0", "node1"], disk_dirs={"node0": small_disk})
    job, ckpt = f"job-{uuid.uuid4().hex[:8]}", tmp_path / "ckpt"
    filler = small_disk / "filler"
    with open(filler, "wb") as f:                            # leave about 2 MiB free
        f.write(b"\0" * (14 << 20))
    torch.manual_seed(2)
    model = torch.nn.Linear(1024, 1024)                      # 4 MiB of weights: does not fit
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng = c.engine(ckpt, job, 0, 1, "node0", shared=False, keep=10, bootstrap=broker.bootstrap)
    for step in range(1, 5):                                 # a training loop that checkpoints every step
        opt.zero_grad()
        model(torch.randn(8, 1024)).pow(2).mean().backward()
        opt.step()
        if step == 3:
            filler.unlink()                                  # space comes back: persisting resumes
        assert eng.save(step, {"model": model.state_dict()})
        eng.wait()                                           # never raises for a failed disk copy
        got_step, state = eng.load(step)                     # memory copies stay valid
        assert (got_step, eng.last_restore["tier_name"]) == (step, "local-memory")
        for k, v in model.state_dict().items():
            assert torch.equal(state["model"][k], v), k
    assert complete_steps(ckpt) == [1, 2, 3, 4]
    assert eng.unpersisted == [1, 2]
    flags = {s: (m.persisted, m.replicated) for s in (1, 2, 3, 4) for m in [read_manifest(step_dir(ckpt, s))]}
    assert flags == {1: (False, True), 2: (False, True), 3: (True, True), 4: (True, True)}

    log = c.log("node0")
    errors = [line for line in log.splitlines() if "could not persist step 1 " in line]
    assert len(errors) == 1, log[-3000:]
    assert "ERROR" in errors[0] and str(small_disk) in errors[0] and f"[Errno {errno.ENOSPC} ENOSPC]" in errors[0]
    assert not list(small_disk.rglob(".*.tmp-*")), "the partial file is removed"
    def ready_events():
        got = [e for e in topic_values(broker.bootstrap, contracts.CHECKPOINTS) if e.job == job]
        return got if len({e.step for e in got}) == 4 else None
    events = wait_until(ready_events, 30, f"checkpoint-ready of steps 1-4 of {job}")
    assert {e.step: e.persisted for e in events} == {1: False, 2: False, 3: True, 4: True}
