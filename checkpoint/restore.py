"""Restore into the caller's tensors: ``CheckpointEngine.load(into=state)``.

A restore into new memory spends nearly all its time in the kernel faulting in and zeroing the
pages the bytes land in (docs/checkpoint.md, Restore). A relaunched or spare rank has built its
model (and often its optimizer) already: their tensors' pages are touched. ``load(into=state)``
lays the shard's bytes straight into the tensors of ``state`` that match (same place in the
nesting, same dtype and shape, contiguous, on the CPU); a saved tensor without a match gets a
tensor of its own, and the non-tensor leaves come from the checkpoint, as with a plain ``load()``.

No unverified byte is returned as a checkpoint. From a peer's memory the daemon sends the XXH3
digests of the shard's 16 MiB chunks ahead of the bytes; the reader checks that they make up the
manifest's digest. The chunks up to the end of the shard's header land in a small staging buffer
that stays warm (three chunks, reused) and are verified before the header is read. From then on
each chunk's bytes are received straight into the tensors they belong to (pieces of at least
:data:`DIRECT_MIN` bytes: the raw socket's one copy, no second pass over the bytes) and the rest
into a staging buffer; a second thread checks the chunk's digest while the next chunk arrives,
then copies its staged pieces into place (:func:`read_peer_into`). A corrupt or torn chunk stops
the read and the copy is refused: the tensors then hold some of its bytes (verified or not), the
next copy overwrites every byte again, and a caller left with no checkpoint at all is told by
``engine.into_touched`` to re-initialise them. The other tiers (and a daemon that sends no chunk
digests, and sha256 checkpoints) are verified whole, as before, then copied into place
(:class:`Scatter`).
"""

from __future__ import annotations

import bisect
import queue
import threading
from typing import Any

import torch

from . import shardfmt, store
from .digest import StreamDigest, algorithm, chunk_digest, combine, spec
from .errors import CheckpointError, CorruptCheckpoint
from .wire import Conn, recv_exact_into, recv_msg, send_msg

__all__ = ["Scatter", "read_peer_into", "Staging", "DIRECT_MIN"]

#: a tensor piece of at least this many bytes is received straight into the tensor; smaller ones
#: (biases, norms, scalars) go through a staging buffer, so a shard of many small tensors is not
#: received in as many small reads
DIRECT_MIN = 1 << 20


def _match(skel: Any, into: Any, found: dict[int, torch.Tensor]) -> None:
    if isinstance(skel, shardfmt.TensorRef):
        if isinstance(into, torch.Tensor) and not shardfmt._is_dtensor(into) and into.device.type == "cpu" \
                and into.is_contiguous():
            found[skel.index] = into
    elif isinstance(skel, dict) and isinstance(into, dict):
        for k, v in skel.items():
            if k in into:
                _match(v, into[k], found)
    elif isinstance(skel, (list, tuple)) and isinstance(into, (list, tuple)) and len(skel) == len(into):
        for a, b in zip(skel, into):
            _match(a, b, found)


