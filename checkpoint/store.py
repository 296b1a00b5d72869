"""Stages 2 and 3, persist and commit, and the verified read that load() builds on.

- :func:`persist_shard`: ``torch.save`` a snapshot to a temp file in the step dir, fsync, rename to
  ``rank-XXXXX.pt``; then its size and sha256 go into ``rank-XXXXX.json``, written the same way.
- :func:`uncommit_older`: a step re-saved by a later launch loses its old manifest first.
- :func:`try_commit`: once every rank's shard manifest of the step exists (same generation and
  world size), exactly one caller wins an ``O_EXCL`` lock file and writes ``manifest.json``
  atomically; the others get None. A committer that dies between the lock and the manifest
  leaves that step uncommitted for this generation (the next saved step commits as usual).
- :func:`verify_shard` / :func:`read_shard`: refuse a missing, truncated or altered shard with
  :class:`CorruptCheckpoint` naming the file and what is wrong.
"""

from __future__ import annotations

import os
import pickle
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

from transom import contracts

from . import layout
from .errors import CheckpointError, CorruptCheckpoint

__all__ = ["persist_shard", "uncommit_older", "try_commit", "verify_shard", "read_shard"]


def persist_shard(sdir: Path, *, job: str, step: int, rank: int, world_size: int, node: str,
                  generation: int, snapshot: Any) -> contracts.Shard:
    """Write this rank's shard and its shard manifest into ``sdir``; return the shard record."""
    sdir.mkdir(parents=True, exist_ok=True)
    path = sdir / layout.shard_name(rank)
    layout.atomic_write(path, lambda f: torch.save(snapshot, f))
    shard = contracts.Shard(rank=rank, name=path.name, size=path.stat().st_size,
                            sha256=layout.sha256_file(path))
    record = {"v": contracts.SCHEMA_VERSION, "job": job, "step": step, "rank": rank,
              "world_size": world_size, "node": node, "generation": generation, "ts": time.time(),
              "name": shard.name, "size": shard.size, "sha256": shard.sha256}
    layout.atomic_write_bytes(sdir / layout.rank_manifest_name(rank), contracts.encode(record))
    return shard


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
    shards = []
    for r in range(world_size):
        d = layout.read_rank_manifest(sdir / layout.rank_manifest_name(r))
        if d is None or d.get("generation") != generation or d.get("world_size") != world_size \
                or d.get("step") != step:
            return None
        shards.append(contracts.Shard(rank=r, name=d["name"], size=d["size"], sha256=d["sha256"]))
    lock = sdir / f".commit-g{generation:05d}.lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    try:
        os.write(fd, f"rank {rank} pid {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    root = sdir.resolve()
    ready = contracts.CheckpointReady(
        job=job, step=step, world_size=world_size, shards=tuple(shards),
        copies=tuple(contracts.Copy(rank=s.rank, node="shared", tier=contracts.Tier.SHARED,
                                    location=str(root / s.name)) for s in shards),
        replicated=False, persisted=True, ts=time.time(), generation=generation)
    layout.atomic_write_bytes(sdir / layout.MANIFEST, contracts.encode(ready))
    return ready


def verify_shard(sdir: Path, shard: contracts.Shard) -> Path:
    """Check the shard file against its manifest entry (size, then sha256); return its path."""
    path = sdir / shard.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CorruptCheckpoint(str(path), "file is missing (the manifest lists it)") from None
    if size != shard.size:
        what = "truncated" if size < shard.size else "longer than recorded"
        raise CorruptCheckpoint(str(path), f"{what}: {size} bytes on disk, manifest says {shard.size}")
    digest = layout.sha256_file(path)
    if digest != shard.sha256:
        raise CorruptCheckpoint(str(path), f"sha256 mismatch: file has {digest}, manifest says {shard.sha256}")
    return path


def read_shard(sdir: Path, shard: contracts.Shard, *, weights_only: bool = True) -> Any:
    """Verify, then ``torch.load`` the shard onto the CPU."""
    path = verify_shard(sdir, shard)
    try:
        # pickle writes an empty bytes value as a call of the bytes global: harmless, allow it
        with torch.serialization.safe_globals([bytes]):
            return torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if weights_only and "Weights only load failed" in str(exc):
            why = next((line.strip() for line in str(exc).splitlines() if "WeightsUnpickler" in line),
                       str(exc).splitlines()[0])
            raise CheckpointError(
                f"{path}: holds objects that torch.load(weights_only=True) refuses ({why}); if you "
                f"trust this directory, load with weights_only=False") from None
        raise CorruptCheckpoint(str(path), f"unreadable: {exc}") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as exc:
        raise CorruptCheckpoint(str(path), f"unreadable: {exc}") from None
