"""Stage 1, snapshot: how ``save()`` gets a rank's tensors into its segment before it returns.

Two modes (:class:`SnapshotMode`), chosen per engine (``CheckpointEngine(snapshot=...)``):

- ``copy`` (default): the training process copies every tensor into the segment (a memcpy for CPU
  tensors, a device-to-host copy for CUDA tensors), then tells the daemon. ``save()`` blocks for
  the whole copy.
- ``fork``: copy-on-write. The training process writes the header and the tensors fork cannot
  snapshot (CUDA tensors: fork cannot see device memory; tensors in shared mappings, whose
  later writes a child would see; non-contiguous and small ones), then forks. The child inherits a
  copy-on-write view of every tensor, ``memmove``s the rest into the segment from address lists
  the parent prepared before the fork (no torch, no logging, no locks in the child), sends the
  ``staged`` request it was handed, waits for the answer and ``_exit``s. ``save()`` blocks for the
  fork only; the hidden cost is paid later by the training process: its first write to each page
  that the child still shares faults and copies the page (``bench/tce.py`` measures it).

Both modes hold an exclusive ``flock`` on the segment file while the bytes are written (in fork
mode the child inherits it, so it outlives a parent killed mid-save). The daemon never hands out
a staging segment whose lock is held, so a writer that is still copying can never write into a
segment that was given to a later save; a writer that died releases it with its last descriptor.

:func:`fork_copy` returns the child's pid; the caller reaps it (:func:`reap`) off the training
thread. A child that fails exits non-zero: the save is reported failed and nothing is committed.
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import fcntl
import json
import os
import signal
import socket
import struct
from dataclasses import dataclass

__all__ = ["SnapshotMode", "ForkJob", "shared_ranges", "in_ranges", "partition", "lock_segment", "fork_copy", "reap",
           "MIN_FORK_BYTES"]

#: tensors smaller than this are copied by the parent: a fork buys nothing for them
MIN_FORK_BYTES = 1 << 20

_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_memmove = ctypes.memmove
_PAGE = os.sysconf("SC_PAGE_SIZE")


class SnapshotMode(str, enum.Enum):
    """How ``save()`` snapshots the tensors (see the module docstring)."""

    COPY = "copy"
    FORK = "fork"


def shared_ranges() -> tuple[list[int], list[int]]:
    """Start and end addresses of this process's shared mappings (``/proc/self/maps`` flag ``s``):
    a forked child sees the parent's later writes there, so those tensors are copied before the fork."""
    starts, ends = [], []
    with open("/proc/self/maps", "rb") as f:
        for line in f:
            rng, perms = line.split(b" ", 2)[:2]
            if perms[3:4] == b"s":
                lo, hi = rng.split(b"-")
                starts.append(int(lo, 16))
                ends.append(int(hi, 16))
    return starts, ends


def in_ranges(ranges: tuple[list[int], list[int]], addr: int, n: int) -> bool:
    """Whether ``[addr, addr + n)`` overlaps one of ``ranges`` (sorted, disjoint)."""
    starts, ends = ranges
    i = bisect.bisect_right(starts, addr) - 1
    if i >= 0 and ends[i] > addr:
        return True
    return i + 1 < len(starts) and starts[i + 1] < addr + n


def partition(tensors: list, offsets: list[int], seg_addr: int) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Split a shard's tensors into those the parent copies (indices) and the child's memmoves."""
    ranges = shared_ranges()
    parent, child = [], []
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        if n < MIN_FORK_BYTES or t.device.type != "cpu" or not t.is_contiguous() or \
                in_ranges(ranges, t.data_ptr(), n):
            parent.append(i)
        else:
            child.append((seg_addr + off, t.data_ptr(), n))
    return parent, child


def lock_segment(path: str) -> int:
    """An fd of the segment file holding an exclusive flock (never blocks: one writer per segment)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(f"{path} is still being written by another process") from None
    return fd


@dataclass
class ForkJob:
    """Everything the child needs, computed by the parent before the fork."""

    seg_addr: int                    # the segment mapping (same address in the child)
    size: int                        # shard bytes
    copies: list[tuple[int, int, int]]   # (dst, src, nbytes) for the child's memmoves
    sock_fd: int                     # a connection to the node's daemon, authenticated by the parent
    request: bytes                   # the length-prefixed ``staged`` request


def _child(job: ForkJob) -> int:
    # Runs in the forked child: only the calling thread exists here. Plain syscalls and memmove:
    # no torch (its thread pools are gone), no logging (a lock may have been held at the fork).
    try:
        # the controller's stop (SIGTERM to the rank's process group) must not cut the snapshot short:
        # the parent finishes the save (save at the fault); SIGKILL still ends this child
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:
            pass                          # not the main thread of the child: keep the default
        lo = job.seg_addr
        hi = job.seg_addr + -(-job.size // _PAGE) * _PAGE
        _libc.madvise(lo, hi - lo, _MADV_POPULATE_WRITE)    # one syscall, not a fault per page
        for dst, src, n in job.copies:
            _memmove(dst, src, n)
        s = socket.socket(fileno=job.sock_fd)
        s.sendall(job.request)
        head = b""
        while len(head) < 4:
            k = s.recv(4 - len(head))
            if not k:
                return 5
            head += k
        (n,) = struct.unpack(">I", head)
        body = b""
        while len(body) < n:
            k = s.recv(n - len(body))
            if not k:
                return 5
            body += k
        s.close()
        return 0 if json.loads(body).get("ok") else 6
    except BaseException:  # noqa: BLE001 - the exit status is the only channel back
        return 4


def fork_copy(job: ForkJob, lock_fd: int) -> int:
    """Fork a child that copies ``job`` and hands the shard to the daemon; return its pid.
    ``lock_fd`` (the segment's flock) and ``job.sock_fd`` go with the child: the caller closes its
    copies of them after this returns (``lock_fd`` is closed here)."""
    pid = os.fork()
    if pid == 0:
        code = 4
        try:
            code = _child(job)
        finally:
            os._exit(code)
    os.close(lock_fd)
    return pid


#: what a child's exit status means (``reap`` puts it into the error)
_CHILD_CODES = {4: "the copy or the request raised", 5: "the daemon closed the connection",
                6: "the daemon refused the staged shard"}


def reap(pid: int) -> str | None:
    """Wait for a snapshot child; None if it succeeded, else what went wrong."""
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        return None if code == 0 else f"snapshot child {pid} exited {code}: {_CHILD_CODES.get(code, 'unknown')}"
    if os.WIFSIGNALED(status):
        return f"snapshot child {pid} was killed by signal {os.WTERMSIG(status)}"
    return f"snapshot child {pid} ended with status {status}"