class Scatter:
    """Lays a shard's bytes, fed in order (:meth:`put`), into ``into``'s tensors; :meth:`finish`
    returns the state. Every byte fed must already be verified."""

    def __init__(self, into: Any, size: int, where: str) -> None:
        self.into, self.size, self.where = into, size, where
        self.head = bytearray()
        self.skel: Any = None
        self.tensors: list[torch.Tensor] = []
        self._los: list[int] = []
        self._spans: list[tuple[int, int, torch.Tensor]] = []
        self.pos = 0
        self.reused = 0          # bytes laid into the caller's tensors
        self.fresh = 0           # bytes of saved tensors without a match (new tensors)

    def _plan(self) -> None:
        try:
            skel, entries = shardfmt.parse(self.head, self.size)
        except Exception as exc:  # noqa: BLE001 - any parse failure means the copy is unusable
            raise CorruptCheckpoint(self.where, f"unreadable shard: {type(exc).__name__}: {exc}") from None
        found: dict[int, torch.Tensor] = {}
        _match(skel, self.into, found)
        used: set[int] = set()
        self.tensors = [None] * len(entries)  # type: ignore[list-item]
        spans = []
        for i, lo, hi, dt, shape in entries:
            t = found.get(i)
            if t is None or t.dtype != dt or list(t.shape) != list(shape) or id(t) in used \
                    or t.numel() * t.element_size() != hi - lo:
                t = torch.empty(shape, dtype=dt)
                self.fresh += hi - lo
            else:
                used.add(id(t))
                self.reused += hi - lo
            self.tensors[i] = t
            if hi > lo:
                spans.append((lo, hi, t.detach().reshape(-1).view(torch.uint8)))
        spans.sort(key=lambda s: s[0])
        self._spans, self._los = spans, [s[0] for s in spans]
        self.skel = skel

    def put(self, lo: int, piece: memoryview) -> None:
        """Bytes ``[lo, lo + len(piece))`` of the shard (``lo``: where the previous piece ended)."""
        n = len(piece)
        if lo != self.pos:
            raise CheckpointError(f"{self.where}: bytes at {lo} fed after {self.pos}")
        at = 0
        while self.skel is None and at < n:
            want = 8 if len(self.head) < 8 else shardfmt.header_size(self.head)
            k = min(want - len(self.head), n - at)
            self.head += piece[at:at + k]
            at += k
            if len(self.head) >= 8 and len(self.head) == shardfmt.header_size(self.head):
                self._plan()
        if self.skel is not None and at < n:
            self.place(lo + at, piece[at:])
        self.pos = lo + n

    def place(self, lo: int, piece: memoryview) -> None:
        """Copy the verified bytes ``[lo, lo + len(piece))`` of the shard into their tensors (after
        the header: :meth:`put` planned the layout)."""
        end = lo + len(piece)
        src = torch.frombuffer(piece, dtype=torch.uint8) if len(piece) else None
        i = max(bisect.bisect_right(self._los, lo) - 1, 0)
        with torch.no_grad():
            while i < len(self._spans):
                s_lo, s_hi, dst = self._spans[i]
                if s_lo >= end:
                    break
                a, b = max(s_lo, lo), min(s_hi, end)
                if a < b:
                    dst[a - s_lo:b - s_lo].copy_(src[a - lo:b - lo])
                i += 1

    def runs(self, lo: int, n: int, direct_min: int) -> list[tuple[int, int, memoryview | None]]:
        """Bytes ``[lo, lo + n)`` (after the header) cut in runs ``(a, b, view)``: ``view`` is the
        memory of the tensor they belong to when that piece is at least ``direct_min`` bytes (the
        bytes are received straight into it), None for the rest (small tensors, gaps: received into
        a staging buffer and copied in once verified, :meth:`place`). Consecutive staged pieces make
        one run. Marks the bytes as fed."""
        if lo != self.pos or self.skel is None:
            raise CheckpointError(f"{self.where}: bytes at {lo} fed after {self.pos}")
        end, out, at = lo + n, [], lo
        i = max(bisect.bisect_right(self._los, lo) - 1, 0)
        while i < len(self._spans) and at < end:
            s_lo, s_hi, dst = self._spans[i]
            i += 1
            a, b = max(s_lo, at), min(s_hi, end)
            if b - a < direct_min:
                continue                          # staged with what surrounds it
            if a > at:
                out.append((at, a, None))
            out.append((a, b, memoryview(dst[a - s_lo:b - s_lo].numpy())))
            at = b
        if at < end:
            out.append((at, end, None))
        self.pos = end
        return out

    def finish(self) -> Any:
        if self.skel is None or self.pos != self.size:
            raise CorruptCheckpoint(self.where, f"{self.pos} of {self.size} bytes laid out")
        return shardfmt._rebuild(self.skel, self.tensors)


class Staging:
    """Three chunk-sized buffers, touched once, reused by every restore of an engine."""

    def __init__(self) -> None:
        self.size = 0
        self.bufs: list[bytearray] = []

    def get(self, chunk: int) -> list[memoryview]:
        if self.size != chunk:
            self.bufs, self.size = [bytearray(chunk) for _ in range(3)], chunk
        return [memoryview(b) for b in self.bufs]


