"""Goodput: the same training job under the same seeded faults, torchrun retry loop vs. Transom.

One invocation runs the job twice, one run after the other, on this machine:

(a) torchrun: ``torchrun --standalone``-style (``--nnodes 1 --nproc-per-node WORLD --max-restarts 0``)
    of ``bench/tol_torchrun_job.py`` (the example LM, synchronous ``torch.save`` by rank 0 every
    ``--ckpt-every`` steps, every rank resumes from the newest file), re-invoked with a new master
    port after every failure, the way users' retry loops do it (torchrun's own ``--max-restarts``
    cannot re-form a gloo group here); a step-progress watchdog (``--watchdog``) kills the attempt
    when no step has been written for that long (hangs are otherwise only noticed at the gloo
    timeout);
(b) Transom: ``LocalStack`` (embedded broker, one agent with simulated GPUs and one TCE daemon per
    node, a TEE worker, the controller with its full pre-check) running ``transom.examples.train_lm``
    with the same model, batch, seed, steps and checkpoint interval (TCE saves), WORLD ranks on
    WORLD nodes plus spares.

The fault schedule (``make_schedule``) is derived from ``--seed``: fault i at about
``(i + 1) * --fault-every`` seconds of wall time after the run's start (jitter +-20 %), kinds in
shuffled rounds of ``--kinds``, target rank from the seed. Each fault is delivered at its offset, or,
when the job is still recovering from the previous fault then, at its first new step (so both runs
take every fault that falls within their wall time). What a fault does:

- ``crash``: SIGKILL of the target rank's process;
- ``xid79``: the GPU fell off the bus: SIGKILL of the rank's process and, under Transom, XID 79 on
  the node's simulated GPU (the agent reports it, the TEE raises it, the controller evicts the node;
  the baseline's retry loop reuses the same node: generous to it, a real lost GPU would need a human);
- ``hang``: SIGSTOP of the rank's process; the baseline notices through its watchdog, Transom
  through the TEE's hang rule;
- ``straggler``: the node runs at ``--straggler-factor`` of its speed for the rest of the run,
  whichever process runs on it (attempt or generation): the bench writes the factor to
  ``slow/<node>`` with S = (1/f - 1) x the normal step time measured so far, and both jobs'
  ``--slowdown-dir`` hook makes that rank spin S seconds on the CPU every step (SIGSTOP duty
  cycling or a sleep do not work here: with 4 ranks on 2 cores, a paused rank hands its core to
  the others and the job barely slows, as a first run showed; S from the rank's own step time
  feeds back on itself and slowed the job 2.5x); under Transom the node's
  simulated GPU also shows clocks and power at 70 %. Nobody replaces it in
  the baseline; under Transom the TEE raises a straggler (critical: its clock is 30 % below its
  peers') and the controller replaces the node with a spare, as its policy says.

Figures per run: wall time from launch to the last step, steps, the normal step time (median
interval between steps before the first fault, checkpoint steps excluded), useful time (steps x
normal step time) and the effective training time ratio (useful / wall); per fault: detection
(fault -> the retry loop sees torchrun exit or its watchdog fires; Transom: the controller's
``relaunching`` decision), recovery (detected -> first step of the new attempt or generation) and
recomputation (steps redone x normal step time); for a straggler, the slowdown it caused (until its
node was replaced, when it was: then also that relaunch's recovery and recomputation). Then the
ratio of wall times a/b (target >= 1.4) and one JSON line.
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

__all__ = ["KINDS", "ScheduledFault", "make_schedule", "main"]

KINDS = ("crash", "xid79", "hang", "straggler")
TARGET = 1.4
RESTARTING = ("crash", "xid79", "hang")


@dataclass(frozen=True)
class ScheduledFault:
    """Fault ``index`` of the schedule: ``kind`` on rank slot ``rank`` at ``offset_s`` of wall time."""

    index: int
    offset_s: float
    kind: str
    rank: int


def make_schedule(seed: int, every_s: float, count: int, world: int, kinds: Iterable[str] = KINDS,
                  jitter: float = 0.2) -> list[ScheduledFault]:
    """The seeded fault schedule: the same seed, interval, count, world and kinds give the same list."""
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"--kinds: {unknown or 'nothing'} given; expected some of {', '.join(KINDS)}")
    if every_s <= 0 or world < 1 or count < 0 or not 0 <= jitter < 0.5:
        raise ValueError("make_schedule: every_s > 0, world >= 1, count >= 0 and 0 <= jitter < 0.5 expected")
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < count:
        round_ = list(kinds)
        rng.shuffle(round_)
        order += round_
    out = []
    for i in range(count):
        offset = every_s * (i + 1) + rng.uniform(-jitter, jitter) * every_s
        out.append(ScheduledFault(i, round(offset, 2), order[i], rng.randrange(world)))
    return out


# --------------------------------------------------------------------------- shared measurement parts

class StepsFile:
    """Reads the ``step generation epoch_seconds`` lines rank 0 appends (partial last lines wait)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.touch()
        self._pos = 0
        self._rest = b""
        self.rows: list[tuple[int, int, float]] = []

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
            if len(parts) == 3:
                new.append((int(parts[0]), int(parts[1]), float(parts[2])))
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
    offset_s: float
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
    note: str = ""


