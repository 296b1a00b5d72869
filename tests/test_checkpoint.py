"""The checkpoint engine on real files with real torch; the announce against the real broker.

Several ranks of one job are simulated as several engines in this process sharing a directory.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from transom import contracts
from transom.broker import free_port
from transom.checkpoint import (
    CheckpointEngine, CheckpointError, CorruptCheckpoint, NoCheckpoint, Snapshotter, complete_steps,
    list_steps, step_dir,
)
from transom.cli import main as transom_main
from transom.config import ConfigError

from util import topic_values, wait_until


def engines(directory, world: int, job: str = "job-t", **kw) -> list[CheckpointEngine]:
    """The ranks of one job, as engines in this process sharing ``directory``."""
    return [CheckpointEngine(directory, job, r, world, f"node{r}", **kw) for r in range(world)]


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


# --------------------------------------------------------------------------- snapshot and round trip

def test_round_trip_is_bit_exact(tmp_path):
    state = rich_state()
    with CheckpointEngine(tmp_path, "job-t", 0, 1, "node0") as eng:
        assert eng.save(100, state)
        eng.wait()
        step, loaded = eng.load()
    assert step == 100
    assert_same(state, loaded)
    assert loaded["tensors"]["noncontig"].is_contiguous()


def test_tensors_changed_after_save_returns_do_not_reach_the_checkpoint(tmp_path):
    w = torch.ones(256, 256)
    meta = {"seen": [1, 2]}
    with CheckpointEngine(tmp_path, "job-t", 0, 1, "node0") as eng:
        eng.save(1, {"w": w, "meta": meta})
        w.add_(41.0)                       # right after save() returns, while it persists
        meta["seen"].append(3)
        eng.save(2, {"w": w, "meta": meta})
        w.zero_()
        eng.wait()
        assert torch.equal(eng.load(1)[1]["w"], torch.ones(256, 256))
        assert eng.load(1)[1]["meta"] == {"seen": [1, 2]}
        assert torch.equal(eng.load(2)[1]["w"], torch.full((256, 256), 42.0))


def test_snapshot_reuses_buffers_when_shape_and_dtype_match():
    snap = Snapshotter()
    state = {"a": torch.zeros(4, 4), "b": [torch.zeros(3, dtype=torch.int64)]}
    first = snap.take(state)
    assert snap.allocations == 2
    state["a"].fill_(5)
    second = snap.take(state)
    assert snap.allocations == 2, "same shapes and dtypes must reuse the staging buffers"
    assert second["a"].data_ptr() == first["a"].data_ptr()
    assert torch.equal(second["a"], torch.full((4, 4), 5.0))
    state["a"] = torch.zeros(2, 2)
    snap.take(state)
    assert snap.allocations == 3


# --------------------------------------------------------------------------- verification

def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, problem", [(truncate, "truncated"), (flip_bit, "sha256 mismatch")])
def test_corrupt_shard_is_refused_and_load_falls_back(tmp_path, caplog, damage, problem):
    with CheckpointEngine(tmp_path, "job-t", 0, 1, "node0") as eng:
        for step in (10, 20):
            eng.save(step, {"w": torch.full((1000,), float(step))})
        eng.wait()
        shard = step_dir(tmp_path, 20) / "rank-00000.pt"
        damage(shard)
        with pytest.raises(CorruptCheckpoint) as err:
            eng.load(20)
        assert str(shard) in str(err.value) and problem in str(err.value)
        with caplog.at_level(logging.WARNING, logger="transom.checkpoint"):
            step, state = eng.load()
    assert step == 10 and torch.equal(state["w"], torch.full((1000,), 10.0))
    assert any(str(shard) in r.getMessage() for r in caplog.records), "the warning must name the file"


def test_missing_shard_file_of_a_committed_step_is_refused(tmp_path):
    with CheckpointEngine(tmp_path, "job-t", 0, 1, "node0") as eng:
        eng.save(5, {"w": torch.ones(3)})
        eng.wait()
        (step_dir(tmp_path, 5) / "rank-00000.pt").unlink()
        with pytest.raises(CorruptCheckpoint, match="rank-00000.pt: file is missing"):
            eng.load(5)
        assert eng.load() is None


def test_step_missing_one_ranks_shard_is_never_loaded(tmp_path):
    r0, r1 = engines(tmp_path, 2)
    save_all([r0, r1], 10, lambda r, s: {"w": torch.full((4,), float(r + s))})
    r0.save(20, {"w": torch.zeros(4)})        # rank 1 never saves step 20 (it died)
    r0.wait()
    assert (step_dir(tmp_path, 20) / "rank-00000.pt").exists()
    assert complete_steps(tmp_path) == [10]
    assert r0.load()[0] == 10
    with pytest.raises(NoCheckpoint, match="incomplete"):
        r0.load(20)
    with pytest.raises(NoCheckpoint, match="no checkpoint of step 30"):
        r0.load(30)
    info = {s.step: s for s in list_steps(tmp_path)}
    assert not info[20].complete and info[20].ranks == (0,)


def test_shards_of_an_earlier_generation_do_not_complete_a_step(tmp_path):
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


def test_a_later_launch_replaces_a_step_an_earlier_one_committed(tmp_path):
    save_all(engines(tmp_path, 2, generation=0), 30, lambda r, s: {"w": torch.zeros(2)})
    new_r0, new_r1 = engines(tmp_path, 2, generation=1)
    new_r0.save(30, {"w": torch.full((2,), 7.0)})
    new_r0.wait()
    assert complete_steps(tmp_path) == [], "a step half re-saved must not be loadable"
    new_r1.save(30, {"w": torch.full((2,), 8.0)})
    new_r1.wait()
    assert complete_steps(tmp_path) == [30]
    assert torch.equal(new_r0.load(30)[1]["w"], torch.full((2,), 7.0))
    save_all(engines(tmp_path, 2, generation=1), 30, lambda r, s: {"w": torch.ones(2)})
    assert complete_steps(tmp_path) == [30], "a launch reusing the generation commits again"
    assert torch.equal(new_r1.load(30)[1]["w"], torch.ones(2))


def test_concurrent_ranks_commit_each_step_exactly_once(tmp_path):
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


def test_keep_k_deletes_older_steps_only_after_newer_are_complete(tmp_path):
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

class Gate:
    """A state value whose serialisation waits for the test: holds a persist in flight."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        assert self.open.wait(30), "gate never opened"
        return (str, ("gate",))


