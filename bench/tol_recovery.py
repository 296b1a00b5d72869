"""TOL recovery: from a fault to the relaunched job's first step, Transom vs. a torchrun retry loop.

Transom (local backend, 4 ranks of ``python -m transom.examples.train_lm``, checkpoint every
``--ckpt-every`` steps, 5 real node agents with simulated GPUs, the embedded broker, the full
pre-check: agent health and a gloo all-reduce): once the job passes ``--fault-step``, the bench
publishes an XID 79 fault event for node1 on ``transom.faults`` (as the TEE would; the TEE itself
is not run, so detection time is not part of the figure) and SIGKILLs the rank on node1 at the
same instant (the GPU fell off the bus, its process died). The clock stops at the first training
step of generation 1, taken from the agents' training samples (report time = batch time minus
``report_age_s``; the agent keeps the newest report only, so this can read late, never early).
Each trial is a fresh job in a fresh run directory, so node4 is the spare every time.

Baseline: ``torchrun --standalone --nproc-per-node 4 --max-restarts 0`` of the same model with
synchronous ``torch.save`` checkpoints (bench/tol_torchrun_job.py), re-invoked with a new master
port after each failure, the way users' retry loops do it (its own ``--max-restarts`` cannot
re-form a gloo group here). The same kill: SIGKILL of rank 1 once the job passes ``--fault-step``;
the clock stops at the first step the new attempt writes.

``--hosts``: Transom runs on the test bed (transom/testbed.py): broker and controller on a control
host, each node a host of its own with its agent, checkpoint daemon and launcher (the hosts
backend), ranks reached only over the bed's network; the rank on node1 is killed inside node1's
PID namespace. The torchrun baseline runs on one host either way (it has no notion of hosts).

Prints one line per trial, the medians, the ratio, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transom import contracts as c  # noqa: E402
from transom.kafka import make_producer, publish  # noqa: E402
from transom.stack import LocalStack, Monitor, train_command  # noqa: E402

TARGET_S = 20.0


def _kill_rank(gen_dir: Path, rank: int, timeout: float = 10, stack: LocalStack | None = None,
               node: str = "node1") -> None:
    pid_file = gen_dir / f"rank-{rank}.pid"
    deadline = time.monotonic() + timeout
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text().split()[1])
    if stack is not None and stack.bed is not None:     # a pid of the node host's own PID namespace
        stack.bed.sh(node, f"kill -KILL {child}", check=True)
    else:
        os.kill(child, signal.SIGKILL)


def transom_trial(stack: LocalStack, i: int, args: argparse.Namespace, producer) -> dict:
    job = f"tolbench-{os.getpid()}-{i}"
    run_dir = stack.run_dir / f"trial-{i}"
    monitor = Monitor(stack.bootstrap, (c.LIFECYCLE, c.METRICS), from_beginning=False)
    steps = args.fault_step + 2 * args.ckpt_every
    ctl = stack.start_controller(job, train_command(steps, args.ckpt_every), world_size=4, name=f"ctl-{i}",
                                 extra=["--exit-when-done", "--run-dir", str(run_dir)])
    t_fault = first = None
    result: dict = {"trial": i}
    deadline = time.monotonic() + args.trial_timeout
    try:
        while time.monotonic() < deadline:
            got = monitor.poll(0.2)
            if ctl.popen.poll() is not None and (got is None):
                break
            if got is None:
                continue
            topic, ev = got
            if topic == c.METRICS:
                for s in ev.of(c.Source.TRAIN):
                    if s.tags.get("job") != job or "step" not in s.fields:
                        continue
                    gen, step = int(s.tags.get("generation", -1)), int(s.fields["step"])
                    if t_fault is None and gen == 0 and step >= args.fault_step:
                        now = time.time()
                        f = c.FaultEvent(fault_id=c.stable_id(job, "node1", "xid", now), job=job, node="node1",
                                         kind=c.FaultKind.XID, severity=c.Severity.CRITICAL, detector="bench",
                                         action=c.Action.EVICT, observed_ts=now, detected_ts=now,
                                         evidence={"xid": 79}, summary="XID 79 on node1 (bench)")
                        publish(producer, c.FAULTS, job, f)
                        producer.flush(10)
                        if stack.bed is not None:
                            _kill_rank(stack.run_dir / "hosts" / "node1" / job / "gen-0", 1, stack=stack)
                        else:
                            _kill_rank(run_dir / job / "gen-0", 1)
                        t_fault = now
                        result["fault_step"] = step
                    elif t_fault is not None and gen == 1 and first is None:
                        first = (s.ts or ev.ts) - float(s.fields.get("report_age_s", 0.0))
                        result["first_step"] = step
                        result["fault_to_first_step_s"] = round(first - t_fault, 2)
            elif topic == c.LIFECYCLE and ev.job == job:
                if ev.name == "resumed":
                    result["steps_lost"] = ev.detail.get("steps_lost")
                    result["resume_step"] = ev.detail.get("resume_step")
                elif ev.name == "relaunching":
                    result["decided_s"] = round(ev.ts - (t_fault or ev.ts), 2)
                elif ev.name == "launched" and ev.detail.get("generation") == 1:
                    result["launched_s"] = round(ev.ts - (t_fault or ev.ts), 2)
                elif ev.name in ("completed", "failed"):
                    result["end"] = ev.name
            if "end" in result and "fault_to_first_step_s" in result:
                break
    finally:
        monitor.close()
        if ctl.popen.poll() is None:
            ctl.signal(signal.SIGTERM)
            try:
                ctl.popen.wait(20)
            except subprocess.TimeoutExpired:
                ctl.signal(signal.SIGKILL)
    return result


def torchrun_trial(i: int, args: argparse.Namespace, work: Path) -> dict:
    from transom.broker import free_port

    ckpt = work / f"torchrun-{i}" / "ckpt"
    ckpt.mkdir(parents=True)
    steps_file = work / f"torchrun-{i}" / "steps.txt"
    steps_file.touch()
    job = [str(ROOT / "bench" / "tol_torchrun_job.py"), "--ckpt-every", str(args.ckpt_every),
           "--ckpt-dir", str(ckpt), "--steps-file", str(steps_file),
           "--steps", str(args.fault_step + 2 * args.ckpt_every)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result: dict = {"trial": i}
    t_kill = None
    last_before = 0
    for attempt in range(3):                    # the user's retry loop: a new torchrun, a new port
        log = open(work / f"torchrun-{i}" / f"attempt-{attempt}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                                 "--nproc-per-node", "4", "--max-restarts", "0", "--master-addr", "127.0.0.1",
                                 "--master-port", str(free_port()), *job[:1], "--attempt", str(attempt), *job[1:]],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + args.trial_timeout
        while proc.poll() is None and time.monotonic() < deadline:
            lines = [ln.split() for ln in steps_file.read_text().splitlines() if ln.strip()]
            mine = [ln for ln in lines if int(ln[1]) == attempt]
            if t_kill is None and mine and int(mine[-1][0]) >= args.fault_step:
                workers = [p for p in _children(proc.pid) if "tol_torchrun_job.py" in " ".join(p.cmdline())]
                target = next((p for p in workers if "LOCAL_RANK=1" in _environ(p)), workers[1])
                last_before = int(mine[-1][0])
                t_kill = time.time()
                target.kill()
                result["fault_step"] = last_before
            elif t_kill is not None and attempt > 0 and mine and "first_step" not in result:
                result["first_step"] = int(mine[0][0])
                result["fault_to_first_step_s"] = round(float(mine[0][2]) - t_kill, 2)
                result["steps_lost"] = max(last_before - (int(mine[0][0]) - 1), 0)
            time.sleep(0.05)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if "first_step" in result or t_kill is None and proc.returncode == 0:
            break
    return result


def _children(pid: int):
    import psutil
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _environ(p) -> str:
    try:
        return " ".join(f"{k}={v}" for k, v in p.environ().items())
    except Exception:
        return ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--ckpt-every", type=int, default=10, help="checkpoint interval in steps (default 10)")
    p.add_argument("--fault-step", type=int, default=25, help="inject once the job passes this step (default 25)")
    p.add_argument("--trial-timeout", type=float, default=120)
    p.add_argument("--hosts", action="store_true",
                   help="Transom on the test bed's hosts (namespaces; needs root), the baseline on one host")
    p.add_argument("--skip-baseline", action="store_true", help="Transom's trials only")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tol-bench-"))
    print(f"tol_recovery: {args.trials} trials each; 4 ranks; checkpoint every {args.ckpt_every} steps; "
          f"fault at step {args.fault_step}; work dir {work}", flush=True)
    stack = LocalStack(work / "stack", hosts=args.hosts)
    transom: list[dict] = []
    baseline: list[dict] = []
    producer = None
    try:
        stack.start_broker()
        stack.start_agents()
        producer = make_producer(stack.bootstrap)
        time.sleep(2)                                # first heartbeats
        for i in range(args.trials):
            r = transom_trial(stack, i, args, producer)
            transom.append(r)
            print(f"transom  trial {i}: {json.dumps(r)}", flush=True)
    finally:
        if producer is not None:
            producer.flush(5)
            del producer                             # before the broker goes: no reconnect noise
        stack.stop()
    for i in range(0 if args.skip_baseline else args.trials):
        r = torchrun_trial(i, args, work)
        baseline.append(r)
        print(f"torchrun trial {i}: {json.dumps(r)}", flush=True)
    t = [r["fault_to_first_step_s"] for r in transom if "fault_to_first_step_s" in r]
    b = [r["fault_to_first_step_s"] for r in baseline if "fault_to_first_step_s" in r]
    lost = [r.get("steps_lost") for r in transom]
    med_t = statistics.median(t) if t else None
    med_b = statistics.median(b) if b else None
    ratio = round(med_b / med_t, 2) if med_t and med_b else None
    lost_ok = bool(lost) and all(x is not None and x <= args.ckpt_every for x in lost)
    print(f"median fault -> first step: transom {med_t} s ({len(t)}/{args.trials} trials), torchrun {med_b} s "
          f"({len(b)}/{args.trials}); torchrun/transom = {ratio}", flush=True)
    print(json.dumps({
        "bench": "tol_recovery", "hosts": bool(args.hosts), "ranks": 4, "trials": args.trials, "ckpt_every": args.ckpt_every,
        "fault": "XID 79 event published on transom.faults + SIGKILL of the rank on node1 (no TEE)",
        "transom_fault_to_first_step_s": med_t, "transom_all_s": t,
        "transom_steps_lost": lost, "torchrun_fault_to_first_step_s": med_b, "torchrun_all_s": b,
        "torchrun_steps_lost": [r.get("steps_lost") for r in baseline],
        "ratio_torchrun_over_transom": ratio,
        "targets": {"fault_to_first_step_s": {"target": TARGET_S, "met": med_t is not None and med_t <= TARGET_S},
                    "steps_lost_le_ckpt_interval": {"target": args.ckpt_every, "met": lost_ok}},
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
