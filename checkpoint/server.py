"""The per-node TCE daemon (``transom ckpt-server``): owns the checkpoint memory of one node.

Ranks of the node write their shard into a shared-memory segment the daemon hands out
(``acquire``), then tell it the shard is there (``staged``); from then on a crash of the
training process loses nothing. For every staged shard the daemon runs, on its pipeline thread
(stages 2 and 3 at once, on threads of their own: the shard is ready after the slowest of them):

1. hash        the shard's digest (:mod:`.digest`) of the bytes (the same bytes are every copy, see :mod:`.shardfmt`)
2. replicate   into the ring neighbour daemon's memory (:mod:`.transport`); never on this node
3. persist     to local disk (``--disk-dir``) and, if the rank asked, the job's shared directory;
               a write that fails (ENOSPC, EIO, ...) is logged once with the path and errno and
               that copy is left out: the step still commits with its memory copies, and the
               manifest says ``persisted: false`` when no disk or shared copy of a shard exists
4. commit      this rank's shard manifest with all its copies; when every rank's is there, one
               daemon wins the commit and writes ``manifest.json`` (:func:`.store.try_commit`)
5. announce    that daemon publishes one :class:`transom.contracts.CheckpointReady`

Segment states: free -> staging (the rank copies into it) -> queued (handed over) -> held (hashed:
a valid copy) -> free. A rank that acquires a segment again while one of its segments is still
``staging`` died mid-save: that segment is reused, the held copies stay, unless a live process
still holds the segment's flock (the fork-snapshot child of a rank that died, which finishes the
save on its own): that segment is left alone.

Segments are reused: a rank's segment returns to its free pool once a newer step of the job is
committed and ``--mem-keep`` newer copies exist; a segment being written (``staging``) is never
handed to anyone, so a rank killed mid-save leaves the previous step's copy whole.

Finding peers: with a broker (``--bootstrap`` / ``TRANSOM_BOOTSTRAP``) the daemon registers in the
service registry (:mod:`transom.registry`, kind ``ckpt-daemon``) under the address a peer routes to
(``--advertise`` / ``TRANSOM_ADVERTISE_ADDR``; default: its bind address when that is a specific
one, else the interface that routes to the broker; never 0.0.0.0), and takes its ring neighbour
from the registry's live entries. Without a broker (one host) the daemons of one runtime dir find
each other there. Ranks always find their own host's daemon in the runtime dir.

Generations: the daemon remembers the newest launch generation it has seen per job (from saves,
replicas and the job directory's ``.generation``, :func:`.store.claim_generation`) and refuses a
save, a replica or a commit stamped with an older one (:class:`.errors.StaleGeneration`, logged):
the ranks and daemon of a host that was cut off and came back cannot touch the new generation.

Requests (JSON messages, :mod:`.wire`): reserve, forget, acquire, staged, abort, wait, lookup, read, replica_put,
replica_alloc, replica_done, replica_abort, capacity, stats, resolve; every connection first passes
the greeting and, with a shared secret, the HMAC challenge of :mod:`.wire`.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import itertools
import os
import queue
import shutil
import signal
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transom import contracts, registry
from transom.contracts import ServiceKind
from transom.log import get
from transom.security import ckpt_secret

from . import layout, segments, store
from .digest import DEFAULT as DIGEST, StreamDigest, algorithm, chunk_digests, combine, digest_of
from .errors import StaleGeneration
from .segments import Segment, safe_name
from .transport import Replicator, make_replicator
from .wire import STALL_S, DaemonError, greet, recv_exact_into, recv_msg, send_msg, send_view

__all__ = ["CheckpointServer", "Slot", "main"]

log = get("checkpoint.server")
_MiB = 1 << 20
_TEST_DELAY_S = float(os.environ.get("TRANSOM_CKPT_TEST_DELAY_S") or 0)


@dataclass
class Slot:
    seg: Segment
    kind: str                     # "own" (a local rank's shard) or "replica" (a neighbour's)
    job: str
    rank: int
    state: str = "free"           # free -> staging -> held -> free
    step: int = -1
    size: int = 0
    digest: str = ""              # ALG:HEX (:mod:`.digest`)
    chunks: list | None = None    # its chunk digests, kept from hashing (what load(into=) reads first)
    origin: str = ""              # node that wrote the shard
    generation: int = 0


@dataclass
class _Result:
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _being_written(path: Path) -> bool:
    """Whether a writer holds the segment's flock (:func:`.snapshot.lock_segment`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class CheckpointServer:
    """The daemon's state and pipeline; :meth:`serve` listens, :meth:`close` removes its segments."""

    def __init__(self, node: str, runtime: str | os.PathLike | None = None, *, disk_dir: str | None = None,
                 host: str | None = None, port: int = 0, transport: str = "auto", protocol: str = "auto",
                 mem_keep: int = 1, disk_keep: int = 3, max_bytes: int | None = None,
                 bootstrap: str | None = None, register: bool = True, advertise: str | None = None,
                 secret: bytes | None | bool = True) -> None:
        self.node = node
        # every connection is authenticated when the daemons share a secret (TRANSOM_CKPT_SECRET)
        self.secret = ckpt_secret() if secret is True else (secret or None)
        self.runtime = segments.runtime_dir(runtime, bootstrap)
        self.seg_dir = self.runtime / safe_name(node)
        self.disk_dir = Path(disk_dir or os.environ.get("TRANSOM_CKPT_LOCAL_DIR")
                             or segments.default_local_dir(bootstrap)) / safe_name(node)
        self.mem_keep, self.disk_keep = mem_keep, disk_keep
        self.max_bytes = max_bytes
        self.bootstrap = bootstrap
        self.slots: dict[str, Slot] = {}
        self.lock = threading.Lock()
        self.results: dict[tuple[str, int, int], _Result] = {}
        self.queue: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._producer = None
        if host is None:                # see registry.default_bind: loopback only for one host
            host = registry.default_bind(bootstrap, explicit=advertise)
        self.advertise = registry.advertise_address(bootstrap, bind=host, explicit=advertise)
        if register and bootstrap and registry.is_loopback(host) and \
                not registry.is_loopback(registry.default_bind(bootstrap, explicit=advertise)):
            log.warning("%s: listening on %s only, while the broker is on another host: daemons on other "
                        "hosts cannot reach this one (use --host 0.0.0.0 or this host's address)", node, host)
        self.generations: dict[str, int] = {}      # job -> newest launch generation seen
        self._writer: registry.RegistryWriter | None = None
        self._reader: registry.RegistryReader | None = None
        self.replicator: Replicator
        self.replicator, self.mooncake = make_replicator(transport, self.advertise, protocol)
        self.seg_dir.mkdir(parents=True, exist_ok=True)
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        self._sweep()
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server._handle(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.tcp = socketserver.ThreadingTCPServer((host, port), Handler, bind_and_activate=True)
        self.tcp.daemon_threads = True
        self.port = self.tcp.server_address[1]
        self.addr = f"[{self.advertise}]:{self.port}" if ":" in self.advertise else f"{self.advertise}:{self.port}"
        self._register = register
        self.stopping = False
        self._threads = [threading.Thread(target=self.tcp.serve_forever, name="ckpt-serve", daemon=True),
                         threading.Thread(target=self._pipeline, name="ckpt-pipeline", daemon=True)]

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "CheckpointServer":
        for t in self._threads:
            t.start()
        if self._register:
            meta = {"transport": self.replicator.name, "mooncake": self.mooncake.name if self.mooncake else None}
            if self.bootstrap:        # peers first, so the first save already has its neighbour
                self._reader = registry.RegistryReader(self.bootstrap).start()
                self._writer = registry.RegistryWriter(self.bootstrap, registry.registration(
                    ServiceKind.CKPT_DAEMON, self.node, addr=self.advertise, port=self.port, meta=meta)).start()
            segments.register(self.runtime, self.node, {        # then this host's ranks may find it
                "addr": self.addr, "pid": os.getpid(), "host": os.uname().nodename, **meta})
        if not self.secret and not self.addr.startswith(("127.", "localhost")):
            log.warning("TCE daemon of %s listens on %s WITHOUT authentication: anyone who reaches the port "
                        "can read and drop checkpoints; set TRANSOM_CKPT_SECRET (docs/security.md)",
                        self.node, self.addr)
        log.info("TCE daemon of %s at %s (runtime %s, disk %s, replication %s, peers from %s, %s)", self.node,
                 self.addr, self.runtime, self.disk_dir, self.replicator.name,
                 f"the registry on {self.bootstrap} (cluster {registry.cluster_name()})" if self._reader
                 else f"the runtime dir {self.runtime} (one host)",
                 "connections authenticated (TRANSOM_CKPT_SECRET)" if self.secret else
                 "connections NOT authenticated: set TRANSOM_CKPT_SECRET")
        return self

    def close(self) -> None:
        if self._register:
            segments.unregister(self.runtime, self.node, os.getpid())
        if self._writer is not None:
            self._writer.stop()          # tombstone: peers stop replicating here at once
        if self._reader is not None:
            self._reader.close()
        self.queue.put(None)
        self.tcp.shutdown()
        self.tcp.server_close()
        with self.lock:
            for slot in self.slots.values():
                slot.seg.close(unlink=True)
            self.slots.clear()
        if self._producer is not None:
            self._producer.flush(5)

    def _sweep(self) -> None:
        """Delete segments left in this node's dir by daemons that died (the pid ends the name)."""
        from .wire import pid_alive

        for f in self.seg_dir.iterdir():
            pid = f.name.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                f.unlink(missing_ok=True)
                log.info("%s: removed %s, left by a daemon that is gone", self.node, f.name)

    # ------------------------------------------------------------------ slots
    def _used(self) -> int:
        return sum(s.seg.capacity for s in self.slots.values())

    def _new_slot(self, kind: str, job: str, rank: int, size: int, origin: str) -> Slot:
        cap = max(_MiB, -(-size // _MiB) * _MiB)
        if self.max_bytes is not None and self._used() + cap > self.max_bytes:
            raise MemoryError(f"node {self.node}: checkpoint memory budget exhausted: {self._used()} bytes "
                              f"in use, {cap} more needed, budget {self.max_bytes} (--max-bytes / "
                              f"TRANSOM_CKPT_SHM_BYTES); lower --mem-keep or give /dev/shm more room")
        name = f"{kind}-{safe_name(job)}-r{rank}-{safe_name(origin)}-{next(self._ids)}-{os.getpid()}"
        seg = Segment.create(self.seg_dir / name, cap)
        slot = Slot(seg, kind, job, rank, origin=origin)
        self.slots[str(seg.path)] = slot
        return slot

    def _take(self, kind: str, job: str, rank: int, size: int, origin: str, grow: bool = True) -> Slot | None:
        """A free slot of this (kind, job, rank) big enough, grown or new otherwise (lock held); with
        ``grow`` false, None instead of more memory."""
        free = [s for s in self.slots.values() if s.state == "free" and s.kind == kind and s.job == job
                and s.rank == rank]
        fit = [s for s in free if s.seg.capacity >= size]
        if fit:
            return min(fit, key=lambda s: s.seg.capacity)
        if not grow:
            return None
        for s in free:                        # too small: give its memory back first
            self._drop(s)
        return self._new_slot(kind, job, rank, size, origin)

    def _drop(self, slot: Slot) -> None:
        if self.mooncake is not None:
            self.mooncake.unregister(slot.seg)
        self.slots.pop(str(slot.seg.path), None)
        slot.seg.close(unlink=True)

    def _release_old(self, kind: str, job: str, rank: int, ckpt_dir: str | None) -> None:
        """Free held slots of (kind, job, rank) older than both the newest committed step and the
        newest ``mem_keep`` held ones (lock held)."""
        held = sorted((s for s in self.slots.values() if s.state == "held" and s.kind == kind
                       and s.job == job and s.rank == rank), key=lambda s: s.step)
        committed = layout.complete_steps(ckpt_dir) if ckpt_dir else []
        newest = committed[-1] if committed else None
        for s in held[:-self.mem_keep] if self.mem_keep else held:
            if newest is not None and s.step < newest:
                s.state = "free"

    def _find(self, job: str, rank: int, step: int, digest: str | None) -> Slot | None:
        cands = [s for s in self.slots.values() if s.state == "held" and s.job == job and s.rank == rank
                 and s.step == step and (digest is None or s.digest == digest)]
        return max(cands, key=lambda s: s.kind == "own", default=None)

    # ------------------------------------------------------------------ peers, generations
    def peers(self) -> dict[str, dict[str, Any]]:
        """The other live daemons by node, as the replicators take them (``node``, ``addr``, ``mooncake``)."""
        if self._reader is None:
            return {n: d for n, d in segments.registered(self.runtime).items() if n != self.node}
        return {n: {"node": n, "addr": r.endpoint, "host": r.host, **r.meta}
                for n, r in self._reader.live(ServiceKind.CKPT_DAEMON).items() if n != self.node}

    def ring(self) -> list[dict[str, Any]]:
        """Peers in ring order from this node: the neighbour first (:func:`.segments.ring`)."""
        return segments.ring(self.peers(), self.node)

    def _check_generation(self, job: str, generation: int | None, what: str) -> None:
        """Remember the newest generation of ``job``; raise :class:`StaleGeneration` for an older one."""
        if generation is None:
            return
        with self.lock:
            newest = self.generations.get(job, generation)
            if generation >= newest:
                self.generations[job] = generation
                return
        err = StaleGeneration(job, generation, newest, what)
        log.error("%s: %s", self.node, err)
        raise err

    def _claim(self, ckpt_dir: str, job: str, generation: int, what: str) -> None:
        """Check ``generation`` against the job directory's record (:func:`.store.claim_generation`)
        and learn the newest from it; raise :class:`StaleGeneration` when it is older."""
        try:
            newest = store.claim_generation(ckpt_dir, job, generation, what)
        except StaleGeneration as exc:
            log.error("%s: %s", self.node, exc)
            with self.lock:
                self.generations[job] = max(self.generations.get(job, -1), exc.newest)
            raise
        with self.lock:
            self.generations[job] = max(self.generations.get(job, -1), newest)

    def _op_resolve(self, _sock, msg) -> dict:
        """Where the daemon of ``node`` is reached now: from the registry, else this runtime dir."""
        node = msg["node"]
        if node == self.node:
            return {"addr": self.addr, "source": "self"}
        if self._reader is not None:
            reg = self._reader.get(ServiceKind.CKPT_DAEMON, node)
            return {"addr": reg.endpoint if reg else None, "source": "registry", "live": reg is not None}
        info = segments.registered(self.runtime).get(node)
        return {"addr": info["addr"] if info else None, "source": "runtime", "live": info is not None}

    # ------------------------------------------------------------------ requests
    def _handle(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            refused = greet(sock, self.secret)
        except (OSError, ValueError):
            return
        if refused is not None:
            try:
                peer = "%s:%s" % sock.getpeername()[:2]
            except OSError:
                peer = "?"
            log.warning("%s: refused a connection from %s: %s", self.node, peer, refused)
            return
        while True:
            try:
                msg = recv_msg(sock)
            except (OSError, ValueError):
                return
            if msg is None:
                return
            op = msg.get("op")
            try:
                reply = getattr(self, f"_op_{op}")(sock, msg)
            except AttributeError as exc:
                reply = {"error": f"unknown request {op!r}" if f"_op_{op}" in str(exc) else repr(exc)}
            except Exception as exc:  # noqa: BLE001 - the reason goes back to the caller
                log.warning("%s request %s failed: %s", self.node, op, exc)
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            if reply is not None:
                try:
                    send_msg(sock, reply)
                except OSError:
                    return

    def _op_hello(self, _sock, _msg) -> dict:
        return {"node": self.node, "addr": self.addr, "transport": self.replicator.name}

    def _op_capacity(self, _sock, _msg) -> dict:
        import psutil

        st = os.statvfs(self.seg_dir)
        return {"shm_free": st.f_bavail * st.f_frsize, "shm_path": str(self.seg_dir),
                "ram_available": psutil.virtual_memory().available, "used": self._used(),
                "budget": self.max_bytes, "mem_keep": self.mem_keep}

    def _op_stats(self, _sock, _msg) -> dict:
        with self.lock:
            return {"slots": [{"kind": s.kind, "job": s.job, "rank": s.rank, "state": s.state, "step": s.step,
                               "size": s.size, "capacity": s.seg.capacity, "path": str(s.seg.path),
                               "origin": s.origin} for s in self.slots.values()], "used": self._used()}

    def _op_acquire(self, _sock, msg) -> dict:
        if self.stopping:
            return {"error": f"the TCE daemon of {self.node} is stopping: no new save is taken"}
        # step None: a rank acquiring its next save's segment ahead, right after a save (the step
        # comes with ``staged``), so that save() itself never waits for this daemon
        what = f"step {msg['step']}" if msg.get("step") is not None else "the next save"
        self._check_generation(msg["job"], msg.get("generation"), f"the save of {what} of rank {msg['rank']}")
        with self.lock:
            self._release_old("own", msg["job"], msg["rank"], msg.get("ckpt_dir"))
            for s in self.slots.values():
                if s.state == "staging" and s.kind == "own" and (s.job, s.rank) == (msg["job"], msg["rank"]):
                    if _being_written(s.seg.path):
                        log.warning("%s: step %s of rank %d of job %s is still being written by a live "
                                    "process (the snapshot child of a rank that died?): left to finish",
                                    self.node, s.step, s.rank, s.job)
                        continue
                    if s.step is None:
                        log.info("%s: a segment rank %d of job %s acquired ahead and never used (the rank "
                                 "restarted): reused", self.node, s.rank, s.job)
                    else:
                        log.warning("%s: rank %d of job %s left step %s half written (it died mid-save): "
                                    "segment reused", self.node, s.rank, s.job, s.step)
                    s.state = "free"     # one rank per (job, rank): the writer of this one is gone
            # ahead: only a segment this rank already has and no longer needs (the one of a step older
            # than the newest committed); never more memory than a save at its time takes
            slot = self._take("own", msg["job"], msg["rank"], msg["size"], self.node,
                              grow=msg.get("step") is not None)
            if slot is None:
                return {"path": None}
            slot.state, slot.step, slot.size = "staging", msg["step"], msg["size"]
            return {"path": str(slot.seg.path), "capacity": slot.seg.capacity}

    def _op_reserve(self, _sock, msg) -> dict:
        with self.lock:
            slot = self._take("own", msg["job"], msg["rank"], msg["size"], self.node)   # stays free
            return {"path": str(slot.seg.path), "capacity": slot.seg.capacity}

    def _op_forget(self, _sock, msg) -> dict:
        """Drop every memory copy of a job on this node (the job is over; frees /dev/shm now)."""
        with self.lock:
            gone = [s for s in self.slots.values() if s.job == msg["job"] and (
                s.state in ("free", "held") or (s.state == "staging" and s.step is None
                                                and not _being_written(s.seg.path)))]
            for s in gone:
                self._drop(s)
        return {"dropped": len(gone)}

    def _op_abort(self, _sock, msg) -> dict:
        with self.lock:
            slot = self.slots.get(msg["path"])
            if slot is not None and slot.state == "staging":
                slot.state = "free"
        return {"ok": True}

    def _op_staged(self, _sock, msg) -> dict:
        try:
            self._check_generation(msg["job"], msg.get("generation"),
                                   f"the save of step {msg['step']} of rank {msg['rank']}")
        except StaleGeneration:
            self._op_abort(_sock, msg)
            raise
        with self.lock:
            slot = self.slots.get(msg["path"])
            if slot is None or slot.state != "staging":
                return {"error": f"{msg['path']} is not a segment being staged on {self.node}"}
            if msg["size"] > slot.seg.capacity:
                slot.state = "free"
                return {"error": f"step {msg['step']}: {msg['size']} bytes staged in a segment of "
                                 f"{slot.seg.capacity}"}
            slot.state, slot.step, slot.size = "queued", msg["step"], msg["size"]
            key = (msg["job"], msg["rank"], msg["step"])
            self.results[key] = _Result()
        self.queue.put((slot, msg))
        return {"ok": True}

    def _op_wait(self, _sock, msg) -> dict:
        res = self.results.get((msg["job"], msg["rank"], msg["step"]))
        if res is None:
            return {"error": f"no save of step {msg['step']} of rank {msg['rank']} is known on {self.node}"}
        if not res.done.wait(msg.get("timeout")):
            return {"error": f"step {msg['step']} of rank {msg['rank']} still in progress"}
        return {"ok": res.error is None, "failed": res.error, **res.info}

    def _op_lookup(self, _sock, msg) -> dict:
        with self.lock:
            slot = self._find(msg["job"], msg["rank"], msg["step"], msg.get("digest"))
            if slot is None:
                return {"found": False}
            return {"found": True, "path": str(slot.seg.path), "size": slot.size, "digest": slot.digest,
                    "kind": slot.kind, "origin": slot.origin}

    def _op_read(self, sock, msg) -> None:
        with self.lock:
            slot = self._find(msg["job"], msg["rank"], msg["step"], msg.get("digest"))
            if slot is not None:
                slot.state = "reading"        # not reused while it is being sent
        if slot is None:
            send_msg(sock, {"found": False})
            return None
        view = slot.seg.view(slot.size)
        try:
            head = {"found": True, "size": slot.size, "digest": slot.digest, "kind": slot.kind}
            if msg.get("chunks") and slot.digest and not algorithm(slot.digest).startswith("sha256"):
                # the reader verifies each chunk against these before it lets it into its tensors,
                # and these against the manifest's digest before the first one (load(into=))
                parts = slot.chunks or chunk_digests(view, algorithm(slot.digest))
                head["chunks"] = [d.hex() for d in parts]
            send_msg(sock, head)
            send_view(sock, view)               # from this daemon's memory, not the file's path
        except BaseException:
            # the head promised bytes: the reader must see a short stream, never a reply read as bytes
            _hang_up(sock)
            raise
        finally:
            view.release()
            with self.lock:
                slot.state = "held"
        return None

    def _replica_slot(self, msg) -> Slot:
        self._check_generation(msg["job"], msg.get("generation"),
                               f"the replica of step {msg['step']} of rank {msg['rank']} from {msg.get('origin')}")
        with self.lock:
            self._release_old("replica", msg["job"], msg["rank"], msg.get("ckpt_dir"))
            slot = self._take("replica", msg["job"], msg["rank"], msg["size"], msg["origin"])
            slot.state, slot.step, slot.size, slot.origin = "staging", msg["step"], msg["size"], msg["origin"]
            slot.generation = msg.get("generation", 0)
            return slot

    def _finish_replica(self, slot: Slot, msg, digest: str | None = None, parts: list | None = None) -> dict:
        if digest is None:
            digest = digest_of(slot.seg.view(slot.size), algorithm(msg["digest"]))
        with self.lock:
            if digest != msg["digest"]:
                slot.state = "free"
                return {"error": f"replica of rank {msg['rank']} step {msg['step']} arrived with digest "
                                 f"{digest}, sender says {msg['digest']}: dropped"}
            for other in self.slots.values():        # an older replica of the same step is stale now
                if other is not slot and other.state == "held" and other.kind == "replica" and \
                        (other.job, other.rank, other.step) == (slot.job, slot.rank, slot.step):
                    other.state = "free"
            slot.digest, slot.state, slot.chunks = digest, "held", parts
        return {"path": str(slot.seg.path), "node": self.node}

    def _op_replica_put(self, sock, msg) -> dict:
        try:
            slot = self._replica_slot(msg)
        except StaleGeneration:
            _drain(sock, msg["size"])         # the bytes follow the request: read them, then refuse
            raise
        t0 = time.perf_counter()
        hasher = StreamDigest(algorithm(msg["digest"]))     # verified while it arrives
        sock.settimeout(STALL_S)                            # a sender that stalls mid-stream fails it
        try:
            recv_exact_into(sock, slot.seg.view(slot.size), hasher.feed)
        except OSError:
            hasher.hexdigest()
            with self.lock:
                slot.state = "free"
            raise
        finally:
            sock.settimeout(None)
        dt = time.perf_counter() - t0
        digest = hasher.hexdigest()
        return {**self._finish_replica(slot, msg, digest, hasher.parts), "transfer_s": dt}

    def _op_replica_alloc(self, _sock, msg) -> dict:
        if self.mooncake is None:
            return {"error": f"{self.node} runs the tcp transport, not Mooncake"}
        slot = self._replica_slot(msg)
        return {"path": str(slot.seg.path), "addr": self.mooncake.register(slot.seg)}

    def _op_replica_done(self, _sock, msg) -> dict:
        slot = self.slots.get(msg["path"])
        if slot is None or slot.state != "staging":
            return {"error": f"{msg['path']}: no replica being received"}
        return self._finish_replica(slot, msg)

    def _op_replica_abort(self, _sock, msg) -> dict:
        return self._op_abort(_sock, msg)

    # ------------------------------------------------------------------ pipeline
    def _pipeline(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                self.queue.task_done()
                return
            slot, msg = item
            if _TEST_DELAY_S:
                time.sleep(_TEST_DELAY_S)         # tests: a save that is surely still in flight
            res = self.results[(msg["job"], msg["rank"], msg["step"])]
            try:
                res.info = self._run_stages(slot, msg)
            except Exception as exc:  # noqa: BLE001 - reported to the rank through wait()
                res.error = f"{type(exc).__name__}: {exc}"
                log.error("%s: checkpoint of job %s rank %d step %d failed: %s", self.node, msg["job"],
                          msg["rank"], msg["step"], res.error)
            finally:
                res.done.set()
                self.queue.task_done()

    def _run_stages(self, slot: Slot, msg: dict) -> dict:
        job, rank, step, gen = msg["job"], msg["rank"], msg["step"], msg.get("generation", 0)
        size, t = msg["size"], {}
        data = slot.seg.view(size)
        t0 = time.perf_counter()
        if msg.get("ckpt_dir"):       # a replaced launch's save goes nowhere, not even to the neighbour
            try:
                self._claim(msg["ckpt_dir"], job, gen, f"the save of step {step} of rank {rank}")
            except StaleGeneration:
                with self.lock:
                    slot.state = "free"          # not a copy of anything: the segment is reused
                raise
        parts = chunk_digests(data, DIGEST)                             # 1. hash
        dig = combine(DIGEST, parts)
        with self.lock:
            slot.digest, slot.state, slot.generation, slot.origin = dig, "held", gen, self.node
            slot.chunks = parts
        t["hash_s"] = time.perf_counter() - t0
        copies = [contracts.Copy(rank, self.node, contracts.Tier.MEMORY, f"{self.addr}#{slot.seg.path}")]
        meta = {"job": job, "rank": rank, "step": step, "size": size, "digest": dig, "origin": self.node,
                "generation": gen, "ckpt_dir": msg.get("ckpt_dir")}
        # 2. replicate and 3. persist run at once (each is bound by its own device: the link, the
        # local disk, the shared file system), so the checkpoint is ready after the slowest of them
        unpersisted: list[str] = []
        sdir = layout.step_dir(msg["ckpt_dir"], step) if msg.get("ckpt_dir") else None
        if sdir is not None:
            replaced = store.uncommit_older(sdir) if msg.get("first_of_step", True) else None
            if replaced is not None:
                log.info("step %d was committed by generation %s; generation %d replaces it", step, replaced, gen)

        def replicate() -> contracts.Copy | None:
            t1 = time.perf_counter()
            peer, where, t["transfer_s"] = self._replicate(slot, meta)
            if peer is None:
                return None
            t["replicate_s"] = time.perf_counter() - t1
            return contracts.Copy(rank, peer["node"], contracts.Tier.MEMORY, f"{peer['addr']}#{where}")

        def persist(where: Path, tier: contracts.Tier, node: str, key: str) -> contracts.Copy | None:
            t1 = time.perf_counter()
            try:
                where.parent.mkdir(parents=True, exist_ok=True)
                store.write_bytes(where, data)
            except OSError as exc:
                unpersisted.append(self._persist_failed(job, rank, step, where, exc))
                return None
            finally:
                t[key] = time.perf_counter() - t1
            return contracts.Copy(rank, node, tier, str(where.resolve()) if tier == contracts.Tier.SHARED
                                  else str(where))

        jobs = [replicate]
        if msg.get("disk", True):
            ddir = layout.step_dir(self.disk_dir / safe_name(job), step)
            jobs.append(lambda: persist(ddir / layout.shard_name(rank), contracts.Tier.DISK, self.node, "persist_s"))
        if sdir is not None and msg.get("shared", True):
            jobs.append(lambda: persist(sdir / layout.shard_name(rank), contracts.Tier.SHARED, "shared",
                                        "shared_s"))
        results: list[Any] = [None] * len(jobs)

        def run(i: int) -> None:
            try:
                results[i] = jobs[i]()
            except BaseException as exc:  # noqa: BLE001 - raised below, on the pipeline thread
                results[i] = exc
        threads = [threading.Thread(target=run, args=(i,), name=f"ckpt-stage-{i}") for i in range(1, len(jobs))]
        for th in threads:
            th.start()
        run(0)
        for th in threads:
            th.join()
        for got in results:
            if isinstance(got, BaseException):
                raise got
            if got is not None:
                copies.append(got)
        t["persist_s"] = max(t.get("persist_s", 0.0), t.get("shared_s", 0.0))
        ready = None
        if sdir is not None:                                            # 4. commit
            self._claim(msg["ckpt_dir"], job, gen, f"the commit of step {step} of rank {rank}")
            t3 = time.perf_counter()
            # the shard manifest (small) must be written: without it the step cannot commit at all
            store.persist_shard(sdir, job=job, step=step, rank=rank, world_size=msg["world_size"],
                                node=self.node, generation=gen, data=data, digest=dig, copies=tuple(copies),
                                write_file=False)
            t["commit_s"] = time.perf_counter() - t3
            ready = store.try_commit(sdir, job=job, step=step, world_size=msg["world_size"], generation=gen,
                                     rank=rank)
        if ready is not None:                                           # 5. announce
            log.info("checkpoint step %d of job %s committed by %s (%d shards, replicated %s)",
                     step, job, self.node, len(ready.shards), ready.replicated)
            self._announce(ready, msg.get("bootstrap") or self.bootstrap)
            deleted = layout.prune(msg["ckpt_dir"], msg.get("keep", 3))
            if deleted:
                log.info("deleted checkpoint steps %s (keeping the newest %d)", deleted, msg.get("keep", 3))
        self._prune_disk(job)
        t["total_s"] = time.perf_counter() - t0
        return {"digest": dig, "committed": ready is not None, "unpersisted": unpersisted,
                "copies": [c.__dict__ | {"tier": c.tier.value} for c in copies], **t}

    def _replicate(self, slot: Slot, meta: dict) -> tuple[dict | None, str, float]:
        """Copy the shard to the first reachable peer in ring order; (peer, location, transfer s),
        or (None, "", 0) when no peer is live or none took it (logged; the step commits with
        ``replicated: false``, like a failed disk write). A peer that cannot be reached (its host is
        gone but its registry entry not yet stale) is skipped for the next one; a stale-generation
        refusal ends the save."""
        order = self.ring()
        if not order:
            log.warning("%s: no other TCE daemon is live (%s): step %d of rank %d has no peer replica", self.node,
                        "registry" if self._reader else f"runtime dir {self.runtime}", meta["step"], meta["rank"])
            return None, "", 0.0
        problems = []
        for peer in order:
            try:
                where, dt = self.replicator.replicate(peer, slot.seg, meta)
                return peer, where, dt
            except (OSError, DaemonError) as exc:
                if "stale generation" in str(exc):
                    log.error("%s: %s refused the replica of step %d of rank %d: %s", self.node, peer["node"],
                              meta["step"], meta["rank"], exc)
                    raise
                log.warning("%s: replica of step %d of rank %d to %s (%s) failed: %s; trying the next daemon "
                            "of the ring", self.node, meta["step"], meta["rank"], peer["node"], peer["addr"], exc)
                problems.append(f"{peer['node']}: {exc}")
        log.error("%s: no peer daemon took the replica of step %d of rank %d (%s): the step commits without a "
                  "peer copy (replicated=false)", self.node, meta["step"], meta["rank"], "; ".join(problems))
        return None, "", 0.0

    def _persist_failed(self, job: str, rank: int, step: int, where: Path, exc: OSError) -> str:
        """Log a failed disk or shared write once, clearly; the step goes on with its other copies."""
        code = errno.errorcode.get(exc.errno, "?") if exc.errno else "?"
        why = (f"{self.node}: could not persist step {step} of rank {rank} of job {job} to {where}: "
               f"[Errno {exc.errno} {code}] {exc.strerror or exc}; the memory copies stay valid and the "
               f"step commits without this copy (persisted=false unless another disk copy exists)")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            why += f"; free space on the file system of {where.parent}"
        log.error("%s", why)
        return why

    def _announce(self, ready: contracts.CheckpointReady, bootstrap: str | None) -> None:
        if not bootstrap:
            return
        from transom.kafka import make_producer, publish

        try:
            if self._producer is None:
                self._producer = make_producer(bootstrap)
            publish(self._producer, contracts.CHECKPOINTS, ready.job, ready)
            if self._producer.flush(2):
                log.warning("checkpoint-ready for step %d not yet delivered to %s", ready.step, bootstrap)
        except Exception as exc:  # noqa: BLE001 - the checkpoint exists; the event is a bonus
            log.warning("could not publish checkpoint-ready for step %d to %s: %s", ready.step, bootstrap, exc)

    def _prune_disk(self, job: str) -> None:
        root = self.disk_dir / safe_name(job)
        steps = sorted(p for p in root.glob("step-*") if p.is_dir())
        for p in steps[:-self.disk_keep]:
            shutil.rmtree(p, ignore_errors=True)

    def drain(self, timeout: float) -> bool:
        """Save at the fault: take no new save, let the staged ones finish every stage (hash,
        replicate, persist, commit) for up to ``timeout`` s while requests (``staged``, ``wait``,
        ``read``) are still served; True when nothing was left."""
        self.stopping = True
        t0 = time.monotonic()
        pending = self.queue.unfinished_tasks
        if pending:
            log.warning("%s: stopping: persisting %d staged save(s) first (at most %.0f s)", self.node, pending,
                        timeout)
        while self.queue.unfinished_tasks and time.monotonic() - t0 < timeout:
            time.sleep(0.02)
        left = self.queue.unfinished_tasks
        if left:
            log.error("%s: stopping after %.1f s with %d save(s) not persisted (raise --stop-timeout)",
                      self.node, time.monotonic() - t0, left)
        elif pending:
            log.warning("%s: stopping: %d staged save(s) persisted in %.2f s", self.node, pending,
                        time.monotonic() - t0)
        return not left

    def serve(self, stop_timeout: float = 30.0) -> None:
        """Run until SIGTERM or SIGINT, then drain (:meth:`drain`), remove every segment and unregister."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        self.start()
        while not stop.wait(0.5):      # a timed wait: the main thread returns to Python to run the handler
            pass
        log.info("TCE daemon of %s stopping", self.node)
        self.drain(stop_timeout)
        self.close()


def _hang_up(sock: socket.socket) -> None:
    """End a connection whose byte stream broke off: the peer gets end-of-stream at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _drain(sock: socket.socket, size: int) -> None:
    """Read and drop ``size`` bytes (a refused replica's payload), so the refusal reaches the sender."""
    buf = bytearray(min(size, 8 << 20) or 1)
    left = size
    while left > 0:
        k = sock.recv_into(memoryview(buf)[:min(left, len(buf))])
        if k == 0:
            return
        left -= k


def main(args: argparse.Namespace) -> int:
    CheckpointServer(args.node, args.runtime, disk_dir=args.disk_dir, host=args.host, port=args.port,
                     transport=args.transport, protocol=args.protocol, mem_keep=args.mem_keep,
                     disk_keep=args.disk_keep, max_bytes=args.max_bytes, bootstrap=args.bootstrap,
                     advertise=args.advertise).serve(args.stop_timeout)
    return 0