@dataclass
class RunResult:
    name: str
    steps: int
    completed: bool = False
    wall_s: float | None = None
    startup_s: float | None = None
    normal_step_s: float | None = None
    ckpt_overhead_s: float | None = None
    useful_s: float | None = None
    effective_ratio: float | None = None
    attempts: int = 1
    normal_note: str = ""
    faults: list[FaultRecord] = field(default_factory=list)
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

    def __init__(self, args: argparse.Namespace, work: Path, schedule: list[ScheduledFault]) -> None:
        self.args, self.work, self.schedule = args, work, schedule
        self.work.mkdir(parents=True, exist_ok=True)
        self.steps = StepsFile(self.work / "steps.txt")
        self.result = RunResult(self.name, args.steps)
        self.hung: set[int] = set()
        self.slow_dir = self.work / "slow"
        self.slow_dir.mkdir(exist_ok=True)
        self.t0 = 0.0
        self.end_ts: float | None = None   # the job ended (torchrun exit 0 / Transom ``completed``)
        self.gen = 0                      # current attempt / generation (launched)
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
                if pending and now - self.t0 >= pending[0].offset_s and self._ready():
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
        rec = FaultRecord(f.index, f.kind, f.rank, f.offset_s, delivered_s=now - self.t0,
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
              f"{rec.step_at_fault} (scheduled {f.offset_s:.0f}s)", flush=True)

    def _normal_so_far(self) -> float | None:
        """The median interval between consecutive steps of one attempt so far (None with under 3)."""
        rows = self.steps.rows
        gaps = [t1 - t0 for (s0, g0, t0), (s1, g1, t1) in zip(rows, rows[1:])
                if g0 == g1 and s1 == s0 + 1 and not self.is_save_interval(s0, s1)]
        return statistics.median(gaps) if len(gaps) >= 3 else None

    def detected(self, ts: float, detector: str, gen_before: int | None = None) -> None:
        """The launcher decided to restart (torchrun exited / watchdog / Transom relaunching)."""
        for rec in reversed(self.result.faults):
            if rec.kind in RESTARTING and rec.detected_s is None and (gen_before is None or rec.gen_at_fault == gen_before):
                rec.detected_s, rec.detector = ts - self.t0, detector
                return

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
                r.ckpt_overhead_s = round(max(per_save, 0.0) * (a.steps // a.ckpt_every), 1)
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
                "--ckpt-every", str(a.ckpt_every), "--ckpt-dir", str(self.work / "ckpt"),
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
        return s0 % self.args.ckpt_every == 0        # the step line is written before the save


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

    def launch(self) -> None:
        from transom import contracts as c
        from transom.stack import LocalStack, Monitor, train_command
        a = self.args
        replaced = sum(1 for f in self.schedule if f.kind in ("xid79", "straggler"))   # each takes a spare
        self.stack = LocalStack(self.work / "stack", nodes=a.world + max(a.spares, replaced + 1))
        self.stack.start_broker()
        self.stack.start_agents()
        self.stack.start_tee()
        self.monitor = Monitor(self.stack.bootstrap, (c.LIFECYCLE, c.FAULTS), from_beginning=False)
        time.sleep(a.settle)           # agents' first heartbeats, the TEE's group join: infrastructure, not the job
        cmd = train_command(a.steps, a.ckpt_every, "--steps-file", str(self.steps.path), "--log-every", "10",
                            *model_args(a, self.work))
        self.t0 = time.time()
        self.ctl = self.stack.start_controller(self.job, cmd, world_size=a.world,
                                               extra=["--exit-when-done", "--max-restarts", "1000",
                                                      "--precheck", a.precheck])

    def tick(self, now: float) -> None:
        from transom import contracts as c
        while True:
            got = self.monitor.poll(0)
            if got is None:
                break
            topic, ev = got
            if topic == c.LIFECYCLE and ev.job == self.job:
                gen = ev.detail.get("generation")
                if ev.name == "relaunching" and (ev.cause or {}).get("kind") == "straggler":
                    self._straggler_replaced(ev)
                elif ev.name == "relaunching":
                    self.detected(ev.ts, f"controller: {ev.cause.get('kind') or ev.detail.get('reason') or 'relaunch'}")
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
                for rec in self.result.faults:
                    if rec.target == ev.node and rec.tee_event_s is None and rec.delivered_s is not None \
                            and ev.detected_ts >= rec.delivered_s + self.t0 \
                            and _tee_matches(rec.kind, cls):
                        rec.tee_event_s = round(ev.detected_ts - self.t0 - rec.delivered_s, 2)
                        if rec.kind == "straggler":
                            rec.detected_s, rec.detector = ev.detected_ts - self.t0, f"TEE {cls}"
                        break
        if self.ctl.popen.poll() is not None and self.end is None:
            self.end = "controller exited"

    def finished(self) -> bool:
        return self.end is not None

    def _straggler_replaced(self, ev) -> None:
        """The controller evicts a straggling node: from here that fault costs a relaunch."""
        rec = next((r for r in self.result.faults if r.kind == "straggler" and r.target == ev.cause.get("node")
                    and not r.restarted), None)
        if rec is None:
            return
        last = self.steps.last
        rec.restarted, rec.gen_at_fault = True, self.gen
        rec.detected_s, rec.detector = ev.ts - self.t0, "controller: straggler replaced"
        rec.step_at_fault = last[0] if last else rec.step_at_fault

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
        try:
            return int((self._gen_dir() / f"rank-{rank}.pid").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return None

    def slot_of(self, rank: int) -> str:
        nodes = self._nodes()
        return nodes[rank] if rank < len(nodes) else f"rank{rank}"


    def inject_gpu(self, slot: str, fault: str) -> None:
        from transom.agents.intake import send_inject
        addr = self.stack.agents.get(slot)
        if addr is None:
            return
        try:
            reply = send_inject(addr, fault, gpu=0)
            if not reply.get("ok"):
                print(f"  transom: agent of {slot} refused {fault}: {reply.get('error')}", flush=True)
        except (TimeoutError, ValueError) as exc:
            print(f"  transom: could not inject {fault} on {slot}: {exc}", flush=True)

    def teardown(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        if self.stack is not None:
            self.stack.stop()

    def is_save_interval(self, s0: int, s1: int) -> bool:
        return s1 % self.args.ckpt_every == 0        # the step line is written after the save


def _tee_matches(kind: str, cls: str) -> bool:
    return {"xid79": ("xid", "gpu_lost"), "hang": ("hang",), "straggler": ("straggler", "power_cap", "thermal"),
            "crash": ()}[kind].__contains__(cls)


# --------------------------------------------------------------------------- report

def model_args(a: argparse.Namespace, work: Path) -> list[str]:
    pause = ["--eval-pause", f"{a.steps // 2}:{a.eval_pause:g}"] if a.eval_pause > 0 else []
    return ["--slowdown-dir", str(work / "slow"), "--width", str(a.width), "--layers", str(a.layers), "--heads", str(a.heads),
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--seed", str(a.seed), *pause]


def _fmt(v, unit: str = "") -> str:
    return "-" if v is None else f"{v}{unit}"


def print_run(r: RunResult) -> None:
    print(f"\n{r.name}: {'completed' if r.completed else 'NOT completed'} {r.steps} steps; wall {_fmt(r.wall_s, 's')}; "
          f"startup {_fmt(r.startup_s and round(r.startup_s, 1), 's')}; normal step {_fmt(r.normal_step_s, 's')}; "
          f"useful {_fmt(r.useful_s, 's')}; effective ratio {_fmt(r.effective_ratio)}; "
          f"checkpoint stalls ~{_fmt(r.ckpt_overhead_s, 's')}; attempts/generations {r.attempts}"
          + (f"; ERROR: {r.error}" if r.error else "") + (f"; NOTE: {r.normal_note}" if r.normal_note else ""))
    print(f"  {'#':>2} {'at(s)':>7} {'kind':<9} {'target':<7} {'step':>5} {'detect':>7} {'recover':>8} "
          f"{'recomp':>7} {'redone':>6} {'slowdn':>7}  detector / note")
    for f in r.faults:
        print(f"  {f.index:>2} {_fmt(f.delivered_s and round(f.delivered_s, 1)):>7} {f.kind:<9} {f.target:<7} "
              f"{_fmt(f.step_at_fault):>5} {_fmt(f.detect_s):>7} {_fmt(f.recover_s):>8} {_fmt(f.recompute_s):>7} "
              f"{_fmt(f.steps_redone):>6} {_fmt(f.slowdown_s):>7}  {f.detector}"
              + (f" TEE event +{f.tee_event_s}s" if f.tee_event_s is not None else "")
              + (f" ({f.note})" if f.note else ""))
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


def summary(r: RunResult) -> dict:
    return {"completed": r.completed, "wall_s": r.wall_s, "startup_s": r.startup_s and round(r.startup_s, 1),
            "normal_step_s": r.normal_step_s, "useful_s": r.useful_s, "effective_ratio": r.effective_ratio,
            "ckpt_stalls_s": r.ckpt_overhead_s, "attempts": r.attempts, "faults": len(r.faults),
            "lost_s": totals(r), "error": r.error or None,
            "per_fault": [{k: v for k, v in asdict(f).items()
                           if k in ("kind", "target", "delivered_s", "detect_s", "recover_s", "recompute_s",
                                    "steps_redone", "slowdown_s", "tee_event_s", "detector")} for f in r.faults]}


# --------------------------------------------------------------------------- main

QUICK = {"steps": 100, "width": 256, "layers": 4, "batch_size": 4, "ckpt_every": 10, "fault_every": 40.0,
         "faults": 4, "run_timeout": 900.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/goodput.py", description=__doc__.split("\n\n")[0],
                                epilog="Method: see the module docstring and docs/goodput.md.")
    p.add_argument("--quick", action="store_true",
                   help="a shorter run (about 10 minutes on a busy 2-core machine): " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
                        + " (flags given explicitly win)")
    p.add_argument("--seed", type=int, default=1, help="seed of the fault schedule, the model and the data (default 1)")
    p.add_argument("--steps", type=int, default=None, help="training steps of the job (default 400: several "
                                                           "fault intervals long, so both runs take many faults)")
    p.add_argument("--ckpt-every", type=int, default=None, help="checkpoint interval K in steps, both runs (default 10)")
    p.add_argument("--width", type=int, default=None, help="model width (default 384: ~7M parameters, ~90 MB "
                                                           "of model + AdamW state per rank)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 4)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per rank per step (default 2)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (default 64)")
    p.add_argument("--world", type=int, default=4, help="ranks (nodes) of the job (default 4)")
    p.add_argument("--spares", type=int, default=1, help="Transom spare nodes (at least one per scheduled XID 79 "
                                                         "and straggler, plus one; default 1)")
    p.add_argument("--fault-every", type=float, default=None, help="seconds of wall time between faults (default 60)")
    p.add_argument("--faults", type=int, default=None,
                   help="faults in the schedule (default 16; a run only takes those within its wall time)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds to mix (default {','.join(KINDS)})")
    p.add_argument("--watchdog", type=float, default=60.0,
                   help="baseline: seconds without a step before the retry loop kills the attempt (default 60; "
                        "see docs/goodput.md for why)")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="baseline: seconds an attempt may take to its first step (default 300)")
    p.add_argument("--straggler-factor", type=float, default=0.7,
                   help="a straggling rank runs this fraction of the time (default 0.7)")
    p.add_argument("--precheck", default="full", choices=["full", "health", "off"],
                   help="Transom controller's pre-check before every launch (default full, as it ships)")
    p.add_argument("--eval-pause", type=float, default=40.0,
                   help="seconds every rank stands still at the middle step, without a phase marker, in both runs "
                        "(an evaluation pass; Transom must not restart for it; 0: none; default 40)")
    p.add_argument("--runs", default="torchrun,transom", help="which runs, in order (default torchrun,transom)")
    p.add_argument("--run-timeout", type=float, default=None, help="give up a run after this many seconds "
                                                                   "(default 1800)")
    p.add_argument("--settle", type=float, default=8.0,
                   help="Transom: seconds between starting the services and submitting the job (default 8)")
    p.add_argument("--progress-every", type=float, default=15.0, help="seconds between progress lines (default 15)")
    p.add_argument("--work-dir", default=None, help="where runs write (default: a new temp dir, removed at the end "
                                                    "unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, checkpoints, steps files)")
    p.add_argument("--print-schedule", action="store_true", help="print the fault schedule as JSON and exit")
    args = p.parse_args(argv)
    defaults = {"steps": 400, "width": 384, "layers": 4, "batch_size": 2, "ckpt_every": 10, "fault_every": 60.0,
                "faults": 16, "run_timeout": 1800.0}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, QUICK[k] if args.quick else v)
    args.kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    args.runs = tuple(r.strip() for r in args.runs.split(",") if r.strip())
    bad = [r for r in args.runs if r not in ("torchrun", "transom")]
    if bad or not args.runs:
        p.error(f"--runs: {bad or 'nothing'} given; expected torchrun and/or transom")
    if args.steps < 1 or args.ckpt_every < 1 or args.world < 2 or not 0 < args.straggler_factor <= 1:
        p.error("--steps >= 1, --ckpt-every >= 1, --world >= 2 and 0 < --straggler-factor <= 1 expected")
    if args.width % args.heads:
        p.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")
    try:
        args.schedule = make_schedule(args.seed, args.fault_every, args.faults, args.world, args.kinds)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_schedule:
        print(json.dumps([asdict(f) for f in args.schedule]))
        return 0
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="goodput-"))
    params = 12 * args.width * args.width * args.layers + (256 + args.seq_len + 256) * args.width
    print(f"goodput: {args.world} ranks, {args.steps} steps, width {args.width} x {args.layers} layers "
          f"(~{params / 1e6:.1f}M parameters, ~{12 * params / 1e6:.0f} MB checkpoint per rank), batch "
          f"{args.batch_size}x{args.seq_len}, checkpoint every {args.ckpt_every} steps; fault every "
          f"~{args.fault_every:.0f}s (seed {args.seed}); baseline watchdog {args.watchdog:.0f}s; work dir {work}",
          flush=True)
    print("schedule: " + ", ".join(f"{f.offset_s:.0f}s {f.kind} rank {f.rank}" for f in args.schedule), flush=True)
    results: dict[str, RunResult] = {}

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)     # a SIGTERM still tears down what the runs started
    try:
        for name in args.runs:
            print(f"\n== run {name} ==", flush=True)
            cls = TorchrunRun if name == "torchrun" else TransomRun
            results[name] = cls(args, work / name, args.schedule).run()
            print_run(results[name])
    finally:
        if not args.keep and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    a, b = results.get("torchrun"), results.get("transom")
    ratio = in_steps = None
    if a and b and a.completed and b.completed and a.wall_s and b.wall_s:
        ratio = round(a.wall_s / b.wall_s, 3)
        if a.normal_step_s and b.normal_step_s:   # the machine is shared: its load differs between the runs
            in_steps = round((a.wall_s / a.normal_step_s) / (b.wall_s / b.normal_step_s), 3)
    print(f"\nwall time to finish: torchrun {_fmt(a and a.wall_s, 's')}, transom {_fmt(b and b.wall_s, 's')}; "
          f"ratio a/b = {_fmt(ratio)} (target >= {TARGET}); in units of each run's normal step time: "
          f"{_fmt(in_steps)}", flush=True)
    print(json.dumps({
        "bench": "goodput", "seed": args.seed, "world": args.world, "steps": args.steps, "width": args.width,
        "layers": args.layers, "batch_size": args.batch_size, "ckpt_every": args.ckpt_every,
        "fault_every_s": args.fault_every, "kinds": list(args.kinds), "watchdog_s": args.watchdog,
        "straggler_factor": args.straggler_factor, "quick": args.quick,
        "torchrun": summary(a) if a else None, "transom": summary(b) if b else None,
        "ratio_wall_torchrun_over_transom": ratio, "ratio_in_normal_steps": in_steps,
        "precheck": args.precheck,
        "targets": {"wall_ratio": {"target": TARGET, "value": ratio, "met": ratio is not None and ratio >= TARGET}},
    }), flush=True)
    return 0 if (not a or a.completed) and (not b or b.completed) else 1


if __name__ == "__main__":
    sys.exit(main())
