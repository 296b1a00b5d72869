"""TCE daemons across host boundaries, on one machine: each daemon on its own loopback address
(127.0.0.2, .3, .4) with its own runtime dir (its own "/dev/shm"), so nothing but the service
registry on the real broker can tell one daemon where another is.

- discovery and replication through the registry, advertised addresses that are routable;
- restore from the neighbour's memory after the writer's daemon (its host) is gone;
- writes of a replaced launch (older generation) refused by daemons and by the job directory.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

from transom import contracts, registry
from transom.checkpoint import CheckpointEngine, CheckpointError, complete_steps, store
from transom.checkpoint.errors import StaleGeneration
from transom.checkpoint.server import CheckpointServer
from transom.checkpoint.wire import Conn, DaemonError, recv_msg, send_msg
from transom.contracts import ServiceKind


@pytest.fixture()
def hosts(broker, tmp_path, monkeypatch):
    """start(node, addr) -> a daemon bound to ``addr`` with runtime and disk dirs of its own; all closed after."""
    monkeypatch.setenv("TRANSOM_CLUSTER", f"t-{uuid.uuid4().hex[:8]}")     # this test's daemons only
    monkeypatch.delenv("TRANSOM_ADVERTISE_ADDR", raising=False)
    base = Path("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp") / f"transom-hosts-{uuid.uuid4().hex[:8]}"
    daemons: dict[str, CheckpointServer] = {}
    engines: list[CheckpointEngine] = []

    def start(node: str, addr: str) -> CheckpointServer:
        d = CheckpointServer(node, base / node, disk_dir=str(tmp_path / f"disk-{node}"), host=addr,
                             transport="tcp", bootstrap=broker.bootstrap).start()
        daemons[node] = d
        return d

    def engine(ckpt: Path, job: str, node: str, generation: int = 0, rank: int = 0, world: int = 1):
        eng = CheckpointEngine(ckpt, job, rank, world, node, generation, runtime=base / node, shared=False)
        engines.append(eng)
        return eng

    start.engine = engine
    start.daemons = daemons
    try:
        yield start
    finally:
        for eng in engines:
            try:
                eng.close()
            except CheckpointError:
                pass
        for d in daemons.values():
            if d.tcp.fileno() >= 0:
                d.close()
        import shutil
        shutil.rmtree(base, ignore_errors=True)


def _wait_ring(daemons, timeout=20.0):
    for d in daemons:
        others = {n for n in (x.node for x in daemons) if n != d.node}
        assert d._reader.wait_for(lambda r: others <= set(d.peers()), timeout), \
            f"{d.node} sees {sorted(d.peers())} in the registry, expected {sorted(others)}"


def test_daemons_on_separate_addresses_find_each_other_through_the_registry_and_replicate(hosts, tmp_path):
    a, b = hosts("hostA", "127.0.0.2"), hosts("hostB", "127.0.0.3")
    _wait_ring([a, b])
    assert a.ring()[0]["addr"] == b.addr == f"127.0.0.3:{b.port}"                    # advertised = routable
    regs = registry.read_registry(a.bootstrap).live(ServiceKind.CKPT_DAEMON)
    assert {n: r.addr for n, r in regs.items()} == {"hostA": "127.0.0.2", "hostB": "127.0.0.3"}
    eng = hosts.engine(tmp_path / "ckpt", "job-h1", "hostA")
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    eng.save(1, state)
    eng.wait()
    mem = {c["node"]: c["location"] for c in eng.last_result["copies"] if c["tier"] == "memory"}
    assert set(mem) == {"hostA", "hostB"} and mem["hostB"].startswith(f"127.0.0.3:{b.port}#")
    assert not any("0.0.0.0" in loc for loc in mem.values())
    replica = [s for s in b._op_stats(None, {})["slots"] if s["kind"] == "replica" and s["state"] == "held"]
    assert [(s["job"], s["step"], s["origin"]) for s in replica] == [("job-h1", 1, "hostA")]


def test_restore_from_the_neighbours_memory_when_the_writers_host_is_gone(hosts, tmp_path):
    a, b, c = hosts("hostA", "127.0.0.2"), hosts("hostB", "127.0.0.3"), hosts("hostC", "127.0.0.4")
    _wait_ring([a, b, c])
    ckpt = tmp_path / "ckpt"
    writer = hosts.engine(ckpt, "job-h2", "hostA")
    state = {"w": torch.randn(4096)}
    writer.save(7, state)
    writer.wait()
    assert complete_steps(ckpt) == [7]
    writer.close()
    a.close()                # host A lost: its daemon, its memory (segments unlinked) and its disk dir
    import shutil
    shutil.rmtree(a.disk_dir, ignore_errors=True)
    assert c._reader.wait_for(lambda r: "hostA" not in c.peers(), 20)
    # the rank now runs on host C: no local copy, A is gone, B holds the replica
    eng = hosts.engine(ckpt, "job-h2", "hostC")
    step, got = eng.load()
    assert step == 7 and torch.equal(got["w"], state["w"])
    assert (eng.last_restore["tier_name"], eng.last_restore["node"]) == ("peer-memory", "hostB")


def _lose(daemon: CheckpointServer) -> None:
    """The daemon's host dies: no tombstone, its registry entry stays live until its TTL."""
    daemon._writer.stop(clean=False)
    daemon._writer = None
    daemon.close()


