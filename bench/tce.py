"""bench/tce: the checkpoint engine against the physical limits of the path its bytes take.

For each state size (default 1 GiB of float32 tensors, 64 MiB each), in one run, every figure a
ratio of two times measured in this run:

- **training time lost per save**, default snapshot mode: a training loop (one in-place update of
  every tensor per step, what an optimizer step does to the weights) steps through a save until
  the checkpoint is ready (hashed, in the neighbour's memory, on local disk, committed); the same
  number of steps without a save is subtracted. It counts the blocking stall and the slowdown of
  the steps that run while copy-on-write faults, hashing, replication and persistence happen.
  Target: at most 1.5x a plain copy of the same bytes into warm memory, and at least 10x below
  the blocking time of ``torch.distributed.checkpoint.async_save`` and of a durable synchronous
  save (``torch.save`` then fsync). The product's default snapshot mode (``copy``, or
  ``TRANSOM_CKPT_SNAPSHOT`` when set) is graded; the other mode is measured the same way (its own
  row, and ``least_lost_mode`` says which lost less). The daemons run as the product runs them: at
  ``TRANSOM_SERVICE_PRIORITY`` (default ``batch:10``, :mod:`transom.priority`; ``--services-priority``).
- **replication**: the daemons' replica of node0's shard into node1's memory (connect, the bytes,
  the receiver's digest check and answer; the daemons' default transport, ``auto``), at least 0.8x
  a raw loopback socket sending the same bytes over one connection in the same run. Both run
  alone (the replica: saves with ``disk=False`` and no training loop); the replica's transfer
  beside the training loop and the disk write is an info row.

Every time is the best of ``--repeat`` runs (raw socket, disk write, saves, restores alike: the
host is shared and noisy), after ``--warm`` saves that bring the daemons to their steady state
(segments allocated once and reused).
- **save to ready**: at most 2x the slowest stage measured alone (the raw socket transfer; a disk
  write of the bytes with fsync into the daemon's disk directory).
- **peer restore** of the shard from a neighbour's memory on a node that holds no copy, its digest
  verified, as a relaunched rank calls it: its model built (the state's tensors exist), then
  ``load(into=state)`` lays the verified bytes into them (transom/examples/train_lm.py): at least
  0.8x the raw socket transfer, and at least 2x faster than ``torch.load`` of the
  same state from a file whose pages were dropped from the page cache (fsync, then
  ``posix_fadvise(DONTNEED)``): the read a relaunched rank does without Transom. An info row
  receives the raw socket into new memory, as a plain ``load()`` does (the kernel faults in and
  zeroes its pages while the bytes arrive); another restores with a plain ``load()``.

With ``--cuda GIB`` (a GPU host) a state of that size on the GPU is saved in copy mode: ``save()``'s
blocking time with the engine's default (its segment page-locked for CUDA, ``pin_memory``) and with
``pin_memory=False``, beside the physical limit, a device-to-host copy of the same tensors into
torch's pinned memory; the training time lost per save by a loop of in-place updates on the GPU
(each step waits for the device) stepping through a save until it is ready, and the blocking time
of DCP ``async_save`` and of a durable ``torch.save`` of the same GPU state: ratios as the targets
above, printed as information (the graded rows are the CPU state's).

Three ``transom ckpt-server`` daemons run as processes (node0 saves, node1 is its neighbour,
node2 restores). Big buffers are freed between cases (the host has other users). Prints a table,
then one JSON line with the figures, the targets and whether each is met.

    python bench/tce.py [--sizes 1,4] [--transport auto|mooncake|tcp] [--services-priority batch:10]
    python bench/tce.py --quick                  # 0.25 GiB, 3 repeats, no sharded part: about 2 minutes
    python bench/tce.py --hosts [--sizes 1]      # on three test-bed hosts (root, namespaces)

With ``--hosts`` the same figures come from three hosts of the test bed (:mod:`transom.testbed`):
node0 saves (its replica goes to node1 over the bed's bridge, the raw link is node0 -> node1),
node2 restores from node1's memory and ``torch.load``s the shared file; the daemons find each
other through the registry on a broker only the bed reaches.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from transom.checkpoint import CheckpointEngine, segments
from transom.checkpoint.wire import Conn

GiB = 1 << 30
#: the snapshot mode the product uses by default (what CheckpointEngine.from_env picks), graded by the targets
DEFAULT_MODE = os.environ.get("TRANSOM_CKPT_SNAPSHOT") or \
    inspect.signature(CheckpointEngine).parameters["snapshot"].default.value
TARGETS = {"lost_per_save_vs_plain_copy": ("<=", 1.5), "async_save_vs_lost_per_save": (">=", 10.0),
           "durable_save_vs_lost_per_save": (">=", 10.0), "replication_vs_raw_socket": (">=", 0.8),
           "ready_vs_slowest_stage": ("<=", 2.0), "peer_restore_vs_raw_socket": (">=", 0.8),
           "cold_torch_load_vs_peer_restore": (">=", 2.0)}
MODES = (DEFAULT_MODE, *(m for m in ("copy", "fork") if m != DEFAULT_MODE))   # default first


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def make_state(nbytes: int, tensor_mib: int) -> dict:
    per = tensor_mib << 20
    return {f"layer{i}.weight": torch.empty(min(per, nbytes - i * per) // 4).fill_(float(i))
            for i in range(-(-nbytes // per))}


def plain_copy(state: dict) -> float:
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    best = float("inf")
    for _ in range(2):                  # the first pass faults the pages in: warm memory after it
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        best = min(best, time.perf_counter() - t0)
    del dst
    return best


def dcp_async_save(state: dict, where: Path) -> float:
    import warnings

    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(where))
        blocked = time.perf_counter() - t0
        fut.result()
    shutil.rmtree(where, ignore_errors=True)
    return blocked


def raw_socket(state: dict, fresh: bool = False) -> float:
    """Seconds to send the state's bytes over one loopback TCP connection to a ``--role sink``
    process (one connection, the kernel's autotuned buffers, 8 MiB ``sendall`` / ``recv_into``, the
    receiver in its own process like a daemon), until it has them all: the link's limit. ``fresh``:
    the sink receives into new memory (:func:`segments.alloc_buffer`, what a restore lands in),
    whose pages the kernel faults in and zeroes while they arrive (an info figure)."""
    sink = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--role", "sink", "--port", "0"],
                            stdout=subprocess.PIPE)
    try:
        port = int(sink.stdout.readline().split()[1])
        return remote_socket(state, f"127.0.0.1:{port}", fresh)
    finally:
        sink.terminate()
        sink.wait(30)


class Daemons:
    def __init__(self, root: Path, transport: str) -> None:
        self.runtime = Path("/dev/shm") / f"transom-bench-{uuid.uuid4().hex[:8]}"
        env = {**os.environ, "TRANSOM_CKPT_RUNTIME": str(self.runtime)}
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "transom.cli", "ckpt-server", "--node", f"node{i}", "--disk-dir",
             str(root / "local"), "--transport", transport], env=env,
            stdout=open(root / f"daemon{i}.log", "ab"), stderr=subprocess.STDOUT) for i in range(3)]
        deadline = time.monotonic() + 120
        while len(segments.registered(self.runtime)) < 3:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.close()
                raise SystemExit(f"the TCE daemons did not start: see {root}/daemon*.log")
            time.sleep(0.1)
        self.transport = segments.registered(self.runtime)["node0"]["transport"]

    def cpu(self) -> float:
        """CPU seconds (user + system) the daemons have used so far."""
        tck, total = os.sysconf("SC_CLK_TCK"), 0.0
        for p in self.procs:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tck
        return total

    def forget(self, job: str) -> None:
        for info in segments.registered(self.runtime).values():
            c = Conn(info["addr"])
            try:
                c.call({"op": "forget", "job": job})
            finally:
                c.close()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.runtime, ignore_errors=True)


def disk_write(state: dict, where: Path) -> float:
    """Seconds to write the state's bytes to ``where`` and fsync them (the persist stage alone)."""
    t0 = time.perf_counter()
    with open(where, "wb") as f:
        for v in state.values():
            f.write(memoryview(v.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    where.unlink()
    return dt


def durable_torch_save(state: dict, where: Path) -> float:
    t0 = time.perf_counter()
    torch.save(state, where)
    fd = os.open(where, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def schedstat() -> tuple[float, float]:
    """Seconds this thread has run on a CPU and waited in a run queue (``/proc/thread-self/schedstat``)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on, wait = f.read().split()[:2]
        return int(on) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def steps(state: dict, n: int, sched: list | None = None) -> float:
    c0 = schedstat()
    t0 = time.perf_counter()
    for _ in range(n):
        inplace_update(state)
    dt = time.perf_counter() - t0
    if sched is not None:
        c1 = schedstat()
        sched.append((dt, c1[0] - c0[0], c1[1] - c0[1]))
    return dt


def loop_through_save(state: dict, eng: CheckpointEngine, step: int, save_at: int = 2, daemons_cpu=None) -> dict:
    """Train (in-place updates) through one save until the checkpoint is ready and one step more;
    the same number of steps without a save is subtracted (the best of the loop right before the
    save and twice after it). Where the lost time went (info): the training thread's extra time on
    a CPU (the stall's copy, slower steps: memory bandwidth, caches) and its extra wait in a run
    queue (cores taken by the daemons or by anything else on the host), against the baseline."""
    sched: list = []
    before = steps(state, 8, sched)
    d0 = daemons_cpu() if daemons_cpu else 0.0
    c0 = schedstat()
    n, t0, ready, saved, stall = 0, time.perf_counter(), None, None, 0.0
    while True:
        if n == save_at:
            saved = time.perf_counter()
            eng.save(step, state)
            stall = time.perf_counter() - saved
        inplace_update(state)
        n += 1
        if saved is not None and not eng.in_flight():
            ready = time.perf_counter() - saved
            break
    inplace_update(state)
    n += 1
    total = time.perf_counter() - t0
    c1 = schedstat()
    eng.wait()
    daemons_s = daemons_cpu() - d0 if daemons_cpu else None
    base = min(before / 8 * n, steps(state, n, sched), steps(state, n, sched))
    best = min(sched, key=lambda x: x[0] / (8 if x is sched[0] else n))
    k = n / (8 if best is sched[0] else n)
    return {"steps": n, "loop_s": total, "base_s": base, "lost_s": max(total - base, 1e-9), "stall_s": stall,
            "ready_s": ready, "extra_cpu_s": (c1[0] - c0[0]) - best[1] * k,
            "extra_runq_wait_s": (c1[1] - c0[1]) - best[2] * k, "daemons_cpu_s": daemons_s}


def replication_alone(state: dict, ckpt: Path, job: str, args: argparse.Namespace, runtime=None) -> dict:
    """The daemons' replication of node0's shard into node1's memory, nothing else running (no
    training loop, no disk write: the raw socket it is graded against runs alone too): saves with
    ``disk=False``, after ``--warm`` saves (replica segments allocated once, then reused). The
    figure is the sender daemon's wall time of the whole replica (connect, handshake, the bytes,
    the receiver's digest check and answer), through the daemons' own transport (``auto`` unless
    ``--transport`` says otherwise); ``transfer_s`` is the receiver's time for the bytes alone."""
    eng = CheckpointEngine(ckpt, job, 0, 1, "node0", runtime=runtime, disk=False, shared=False)
    eng.reserve(state)
    runs = []
    for step in range(1, max(args.warm, 2) + args.repeat + 1):
        eng.save(step, state)
        eng.wait()
        res = eng.last_result or {}
        if step > max(args.warm, 2):
            runs.append({k: res.get(k) for k in ("replicate_s", "transfer_s")})
    eng.close()
    shutil.rmtree(ckpt, ignore_errors=True)
    if not all(x["replicate_s"] for x in runs):
        raise SystemExit(f"replication alone: a save had no peer copy ({runs}): see the daemons' logs")
    return {"replication_s": min(x["replicate_s"] for x in runs),
            "replication_transfer_s": min(x["transfer_s"] for x in runs), "replication_runs": runs}


def bench_size(nbytes: int, args: argparse.Namespace, daemons: Daemons, root: Path) -> dict:
    r: dict = {"bytes": nbytes}
    state = make_state(nbytes, args.tensor_mib)
    say(f"{nbytes / GiB:g} GiB: plain copy into warm memory")
    r["plain_copy_s"] = plain_copy(state)
    r["update_s"] = inplace_update(state)
    gc.collect()
    say("torch.distributed.checkpoint.async_save")
    r["async_save_block_s"] = dcp_async_save(state, root / "dcp")
    gc.collect()
    say("durable torch.save (then fsync)")
    pt = root / "state.pt"
    r["durable_torch_save_s"] = durable_torch_save(state, pt)
    say("raw loopback socket copy; disk write with fsync")
    r["raw_socket_s"] = min(raw_socket(state) for _ in range(max(args.repeat, 2)))
    r["raw_socket_gbps"] = nbytes / r["raw_socket_s"] / 1e9
    r["raw_socket_fresh_s"] = min(raw_socket(state, fresh=True) for _ in range(max(args.repeat, 2)))
    (root / "local").mkdir(exist_ok=True)
    r["disk_write_s"] = min(disk_write(state, root / "local" / "probe"), disk_write(state, root / "local" / "probe"))

    tag = f"bench-{nbytes >> 20}m-{uuid.uuid4().hex[:6]}"
    say(f"replication alone ({daemons.transport}): node0 -> node1, digest verified on arrival")
    r |= replication_alone(state, root / f"ckpt-{tag}-repl", f"{tag}-repl", args, daemons.runtime)
    daemons.forget(f"{tag}-repl")
    r["replication_gbps"] = nbytes / r["replication_s"] / 1e9
    transfers = []
    for mode in MODES:
        job = f"{tag}-{mode}"
        ckpt = root / f"ckpt-{job}"
        say(f"training loop through a TCE save, {mode} snapshot (replication: {daemons.transport})")
        eng = CheckpointEngine(ckpt, job, 0, 1, "node0", runtime=daemons.runtime, shared=False, snapshot=mode)
        eng.reserve(state)                           # pre-faulted staging memory, before training
        for step in range(1, args.warm + 1):         # the daemons' steady state: slots allocated, reused
            eng.save(step, state)
            eng.wait()
        runs = [loop_through_save(state, eng, args.warm + 1 + i, daemons_cpu=daemons.cpu) for i in range(args.repeat)]
        got = {k: min(x[k] for x in runs) for k in ("lost_s", "stall_s", "ready_s")}   # best of each
        least = min(runs, key=lambda x: x["lost_s"])          # where the least lost went (info)
        got |= {k: least[k] for k in ("extra_cpu_s", "extra_runq_wait_s", "daemons_cpu_s")}
        got |= {"steps": runs[0]["steps"], "runs": [{k: round(v, 4) if isinstance(v, float) else v for k, v in x.items()} for x in runs]}
        assert eng.last_snapshot_mode.value == mode, eng.last_snapshot_mode
        res = eng.last_result or {}
        got["stages"] = {k: round(v, 4) for k, v in res.items() if k.endswith("_s")}
        if res.get("transfer_s"):
            transfers.append(res["transfer_s"])
        r[mode] = got
        eng.close()
        if mode != MODES[-1]:
            daemons.forget(job)
            shutil.rmtree(ckpt, ignore_errors=True)
    r["replication_in_loop_s"] = min(transfers) if transfers else None
    r["default_mode"] = DEFAULT_MODE
    r["least_lost_mode"] = min(MODES, key=lambda m: r[m]["lost_s"])
    del state
    gc.collect()
    say("TCE restore from peer memory (rank moved to node2), digest verified, into the relaunched rank's "
        "built state; then into new memory (info)")
    other = CheckpointEngine(ckpt, job, 0, 1, "node2", runtime=daemons.runtime, shared=False)
    r |= peer_restores(other, nbytes, args)
    other.close()
    daemons.forget(job)
    shutil.rmtree(ckpt, ignore_errors=True)
    say("torch.load of a file whose pages were dropped (fsync, posix_fadvise DONTNEED)")
    cold = []
    for _ in range(args.repeat):
        fd = os.open(pt, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        t0 = time.perf_counter()
        loaded = torch.load(pt, weights_only=True)
        cold.append(time.perf_counter() - t0)
        del loaded
        gc.collect()
    r["torch_load_cold_s"] = min(cold)
    pt.unlink()
    gc.collect()
    grade(r)
    return r


def peer_restores(eng: CheckpointEngine, nbytes: int, args: argparse.Namespace) -> dict:
    """The graded restore as a relaunched rank calls it: its model is built (the state's tensors
    exist, their pages touched), then ``load(into=)`` lays the verified shard into them (what
    transom/examples/train_lm.py does); then, as an info row, ``load()`` into new memory."""
    r: dict = {}
    live = make_state(nbytes, args.tensor_mib)            # the relaunched rank's built model
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        step, restored = eng.load(into=live)
        times.append(time.perf_counter() - t0)
        r["restore_tier"], r["restore_node"] = eng.last_restore["tier_name"], eng.last_restore["node"]
        r["restore_into_bytes"] = eng.last_restore["into_bytes"]
        del restored
    r["peer_restore_s"] = min(times)
    del live
    gc.collect()
    fresh = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        step, restored = eng.load()
        fresh.append(time.perf_counter() - t0)
        del restored
        gc.collect()
    r["peer_restore_new_memory_s"] = min(fresh)
    return r


def inplace_update(state: dict) -> float:
    """Seconds for one in-place update of every tensor (what an optimizer step does to the weights);
    on the GPU the step ends when the device is done, as a loop reading its loss waits for it."""
    t0 = time.perf_counter()
    for v in state.values():
        v.add_(1.0)
    if next(iter(state.values())).is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- --hosts: the test bed

def grade(r: dict) -> dict:
    """The ratios of one size's figures (the same for one host and for the test bed)."""
    d = r[r["default_mode"]]
    slowest = max(r["raw_socket_s"], r["disk_write_s"])
    r["ratios"] = {
        "lost_per_save_vs_plain_copy": d["lost_s"] / r["plain_copy_s"],
        "async_save_vs_lost_per_save": r["async_save_block_s"] / d["lost_s"],
        "durable_save_vs_lost_per_save": r["durable_torch_save_s"] / d["lost_s"],
        "replication_vs_raw_socket": r["raw_socket_s"] / r["replication_s"] if r["replication_s"] else 0.0,
        "ready_vs_slowest_stage": d["ready_s"] / slowest,
        "peer_restore_vs_raw_socket": r["raw_socket_s"] / r["peer_restore_s"],
        "cold_torch_load_vs_peer_restore": r["torch_load_cold_s"] / r["peer_restore_s"],
    }
    r["info_ratios"] = {f"{m}_{k}": v for m in MODES for k, v in (
        ("lost_per_save_vs_plain_copy", r[m]["lost_s"] / r["plain_copy_s"]),
        ("stall_vs_plain_copy", r[m]["stall_s"] / r["plain_copy_s"]),
        ("ready_vs_slowest_stage", r[m]["ready_s"] / slowest))}
    # the wire's share: the replica's bytes alone (receiver side), beside a training loop and the disk
    # write; the restore against a raw socket that also lands in new memory (page faults included)
    if r.get("replication_in_loop_s"):
        r["info_ratios"]["replication_in_loop_vs_raw_socket"] = r["raw_socket_s"] / r["replication_in_loop_s"]
    if r.get("raw_socket_fresh_s"):
        r["info_ratios"]["peer_restore_vs_raw_socket_fresh_memory"] = r["raw_socket_fresh_s"] / r["peer_restore_s"]
    if r.get("peer_restore_new_memory_s"):
        r["info_ratios"]["peer_restore_new_memory_vs_raw_socket_fresh_memory"] = \
            r.get("raw_socket_fresh_s", r["raw_socket_s"]) / r["peer_restore_new_memory_s"]
    return r


def remote_socket(state: dict, addr: str, fresh: bool = False) -> float:
    """Seconds to send the state's bytes to a ``--role sink`` (8 MiB ``sendall`` calls), until it
    has them all; ``fresh``: the sink receives them into new memory instead of its warm ring."""
    total = sum(v.numel() * v.element_size() for v in state.values())
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.sendall(struct.pack(">QB", total, fresh))
    assert s.recv(1) == b"r"                        # the sink's memory is ready
    t0 = time.perf_counter()
    for v in state.values():
        mv = memoryview(v.numpy()).cast("B")
        for lo in range(0, len(mv), 8 << 20):
            s.sendall(mv[lo:lo + (8 << 20)])
    assert s.recv(1) == b"k"
    dt = time.perf_counter() - t0
    s.close()
    return dt


def role_sink(args: argparse.Namespace) -> int:
    """Receive whole connections (8 MiB ``recv_into``) into a warm ring, every page touched
    beforehand, or into new memory when the sender asks, and acknowledge each: the raw link's far end."""
    srv = socket.create_server(("0.0.0.0", args.port))
    ring = memoryview(bytearray(b"\x01") * (512 << 20))
    print(f"listening {srv.getsockname()[1]}", flush=True)
    while True:
        conn, _ = srv.accept()
        head = bytearray(9)
        got = 0
        while got < 9:
            got += conn.recv_into(memoryview(head)[got:])
        total, fresh = struct.unpack(">QB", head)
        buf = memoryview(segments.alloc_buffer(total)) if fresh else ring
        conn.sendall(b"r")
        got = 0
        while got < total:
            k = conn.recv_into(buf[got % len(buf):][: min(8 << 20, total - got)])
            if not k:
                break
            got += k
        conn.sendall(b"k")
        conn.close()
        if fresh:
            buf.release()


def role_saver(args: argparse.Namespace) -> int:
    """On the saving host: the peers, the raw link to the sink host, the training loop through saves."""
    root, nbytes = Path(args.root), int(float(args.size) * GiB)
    r: dict = {"bytes": nbytes}
    state = make_state(nbytes, args.tensor_mib)
    r["plain_copy_s"] = plain_copy(state)
    r["update_s"] = inplace_update(state)
    r["async_save_block_s"] = dcp_async_save(state, root / "dcp")
    r["durable_torch_save_s"] = durable_torch_save(state, root / "state.pt")     # the restorer reads it
    r["raw_socket_s"] = min(remote_socket(state, args.sink) for _ in range(args.repeat))
    r["raw_socket_gbps"] = nbytes / r["raw_socket_s"] / 1e9
    r["raw_socket_fresh_s"] = min(remote_socket(state, args.sink, fresh=True) for _ in range(args.repeat))
    r["disk_write_s"] = min(disk_write(state, Path(args.disk_dir) / "probe") for _ in range(args.repeat))
    r |= replication_alone(state, root / "ckpt-repl", f"{args.job}-repl", args)
    r["replication_gbps"] = nbytes / r["replication_s"] / 1e9
    transfers = []
    for mode in MODES:
        eng = CheckpointEngine(root / f"ckpt-{mode}", f"{args.job}-{mode}", 0, 1, "node0", shared=False,
                               snapshot=mode)
        eng.reserve(state)
        for step in range(1, args.warm + 1):
            eng.save(step, state)
            eng.wait()
        runs = [loop_through_save(state, eng, args.warm + 1 + i) for i in range(args.repeat)]
        got = {k: min(x[k] for x in runs) for k in ("lost_s", "stall_s", "ready_s")}
        least = min(runs, key=lambda x: x["lost_s"])
        got |= {k: least[k] for k in ("extra_cpu_s", "extra_runq_wait_s")}
        got |= {"steps": runs[0]["steps"], "runs": [{k: round(v, 4) if isinstance(v, float) else v for k, v in x.items()} for x in runs]}
        res = eng.last_result or {}
        got["stages"] = {k: round(v, 4) for k, v in res.items() if k.endswith("_s")}
        got["copies"] = [(c["tier"], c["node"]) for c in res.get("copies", [])]
        if res.get("transfer_s"):
            transfers.append(res["transfer_s"])
        r[mode] = got
        eng.close()
    r["replication_in_loop_s"] = min(transfers) if transfers else None
    r["default_mode"] = DEFAULT_MODE
    r["least_lost_mode"] = min(MODES, key=lambda m: r[m]["lost_s"])
    print(json.dumps(r), flush=True)
    return 0


def role_restorer(args: argparse.Namespace) -> int:
    """On a host that holds no copy: restore the saved shard from a peer's memory, then torch.load
    the same state from the shared file with its pages dropped."""
    root = Path(args.root)
    r: dict = {}
    eng = CheckpointEngine(root / f"ckpt-{args.mode}", f"{args.job}-{args.mode}", 0, 1, "node2", shared=False)
    r |= peer_restores(eng, int(float(args.size) * GiB), args)
    eng.close()
    pt, cold = root / "state.pt", []
    for _ in range(args.repeat):
        fd = os.open(pt, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        t0 = time.perf_counter()
        loaded = torch.load(pt, weights_only=True)
        cold.append(time.perf_counter() - t0)
        del loaded
        gc.collect()
    r["torch_load_cold_s"] = min(cold)
    print(json.dumps(r), flush=True)
    return 0


def hosts_bench(args: argparse.Namespace) -> tuple[dict, str]:
    """Three test-bed hosts (transom.testbed: own network, PID space, /tmp, /dev/shm), a TCE daemon
    on each finding the others through the registry on a broker; node0 saves, node1 holds its
    replica (and is the raw link's far end), node2 restores. The bytes cross the bed's bridge."""
    import subprocess

    from transom import testbed
    from transom.broker import EmbeddedBroker

    ok, why = testbed.available()
    if not ok:
        raise SystemExit(f"--hosts: the test bed is unavailable here: {why}")
    root = Path(tempfile.mkdtemp(prefix="transom-bench-tce-hosts-", dir="/tmp"))
    hosts = ["node0", "node1", "node2"]
    results: dict = {}
    env = {**os.environ, "TRANSOM_CLUSTER": f"bench-{uuid.uuid4().hex[:8]}"}
    for k in ("TRANSOM_CKPT_RUNTIME", "TRANSOM_CKPT_LOCAL_DIR", "TRANSOM_ADVERTISE_ADDR"):
        env.pop(k, None)
    me = str(Path(__file__).resolve())
    procs: list = []
    with testbed.Bed(hosts, share=[root]) as bed, \
            EmbeddedBroker(host=bed.root_addr, log_path=str(root / "broker.log")) as broker:
        env["TRANSOM_BOOTSTRAP"] = broker.bootstrap    # the ranks find their host's daemon in its runtime dir
        try:
            for h in hosts:
                (root / f"disk-{h}").mkdir()
                procs.append(bed.python(h, ["-m", "transom.cli", "ckpt-server", "--node", h, "--host", "0.0.0.0",
                                            "--bootstrap", broker.bootstrap, "--transport", args.transport,
                                            "--disk-dir", str(root / f"disk-{h}")], env=env,
                                        stdout=open(root / f"daemon-{h}.log", "wb"), stderr=subprocess.STDOUT))
            port = 39000
            procs.append(bed.python("node1", [me, "--role", "sink", "--port", str(port)], env=env,
                                    stdout=subprocess.PIPE, stderr=open(root / "sink.log", "wb")))
            assert procs[-1].stdout.readline().startswith(b"listening")
            time.sleep(3)                       # the daemons register and see each other
            for gib in args.sizes.split(","):
                job = f"bench-{uuid.uuid4().hex[:6]}"
                common = ["--root", str(root), "--job", job, "--size", gib, "--repeat", str(args.repeat),
                          "--warm", str(args.warm), "--tensor-mib", str(args.tensor_mib)]
                say(f"--hosts {gib} GiB: saver on node0 (replica on node1, raw link node0 -> node1)")
                r = _host_json(bed, "node0", [me, "--role", "saver", "--sink", f"{bed.addr('node1')}:{port}",
                                              "--disk-dir", str(root / "disk-node0"), *common], env, root)
                say("restorer on node2 (from node1's memory; torch.load of the page-dropped file)")
                r |= _host_json(bed, "node2", [me, "--role", "restorer", "--mode", r["default_mode"], *common],
                                env, root)
                (root / "state.pt").unlink(missing_ok=True)
                results[f"{float(gib):g}GiB"] = grade(r)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    shutil.rmtree(root, ignore_errors=True)
    return results, f"{args.transport} over the test bed's bridge"


def _host_json(bed, host: str, argv: list, env: dict, root: Path) -> dict:
    import subprocess

    with open(root / f"{host}-role.log", "ab") as err:
        p = bed.python(host, argv, env=env, stdout=subprocess.PIPE, stderr=err)
        out, _ = p.communicate(timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"--hosts: the {host} part failed (exit {p.returncode}): "
                         f"{(root / f'{host}-role.log').read_text()[-2000:]}")
    return json.loads(out.decode().strip().splitlines()[-1])


# --------------------------------------------------------------------------- sharded state vs DCP

def sharded_rank(rank: int, world: int, root: str, runtime: str, nbytes: int, q) -> None:
    """One rank of ``world`` holding ``nbytes`` of DTensors sharded on dim 0 (what FSDP2 holds):
    TCE save (blocking, ready) and load(template=) against DCP save, async_save and load."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        per = 64 << 20
        rows = per // 4 // 1024
        state = {f"layer{i}.weight": distribute_tensor(torch.full((rows, 1024), float(i)), mesh, [Shard(0)])
                 for i in range(max(1, nbytes // per))}
        out: dict = {}

        def timed(name, fn):
            dist.barrier()
            t0 = time.perf_counter()
            got = fn()
            out[name] = time.perf_counter() - t0
            return got
        eng = CheckpointEngine(f"{root}/ckpt", "sharded", rank, world, f"node{rank % 3}", runtime=runtime,
                               shared=False)
        eng.reserve(state)
        eng.save(1, state)
        eng.wait()
        timed("tce_save_block_s", lambda: eng.save(2, state))
        eng.wait()
        dist.barrier()
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            timed("dcp_save_s", lambda: dcp.save(state, checkpoint_id=f"{root}/dcp-sync"))
            fut = timed("dcp_async_save_block_s", lambda: dcp.async_save(state, checkpoint_id=f"{root}/dcp-async"))
            fut.result()
            template = {k: distribute_tensor(torch.zeros(rows, 1024), mesh, [Shard(0)]) for k in state}
            timed("tce_load_s", lambda: eng.load(template=template))
            ok = all(torch.equal(template[k].to_local(), state[k].to_local()) for k in state)
            template = {k: distribute_tensor(torch.zeros(rows, 1024), mesh, [Shard(0)]) for k in state}
            timed("dcp_load_s", lambda: dcp.load(template, checkpoint_id=f"{root}/dcp-sync"))
        eng.close()
        out["tce_ready_s"] = (eng.last_result or {}).get("total_s")
        out["load_ok"] = ok
        q.put((rank, out))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        q.put((rank, f"{exc!r}\n{traceback.format_exc()}"))


def sharded_bench(world: int, nbytes: int, daemons: "Daemons", root: Path) -> dict:
    """The same sharded state on ``world`` ranks: TCE against torch.distributed.checkpoint."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint"])
    q = ctx.Queue()
    sroot = root / "sharded"
    sroot.mkdir(exist_ok=True)
    procs = [ctx.Process(target=sharded_rank, args=(r, world, str(sroot), str(daemons.runtime), nbytes // world, q))
             for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(60)
    bad = {r: v for r, v in got.items() if isinstance(v, str)}
    if bad:
        raise SystemExit(f"sharded bench failed: {bad}")
    keys = [k for k in got[0] if k.endswith("_s") and got[0][k] is not None]
    r = {k: max(v[k] for v in got.values()) for k in keys}      # the slowest rank sets the pace
    r["load_ok"] = all(v["load_ok"] for v in got.values())
    r["ranks"], r["bytes"] = world, nbytes
    shutil.rmtree(sroot, ignore_errors=True)
    return r


def cuda_bench(nbytes: int, args: argparse.Namespace, daemons: "Daemons", root: Path) -> dict:
    """``save()`` of a state on the GPU (copy mode): the engine's default, which page-locks its segment
    (``pin_memory``), against ``pin_memory=False`` (a copy into pageable memory) and against the
    physical limit, a device-to-host copy of the same tensors into a page-locked buffer of torch's."""
    state = {k: v.cuda() for k, v in make_state(nbytes, args.tensor_mib).items()}
    torch.cuda.synchronize()

    def best_copy(pinned: bool) -> float:
        dst = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in state.items()}
        best = float("inf")
        for _ in range(max(args.repeat, 2) + 1):          # the first pass faults pageable memory in
            t0 = time.perf_counter()
            for k, v in state.items():
                dst[k].copy_(v, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        del dst
        return best

    r: dict = {"bytes": nbytes, "pinned_copy_s": best_copy(True), "pageable_copy_s": best_copy(False)}
    r["async_save_block_s"] = dcp_async_save(state, root / "dcp-cuda")
    r["durable_torch_save_s"] = durable_torch_save(state, root / "cuda.pt")
    (root / "cuda.pt").unlink()
    gc.collect()
    for tag, pin in (("save_block_s", True), ("save_block_unpinned_s", False)):
        eng = CheckpointEngine(root / f"ckpt-cuda-{tag}", f"cuda-{tag}", 0, 1, "node0", runtime=daemons.runtime,
                               shared=False, pin_memory=pin)
        try:
            stalls = []
            for step in range(1, args.warm + max(args.repeat, 2) + 1):
                eng.save(step, state)
                stalls.append(eng.last_snapshot_s)
                eng.wait()
            r[tag] = min(stalls[args.warm:])
            if pin:
                r["pinned_bytes"] = eng.pinned_bytes
                got = eng.load()[1]             # before the loop below changes the state
                r["load_ok"] = all(torch.equal(got[k], v.cpu()) for k, v in state.items())
                del got
                # a GPU loop stepping through a save until it is ready
                runs = [loop_through_save(state, eng, 100 + i) for i in range(max(args.repeat, 2))]
                r["lost_s"] = min(x["lost_s"] for x in runs)
                r["ready_s"] = min(x["ready_s"] for x in runs)
        finally:
            eng.close()
    del state
    torch.cuda.empty_cache()
    r["save_block_vs_pinned_copy"] = r["save_block_s"] / r["pinned_copy_s"]
    r["lost_per_save_vs_pinned_copy"] = r["lost_s"] / r["pinned_copy_s"]
    r["async_save_vs_lost_per_save"] = r["async_save_block_s"] / r["lost_s"]
    r["durable_save_vs_lost_per_save"] = r["durable_torch_save_s"] / r["lost_s"]
    r["unpinned_vs_pinned_save"] = r["save_block_unpinned_s"] / r["save_block_s"]
    return r


def _or_nan(v) -> float:
    return float("nan") if v is None else v


def _default_priority() -> str:
    from transom.priority import DEFAULT, KEY

    return os.environ.get(KEY) or DEFAULT


def met(name: str, value: float) -> bool:
    op, target = TARGETS[name]
    return value <= target if op == "<=" else value >= target


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1", help="state sizes in GiB, comma separated (default 1)")
    p.add_argument("--warm", type=int, default=3, help="saves before the measured ones (default 3)")
    p.add_argument("--repeat", type=int, default=2,
                   help="measured saves and restores; the best of each figure counts (default 2)")
    p.add_argument("--tensor-mib", type=int, default=64, help="size of each tensor in MiB (default 64)")
    p.add_argument("--transport", default="auto", choices=("auto", "mooncake", "tcp"),
                   help="the daemons' replication transport (default auto: Mooncake RDMA with an active "
                        "RDMA port, Transom's TCP transport otherwise)")
    p.add_argument("--sharded", type=int, default=2, metavar="RANKS",
                   help="also compare with torch.distributed.checkpoint on DTensor state sharded over RANKS "
                        "gloo ranks (default 2; 0: skip)")
    p.add_argument("--sharded-gib", default="0.25", help="total size of the sharded state (default 0.25)")
    p.add_argument("--hosts", action="store_true",
                   help="run on three test-bed hosts (transom.testbed, needs root and namespaces): the "
                        "bytes cross the bed's network, daemons find each other through the registry")
    p.add_argument("--role", choices=("saver", "restorer", "sink"), help=argparse.SUPPRESS)  # --hosts' parts
    for hidden in ("--root", "--job", "--size", "--sink", "--disk-dir", "--mode"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true",
                   help="a run of about 2-3 minutes: --sizes 0.25 --warm 2 --repeat 3 --sharded 0 (flags given "
                        "after it still win)")
    p.add_argument("--cuda", type=float, default=0.0, metavar="GIB",
                   help="also save a state of GIB GiB on the GPU: save() blocking with the default page-locked "
                        "segment, with pin_memory=False, and a device-to-host copy into torch's pinned memory "
                        "(needs CUDA; default 0: skip)")
    p.add_argument("--services-priority", default=None, metavar="PRIO",
                   help="CPU priority of the daemons (TRANSOM_SERVICE_PRIORITY: batch:N, nice:N, idle, normal; "
                        "default: the product's default, %s, or the variable when set)" % _default_priority())
    argv = sys.argv[1:]
    if "--quick" in argv:
        argv = ["--sizes", "0.25", "--warm", "2", "--repeat", "3", "--sharded", "0", *argv]
    args = p.parse_args(argv)
    if args.services_priority is not None:
        from transom.priority import KEY, parse

        parse(args.services_priority, "--services-priority")
        os.environ[KEY] = args.services_priority          # the daemons (and the --hosts parts) inherit it
    torch.set_num_threads(1)
    if args.role:
        return {"saver": role_saver, "restorer": role_restorer, "sink": role_sink}[args.role](args)
    if args.cuda and not torch.cuda.is_available():
        p.error("--cuda: no CUDA device here")
    results, sharded, cuda = {}, None, None
    if args.hosts:
        results, where = hosts_bench(args)
    else:
        root = Path(tempfile.mkdtemp(prefix="transom-bench-tce-", dir="/tmp"))
        daemons = Daemons(root, args.transport)
        from transom.priority import read

        where = f"{daemons.transport} over loopback; daemons at CPU priority {read(daemons.procs[0].pid)}"
        try:
            for gib in [float(x) for x in args.sizes.split(",")]:
                results[f"{gib:g}GiB"] = bench_size(int(gib * GiB), args, daemons, root)
            if args.sharded:
                say(f"sharded state (DTensor, Shard(0)) on {args.sharded} ranks: TCE against "
                    f"torch.distributed.checkpoint")
                sharded = sharded_bench(args.sharded, int(float(args.sharded_gib) * GiB), daemons, root)
            if args.cuda:
                say(f"{args.cuda:g} GiB on the GPU: save() into a page-locked segment, a pageable one, and "
                    f"a plain copy into pinned memory")
                cuda = cuda_bench(int(args.cuda * GiB), args, daemons, root)
        finally:
            daemons.close()
            shutil.rmtree(root, ignore_errors=True)
    cols = list(results)
    rows = [("plain copy s (warm memory)", lambda x: x["plain_copy_s"]),
            ("training step s (in-place update)", lambda x: x["update_s"])]
    for m in MODES:
        rows += [(f"{m}: lost per save s", lambda x, m=m: x[m]["lost_s"]),
                 (f"{m}: save() blocking s", lambda x, m=m: x[m]["stall_s"]),
                 (f"{m}:  lost: extra on-CPU s", lambda x, m=m: _or_nan(x[m].get("extra_cpu_s"))),
                 (f"{m}:  lost: extra run-queue wait s", lambda x, m=m: _or_nan(x[m].get("extra_runq_wait_s"))),
                 (f"{m}:  daemons' CPU s (3 daemons)", lambda x, m=m: _or_nan(x[m].get("daemons_cpu_s"))),
                 (f"{m}: save -> ready s", lambda x, m=m: x[m]["ready_s"]),
                 (f"{m}: steps through the save", lambda x, m=m: x[m]["steps"])]
    rows += [("async_save blocking s", lambda x: x["async_save_block_s"]),
             ("durable torch.save s (fsync)", lambda x: x["durable_torch_save_s"]),
             ("raw socket s", lambda x: x["raw_socket_s"]), ("disk write s (fsync)", lambda x: x["disk_write_s"]),
             ("raw socket s, into new memory", lambda x: x.get("raw_socket_fresh_s") or 0.0),
             ("replication s (alone)", lambda x: x["replication_s"] or 0.0),
             ("replication s (in training loop)", lambda x: x.get("replication_in_loop_s") or 0.0),
             ("peer restore s (verified, into state)", lambda x: x["peer_restore_s"]),
             ("peer restore s, into new memory", lambda x: x.get("peer_restore_new_memory_s") or 0.0),
             ("torch.load s (pages dropped)", lambda x: x["torch_load_cold_s"])]
    print(f"{'TCE (' + where + ')':<36}" + "".join(f"{c:>12}" for c in cols))
    for label, get in rows:
        print(f"{label:<36}" + "".join(f"{get(results[c]):>12.3f}" for c in cols))
    print(f"{'default snapshot mode (graded)':<36}" + "".join(f"{results[c]['default_mode']:>12}" for c in cols))
    print(f"{'mode that lost least (info)':<36}" + "".join(f"{results[c]['least_lost_mode']:>12}" for c in cols))
    for name, (op, target) in TARGETS.items():
        vals = [results[c]["ratios"][name] for c in cols]
        print(f"{name + ' (' + op + ' ' + str(target) + ')':<44}" + "".join(
            f"{v:>10.2f}{'ok' if met(name, v) else ' X':>2}" for v in vals))
    for name in results[cols[0]]["info_ratios"]:
        print(f"{name + ' (info)':<44}" + "".join(f"{results[c]['info_ratios'][name]:>12.2f}" for c in cols))

    if sharded:
        print(f"sharded state, {sharded['ranks']} ranks, {sharded['bytes'] / GiB:g} GiB (slowest rank; "
              f"loads verified: {sharded['load_ok']})")
        for k in ("tce_save_block_s", "tce_ready_s", "dcp_async_save_block_s", "dcp_save_s", "tce_load_s",
                  "dcp_load_s"):
            if k in sharded:
                print(f"  {k:<34}{sharded[k]:>12.3f}")

    if cuda:
        print(f"state on the GPU, {cuda['bytes'] / GiB:g} GiB (copy mode; load verified: {cuda['load_ok']})")
        for k in ("pinned_copy_s", "pageable_copy_s", "save_block_s", "save_block_unpinned_s", "lost_s", "ready_s",
                  "async_save_block_s", "durable_torch_save_s", "save_block_vs_pinned_copy", "unpinned_vs_pinned_save",
                  "lost_per_save_vs_pinned_copy", "async_save_vs_lost_per_save", "durable_save_vs_lost_per_save"):
            print(f"  {k:<34}{cuda[k]:>12.3f}")

    def rounded(v):
        if isinstance(v, float):
            return round(v, 4)
        if isinstance(v, dict):
            return {k: rounded(x) for k, x in v.items()}
        return v
    figures = {c: {k: rounded(v) for k, v in results[c].items() if k not in ("ratios", "info_ratios")} for c in cols}
    ratios = {c: {k: round(v, 3) for k, v in results[c]["ratios"].items()} for c in cols}
    info = {c: {k: round(v, 3) for k, v in results[c]["info_ratios"].items()} for c in cols}
    met_all = {c: {k: met(k, v) for k, v in results[c]["ratios"].items()} for c in cols}
    print(json.dumps({"bench": "tce", "where": where, "hosts": bool(args.hosts), "default_mode": DEFAULT_MODE,
                      "services_priority": _default_priority(), "figures": figures, "ratios": ratios,
                      "info_ratios": info, "targets": {k: f"{op} {t}" for k, (op, t) in TARGETS.items()},
                      "met": met_all, "sharded_vs_dcp": sharded and rounded(sharded),
                      "cuda": cuda and rounded(cuda), "all_met": all(all(v.values()) for v in met_all.values())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
