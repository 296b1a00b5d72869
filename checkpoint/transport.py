"""Stage 3, replicate: copy a staged shard into the ring neighbour daemon's memory.

A :class:`Replicator` has one job, ``replicate(peer, segment, meta) -> seconds of transfer``; the
neighbour daemon allocates the replica segment, receives the bytes and verifies their sha256
before it answers, so a replica that exists is never torn.

- :class:`MooncakeReplicator`: the Mooncake Transfer Engine (``mooncake-transfer-engine``), peer
  to peer handshake, protocol ``rdma`` where the host has HCAs (``/sys/class/infiniband``), else
  ``tcp``. The source segment and the replica segment are registered memory; the bytes move with
  one ``transfer_sync_write``.
- :class:`TcpReplicator`: the fallback when Mooncake is not installed: the shard's file is sent
  with ``sendfile`` over the daemons' own TCP connection.

``make_replicator("auto" | "mooncake" | "tcp", ...)`` picks one; ``auto`` takes Mooncake when it
imports and says which it took.
"""

from __future__ import annotations

import abc
import os
import threading
import time
from typing import Any

from transom.config import ConfigError
from transom.log import get

from .segments import Segment
from .wire import Conn, DaemonError, send_file, send_msg, recv_msg

__all__ = ["Replicator", "TcpReplicator", "MooncakeReplicator", "make_replicator", "detect_protocol",
           "MooncakeEndpoint"]

log = get("checkpoint.transport")


def detect_protocol() -> str:
    """``rdma`` when the host has an InfiniBand/RoCE device, else ``tcp``."""
    try:
        return "rdma" if os.listdir("/sys/class/infiniband") else "tcp"
    except OSError:
        return "tcp"


class MooncakeEndpoint:
    """This daemon's Mooncake Transfer Engine: initialised once, memory registered once per segment."""

    def __init__(self, host: str, protocol: str) -> None:
        from mooncake.engine import TransferEngine   # ImportError when not installed

        # Mooncake's TCP transport moves a transfer in slices; bigger ones than its default cost
        # fewer round trips for checkpoint-sized transfers (an operator's setting wins)
        os.environ.setdefault("MC_TCP_SLICE_SIZE", str(16 << 20))

        self.protocol = protocol
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise DaemonError(f"Mooncake Transfer Engine failed to initialise (protocol {protocol}, rc {rc})")
        self.name = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()

    def register(self, seg: Segment) -> int:
        with self._lock:
            addr = seg.addr
            if self._registered.get(addr) != seg.capacity:
                rc = self.engine.register_memory(addr, seg.capacity)
                if rc != 0:
                    raise DaemonError(f"Mooncake could not register {seg.path} ({seg.capacity} bytes): rc {rc}")
                self._registered[addr] = seg.capacity
            return addr

    def unregister(self, seg: Segment) -> None:
        with self._lock:
            if seg._addr is not None and self._registered.pop(seg._addr, None) is not None:
                self.engine.unregister_memory(seg._addr)


class Replicator(abc.ABC):
    name: str

    @abc.abstractmethod
    def replicate(self, peer: dict[str, Any], seg: Segment, meta: dict[str, Any]) -> tuple[str, float]:
        """Copy ``meta['size']`` bytes of ``seg`` to ``peer``; return (replica location, transfer s)."""


class TcpReplicator(Replicator):
    name = "tcp"

    def replicate(self, peer: dict[str, Any], seg: Segment, meta: dict[str, Any]) -> tuple[str, float]:
        conn = Conn(peer["addr"], timeout=10)
        try:
            t0 = time.perf_counter()
            send_msg(conn.sock, {"op": "replica_put", **meta})
            send_file(conn.sock, str(seg.path), meta["size"])
            reply = recv_msg(conn.sock)
            dt = time.perf_counter() - t0
        finally:
            conn.close()
        if not reply or reply.get("error"):
            raise DaemonError(f"replica to {peer['node']} refused: {reply and reply.get('error')}")
        return reply["path"], reply.get("transfer_s", dt)


class MooncakeReplicator(Replicator):
    name = "mooncake"

    def __init__(self, endpoint: MooncakeEndpoint) -> None:
        self.endpoint = endpoint

    def replicate(self, peer: dict[str, Any], seg: Segment, meta: dict[str, Any]) -> tuple[str, float]:
        if not peer.get("mooncake"):
            raise DaemonError(f"neighbour {peer['node']} has no Mooncake endpoint (it runs the tcp "
                              f"transport): start every daemon with the same --transport")
        conn = Conn(peer["addr"], timeout=10)
        try:
            alloc = conn.call({"op": "replica_alloc", **meta})
            src = self.endpoint.register(seg)
            t0 = time.perf_counter()
            rc = self.endpoint.engine.transfer_sync_write(peer["mooncake"], src, alloc["addr"], meta["size"])
            dt = time.perf_counter() - t0
            if rc != 0:
                conn.call({"op": "replica_abort", "path": alloc["path"]})
                raise DaemonError(f"Mooncake transfer to {peer['node']} failed: rc {rc}")
            done = conn.call({"op": "replica_done", "path": alloc["path"], **meta})
        finally:
            conn.close()
        return done["path"], dt


def make_replicator(kind: str, host: str, protocol: str = "auto") -> tuple[Replicator, MooncakeEndpoint | None]:
    if kind not in ("auto", "mooncake", "tcp"):
        raise ConfigError(f"--transport: expected auto, mooncake or tcp, got {kind!r}")
    if protocol not in ("auto", "tcp", "rdma"):
        raise ConfigError(f"--protocol: expected auto, tcp or rdma, got {protocol!r}")
    if kind in ("auto", "mooncake"):
        proto = detect_protocol() if protocol == "auto" else protocol
        try:
            ep = MooncakeEndpoint(host, proto)
            log.info("replication: Mooncake Transfer Engine, protocol %s, endpoint %s", proto, ep.name)
            return MooncakeReplicator(ep), ep
        except ImportError:
            if kind == "mooncake":
                raise ConfigError("--transport mooncake: the Mooncake Transfer Engine is not installed "
                                  "(pip install mooncake-transfer-engine, or "
                                  "mooncake-transfer-engine-non-cuda on hosts without CUDA)") from None
            log.info("replication: Mooncake is not installed: using the plain TCP transport")
    return TcpReplicator(), None