def test_a_replica_goes_round_the_ring_when_the_neighbour_is_gone(hosts, tmp_path):
    a, b, c = hosts("hostA", "127.0.0.2"), hosts("hostB", "127.0.0.3"), hosts("hostC", "127.0.0.4")
    _wait_ring([a, b, c])
    _lose(b)                                                   # A's neighbour, still "live" in the registry
    assert [p["node"] for p in a.ring()] == ["hostB", "hostC"]
    ckpt = tmp_path / "ckpt"
    eng = hosts.engine(ckpt, "job-h4", "hostA")
    eng.save(1, {"w": torch.ones(256)})
    eng.wait()
    assert {c["node"] for c in eng.last_result["copies"] if c["tier"] == "memory"} == {"hostA", "hostC"}
    _lose(c)                                                   # no peer answers now: commit without one
    eng.save(2, {"w": torch.ones(256)})
    eng.wait()
    assert eng.last_result["committed"] and complete_steps(ckpt) == [1, 2]
    from transom.checkpoint.layout import read_manifest, step_dir
    assert not read_manifest(step_dir(ckpt, 2)).replicated


def test_writes_of_an_older_generation_are_refused(hosts, tmp_path):
    a, b, c = hosts("hostA", "127.0.0.2"), hosts("hostB", "127.0.0.3"), hosts("hostC", "127.0.0.4")
    _wait_ring([a, b, c])
    ckpt, job = tmp_path / "ckpt", "job-h3"
    new = hosts.engine(ckpt, job, "hostB", generation=2)        # the relaunched generation, on host B
    new.save(10, {"w": torch.ones(64)})                         # (replicated to C)
    new.wait()
    assert store.newest_generation(ckpt, job) == 2
    # host A was cut off during the relaunch: its daemon never saw generation 2, its rank still runs
    assert "job-h3" not in a.generations
    old = hosts.engine(ckpt, job, "hostA", generation=1)
    old.save(11, {"w": torch.zeros(64)})                       # A's daemon takes it; the job directory refuses
    with pytest.raises(CheckpointError, match="stale generation"):
        old.wait()
    assert a.generations[job] == 2
    assert not [s for s in b._op_stats(None, {})["slots"] if s["step"] == 11]      # never replicated
    assert not [s for s in a._op_stats(None, {})["slots"] if s["step"] == 11 and s["state"] != "free"]
    assert complete_steps(ckpt) == [10]
    assert not (ckpt / "step-00000011").exists() or not any((ckpt / "step-00000011").glob("rank-*.json"))
    # A's daemon has learnt generation 2 now: the stale rank's next save is refused at once
    with pytest.raises(DaemonError, match="stale generation"):
        old.save(12, {"w": torch.zeros(64)})
    # a replica stamped with the old generation is refused by B, and the refusal reaches the sender
    conn = Conn(b.addr)
    try:
        send_msg(conn.sock, {"op": "replica_put", "job": job, "rank": 0, "step": 13, "size": 3, "digest": "sha256:" + "0" * 64,
                             "origin": "hostA", "generation": 1})
        conn.sock.sendall(b"abc")
        reply = recv_msg(conn.sock)
    finally:
        conn.close()
    assert "stale generation" in reply["error"] and "generation 2" in reply["error"]
    # the generation record itself
    with pytest.raises(StaleGeneration, match="generation 1, but generation 2"):
        store.claim_generation(ckpt, job, 1)
    assert store.claim_generation(ckpt, job, 3) == 3
    assert store.claim_generation(ckpt, "another-job", 0) == 0       # another job may reuse the directory


