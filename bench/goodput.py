"""Goodput: one training job under the same faults, plain vs. torchrun retry loop vs. TorchFT vs. Transom.

One invocation runs, one after the other on this machine: (0) **plain**: the job with no
fault-tolerance system (one torchrun attempt, no checkpoint, no fault), whose step time is the
yardstick; (a) **torchrun**: the retry loop with synchronous ``torch.save`` of
``bench/tol_torchrun_job.py``, re-invoked after every failure, a step-progress watchdog for hangs;
(b) **torchft**: TorchFT 0.2.0, a Lighthouse and one Manager per replica group
(``bench/torchft_job.py``; gloo timeout 5 s as TorchFT's example, Lighthouse heartbeat 1 s), a
group relaunched when it exits or stays stuck past the watchdog, the survivors going on;
(c) **transom**: ``LocalStack`` (broker, agents with simulated GPUs, TCE daemons, TEE, controller)
running ``transom.examples.train_lm``, its services at nice ``--services-nice``, every fault a
relaunch of the whole job from the newest peer-memory checkpoint. ``--hosts``: Transom on the
hosts test bed (``LocalStack(hosts=True)``: a control host, a host per node), the others on one
host; faults reach the ranks across the hosts' PID namespaces and an XID 79 also kills its host.

Faults are placed by training progress (``make_schedule``): fault i after step N_i, the same steps,
kinds (crash: SIGKILL; xid79: SIGKILL plus XID 79 on Transom's simulated GPU; hang: SIGSTOP;
straggler: the slot spins (1/f - 1) x its step every step) and ranks for every system; plus one
evaluation pause of 30-60 s (``make_eval_pause``): every rank sleeps until a time the bench writes
to ``slow/pause``, with no phase marker; a restart during it is a false restart.

Figures: steady step and overhead against the plain step; effective training time ratio = steps x
plain step (+ the pause) / wall; lost seconds per fault (the wall time until the job has made
``LOSS_STEPS`` steps of new progress past the step it hit, or to the next fault, the pause or the
end if sooner, less that progress x the pace around it) with its detection, recovery and
recomputation parts; issue 17's targets with met flags in the one JSON line at the end. Method and
figures: docs/goodput.md.

``--combine OUTPUT...`` runs nothing: it pools the faults of saved runs (each output ends in its JSON
line) and grades the per-kind targets on the pool. Stragglers are graded that way, one per run: once a
system that never replaces a straggler has one, a synchronous job is slow at its pace, and a later
straggler of the same run costs that system next to nothing (docs/goodput.md, "Targets").
"""

from __future__ import annotations

import abc
import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

__all__ = ["KINDS", "EvalPause", "ScheduledFault", "make_eval_pause", "make_schedule", "renice_threads", "main"]

KINDS = ("crash", "xid79", "hang", "straggler")
RESTARTING = ("crash", "xid79", "hang")
#: a fault's lost seconds: the wall time to LOSS_STEPS steps of new progress past the step it hit (a
#: straggler: past its replacement), less that progress x the pace: the mean of the LOCAL_STEPS steps
#: before it and of the last LOCAL_STEPS of the window (the same for every system; Runner._window_figures)
LOSS_STEPS = 60
LOCAL_STEPS = 30


@dataclass(frozen=True)
class ScheduledFault:
    """Fault ``index`` of the schedule: ``kind`` on rank slot ``rank`` once the job has done ``after_step`` steps."""

    index: int
    after_step: int
    kind: str
    rank: int


@dataclass(frozen=True)
class EvalPause:
    """The job's evaluation pause: every rank stops stepping for ``seconds`` after step ``after_step``."""

    after_step: int
    seconds: float


def renice_threads(procs, ranks: set[int], services_nice: int) -> int:
    """Every thread of ``procs`` (psutil processes) at nice 0 when its process is one of ``ranks``, else at
    ``services_nice``. Each thread: Linux keeps a nice value per thread, and setpriority on a PID changes
    only its main thread, so threads a process started before its renice keep the old value (a warm spare
    at the services' nice that takes a rank has made its gloo threads by the time the bench sees it as a
    rank: that rank's all-reduce would lag the job's). Returns how many threads refused the change (lowering
    a nice value needs the privilege); a thread that ended meanwhile is skipped."""
    import psutil
    refused = 0
    for proc in procs:
        want = 0 if proc.pid in ranks else services_nice
        try:
            tids = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        for tid in tids:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) != want:
                    os.setpriority(os.PRIO_PROCESS, tid, want)
            except ProcessLookupError:
                continue
            except PermissionError:
                refused += 1
    return refused


def make_schedule(seed: int, every_steps: float, count: int, world: int, kinds: Iterable[str] = KINDS,
                  jitter: float = 0.2) -> list[ScheduledFault]:
    """The seeded fault schedule by training progress: the same arguments give the same list.

    Fault i comes after step about ``(i + 1) * every_steps`` (jitter +-20 %, strictly increasing),
    kinds in shuffled rounds of ``kinds``, the target rank from the seed.
    """
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"--kinds: {unknown or 'nothing'} given; expected some of {', '.join(KINDS)}")
    if every_steps < 1 or world < 1 or count < 0 or not 0 <= jitter < 0.5:
        raise ValueError("make_schedule: every_steps >= 1, world >= 1, count >= 0 and 0 <= jitter < 0.5 expected")
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < count:
        round_ = list(kinds)
        rng.shuffle(round_)
        order += round_
    out: list[ScheduledFault] = []
    for i in range(count):
        step = max(1, round(every_steps * (i + 1) + rng.uniform(-jitter, jitter) * every_steps))
        if out and step <= out[-1].after_step:
            step = out[-1].after_step + 1
        out.append(ScheduledFault(i, step, order[i], rng.randrange(world)))
    return out


def spares_needed(schedule: list[ScheduledFault], steps: int, floor: int = 1) -> int:
    """Transom's warm spares for a run: one per XID 79 and straggler that comes (each takes a spare) plus
    one, at least ``floor``. Faults scheduled after the last step never come: a spare kept warm for one
    would only load the machine (each is an agent, a checkpoint daemon and a built job beside the ranks)."""
    taken = sum(1 for f in schedule if f.kind in ("xid79", "straggler") and f.after_step < steps)
    return max(floor, taken + 1)


def make_eval_pause(seed: int, steps: int, schedule: list[ScheduledFault], low_s: float = 30.0,
                    high_s: float = 60.0) -> EvalPause:
    """One evaluation pause of ``low_s``-``high_s`` seconds (from the seed) half way between the two
    faults around the middle of the job (never at a fault's step), or at the middle without faults."""
    if not 0 < low_s <= high_s or steps < 2:
        raise ValueError("make_eval_pause: 0 < low_s <= high_s and steps >= 2 expected")
    rng = random.Random(seed * 7919 + 17)
    seconds = round(rng.uniform(low_s, high_s), 1)
    marks = [0] + [f.after_step for f in schedule if f.after_step < steps] + [steps]
    mid = steps // 2
    i = max(k for k in range(len(marks) - 1) if marks[k] <= mid)   # the gap that holds the middle
    lo, hi = marks[i], marks[i + 1]
    step = (lo + hi) // 2
    if step in (lo, hi) or step < 1:
        step = mid if mid not in marks else max(1, mid - 1)
    return EvalPause(step, seconds)


# --------------------------------------------------------------------------- shared measurement parts

class StepsFile:
    """Reads the ``step generation epoch_seconds [s]`` lines rank 0 appends (partial last lines wait); ``s``
    marks a step that was saved (``saves``)."""

    def __init__(self, path: Path, first_only: bool = False) -> None:
        self.path = path
        path.touch()
        self._pos = 0
        self._rest = b""
        self.rows: list[tuple[int, int, float]] = []
        self.saves: set[int] = set()
        # TorchFT: every replica group writes ``step group ts``; a step counts once, when the first
        # group commits it, as generation 0 (no job-wide restart); ``group_last`` per group
        self.first_only = first_only
        self.group_last: dict[int, float] = {}

    def read(self) -> list[tuple[int, int, float]]:
        with open(self.path, "rb") as fh:
            fh.seek(self._pos)
            data = fh.read()
            self._pos += len(data)
        data = self._rest + data
        lines = data.split(b"\n")
        self._rest = lines.pop()
        new = []
        for ln in lines:
            parts = ln.split()
            if len(parts) in (3, 4):
                row = (int(parts[0]), int(parts[1]), float(parts[2]))
                if parts[3:] == [b"s"]:
                    self.saves.add(row[0])
                if self.first_only:
                    self.group_last[row[1]] = row[2]
                    top = new[-1][0] if new else (self.rows[-1][0] if self.rows else 0)
                    if row[0] <= top:
                        continue
                    row = (row[0], 0, row[2])
                new.append(row)
        self.rows += new
        return new

    @property
    def last(self) -> tuple[int, int, float] | None:
        return self.rows[-1] if self.rows else None


@dataclass
class FaultRecord:
    index: int
    kind: str
    rank: int
    after_step: int
    delivered_s: float | None = None        # seconds after the run's start
    target: str = ""                        # node (Transom) or local rank slot (torchrun)
    step_at_fault: int | None = None
    gen_at_fault: int | None = None
    detected_s: float | None = None         # seconds after the run's start
    detector: str = ""
    first_step_s: float | None = None
    resume_step: int | None = None
    detect_s: float | None = None           # the three parts of the time lost, seconds
    recover_s: float | None = None
    recompute_s: float | None = None
    steps_redone: int | None = None
    slowdown_s: float | None = None         # stragglers: extra time of the steps it slowed
    tee_event_s: float | None = None        # Transom: the TEE's fault event for this fault, if any
    restarted: bool = False                 # a straggler whose node the controller replaced
    lost_s: float | None = None             # wall time to LOSS_STEPS of new progress - that progress x the pace
    note: str = ""
    path: str = ""                          # Transom: how it recovered (in-job, relaunch, in-job -> relaunch)
    healed_at: float | None = None          # Transom, in-job: epoch time the new group was synced


