"""Training collector: the latest report of each training rank, with its liveness.

Ranks are keyed by ``(job, generation, rank)``. Every collect gives, per known rank, one
``Source.TRAIN`` sample (index = rank) with the latest reported values and:

- ``alive``: 1 until the rank said it exits (its ``exit`` datagram), or, for a rank in this
  agent's own PID namespace, until the kernel says its pid is gone (or a zombie); a rank heard
  from by nothing for ``forget_s`` is also given up (``alive = 0``). A SIGSTOPped rank is alive.
- ``report_age_s``: seconds since its last training report (the step it shows).
- ``heartbeat_age_s``: seconds since anything was heard from it (report or heartbeat), on this
  agent's clock. This is what tells a stuck rank (stopped, or holding the GIL) across PID
  namespaces and containers: its heartbeat thread stops with it. No PID of another namespace
  is ever looked up (it would name an unrelated process, or none).
- ``stopped``: 1 when the kernel says the process is stopped (only in this PID namespace).
- ``write_bytes_per_s``: how fast the process wrote between its two newest readings of what it has
  written (the larger of the kernel's ``wchar``, bytes handed to write calls, and ``write_bytes``,
  bytes dirtied for storage: a file on local disk, tmpfs, NFS or Lustre, or a memory map). The rank's
  heartbeats carry the readings (its own ``/proc/self/io``: any namespace, any user); for a rank in
  this PID namespace whose heartbeats do not, the agent reads ``/proc/PID/io`` itself at each collect
  (which needs the rank's user, or root). Left out until two readings are known; a batch with no new
  reading repeats the last rate while the newest reading is at most two of its gaps old (heartbeats
  less often than batches), then leaves it out (a rank whose heartbeat stopped). A rank whose GPU idles while it writes saves a
  checkpoint (rank 0 behind a barrier) and is not hung: the TEE reads it (``docs/tee.md``, "A rank
  that writes saves").

Tags: ``job``, ``generation``, ``pid``, and when known ``phase`` (what the rank said it is doing:
checkpoint, eval, ...), ``stack`` (where its main thread waits, from its heartbeat; for a rank
in this namespace whose heartbeat stopped, ``py-spy dump`` when installed) and ``state`` (the
kernel's process state). The values are re-sent every interval while the rank lives, so a hang
reads as "alive, step not advancing". Once it is gone the rank gets one sample with
``alive = 0`` and is forgotten. The sample's time is the batch's: liveness is measured then.

Events (``report_event``: a checkpoint save and its stall, a restore and its tier) are not a rank's
state: each is published once, in the next collect, as a ``TRAIN`` sample with the event's own
time and fields, tagged ``event=NAME`` besides ``job``/``generation``/``pid`` (at most
``MAX_EVENTS`` wait between collects; beyond that the oldest are dropped and counted in the log).

``job`` is the job of the newest report (``None`` before any, or when it was empty).
Thread-safe: reports arrive on the intake thread, collects on the agent's loop.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import psutil

from transom import contracts
from transom.log import get

from .collectors import LogOnce
from .intake import TrainReport, written

__all__ = ["TrainingCollector"]

log = get("agent.train")

_Key = tuple[str, int, int]
#: Events kept between two collects (beyond: the oldest are dropped).
MAX_EVENTS = 1000


#: A rank heard from by nothing (report, heartbeat) for this long is given up (alive = 0).
FORGET_S = 900.0
#: A rank in this PID namespace silent for this long, or stopped, gets a py-spy stack sample (when installed).
STACK_AFTER_S = 5.0


@dataclass
class _Rank:
    report: TrainReport
    proc: psutil.Process | None
    heard: float = 0.0              # this agent's clock: the last datagram of the rank
    phase: str = ""
    stack: str = ""
    exited: bool = False
    sampling: bool = False          # a py-spy dump is under way
    extra: dict = field(default_factory=dict)
    io: tuple[float, int, int] | None = None      # the newest reading: (monotonic time, wchar, write_bytes)
    io_used: tuple[float, int, int] | None = None  # the reading the last write rate ended at
    beats_io: bool = False                         # its heartbeats carry its readings
    rate: tuple[float, float] | None = None        # the last write rate and the time between its two readings


def _own_pidns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


_PIDNS = _own_pidns()


def _open(report: TrainReport) -> psutil.Process | None:
    """The rank's process, only when it lives in this agent's PID namespace (else its pid means nothing here)."""
    if report.pidns != _PIDNS or not _PIDNS:
        return None
    try:
        return psutil.Process(report.pid)
    except psutil.Error:
        return None


def _state(proc: psutil.Process | None) -> str:
    if proc is None:
        return ""
    try:
        return proc.status()
    except psutil.Error:
        return ""


def _py_spy(pid: int) -> str:
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if exe is None:
        return ""
    try:
        out = subprocess.run([exe, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return " < ".join(line.strip() for line in out.splitlines() if line.startswith("    "))[:4000]


def _write_rate(r: "_Rank", clock: float, heartbeats: bool) -> float | None:
    """Bytes per second ``r``'s process wrote between the reading the last rate ended at and the newest one
    (None without a new reading). ``heartbeats``: the rank's heartbeats carry its readings; else the agent
    reads the process's counters itself (this PID namespace only)."""
    if not heartbeats and r.proc is not None and (now := written(f"/proc/{r.proc.pid}/io")) is not None:
        r.io = (clock, *now)
    before, after = r.io_used, r.io
    if after is None:
        return None
    if before is not None and after[0] <= before[0]:
        # no new reading: heartbeats less often than collects keep their last rate while they keep their pace
        # (a rank whose heartbeat stopped gets none after two of its gaps)
        if r.rate is not None and clock - after[0] <= 2 * r.rate[1]:
            return r.rate[0]
        return None
    r.io_used = after
    if before is None:
        return None
    rate = max(0, after[1] - before[1], after[2] - before[2]) / (after[0] - before[0])
    r.rate = (rate, after[0] - before[0])
    return rate


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
        now = time.time()
        with self._lock:
            known = self._ranks.get(key)
            same = known is not None and known.report.pid == report.pid
            if report.kind != "train":
                if not same:
                    return      # liveness of a rank that has not reported yet: nothing to show
                known.heard, known.phase, known.stack = now, report.phase, report.stack
                known.exited = known.exited or report.kind == "exit"
                if report.io is not None:
                    known.io, known.beats_io = (time.monotonic(), *report.io), True
                return
            proc = known.proc if same else _open(report)
            if known is None:
                log.info("training rank %d of job %s (generation %d, pid %d) reports to this agent",
                         report.rank, report.job or "?", report.generation, report.pid)
            self._ranks[key] = _Rank(report, proc, heard=now, phase=report.phase, io=known.io if same else None,
                                     io_used=known.io_used if same else None, beats_io=same and known.beats_io,
                                     rate=known.rate if same else None)
            self._job = report.job or None

    def processes(self) -> list[psutil.Process]:
        """The live processes of the ranks that reported (for hang injection)."""
        with self._lock:
            procs = [r.proc for r in self._ranks.values() if r.proc is not None]
        return [p for p in procs if _alive(p)]

    def _sample_stack(self, r: _Rank) -> None:
        stack = _py_spy(r.report.pid)
        if stack and not r.stack:
            r.stack = f"py-spy: {stack}"

    def __len__(self) -> int:
        with self._lock:
            return len(self._ranks)

    def collect(self) -> list[contracts.Sample]:
        now = time.time()
        with self._lock:
            if not self._ranks and self._job is not None:
                # no rank of any job left here since the last batch (the one that said its last rank was
                # gone, in its job): the node's metrics go out without a job from now on, so a node
                # replaced and cordoned is no longer judged among its old job's peers
                log.info("no training rank left on this node: its metrics no longer carry job %s", self._job)
                self._job = None
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
            rep = r.report
            silent = max(0.0, now - r.heard)
            alive = not r.exited and silent < FORGET_S and (r.proc is None or _alive(r.proc))
            fields = {**rep.values, "alive": int(alive), "report_age_s": max(0.0, now - rep.ts),
                      "heartbeat_age_s": round(silent, 3)}
            tags = {"job": rep.job, "generation": str(rep.generation), "pid": str(rep.pid)}
            state = _state(r.proc) if alive else ""
            stopped = state == psutil.STATUS_STOPPED       # SIGSTOP: its stack at once (the TEE judges it in seconds)
            if stopped:
                fields["stopped"] = 1
            if alive and (rate := _write_rate(r, time.monotonic(), r.beats_io)) is not None:
                fields["write_bytes_per_s"] = round(rate)
            if state and state != psutil.STATUS_SLEEPING and state != psutil.STATUS_RUNNING:
                tags["state"] = state
            if r.phase:
                tags["phase"] = r.phase
            if alive and r.proc is not None and (silent > STACK_AFTER_S or stopped) and not r.stack \
                    and not r.sampling:
                r.sampling = True
                threading.Thread(target=self._sample_stack, args=(r,), daemon=True).start()
            if r.stack:
                tags["stack"] = r.stack
            samples.append(contracts.Sample(contracts.Source.TRAIN, fields, index=rep.rank, tags=tags))
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
