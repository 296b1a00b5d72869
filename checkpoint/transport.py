"""Stage 3, replicate: copy a staged shard into the ring neighbour daemon's memory.

A :class:`Replicator` has one job, ``replicate(peer, segment, meta) -> seconds of transfer``; the
neighbour daemon allocates the replica segment, receives the bytes and verifies their digest
before it answers, so a replica that exists is never torn.

- :class:`MooncakeReplicator`: the Mooncake Transfer Engine (``mooncake-transfer-engine``), peer
  to peer handshake, protocol ``rdma`` where the host has an RDMA device with an active port
  (``/sys/class/infiniband/*/ports/*/state``), else ``tcp``. The source segment and the replica
  segment are registered memory; the bytes move with one ``transfer_sync_write``.
- :class:`TcpReplicator`: Transom's own TCP transport: the shard goes out of the daemon's mapping
  of its segment in 8 MiB ``sendall`` calls (:func:`.wire.send_view`; ``sendfile`` of the
  segment's file measured 1.4-1.5x slower over loopback here) over one daemon-to-daemon
  connection (the kernel's autotuned socket buffers), and is received straight into the replica
  segment, its digest computed while it arrives. Alone it measured 0.9-1.0x a raw socket here;
  Mooncake's tcp protocol 0.5-0.67x.

``make_replicator("auto" | "mooncake" | "tcp", ...)`` picks one: ``auto`` takes Mooncake's RDMA
transport when the host has an active RDMA port and Mooncake imports, Transom's TCP transport
otherwise, and says which it took and why. ``mooncake`` is Mooncake whatever the hardware
(protocol ``tcp`` without RDMA: an explicit choice).
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
from .wire import Conn, DaemonError, send_msg, send_view, recv_msg

__all__ = ["Replicator", "TcpReplicator", "MooncakeReplicator", "make_replicator", "detect_protocol",
           "MooncakeEndpoint", "rdma_ports", "tune"]

log = get("checkpoint.transport")


def rdma_ports(root: str = "/sys/class/infiniband") -> list[str]:
    """``device/port`` of every InfiniBand/RoCE port whose state is ACTIVE."""
    out = []
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return out
    for dev in devices:
        try:
            ports = sorted(os.listdir(os.path.join(root, dev, "ports")))
        except OSError:
            continue
        for port in ports:
            try:
                with open(os.path.join(root, dev, "ports", port, "state")) as f:
                    if "ACTIVE" in f.read():
                        out.append(f"{dev}/{port}")
            except OSError:
                continue
    return out


def detect_protocol(root: str = "/sys/class/infiniband") -> str:
    """``rdma`` when the host has an RDMA device with an active port, else ``tcp``."""
    return "rdma" if rdma_ports(root) else "tcp"


def tune(sock) -> None:
    """Socket settings for bulk transfers: none. Setting SO_SNDBUF / SO_RCVBUF turns off the
    kernel's buffer autotuning (tcp_wmem / tcp_rmem, up to 4-6 MiB) and is capped at
    net.core.wmem_max / rmem_max (208 KiB by default): measured 2-6x slower here."""


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
        tune(conn.sock)
        try:
            t0 = time.perf_counter()
            send_msg(conn.sock, {"op": "replica_put", **meta})
            view = seg.view(meta["size"])
            try:
                send_view(conn.sock, view)          # from the daemon's mapping of the segment
            finally:
                view.release()
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


def make_replicator(kind: str, host: str, protocol: str = "auto",
                    ib_root: str = "/sys/class/infiniband") -> tuple[Replicator, MooncakeEndpoint | None]:
    if kind not in ("auto", "mooncake", "tcp"):
        raise ConfigError(f"--transport: expected auto, mooncake or tcp, got {kind!r}")
    if protocol not in ("auto", "tcp", "rdma"):
        raise ConfigError(f"--protocol: expected auto, tcp or rdma, got {protocol!r}")
    if kind == "tcp":
        return TcpReplicator(), None
    proto = detect_protocol(ib_root) if protocol == "auto" else protocol
    if kind == "auto" and proto != "rdma":
        log.info("replication: Transom's TCP transport (no active RDMA port in %s)", ib_root)
        return TcpReplicator(), None
    try:
        ep = MooncakeEndpoint(host, proto)
    except ImportError:
        if kind == "mooncake":
            raise ConfigError("--transport mooncake: the Mooncake Transfer Engine is not installed "
                              "(pip install mooncake-transfer-engine, or "
                              "mooncake-transfer-engine-non-cuda on hosts without CUDA)") from None
        log.warning("replication: RDMA ports %s but Mooncake is not installed: using Transom's TCP "
                    "transport (pip install 'transom[mooncake]')", ", ".join(rdma_ports(ib_root)))
        return TcpReplicator(), None
    log.info("replication: Mooncake Transfer Engine, protocol %s, endpoint %s", proto, ep.name)
    return MooncakeReplicator(ep), ep