@dataclass
class PauseRecord:
    """The evaluation pause as a run saw it; any restart or hang event during it is a false one."""

    after_step: int
    seconds: float
    delivered_s: float | None = None
    false_restarts: int = 0
    false_events: list[str] = field(default_factory=list)
    lost_s: float | None = None             # beyond the pause itself


@dataclass
class RunResult:
    name: str
    steps: int
    completed: bool = False
    wall_s: float | None = None
    startup_s: float | None = None
    warm_s: float | None = None             # Transom: run start -> every warm spare ready (the steady window opens)
    normal_step_s: float | None = None
    steady_step_s: float | None = None      # mean step of undisturbed stretches, checkpoint stalls included
    overhead: float | None = None           # steady_step_s / the plain run's step - 1
    ckpt_overhead_s: float | None = None
    plain_step_s: float | None = None       # the plain step it is graded against (see grade())
    useful_s: float | None = None
    effective_ratio: float | None = None
    attempts: int = 1
    normal_note: str = ""
    faults: list[FaultRecord] = field(default_factory=list)
    pause: PauseRecord | None = None
    error: str = ""


def _signal(pid: int, sig: int, rec: FaultRecord) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        rec.note = f"rank process {pid} was already gone"


def _kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    import psutil
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.send_signal(sig)
            if sig == signal.SIGKILL:
                continue
            p.send_signal(signal.SIGCONT)
        except psutil.Error:
            pass


class Runner(abc.ABC):
    """One run: launches the job, delivers the schedule, measures. Subclasses launch and target."""

    name = "run"

    def __init__(self, args: argparse.Namespace, work: Path, schedule: list[ScheduledFault],
                 pause: EvalPause | None = None) -> None:
        self.args, self.work, self.schedule, self.eval_pause = args, work, schedule, pause
        self.work.mkdir(parents=True, exist_ok=True)
        self.steps = StepsFile(self.work / "steps.txt", first_only=self.name == "torchft")
        self.result = RunResult(self.name, args.steps)
        if pause is not None:
            self.result.pause = PauseRecord(pause.after_step, pause.seconds)
        self.hung: set[int] = set()
        self.slow_dir = self.work / "slow"
        self.slow_dir.mkdir(exist_ok=True)
        self.t0 = 0.0
        self.end_ts: float | None = None   # the job ended (torchrun exit 0 / Transom ``completed``)
        self.gen = 0                      # current attempt / generation (launched)
        self.warm_ts: float | None = None  # the system's start-up work done (Transom: its warm spares ready)
        self.slow_slots: list[str] = []

    # hooks --------------------------------------------------------------
    def launch(self) -> None: ...
    def tick(self, now: float) -> None: ...
    def finished(self) -> bool: ...
    def rank_pid(self, rank: int) -> int | None: ...
    def slot_of(self, rank: int) -> str: ...
    def inject_gpu(self, slot: str, fault: str) -> None: ...
    def teardown(self) -> None: ...

    # the loop -----------------------------------------------------------
    def run(self) -> RunResult:
        a = self.args
        pending = list(self.schedule)
        last_progress = 0.0
        try:
            self.t0 = time.time()
            self.launch()
            deadline = time.monotonic() + a.run_timeout
            while time.monotonic() < deadline:
                now = time.time()
                for row in self.steps.read():
                    self._on_step(row)
                self.tick(now)
                if self.finished():
                    break
                top = self._top_step()
                p = self.result.pause
                if p is not None and p.delivered_s is None and top >= p.after_step and self._ready():
                    self._pause(now)
                elif pending and top >= pending[0].after_step and self._ready():
                    self._deliver(pending.pop(0), now)
                if now >= last_progress + a.progress_every:
                    last_progress = now
                    last = self.steps.last
                    print(f"  [{now - self.t0:6.1f}s] {self.name}: step {last[0] if last else 0}/{a.steps} "
                          f"gen/attempt {self.gen}, faults delivered {len(self.result.faults)}", flush=True)
                time.sleep(0.05)
            else:
                self.result.error = f"timed out after {a.run_timeout:.0f}s (--run-timeout)"
            for row in self.steps.read():
                self._on_step(row)
        finally:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C must not strand processes
            try:
                self.teardown()
            finally:
                signal.signal(signal.SIGINT, previous)
        self._measure()
        return self.result

    def _top_step(self) -> int:
        return max((r[0] for r in self.steps.rows[-50:]), default=0) if self.steps.rows else 0

    def _pause(self, now: float) -> None:
        """Every rank stops stepping until ``now + seconds`` (the hook reads ``slow/pause``); no phase marker."""
        p = self.result.pause
        p.delivered_s = now - self.t0
        tmp = self.slow_dir / ".pause"
        tmp.write_text(f"{now + p.seconds:.3f}\n")
        os.replace(tmp, self.slow_dir / "pause")
        print(f"  [{p.delivered_s:6.1f}s] {self.name}: EVALUATION PAUSE {p.seconds:.0f}s after step {self._top_step()}",
              flush=True)

    def in_pause(self, ts: float, grace: float = 15.0) -> bool:
        """Whether epoch ``ts`` falls in the evaluation pause (or ``grace`` seconds after it)."""
        p = self.result.pause
        return p is not None and p.delivered_s is not None and \
            self.t0 + p.delivered_s <= ts <= self.t0 + p.delivered_s + p.seconds + grace

    def _ready(self) -> bool:
        """The job is training: a step of the current attempt after the previous fault's recovery."""
        last = self.steps.last
        if last is None or last[1] != self.gen or last[0] >= self.args.steps:
            return False                  # starting, recovering, or past its last step (saving, exiting)
        prev = self.result.faults[-1] if self.result.faults else None
        if prev is not None and (prev.kind in RESTARTING or prev.restarted) and prev.first_step_s is None:
            return False
        return True

    def _deliver(self, f: ScheduledFault, now: float) -> None:
        last = self.steps.last
        rec = FaultRecord(f.index, f.kind, f.rank, f.after_step, delivered_s=now - self.t0,
                          step_at_fault=last[0] if last else 0, gen_at_fault=self.gen)
        slot = self.slot_of(f.rank)
        rec.target = slot
        pid = self.rank_pid(f.rank)
        if pid is None and f.kind != "straggler":
            rec.note = "no live rank process to hit"
        elif f.kind in ("crash", "xid79"):
            if f.kind == "xid79":
                self.inject_gpu(slot, "xid79")
            _signal(pid, signal.SIGKILL, rec)
        elif f.kind == "hang":
            self.hung.add(pid)
            _signal(pid, signal.SIGSTOP, rec)
        elif f.kind == "straggler":
            self.inject_gpu(slot, "straggler")
            if slot not in self.slow_slots:
                self.slow_slots.append(slot)
                factor = self.args.straggler_factor
                normal = self._normal_so_far()
                extra = (1.0 / factor - 1.0) * normal if normal else None
                (self.slow_dir / slot).write_text(f"{factor}" + (f" {extra:.4f}" if extra is not None else "") + "\n")
                rec.note = f"spins {extra:.2f}s per step" if extra is not None else "spins (1/f - 1) x its step"
            else:
                rec.note = "slot already slow"
        self.result.faults.append(rec)
        print(f"  [{rec.delivered_s:6.1f}s] {self.name}: FAULT {f.index} {f.kind} on {slot} (rank {f.rank}) at step "
              f"{rec.step_at_fault} (scheduled after step {f.after_step})", flush=True)

    def _normal_so_far(self) -> float | None:
        """The median interval between consecutive steps of one attempt so far (None with under 3)."""
        rows = self.steps.rows
        gaps = [t1 - t0 for (s0, g0, t0), (s1, g1, t1) in zip(rows, rows[1:])
                if g0 == g1 and s1 == s0 + 1 and not self.is_save_interval(s0, s1)]
        return statistics.median(gaps) if len(gaps) >= 3 else None

    def detected(self, ts: float, detector: str, gen_before: int | None = None) -> FaultRecord | None:
        """The launcher decided to restart (torchrun exited / watchdog / Transom relaunching or healing)."""
        for rec in reversed(self.result.faults):
            if rec.kind in RESTARTING and rec.detected_s is None and (gen_before is None or rec.gen_at_fault == gen_before):
                rec.detected_s, rec.detector = ts - self.t0, detector
                return rec
        if self.in_pause(ts):
            self.result.pause.false_restarts += 1
            self.result.pause.false_events.append(f"restart at {ts - self.t0:.1f}s: {detector}")
        return None

    def _on_step(self, row: tuple[int, int, float]) -> None:
        step, gen, ts = row
        if self.result.startup_s is None:
            self.result.startup_s = ts - self.t0
        for rec in self.result.faults:
            if (rec.kind in RESTARTING or rec.restarted) and rec.first_step_s is None \
                    and gen > (rec.gen_at_fault or 0):
                rec.first_step_s, rec.resume_step = ts - self.t0, step - 1

    def _measure(self) -> None:
        r, a = self.result, self.args
        rows = self.steps.rows
        r.completed = bool(rows) and rows[-1][0] >= a.steps and not r.error
        if self.end_ts is not None:
            r.wall_s = round(self.end_ts - self.t0, 2)
        slow_from = min((f.delivered_s + self.t0 for f in r.faults if f.kind == "straggler"), default=math.inf)
        healthy, ckpt = [], []
        for (s0, g0, t0), (s1, g1, t1) in zip(rows, rows[1:]):
            if g0 != g1 or s1 != s0 + 1 or t1 > slow_from:
                continue                  # across a restart, or slowed by a straggler
            (ckpt if self.is_save_interval(s0, s1) else healthy).append(t1 - t0)
        if len(healthy) < 5:              # a straggler came early: every same-attempt interval, noted
            r.normal_note = f"only {len(healthy)} steps before the first straggler: normal step from all steps"
            healthy = [t1 - t0 for (s0, g0, t0), (s1, g1, t1) in zip(rows, rows[1:])
                       if g0 == g1 and s1 == s0 + 1 and not self.is_save_interval(s0, s1)]
        if healthy:
            r.normal_step_s = round(statistics.median(healthy), 3)
            r.useful_s = round(a.steps * r.normal_step_s, 1)
            if r.wall_s:
                r.effective_ratio = round(r.useful_s / r.wall_s, 3)
            if ckpt:
                per_save = statistics.median(ckpt) - r.normal_step_s
                r.ckpt_overhead_s = round(max(per_save, 0.0) * len(self.steps.saves), 1)
        for rec in r.faults:
            if rec.delivered_s is None:
                continue
            if rec.kind in RESTARTING or rec.restarted:
                if rec.detected_s is not None:
                    rec.detect_s = round(rec.detected_s - rec.delivered_s, 2)
                if rec.first_step_s is not None and rec.detected_s is not None:
                    rec.recover_s = round(rec.first_step_s - rec.detected_s, 2)
                if rec.resume_step is not None and rec.step_at_fault is not None:
                    rec.steps_redone = max(rec.step_at_fault - rec.resume_step, 0)
                    if r.normal_step_s:
                        rec.recompute_s = round(rec.steps_redone * r.normal_step_s, 2)
            if rec.kind == "straggler" and r.normal_step_s and "already" not in rec.note:
                start = rec.delivered_s + self.t0
                end = rec.detected_s + self.t0 if rec.restarted else math.inf     # its node replaced
                after = [t1 - t0 for (s0, g0, t0), (s1, g1, t1) in zip(rows, rows[1:])
                         if t0 >= start and t1 <= end and g0 == g1 and s1 == s0 + 1
                         and not self.is_save_interval(s0, s1)]
                if after:
                    slow = statistics.median(after)
                    rec.slowdown_s = round(max(slow - r.normal_step_s, 0.0) * len(after), 1)
                    rec.note += f"; median step {slow:.2f}s vs {r.normal_step_s:.2f}s over {len(after)} steps"

        self._window_figures()

    def _window_figures(self) -> None:
        """Steady step (before the first fault or pause), and each fault's lost seconds: the wall time
        from it until the job has made ``LOSS_STEPS`` steps of new progress past the step it hit (a
        straggler: past its node's replacement; one never replaced: to the next fault, the pause or the
        end), or to the next fault, the pause or the end if sooner, less that progress x the pace: the
        mean step of the ``LOCAL_STEPS`` steps before it, averaged with that of the window's last
        ``LOCAL_STEPS`` steps where it has them (a pause's own seconds are not lost)."""
        r, rows = self.result, self.steps.rows
        if not rows:
            return
        marks = sorted([(f.delivered_s + self.t0, f) for f in r.faults if f.delivered_s is not None]
                       + ([(r.pause.delivered_s + self.t0, r.pause)] if r.pause and r.pause.delivered_s is not None else []),
                       key=lambda m: m[0])
        first = marks[0][0] if marks else math.inf
        gen_start: dict[int, int] = {}
        for s0, g0, _ in rows:
            gen_start.setdefault(g0, s0)
        # steady: after the system's start-up work (a warm spare importing torch and building the model
        # shares these cores with the ranks for its first seconds, once), before the first fault
        warm = self.warm_ts if self.warm_ts is not None else -math.inf
        def window(after: float) -> list[float]:
            return [t1 - t0 for (s0, g0, t0), (s1, g1, t1) in zip(rows, rows[1:])
                    if g0 == g1 and s1 == s0 + 1 and t1 <= first and s0 >= gen_start[g0] + 3 and t0 >= after]

        gaps = window(warm)
        if len(gaps) < 3 and warm > -math.inf:      # the spares were not warm before the first fault
            gaps = window(-math.inf)
            r.normal_note += ("; " if r.normal_note else "") + "steady step with the spares' start-up in it"
        if len(gaps) >= 3:
            r.steady_step_s = round(statistics.fmean(gaps), 4)      # graded against plain runs: grade()
        if not r.steady_step_s:
            return
        end = self.end_ts if self.end_ts is not None else rows[-1][2]

        def top_at(ts: float) -> int:
            return max((st for st, _, t in rows if t <= ts), default=0)

        # each step that followed the one before it in the same generation: (step before, its time, this time)
        stepped = [(s0, t0, t1) for (s0, g0, t0), (s1, g1, t1) in zip(rows, rows[1:]) if g0 == g1 and s1 == s0 + 1]

        for i, (t, rec) in enumerate(marks):
            t_prev = marks[i - 1][0] if i else (warm if warm < t else -math.inf)
            t_next = marks[i + 1][0] if i + 1 < len(marks) else end
            # the pace just before it (the machine's speed drifts over minutes: a window of hundreds of
            # steps graded by the steady step at the start carried that drift into every fault's loss)
            before = [t1 - t0 for _, t0, t1 in stepped if t_prev <= t0 and t1 <= t][-LOCAL_STEPS:]
            pace = statistics.fmean(before) if len(before) >= 5 else r.steady_step_s
            at = top_at(t)
            # to LOSS_STEPS steps of new progress past the step it hit, or the next fault, pause or end; a
            # straggler slows every step until its node is replaced: LOSS_STEPS past the replacement, and
            # one never replaced to the next fault, pause or end
            base: int | None = at
            if isinstance(rec, FaultRecord) and rec.kind == "straggler":
                base = top_at(rec.detected_s + self.t0) if rec.restarted and rec.detected_s is not None else None
            t_end = t_next if base is None else \
                min(min((ts for st, _, ts in rows if st >= base + LOSS_STEPS and ts > t), default=t_next), t_next)
            if base is not None:
                # and the pace at the end of the window, past the fault's own transient: the mean of the two
                # brackets a drift that runs through the window
                after = [t1 - t0 for s0, t0, t1 in stepped
                         if s0 >= base + LOSS_STEPS - LOCAL_STEPS and t < t0 and t1 <= t_end]
                if len(after) >= 5 and len(before) >= 5:
                    pace = (pace + statistics.fmean(after)) / 2
            lost = (t_end - t) - (top_at(t_end) - at) * pace
            if isinstance(rec, PauseRecord):
                lost -= rec.seconds
            rec.lost_s = round(lost, 2)

    @abc.abstractmethod
    def is_save_interval(self, s0: int, s1: int) -> bool:
        """Whether the time from step ``s0`` to ``s1`` includes this job's checkpoint save."""


