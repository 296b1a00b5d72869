"""The per-rank checkpoint engine: snapshot, then persist, commit and announce in the background.

``save(step, state)`` blocks only for the snapshot (:mod:`.snapshot`); a background thread then
persists the shard and tries to commit the step (:mod:`.store`); the rank whose commit wins
publishes one :class:`transom.contracts.CheckpointReady` to ``transom.checkpoints`` keyed by job
(when a bootstrap is configured) and deletes steps beyond the newest ``keep`` complete ones.

One save is in flight per rank. A ``save()`` that finds the previous one still persisting waits
for it (:attr:`SavePolicy.WAIT`, default) or drops the new one and logs it (:attr:`SavePolicy.SKIP`).
A failed persist is logged and raised by the next :meth:`CheckpointEngine.wait`; it never stops
training by itself, and neither does an unreachable broker (the announce is flushed with a
timeout and logged).

Saving a step that an earlier launch committed (the job was rolled back past it) replaces it:
the old manifest is removed before this rank writes its shard, so the step is incomplete until
this launch commits it again; a shard is never rewritten under a manifest that vouches for it.
"""

from __future__ import annotations

import enum
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from transom import contracts
from transom.config import ConfigError, env_int, env_str
from transom.log import get

from . import layout, store
from .errors import CheckpointError, CorruptCheckpoint, NoCheckpoint
from .snapshot import Snapshotter

__all__ = ["CheckpointEngine", "SavePolicy"]

log = get("checkpoint")


class SavePolicy(str, enum.Enum):
    """What ``save()`` does while the previous save of this rank is still persisting."""

    WAIT = "wait"      # block until it is done, then save
    SKIP = "skip"      # drop the new save, log it, return False