def test_one_host_mode_needs_no_broker(tmp_path, monkeypatch):
    """Without a broker the daemons of one runtime dir find each other there, on loopback."""
    monkeypatch.delenv("TRANSOM_ADVERTISE_ADDR", raising=False)
    runtime = Path("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp") / f"transom-one-{uuid.uuid4().hex[:8]}"
    a = CheckpointServer("n0", runtime, disk_dir=str(tmp_path), host="0.0.0.0", transport="tcp").start()
    b = CheckpointServer("n1", runtime, disk_dir=str(tmp_path), transport="tcp").start()
    try:
        assert a.addr.startswith("127.0.0.1:")              # a wildcard bind advertises loopback, never 0.0.0.0
        assert [p["node"] for p in a.ring()] == ["n1"] and [p["node"] for p in b.ring()] == ["n0"]
        assert a._op_resolve(None, {"node": "n1"}) == {"addr": b.addr, "source": "runtime", "live": True}
    finally:
        a.close()
        b.close()
        import shutil
        shutil.rmtree(runtime, ignore_errors=True)


def test_ring_order():
    from transom.checkpoint.segments import ring
    peers = {n: {"node": n} for n in ("a", "b", "d")}
    assert [p["node"] for p in ring(peers, "c")] == ["d", "a", "b"]
    assert [p["node"] for p in ring({**peers, "c": {"node": "c"}}, "d")] == ["a", "b", "c"]
    assert ring({}, "a") == []
    assert contracts.REGISTRY in {t.name for t in contracts.TOPICS}


# --------------------------------------------------------------------------- on the test bed

_SAVE = """
import json, sys, torch
from transom.checkpoint import CheckpointEngine
ckpt, job, node = sys.argv[1:4]
eng = CheckpointEngine(ckpt, job, 0, 1, node, 0, shared=False)
eng.save(5, {"w": torch.arange(1 << 16, dtype=torch.float32)})
eng.wait()
print(json.dumps(eng.last_result["copies"]), flush=True)
eng.close()
"""

_LOAD = """
import json, sys, torch
from transom.checkpoint import CheckpointEngine
ckpt, job, node = sys.argv[1:4]
eng = CheckpointEngine(ckpt, job, 0, 1, node, 1, shared=False)
step, state = eng.load()
ok = bool(torch.equal(state["w"], torch.arange(1 << 16, dtype=torch.float32)))
print(json.dumps({"step": step, "ok": ok, **eng.last_restore}), flush=True)
eng.close()
"""


_STALE = """
import json, sys, torch
from transom.checkpoint import CheckpointEngine, CheckpointError
ckpt, job, node = sys.argv[1:4]
eng = CheckpointEngine(ckpt, job, 0, 1, node, 0, shared=False)     # generation 0: the replaced launch
try:
    eng.save(6, {"w": torch.zeros(1 << 16)})
    eng.wait()
    print(json.dumps({"refused": None}), flush=True)
except CheckpointError as exc:
    print(json.dumps({"refused": str(exc)}), flush=True)
"""