def test_skip_policy_drops_a_save_while_one_is_in_flight(tmp_path, caplog):
    gate = Gate()
    with CheckpointEngine(tmp_path, "job-t", 0, 1, "node0", policy="skip") as eng:
        assert eng.save(1, {"g": gate})
        with caplog.at_level(logging.WARNING, logger="transom.checkpoint"):
            assert eng.save(2, {"w": torch.ones(2)}) is False
        gate.open.set()
        eng.wait()
        assert eng.skipped == [2]
    assert complete_steps(tmp_path) == [1]
    assert any("skipped checkpoint of step 2" in r.getMessage() for r in caplog.records)


def test_wait_policy_blocks_the_next_save_until_the_previous_persisted(tmp_path):
    gate = Gate()
    with CheckpointEngine(tmp_path, "job-t", 0, 1, "node0") as eng:
        assert eng.save(1, {"g": gate})
        second = threading.Thread(target=eng.save, args=(2, {"w": torch.ones(2)}))
        second.start()
        second.join(0.5)
        assert second.is_alive(), "save(2) must wait for step 1 to persist"
        assert complete_steps(tmp_path) == []
        gate.open.set()
        second.join(30)
        eng.wait()
    assert complete_steps(tmp_path) == [1, 2]


def test_objects_refused_by_weights_only_load_say_what_to_do(tmp_path):
    with CheckpointEngine(tmp_path, "job-t", 0, 1, "node0") as eng:
        eng.save(1, {"ratio": Fraction(1, 3)})
        eng.wait()
        with pytest.raises(CheckpointError, match="Fraction.*weights_only=False") as err:
            eng.load(1)
        assert not isinstance(err.value, CorruptCheckpoint)
        assert eng.load(1, weights_only=False) == (1, {"ratio": Fraction(1, 3)})


