"""Stages 2 and 3, persist and commit, and the verified read that load() builds on.

- :func:`persist_shard`: write a shard's bytes (:mod:`.shardfmt`, safetensors) to a temp file in
  the step dir, fsync, rename to ``rank-XXXXX.safetensors``; then its size, digest (:mod:`.digest`) and every copy
  of it (memory on two nodes, local disk, shared) go into ``rank-XXXXX.json``, written the same way.
- :func:`uncommit_older`: a step re-saved by a later launch loses its old manifest first.
- :func:`try_commit`: once every rank's shard manifest of the step exists (same generation and
  world size), exactly one caller wins an ``O_EXCL`` lock file and writes ``manifest.json``
  atomically; the others get None. A committer that dies between the lock and the manifest
  leaves that step uncommitted for this generation (the next saved step commits as usual).
  The manifest's ``copies`` are the union of the ranks' copies; ``replicated`` means every rank's
  shard is in memory on two nodes, ``persisted`` that every rank has a disk or shared copy.
- :func:`claim_generation`: ``DIR/.generation`` holds, per job, the newest launch generation that
  wrote to the directory; a write of an older one is refused (:class:`StaleGeneration`), so ranks
  and daemons of a replaced launch (a host cut off, then back) cannot commit over the new one.
- :func:`verify_shard` / :func:`read_shard`: refuse a missing, truncated or altered shard with
  :class:`CorruptCheckpoint` naming the file and what is wrong.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import Any

from transom import contracts

from . import layout
from .digest import StreamDigest, algorithm
from .errors import CorruptCheckpoint, StaleGeneration

__all__ = ["claim_generation", "newest_generation", "GENERATION_FILE", "persist_shard", "write_bytes", "uncommit_older",
           "try_commit", "verify_shard", "read_verified", "read_shard", "check_digest"]


GENERATION_FILE = ".generation"


def claim_generation(directory: str | os.PathLike, job: str, generation: int, what: str = "a write") -> int:
    """Record ``generation`` as the newest of ``job`` in ``directory`` unless a newer one is recorded
    there; return the newest. Raise :class:`StaleGeneration` when ``generation`` is older than it.

    ``DIR/.generation`` is a JSON object, job -> newest generation (a directory reused by another
    job is not refused). Read-modify-write under an ``flock`` of the file, so two launches racing
    both end with the larger.
    """
    import fcntl

    path = Path(directory) / GENERATION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with os.fdopen(os.dup(fd), "rb") as f:
            table = _generations(f.read())
        newest = table.get(job, -1)
        if generation < newest:
            raise StaleGeneration(job, generation, newest, what)
        if generation > newest:
            table[job] = newest = generation
            raw = json.dumps(table, sort_keys=True).encode() + b"\n"
            os.ftruncate(fd, 0)
            os.pwrite(fd, raw, 0)
            os.fsync(fd)
        return newest
    finally:
        os.close(fd)


def _generations(raw: bytes) -> dict[str, int]:
    try:
        table = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return {str(k): v for k, v in table.items() if isinstance(v, int)} if isinstance(table, dict) else {}


def newest_generation(directory: str | os.PathLike, job: str) -> int:
    """The generation :func:`claim_generation` recorded for ``job`` in ``directory``, -1 when none."""
    try:
        return _generations((Path(directory) / GENERATION_FILE).read_bytes()).get(job, -1)
    except OSError:
        return -1


def persist_shard(sdir: Path, *, job: str, step: int, rank: int, world_size: int, node: str,
                  generation: int, data: memoryview, digest: str,
                  copies: tuple[contracts.Copy, ...] = (), write_file: bool = True) -> contracts.Shard:
    """Write this rank's shard bytes (unless ``write_file`` is false: the bytes live elsewhere) and
    its shard manifest, with every copy of it, into ``sdir``; return the shard record."""
    sdir.mkdir(parents=True, exist_ok=True)
    name = layout.shard_name(rank)
    if write_file:
        write_bytes(sdir / name, data)
        copies = (*copies, contracts.Copy(rank=rank, node="shared", tier=contracts.Tier.SHARED,
                                          location=str((sdir / name).resolve())))
    shard = contracts.Shard(rank=rank, name=name, size=len(data), digest=digest)
    record = {"v": contracts.SCHEMA_VERSION, "job": job, "step": step, "rank": rank,
              "world_size": world_size, "node": node, "generation": generation, "ts": time.time(),
              "name": shard.name, "size": shard.size, "digest": shard.digest,
              "copies": [{"rank": c.rank, "node": c.node, "tier": c.tier.value, "location": c.location}
                         for c in copies]}
    layout.atomic_write_bytes(sdir / layout.rank_manifest_name(rank), contracts.encode(record))
    return shard


#: O_DIRECT needs the buffer's address, the length and the file offset aligned to the device's block
_DIRECT_ALIGN = 4096
_CHUNK = 64 << 20


def _address(mv: memoryview) -> int | None:
    import ctypes

    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    except (TypeError, ValueError, BufferError):       # read-only or not contiguous: no O_DIRECT
        return None


def write_bytes(path: Path, data: memoryview) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename, fsync dir).

    A buffer at a page-aligned address (a daemon's segment) goes to the disk with ``O_DIRECT``, its
    aligned bulk read by the disk's DMA straight from the segment: no copy into the page cache, and
    no writeback by the kernel's flusher threads later, both CPU time taken from the training ranks
    beside the daemon (256 MiB here: 0.12 s and ~0 CPU against 0.3-2 s and 0.07-0.3 s of the
    daemon's CPU plus the flushers' through the page cache). The unaligned tail, other buffers and
    file systems without ``O_DIRECT`` go through the page cache. Durable the same way: fsync before
    the rename either way."""
    mv = memoryview(data).cast("B")
    addr = _address(mv) if len(mv) >= _DIRECT_ALIGN else None
    if addr is None or addr % _DIRECT_ALIGN or not hasattr(os, "O_DIRECT"):
        def write(f) -> None:
            pos = 0
            while pos < len(mv):
                pos += f.write(mv[pos:pos + _CHUNK])
        layout.atomic_write(path, write)
        return
    import fcntl

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    bulk = len(mv) - len(mv) % _DIRECT_ALIGN
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:         # EINVAL: this file system has no O_DIRECT
                raise
            fd, bulk = os.open(tmp, flags, 0o644), 0
        try:
            pos = 0
            while pos < bulk:
                try:
                    pos += os.write(fd, mv[pos:min(bulk, pos + _CHUNK)])
                except OSError as exc:
                    if exc.errno != errno.EINVAL:      # EINVAL: an alignment this device refuses
                        raise
                    break
            if bulk:                               # the rest through the page cache
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            while pos < len(mv):
                pos += os.write(fd, mv[pos:pos + _CHUNK])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    layout._fsync_dir(path.parent)


