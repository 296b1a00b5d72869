"""The checkpoint engine's exceptions (the tree is drawn in :mod:`transom.checkpoint`)."""

from __future__ import annotations

__all__ = ["CheckpointError", "CorruptCheckpoint", "NoCheckpoint", "StaleGeneration"]


class CheckpointError(RuntimeError):
    """Base class: a checkpoint could not be saved, committed or loaded."""


class CorruptCheckpoint(CheckpointError):
    """A committed shard fails verification: missing, truncated, wrong digest, or unreadable.

    The message names the file and what is wrong; ``path`` holds the file.
    """

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class NoCheckpoint(CheckpointError):
    """The requested step does not exist, or exists but was never committed (no manifest.json)."""


class StaleGeneration(CheckpointError):
    """A write stamped with a launch generation older than the newest one seen for the job: the
    writer belongs to a launch the controller replaced (e.g. a host that was cut off and came
    back). Refused so it cannot overwrite or commit over the new generation's checkpoints."""

    def __init__(self, job: str, generation: int, newest: int, what: str) -> None:
        super().__init__(f"stale generation: {what} of job {job} is stamped generation {generation}, but "
                         f"generation {newest} of the job exists; refused (the writer belongs to a replaced "
                         f"launch and must stop)")
        self.job, self.generation, self.newest = job, generation, newest