def test_failed_persist_does_not_raise_in_save_but_in_wait(tmp_path):
    eng = CheckpointEngine(tmp_path, "job-t", 0, 1, "node0")
    assert eng.save(1, {"fn": lambda: None})   # cannot be pickled
    with pytest.raises(CheckpointError, match="a checkpoint save failed"):
        eng.wait()
    assert list_steps(tmp_path)[0].ranks == () and complete_steps(tmp_path) == []
    assert not [p for p in step_dir(tmp_path, 1).iterdir() if ".tmp-" in p.name], "temp file left"
    eng.save(2, {"w": torch.ones(1)})
    eng.close()
    assert complete_steps(tmp_path) == [2]


# --------------------------------------------------------------------------- announce

def test_checkpoint_ready_is_published_once_with_every_shard_sha256(tmp_path, broker):
    job = f"job-{uuid.uuid4().hex[:8]}"
    engs = engines(tmp_path, 3, job=job, bootstrap=broker.bootstrap)
    save_all(engs, 7, lambda r, s: {"w": torch.randn(100 + r)})
    for e in engs:
        e.close()

    def mine():
        return [e for e in topic_values(broker.bootstrap, contracts.CHECKPOINTS) if e.job == job]

    events = wait_until(mine, 30, f"checkpoint-ready of {job}")
    assert len(events) == 1
    ready = events[0]
    assert (ready.step, ready.world_size, ready.persisted) == (7, 3, True)
    sdir = step_dir(tmp_path, 7)
    for shard in ready.shards:
        data = (sdir / shard.name).read_bytes()
        assert shard.sha256 == hashlib.sha256(data).hexdigest() and shard.size == len(data)
    assert {(c.rank, c.tier, c.node) for c in ready.copies} == {
        (r, contracts.Tier.SHARED, "shared") for r in range(3)}
    assert all(Path(c.location).is_file() for c in ready.copies)


def test_unreachable_broker_does_not_stop_the_checkpoint(tmp_path, caplog):
    dead = f"127.0.0.1:{free_port()}"
    eng = CheckpointEngine(tmp_path, "job-t", 0, 1, "node0", bootstrap=dead, announce_timeout=1.0)
    with caplog.at_level(logging.WARNING, logger="transom.checkpoint"):
        eng.save(3, {"w": torch.ones(3)})
        eng.wait()
        eng.close()
    assert complete_steps(tmp_path) == [3]
    assert any("not delivered" in r.getMessage() or "undelivered" in r.getMessage()
               for r in caplog.records)


# --------------------------------------------------------------------------- env and CLI

def test_from_env_reads_the_launcher_environment(tmp_path, monkeypatch):
    for key, value in {"TRANSOM_CKPT_DIR": str(tmp_path), "RANK": "2", "WORLD_SIZE": "4",
                       "TRANSOM_JOB": "j1", "TRANSOM_NODE": "node3", "TRANSOM_GENERATION": "5"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TRANSOM_BOOTSTRAP", raising=False)
    eng = CheckpointEngine.from_env()
    assert (eng.directory, eng.rank, eng.world_size, eng.job, eng.node, eng.generation, eng.bootstrap) == \
        (tmp_path, 2, 4, "j1", "node3", 5, None)
    monkeypatch.delenv("TRANSOM_CKPT_DIR")
    with pytest.raises(ConfigError, match="TRANSOM_CKPT_DIR"):
        CheckpointEngine.from_env()


def test_ckpt_list_shows_complete_and_flags_incomplete_steps(tmp_path, capsys):
    r0, r1 = engines(tmp_path, 2)
    save_all([r0, r1], 10, lambda r, s: {"w": torch.ones(8)})
    r0.save(20, {"w": torch.ones(8)})
    r0.wait()
    assert transom_main(["ckpt", "list", "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = {int(line.split()[0]): line.split() for line in lines if line.split()[0].isdigit()}
    assert row[10][1:3] == ["complete", "2/2"] and row[20][1:3] == ["INCOMPLETE", "1/2"]
    flip_bit(step_dir(tmp_path, 10) / "rank-00001.pt")
    assert transom_main(["ckpt", "list", "--dir", str(tmp_path), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "rank-00001.pt: sha256 mismatch" in out
