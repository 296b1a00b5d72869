"""DTensor state dicts (FSDP2, tensor parallelism): each rank saves its own pieces, and a load
into a template re-shards them onto any world size.

``save()`` stores a DTensor as its local tensor plus where that piece sits in the global tensor
(:class:`.shardfmt.DTensorRef`: global shape, offset; computed from the DTensor's mesh and
placements), so every rank writes only what it holds and no rank gathers anything.

``load(template=state)`` takes a state dict of DTensors laid out as the job now runs (the model
and optimizer after ``fully_shard`` / ``parallelize_module`` on the new mesh) and fills each
DTensor's local tensor in place from the saved pieces that overlap it: with the same world size
and layout, a rank reads only its own shard; on a different world size (4 ranks saved, 3 load:
the controller's shrink path when no spare is left) it reads the shards of the old ranks whose
pieces overlap its new piece. Everything that is not a DTensor in the template (step counters,
hyper-parameters, plain tensors) comes from the old shard of the same rank (rank 0's when this
rank did not exist then). The result has the saved structure with the template's DTensors in
place: pass it to ``model.load_state_dict`` / ``optimizer.load_state_dict``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch

from .errors import CorruptCheckpoint
from .shardfmt import LocalShard, _is_dtensor

__all__ = ["fill"]


def _at(state: Any, path: tuple) -> Any:
    for key in path:
        try:
            state = state[key]
        except (KeyError, IndexError, TypeError):
            return None
    return state


def _fill_dtensor(dst_dt: Any, path: tuple, load_rank: Callable[[int], Any], order: list[int]) -> None:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(dst_dt.shape, dst_dt.device_mesh, dst_dt.placements)
    dst = dst_dt.to_local()
    if dst.numel() == 0:
        return
    covered = torch.zeros(tuple(shape), dtype=torch.bool)
    for r in order:
        piece = _at(load_rank(r), path)
        if not isinstance(piece, LocalShard):
            continue
        if tuple(piece.global_shape) != tuple(dst_dt.shape):
            raise CorruptCheckpoint(f"rank {r}'s shard", f"{'.'.join(map(str, path))}: saved with global shape "
                                    f"{tuple(piece.global_shape)}, the template has {tuple(dst_dt.shape)}")
        lo = [max(a, b) for a, b in zip(offset, piece.offset)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offset, shape, piece.offset, piece.tensor.shape)]
        if any(x >= y for x, y in zip(lo, hi)):
            continue
        d = tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, offset))
        s = tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, piece.offset))
        dst[d] = piece.tensor[s]
        covered[d] = True
        if bool(covered.all()):
            return
    raise CorruptCheckpoint(f"step's shards of ranks {order}", f"{'.'.join(map(str, path))}: no saved piece "
                            f"covers part of [{offset}, +{tuple(shape)})")


def fill(template: Any, load_rank: Callable[[int], Any], old_world: int, rank: int) -> Any:
    """The state saved by ``old_world`` ranks, with every DTensor of ``template`` filled in place;
    ``load_rank(r)`` gives old rank ``r``'s decoded shard (it is called only for shards needed)."""
    primary = rank if rank < old_world else 0
    order = [primary] + [r for r in range(old_world) if r != primary]

    def walk(saved: Any, tmpl: Any, path: tuple) -> Any:
        if _is_dtensor(tmpl):
            _fill_dtensor(tmpl, path, load_rank, order)
            return tmpl
        if isinstance(saved, dict):
            out = OrderedDict() if isinstance(saved, OrderedDict) else {}
            for k, v in saved.items():
                out[k] = walk(v, tmpl.get(k) if isinstance(tmpl, dict) else None, path + (k,))
            if hasattr(saved, "_metadata"):
                out._metadata = saved._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(saved, (list, tuple)):
            items = [walk(v, tmpl[i] if isinstance(tmpl, (list, tuple)) and i < len(tmpl) else None, path + (i,))
                     for i, v in enumerate(saved)]
            return type(saved)(*items) if hasattr(saved, "_fields") else type(saved)(items)
        return saved

    return walk(load_rank(primary), template, ())
