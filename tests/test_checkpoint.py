"""The checkpoint engine with real TCE daemons (``transom ckpt-server`` processes), real shared
memory, real files and real torch; the announce against the real broker.

Several "nodes" are several daemons on 127.0.0.1 sharing one runtime directory; several ranks of
one job are several engines in this process sharing a checkpoint directory.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from transom import contracts
from transom.broker import free_port
from transom.checkpoint import (
    CheckpointEngine, CheckpointError, CorruptCheckpoint, NoCheckpoint, complete_steps, list_steps, step_dir,
)
from transom.checkpoint import cadence, planner, segments
from transom.checkpoint.layout import read_manifest
from transom.checkpoint.wire import Conn
from transom.cli import main as transom_main
from transom.config import ConfigError

from util import topic_values, wait_until


class Cluster:
    """``transom ckpt-server`` daemons for ``nodes``, one runtime dir on /dev/shm, logs in ``root``;
    local disk copies under ``root/local`` unless ``disk_dirs`` names another dir for a node."""

    def __init__(self, root: Path, nodes: list[str], transport: str = "auto",
                 disk_dirs: dict[str, Path] | None = None) -> None:
        self.root = root
        self.runtime = Path("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp") / f"transom-test-{uuid.uuid4().hex[:8]}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.engines: list[CheckpointEngine] = []
        self.env = {**os.environ, "TRANSOM_CKPT_RUNTIME": str(self.runtime)}
        self.env.pop("TRANSOM_CKPT_SHM_BYTES", None)
        for node in nodes:
            with open(root / f"daemon-{node}.log", "ab") as log:
                self.procs[node] = subprocess.Popen(
                    [sys.executable, "-m", "transom.cli", "ckpt-server", "--node", node, "--runtime",
                     str(self.runtime), "--disk-dir", str((disk_dirs or {}).get(node, root / "local")),
                     "--transport", transport],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env)
        wait_until(lambda: set(segments.registered(self.runtime)) >= set(nodes) or None, 60,
                   f"daemons of {nodes} registered")

    def engine(self, directory, job: str, rank: int, world: int, node: str, **kw) -> CheckpointEngine:
        eng = CheckpointEngine(directory, job, rank, world, node, runtime=self.runtime, **kw)
        self.engines.append(eng)
        return eng

    def log(self, node: str) -> str:
        return (self.root / f"daemon-{node}.log").read_text(errors="replace")

    def restart(self, node: str) -> None:
        """Start ``node``'s daemon again (as its supervisor would), with the same arguments."""
        old = self.procs[node]
        with open(self.root / f"daemon-{node}.log", "ab") as log:
            self.procs[node] = subprocess.Popen(old.args, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=self.env)
        wait_until(lambda: segments.registered(self.runtime).get(node, {}).get("pid") == self.procs[node].pid
                   or None, 60, f"daemon of {node} registered again")

    def signal(self, node: str, sig: int) -> None:
        self.procs[node].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[node].wait(10)

    def close(self) -> None:
        for eng in self.engines:
            try:
                eng.close()
            except CheckpointError:
                pass
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.runtime, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three nodes' daemons shared by the tests of this module (each test uses its own job)."""
    c = Cluster(tmp_path_factory.mktemp("cluster"), ["node0", "node1", "node2"], transport="tcp")
    yield c
    c.close()


@pytest.fixture()
def own_cluster(tmp_path):
    made: list[Cluster] = []

    def make(nodes, **kw) -> Cluster:
        made.append(Cluster(tmp_path, nodes, **kw))
        return made[-1]
    yield make
    for c in made:
        c.close()


@pytest.fixture()
def engines(cluster):
    """``engines(directory, world, **kw)``: the ranks of one new job, rank r on node r % 3."""
    job = f"job-{uuid.uuid4().hex[:8]}"

    def make(directory, world: int, job: str = job, **kw) -> list[CheckpointEngine]:
        return [cluster.engine(directory, job, r, world, f"node{r % 3}", **kw) for r in range(world)]
    return make


def one(cluster, directory, node: str = "node0", **kw) -> CheckpointEngine:
    return cluster.engine(directory, f"job-{uuid.uuid4().hex[:8]}", 0, 1, node, **kw)


