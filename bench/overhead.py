"""bench/overhead: what Transom's services cost a training step on the machine they share, in paired windows.

A light companion of bench/goodput's steady-state overhead (issue 17): one run of ``LocalStack``
(embedded broker, an agent and a TCE daemon per node, a TEE worker, the controller) beside a
training loop in this process (CPU-bound steps: matmuls of ``--width``, one ``report()`` to node0's
agent per step, as ``transom.examples.train_lm`` does), which also holds ``--channels`` ranks'
control channels (``transom.elastic.ElasticGroup``: a producer and a consumer of the job's timeline
each, as every rank of a 4-rank job holds; their threads run in the job's process, at its priority).
The services are stopped (SIGSTOP to each one's process group) and resumed in alternating windows
of ``--window`` seconds; the overhead is the median over ``--rounds`` pairs of (mean step with the
services running / mean step with them stopped) - 1. Pairing adjacent windows cancels most of the
drift of a shared host's load, which a plain run followed by a Transom run (bench/goodput) cannot.
It leaves out what a job adds (its checkpoints: bench/tce's lost per save; the rank-side client:
``report()`` runs in both windows alike). The services run at ``TRANSOM_SERVICE_PRIORITY``
(default ``batch:10``, ``--services-priority`` to compare).

    python bench/overhead.py [--nodes 5] [--rounds 6] [--window 5] [--services-priority normal]

Prints one line per pair, the services' CPU seconds per second of the running windows (what they
take from the machine, whatever the noise of the step times), and a JSON line with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def step(a: torch.Tensor, b: torch.Tensor) -> None:
    (a @ b).sum().item()


def window(seconds: float, a, b, report) -> tuple[float, int]:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        s0 = time.perf_counter()
        step(a, b)
        report(step=n, loss=1.0, step_time=time.perf_counter() - s0)
        n += 1
    return (time.perf_counter() - t0) / n, n


def services_cpu(groups: list[int], per: dict | None = None) -> float:
    """CPU seconds used so far by every process in the services' process groups (``/proc/*/stat``);
    ``per``: filled with group -> seconds."""
    tck, total, want = os.sysconf("SC_CLK_TCK"), 0.0, set(groups)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in want:               # field 5: the process group
            sec = (int(fields[11]) + int(fields[12])) / tck
            total += sec
            if per is not None:
                per[int(fields[2])] = per.get(int(fields[2]), 0.0) + sec
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=5, help="simulated nodes: an agent and a TCE daemon each (default 5)")
    p.add_argument("--rounds", type=int, default=6, help="pairs of windows (default 6)")
    p.add_argument("--window", type=float, default=5.0, help="seconds per window (default 5)")
    p.add_argument("--width", type=int, default=1024, help="matmul size of a step (default 1024: ~50-100 ms here)")
    p.add_argument("--channels", type=int, default=4,
                   help="ranks' control channels (transom.elastic) held in the job's process (default 4)")
    p.add_argument("--settle", type=float, default=10.0, help="seconds after the services start (default 10)")
    p.add_argument("--services-priority", default=None, metavar="PRIO",
                   help="TRANSOM_SERVICE_PRIORITY of the services (batch:N, nice:N, idle, normal; default: "
                        "the variable, else the product's default batch:10)")
    args = p.parse_args()
    from transom.priority import DEFAULT, KEY, parse, read

    if args.services_priority is not None:
        parse(args.services_priority, "--services-priority")
        os.environ[KEY] = args.services_priority
    torch.set_num_threads(1)
    from transom.agents.intake import report
    from transom.stack import LocalStack

    root = Path(tempfile.mkdtemp(prefix="transom-bench-overhead-"))
    stack = LocalStack(root, nodes=args.nodes)
    channels: list = []
    try:
        stack.start_broker()
        agents = stack.start_agents()
        stack.start_tee()
        stack.start_controller()
        os.environ.update(TRANSOM_AGENT_ADDR=agents["node0"], TRANSOM_JOB="overhead", TRANSOM_NODE="node0", RANK="0")
        from transom.elastic import ElasticGroup

        channels += [ElasticGroup("overhead", f"node{i % args.nodes}", 0, stack.bootstrap)
                     for i in range(args.channels)]
        time.sleep(args.settle)
        groups = [pr.popen.pid for pr in stack.procs] + ([stack.broker.proc.pid] if stack.broker else [])
        prio = str(read(stack.procs[0].popen.pid))

        def services(sig: int) -> None:
            for g in groups:
                try:
                    os.killpg(g, sig)
                except ProcessLookupError:
                    pass
        a, b = torch.randn(args.width, args.width), torch.randn(args.width, args.width)
        window(1.0, a, b, report)
        names = {pr.popen.pid: pr.name for pr in stack.procs} | ({stack.broker.proc.pid: "broker"} if stack.broker else {})
        by0: dict = {}
        services_cpu(groups, by0)
        pairs, used, ran = [], 0.0, 0.0
        for i in range(args.rounds):
            c0 = services_cpu(groups)
            on, n_on = window(args.window, a, b, report)
            used += services_cpu(groups) - c0
            ran += on * n_on
            services(signal.SIGSTOP)
            try:
                off, n_off = window(args.window, a, b, report)
            finally:
                services(signal.SIGCONT)
            pairs.append(on / off - 1)
            print(f"pair {i + 1}: step {on * 1e3:.2f} ms with the services running ({n_on} steps), "
                  f"{off * 1e3:.2f} ms stopped ({n_off}): overhead {pairs[-1] * 100:+.1f} %  "
                  f"(load {open('/proc/loadavg').read().split()[0]})", flush=True)
        out = {"bench": "overhead", "nodes": args.nodes, "channels": args.channels,
               "services_priority": os.environ.get(KEY) or DEFAULT,
               "services_at": prio, "window_s": args.window, "pairs": [round(x, 4) for x in pairs],
               "overhead_median": round(statistics.median(pairs), 4), "target": 0.05,
               "services_cpu_per_s": round(used / ran, 4)}
        by1: dict = {}
        services_cpu(groups, by1)
        kinds: dict = {}
        for g, sec in by1.items():
            kind = names.get(g, str(g)).split("-")[0]
            kinds[kind] = kinds.get(kind, 0.0) + sec - by0.get(g, 0.0)
        out["services_cpu_s_by_kind"] = {k: round(v, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
        print(f"services' CPU seconds over the run, by kind: {out['services_cpu_s_by_kind']}", flush=True)
        print(f"the services used {used / ran:.3f} CPU seconds per second while running (2 cores here: "
              f"{used / ran / (os.cpu_count() or 1) * 100:.1f} % of the machine)", flush=True)
        out["met"] = out["overhead_median"] <= out["target"]
        print(json.dumps(out), flush=True)
    finally:
        try:
            services(signal.SIGCONT)
        except NameError:
            pass
        for ch in channels:
            ch.close()
        stack.stop()
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
