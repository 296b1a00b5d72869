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
waited for. With ``quiet_s`` (the event clock), also only once nothing of the node (a window or a
read mark) came for that many seconds of the worker's own time: in a replay a worker may read its
partitions hours of sample time behind another's, and a node it still reads is behind, not gone.
A job's first window is released on that rule alone (its nodes are not known yet). A
window arriving after its job's window was released (a node far behind the others) is released at
once; the peers detector judges it against the peers its job's window was decided with.

:class:`JobReports` does the same for a job's rank reports on the event clock (a replay, where a
worker reads its partitions minutes of sample time apart): it holds them until every node of the job
has reported past them, then releases them in time order, so the hang rules compare each rank with
where its peers stood at the same time, not minutes earlier or later.
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import count
from typing import Callable, Iterable

from transom.contracts import PeerWindow, RankReport

__all__ = ["JobReports", "JobWindows", "is_read_mark", "apart_from_marks", "window_complete", "drop_gone", "quiet_for"]


def is_read_mark(r: RankReport) -> bool:
    """Whether ``r`` only says how far its node was read (``TEEEngine.read_up_to``): no samples, no utilisation."""
    return not r.samples and r.gpu_util is None


def apart_from_marks(ranks: Iterable[RankReport]) -> tuple[tuple[RankReport, ...], tuple[RankReport, ...]]:
    """``ranks`` as (the reports, the read marks), each in its order: a mark must come after what it says was sent.
    A silence mark (``silent_s``) stays among the reports, in its order: it is judged, with the reports of its
    time (a feed split in parts, a replay's minutes of a job, must not carry it past the reports that follow it)."""
    reports, marks = [], []
    for r in ranks:
        (marks if is_read_mark(r) and r.silent_s is None else reports).append(r)
    return tuple(reports), tuple(marks)


def window_complete(newest: dict[str, int], k: int, wait: int) -> bool:
    """Whether every node that reported one of the ``wait`` windows before ``k`` has reported ``k`` or a
    later one (``newest``: node -> the newest window index it reported)."""
    return all(i >= k for i in newest.values() if i >= k - wait)


def quiet_for(heard: dict[str, float], now: float, quiet_s: float) -> Callable[[str], bool]:
    """Whether nothing of a node came for ``quiet_s`` seconds before ``now`` (``heard``: node -> when something
    of it last came, on the same clock; 0 s: always)."""
    if not quiet_s:
        return lambda n: True
    return lambda n: now - heard.get(n, now) >= quiet_s


def drop_gone(newest: dict[str, int], k: int, wait: int, quiet: Callable[[str], bool] = lambda n: True) -> None:
    """Forget the nodes whose newest window is more than ``wait`` windows before ``k`` (and that are
    ``quiet``: nothing of them came for a while): gone from the job."""
    for n in [n for n, i in newest.items() if i < k - wait and quiet(n)]:
        del newest[n]


@dataclass
class _Job:
    waiting: dict[int, dict[str, PeerWindow]] = field(default_factory=lambda: defaultdict(dict))
    newest: dict[str, int] = field(default_factory=dict)     # node -> newest window index received
    heard: dict[str, float] = field(default_factory=dict)    # node -> when a window or mark of it came (own clock)
    released: int = -1
    marked: bool = False          # the node side says how far it read the job's nodes (read_past)