def save_all(engs, step: int, make_state) -> None:
    for e in engs:
        assert e.save(step, make_state(e.rank, step))
    for e in engs:
        e.wait()


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def assert_same(a, b, path="state") -> None:
    """Equal structure, types and values; tensors compared byte for byte (NaN payloads too)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert as_bytes(a) == as_bytes(b), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), f"{path}: _metadata"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def rich_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    nan_payload = torch.tensor([0x7FC00001, 0x7F800001], dtype=torch.int32).view(torch.float32)
    return {
        "model": model.state_dict(),                       # OrderedDict with _metadata
        "optimizer": opt.state_dict(),                     # int keys, 0-dim step tensors, lists
        "tensors": {
            "f32": torch.randn(5, 7), "f64": torch.randn(3, dtype=torch.float64),
            "f16": torch.randn(4, dtype=torch.float16), "bf16": torch.randn(6, dtype=torch.bfloat16),
            "i8": torch.randint(-128, 127, (9,), dtype=torch.int8), "i64": torch.arange(10) * 2**40,
            "u8": torch.randint(0, 255, (2, 3), dtype=torch.uint8), "bool": torch.rand(11) > 0.5,
            "c64": torch.randn(3, dtype=torch.complex64), "scalar": torch.tensor(3.25),
            "noncontig": torch.randn(4, 6).t(), "nan_payloads": nan_payload, "empty": torch.empty(0, 3),
        },
        "rng": torch.get_rng_state(),
        "meta": {"name": "run-1", "lr": 1e-3, "epoch": 7, "none": None, "flags": {1, 2},
                 "blob": b"\x00\xff", "empty_blob": b"", "pair": (1, "a"), "seen": [1, 2, [3, 4]]},
    }


def flip_bit(path: Path, at: int | None = None) -> None:
    """Flip one bit in the middle of the file, or at byte ``at`` (a segment is larger than its shard)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2 if at is None else at)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def copies_of(directory, step: int, rank: int = 0) -> dict:
    """The manifest's copies of ``rank``'s shard by (tier, node): local paths for memory copies."""
    man = read_manifest(step_dir(directory, step))
    return {(c.tier.value, c.node): c.location.split("#", 1)[-1] for c in man.copies if c.rank == rank}


# --------------------------------------------------------------------------- round trips

def test_round_trip_is_bit_exact_through_every_tier(tmp_path, own_cluster, caplog):
    c = own_cluster(["node0", "node1", "node2"], transport="tcp")
    state = rich_state()
    eng = c.engine(tmp_path / "ckpt", "job-rt", 0, 1, "node0")
    assert eng.save(100, state)
    eng.wait()
    copies = copies_of(tmp_path / "ckpt", 100)
    assert set(copies) == {("memory", "node0"), ("memory", "node1"), ("disk", "node0"), ("shared", "shared")}
    seen = {}
    step, loaded = eng.load()                                   # tier 0: this node's memory
    seen[eng.last_restore["tier_name"]] = step
    assert_same(state, loaded)
    assert loaded["tensors"]["noncontig"].is_contiguous()
    holder = c.engine(tmp_path / "ckpt", "job-rt", 0, 1, "node1")  # the replica is node1's own memory
    assert holder.load()[0] == 100 and holder.last_restore["tier_name"] == "local-memory"
    spare = c.engine(tmp_path / "ckpt", "job-rt", 0, 1, "node2")   # rank 0 moved: the peer's memory
    step, loaded = spare.load()
    seen[spare.last_restore["tier_name"]] = step
    assert_same(state, loaded)
    for node in ("node0", "node1"):                             # both daemons die: memory is gone
        c.signal(node, signal.SIGKILL)
    for path in (copies[("memory", "node0")], copies[("memory", "node1")]):
        Path(path).unlink()
    with caplog.at_level(logging.WARNING, logger="transom.checkpoint"):
        again = c.engine(tmp_path / "ckpt", "job-rt", 0, 1, "node0")
        step, loaded = again.load()                             # tier 2: local disk
        seen[again.last_restore["tier_name"]] = step
        assert_same(state, loaded)
        Path(copies[("disk", "node0")]).unlink()
        step, loaded = again.load()                             # tier 3: shared directory
        seen[again.last_restore["tier_name"]] = step
    assert_same(state, loaded)
    assert seen == {"local-memory": 100, "peer-memory": 100, "local-disk": 100, "shared": 100}


def test_shard_bytes_are_a_safetensors_file(tmp_path, cluster):
    from safetensors.torch import load_file

    eng = one(cluster, tmp_path)
    w = torch.randn(7, 3)
    eng.save(1, {"w": w, "n": 3})
    eng.wait()
    got = load_file(str(step_dir(tmp_path, 1) / "rank-00000.safetensors"))
    assert torch.equal(got["t0"], w)


def test_tensors_changed_after_save_returns_do_not_reach_the_checkpoint(tmp_path, cluster):
    w = torch.ones(256, 256)
    meta = {"seen": [1, 2]}
    eng = one(cluster, tmp_path)
    eng.save(1, {"w": w, "meta": meta})
    w.add_(41.0)                       # right after save() returns, while the daemon works on it
    meta["seen"].append(3)
    eng.save(2, {"w": w, "meta": meta})
    w.zero_()
    eng.wait()
    assert torch.equal(eng.load(1)[1]["w"], torch.ones(256, 256))
    assert eng.load(1)[1]["meta"] == {"seen": [1, 2]}
    assert torch.equal(eng.load(2)[1]["w"], torch.full((256, 256), 42.0))


def test_cpu_state_never_page_locks_a_segment(tmp_path, cluster):
    eng = one(cluster, tmp_path)
    eng.save(1, {"w": torch.ones(1000)})
    eng.wait()
    assert eng.pin_memory and eng.pinned_bytes == 0, "page-locking is for CUDA copies only"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run it on a GPU host)")
