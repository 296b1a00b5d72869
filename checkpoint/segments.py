"""Shared-memory segments and the runtime directory where a TCE daemon meets the ranks of its host.

Runtime directory (``TRANSOM_CKPT_RUNTIME``, default ``/dev/shm/transom-ckpt-<uid>-<hash of the
bootstrap>``: one per user and stack, see :func:`stack_tag`)::

    RUNTIME/daemons/NODE.json      {"node", "addr", "pid", "transport", "mooncake"}: one per daemon
    RUNTIME/NODE/seg-*             segments of that node's daemon (files on tmpfs = host memory)

A rank finds its node's daemon at ``RUNTIME/daemons/$TRANSOM_NODE.json`` (same host: it maps the
daemon's segments from the same /dev/shm). Daemons on other hosts are found through the service
registry on the broker (:mod:`transom.registry`); only a daemon without a broker (one host, no
Kafka) falls back to the other daemons of this runtime dir. Either way a daemon's ring neighbour
is the next live node in name order (cyclic), never itself (:func:`ring`). The daemon creates,
sizes and deletes segments; ranks only map them. A segment is pre-faulted for writing in every
process that maps it to write (``MADV_POPULATE_WRITE``, else one write per page), so a save
copies into warm memory without a page fault.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

from transom.log import get

from .wire import pid_alive

__all__ = ["alloc_buffer", "default_runtime", "default_local_dir", "stack_tag", "runtime_dir",
           "registry_path", "register", "unregister", "registered", "neighbour", "ring", "Segment", "safe_name"]

log = get("checkpoint")

_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)   # Linux >= 5.14
_libc = ctypes.CDLL(None, use_errno=True)


def _prefault_write(mm: mmap.mmap, size: int) -> None:
    """Fault every page in for writing now. MAP_POPULATE alone maps a shared mapping read-only,
    so the first write to each page would still fault (a second per GiB) inside save()."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
        return
    except (OSError, AttributeError, ValueError):
        pass
    mv = memoryview(mm)
    try:
        for off in range(0, size, _PAGE):
            mv[off] = mv[off]
    finally:
        mv.release()


def alloc_buffer(size: int) -> mmap.mmap:
    """A private, writable buffer of ``size`` bytes whose pages are being faulted in.

    Restores receive a whole shard and hand out tensors as views of it. ``bytearray(size)``
    zeroes (faults in) every 4 KiB page before the first byte arrives; here a thread populates the
    pages ahead of the writer in 64 MiB ``MADV_POPULATE_WRITE`` steps, while the receive or read
    fills them. A page the writer reaches first is faulted in by the kernel as usual: the
    populating never changes a byte. No ``MADV_HUGEPAGE``: receiving 1 GiB into huge pages took
    8-14 s here (2.4 s of system time) against 2.2-5.2 s (0.74 s) for 4 KiB pages, same host, same
    minute (transparent huge pages are allocated and zeroed 2 MiB at a time, with compaction when
    memory is fragmented); ``torch.load`` does not ask for them either.
    """
    mm = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    total = max(size, 1)

    def populate(keep: mmap.mmap) -> None:       # holds the mapping until it is done
        step = 64 << 20
        for lo in range(0, total, step):
            n = min(step, total - lo)
            if _libc.madvise(ctypes.c_void_p(base + lo), ctypes.c_size_t(n), _MADV_POPULATE_WRITE) != 0:
                return                     # an old kernel: the writer faults the pages in itself

    threading.Thread(target=populate, args=(mm,), name="populate", daemon=True).start()
    return mm


def stack_tag(bootstrap: str | None = None) -> str:
    """``UID`` or ``UID-HASH``: the defaults below are per user and per stack, the stack being named by
    its Kafka bootstrap (``bootstrap``, else env TRANSOM_BOOTSTRAP), so two stacks one user runs on
    one host never share a runtime directory, and so never join one replication ring."""
    import hashlib

    bootstrap = bootstrap if bootstrap is not None else os.environ.get("TRANSOM_BOOTSTRAP")
    tag = str(os.getuid())
    return f"{tag}-{hashlib.sha256(bootstrap.encode()).hexdigest()[:10]}" if bootstrap else tag


def default_runtime(bootstrap: str | None = None) -> Path:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return base / f"transom-ckpt-{stack_tag(bootstrap)}"


def default_local_dir(bootstrap: str | None = None) -> Path:
    return Path(tempfile.gettempdir()) / f"transom-ckpt-local-{stack_tag(bootstrap)}"


