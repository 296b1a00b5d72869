"""TCE, the checkpoint engine: in-memory checkpoints on two nodes, persisted, verified on load.

Stages, each in its own module and testable alone:

1. snapshot (:mod:`.engine` + :mod:`.shardfmt` + :mod:`.snapshot`, blocking): the rank copies its
   state, laid out as one safetensors shard, into a reused shared-memory segment of its node's
   daemon (:mod:`.server`, :mod:`.segments`), or forks a child that does it from a copy-on-write
   view (``snapshot="fork"``); ``save()`` returns after this.
2. hash, replicate (:mod:`.transport`: Mooncake Transfer Engine or plain TCP) into the ring
   neighbour daemon's memory, persist (:mod:`.store`) to local disk and the shared directory.
3. commit (:mod:`.store`): when every rank's shard manifest exists, one daemon wins an ``O_EXCL``
   lock and writes ``manifest.json`` with every copy; its presence means the step is complete.
4. announce (:mod:`.server`): that daemon publishes one :class:`transom.contracts.CheckpointReady`
   to ``transom.checkpoints``, then keeps only the newest ``keep`` complete steps.

``load()`` takes the fastest copy whose digest verifies: local memory, peer memory, local disk,
shared directory. :mod:`.planner` sizes memory (the paper's formulas) and checks a node;
:mod:`.cadence` says when to save (``engine.due(step)``: Young's interval from the measured save cost).

Layout of the shared directory (see :mod:`.layout`)::

    DIR/step-00000100/rank-00003.safetensors     rank-00003.json     manifest.json

Use::

    engine = CheckpointEngine.from_env()        # TRANSOM_CKPT_DIR, RANK, WORLD_SIZE, ...
    got = engine.load()                         # (step, state) of the newest good step, or None
    if engine.due(step):                        # every rank alike, at the interval that pays
        engine.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    engine.close()                              # waits for the last persist

Exception tree::

    CheckpointError(RuntimeError)    saving or loading failed (a failed background persist is
     |                               raised by the next wait()/close())
     +-- CorruptCheckpoint           a committed shard is missing, truncated, has the wrong
     |                               digest, or cannot be read; names the file and the problem
     +-- NoCheckpoint                the step does not exist or was never committed
     +-- StaleGeneration             a write of a replaced launch (older generation) was refused
     +-- DaemonError                 a TCE daemon refused a request or cannot be reached
     +-- CapacityError               this node's /dev/shm or RAM cannot hold the checkpoints
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError, CorruptCheckpoint, NoCheckpoint, StaleGeneration
from .layout import StepInfo, complete_steps, list_steps, prune, step_dir

if TYPE_CHECKING:
    from .engine import TIERS, CheckpointEngine, SavePolicy, SnapshotMode
    from .planner import CapacityError
    from .server import CheckpointServer
    from .store import persist_shard, read_shard, try_commit, uncommit_older, verify_shard
    from .wire import DaemonError

__all__ = [
    "CheckpointEngine", "SavePolicy", "SnapshotMode", "TIERS", "CheckpointServer", "CheckpointError", "CorruptCheckpoint",
    "NoCheckpoint", "StaleGeneration", "DaemonError", "CapacityError", "StepInfo", "list_steps", "complete_steps", "prune",
    "step_dir", "persist_shard", "uncommit_older", "try_commit", "read_shard", "verify_shard",
]

# Modules that import torch load on first use, so `transom --help` (which imports this package
# through checkpoint/cli.py) stays fast.
_LAZY = {
    "CheckpointEngine": ".engine", "SavePolicy": ".engine", "SnapshotMode": ".engine", "TIERS": ".engine", "CheckpointServer": ".server",
    "DaemonError": ".wire", "CapacityError": ".planner",
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