def _run_py(bed, host, code, *args, timeout=120):
    import json
    import subprocess

    p = bed.python(host, ["-c", code, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    assert p.returncode == 0, f"{host}: exit {p.returncode}\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.e2e
def test_on_the_bed_a_killed_hosts_shard_is_restored_from_its_neighbours_memory(bed, tmp_path, monkeypatch):
    """Three hosts (own network, PID space, /tmp and /dev/shm), a TCE daemon on each listening where it
    chooses by default (its interface to the broker) and finding the others through the registry on a
    broker only the bed's network reaches. Host
    node0 saves; node0 is killed (processes, memory, disk gone); a rank on node2 restores node0's
    shard from node1's memory over the bed's network (generation 1). Then node1 is partitioned and
    healed, and a rank of generation 0 on it saves: refused as a stale generation."""
    import subprocess

    from transom.broker import EmbeddedBroker

    b = bed(["node0", "node1", "node2"], share=[tmp_path])
    monkeypatch.setenv("TRANSOM_CLUSTER", f"bed-{uuid.uuid4().hex[:8]}")
    monkeypatch.delenv("TRANSOM_ADVERTISE_ADDR", raising=False)
    monkeypatch.delenv("TRANSOM_CKPT_RUNTIME", raising=False)
    monkeypatch.delenv("TRANSOM_CKPT_LOCAL_DIR", raising=False)
    with EmbeddedBroker(host=b.root_addr, log_path=str(tmp_path / "broker.log")) as broker:
        # the stack's broker, as Transom's launchers give it to ranks: it keys the runtime directory in
        # which a rank finds its host's daemon (segments.stack_tag)
        monkeypatch.setenv("TRANSOM_BOOTSTRAP", broker.bootstrap)
        daemons = {h: b.python(h, ["-m", "transom.cli", "ckpt-server", "--node", h,      # no --host: the default
                                   "--bootstrap", broker.bootstrap, "--transport", "tcp"],
                               stdout=open(tmp_path / f"daemon-{h}.log", "wb"), stderr=subprocess.STDOUT)
                   for h in ("node0", "node1", "node2")}
        try:
            with registry.RegistryReader(broker.bootstrap).start() as reader:
                live = reader.wait_for(lambda r: len(r.live(ServiceKind.CKPT_DAEMON)) == 3 and
                                       r.live(ServiceKind.CKPT_DAEMON), 60)
                assert live, "the three daemons did not register: " + \
                    " | ".join((tmp_path / f"daemon-{h}.log").read_text()[-500:] for h in daemons)
                # each advertises its own bed address (its route to the broker), never 0.0.0.0
                assert {n: r.addr for n, r in live.items()} == {h: b.addr(h) for h in daemons}
                assert {r.host for r in live.values()} == set(daemons)       # three hostnames
            ckpt = tmp_path / "ckpt"
            copies = _run_py(b, "node0", _SAVE, ckpt, "job-bed", "node0")
            mem = {c["node"]: c["location"] for c in copies if c["tier"] == "memory"}
            assert set(mem) == {"node0", "node1"}
            assert mem["node1"].startswith(b.addr("node1") + ":")           # replicated over the bed's network
            b.kill("node0")                                                 # processes, /dev/shm, /tmp: gone
            got = _run_py(b, "node2", _LOAD, ckpt, "job-bed", "node2")
            assert got["ok"] and got["step"] == 5
            assert (got["tier_name"], got["node"]) == ("peer-memory", "node1")
            # node1 was cut off while generation 1 started; when its link returns, a rank of generation 0
            # on it saves: refused, nothing of it reaches the job's checkpoints
            b.partition("node1")
            b.heal("node1")
            stale = _run_py(b, "node1", _STALE, ckpt, "job-bed", "node1")
            assert stale["refused"] and "stale generation" in stale["refused"]
            assert complete_steps(ckpt) == [5] and store.newest_generation(ckpt, "job-bed") == 1
        finally:
            for h, p in daemons.items():
                if h != "node0" and p.poll() is None:
                    p.terminate()
            for h, p in daemons.items():
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
