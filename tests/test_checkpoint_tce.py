"""TCE against the physical limits (issue 19): the chunked XXH3 digest, old sha256 checkpoints,
the transport choice, the daemon's authentication, save at the fault, DTensor state dicts."""

from __future__ import annotations

import hashlib
import json
import os
import random
import uuid
from pathlib import Path

import pytest
import torch

from transom import contracts
from transom.checkpoint import layout, step_dir
from transom.checkpoint.digest import CHUNK, DEFAULT, StreamDigest, digest_of
from transom.checkpoint.transport import TcpReplicator, detect_protocol, make_replicator

from test_checkpoint import Cluster, copies_of, flip_bit, one  # noqa: F401  (fixtures below)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("tce"), ["node0", "node1", "node2"], transport="tcp")
    yield c
    c.close()


# --------------------------------------------------------------------------- digest

def test_chunked_digest_streamed_in_any_pieces_equals_the_one_shot_digest():
    data = bytearray(os.urandom(3 * CHUNK + 12345))
    whole = digest_of(data)
    assert whole.startswith(DEFAULT + ":") and len(whole.split(":")[1]) == 32
    rnd = random.Random(1)
    s, pos = StreamDigest(), 0
    while pos < len(data):
        k = rnd.choice([1, 4096, CHUNK - 7, CHUNK, 5 << 20])
        s.feed(memoryview(data)[pos:pos + k])
        pos += k
    assert s.hexdigest() == whole
    data[2 * CHUNK + 5] ^= 1                               # one bit in the third chunk
    assert digest_of(data) != whole
    assert digest_of(b"") == digest_of(bytearray()) and digest_of(b"", "sha256") == \
        "sha256:" + hashlib.sha256(b"").hexdigest()


def test_multi_chunk_shard_with_a_corrupted_chunk_is_refused_and_the_next_copy_used(tmp_path, cluster, caplog):
    import logging

    eng = one(cluster, tmp_path)
    w = torch.arange(9 << 20, dtype=torch.float32)         # 36 MiB: three chunks
    eng.save(10, {"w": w})
    eng.wait()
    man = layout.read_manifest(step_dir(tmp_path, 10))
    assert man.shards[0].digest.startswith("xxh3-128/c")
    copies = copies_of(tmp_path, 10)
    flip_bit(Path(copies[("memory", "node0")]), at=CHUNK + 100)        # second chunk, local memory
    with caplog.at_level(logging.WARNING, logger="transom.checkpoint"):
        step, state = eng.load()
    assert (step, eng.last_restore["tier_name"]) == (10, "peer-memory")
    assert torch.equal(state["w"], w)
    assert any("local-memory copy on node0" in r.getMessage() and "digest mismatch (xxh3-128" in r.getMessage()
               for r in caplog.records)


def test_a_checkpoint_written_with_sha256_manifests_still_loads_and_verifies(tmp_path, cluster):
    eng = one(cluster, tmp_path, node="node1")
    eng.save(5, {"w": torch.arange(1000.0)})
    eng.wait()
    sdir = step_dir(tmp_path, 5)
    data = (sdir / layout.shard_name(0)).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    rm = json.loads((sdir / layout.rank_manifest_name(0)).read_bytes())
    rm.pop("digest")
    rm["sha256"] = sha
    layout.atomic_write_bytes(sdir / layout.rank_manifest_name(0), json.dumps(rm).encode())
    man = json.loads((sdir / layout.MANIFEST).read_bytes())
    for s in man["shards"]:
        s.pop("digest")
        s["sha256"] = sha
    man["copies"] = [c for c in man["copies"] if c["tier"] == "shared"]     # as an old one: files only
    layout.atomic_write_bytes(sdir / layout.MANIFEST, json.dumps(man).encode())
    step, state = eng.load()
    assert step == 5 and eng.last_restore["tier_name"] == "shared"
    assert torch.equal(state["w"], torch.arange(1000.0))
    live = {"w": torch.zeros(1000)}
    assert eng.load(5, into=live)[1]["w"] is live["w"] and torch.equal(live["w"], torch.arange(1000.0))
    flip_bit(sdir / layout.shard_name(0))
    with pytest.raises(Exception, match="digest mismatch \\(sha256\\)"):
        eng.load(5)


