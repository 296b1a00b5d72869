"""Shard digests: what vouches that a copy is the bytes that were saved.

A digest is a string ``ALG:HEX``, recorded in the shard manifest (``contracts.Shard.digest``):

- ``xxh3-128/c<N>``, the default: the shard is cut into chunks of ``N`` bytes (16 MiB), each
  chunk gets its XXH3-128, and the digest is the XXH3-128 of those chunk digests in order. XXH3
  runs at ~20-30 GB/s on one core here (sha256: ~1.2-1.7 GB/s), so verifying never caps a
  restore or a replica at link speed; chunks are hashed as they arrive (:class:`StreamDigest`,
  on its own thread, overlapped with the receive or read), and a torn, truncated or altered chunk
  changes the digest, so such a copy is refused like before. XXH3 is not a cryptographic hash: it
  detects corruption, not forgery; forgery is kept out by authenticating the daemons (see
  docs/security.md) and by the shared directory's permissions.
- ``sha256``: what checkpoints written before the manifest recorded an algorithm carry (their
  manifest has only the ``sha256`` field); they load and verify as before.

:func:`digest_of` hashes a buffer at once (the chunks in parallel threads when the buffer is
big: xxhash releases the GIL); :func:`StreamDigest` hashes it piece by piece.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["DEFAULT", "CHUNK", "digest_of", "chunk_digests", "chunk_digest", "combine", "StreamDigest", "algorithm",
           "spec"]

CHUNK = 16 << 20
DEFAULT = f"xxh3-128/c{CHUNK}"
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def algorithm(digest: str) -> str:
    """The algorithm part of ``digest`` ("xxh3-128/c16777216", "sha256")."""
    return digest.split(":", 1)[0]


def spec(alg: str) -> tuple[str, int]:
    """(family, chunk bytes) of an algorithm name; ValueError when unknown."""
    if alg == "sha256":
        return "sha256", 0
    fam, _, rest = alg.partition("/c")
    if fam != "xxh3-128" or not rest.isdigit() or int(rest) <= 0:
        raise ValueError(f"unknown shard digest algorithm {alg!r} (known: xxh3-128/c<chunk bytes>, sha256)")
    return fam, int(rest)


def _xxh3():
    import xxhash

    return xxhash.xxh3_128


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="digest")
        return _pool


def chunk_digests(buf: bytes | bytearray | memoryview, alg: str = DEFAULT) -> list[bytes]:
    """The XXH3-128 of each ``alg`` chunk of ``buf``, in order (the chunks in parallel threads when
    the buffer is big: xxhash releases the GIL); what a daemon sends ahead of a shard so that the
    reader can verify every chunk before it uses it (:func:`combine` of them is the shard's digest)."""
    fam, chunk = spec(alg)
    if fam == "sha256":
        raise ValueError("sha256 digests have no chunks")
    h = _xxh3()
    mv = memoryview(buf).cast("B")
    bounds = range(0, max(len(mv), 1), chunk)
    if len(bounds) > 4:
        return list(_executor().map(lambda lo: h(mv[lo:lo + chunk]).digest(), bounds))
    return [h(mv[lo:lo + chunk]).digest() for lo in bounds]


def combine(alg: str, parts: list[bytes]) -> str:
    """The shard digest made of its chunk digests ``parts`` (see :func:`chunk_digests`)."""
    return f"{alg}:{_xxh3()(b''.join(parts)).hexdigest()}"


def chunk_digest(*pieces: bytes | bytearray | memoryview) -> bytes:
    """The XXH3-128 of one chunk, given whole or as the pieces it is made of, in order."""
    h = _xxh3()()
    for piece in pieces:
        h.update(piece)
    return h.digest()


def digest_of(buf: bytes | bytearray | memoryview, alg: str = DEFAULT) -> str:
    """The digest of ``buf`` under ``alg`` (default :data:`DEFAULT`)."""
    fam, _ = spec(alg)
    if fam == "sha256":
        return f"sha256:{hashlib.sha256(buf).hexdigest()}"
    return combine(alg, chunk_digests(buf, alg))


class StreamDigest:
    """The digest of bytes fed in order, piece by piece, computed on its own thread: ``feed(view)``
    each piece as it lands (the view must stay valid), ``hexdigest()`` after the last."""

    def __init__(self, alg: str = DEFAULT) -> None:
        self.alg = alg
        self._fam, self._chunk = spec(alg)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._t = threading.Thread(target=self._run, name="digest", daemon=True)
        self._t.start()
        self._result = ""
        self.parts: list[bytes] | None = None       # the chunk digests, after hexdigest() (XXH3 only)

    def _run(self) -> None:
        if self._fam == "sha256":
            s = hashlib.sha256()
            while (piece := self._q.get()) is not None:
                s.update(piece)
            self._result = f"sha256:{s.hexdigest()}"
            return
        h = _xxh3()
        parts, cur, filled = [], h(), 0
        while (piece := self._q.get()) is not None:
            mv = memoryview(piece).cast("B")
            while len(mv):
                take = min(len(mv), self._chunk - filled)
                cur.update(mv[:take])
                filled += take
                mv = mv[take:]
                if filled == self._chunk:
                    parts.append(cur.digest())
                    cur, filled = h(), 0
        if filled or not parts:
            parts.append(cur.digest())
        self.parts = parts
        self._result = f"{self.alg}:{h(b''.join(parts)).hexdigest()}"

    def feed(self, piece: memoryview) -> None:
        self._q.put(piece)

    def hexdigest(self) -> str:
        self._q.put(None)
        self._t.join()
        return self._result
