"""The checkpoint engine's exceptions (the tree is drawn in :mod:`transom.checkpoint`)."""

from __future__ import annotations

__all__ = ["CheckpointError", "CorruptCheckpoint", "NoCheckpoint"]


class CheckpointError(RuntimeError):
    """Base class: a checkpoint could not be saved, committed or loaded."""


class CorruptCheckpoint(CheckpointError):
    """A committed shard fails verification: missing, truncated, wrong sha256, or unreadable.

    The message names the file and what is wrong; ``path`` holds the file.
    """

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class NoCheckpoint(CheckpointError):
    """The requested step does not exist, or exists but was never committed (no manifest.json)."""
