"""One rank's shard as bytes: a safetensors file whose metadata carries the non-tensor state.

The same bytes are the staging segment in shared memory, the peer replica, the local-disk file
and the shared-path file, so one digest vouches for every copy of a shard.

Layout (the safetensors format, readable by ``safetensors.safe_open``)::

    u64 little-endian header length | JSON header, space padded to 64 bytes | tensor bytes

The header names tensors ``t0, t1, ...`` in the order they appear in the state; data is laid
out by decreasing element size, so every tensor starts aligned to its element size without
holes. ``__metadata__`` holds ``transom.skeleton`` (base64 of a pickle of the state with each
tensor replaced by its :class:`TensorRef`) and ``transom.dtypes`` (torch dtype per tensor, for
dtypes safetensors has no name for: those are stored as U8 bytes).

:func:`plan` walks the state once (the only Python-level work of a save); :func:`write_into`
copies the tensors into a buffer; :func:`decode` rebuilds the state from a buffer with a
restricted unpickler (builtins, ``collections.OrderedDict`` and :class:`TensorRef` only): a shard
never runs code when loaded. Tensors come back as views of the buffer, contiguous, on the CPU.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CheckpointError, CorruptCheckpoint
from .layout import sha256_of

__all__ = ["TensorRef", "DTensorRef", "LocalShard", "ShardPlan", "plan", "write_into", "decode", "sha256_of"]

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_DTYPE_BY_NAME = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.complex32,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64)}
_ALIGN = 64


@dataclass(frozen=True)
class TensorRef:
    """Placeholder for a tensor inside the pickled skeleton."""

    index: int


@dataclass(frozen=True)
class DTensorRef:
    """Placeholder for a DTensor (FSDP2, tensor parallel): its local tensor is tensor ``index``; it
    covers ``[offset, offset + local shape)`` of a tensor of ``global_shape``."""

    index: int
    global_shape: tuple
    offset: tuple


@dataclass
class LocalShard:
    """What a saved DTensor decodes to: this rank's piece of the global tensor. ``load(template=)``
    (:mod:`.sharded`) turns the pieces of every rank into the DTensors of the template."""

    tensor: torch.Tensor
    global_shape: tuple
    offset: tuple


@dataclass
class ShardPlan:
    header: bytes                      # u64 length + padded JSON
    tensors: list[torch.Tensor]        # in header order (t0, t1, ...), detached
    offsets: list[int]                 # absolute byte offset of each tensor in the shard
    size: int                          # total shard bytes

    @property
    def tensor_bytes(self) -> int:
        return self.size - len(self.header)

    @property
    def on_cuda(self) -> bool:
        """Whether any tensor lives on a CUDA device (copied with a device-to-host copy)."""
        return any(t.is_cuda for t in self.tensors)


def _dtensor_ref(obj: Any, tensors: list[torch.Tensor]) -> DTensorRef:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = obj.to_local().detach()
    shape, offset = compute_local_shape_and_global_offset(obj.shape, obj.device_mesh, obj.placements)
    if tuple(shape) != tuple(local.shape):
        raise CheckpointError(f"DTensor of global shape {tuple(obj.shape)}: local tensor {tuple(local.shape)} is not "
                              f"the piece {tuple(shape)} its placements {obj.placements} give (uneven sharding "
                              f"is not supported)")
    tensors.append(local)
    return DTensorRef(len(tensors) - 1, tuple(obj.shape), tuple(int(o) for o in offset))


def _is_dtensor(obj: Any) -> bool:
    cls = type(obj)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def _skeleton(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if _is_dtensor(obj):
        return _dtensor_ref(obj, tensors)
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.layout != torch.strided or t.is_quantized:
            raise CheckpointError(f"tensor {len(tensors)} has layout {t.layout}"
                                  f"{' (quantized)' if t.is_quantized else ''}: only dense tensors "
                                  f"can be checkpointed; convert it (e.g. .to_dense()) first")
        tensors.append(t)
        return TensorRef(len(tensors) - 1)
    if isinstance(obj, dict):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _skeleton(v, tensors)
        meta = getattr(obj, "_metadata", None)     # nn.Module state dicts carry versions here
        if meta is not None:
            out._metadata = copy.deepcopy(meta)    # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_skeleton(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        items = [_skeleton(v, tensors) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return copy.deepcopy(obj)


class _Pickler(pickle.Pickler):
    """Keeps the ``_metadata`` attribute of OrderedDicts (state dicts), which pickle drops."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is OrderedDict and hasattr(obj, "_metadata"):
            return _odict_with_meta, (list(obj.items()), obj._metadata)
        return NotImplemented


def _odict_with_meta(items: list, meta: Any) -> OrderedDict:
    out = OrderedDict(items)
    out._metadata = meta  # type: ignore[attr-defined]
    return out