class JobWindows:
    """Collects :class:`PeerWindow` summaries by job and window; :meth:`add` returns those released.
    ``quiet_s``: a node behind is given up on only once nothing of it came for that many seconds of
    ``clock`` (0: on the window count alone)."""

    def __init__(self, wait: int = 3, quiet_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        if wait < 1:
            raise ValueError("wait must be at least one window")
        if not quiet_s >= 0:
            raise ValueError("quiet_s must be a number of seconds >= 0")
        self.wait, self.quiet_s, self.clock = wait, quiet_s, clock
        self._jobs: dict[str, _Job] = {}
        self.late = 0          # windows that came after their job's window was released

    def _job(self, job: str) -> _Job:
        j = self._jobs.get(job)
        if j is None:
            j = self._jobs[job] = _Job()
        return j

    def add(self, w: PeerWindow) -> list[PeerWindow]:
        j = self._job(w.job)
        j.newest[w.node] = max(j.newest.get(w.node, w.index), w.index)
        j.heard[w.node] = self.clock()
        if w.index <= j.released:
            self.late += 1
            return [w]
        j.waiting[w.index][w.node] = w
        return self._release(j)

    def read_past(self, job: str, passed: dict[str, int]) -> list[PeerWindow]:
        """The node side read these nodes of ``job`` past the end of these windows (node -> index; its
        partition's clock, :meth:`TEEEngine.read_up_to`), and sent every window of theirs that closed
        before: a node without window ``k`` then had none (silent), and ``k`` does not wait for it. The
        nodes it names are the job's, so the job's first window waits for them too. Returns the windows
        this completes. (On the event clock, where a replay reads partitions tens
        of minutes apart: a node read far behind is not silent, and its job waits for it.)"""
        j = self._job(job)
        j.marked = True                 # the job's nodes are known: its first window needs them all too
        now = self.clock()
        for node, k in passed.items():
            j.heard[node] = now
            if k > j.newest.get(node, k - 1):
                j.newest[node] = k
        return self._release(j)

    def _release(self, j: _Job) -> list[PeerWindow]:
        out: list[PeerWindow] = []
        now = self.clock()
        quiet = quiet_for(j.heard, now, self.quiet_s)
        while j.waiting:
            k = min(j.waiting)
            complete = (j.released >= 0 or j.marked) and window_complete(j.newest, k, self.wait)
            # another node `wait` windows past k, and the nodes without k fell silent (not only read behind)
            ahead = not complete and max(j.newest.values()) >= k + self.wait and \
                all(quiet(n) for n, i in j.newest.items() if k - self.wait <= i < k)
            if not (complete or ahead):
                break
            got = j.waiting.pop(k)
            j.released = k
            out += [got[n] for n in sorted(got)]
            drop_gone(j.newest, k, self.wait, quiet)      # gone from the job: not waited for again
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


@dataclass
class _Reports:
    held: list = field(default_factory=list)                 # heap of (ts, arrival, report)
    newest: dict[str, float] = field(default_factory=dict)   # node -> the newest report time received
    heard: dict[str, float] = field(default_factory=dict)    # node -> when a report or mark of it came (own clock)


class JobReports:
    """Holds a job's :class:`RankReport` values until every node of the job has reported one as late or
    later (a node's reports arrive in its own order), then :meth:`add` releases them in time order. A
    report with no samples and no utilisation only says how far the node was read (the node side's
    partition clock: :meth:`TEEEngine.read_up_to`), so a silent node does not hold its job; it is not
    released, unless it is a silence mark (``silent_s``: the job's worker judges the node's silence, in
    its order with the other reports). A node whose newest report is more than ``wait`` seconds (sample
    time) behind the job's newest, and of which nothing (a report or a read mark) came for ``quiet_s`` seconds of ``clock``
    (the worker's own time), is gone (left the job, its worker stopped) and no longer waited for; one
    that comes back is waited for again (what it sends meanwhile is released at once: the job is past
    it). A node whose worker reads it hours of sample time behind the others' (a replay on a busy
    machine) still sends its reports and marks: it is behind, not gone, and its job waits for it."""

    def __init__(self, wait: float, quiet_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not wait > 0:
            raise ValueError("wait must be a positive number of seconds")
        if not quiet_s >= 0:
            raise ValueError("quiet_s must be a number of seconds >= 0")
        self.wait, self.quiet_s, self.clock = wait, quiet_s, clock
        self._jobs: dict[str, _Reports] = {}
        self._arrival = count()          # ties in time keep their arrival order

    def add(self, job: str, reports: Iterable[RankReport]) -> list[RankReport]:
        j = self._jobs.get(job)
        if j is None:
            j = self._jobs[job] = _Reports()
        now = self.clock()
        for r in reports:
            j.heard[r.node] = now
            if r.ts > j.newest.get(r.node, 0.0):
                j.newest[r.node] = r.ts
            if not is_read_mark(r) or r.silent_s is not None:      # (a silence mark is judged, in its order)
                heapq.heappush(j.held, (r.ts, next(self._arrival), r))
        if not j.newest:
            return []
        top, quiet = max(j.newest.values()), quiet_for(j.heard, now, self.quiet_s)
        for node in [n for n, t in j.newest.items() if t < top - self.wait and quiet(n)]:
            del j.newest[node]
        mark = min(j.newest.values())
        out = []
        while j.held and j.held[0][0] <= mark:
            out.append(heapq.heappop(j.held)[2])
        return out

    def flush(self) -> dict[str, list[RankReport]]:
        """Release every report still held, by job (end of a replay)."""
        out = {}
        for job, j in self._jobs.items():
            if j.held:
                out[job] = [r for _, _, r in sorted(j.held)]
                j.held.clear()
        return out

    def forget(self, jobs: Iterable[str]) -> None:
        """These jobs are another worker's now."""
        for job in jobs:
            self._jobs.pop(job, None)