# --------------------------------------------------------------------------- (a) torchrun retry loop

class TorchrunRun(Runner):
    name = "torchrun"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.proc: subprocess.Popen | None = None
        self.done = False
        self._pids: dict[int, int] = {}
        self.attempt_start = 0.0

    def _cmd(self) -> list[str]:
        from transom.broker import free_port
        a = self.args
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(a.world),
                "--max-restarts", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                str(ROOT / "bench" / "tol_torchrun_job.py"), "--attempt", str(self.gen),
                *ckpt_args(a), "--ckpt-dir", str(self.work / "ckpt"),
                "--steps-file", str(self.steps.path), "--steps", str(a.steps), *model_args(a, self.work)]

    def launch(self) -> None:
        (self.work / "ckpt").mkdir(exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        log = open(self.work / f"attempt-{self.gen}.log", "w")
        self.proc = subprocess.Popen(self._cmd(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._pids = {}
        self.attempt_start = time.time()

    def _relaunch(self, now: float, why: str) -> None:
        self.detected(now, why, self.gen)
        if self.proc is not None and self.proc.poll() is None:
            _kill_tree(self.proc.pid)
            self.proc.wait(30)
        self.hung.clear()
        self.gen += 1
        self.result.attempts = self.gen + 1
        self.launch()

    def tick(self, now: float) -> None:
        a, last = self.args, self.steps.last
        if self.proc.poll() is not None:
            if self.proc.returncode == 0 and last is not None and last[0] >= a.steps:
                self.done = True
                self.end_ts = now
                return
            self._relaunch(now, f"torchrun exited {self.proc.returncode}")
            return
        mine = last is not None and last[1] == self.gen
        if mine and last[0] >= a.steps:
            return                        # past its last step: saving, exiting
        if mine and now - last[2] > a.watchdog:
            self._relaunch(now, f"watchdog: no step for {a.watchdog:.0f}s")
        elif not mine and now - self.attempt_start > a.start_timeout:
            self._relaunch(now, f"watchdog: no first step in {a.start_timeout:.0f}s")

    def finished(self) -> bool:
        return self.done

    def _workers(self) -> dict[int, int]:
        import psutil
        if len(self._pids) < self.args.world and self.proc is not None:
            try:
                for p in psutil.Process(self.proc.pid).children(recursive=True):
                    try:
                        if "tol_torchrun_job.py" in " ".join(p.cmdline()):
                            lr = p.environ().get("LOCAL_RANK")
                            if lr is not None:
                                self._pids[int(lr)] = p.pid
                    except psutil.Error:
                        continue
            except psutil.Error:
                pass
        return self._pids

    def rank_pid(self, rank: int) -> int | None:
        return self._workers().get(rank)

    def slot_of(self, rank: int) -> str:
        return f"slot{rank}"


    def inject_gpu(self, slot: str, fault: str) -> None:
        return None          # no agent, no simulated GPU: the baseline only feels the process fault

    def teardown(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _kill_tree(self.proc.pid)
            self.proc.wait(30)

    def is_save_interval(self, s0: int, s1: int) -> bool:
        return s0 in self.steps.saves        # the step line is written before the save


class PlainRun(TorchrunRun):
    """The same job with no fault-tolerance system: one torchrun attempt, no checkpoint, no fault."""

    name = "plain"

    def _cmd(self) -> list[str]:
        cmd = super()._cmd()
        cmd[cmd.index("--ckpt-every") + 1] = str(10 ** 9)
        return cmd

    def is_save_interval(self, s0: int, s1: int) -> bool:
        return False


# --------------------------------------------------------------------------- TorchFT

class TorchftRun(Runner):
    """TorchFT 0.2.0: a Lighthouse and WORLD replica groups of one rank each (bench/torchft_job.py).

    A group whose process exits is relaunched at once on its slot (the per-group retry loop
    torchrun's --max-restarts would be); a group that commits no step for --watchdog seconds while
    the others go on is killed and relaunched. The survivors keep training with fewer groups.
    """

    name = "torchft"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.lighthouse: subprocess.Popen | None = None
        self.groups: dict[int, subprocess.Popen] = {}
        self.started: dict[int, float] = {}
        self.restarts = 0
        self.lh_addr = ""

    def _start_group(self, g: int, first: bool = False) -> None:
        from transom.broker import free_port
        a = self.args
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "REPLICA_GROUP_ID": str(g),
               "NUM_REPLICA_GROUPS": str(a.world), "TORCHFT_LIGHTHOUSE": self.lh_addr,
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        log = open(self.work / f"group-{g}.log", "a")
        self.groups[g] = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "torchft_job.py"), "--steps", str(a.steps),
             "--steps-file", str(self.steps.path), "--pg-timeout", str(a.torchft_pg_timeout),
             *(["--ready-dir", str(self.work / "ready")] if first else []),
             *model_args(a, self.work)], env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        self.started[g] = time.time()

    def launch(self) -> None:
        from transom.broker import free_port
        port = free_port()
        self.lh_addr = f"http://127.0.0.1:{port}"
        self.lighthouse = subprocess.Popen(
            [lighthouse() or "torchft_lighthouse", "--min_replicas", "1", "--bind", f"[::]:{port}",
             "--heartbeat_timeout_ms", str(self.args.torchft_heartbeat_ms)],
            stdout=open(self.work / "lighthouse.log", "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        (self.work / "ready").mkdir(exist_ok=True)
        for g in range(self.args.world):
            self._start_group(g, first=True)

    def _restart(self, g: int, now: float, why: str) -> None:
        proc = self.groups[g]
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.wait(30)
        self.restarts += 1
        self.result.attempts = 1 + self.restarts
        for rec in reversed(self.result.faults):
            if rec.kind in RESTARTING and rec.detected_s is None and rec.target == f"slot{g}":
                rec.detected_s, rec.detector = now - self.t0, why
                break
        else:
            if self.in_pause(now):
                self.result.pause.false_restarts += 1
                self.result.pause.false_events.append(f"group {g} restarted at {now - self.t0:.1f}s: {why}")
        self._start_group(g)

    def tick(self, now: float) -> None:
        a, last = self.args, self.steps.last
        if last is not None and last[0] >= a.steps:
            if self.end_ts is None:
                self.end_ts = last[2]
            return
        for g, proc in self.groups.items():
            if proc.poll() is not None:
                self._restart(g, now, f"group {g} exited {proc.returncode}")
            elif last is not None and now - max(self.steps.group_last.get(g, 0.0), self.started[g]) > a.watchdog \
                    and now - last[2] < a.watchdog:
                self._restart(g, now, f"watchdog: group {g} no step for {a.watchdog:.0f}s while the others step")

    def finished(self) -> bool:
        return self.end_ts is not None

    def rank_pid(self, rank: int) -> int | None:
        proc = self.groups.get(rank)
        return proc.pid if proc is not None and proc.poll() is None else None

    def slot_of(self, rank: int) -> str:
        return f"slot{rank}"

    def inject_gpu(self, slot: str, fault: str) -> None:
        return None          # as the retry loop: the process fault only, the same slot reused

    def teardown(self) -> None:
        for proc in [*self.groups.values(), self.lighthouse]:
            if proc is not None and proc.poll() is None:
                _kill_tree(proc.pid)
                proc.wait(30)

    def is_save_interval(self, s0: int, s1: int) -> bool:
        return False         # no checkpoint: a restarted group heals from a live peer

    def _ready(self) -> bool:
        """Training (the survivors go on while a group restarts: no wait for it)."""
        last = self.steps.last
        return last is not None and last[0] < self.args.steps

    def _measure(self) -> None:
        super()._measure()
        # no generation: a fault costs the survivors a stall (detection), the restarted group's heal
        # shows in the window's lost seconds; nothing is redone (the failed step is discarded)
        rows = self.steps.rows
        for rec in self.result.faults:
            if rec.kind not in RESTARTING or rec.delivered_s is None:
                continue
            t = rec.delivered_s + self.t0
            nxt = next((ts for st, _, ts in rows if ts > t), None)
            if nxt is not None and self.result.steady_step_s:
                rec.detect_s = round(max(nxt - t - self.result.steady_step_s, 0.0), 2)
                rec.recover_s, rec.steps_redone, rec.recompute_s = 0.0, 0, 0.0
                rec.note += ("; " if rec.note else "") + "survivors' stall to their next step"


# --------------------------------------------------------------------------- (b) Transom

class TransomRun(Runner):
    name = "transom"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.stack = None
        self.monitor = None
        self.ctl = None
        self.job = f"goodput-{os.getpid()}"
        self.end: str | None = None
        self.nodes_of: dict[int, list[str]] = {}
        self._reniced = 0.0
        self._renice_refused = False
        # --hosts: the ranks run on the bed's node hosts, each with its own /tmp: the steps file and
        # the slowdown hook's directory live in the stack's run dir, which the bed shares into every host
        self._injects: list = []                       # `transom inject` processes on bed hosts
        self._host_kills: list[list] = []              # [node, record, inject process, deadline]
        self._pids: dict[tuple[int, int], int] = {}    # (generation, rank) -> PID seen from here
        if self.args.hosts:
            shared = self.work / "stack"
            shared.mkdir(parents=True, exist_ok=True)
            self.steps = StepsFile(shared / "steps.txt")
            self.slow_dir = shared / "slow"
            self.slow_dir.mkdir(exist_ok=True)

    def launch(self) -> None:
        from transom import contracts as c
        from transom.stack import LocalStack, Monitor, train_command
        a = self.args
        kw = {"hosts": True} if a.hosts else {}
        self._agent_config()
        self._spares, self._warm = spares_needed(self.schedule, a.steps, a.spares), 0
        self.stack = LocalStack(self.work / "stack", nodes=a.world + self._spares, **kw)
        self.stack.start_broker()
        self.stack.start_agents()
        self.stack.start_tee()
        self.monitor = Monitor(self.stack.bootstrap, (c.LIFECYCLE, c.FAULTS), from_beginning=False)
        time.sleep(a.settle)           # agents' first heartbeats, the TEE's group join: infrastructure, not the job
        cmd = train_command(a.steps, a.ckpt_every, "--steps-file", str(self.steps.path), "--log-every", "10",
                            *ckpt_args(a)[2:], *model_args(a, self.work, self.slow_dir))
        self.t0 = time.time()
        self.ctl = self.stack.start_controller(self.job, cmd, world_size=a.world,
                                               extra=["--exit-when-done", "--max-restarts", "1000",
                                                      "--precheck", a.precheck, "--heal", a.heal])

    def _agent_config(self) -> None:
        """The agents read only the NIC of the default route (unless TRANSOM_AGENT_CONFIG is set): on a
        shared machine other people's test-bed links (tb*, veth*) come and go, and an agent that
        reads every link would report them down as this node's links (a first run lost every node).
        On the bed (--hosts) each agent sees its own host's links only: nothing to configure."""
        if os.environ.get("TRANSOM_AGENT_CONFIG") or self.args.hosts:
            return
        nic = None
        try:
            for ln in open("/proc/net/route").read().splitlines()[1:]:
                f = ln.split()
                if len(f) > 2 and f[1] == "00000000":
                    nic = f[0]
                    break
        except OSError:
            pass
        if nic is None:
            return
        path = self.work / "agent.toml"
        path.write_text(f'[collectors.nic]\ninclude = ["{nic}"]\n')
        os.environ["TRANSOM_AGENT_CONFIG"] = str(path)
        self._set_env = True

    def _renice(self, now: float, *, force: bool = False) -> None:
        """Transom's services (broker, agents, daemons, TEE, controller, zygotes) at nice
        --services-nice, its ranks at 0: on a cluster the services run on other cores or machines.
        Once a second, or at once with ``force``."""
        if self.args.services_nice <= 0 or (now < self._reniced + 1.0 and not force):
            return
        self._reniced = now
        import psutil
        ranks = {pid for pid in (self.rank_pid(r) for r in range(self.args.world)) if pid}
        try:
            procs = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        if renice_threads(procs, ranks, self.args.services_nice) and not self._renice_refused:
            self._renice_refused = True
            print("  (cannot put every thread of the ranks back at nice 0 without the privilege: the ranks "
                  "share the services' priority; run as root or with CAP_SYS_NICE)", flush=True)

    def tick(self, now: float) -> None:
        from transom import contracts as c
        self._renice(now)
        reformed = False
        while True:
            got = self.monitor.poll(0)
            if got is None:
                break
            topic, ev = got
            if topic == c.LIFECYCLE and ev.job == self.job and ev.name == "spare_ready" and self.warm_ts is None:
                self._warm += 1                 # a rank's own message (state "request"): the spare waits
                if self._warm >= self._spares:
                    self.warm_ts = ev.ts
                    self.result.warm_s = round(ev.ts - self.t0, 1)
            elif topic == c.LIFECYCLE and ev.job == self.job and ev.state != "request":
                gen = ev.detail.get("generation")
                if ev.name == "healing":
                    # in-job: the survivors keep their processes, a warm spare takes the rank
                    if (ev.cause or {}).get("kind") == "straggler":
                        rec = self._straggler_replaced(ev)
                    else:
                        rec = self.detected(ev.ts, f"controller: in-job heal ({ev.cause.get('kind') or 'rank exit'})")
                    if rec is not None:
                        rec.path = "in-job"
                    self.nodes_of[self.gen] = list(ev.detail.get("nodes") or self._nodes())
                elif ev.name == "reforming":
                    reformed = True
                elif ev.name == "healed":
                    rec = next((r for r in reversed(self.result.faults) if r.path == "in-job" and r.healed_at is None),
                               None)
                    if rec is not None:
                        rec.healed_at = ev.ts
                        rec.note += ("; " if rec.note else "") + f"in-job heal {ev.detail.get('seconds')}s"
                elif ev.name == "relaunching" and ev.detail.get("fallback"):
                    rec = next((r for r in reversed(self.result.faults) if r.path == "in-job" and r.healed_at is None),
                               None)
                    if rec is not None:
                        rec.path = "in-job -> relaunch"
                        rec.note += ("; " if rec.note else "") + f"fallback: {ev.detail.get('reason')}"
                elif ev.name == "relaunching" and (ev.cause or {}).get("kind") == "straggler":
                    rec = self._straggler_replaced(ev)
                    if rec is not None:
                        rec.path = "relaunch"
                elif ev.name == "relaunching":
                    rec = self.detected(ev.ts, f"controller: {ev.cause.get('kind') or ev.detail.get('reason') or 'relaunch'}")
                    if rec is not None:
                        rec.path = "relaunch"
                elif ev.name == "launched" and isinstance(gen, int):
                    self.gen = max(self.gen, gen)
                    self.result.attempts = self.gen + 1
                    self.hung.clear()
                    nodes = (ev.detail.get("handle") or {}).get("nodes") or ev.snapshot.get("nodes")
                    if nodes:
                        self.nodes_of[gen] = list(nodes)
                elif ev.name in ("completed", "failed"):
                    self.end = ev.name
                    self.end_ts = ev.ts
                    if ev.name == "failed":
                        self.result.error = f"job failed: {ev.detail.get('reason')}"
            elif topic == c.FAULTS and ev.job in (self.job, None, ""):
                cls = (ev.evidence or {}).get("class", ev.kind.value)
                found = None          # the delivered fault this event is the TEE's first report of
                for rec in self.result.faults:
                    if rec.target == ev.node and rec.tee_event_s is None and rec.delivered_s is not None \
                            and ev.detected_ts >= rec.delivered_s + self.t0 \
                            and _tee_matches(rec.kind, cls):
                        rec.tee_event_s = round(ev.detected_ts - self.t0 - rec.delivered_s, 2)
                        if rec.kind == "straggler":
                            rec.detected_s, rec.detector = ev.detected_ts - self.t0, f"TEE {cls}"
                        found = rec
                        break
                # an event during the pause is false unless it reports a fault the bench delivered (a straggler
                # slowed before the pause, found during it) or a restart's fault is still being recovered
                if self.in_pause(ev.detected_ts) and found is None and not any(
                        r.delivered_s is not None and r.first_step_s is None and r.kind in RESTARTING
                        for r in self.result.faults):
                    self.result.pause.false_events.append(f"TEE {cls} on {ev.node} at {ev.detected_ts - self.t0:.1f}s")
        if reformed:
            # the spare that took the rank is a rank from now on: at the ranks' priority for its rendezvous and
            # sync, not up to a second later at the next periodic renice (on a cluster it has its host to itself)
            self._renice(time.time(), force=True)
        self._kill_hosts(time.time())
        if self.ctl.popen.poll() is not None and self.end is None:
            self.end = "controller exited"

    def _deliver(self, f: ScheduledFault, now: float) -> None:
        super()._deliver(f, now)
        rec = self.result.faults[-1]
        bed = self.stack.bed
        if bed is not None and f.kind == "xid79" and rec.target in bed.addresses() and bed.is_up(rec.target):
            # the GPU fell off the bus and its host is lost with it: the host is killed once the
            # TEE has the agent's XID 79 (or 10 s after the agent took the injection, 30 s at most)
            inject = self._injects[-1] if self._injects else None
            self._host_kills.append([rec.target, rec, inject, now + 30.0])

    def _kill_hosts(self, now: float) -> None:
        for item in list(self._host_kills):
            node, rec, inject, deadline = item
            if inject is not None and inject.poll() is not None:
                item[2], item[3] = None, min(deadline, now + 10.0)
            if rec.tee_event_s is None and now < item[3]:
                continue
            self._host_kills.remove(item)
            if self.stack.bed.is_up(node):
                self.stack.kill_host(node)
                rec.note += ("; " if rec.note else "") + f"host {node} killed {now - self.t0 - rec.delivered_s:.1f}s after"
                print(f"  [{now - self.t0:6.1f}s] {self.name}: host {node} killed (XID 79)", flush=True)

    def finished(self) -> bool:
        return self.end is not None

    def _straggler_replaced(self, ev) -> FaultRecord | None:
        """The controller replaces a straggling node: from here that fault costs a recovery."""
        rec = next((r for r in self.result.faults if r.kind == "straggler" and r.target == ev.cause.get("node")
                    and not r.restarted), None)
        if rec is None:
            return None
        last = self.steps.last
        rec.restarted, rec.gen_at_fault = True, self.gen
        rec.detected_s, rec.detector = ev.ts - self.t0, "controller: straggler replaced"
        rec.step_at_fault = last[0] if last else rec.step_at_fault
        return rec

    def _on_step(self, row: tuple[int, int, float]) -> None:
        super()._on_step(row)
        step, _gen, ts = row
        for rec in self.result.faults:           # in-job: the first step after the new group synced
            if rec.path == "in-job" and rec.first_step_s is None and rec.healed_at is not None and ts >= rec.healed_at:
                rec.first_step_s, rec.resume_step = ts - self.t0, step - 1

    def _gen_dir(self) -> Path:
        return self.stack.run_dir / "jobs" / self.job / f"gen-{self.gen}"

    def _nodes(self) -> list[str]:
        if self.gen not in self.nodes_of:
            try:
                self.nodes_of[self.gen] = json.loads((self._gen_dir() / "launch.json").read_text())["nodes"]
            except (OSError, ValueError, KeyError):
                return []
        return self.nodes_of[self.gen]

    def rank_pid(self, rank: int) -> int | None:
        if self.stack is not None and self.stack.bed is not None:
            return self._bed_rank_pid(rank)
        try:
            pid_file = self._gen_dir() / f"rank-{rank}.pid"
            healed = json.loads((self._gen_dir() / "launch.json").read_text()).get("dirs") or {}
            if str(rank) in healed:                    # a warm spare took this rank (in-job heal)
                pid_file = Path(healed[str(rank)]) / "rank-0.pid"
            return int(pid_file.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return None

    def _bed_rank_pid(self, rank: int) -> int | None:
        """The rank's PID as this machine sees it: its host's launcher records it in the host's own
        PID namespace (RUN_DIR/hosts/NODE/JOB/gen-G/rank-R.pid; a warm spare that took the rank, in
        its own directory there, named in the host's host.json), the bed maps it to ours."""
        key = (self.gen, rank)
        pid = self._pids.get(key)
        if pid is not None:
            try:
                os.kill(pid, 0)
                return pid
            except ProcessLookupError:
                del self._pids[key]           # gone: a spare may hold the rank now (looked up below)
        node = self.slot_of(rank)
        bed = self.stack.bed
        try:
            if node not in bed.addresses() or not bed.is_up(node):
                return None
            gen_dir = self.stack.run_dir / "hosts" / node / self.job / f"gen-{self.gen}"
            pid_file = gen_dir / f"rank-{rank}.pid"
            try:
                dirs = json.loads((gen_dir / "host.json").read_text()).get("dirs") or {}
            except (OSError, ValueError):
                dirs = {}
            if str(rank) in dirs:             # the host's path: the spare's directory lies in gen_dir here too
                pid_file = gen_dir / Path(dirs[str(rank)]).name / "rank-0.pid"
            host_pid = int(pid_file.read_text().split()[1])
            pid = next((p["pid"] for p in bed.processes(node) if p["host_pid"] == host_pid), None)
        except (OSError, IndexError, ValueError, KeyError, RuntimeError):
            return None
        if pid is not None:
            self._pids[key] = pid
        return pid

    def slot_of(self, rank: int) -> str:
        nodes = self._nodes()
        return nodes[rank] if rank < len(nodes) else f"rank{rank}"


    def inject_gpu(self, slot: str, fault: str) -> None:
        from transom.agents.intake import send_inject
        addr = self.stack.agents.get(slot)
        if addr is None:
            return
        if self.stack.bed is not None:
            # the agent's intake listens on its host's loopback: `transom inject` runs on that host,
            # in the background (an interpreter's start on a loaded machine must not stall the loop)
            try:
                self._injects.append(self.stack.bed.python(
                    slot, ["-m", "transom.cli", "inject", fault, "--gpu", "0", "--agent", addr],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            except RuntimeError as exc:          # BedError: no such host, or it is down
                print(f"  transom: could not inject {fault} on {slot}: {exc}", flush=True)
            return
        try:
            reply = send_inject(addr, fault, gpu=0)
            if not reply.get("ok"):
                print(f"  transom: agent of {slot} refused {fault}: {reply.get('error')}", flush=True)
        except (TimeoutError, ValueError) as exc:
            print(f"  transom: could not inject {fault} on {slot}: {exc}", flush=True)

    def teardown(self) -> None:
        if getattr(self, "_set_env", False):
            os.environ.pop("TRANSOM_AGENT_CONFIG", None)
        for proc in self._injects:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if self.monitor is not None:
            self.monitor.close()
        if self.stack is not None:
            self.stack.stop()

    def is_save_interval(self, s0: int, s1: int) -> bool:
        return s1 in self.steps.saves        # the step line is written after the save


def _tee_matches(kind: str, cls: str) -> bool:
    return {"xid79": ("xid", "gpu_lost"), "hang": ("hang",), "straggler": ("straggler", "power_cap", "thermal"),
            "crash": ()}[kind].__contains__(cls)


# --------------------------------------------------------------------------- report

def ckpt_args(a: argparse.Namespace) -> list[str]:
    """The retry loop's and Transom's checkpoint interval: K steps, or auto with the schedule's mean time
    between faults as each one's MTBF (the same rule, Young's interval from each one's measured save cost and
    the share of its faults that rolled it back: the retry loop relaunches for every fault, Transom learns
    the share from its own heals and relaunches)."""
    mtbf = getattr(a, "mtbf_s", None)        # None in the plain run (it saves nothing)
    return ["--ckpt-every", str(a.ckpt_every)] + (["--mtbf", f"{mtbf:.1f}"] if a.ckpt_every == "auto" and mtbf else [])


def model_args(a: argparse.Namespace, work: Path, slow: Path | None = None) -> list[str]:
    return ["--slowdown-dir", str(slow or work / "slow"), "--width", str(a.width), "--layers", str(a.layers), "--heads", str(a.heads),
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--seed", str(a.seed)]


def _fmt(v, unit: str = "") -> str:
    return "-" if v is None else f"{v}{unit}"


def print_run(r: RunResult) -> None:
    print(f"\n{r.name}: {'completed' if r.completed else 'NOT completed'} {r.steps} steps; wall {_fmt(r.wall_s, 's')}; "
          f"startup {_fmt(r.startup_s and round(r.startup_s, 1), 's')}"
          f"{'' if r.warm_s is None else f' (spares warm at {r.warm_s} s)'}; steady step {_fmt(r.steady_step_s, 's')} "
          f"(overhead {_fmt(r.overhead)}"
          f"{'' if r.plain_step_s is None else f' against a plain step of {r.plain_step_s} s'}); "
          f"useful {_fmt(r.useful_s, 's')}; effective ratio {_fmt(r.effective_ratio)}; "
          f"checkpoint stalls ~{_fmt(r.ckpt_overhead_s, 's')}; attempts/generations {r.attempts}"
          + (f"; ERROR: {r.error}" if r.error else "") + (f"; NOTE: {r.normal_note}" if r.normal_note else ""))
    if not r.faults and r.pause is None:
        return
    print(f"  {'#':>2} {'at(s)':>7} {'kind':<9} {'target':<7} {'step':>5} {'lost':>7} {'detect':>7} {'recover':>8} "
          f"{'recomp':>7} {'redone':>6} {'slowdn':>7}  detector / note")
    for f in r.faults:
        print(f"  {f.index:>2} {_fmt(f.delivered_s and round(f.delivered_s, 1)):>7} {f.kind:<9} {f.target:<7} "
              f"{_fmt(f.step_at_fault):>5} {_fmt(f.lost_s):>7} {_fmt(f.detect_s):>7} {_fmt(f.recover_s):>8} "
              f"{_fmt(f.recompute_s):>7} {_fmt(f.steps_redone):>6} {_fmt(f.slowdown_s):>7}  "
              + (f"[{f.path}] " if f.path else "") + f"{f.detector}"
              + (f" TEE event +{f.tee_event_s}s" if f.tee_event_s is not None else "")
              + (f" ({f.note})" if f.note else ""))
    p = r.pause
    if p is not None:
        print(f"  evaluation pause {p.seconds:.0f}s after step {p.after_step} at {_fmt(p.delivered_s and round(p.delivered_s, 1))}s:"
              f" lost beyond the pause {_fmt(p.lost_s, 's')}, false restarts {p.false_restarts}"
              + (f" ({'; '.join(p.false_events)})" if p.false_events else ""))
    lost = totals(r)
    print(f"  lost: detection {lost['detect_s']}s, recovery {lost['recover_s']}s, recomputation "
          f"{lost['recompute_s']}s, straggler slowdown {lost['slowdown_s']}s")


def totals(r: RunResult) -> dict[str, float]:
    def s(attr: str) -> float:
        # a straggler's "detect" is the time it ran slow before its node was replaced: that cost is its
        # slowdown (the steps still went on), not time lost whole
        return round(sum(getattr(f, attr) or 0.0 for f in r.faults
                         if not (attr == "detect_s" and f.kind == "straggler")), 1)
    return {k: s(k) for k in ("detect_s", "recover_s", "recompute_s", "slowdown_s")}


def per_kind(r: RunResult) -> dict[str, dict]:
    """Median lost seconds per fault kind (and of its detection, recovery, recomputation parts)."""
    return kind_medians([asdict(f) for f in r.faults])


def kind_medians(faults: list[dict]) -> dict[str, dict]:
    """Per kind of ``faults`` (a run's ``per_fault`` rows, or the rows of several runs pooled): their
    number, the median of their lost seconds and of its parts, and the paths their heals took."""
    out: dict[str, dict] = {}
    for kind in KINDS:
        fs = [f for f in faults if f["kind"] == kind]
        if not fs:
            continue

        def med(key: str):
            vals = [f[key] for f in fs if f.get(key) is not None]
            return round(statistics.median(vals), 2) if vals else None
        out[kind] = {"n": len(fs), "lost_s": med("lost_s"), "detect_s": med("detect_s"),
                     "recover_s": med("recover_s"), "recompute_s": med("recompute_s")}
        paths = [f["path"] for f in fs if f.get("path")]
        if paths:
            out[kind]["paths"] = {p: paths.count(p) for p in dict.fromkeys(paths)}
    return out


def summary(r: RunResult) -> dict:
    return {"completed": r.completed, "wall_s": r.wall_s, "startup_s": r.startup_s and round(r.startup_s, 1),
            "warm_s": r.warm_s,
            "steady_step_s": r.steady_step_s, "overhead": r.overhead, "normal_step_s": r.normal_step_s,
            "plain_step_s": r.plain_step_s,
            "useful_s": r.useful_s, "effective_ratio": r.effective_ratio,
            "ckpt_stalls_s": r.ckpt_overhead_s, "attempts": r.attempts, "faults": len(r.faults),
            "per_kind": per_kind(r), "lost_s": totals(r), "error": r.error or None,
            "eval_pause": asdict(r.pause) if r.pause else None,
            "per_fault": [{k: v for k, v in asdict(f).items()
                           if k in ("kind", "target", "after_step", "delivered_s", "lost_s", "detect_s", "recover_s",
                                    "recompute_s", "steps_redone", "slowdown_s", "tee_event_s", "detector", "path")}
                          for f in r.faults]}


def grade(r: RunResult, plain_steps: list[float | None], pause: EvalPause | None) -> None:
    """Grade ``r`` against the mean step of the plain runs right before and right after it (the machine's
    speed drifts by more than the targets over the minutes of one run; the mean of the two brackets a
    linear drift): its overhead and its effective ratio."""
    seen = [p for p in plain_steps if p]
    if not seen:
        return
    r.plain_step_s = round(statistics.fmean(seen), 4)
    if r.steady_step_s:
        r.overhead = round(r.steady_step_s / r.plain_step_s - 1.0, 3)
    effective(r, r.plain_step_s, pause)


def effective(r: RunResult, plain_step: float | None, pause: EvalPause | None) -> None:
    """Useful time = steps x the plain run's step (+ the evaluation pause, which the job asked for)."""
    if plain_step and r.wall_s:
        r.useful_s = round(r.steps * plain_step + (pause.seconds if pause and r.pause and r.pause.delivered_s is not None
                                                   else 0.0), 1)
        r.effective_ratio = round(r.useful_s / r.wall_s, 3)


TARGET_LOSS = {"crash": 3.0, "xid79": 3.0, "hang": 15.0}


def paired_overhead(pairs: list) -> float | None:
    """Median over fault-free (plain step, Transom steady step) pairs of Transom / plain - 1."""
    ratios = [t / p - 1.0 for p, t in pairs if p and t]
    return round(statistics.median(ratios), 3) if ratios else None


def loss_targets(tk: dict[str, dict], bk: dict[str, dict]) -> dict:
    """Issue 17's lost-seconds targets from Transom's (``tk``) and the retry loop's (``bk``) medians per
    kind (:func:`kind_medians`), each with its value and a met flag (None: not measured)."""
    out: dict[str, dict] = {}
    for kind in KINDS:
        v = (tk.get(kind) or {}).get("lost_s")
        b = (bk.get(kind) or {}).get("lost_s")
        if kind in TARGET_LOSS:
            out[f"lost_{kind}_s"] = {"target": TARGET_LOSS[kind], "value": v,
                                     "met": None if v is None else v <= TARGET_LOSS[kind]}
        out[f"lost_{kind}_vs_retry_loop"] = {"target": 0.25, "value": None if v is None or not b else round(v / b, 3),
                                             "met": None if v is None or not b else v <= 0.25 * b}
    return out


def targets(results: dict[str, RunResult], fault_rate_s: float | None, paired: dict | None = None) -> dict:
    """Issue 17's targets for Transom, each with its value and a met flag (None: not measured); ``paired``:
    the fault-free pairs' overhead (``--overhead-pairs``), which grades the overhead when given."""
    t = results.get("transom")
    base = results.get("torchrun")
    out: dict[str, dict] = {}
    if t is None:
        return out
    out.update(loss_targets(per_kind(t), per_kind(base) if base else {}))
    if paired and paired.get("value") is not None:
        out["overhead"] = {"target": 0.05, "value": paired["value"], "met": paired["value"] <= 0.05,
                           "method": f"median of {len(paired['pairs'])} fault-free plain/Transom pairs, the "
                                     f"cadence's MTBF {paired['mtbf']}",
                           "pairs": paired["pairs"], "in_the_fault_run": t.overhead}
    else:
        out["overhead"] = {"target": 0.05, "value": t.overhead,
                           "met": None if t.overhead is None else t.overhead <= 0.05}
    out["effective_ratio"] = {"target": 0.9, "value": t.effective_ratio,
                              "met": None if t.effective_ratio is None else t.effective_ratio >= 0.9,
                              "fault_every_s_of_training": fault_rate_s,
                              "note": "the target is for one fault per 120 s of training"}
    return out


# --------------------------------------------------------------------------- main

QUICK = {"steps": 200, "width": 256, "layers": 4, "batch_size": 4, "ckpt_every": "auto", "fault_every_steps": 40,
         "faults": 4, "run_timeout": 900.0}
RUNS = ("torchrun", "torchft", "transom")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/goodput.py", description=__doc__.split("\n\n")[0],
                                epilog="Method: see the module docstring and docs/goodput.md.")
    p.add_argument("--quick", action="store_true",
                   help="a shorter run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
                        + " (flags given explicitly win)")
    p.add_argument("--seed", type=int, default=1, help="seed of the fault schedule, the pause, the model and the data (default 1)")
    p.add_argument("--steps", type=int, default=None, help="training steps of the job (default 400)")
    p.add_argument("--ckpt-every", default=None,
                   help="checkpoint interval K in steps, retry loop and Transom, or auto: each at Young's interval "
                        "from its own measured save cost and the schedule's mean time between faults (default auto)")
    p.add_argument("--width", type=int, default=None, help="model width (default 384: ~7M parameters)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 4)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per rank per step (default 2)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (default 64)")
    p.add_argument("--world", type=int, default=4, help="ranks (nodes, TorchFT replica groups) of the job (default 4)")
    p.add_argument("--spares", type=int, default=1, help="Transom spare nodes (at least one per XID 79 and straggler "
                                                         "scheduled before the last step, plus one; default 1)")
    p.add_argument("--fault-every-steps", type=int, default=None,
                   help="steps between faults (default: --fault-every seconds of the plain run's step time)")
    p.add_argument("--fault-every", type=float, default=120.0,
                   help="seconds of plain training between faults, when --fault-every-steps is not given (default 120)")
    p.add_argument("--faults", type=int, default=None, help="faults in the schedule (default 16; those after the "
                                                            "last step never come)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds to mix (default {','.join(KINDS)})")
    p.add_argument("--pause", default="30,60", help="evaluation pause LOW,HIGH seconds (the seed picks; default "
                                                    "30,60); 'off' for none")
    p.add_argument("--watchdog", type=float, default=75.0,
                   help="retry loop and TorchFT: seconds without a step before a rank / group is killed and "
                        "relaunched (default 75: above the longest evaluation pause; see docs/goodput.md)")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="retry loop: seconds an attempt may take to its first step (default 300)")
    p.add_argument("--straggler-factor", type=float, default=0.7,
                   help="a straggling rank runs this fraction of the time (default 0.7)")
    p.add_argument("--torchft-pg-timeout", type=float, default=5.0,
                   help="TorchFT ProcessGroupGloo timeout, s (default 5, as its train_ddp.py example)")
    p.add_argument("--torchft-heartbeat-ms", type=int, default=1000,
                   help="TorchFT Lighthouse heartbeat timeout, ms (default 1000, tuned down from its 5000; "
                        "../shared/notes/torchft-here.md)")
    p.add_argument("--heal", default="in-job", choices=["in-job", "relaunch"],
                   help="Transom's recovery path: in-job (default, the system as it ships: survivors keep their "
                        "processes, a warm spare takes the failed rank, a relaunch only as the fallback) or relaunch "
                        "(every fault relaunches from the newest checkpoint, as before issue 17)")
    p.add_argument("--precheck", default="full", choices=["full", "health", "off"],
                   help="Transom controller's pre-check before every launch (default full, as it ships)")
    p.add_argument("--services-nice", type=int, default=10,
                   help="nice value of Transom's services (its ranks stay at 0), as on a cluster they run "
                        "elsewhere; 0 leaves them alone (default 10)")
    p.add_argument("--hosts", action="store_true",
                   help="Transom on the hosts test bed (LocalStack(hosts=True): a control host and a host per "
                        "node, namespaces, needs root), the others on one host; faults reach the ranks on "
                        "their hosts, an XID 79 also kills its host (docs/goodput.md)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"which systems, in order (default {','.join(RUNS)}); "
                                                         "the plain run always comes first")
    p.add_argument("--plain-steps", type=int, default=60, help="steps of the plain run (default 60)")
    p.add_argument("--overhead-pairs", type=int, default=0,
                   help="after the runs, N alternating fault-free pairs (a plain run of --plain-steps, then Transom "
                        "with one spare for twice as many steps, no pause): the overhead target is graded on the "
                        "median of the pairs' steady-step ratios, which cancels the machine's drift between runs "
                        "(default 0: graded on the one plain run before the first fault)")
    p.add_argument("--bracket", action=argparse.BooleanOptionalAction, default=True,
                   help="a plain run of --plain-steps after each system, which is graded (overhead, effective "
                        "ratio) against the mean plain step before and after it; --no-bracket: every system "
                        "against the first plain run (default on)")
    p.add_argument("--pairs-mtbf", choices=("default", "schedule"), default="default",
                   help="the mean time between faults Transom's cadence is given in the fault-free pairs: default, "
                        "the product's (TRANSOM_CKPT_MTBF_S unset: 4 h), as a job with no fault runs; schedule, "
                        "the fault run's (what a job expecting that fault rate pays for its saves) (default "
                        "default)")
    p.add_argument("--run-timeout", type=float, default=None, help="give up a run after this many seconds "
                                                                   "(default 1800)")
    p.add_argument("--settle", type=float, default=8.0,
                   help="Transom: seconds between starting the services and submitting the job (default 8)")
    p.add_argument("--progress-every", type=float, default=15.0, help="seconds between progress lines (default 15)")
    p.add_argument("--work-dir", default=None, help="where runs write (default: a new temp dir, removed at the end "
                                                    "unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, checkpoints, steps files)")
    p.add_argument("--combine", nargs="+", metavar="OUTPUT", default=None,
                   help="grade the per-kind targets on the faults of several saved runs pooled (each file: a "
                        "run's output, ending in its JSON line) and run nothing; how stragglers are graded, "
                        "one per run (docs/goodput.md)")
    p.add_argument("--print-schedule", action="store_true",
                   help="print the fault schedule and the pause as JSON and exit (needs --fault-every-steps)")
    args = p.parse_args(argv)
    defaults = {"steps": 400, "width": 384, "layers": 4, "batch_size": 2, "ckpt_every": "auto",
                "fault_every_steps": None, "faults": 16, "run_timeout": 1800.0}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, QUICK[k] if args.quick else v)
    args.kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    args.runs = tuple(r.strip() for r in args.runs.split(",") if r.strip())
    bad = [r for r in args.runs if r not in RUNS]
    if bad or not args.runs:
        p.error(f"--runs: {bad or 'nothing'} given; expected some of {', '.join(RUNS)}")
    if args.ckpt_every != "auto":
        if not str(args.ckpt_every).isdigit() or int(args.ckpt_every) < 1:
            p.error(f"--ckpt-every {args.ckpt_every!r}: expected a number of steps >= 1 or auto")
        args.ckpt_every = int(args.ckpt_every)
    if args.steps < 2 or args.world < 2 or not 0 < args.straggler_factor <= 1:
        p.error("--steps >= 2, --world >= 2 and 0 < --straggler-factor <= 1 expected")
    if args.width % args.heads:
        p.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")
    if args.pause.strip().lower() == "off":
        args.pause_range = None
    else:
        try:
            lo, hi = (float(v) for v in args.pause.split(","))
            if not 0 < lo <= hi:
                raise ValueError
        except ValueError:
            p.error(f"--pause: {args.pause!r} given; expected LOW,HIGH seconds with 0 < LOW <= HIGH, or off")
        args.pause_range = (lo, hi)
    if args.hosts:
        import inspect
        from transom.stack import LocalStack
        if "hosts" not in inspect.signature(LocalStack).parameters:
            p.error("--hosts: this checkout's LocalStack has no hosts test bed yet (LocalStack(hosts=True))")
        if os.geteuid() != 0:
            p.error("--hosts: the test bed makes namespaces, which needs root")
    args.schedule, args.eval_pause = None, None
    if args.fault_every_steps is not None:
        try:
            plan(args, None)
        except ValueError as exc:
            p.error(str(exc))
    return args


def plan(args: argparse.Namespace, plain_step: float | None) -> None:
    """The schedule and the pause, by steps: from --fault-every-steps, else --fault-every / the plain step."""
    every = args.fault_every_steps
    if every is None:
        every = max(1, round(args.fault_every / plain_step)) if plain_step else args.steps
    args.every_steps = every
    args.schedule = make_schedule(args.seed, every, args.faults, args.world, args.kinds)
    args.eval_pause = make_eval_pause(args.seed, args.steps, args.schedule, *args.pause_range) \
        if args.pause_range else None


def lighthouse() -> str | None:
    """TorchFT's lighthouse program: beside this interpreter (its venv), else on PATH; None if neither."""
    exe = Path(sys.executable).with_name("torchft_lighthouse")
    return str(exe) if exe.exists() else shutil.which("torchft_lighthouse")


def overhead_pairs(args: argparse.Namespace, work: Path) -> dict:
    """``--overhead-pairs`` alternating fault-free runs, plain then Transom (one spare, no pause): the
    steady step of each, and the median of Transom's over the plain one's, less one."""
    pairs: list[list[float | None]] = []
    for i in range(args.overhead_pairs):
        print(f"\n== overhead pair {i + 1}/{args.overhead_pairs}: plain, then Transom, no fault ==", flush=True)
        pargs = argparse.Namespace(**{**vars(args), "steps": args.plain_steps})
        plain = PlainRun(pargs, work / f"pair{i}-plain", []).run()
        targs = argparse.Namespace(**{**vars(args), "steps": 2 * args.plain_steps, "spares": 1})
        if args.pairs_mtbf == "default":
            targs.mtbf_s = None                  # no --mtbf: the cadence's own default
        t = TransomRun(targs, work / f"pair{i}-transom", [], None).run()
        grade(t, [plain.steady_step_s], None)
        pairs.append([plain.steady_step_s, t.steady_step_s])
        print(f"  plain step {_fmt(plain.steady_step_s, 's')}, Transom steady step {_fmt(t.steady_step_s, 's')} "
              f"(spares warm at {_fmt(t.warm_s, 's')}): overhead {_fmt(t.overhead)}", flush=True)
    value = paired_overhead(pairs)
    print(f"overhead, median of {len(pairs)} pairs: {_fmt(value)}", flush=True)
    mtbf = "the product's default" if args.pairs_mtbf == "default" else f"{args.mtbf_s:.0f} s (the schedule's)"
    return {"value": value, "pairs": pairs, "mtbf": mtbf}


def last_json_line(path: str) -> dict:
    """The last goodput JSON line of a saved run's output (``goodput.py ... > FILE``)."""
    found = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("{") and '"bench": "goodput"' in line:
                try:
                    found = json.loads(line)
                except ValueError:
                    continue
    if found is None or "runs" not in found:
        raise ValueError(f"{path}: no goodput JSON line (the one a run prints last); was the run cut short?")
    return found


def combine(paths: list[str]) -> int:
    """``--combine``: pool the faults of several saved runs and grade the per-kind targets on the pool.

    Each run gave every system the same faults at the same steps; the medians per kind are over the
    pooled faults of each system, and each fault's row shows what it cost every system in its own run.
    Runs of one straggler each are how stragglers are graded (docs/goodput.md): in a synchronous job
    the slowest rank sets the step, so against a system that never replaces a straggler every later
    straggler of the same run lands on a job its first one already slowed and costs that system
    next to nothing by any per-fault measure."""
    try:
        runs = [last_json_line(p) for p in paths]
    except (OSError, ValueError) as exc:
        print(f"goodput --combine: {exc}", file=sys.stderr)
        return 2
    setup = {(r["world"], r["straggler_factor"], r["width"], r["layers"], r["batch_size"]) for r in runs}
    if len(setup) > 1:
        print("goodput --combine: the runs differ in world, straggler factor or model "
              f"({sorted(setup)}): their faults are not comparable", file=sys.stderr)
        return 2
    systems = [n for n in RUNS if any(n in r["runs"] for r in runs)]
    rows: dict[tuple, dict[str, dict]] = {}
    for i, r in enumerate(runs):
        for n in systems:
            for f in (r["runs"].get(n) or {}).get("per_fault") or []:
                rows.setdefault((i, r["seed"], f["after_step"], f["kind"]), {})[n] = f
    print(f"{'run':>3} {'seed':>4} {'after':>5} {'kind':<9}  "
          + "  ".join(f"{n + ' lost':>16}" for n in systems))
    for (i, seed, after, kind), by in sorted(rows.items()):
        print(f"{i:>3} {seed:>4} {after:>5} {kind:<9}  "
              + "  ".join(f"{_fmt((by.get(n) or {}).get('lost_s'), 's'):>16}" for n in systems))
    pooled = {n: kind_medians([by[n] for by in rows.values() if n in by]) for n in systems}
    print("\nmedian lost per kind  " + "  ".join(f"{k:>9}" for k in KINDS))
    for n in systems:
        print(f"{n:<20}  " + "  ".join(f"{_fmt((pooled[n].get(k) or {}).get('lost_s')):>9}" for k in KINDS))
    tg = loss_targets(pooled.get("transom") or {}, pooled.get("torchrun") or {}) if "transom" in pooled else {}
    print(json.dumps({
        "bench": "goodput", "combined": [{"file": p, "seed": r["seed"], "steps": r["steps"], "kinds": r["kinds"],
                                          "fault_every_steps": r["fault_every_steps"],
                                          "effective_ratio": {n: (r["runs"].get(n) or {}).get("effective_ratio")
                                                              for n in systems}}
                                         for p, r in zip(paths, runs)],
        "world": runs[0]["world"], "straggler_factor": runs[0]["straggler_factor"],
        "per_kind": pooled, "targets": tg,
        "met": all(v["met"] for v in tg.values() if v["met"] is not None) if tg else None,
    }), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.combine:
        return combine(args.combine)
    if args.print_schedule:
        if args.schedule is None:
            print("--print-schedule needs --fault-every-steps (otherwise the plain run decides)", file=sys.stderr)
            return 2
        print(json.dumps({"faults": [asdict(f) for f in args.schedule],
                          "eval_pause": asdict(args.eval_pause) if args.eval_pause else None}))
        return 0
    if "torchft" in args.runs and lighthouse() is None:
        print("goodput: --runs torchft: TorchFT is not installed here (no torchft_lighthouse): install the "
              "bench extra (pip install -e '.[bench]', which `make bench` does), or leave torchft out of "
              "--runs", file=sys.stderr)
        return 2
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="goodput-"))
    params = 12 * args.width * args.width * args.layers + (256 + args.seq_len + 256) * args.width
    print(f"goodput: {args.world} ranks, {args.steps} steps, width {args.width} x {args.layers} layers "
          f"(~{params / 1e6:.1f}M parameters), batch {args.batch_size}x{args.seq_len}, checkpoint every "
          + ("Young's interval" if args.ckpt_every == "auto" else f"{args.ckpt_every} steps")
          + f"; seed {args.seed}; watchdog {args.watchdog:.0f}s; Transom services at nice {args.services_nice}; "
          f"work dir {work}", flush=True)
    results: dict[str, RunResult] = {}

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)     # a SIGTERM still tears down what the runs started
    plain_step = None
    try:
        print(f"\n== run plain (no fault tolerance, {args.plain_steps} steps) ==", flush=True)
        pargs = argparse.Namespace(**{**vars(args), "steps": args.plain_steps})
        plain = PlainRun(pargs, work / "plain", []).run()
        results["plain"] = plain
        plain_step = plain.steady_step_s or plain.normal_step_s
        print_run(plain)
        if not plain_step:
            print("goodput: the plain run measured no step time; stopping", flush=True)
            return 1
        if args.schedule is None:
            plan(args, plain_step)
        else:
            args.every_steps = args.fault_every_steps
        args.mtbf_s = args.every_steps * plain_step
        print(f"\nplain step {plain_step:.4f}s; a fault every {args.every_steps} steps "
              f"(~{args.mtbf_s:.0f}s of plain training"
              + (", the MTBF of both checkpoint cadences)" if args.ckpt_every == "auto" else ")"), flush=True)
        print("schedule: " + ", ".join(f"after step {f.after_step} {f.kind} rank {f.rank}" for f in args.schedule
                                       if f.after_step < args.steps)
              + (f"; evaluation pause {args.eval_pause.seconds:.0f}s after step {args.eval_pause.after_step}"
                 if args.eval_pause else ""), flush=True)
        classes = {"torchrun": TorchrunRun, "torchft": TorchftRun, "transom": TransomRun}
        before = plain_step
        for name in args.runs:
            print(f"\n== run {name} ==", flush=True)
            r = classes[name](args, work / name, args.schedule, args.eval_pause).run()
            results[name] = r
            after = None
            if args.bracket:
                print(f"\n== run plain again ({args.plain_steps} steps: {name}'s reference is the mean of the plain "
                      f"steps before and after it) ==", flush=True)
                again = PlainRun(pargs, work / f"plain-after-{name}", []).run()
                after = again.steady_step_s or again.normal_step_s
                print(f"  plain step {_fmt(after, 's')}", flush=True)
            grade(r, [before, after], args.eval_pause)
            print_run(r)
            before = after or before
        paired = overhead_pairs(args, work) if args.overhead_pairs > 0 and "transom" in results else None
    finally:
        if not args.keep and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    systems = [n for n in args.runs if n in results]
    print("\nsystem     wall(s)  eff.ratio  overhead  " + "  ".join(f"{k:>9}" for k in KINDS) + "  pause false restarts")
    for n in systems:
        r, pk = results[n], per_kind(results[n])
        print(f"{n:<10} {_fmt(r.wall_s):>7}  {_fmt(r.effective_ratio):>9}  {_fmt(r.overhead):>8}  "
              + "  ".join(f"{_fmt((pk.get(k) or {}).get('lost_s')):>9}" for k in KINDS)
              + f"  {r.pause.false_restarts if r.pause else '-'}", flush=True)
    fault_rate = round(args.every_steps * plain_step, 1)
    tg = targets(results, fault_rate, paired)
    print(json.dumps({
        "bench": "goodput", "seed": args.seed, "world": args.world, "steps": args.steps, "width": args.width,
        "layers": args.layers, "batch_size": args.batch_size, "ckpt_every": args.ckpt_every,
        "mtbf_s": round(args.mtbf_s, 1),
        "plain_step_s": plain_step, "fault_every_steps": args.every_steps, "fault_every_s_of_training": fault_rate,
        "kinds": list(args.kinds), "watchdog_s": args.watchdog, "straggler_factor": args.straggler_factor,
        "eval_pause": asdict(args.eval_pause) if args.eval_pause else None, "quick": args.quick,
        "torchft": {"pg_timeout_s": args.torchft_pg_timeout, "heartbeat_timeout_ms": args.torchft_heartbeat_ms},
        "services_nice": args.services_nice, "hosts": args.hosts, "precheck": args.precheck,
        "runs": {n: summary(results[n]) for n in ["plain", *systems]},
        "targets": tg, "met": all(v["met"] for v in tg.values() if v["met"] is not None) if tg else None,
    }), flush=True)
    return 0 if all(results[n].completed for n in systems) else 1


if __name__ == "__main__":
    sys.exit(main())