def test_cuda_state_is_copied_into_a_page_locked_segment_and_loads_bit_for_bit(tmp_path, cluster):
    state = {"w": torch.randn(1 << 22, device="cuda"), "b": torch.arange(1000, device="cuda"),
             "cpu": torch.ones(10), "step": 3}
    eng = one(cluster, tmp_path)
    for step in (1, 2, 3):             # the second and third saves copy into segments pinned ahead
        assert eng.save(step, state)
        eng.wait()
        assert eng.pinned_bytes >= (1 << 24), f"save {step}: the segment it copied into is page-locked"
    got = eng.load()[1]
    assert torch.equal(got["w"], state["w"].cpu()) and torch.equal(got["b"], state["b"].cpu())
    assert got["step"] == 3 and torch.equal(got["cpu"], torch.ones(10))
    eng.close()
    plain = one(cluster, tmp_path / "plain", pin_memory=False)
    plain.save(1, state)
    plain.wait()
    assert plain.pinned_bytes == 0 and torch.equal(plain.load()[1]["w"], state["w"].cpu())


def test_segments_are_reused_across_saves(tmp_path, cluster):
    eng = one(cluster, tmp_path, keep=2)
    for step in range(1, 6):
        eng.save(step, {"w": torch.full((1000,), float(step))})
        eng.wait()
    conn = Conn(eng.daemon_addr)
    try:
        mine = [s for s in conn.call({"op": "stats"})["slots"] if s["job"] == eng.job and s["kind"] == "own"]
    finally:
        conn.close()
    assert len(mine) == 2, f"one held and one being written, reused: {mine}"
    assert torch.equal(eng.load()[1]["w"], torch.full((1000,), 5.0))


def test_save_does_not_wait_for_a_busy_daemon(tmp_path, cluster):
    """A save copies into the segment the previous save's background work acquired and hands the
    shard over without waiting for the daemon's answer: a daemon that gets no CPU (stopped here)
    does not hold the training step; it takes the shard when it runs again."""
    eng = one(cluster, tmp_path)
    w = torch.arange(1 << 16, dtype=torch.float32)
    for step in (1, 2):                # the second save frees the first's segment: acquired ahead
        eng.save(step, {"w": w})
        eng.wait()
    cluster.signal("node0", signal.SIGSTOP)
    try:
        returned = threading.Event()
        threading.Thread(target=lambda: (eng.save(3, {"w": w + 3}), returned.set()), daemon=True).start()
        assert returned.wait(20), "save() waited for a daemon that was not running"
        assert eng.in_flight()
    finally:
        cluster.signal("node0", signal.SIGCONT)
    eng.wait()
    assert eng.committed[-1] == 3 and eng.saves_ahead == 1
    assert torch.equal(eng.load(3)[1]["w"], w + 3)


def test_every_rank_acquires_its_next_segment_once_the_step_commits(tmp_path, engines):
    """In a job of several ranks a rank's save is done before the step commits (the slowest rank
    decides); the segment to reuse is free only then: each rank's background work waits for it."""
    engs = engines(tmp_path, 3)
    for step in range(1, 6):
        for e in engs:                                 # no wait(): a training loop goes on stepping
            e.save(step, {"w": torch.full((1 << 14,), float(step + e.rank))})
        if step >= 2:
            wait_until(lambda: all(e.next_segment_ready for e in engs) or None, 20,
                       f"every rank's segment for the save after step {step}")
    for e in engs:
        e.wait()
    assert [e.saves_ahead for e in engs] == [3, 3, 3]
    assert all(torch.equal(e.load(5)[1]["w"], torch.full((1 << 14,), 5.0 + e.rank)) for e in engs)


# --------------------------------------------------------------------------- failures

def test_corrupted_memory_replicas_fall_back_to_disk(tmp_path, cluster, caplog):
    eng = one(cluster, tmp_path)
    eng.save(10, {"w": torch.arange(100_000, dtype=torch.float32)})
    eng.wait()
    copies = copies_of(tmp_path, 10)
    flip_bit(Path(copies[("memory", "node0")]), at=200_000)     # inside the 400 kB shard
    flip_bit(Path(copies[("memory", "node1")]), at=200_000)
    with caplog.at_level(logging.WARNING, logger="transom.checkpoint"):
        step, state = eng.load()
    assert (step, eng.last_restore["tier_name"]) == (10, "local-disk")
    assert torch.equal(state["w"], torch.arange(100_000, dtype=torch.float32))
    warned = [r.getMessage() for r in caplog.records if "digest mismatch" in r.getMessage()]
    assert any("local-memory copy on node0" in m for m in warned), warned
    assert any("peer-memory copy on node1" in m for m in warned), warned
    flip_bit(Path(copies[("disk", "node0")]))
    truncate(Path(copies[("shared", "shared")]))
    with pytest.raises(CorruptCheckpoint, match="no copy verifies.*truncated"):
        eng.load(10)
    assert eng.load() is None