class CheckpointEngine:
    """Saves and loads one rank's shard of a job's checkpoints under ``directory``.

    Ranks of one job share ``directory`` (a shared filesystem) and must use the same
    ``world_size`` and ``generation``; ``generation`` tells this launch's files from those of an
    earlier launch that died mid-save.
    """

    def __init__(self, directory: str | os.PathLike, job: str, rank: int, world_size: int, node: str,
                 generation: int = 0, bootstrap: str | None = None, *, keep: int = 3,
                 policy: SavePolicy | str = SavePolicy.WAIT, announce_timeout: float = 10.0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.job, self.rank, self.world_size, self.node = job, rank, world_size, node
        self.generation = generation
        self.bootstrap = bootstrap
        self.keep = keep
        self.policy = SavePolicy(policy)
        self.announce_timeout = announce_timeout
        self.last_snapshot_s = 0.0
        self.saved: list[int] = []          # steps this rank persisted, in order
        self.committed: list[int] = []      # steps this rank committed (won the lock)
        self.skipped: list[int] = []        # steps dropped by SavePolicy.SKIP
        self._snapshotter = Snapshotter()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._producer = None
        self._closed = False
        self.directory.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls, directory: str | os.PathLike | None = None, **kwargs: Any) -> "CheckpointEngine":
        """Build from the launcher's environment (TRANSOM_CKPT_DIR, RANK, WORLD_SIZE, TRANSOM_JOB,
        TRANSOM_NODE, TRANSOM_GENERATION, TRANSOM_BOOTSTRAP); ``kwargs`` override."""
        directory = directory or env_str("TRANSOM_CKPT_DIR")
        if not directory:
            raise ConfigError("TRANSOM_CKPT_DIR is not set: the checkpoint engine needs a directory")
        args: dict[str, Any] = dict(
            job=env_str("TRANSOM_JOB", "local"), rank=env_int("RANK", 0),
            world_size=env_int("WORLD_SIZE", 1), node=env_str("TRANSOM_NODE", socket.gethostname()),
            generation=env_int("TRANSOM_GENERATION", 0), bootstrap=env_str("TRANSOM_BOOTSTRAP"))
        args.update(kwargs)
        return cls(directory, **args)

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any) -> bool:
        """Snapshot ``state`` (blocking) and persist it in the background; False if skipped."""
        if self._closed:
            raise CheckpointError("save() after close()")
        if self._thread is not None and self._thread.is_alive():
            if self.policy is SavePolicy.SKIP:
                self.skipped.append(step)
                log.warning("rank %d: skipped checkpoint of step %d: the previous save is still "
                            "persisting (policy skip)", self.rank, step)
                return False
            self._thread.join()
        t0 = time.perf_counter()
        snapshot = self._snapshotter.take(state)
        self.last_snapshot_s = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._persist, args=(step, snapshot),
                                        name=f"ckpt-persist-{step}")
        self._thread.start()
        return True

    def _persist(self, step: int, snapshot: Any) -> None:
        try:
            sdir = layout.step_dir(self.directory, step)
            replaced = store.uncommit_older(sdir)
            if replaced is not None:
                log.info("rank %d: step %d was committed by generation %s; generation %d replaces it",
                         self.rank, step, replaced, self.generation)
            t0 = time.perf_counter()
            shard = store.persist_shard(sdir, job=self.job, step=step, rank=self.rank,
                                        world_size=self.world_size, node=self.node,
                                        generation=self.generation, snapshot=snapshot)
            self.saved.append(step)
            log.debug("rank %d: persisted step %d (%d bytes) in %.3fs", self.rank, step, shard.size,
                      time.perf_counter() - t0)
            ready = store.try_commit(sdir, job=self.job, step=step, world_size=self.world_size,
                                     generation=self.generation, rank=self.rank)
            if ready is None:
                return
            self.committed.append(step)
            log.info("checkpoint step %d of job %s committed by rank %d (%d shards, %d bytes)",
                     step, self.job, self.rank, len(ready.shards), sum(s.size for s in ready.shards))
            self._announce(ready)
            deleted = layout.prune(self.directory, self.keep)
            if deleted:
                log.info("deleted checkpoint steps %s (keeping the newest %d)", deleted, self.keep)
        except BaseException as exc:  # noqa: BLE001 - kept for wait(), never kills training
            self._error = exc
            log.error("rank %d: checkpoint of step %d failed: %s", self.rank, step, exc)

    def _announce(self, ready: contracts.CheckpointReady) -> None:
        if not self.bootstrap:
            return
        from transom.kafka import make_producer, publish

        def delivered(err, _msg) -> None:
            if err is not None:
                log.warning("checkpoint-ready for step %d was not delivered: %s", ready.step, err)

        try:
            if self._producer is None:
                self._producer = make_producer(self.bootstrap)
            publish(self._producer, contracts.CHECKPOINTS, self.job, ready, on_delivery=delivered)
            left = self._producer.flush(self.announce_timeout)
        except Exception as exc:  # noqa: BLE001 - the checkpoint is on disk; the event is a bonus
            log.warning("could not publish checkpoint-ready for step %d to %s: %s",
                        ready.step, self.bootstrap, exc)
            return
        if left:
            log.warning("checkpoint-ready for step %d not delivered to %s within %.0fs; the producer "
                        "keeps trying in the background", ready.step, self.bootstrap, self.announce_timeout)

    def wait(self) -> None:
        """Block until the in-flight save is persisted (and committed, announced if this rank
        won); raise :class:`CheckpointError` if a save since the last ``wait()`` failed."""
        if self._thread is not None:
            self._thread.join()
        err, self._error = self._error, None
        if err is not None:
            raise CheckpointError(f"rank {self.rank}: a checkpoint save failed: {err}") from err

    def close(self) -> None:
        """Wait for the in-flight save, then flush the announce producer (with a timeout)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._producer is not None:
                left = self._producer.flush(self.announce_timeout)
                if left:
                    log.warning("%d checkpoint-ready event(s) undelivered to %s at close",
                                left, self.bootstrap)
                self._producer = None

    def __enter__(self) -> "CheckpointEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ load

    def load(self, step: int | None = None, *, weights_only: bool = True) -> tuple[int, Any] | None:
        """This rank's state of a committed step, as ``(step, state)``.

        Without ``step``: the newest complete step whose shard for this rank verifies (a corrupt
        one is skipped with a warning naming the file), or None when there is none. With
        ``step``: that step, or :class:`NoCheckpoint` (absent, not committed) /
        :class:`CorruptCheckpoint` (shard fails verification). Tensors are bit-identical to
        what was saved and on the CPU.
        """
        if step is not None:
            return step, self._load_step(step, weights_only)
        for s in reversed(layout.complete_steps(self.directory)):
            try:
                return s, self._load_step(s, weights_only)
            except (CorruptCheckpoint, NoCheckpoint) as exc:
                log.warning("rank %d: skipping checkpoint step %d: %s", self.rank, s, exc)
        return None

    def _load_step(self, step: int, weights_only: bool) -> Any:
        sdir = layout.step_dir(self.directory, step)
        if not sdir.is_dir():
            raise NoCheckpoint(f"no checkpoint of step {step} in {self.directory}")
        try:
            manifest = layout.read_manifest(sdir)
        except FileNotFoundError:
            raise NoCheckpoint(f"checkpoint step {step} in {sdir} is incomplete "
                               f"(no {layout.MANIFEST}: not every rank's shard was committed)") from None
        except (OSError, contracts.ContractError) as exc:
            raise CorruptCheckpoint(str(sdir / layout.MANIFEST), f"unreadable manifest: {exc}") from None
        if manifest.world_size != self.world_size:
            raise NoCheckpoint(f"checkpoint step {step} in {sdir} was written by {manifest.world_size} "
                               f"ranks, this job has {self.world_size} (resharding is not supported)")
        shard = next(s for s in manifest.shards if s.rank == self.rank)
        return store.read_shard(sdir, shard, weights_only=weights_only)