def test_shard_contract_takes_a_digest_or_an_old_sha256():
    new = contracts.Shard.from_dict({"rank": 0, "name": "a", "size": 1, "digest": "xxh3-128/c16:ab"})
    assert new.checksum == "xxh3-128/c16:ab"
    old = contracts.Shard.from_dict({"rank": 0, "name": "a", "size": 1, "sha256": "ab" * 32})
    assert old.checksum == "sha256:" + "ab" * 32
    with pytest.raises(contracts.ContractError, match="needs a 'digest'"):
        contracts.Shard.from_dict({"rank": 0, "name": "a", "size": 1})


# --------------------------------------------------------------------------- transport

def test_auto_transport_is_rdma_only_with_an_active_port(tmp_path):
    ib = tmp_path / "infiniband"
    assert detect_protocol(str(ib)) == "tcp"
    port = ib / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("1: DOWN\n")
    assert detect_protocol(str(ib)) == "tcp"
    rep, ep = make_replicator("auto", "127.0.0.1", ib_root=str(ib))
    assert isinstance(rep, TcpReplicator) and ep is None
    (port / "state").write_text("4: ACTIVE\n")
    assert detect_protocol(str(ib)) == "rdma"


# --------------------------------------------------------------------------- authentication

def test_daemons_with_a_secret_refuse_unauthenticated_clients_and_serve_authenticated_ones(
        tmp_path, monkeypatch):
    import socket as socketlib

    from transom.checkpoint import DaemonError, segments
    from transom.checkpoint.wire import Conn, recv_msg, send_msg

    secret = tmp_path / "secret"
    secret.write_text("s3cret-" + uuid.uuid4().hex + "\n")
    monkeypatch.setenv("TRANSOM_CKPT_SECRET_FILE", str(secret))
    c = Cluster(tmp_path, ["node0", "node1"], transport="tcp")
    try:
        for mode in ("copy", "fork"):        # the fork child uses a connection its parent authenticated
            eng = c.engine(tmp_path / mode, f"job-{uuid.uuid4().hex[:8]}", 0, 1, "node0", snapshot=mode)
            eng.save(3, {"w": torch.arange(50_000.0)})
            eng.wait()
            assert eng.last_result["committed"] and len(eng.last_result["copies"]) >= 3, eng.last_result
            assert any(cp["node"] == "node1" for cp in eng.last_result["copies"]), "replicated to node1"
        addr = segments.registered(c.runtime)["node0"]["addr"]
        with pytest.raises(DaemonError, match="requires authentication: set TRANSOM_CKPT_SECRET"):
            Conn(addr, key=None)
        with pytest.raises(DaemonError, match="refused this client: authentication failed"):
            Conn(addr, key=b"not-the-secret-at-all")
        host, port = addr.rsplit(":", 1)
        with socketlib.create_connection((host, int(port)), timeout=10) as s:     # a client of old
            assert recv_msg(s)["auth"] == "hmac-sha256"
            send_msg(s, {"op": "forget", "job": "anything"})
            assert "authentication required" in recv_msg(s)["error"]
            assert recv_msg(s) is None, "the daemon closed the connection"
        log = c.log("node0")
        assert "connections authenticated (TRANSOM_CKPT_SECRET)" in log
        assert "refused a connection from 127.0.0.1:" in log and "unauthenticated request 'forget'" in log
        assert "wrong secret (HMAC does not verify)" in log
        monkeypatch.delenv("TRANSOM_CKPT_SECRET_FILE")
        monkeypatch.setenv("TRANSOM_CKPT_SECRET", "short")
        from transom.config import ConfigError
        with pytest.raises(ConfigError, match="at least 16"):
            Conn(addr)
    finally:
        c.close()


# --------------------------------------------------------------------------- save at the fault

_RANK = """
import sys, time, torch
from transom.checkpoint import CheckpointEngine
eng = CheckpointEngine(sys.argv[1], sys.argv[2], 0, 1, "node0", runtime=sys.argv[3], stop_grace=60)
eng.save(7, {"w": torch.arange(100_000.0)})
print("saved", flush=True)
while True:
    time.sleep(0.05)            # training goes on until the controller stops the rank
"""


