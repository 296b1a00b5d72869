"""The job side of the repartitioned peers detector: a job's window, released whole and in order.

No Faust here. The TEE workers summarise each node's closed soft-detection window on the worker
that reads the node's metrics and send it, keyed by job, through ``transom.peer-windows`` (see
:mod:`.app`); the summaries of one job's window come from several node partitions, possibly several
workers, in any order and at any skew. :class:`JobWindows` holds them until the job's window ``k``
is complete, then releases all of them together, sorted by node, before anything of window ``k+1``,
so the peers detector judges the same peer set whatever the number of workers.

Window ``k`` of a job is complete when every node of the job that reported one of the ``wait`` windows
before ``k`` has sent window ``k`` or a later one (a node's summaries arrive in its own order, so a
node past ``k`` without ``k`` skipped it). A node gone silent holds its job back until another node
of the job is ``wait`` windows past ``k``; then ``k`` is released without it, and it is no longer
waited for. A job's first window is released on that rule alone (its nodes are not known yet). A
window arriving after its job's window was released (a node far behind the others) is released at
once, alone: it is judged without peers, as on a worker that never saw them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from transom.contracts import PeerWindow

__all__ = ["JobWindows", "window_complete", "drop_gone"]


def window_complete(newest: dict[str, int], k: int, wait: int) -> bool:
    """Whether every node that reported one of the ``wait`` windows before ``k`` has reported ``k`` or a
    later one (``newest``: node -> the newest window index it reported)."""
    return all(i >= k for i in newest.values() if i >= k - wait)


def drop_gone(newest: dict[str, int], k: int, wait: int) -> None:
    """Forget the nodes whose newest window is more than ``wait`` windows before ``k``: gone from the job."""
    for n in [n for n, i in newest.items() if i < k - wait]:
        del newest[n]


@dataclass
class _Job:
    waiting: dict[int, dict[str, PeerWindow]] = field(default_factory=lambda: defaultdict(dict))
    newest: dict[str, int] = field(default_factory=dict)     # node -> newest window index received
    released: int = -1


class JobWindows:
    """Collects :class:`PeerWindow` summaries by job and window; :meth:`add` returns those released."""

    def __init__(self, wait: int = 3) -> None:
        if wait < 1:
            raise ValueError("wait must be at least one window")
        self.wait = wait
        self._jobs: dict[str, _Job] = {}
        self.late = 0          # windows that came after their job's window was released

    def add(self, w: PeerWindow) -> list[PeerWindow]:
        j = self._jobs.get(w.job)
        if j is None:
            j = self._jobs[w.job] = _Job()
        j.newest[w.node] = max(j.newest.get(w.node, w.index), w.index)
        if w.index <= j.released:
            self.late += 1
            return [w]
        j.waiting[w.index][w.node] = w
        return self._release(j)

    def _release(self, j: _Job) -> list[PeerWindow]:
        out: list[PeerWindow] = []
        while j.waiting:
            k = min(j.waiting)
            ahead = max(j.newest.values()) >= k + self.wait
            complete = j.released >= 0 and window_complete(j.newest, k, self.wait)
            if not (complete or ahead):
                break
            got = j.waiting.pop(k)
            j.released = k
            out += [got[n] for n in sorted(got)]
            drop_gone(j.newest, k, self.wait)      # gone from the job: not waited for again
        return out

    def flush(self) -> list[PeerWindow]:
        """Release every window still held (end of a replay)."""
        out: list[PeerWindow] = []
        for j in self._jobs.values():
            for k in sorted(j.waiting):
                got = j.waiting.pop(k)
                j.released = k
                out += [got[n] for n in sorted(got)]
        return out

    def forget(self, jobs: Iterable[str]) -> None:
        """These jobs are another worker's now."""
        for job in jobs:
            self._jobs.pop(job, None)