def read_peer_into(addr: str, job: str, rank: int, step: int, shard: Any, node: str, scatter: Scatter,
                   staging: Staging, stall_s: float) -> bool:
    """Lay rank ``rank``'s shard from the peer daemon at ``addr`` into ``scatter``, each chunk
    verified while the next arrives; False when the peer has no such copy."""
    where = f"memory of {node} ({addr})"
    conn = Conn(addr, timeout=5)
    try:
        send_msg(conn.sock, {"op": "read", "job": job, "rank": rank, "step": step, "digest": shard.checksum,
                             "chunks": True})
        head = recv_msg(conn.sock)
        if not head or not head.get("found"):
            return False
        if head["size"] != shard.size:
            raise CorruptCheckpoint(where, f"{head['size']} bytes, manifest says {shard.size}")
        conn.sock.settimeout(stall_s)       # a daemon that stops sending mid-stream: the next copy
        alg = algorithm(shard.checksum)
        if not head.get("chunks"):          # an older daemon, or a sha256 checkpoint: verified whole
            _whole(conn, shard, scatter, where, alg)
            return True
        _, csize = spec(alg)
        parts = [bytes.fromhex(c) for c in head["chunks"]]
        if len(parts) != max(1, -(-shard.size // csize)):
            raise CorruptCheckpoint(where, f"{len(parts)} chunk digests for {shard.size} bytes")
        store.check_digest(combine(alg, parts), shard, where)      # the list is the manifest's digest
        _chunked(conn, shard.size, csize, parts, scatter, staging.get(csize), where, alg)
        return True
    finally:
        conn.close()


def _whole(conn: Conn, shard: Any, scatter: Scatter, where: str, alg: str) -> None:
    from .segments import alloc_buffer

    buf = alloc_buffer(shard.size)
    hasher = StreamDigest(alg)
    try:
        recv_exact_into(conn.sock, memoryview(buf)[:shard.size], hasher.feed)
    except (OSError, ValueError):
        hasher.hexdigest()
        raise
    store.check_digest(hasher.hexdigest(), shard, where)
    scatter.put(0, memoryview(buf)[:shard.size])


def _chunked(conn: Conn, size: int, csize: int, parts: list[bytes], scatter: Scatter, slots: list[memoryview],
             where: str, alg: str) -> None:
    """Receive chunk k+1 while chunk k is verified (its own thread). The chunks up to the end of
    the shard's header are received into a staging buffer, verified and laid out here (the header
    says where every tensor's bytes go); from then on a chunk's big tensor pieces are received
    straight into their tensors and its small ones into a staging buffer, which the thread copies
    into place once the chunk verifies."""
    free: queue.SimpleQueue = queue.SimpleQueue()
    for s in slots:
        free.put(s)
    work: queue.SimpleQueue = queue.SimpleQueue()
    error: list[BaseException] = []

    def refuse(k: int, lo: int, n: int) -> CorruptCheckpoint:
        return CorruptCheckpoint(where, f"digest mismatch ({alg}): chunk {k} (bytes {lo}-{lo + n}) is not the "
                                        f"one the manifest vouches for")

    def verify() -> None:
        while (item := work.get()) is not None:
            k, lo, n, slot, runs = item
            try:
                if not error:
                    if chunk_digest(*(view if view is not None else slot[a - lo:b - lo]
                                      for a, b, view in runs)) != parts[k]:
                        raise refuse(k, lo, n)
                    for a, b, view in runs:
                        if view is None:
                            scatter.place(a, slot[a - lo:b - lo])
            except BaseException as exc:  # noqa: BLE001 - raised by the receiving thread
                error.append(exc)
            finally:
                free.put(slot)

    t = threading.Thread(target=verify, name="restore-verify", daemon=True)
    t.start()
    try:
        for k, lo in enumerate(range(0, size, csize)):
            slot = free.get()
            if error:
                break
            n = min(csize, size - lo)
            if scatter.skel is None:              # the header's chunks: verified and laid out here
                recv_exact_into(conn.sock, slot[:n])
                if chunk_digest(slot[:n]) != parts[k]:
                    free.put(slot)
                    raise refuse(k, lo, n)
                scatter.put(lo, slot[:n])
                free.put(slot)
                continue
            runs = scatter.runs(lo, n, DIRECT_MIN)
            for a, b, view in runs:
                recv_exact_into(conn.sock, view if view is not None else slot[a - lo:b - lo])
            work.put((k, lo, n, slot, runs))
    finally:
        work.put(None)
        t.join()                      # nothing is written into the tensors after this returns
    if error:
        raise error[0]
