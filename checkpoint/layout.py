"""The on-disk layout of checkpoints, and the file operations every stage shares.

::

    DIR/step-00000100/rank-00003.safetensors  one rank's shard (:mod:`.shardfmt`), the shared copy
    DIR/step-00000100/rank-00003.json         the shard manifest: name, size, digest, generation,
                                              every copy of the shard (memory, disk, shared), ...
    DIR/step-00000100/manifest.json      the committed step: a contracts.CheckpointReady, encoded

Every file is written to a temporary name in the same directory, fsynced and renamed into place,
so a reader sees a whole file or none. ``manifest.json`` is written last, by one daemon, once every
rank's shard manifest exists: its presence is what makes a step complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from transom import contracts

__all__ = [
    "MANIFEST", "step_dir", "shard_name", "rank_manifest_name", "atomic_write", "atomic_write_bytes",
    "sha256_file", "sha256_of", "StreamHasher", "read_rank_manifest", "read_manifest", "StepInfo", "list_steps", "complete_steps",
    "prune",
]

MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_RANK_JSON_RE = re.compile(r"^rank-(\d{5,})\.json$")


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def rank_manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Write ``path`` whole or not at all: ``write(file)`` into a temp file, fsync, rename, fsync dir."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def sha256_of(buf: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(buf).hexdigest()


class StreamHasher:
    """sha256 of bytes as they arrive, on its own thread: ``feed(view)`` each chunk in order,
    ``hexdigest()`` when the last is in. hashlib releases the GIL on big chunks, so hashing
    overlaps the receive or read that produces the next chunk."""

    def __init__(self) -> None:
        import queue
        import threading

        self._h = hashlib.sha256()
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._t = threading.Thread(target=self._run, name="sha256", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (chunk := self._q.get()) is not None:
            self._h.update(chunk)

    def feed(self, chunk: memoryview) -> None:
        self._q.put(chunk)

    def hexdigest(self) -> str:
        self._q.put(None)
        self._t.join()
        return self._h.hexdigest()


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_rank_manifest(path: Path) -> dict[str, Any] | None:
    """A shard manifest as a dict, or None when it is absent or not valid JSON."""
    try:
        d = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def read_manifest(sdir: Path) -> contracts.CheckpointReady:
    """The committed manifest of a step dir; OSError if absent, ContractError if malformed."""
    return contracts.decode(contracts.CHECKPOINTS, (sdir / MANIFEST).read_bytes())


@dataclass(frozen=True)
class StepInfo:
    """What a step dir holds, for listing: complete means manifest.json exists."""

    step: int
    path: Path
    complete: bool
    ranks: tuple[int, ...]          # ranks whose shard manifest exists
    world_size: int | None          # from manifest.json, else from a shard manifest
    size: int                       # bytes of the shards listed by the manifests
    generation: int | None


def list_steps(directory: str | os.PathLike) -> list[StepInfo]:
    """Every step dir under ``directory``, oldest first (an absent directory has none)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    out = []
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if not m or not entry.is_dir():
            continue
        try:
            files = list(entry.iterdir())
        except FileNotFoundError:          # deleted by a concurrent prune
            continue
        ranks, size, world, gen = [], 0, None, None
        for f in files:
            rm = _RANK_JSON_RE.match(f.name)
            if rm and (d := read_rank_manifest(f)) is not None:
                ranks.append(int(rm.group(1)))
                size += int(d.get("size", 0))
                world = d.get("world_size", world)
                gen = d.get("generation", gen)
        complete = (entry / MANIFEST).exists()
        if complete:
            try:
                man = read_manifest(entry)
                world, gen, size = man.world_size, man.generation, sum(s.size for s in man.shards)
            except (OSError, contracts.ContractError):
                pass
        out.append(StepInfo(int(m.group(1)), entry, complete, tuple(sorted(ranks)), world, size, gen))
    return sorted(out, key=lambda s: s.step)


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """Steps whose manifest.json exists, oldest first."""
    return [s.step for s in list_steps(directory) if s.complete]


def prune(directory: str | os.PathLike, keep: int) -> list[int]:
    """Delete every step dir older than the ``keep``-th newest complete step; return those deleted.

    Incomplete dirs newer than that step are left alone (a save may be writing them). The
    manifest goes first, so a half-deleted step is never taken for a complete one.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    steps = list_steps(directory)
    done = [s.step for s in steps if s.complete]
    if len(done) <= keep:
        return []
    oldest_kept = done[-keep]
    deleted = []
    for s in steps:
        if s.step < oldest_kept:
            (s.path / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(s.path, ignore_errors=True)
            deleted.append(s.step)
    return deleted