def plan(state: Any) -> ShardPlan:
    """Walk ``state``: the tensors to copy, their offsets, and the header describing them."""
    tensors: list[torch.Tensor] = []
    skel = _skeleton(state, tensors)
    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=5).dump(skel)
        _Unpickler(io.BytesIO(buf.getvalue())).load()     # refuse now what load() would refuse
    except Exception as exc:  # noqa: BLE001 - pickling errors come in many types
        raise CheckpointError(
            f"the state cannot be checkpointed: {exc}; keep non-tensor state to builtin types "
            f"(numbers, strings, bytes, None, lists, tuples, dicts, sets) so that loading never "
            f"runs code") from None
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    rel, pos = [0] * len(tensors), 0
    for i in order:
        rel[i] = pos
        pos += tensors[i].numel() * tensors[i].element_size()
    header: dict[str, Any] = {}
    dtypes = {}
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        st = _ST_DTYPES.get(t.dtype)
        if st is None:
            dtypes[f"t{i}"] = [str(t.dtype).removeprefix("torch."), list(t.shape)]
        header[f"t{i}"] = {"dtype": st or "U8", "shape": list(t.shape) if st else [nbytes],
                           "data_offsets": [rel[i], rel[i] + nbytes]}
    header["__metadata__"] = {"format": "pt", "transom.skeleton": base64.b64encode(buf.getvalue()).decode(),
                              "transom.dtypes": json.dumps(dtypes)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    head = struct.pack("<Q", len(raw)) + raw
    return ShardPlan(head, tensors, [len(head) + r for r in rel], len(head) + pos)


def write_into(buf: memoryview | bytearray, p: ShardPlan, only: list[int] | None = None) -> None:
    """Copy the header and every tensor of ``p`` (or the tensors at indices ``only``) into ``buf``
    (at least ``p.size`` bytes)."""
    mv = memoryview(buf)
    mv[:len(p.header)] = p.header
    whole = torch.frombuffer(buf, dtype=torch.uint8, count=p.size) if p.size else None
    cuda = False
    for i in (range(len(p.tensors)) if only is None else only):
        t, off = p.tensors[i], p.offsets[i]
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        dst = whole[off:off + n].view(t.dtype).view(t.shape)
        dst.copy_(t, non_blocking=t.is_cuda)
        cuda = cuda or t.is_cuda
    if cuda:
        torch.cuda.synchronize()       # the device-to-host copies must land before save() returns


class _Unpickler(pickle.Unpickler):
    _ALLOWED = {("collections", "OrderedDict"), ("transom.checkpoint.shardfmt", "TensorRef"),
                ("transom.checkpoint.shardfmt", "DTensorRef"),
                ("transom.checkpoint.shardfmt", "_odict_with_meta"),
                ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytes"),
                ("builtins", "bytearray"), ("builtins", "complex"), ("builtins", "slice"),
                ("builtins", "range")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"shard skeleton refers to {module}.{name}, which is not allowed")


def _rebuild(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, TensorRef):
        return tensors[obj.index]
    if isinstance(obj, DTensorRef):
        return LocalShard(tensors[obj.index], tuple(obj.global_shape), tuple(obj.offset))
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _rebuild(v, tensors)
        return obj
    if isinstance(obj, list):
        return [_rebuild(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        items = [_rebuild(v, tensors) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


def header_size(buf: bytes | bytearray | memoryview) -> int:
    """Bytes of the length field and JSON header at the start of a shard (``buf``: at least 8 bytes)."""
    return 8 + struct.unpack_from("<Q", buf, 0)[0]


def parse(buf: bytes | bytearray | memoryview, size: int) -> tuple[Any, list[tuple[int, int, int, Any, list]]]:
    """The skeleton and, per tensor, ``(index, first byte, end byte, dtype, shape)`` (offsets in the
    shard) of a shard of ``size`` bytes whose first bytes (at least :func:`header_size`) are ``buf``."""
    (hlen,) = struct.unpack_from("<Q", buf, 0)
    header = json.loads(bytes(memoryview(buf)[8:8 + hlen]))
    meta = header.pop("__metadata__")
    dtypes = json.loads(meta["transom.dtypes"])
    skel = _Unpickler(io.BytesIO(base64.b64decode(meta["transom.skeleton"]))).load()
    base, out = 8 + hlen, []
    for name, d in header.items():
        lo, hi = d["data_offsets"]
        if name in dtypes:
            dt, shape = _DTYPE_BY_NAME[dtypes[name][0]], dtypes[name][1]
        else:
            dt, shape = next(k for k, v in _ST_DTYPES.items() if v == d["dtype"]), d["shape"]
        if base + hi > size or hi < lo:
            raise ValueError(f"tensor {name} ends at byte {base + hi}, the shard has {size}")
        out.append((int(name[1:]), base + lo, base + hi, dt, shape))
    return skel, out


def decode(buf: bytearray | memoryview, where: str = "shard") -> Any:
    """The state stored in ``buf`` (writable buffer), tensors as views of it."""
    try:
        skel, entries = parse(buf, len(buf))
        tensors: list[torch.Tensor] = [None] * len(entries)  # type: ignore[list-item]
        for i, lo, hi, dt, shape in entries:
            n = (hi - lo) // torch.empty(0, dtype=dt).element_size()
            # one storage per tensor, starting at its first byte: some torch APIs (set_rng_state)
            # ignore a view's storage offset
            tensors[i] = (torch.frombuffer(buf, dtype=dt, count=n, offset=lo) if n
                          else torch.empty(0, dtype=dt)).view(shape)
        return _rebuild(skel, tensors)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse failure means the copy is unusable
        raise CorruptCheckpoint(where, f"unreadable shard: {type(exc).__name__}: {exc}") from None