def test_evicted_nodes_shards_are_restored_on_the_spare_from_its_neighbours_memory(tmp_path, own_cluster, broker):
    c = own_cluster(["node0", "node1", "node2", "node3"])      # auto: Mooncake only with an RDMA port
    job = f"job-{uuid.uuid4().hex[:8]}"
    ckpt = tmp_path / "ckpt"
    states = [{"w": torch.randn(300, 300), "rank": r} for r in range(2)]
    ranks = [c.engine(ckpt, job, r, 2, f"node{r}", bootstrap=broker.bootstrap) for r in range(2)]
    for e in ranks:
        e.save(40, states[e.rank])
    for e in ranks:
        e.wait()
    events = wait_until(lambda: [e for e in topic_values(broker.bootstrap, contracts.CHECKPOINTS)
                                 if e.job == job] or None, 30, f"checkpoint-ready of {job}")
    assert len(events) == 1
    ready = events[0]
    assert ready.replicated and ready.persisted and ready.step == 40
    from transom.checkpoint.digest import digest_of
    from transom.checkpoint.transport import rdma_ports

    if not rdma_ports():
        assert "replication: Transom's TCP transport (no active RDMA port" in c.log("node0")
    for shard in ready.shards:
        data = (step_dir(ckpt, 40) / shard.name).read_bytes()
        assert shard.digest.startswith("xxh3-128/c") and not shard.sha256
        assert shard.digest == digest_of(data) and shard.size == len(data)
    memory = {(cp.rank, cp.node) for cp in ready.copies if cp.tier == contracts.Tier.MEMORY}
    assert memory == {(0, "node0"), (0, "node1"), (1, "node1"), (1, "node2")}, "ring: each shard on two nodes"
    # node1 is evicted (its daemon dies with it): by the controller's rule (a copy survives when
    # its node is not evicted) the memory copies alone still cover every rank
    assert {cp.rank for cp in ready.copies if cp.tier == contracts.Tier.MEMORY and cp.node != "node1"} == {0, 1}
    c.signal("node1", signal.SIGKILL)
    spare = c.engine(ckpt, job, 1, 2, "node3", generation=1)    # rank 1 relaunched on the spare
    step, state = spare.load()
    assert (step, spare.last_restore["tier_name"], spare.last_restore["node"]) == (40, "peer-memory", "node2")
    assert torch.equal(state["w"], states[1]["w"]) and state["rank"] == 1


_MID_SAVE = """
import sys, torch
from transom.checkpoint import CheckpointEngine
eng = CheckpointEngine(sys.argv[1], sys.argv[2], 0, 1, "node0", runtime=sys.argv[3])
eng.save(10, {"w": torch.full((1000,), 10.0)})
eng.wait()
print("saved 10", flush=True)
big = {"w": torch.ones(32 << 20)}
print("saving 20", flush=True)
eng.save(20, big)
eng.wait()
print("saved 20", flush=True)
"""


def test_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, cluster):
    job = f"job-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", _MID_SAVE, str(tmp_path), job, str(cluster.runtime)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=cluster.env)
    conn = Conn(segments.registered(cluster.runtime)["node0"]["addr"])
    try:
        assert proc.stdout.readline().decode().startswith("saved 10")
        assert proc.stdout.readline().decode().startswith("saving 20")
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:   # kill it once the copy is under way
            slots = conn.call({"op": "stats"})["slots"]
            if any(s["job"] == job and s["state"] == "staging" and s["step"] == 20 for s in slots):
                break
            time.sleep(0.002)
        proc.kill()                                    # mid-copy (128 MiB), or later on a fast host
        proc.wait(10)
        assert complete_steps(tmp_path) in ([10], [10, 20])
        eng = cluster.engine(tmp_path, job, 0, 1, "node0")
        assert eng.load(10)[1]["w"].eq(10.0).all()
        assert eng.last_restore["tier_name"] == "local-memory"
        eng.save(30, {"w": torch.full((1000,), 30.0)})      # the half-written segment is taken back
        eng.wait()
        assert eng.load()[0] == 30
    finally:
        conn.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_state_a_load_would_refuse_is_refused_by_save_with_the_fix(tmp_path, cluster):
    eng = one(cluster, tmp_path)
    with pytest.raises(CheckpointError, match="Fraction.*builtin types"):
        eng.save(1, {"ratio": Fraction(1, 3)})
    with pytest.raises(CheckpointError, match="builtin types"):
        eng.save(1, {"fn": lambda: None})
    assert eng.save(2, {"w": torch.ones(1)})
    eng.wait()
    assert complete_steps(tmp_path) == [2]


def test_failed_persist_does_not_raise_in_save_but_in_wait(tmp_path, cluster):
    eng = one(cluster, tmp_path)
    step_dir(tmp_path, 1).write_text("in the way")            # the step dir cannot be created
    assert eng.save(1, {"w": torch.ones(3)})
    with pytest.raises(CheckpointError, match="a checkpoint save failed"):
        eng.wait()
    eng.save(2, {"w": torch.ones(1)})
    eng.wait()
    assert complete_steps(tmp_path) == [2]


# --------------------------------------------------------------------------- commit

def test_step_missing_one_ranks_shard_is_never_loaded(tmp_path, engines):
    r0, r1 = engines(tmp_path, 2)
    save_all([r0, r1], 10, lambda r, s: {"w": torch.full((4,), float(r + s))})
    r0.save(20, {"w": torch.zeros(4)})        # rank 1 never saves step 20 (it died)
    r0.wait()
    assert (step_dir(tmp_path, 20) / "rank-00000.safetensors").exists()
    assert complete_steps(tmp_path) == [10]
    assert r0.load()[0] == 10
    with pytest.raises(NoCheckpoint, match="incomplete"):
        r0.load(20)
    with pytest.raises(NoCheckpoint, match="no checkpoint of step 30"):
        r0.load(30)
    with pytest.raises(TypeError, match="map_location"):
        r0.load(10, map_location="cpu")       # an unknown keyword is refused, not swallowed
    info = {s.step: s for s in list_steps(tmp_path)}
    assert not info[20].complete and info[20].ranks == (0,)