def test_a_stopped_rank_and_its_daemon_finish_and_persist_the_in_flight_save(tmp_path, monkeypatch):
    import signal
    import subprocess
    import sys

    from transom.checkpoint import complete_steps, store

    from util import wait_until

    monkeypatch.setenv("TRANSOM_CKPT_TEST_DELAY_S", "1.5")     # the save is surely in flight at the stop
    c = Cluster(tmp_path, ["node0", "node1"], transport="tcp")
    ckpt, job = tmp_path / "ckpt", f"job-{uuid.uuid4().hex[:8]}"
    rank = subprocess.Popen([sys.executable, "-c", _RANK, str(ckpt), job, str(c.runtime)], env=c.env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert rank.stdout.readline().strip() == "saved", "the rank's first line"
        rank.send_signal(signal.SIGTERM)                   # the controller stops the rank and the node
        c.signal("node0", signal.SIGTERM)
        out, _ = rank.communicate(timeout=60)
        assert rank.returncode == -signal.SIGTERM, out
        assert "stopped (signal 15): the save of step 7 is committed" in out, out
        c.procs["node0"].wait(60)
        assert complete_steps(ckpt) == [7]
        man = layout.read_manifest(step_dir(ckpt, 7))
        state = store.read_shard(step_dir(ckpt, 7), man.shards[0])
        assert torch.equal(state["w"], torch.arange(100_000.0))
        wait_until(lambda: "staged save(s) persisted" in c.log("node0") or None, 10, "the daemon's drain line")
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
        c.close()


# --------------------------------------------------------------------------- DTensor state

def _dtensor_rank(rank: int, world: int, phase: str, root: str, job: str, runtime: str, q) -> None:
    """One rank of an FSDP2 job on a gloo CPU mesh. Phase "save": train one step, save it, then
    build the model afresh (other weights) and load the step into it. Phase "load": only the
    latter. Reports the full tensors (bytes) as saved and as loaded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from transom.checkpoint import CheckpointEngine

    def build(mesh, seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 12))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        torch.manual_seed(rank)
        model(torch.randn(8, 24)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    def full(model, opt) -> dict:
        out = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
        for i, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                out[f"optim.{i}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
        return {k: v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() for k, v in out.items()}

    try:
        dist.init_process_group("gloo", init_method=f"file://{root}/pg-{phase}-{world}", rank=rank,
                                world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        eng = CheckpointEngine(f"{root}/ckpt", job, rank, world, f"node{rank % 3}", runtime=runtime)
        saved = None
        if phase == "save":
            model, opt = build(mesh, 0)
            eng.save(1, {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3})
            eng.wait()
            saved = full(model, opt)
        model, opt = build(mesh, 1234)                   # the load starts from other weights
        step, state = eng.load(template={"model": model.state_dict(), "optim": opt.state_dict()})
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        assert step == 1 and state["epoch"] == 3
        eng.close()
        q.put((rank, (saved, full(model, opt))))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        q.put((rank, f"{exc!r}\n{traceback.format_exc()}"))


def _run_ranks(world: int, phase: str, root: Path, job: str, runtime: Path) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.fsdp"])
    q = ctx.Queue()
    procs = [ctx.Process(target=_dtensor_rank, args=(r, world, phase, str(root), job, str(runtime), q))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    bad = {r: v for r, v in got.items() if isinstance(v, str)}
    assert not bad, bad
    return got


@pytest.mark.e2e          # 7 gloo ranks over two process groups: 60-97 s on the loaded 2-core host
def test_fsdp2_model_and_optimizer_saved_on_4_ranks_load_bit_for_bit_on_4_and_reshard_onto_3(tmp_path, cluster):
    job = f"job-{uuid.uuid4().hex[:8]}"
    four = _run_ranks(4, "save", tmp_path, job, cluster.runtime)
    ref = four[0][0]
    assert all(saved == ref for saved, _ in four.values()), "full tensors agree on every rank"
    assert any(k.startswith("optim.") and k.endswith("exp_avg") for k in ref)
    three = _run_ranks(3, "load", tmp_path, job, cluster.runtime)
    for world, got in ((4, four), (3, three)):
        for r, (_, full) in got.items():
            assert full.keys() == ref.keys()
            diff = [k for k in ref if full[k] != ref[k]]
            assert not diff, f"world {world} rank {r}: {diff} differ from what 4 ranks saved"


# --------------------------------------------------------------------------- a broken byte stream

def test_a_peer_that_breaks_off_or_stalls_mid_shard_is_left_for_the_next_copy(tmp_path, monkeypatch):
    """A peer daemon that fails after announcing a shard hangs up (the reader sees a short stream,
    not a reply read as bytes); one that stops sending is given up after STALL_S; the restore then
    uses the next copy. In-process daemons, so their send can be broken."""
    import threading

    from transom.checkpoint import CheckpointEngine
    from transom.checkpoint import engine as eng_mod
    from transom.checkpoint import server as srv_mod
    from transom.checkpoint.server import CheckpointServer

    runtime = tmp_path / "rt"
    servers = [CheckpointServer(n, runtime, disk_dir=str(tmp_path / "disk"), host="127.0.0.1", transport="tcp").start()
               for n in ("node0", "node1")]
    release, calls = threading.Event(), []
    real = srv_mod.send_view

    def broken(sock, view, piece=8 << 20):
        calls.append(len(view))
        real(sock, view[:len(view) // 2])
        if len(calls) == 1:
            raise OSError("disk on fire")        # the replica holder fails mid-stream
        release.wait(30)                         # the writer stalls mid-stream

    try:
        eng = CheckpointEngine(tmp_path / "ckpt", "j-broken", 0, 1, "node0", runtime=runtime, disk=False)
        state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
        eng.save(1, state)
        eng.wait()
        eng.close()
        monkeypatch.setattr(srv_mod, "send_view", broken)
        monkeypatch.setattr(eng_mod, "STALL_S", 1.0)
        other = CheckpointEngine(tmp_path / "ckpt", "j-broken", 0, 1, "node2", runtime=runtime, disk=False)
        try:
            step, got = other.load()
        finally:
            release.set()
            other.close()
        assert step == 1 and torch.equal(got["w"], state["w"])
        assert len(calls) == 2 and other.last_restore["tier_name"] == "shared", (calls, other.last_restore)
    finally:
        release.set()
        for s in servers:
            s.close()


# --------------------------------------------------------------------------- restore into existing tensors

def _model_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(9 << 20, generator=g),                 # 36 MiB: three chunks
                      "b": torch.randn(7, 3, generator=g).to(torch.bfloat16),
                      "n": torch.tensor(seed, dtype=torch.int64)},
            "optimizer": {"state": {0: {"exp_avg": torch.randn(1000, generator=g)}},
                          "param_groups": [{"lr": 0.1 * seed, "params": [0]}]},
            "rng": torch.get_rng_state(), "step": seed}


def test_load_into_existing_tensors_from_a_peer_is_bit_equal_and_fills_them_in_place(tmp_path, cluster):
    saver = one(cluster, tmp_path)
    saved = _model_state(3)
    saver.save(7, saved)
    saver.wait()
    relaunched = cluster.engine(tmp_path, saver.job, 0, 1, "node2")        # holds no copy: a peer's memory
    live = _model_state(4)                                                  # a rank whose model is built
    ptrs = {k: t.data_ptr() for k, t in live["model"].items()}
    step, got = relaunched.load(into={"model": live["model"], "optimizer": {}})
    assert step == 7 and relaunched.last_restore["tier_name"] == "peer-memory"
    assert all(got["model"][k] is live["model"][k] and live["model"][k].data_ptr() == ptrs[k] for k in ptrs)
    assert relaunched.last_restore["into_bytes"] == sum(t.numel() * t.element_size() for t in live["model"].values())
    for k in ("w", "b", "n"):
        assert torch.equal(live["model"][k], saved["model"][k]) and live["model"][k].dtype == saved["model"][k].dtype
    assert torch.equal(got["optimizer"]["state"][0]["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"])
    assert got["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"] and got["step"] == 3
    assert torch.equal(got["rng"], saved["rng"])
    # a daemon that sends no chunk digests (an older one): the shard is verified whole, then laid in place
    from transom.checkpoint import restore

    real_send = restore.send_msg
    restore.send_msg = lambda sock, msg: real_send(sock, {k: v for k, v in msg.items() if k != "chunks"})
    try:
        live = _model_state(8)
        _, got = relaunched.load(7, into=live)
    finally:
        restore.send_msg = real_send
    assert relaunched.last_restore["tier_name"] == "peer-memory" and got["model"]["w"] is live["model"]["w"]
    assert torch.equal(live["model"]["w"], saved["model"]["w"])
    # a template that does not match (shape, dtype) gets tensors of its own; the caller's stay as they were
    odd = {"model": {"w": torch.zeros(5), "b": torch.zeros(7, 3)}}
    _, got = relaunched.load(7, into=odd)
    assert torch.equal(odd["model"]["w"], torch.zeros(5)) and torch.equal(got["model"]["w"], saved["model"]["w"])
    assert got["model"]["b"].dtype == torch.bfloat16 and torch.equal(odd["model"]["b"], torch.zeros(7, 3))


def test_a_corrupt_chunk_refuses_the_copy_loaded_into_and_the_next_copy_is_used(tmp_path, cluster, caplog):
    import logging

    from transom.checkpoint import restore

    saver = one(cluster, tmp_path, disk=False, shared=False)             # memory copies only
    saved = _model_state(5)
    saver.save(9, saved)
    saver.wait()
    copies = copies_of(tmp_path, 9)
    relaunched = cluster.engine(tmp_path, saver.job, 0, 1, "node2")
    placed: list[tuple[int, int]] = []
    real_put = restore.Scatter.put

    def spy(self, lo, piece):
        placed.append((lo, len(piece)))
        return real_put(self, lo, piece)

    real_recv, calls = restore.recv_exact_into, []

    def torn(sock, mv, on_chunk=None):          # the replica's second chunk is damaged on the way
        real_recv(sock, mv, on_chunk)
        calls.append(len(mv))
        if len(calls) == 2:
            mv[100] ^= 0x10

    restore.Scatter.put = spy
    restore.recv_exact_into = torn
    try:
        live = _model_state(6)
        with caplog.at_level(logging.WARNING, logger="transom.checkpoint"):
            step, got = relaunched.load(into=live)
        assert step == 9 and relaunched.last_restore["node"] == "node0"      # the writer's memory, next
        assert any("chunk 1" in r.getMessage() and "node1" in r.getMessage() for r in caplog.records)
        assert placed[0] == (0, CHUNK) and placed[1] == (0, CHUNK)          # node1's chunk 0, then node0's
        assert torch.equal(live["model"]["w"], saved["model"]["w"]) and got["model"]["w"] is live["model"]["w"]
        for k in ("b", "n"):              # small tensors: staged behind the big one, copied once verified
            assert torch.equal(got["model"][k], saved["model"][k])
        assert torch.equal(got["optimizer"]["state"][0]["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"])
        restore.recv_exact_into = real_recv
        # a copy whose memory is damaged after it was hashed: refused at that chunk, the next copy used
        flip_bit(Path(copies[("memory", "node1")]), at=CHUNK + 100)
        # every copy refused at its first chunk: the tensors loaded into are left as they were
        placed.clear()
        step, got = relaunched.load(into=live)
        assert relaunched.last_restore["node"] == "node0" and placed[0] == (0, CHUNK)
        # every copy refused past the header: load raises, and says the tensors were written into
        flip_bit(Path(copies[("memory", "node0")]), at=2 * CHUNK + 100)
        with pytest.raises(Exception, match="no copy verifies"):
            relaunched.load(9, into=_model_state(6))
        assert relaunched.into_touched
        flip_bit(Path(copies[("memory", "node0")]), at=2 * CHUNK + 100)      # node0's copy whole again
        # every copy refused: the tensors loaded into are left as they were
        flip_bit(Path(copies[("memory", "node0")]), at=100)                  # both refused at their first chunk
        flip_bit(Path(copies[("memory", "node1")]), at=200)
        live = _model_state(6)
        before = {k: t.clone() for k, t in live["model"].items()}
        with pytest.raises(Exception, match="no copy verifies"):
            relaunched.load(9, into=live)
        assert all(torch.equal(live["model"][k], before[k]) for k in before)
    finally:
        restore.Scatter.put = real_put
        restore.recv_exact_into = real_recv
