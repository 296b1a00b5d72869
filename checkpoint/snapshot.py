"""Stage 1, snapshot: the only part of ``save()`` that blocks training.

:class:`Snapshotter` copies every tensor of a nested state dict (dicts, lists, tuples) into CPU
staging buffers keyed by the tensor's path in the state, and deep-copies everything else. A
buffer is reused by the next snapshot when the tensor at the same path has the same shape and
dtype, so a steady training loop allocates once and afterwards only copies bytes. The caller
must not take a new snapshot while a previous one is still being persisted (the engine ensures
this: one save in flight per rank).

Tensors come back contiguous and on the CPU; storage shared between tensors of the state (tied
weights, views) is not preserved: each path gets its own copy.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["Snapshotter"]

Path_ = tuple[Any, ...]


class Snapshotter:
    """Copies state into reused, preallocated CPU buffers. Not thread-safe; one per engine."""

    def __init__(self) -> None:
        self._buffers: dict[Path_, torch.Tensor] = {}
        self._used: dict[Path_, torch.Tensor] = {}
        self._from_cuda = False
        self.bytes_copied = 0
        self.allocations = 0        # buffers allocated in total (a warm loop stops adding)

    def take(self, state: Any) -> Any:
        """Return a copy of ``state`` that later changes to ``state`` cannot affect."""
        self._used = {}
        self._from_cuda = False
        self.bytes_copied = 0
        out = self._copy(state, ())
        if self._from_cuda:
            torch.cuda.synchronize()   # the non_blocking device-to-host copies must land first
        self._buffers = self._used     # paths no longer in the state free their buffers
        return out

    def _buffer(self, path: Path_, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
            self.allocations += 1
        self._used[path] = buf
        return buf

    def _copy(self, obj: Any, path: Path_) -> Any:
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            if src.layout != torch.strided or src.is_quantized:
                return src.clone()     # rare layouts: a fresh copy, no staging buffer
            buf = self._buffer(path, src)
            buf.copy_(src, non_blocking=src.is_cuda)
            self._from_cuda = self._from_cuda or src.is_cuda
            self.bytes_copied += buf.numel() * buf.element_size()
            return buf
        if isinstance(obj, dict):
            out = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for k, v in obj.items():
                out[k] = self._copy(v, path + (k,))
            meta = getattr(obj, "_metadata", None)   # nn.Module state dicts carry versions here
            if meta is not None:
                out._metadata = copy.deepcopy(meta)  # type: ignore[attr-defined]
            return out
        if isinstance(obj, list):
            return [self._copy(v, path + (i,)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            items = [self._copy(v, path + (i,)) for i, v in enumerate(obj)]
            return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
        return copy.deepcopy(obj)