def test_shards_of_an_earlier_generation_do_not_complete_a_step(tmp_path, engines):
    _, old_r1 = engines(tmp_path, 2, generation=0)
    old_r1.save(30, {"w": torch.ones(2)})      # gen 0 died after rank 1 wrote step 30
    old_r1.wait()
    new_r0, new_r1 = engines(tmp_path, 2, generation=1)
    new_r0.save(30, {"w": torch.full((2,), 7.0)})
    new_r0.wait()
    assert complete_steps(tmp_path) == [], "a stale gen-0 shard must not complete gen 1's step"
    new_r1.save(30, {"w": torch.full((2,), 8.0)})
    new_r1.wait()
    assert complete_steps(tmp_path) == [30]
    assert torch.equal(new_r1.load(30)[1]["w"], torch.full((2,), 8.0))


def test_concurrent_ranks_commit_each_step_exactly_once(tmp_path, engines):
    engs = engines(tmp_path, 4, keep=10)

    def run(e):
        for step in range(1, 6):
            e.save(step, {"w": torch.full((5000,), float(e.rank * 100 + step))})
        e.wait()

    threads = [threading.Thread(target=run, args=(e,)) for e in engs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert complete_steps(tmp_path) == [1, 2, 3, 4, 5]
    assert sorted(s for e in engs for s in e.committed) == [1, 2, 3, 4, 5]
    for e in engs:
        assert torch.equal(e.load(3)[1]["w"], torch.full((5000,), float(e.rank * 100 + 3)))


def test_keep_k_deletes_older_steps_only_after_newer_are_complete(tmp_path, engines):
    r0, r1 = engines(tmp_path, 2, keep=2)
    state = lambda r, s: {"w": torch.full((4,), float(s))}  # noqa: E731
    save_all([r0, r1], 10, state)
    r0.save(15, state(0, 15))                  # incomplete, older than what will be kept
    r0.wait()
    save_all([r0, r1], 20, state)
    assert complete_steps(tmp_path) == [10, 20], "nothing to delete while only 2 steps are complete"
    save_all([r0, r1], 30, state)
    r0.save(40, state(0, 40))                  # incomplete, newer: a save may be writing it
    r0.wait()
    assert [s.step for s in list_steps(tmp_path)] == [20, 30, 40]
    save_all([r0, r1], 50, state)
    assert [s.step for s in list_steps(tmp_path)] == [30, 40, 50]
    assert complete_steps(tmp_path) == [30, 50]


# --------------------------------------------------------------------------- one save in flight

def test_skip_and_wait_policies_while_a_save_is_in_flight(tmp_path, cluster, caplog):
    """The neighbour daemon is stopped (SIGSTOP), so replication, and the save, stay in flight."""
    skip = one(cluster, tmp_path / "skip", policy="skip")
    wait = one(cluster, tmp_path / "wait")
    cluster.signal("node1", signal.SIGSTOP)
    try:
        assert skip.save(1, {"w": torch.ones(2)})
        with caplog.at_level(logging.WARNING, logger="transom.checkpoint"):
            assert skip.save(2, {"w": torch.ones(2)}) is False
        assert any("skipped checkpoint of step 2" in r.getMessage() for r in caplog.records)
        assert wait.save(1, {"w": torch.ones(2)})
        second = threading.Thread(target=wait.save, args=(2, {"w": torch.ones(2)}))
        second.start()
        second.join(0.5)
        assert second.is_alive(), "save(2) must wait for step 1"
        assert complete_steps(tmp_path / "wait") == []
    finally:
        cluster.signal("node1", signal.SIGCONT)
    second.join(60)
    skip.wait()
    wait.wait()
    assert skip.skipped == [2] and complete_steps(tmp_path / "skip") == [1]
    assert complete_steps(tmp_path / "wait") == [1, 2]


# --------------------------------------------------------------------------- announce

def test_unreachable_broker_does_not_stop_the_checkpoint(tmp_path, cluster):
    dead = f"127.0.0.1:{free_port()}"
    eng = one(cluster, tmp_path, bootstrap=dead)
    eng.save(3, {"w": torch.ones(3)})
    eng.wait()
    assert complete_steps(tmp_path) == [3]
    wait_until(lambda: "checkpoint-ready for step 3 not yet delivered" in cluster.log("node0")
               or "could not publish" in cluster.log("node0") or None, 10, "the daemon's warning")


# --------------------------------------------------------------------------- capacity, env and CLI

def test_planner_implements_the_papers_formulas():
    p = planner.plan(7e9, 8, 4, b_mem=10e9, b_rdma=12.5e9)
    assert p.s_save == pytest.approx((8 + 6) * 7e9 / 16)
    assert p.load_s == pytest.approx((8 + 6) * 7e9 / (16 * 10e9))
    q = planner.plan(7e9, 16, 4, b_mem=10e9, b_rdma=12.5e9, mem_keep=2)
    assert q.load_s == pytest.approx(3 * 7e9 / (8 * 10e9) + 8 * 16 * 7e9 / (128 * 12.5e9))
    assert q.per_node == pytest.approx(3 * q.s_save)


def test_too_small_shm_is_a_clear_error_before_training(tmp_path, capsys):
    with pytest.raises(planner.CapacityError, match=r"need 4\.00 GiB .*free space in /dev/shm 1\.00 GiB.*--mem-keep"):
        planner.check_node(4 << 30, shm_free=1 << 30, ram_available=64 << 30, where="/dev/shm")
    assert transom_main(["ckpt", "plan", "--params", "1e13", "--dp", "8", "--nodes", "1", "--check",
                         "--runtime", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "checkpoints need" in err and "free space in" in err


def test_from_env_reads_the_launcher_environment(tmp_path, monkeypatch, cluster):
    for key, value in {"TRANSOM_CKPT_DIR": str(tmp_path), "RANK": "2", "WORLD_SIZE": "4",
                       "TRANSOM_JOB": "j1", "TRANSOM_NODE": "node2", "TRANSOM_GENERATION": "5",
                       "TRANSOM_CKPT_RUNTIME": str(cluster.runtime)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TRANSOM_BOOTSTRAP", raising=False)
    eng = CheckpointEngine.from_env()
    cluster.engines.append(eng)
    assert (eng.directory, eng.rank, eng.world_size, eng.job, eng.node, eng.generation, eng.bootstrap) == \
        (tmp_path, 2, 4, "j1", "node2", 5, None)
    assert eng.cadence.relaunches == 5, "generation 5: the job was relaunched five times (the cadence's rollbacks)"
    assert eng.daemon_addr == segments.registered(cluster.runtime)["node2"]["addr"]
    assert eng.pin_memory, "CUDA tensors are copied into page-locked memory unless told otherwise"
    monkeypatch.setenv("TRANSOM_CKPT_PIN", "0")
    unpinned = CheckpointEngine.from_env()
    cluster.engines.append(unpinned)
    assert not unpinned.pin_memory
    monkeypatch.setenv("TRANSOM_CKPT_PIN", "sometimes")
    with pytest.raises(ConfigError, match="TRANSOM_CKPT_PIN='sometimes': expected 1 or 0"):
        CheckpointEngine.from_env()
    monkeypatch.delenv("TRANSOM_CKPT_DIR")
    with pytest.raises(ConfigError, match="TRANSOM_CKPT_DIR"):
        CheckpointEngine.from_env()


def test_ckpt_list_shows_complete_and_flags_incomplete_steps(tmp_path, engines, capsys):
    r0, r1 = engines(tmp_path, 2)
    save_all([r0, r1], 10, lambda r, s: {"w": torch.ones(8)})
    r0.save(20, {"w": torch.ones(8)})
    r0.wait()
    assert transom_main(["ckpt", "list", "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = {int(line.split()[0]): line.split() for line in lines if line.split()[0].isdigit()}
    assert row[10][1:3] == ["complete", "2/2"] and row[20][1:3] == ["INCOMPLETE", "1/2"]
    flip_bit(step_dir(tmp_path, 10) / "rank-00001.safetensors")
    assert transom_main(["ckpt", "list", "--dir", str(tmp_path), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "rank-00001.safetensors: digest mismatch" in out


# --------------------------------------------------------------------------- fork (copy-on-write) snapshots

def test_fork_snapshot_is_bit_exact_and_later_writes_do_not_reach_it(tmp_path, cluster):
    eng = one(cluster, tmp_path, snapshot="fork")
    state = rich_state()
    big = torch.arange(1 << 20, dtype=torch.float32)           # 4 MiB: snapshotted by the child
    state["tensors"]["big"] = big
    want = copy.deepcopy(state)
    assert eng.save(1, state)
    assert eng.last_snapshot_mode.value == "fork" and eng.snapshot_child is not None
    big.mul_(-1.0)                                            # right after save() returns
    state["tensors"]["f32"].zero_()
    state["meta"]["seen"].append(5)
    eng.wait()
    assert eng.snapshot_child is None
    step, loaded = eng.load()
    assert step == 1 and eng.last_restore["tier_name"] == "local-memory"
    assert_same(want, loaded)
    small = one(cluster, tmp_path / "small", snapshot="fork")   # nothing big: copied, no fork
    assert small.save(1, {"w": torch.ones(4)}) and small.last_snapshot_mode.value == "copy"
    small.wait()
    with pytest.raises(ConfigError, match="snapshot: expected one of.*'clone'"):
        one(cluster, tmp_path / "bad", snapshot="clone")


_FORK_PARENT = """
import os, sys, time, torch
from transom.checkpoint import CheckpointEngine
eng = CheckpointEngine(sys.argv[1], sys.argv[2], 0, 1, "node0", runtime=sys.argv[3], snapshot="fork")
eng.save(10, {"w": torch.full((1 << 20,), 10.0)})
eng.wait()
eng.save(20, {"w": torch.full((1 << 25,), 20.0)})   # 128 MiB: the child is still copying when it is stopped
print("child", eng.snapshot_child, flush=True)
time.sleep(600)
"""


def test_rank_killed_while_its_fork_snapshot_runs_cannot_corrupt_later_saves(tmp_path, cluster):
    """The child of a dead rank still holds its segment: a relaunched rank's saves never reuse it,
    and the child, when it finishes, is refused: its generation was replaced (stale-generation
    writes never reach the new generation's checkpoints)."""
    job = f"job-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", _FORK_PARENT, str(tmp_path), job, str(cluster.runtime)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=cluster.env)
    child = None
    try:
        line = proc.stdout.readline().decode()
        child = int(line.split()[1])
        os.kill(child, signal.SIGSTOP)                  # the snapshot child, stopped mid-save
        proc.kill()                                     # the rank dies
        proc.wait(10)
        eng = cluster.engine(tmp_path, job, 0, 1, "node0", generation=1)   # relaunched on node0
        assert eng.load()[0] == 10
        eng.save(30, {"w": torch.full((1 << 20,), 30.0)})
        eng.wait()
        assert "still being written by a live process" in cluster.log("node0")
        os.kill(child, signal.SIGCONT)                  # the child finishes the save of step 20 of generation 0
        wait_until(lambda: "save of step 20 of rank 0 of job" in cluster.log("node0") or None, 30,
                   "the child's save of step 20 refused as a stale generation")
        assert "stale generation" in cluster.log("node0")
        assert 20 not in complete_steps(tmp_path) and eng.load(30)[1]["w"].eq(30.0).all()
        eng.save(40, {"w": torch.full((1 << 20,), 40.0)})                    # the segment is reusable again
        eng.wait()
        assert eng.load(40)[1]["w"].eq(40.0).all()
    finally:
        if child is not None:
            try:
                os.kill(child, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()


_GLOO_RANK = """
import os, sys, torch, torch.distributed as dist
from transom.checkpoint import CheckpointEngine
torch.set_num_threads(2)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(512, 1024))   # 2 MiB of weights
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
eng = CheckpointEngine(sys.argv[1], "gloo-job", rank, 2, f"node{rank}", runtime=sys.argv[2], snapshot="fork")
for step in range(1, 5):
    opt.zero_grad()
    model(torch.randn(16, 512)).pow(2).mean().backward()      # gloo all-reduce while a child may run
    opt.step()
    eng.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    assert eng.last_snapshot_mode.value == "fork", eng.last_snapshot_mode
    dist.barrier()
eng.wait()
dist.barrier()                                                  # every rank's save of the last step is done
step, got = eng.load()
ok = step == 4 and all(torch.equal(got["model"][k], v) for k, v in model.state_dict().items())
print("ok" if ok else f"mismatch at {step}", flush=True)
eng.close()
dist.destroy_process_group()
"""


def test_fork_snapshots_are_safe_with_a_gloo_process_group_and_torch_threads(tmp_path, cluster):
    env = {**cluster.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_RANK, str(tmp_path), str(cluster.runtime)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**env, "RANK": str(r)})
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and out.strip().endswith("ok"), out[-2000:]
    assert complete_steps(tmp_path)[-1] == 4


# --------------------------------------------------------------------------- cadence (when to save)

class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _train(cad: "cadence.Cadence", clock: _Clock, steps: range, agree, epoch: int | None = None) -> list[int]:
    """Steps of 0.1 s; a save stalls 0.05 s and slows the 3 steps while it is in flight by 0.05 s each;
    ``epoch``: the elastic group's (None: a job without one, every fault relaunches it)."""
    saves, busy_left = [], 0
    for step in steps:
        clock.t += 0.1 + (0.05 if busy_left else 0.0)
        busy_left = max(0, busy_left - 1)
        cad.tick(step, busy=busy_left > 0)
        if cad.due(step, agree, epoch):
            clock.t += 0.05                           # the stall
            cad.saved(step, 0.05)
            saves.append(step)
            busy_left = 3
    return saves


def test_cadence_saves_at_youngs_interval_from_the_measured_cost_and_agrees_only_at_saves():
    """A save costs 0.2 s (its stall and 3 slowed steps), so with a fault every 100 s the interval is
    sqrt(2 x 0.2 x 100) = 6.3 s = 63 steps; the ranks agree once at the start and once per save, never
    on the steps between (one more collective per step costs this host ~5 % of the step)."""
    clock, calls = _Clock(), []
    cad = cadence.Cadence(100.0, first=10, clock=clock)
    saves = _train(cad, clock, range(1, 400), lambda v: calls.append(v) or v)
    assert saves[:2] == [10, 20], "the first save 10 steps in, the next 10 later (its cost not measured yet)"
    assert cad.save_cost_s == pytest.approx(0.2, abs=1e-6)
    assert cad.interval.steps == 63 and cad.interval.seconds == pytest.approx(6.3)
    assert [b - a for a, b in zip(saves[1:], saves[2:])] == [63] * (len(saves) - 2)
    assert cad.interval.save_fraction == pytest.approx(0.2 / 6.3)
    assert len(calls) == len(saves) + 1


class _MaxAllReduce:
    """dist.all_reduce(op=MAX) among threads, each a rank; a rank that calls it alone times out."""

    def __init__(self, n: int) -> None:
        self.barrier, self.votes = threading.Barrier(n, timeout=10), [0] * n

    def agree(self, rank: int):
        def call(vote: int) -> int:
            self.votes[rank] = vote
            self.barrier.wait()
            top = max(self.votes)
            self.barrier.wait()
            return top
        return call


def test_cadence_a_spare_that_joins_keeps_the_jobs_schedule():
    """Rank 1 dies after step 200; a fresh spare takes its place in the group of epoch 1: both save the
    same steps from then on, the survivor's schedule, not the newcomer's first 10: the save already
    agreed (89 steps after the last: an elastic job starts at half the faults rolling back, sqrt(2 x 0.2
    x 100 / 0.5) = 8.9 s), then 110 apart, since the fault healed in the job (a third: 11.0 s)."""
    c0, c1 = _Clock(), _Clock()
    survivor, spare = cadence.Cadence(100.0, first=10, clock=c0), cadence.Cadence(100.0, first=10, clock=c1)
    before = _train(survivor, c0, range(1, 201), lambda v: v, epoch=0)
    group, out = _MaxAllReduce(2), {}

    def rank(r: int, cad, clock) -> None:
        out[r] = _train(cad, clock, range(201, 400), group.agree(r), epoch=1)

    threads = [threading.Thread(target=rank, args=(0, survivor, c0)), threading.Thread(target=rank, args=(1, spare, c1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0] == out[1], out
    assert out[0][0] == before[-1] + 89 and [b - a for a, b in zip(out[0], out[0][1:])] == [110] * (len(out[0]) - 1)
    assert (survivor.heals, spare.heals) == (1, 0)


def test_cadence_saves_less_often_as_faults_heal_in_the_job_and_not_after_relaunches():
    """Only a relaunch rolls the job back. A job without an elastic group (no epoch) takes every fault to
    roll it back; an elastic one starts at half (Laplace), and each group re-formed in the job (a new
    epoch) lowers the share, (relaunches + 1) / (relaunches + heals + 2), stretching the interval to
    sqrt(2 C M / share); a job relaunched as often as it healed keeps saving more often."""
    clock = _Clock()
    plain = cadence.Cadence(100.0, first=10, relaunches=2, clock=clock)
    _train(plain, clock, range(1, 201), lambda v: v)
    assert plain.rollback_share == 1 and plain.interval.steps == 63

    clock = _Clock()
    healing = cadence.Cadence(100.0, first=10, clock=clock)
    _train(healing, clock, range(1, 101), lambda v: v, epoch=0)
    assert healing.rollback_share == 0.5 and healing.interval.steps == 89
    for epoch in range(1, 5):
        _train(healing, clock, range(100 * epoch + 1, 100 * epoch + 101), lambda v: v, epoch=epoch)
    assert healing.heals == 4 and healing.rollback_share == pytest.approx(1 / 6)
    assert healing.interval.steps == round((2 * 0.2 * 100 * 6) ** 0.5 / 0.1) == 155
    assert healing.interval.rollback_fraction == pytest.approx(15.5 / (2 * 600))

    clock = _Clock()
    relaunched = cadence.Cadence(100.0, first=10, relaunches=4, clock=clock)
    for epoch in range(5):
        _train(relaunched, clock, range(100 * epoch + 1, 100 * epoch + 101), lambda v: v, epoch=epoch)
    assert relaunched.rollback_share == pytest.approx(5 / 10)
    assert relaunched.interval.steps == round((2 * 0.2 * 100 * 10 / 5) ** 0.5 / 0.1) == 89


def test_cadence_interval_bounds_and_youngs_formula():
    assert cadence.young(0.4, 120) == pytest.approx((2 * 0.4 * 120) ** 0.5)
    p = cadence.plan(0.4, 120, 0.3)
    assert p.steps == 33 and p.lost_fraction == pytest.approx(0.4 / 9.9 + 9.9 / 240)
    assert cadence.plan(0.4, 1e12, 0.3).seconds == pytest.approx(1800, rel=1e-3), "capped at 30 min"
    assert cadence.plan(0.0, 120, 0.3, min_steps=3).steps == 3, "never below the steps a save was in flight"
    assert cadence.plan(0.4, 120, rollback_share=0.25).seconds == pytest.approx(cadence.young(0.4, 480))
    with pytest.raises(ValueError, match="roll back must be in"):
        cadence.plan(0.4, 120, rollback_share=0)
    with pytest.raises(ValueError, match="mean time between faults"):
        cadence.young(0.4, 0)


def test_ckpt_plan_prints_the_interval_and_refuses_bad_input(capsys):
    assert transom_main(["ckpt", "plan", "--save-cost", "0.4", "--mtbf", "120", "--step-time", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "9.9 s = 33 steps of 0.3 s" in out and "lost to saves" in out and "8.17 %" in out
    assert transom_main(["ckpt", "plan", "--save-cost", "0.4", "--mtbf", "120", "--step-time", "0.3",
                         "--rollback-share", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "25 % of them rolled back: one every 480 s" in out and "19.5 s = 65 steps of 0.3 s" in out
    assert transom_main(["ckpt", "plan", "--save-cost", "0.4", "--mtbf", "120", "--rollback-share", "1.5"]) == 2
    assert "--rollback-share 1.5: expected a share in (0, 1]" in capsys.readouterr().err
    assert transom_main(["ckpt", "plan", "--save-cost", "0.4", "--mtbf", "0"]) == 2
    assert "--mtbf 0.0: expected seconds > 0" in capsys.readouterr().err
    assert transom_main(["ckpt", "plan"]) == 2
    assert "give --params, --dp and --nodes" in capsys.readouterr().err