def uncommit_older(sdir: Path) -> int | str | None:
    """Remove the manifest.json of an earlier launch before this launch re-saves the step; return
    that launch's generation ("unreadable" if the manifest was), None when there was none.

    Each launch saves a step once, so a manifest present at save time is always an earlier
    launch's. Launches are told apart by generation: two launches that share one leave the
    later one open to committing the earlier one's stray shards of an unfinished step.
    """
    try:
        old: int | str = layout.read_manifest(sdir).generation
    except FileNotFoundError:
        return None
    except (OSError, contracts.ContractError):
        old = "unreadable"
    (sdir / layout.MANIFEST).unlink(missing_ok=True)
    for lock in sdir.glob(".commit-g*.lock"):   # a launch that reused the generation commits anew
        lock.unlink(missing_ok=True)
    return old


def try_commit(sdir: Path, *, job: str, step: int, world_size: int, generation: int,
               rank: int) -> contracts.CheckpointReady | None:
    """Commit the step if every rank's shard is there and nobody else did; return the manifest.

    Shard manifests of another generation or world size (left by an earlier launch that died
    mid-save) do not count: the step waits until this launch's rank overwrites them.
    """
    shards, copies = [], []
    for r in range(world_size):
        d = layout.read_rank_manifest(sdir / layout.rank_manifest_name(r))
        if d is None or d.get("generation") != generation or d.get("world_size") != world_size \
                or d.get("step") != step:
            return None
        shards.append(contracts.Shard.from_dict(d, f"shard manifest of rank {r}"))
        copies += [contracts.Copy.from_dict(c) for c in d.get("copies", ())]
    lock = sdir / f".commit-g{generation:05d}.lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    try:
        os.write(fd, f"rank {rank} pid {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    replicated = all(len({c.node for c in copies if c.rank == r and c.tier == contracts.Tier.MEMORY}) >= 2
                     for r in range(world_size))
    persisted = all(any(c.rank == r and c.tier != contracts.Tier.MEMORY for c in copies)
                    for r in range(world_size))
    ready = contracts.CheckpointReady(
        job=job, step=step, world_size=world_size, shards=tuple(shards), copies=tuple(copies),
        replicated=replicated, persisted=persisted, ts=time.time(), generation=generation)
    layout.atomic_write_bytes(sdir / layout.MANIFEST, contracts.encode(ready))
    return ready


def verify_shard(sdir: Path, shard: contracts.Shard) -> Path:
    """Check the shard file against its manifest entry (size, then digest); return its path."""
    read_verified(sdir / shard.name, shard)
    return sdir / shard.name


def read_verified(path: Path, shard: contracts.Shard):
    """The bytes of a shard file (a writable buffer, hashed while it is read), refused with
    :class:`CorruptCheckpoint` unless size and digest match."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CorruptCheckpoint(str(path), "file is missing (the manifest lists it)") from None
    if size != shard.size:
        what = "truncated" if size < shard.size else "longer than recorded"
        raise CorruptCheckpoint(str(path), f"{what}: {size} bytes on disk, manifest says {shard.size}")
    from .segments import alloc_buffer

    buf = alloc_buffer(size)
    hasher = StreamDigest(algorithm(shard.checksum))
    with open(path, "rb", buffering=0) as f:
        mv, got = memoryview(buf)[:size], 0
        while got < size:
            k = f.readinto(mv[got:got + (64 << 20)])
            if not k:
                hasher.hexdigest()
                raise CorruptCheckpoint(str(path), f"truncated while reading at byte {got}")
            hasher.feed(mv[got:got + k])
            got += k
    digest = hasher.hexdigest()
    check_digest(digest, shard, str(path))
    return buf


def check_digest(digest: str, shard: contracts.Shard, where: str) -> None:
    """Refuse a copy whose digest is not the manifest's (one message for every tier)."""
    if digest != shard.checksum:
        raise CorruptCheckpoint(where, f"digest mismatch ({algorithm(shard.checksum)}): copy has "
                                       f"{digest.split(':', 1)[-1]}, manifest says {shard.checksum.split(':', 1)[-1]}")


def read_shard(sdir: Path, shard: contracts.Shard, **_: Any) -> Any:
    """Verify, then decode the shard file; tensors on the CPU."""
    from . import shardfmt                # imports torch: not needed by the daemon

    path = sdir / shard.name
    return shardfmt.decode(read_verified(path, shard), str(path))
