"""TCE, the checkpoint engine (thin version: one shared directory, no peer replication yet).

Stages, each in its own module and testable alone:

1. snapshot (:mod:`.snapshot`, blocking): copy every tensor of the state into reused CPU buffers,
   deep-copy the rest; ``save()`` returns after this.
2. persist (:mod:`.store`, background thread): ``torch.save`` the rank's shard to a temp file,
   fsync, rename; sha256 and size into the rank's shard manifest, written the same way.
3. commit (:mod:`.store`): when every rank's shard manifest exists, one rank wins an ``O_EXCL``
   lock and writes ``manifest.json``; its presence means the step is complete.
4. announce (:mod:`.engine`): that rank publishes one :class:`transom.contracts.CheckpointReady`
   to ``transom.checkpoints``, then keeps only the newest ``keep`` complete steps.

Layout (see :mod:`.layout`)::

    DIR/step-00000100/rank-00003.pt     rank-00003.json     manifest.json

Use::

    engine = CheckpointEngine.from_env()        # TRANSOM_CKPT_DIR, RANK, WORLD_SIZE, ...
    got = engine.load()                         # (step, state) of the newest good step, or None
    engine.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    engine.close()                              # waits for the last persist

Exception tree::

    CheckpointError(RuntimeError)    saving or loading failed (a failed background persist is
     |                               raised by the next wait()/close())
     +-- CorruptCheckpoint           a committed shard is missing, truncated, has the wrong
     |                               sha256, or cannot be read; names the file and the problem
     +-- NoCheckpoint                the step does not exist or was never committed
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError, CorruptCheckpoint, NoCheckpoint
from .layout import StepInfo, complete_steps, list_steps, prune, step_dir

if TYPE_CHECKING:
    from .engine import CheckpointEngine, SavePolicy
    from .snapshot import Snapshotter
    from .store import persist_shard, read_shard, try_commit, uncommit_older, verify_shard

__all__ = [
    "CheckpointEngine", "SavePolicy", "CheckpointError", "CorruptCheckpoint", "NoCheckpoint",
    "Snapshotter", "StepInfo", "list_steps", "complete_steps", "prune", "step_dir",
    "persist_shard", "uncommit_older", "try_commit", "read_shard", "verify_shard",
]

# Modules that import torch load on first use, so `transom --help` (which imports this package
# through checkpoint/cli.py) stays fast.
_LAZY = {
    "CheckpointEngine": ".engine", "SavePolicy": ".engine", "Snapshotter": ".snapshot",
    "persist_shard": ".store", "uncommit_older": ".store", "try_commit": ".store",
    "read_shard": ".store", "verify_shard": ".store",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