def runtime_dir(value: str | os.PathLike | None = None, bootstrap: str | None = None) -> Path:
    return Path(value or os.environ.get("TRANSOM_CKPT_RUNTIME") or default_runtime(bootstrap))


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def registry_path(runtime: Path, node: str) -> Path:
    return runtime / "daemons" / f"{safe_name(node)}.json"


def register(runtime: Path, node: str, info: dict[str, Any]) -> None:
    path = registry_path(runtime, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"node": node, **info}))
    os.replace(tmp, path)


def unregister(runtime: Path, node: str, pid: int) -> None:
    path = registry_path(runtime, node)
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def registered(runtime: Path) -> dict[str, dict[str, Any]]:
    """Every daemon registered under ``runtime`` whose process is alive (same host), by node."""
    out = {}
    for f in sorted((runtime / "daemons").glob("*.json")):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if d.get("host") == os.uname().nodename and not pid_alive(int(d.get("pid", 0))):
            continue                 # a daemon that died without unregistering
        out[d["node"]] = d
    return out


def ring(peers: dict[str, Any], node: str) -> list[Any]:
    """The peers of ``node`` in ring order: the next node after it in name order first, then on
    round the ring (cyclic), never ``node`` itself. The first is its neighbour; the rest are where a
    replica goes when the neighbour cannot be reached."""
    names = sorted(set(peers) | {node})
    i = names.index(node)
    return [peers[n] for n in names[i + 1:] + names[:i]]


def neighbour(runtime: Path, node: str) -> dict[str, Any] | None:
    """The ring neighbour of ``node`` among the daemons of ``runtime`` (one-host mode)."""
    order = ring(registered(runtime), node)
    return order[0] if order else None


_CUDA_HOST_REGISTER_PORTABLE = 1      # cudaHostRegisterPortable


class Segment:
    """One file on tmpfs, mapped shared; ``create`` sizes and pre-faults it."""

    def __init__(self, path: Path, capacity: int, mm: mmap.mmap) -> None:
        self.path, self.capacity, self.mm = path, capacity, mm
        self._addr: int | None = None
        self.pinned = False           # page-locked for CUDA copies (:meth:`pin_for_cuda`)

    @classmethod
    def create(cls, path: Path, capacity: int) -> "Segment":
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, max(capacity, 1))
            try:
                os.posix_fallocate(fd, 0, max(capacity, 1))   # ENOSPC now, not SIGBUS mid-copy
            except OSError as exc:
                os.close(fd)
                fd = -1
                path.unlink(missing_ok=True)
                raise OSError(exc.errno, f"{path}: cannot reserve {capacity} bytes of shared "
                                         f"memory ({exc.strerror})") from None
            mm = mmap.mmap(fd, max(capacity, 1), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            _prefault_write(mm, max(capacity, 1))
        finally:
            if fd >= 0:
                os.close(fd)
        return cls(path, capacity, mm)

    @classmethod
    def open(cls, path: str | Path, writable: bool = True) -> "Segment":
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
            if writable:
                _prefault_write(mm, size)
        finally:
            os.close(fd)
        return cls(Path(path), size, mm)

    @property
    def addr(self) -> int:
        """Address of the mapping in this process (for registering it with a transfer engine)."""
        if self._addr is None:
            self._addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        return self._addr

    def view(self, size: int | None = None) -> memoryview:
        return memoryview(self.mm)[: self.capacity if size is None else size]

    def pin_for_cuda(self) -> None:
        """Page-lock the mapping for CUDA (``cudaHostRegister``, portable to every device's context):
        a device-to-host copy into pinned memory runs at the copy engines' speed (on an H200, 55 GB/s
        against 15 GB/s into pageable memory). Costs about 40 ms per GiB, once per mapping; raises
        ``OSError`` when CUDA refuses (the caller copies into pageable memory instead)."""
        if self.pinned:
            return
        import torch
        err = torch.cuda.cudart().cudaHostRegister(self.addr, max(self.capacity, 1), _CUDA_HOST_REGISTER_PORTABLE)
        if int(getattr(err, "value", err)) != 0:
            raise OSError(f"cudaHostRegister of {self.path} ({self.capacity} bytes) failed: {err}")
        self.pinned = True

    def unpin(self) -> None:
        if self.pinned:
            import torch
            torch.cuda.cudart().cudaHostUnregister(self.addr)
            self.pinned = False

    def close(self, unlink: bool = False) -> None:
        try:
            self.unpin()
        except Exception as exc:       # a CUDA runtime torn down at exit: the mapping goes anyway
            log.debug("%s: cudaHostUnregister: %s", self.path, exc)
        try:
            self.mm.close()
        except BufferError:
            pass                       # a view is still exported; the mapping goes with the process
        if unlink:
            self.path.unlink(missing_ok=True)
