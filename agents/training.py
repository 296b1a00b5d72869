"""Training collector: the latest report of each training rank, with its liveness.

Ranks are keyed by ``(job, generation, rank)``. Every collect gives, per known rank, one
``Source.TRAIN`` sample (index = rank) with the latest reported values, ``alive`` (1 while the
reporting pid exists and is not a zombie, checked with psutil; a SIGSTOPped pid is alive) and
``report_age_s``, tagged ``job``, ``generation`` and ``pid``. The values are re-sent every
interval while the pid lives, so a hang reads as "alive, step not advancing". Once the pid is
gone the rank gets one sample with ``alive = 0`` and is forgotten. The sample's time is the
batch's: liveness is measured then.

Events (``report_event``: a checkpoint save and its stall, a restore and its tier) are not a rank's
state: each is published once, in the next collect, as a ``TRAIN`` sample with the event's own
time and fields, tagged ``event=NAME`` besides ``job``/``generation``/``pid`` (at most
``MAX_EVENTS`` wait between collects; beyond that the oldest are dropped and counted in the log).

``job`` is the job of the newest report (``None`` before any, or when it was empty).
Thread-safe: reports arrive on the intake thread, collects on the agent's loop.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import psutil

from transom import contracts
from transom.log import get

from .collectors import LogOnce
from .intake import TrainReport

__all__ = ["TrainingCollector"]

log = get("agent.train")

_Key = tuple[str, int, int]
#: Events kept between two collects (beyond: the oldest are dropped).
MAX_EVENTS = 1000


@dataclass
class _Rank:
    report: TrainReport
    proc: psutil.Process | None


def _open(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _alive(proc: psutil.Process | None) -> bool:
    if proc is None:
        return False
    try:
        # is_running() also compares the creation time, so a reused pid reads as gone
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


class TrainingCollector:
    name = "train"

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._ranks: dict[_Key, _Rank] = {}
        self._events: list[TrainReport] = []
        self._dropped_events = 0
        self._job: str | None = None
        self._once = LogOnce(log)

    @property
    def job(self) -> str | None:
        return self._job

    def update(self, report: TrainReport) -> None:
        if report.node and report.node != self.node:
            self._once(("node", report.node), logging.WARNING,
                       "a training process of node %s (pid %d) reports to the agent of node %s; "
                       "check TRANSOM_NODE and TRANSOM_AGENT_ADDR", report.node, report.pid, self.node)
        key = (report.job, report.generation, report.rank)
        if report.event:
            with self._lock:
                self._events.append(report)
                if len(self._events) > MAX_EVENTS:
                    del self._events[0]
                    self._dropped_events += 1
            return
        with self._lock:
            known = self._ranks.get(key)
            proc = known.proc if known is not None and known.report.pid == report.pid else _open(report.pid)
            if known is None:
                log.info("training rank %d of job %s (generation %d, pid %d) reports to this agent",
                         report.rank, report.job or "?", report.generation, report.pid)
            self._ranks[key] = _Rank(report, proc)
            self._job = report.job or None

    def processes(self) -> list[psutil.Process]:
        """The live processes of the ranks that reported (for hang injection)."""
        with self._lock:
            procs = [r.proc for r in self._ranks.values() if r.proc is not None]
        return [p for p in procs if _alive(p)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._ranks)

    def collect(self) -> list[contracts.Sample]:
        now = time.time()
        with self._lock:
            ranks = list(self._ranks.items())
            events, self._events = self._events, []
            dropped, self._dropped_events = self._dropped_events, 0
        if dropped:
            log.warning("%d training events dropped: more than %d arrived between two collects", dropped, MAX_EVENTS)
        samples = [contracts.Sample(contracts.Source.TRAIN, dict(e.values), index=e.rank, ts=e.ts,
                                    tags={"job": e.job, "generation": str(e.generation), "pid": str(e.pid),
                                          "event": e.event})
                   for e in events]
        gone = []
        for key, r in ranks:
            alive = _alive(r.proc)
            rep = r.report
            fields = {**rep.values, "alive": int(alive), "report_age_s": max(0.0, now - rep.ts)}
            samples.append(contracts.Sample(
                contracts.Source.TRAIN, fields, index=rep.rank,
                tags={"job": rep.job, "generation": str(rep.generation), "pid": str(rep.pid)}))
            if not alive:
                gone.append((key, r))
        if gone:
            with self._lock:
                for key, r in gone:
                    if self._ranks.get(key) is r:  # unless a newer report replaced it meanwhile
                        del self._ranks[key]
                        log.info("training rank %d of job %s (pid %d) is gone; reported alive=0 and forgotten",
                                 r.report.rank, r.report.job or "?", r.report.pid)
        return samples
