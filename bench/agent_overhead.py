"""Agent overhead: CPU seconds per second and RSS of one `transom agent` process.

Setup: an embedded broker; one agent at 1 Hz with 8 simulated GPUs, the host and NIC collectors
(this machine's /sys), the training collector fed by a real training-side process that calls
``report()`` 10 times a second, and the self-metrics. After a warm-up the agent's CPU time
(user + system) is measured over a window and its RSS sampled every second (the maximum is
reported). The peer run in the same process tree is a bare Python interpreter that imports what
the agent cannot do without (confluent_kafka, psutil, pynvml): the floor any Python agent pays.

Targets (docs/agent.md): at most 1% of one core, at most 80 MB RSS. Prints progress to stderr
and ONE JSON line to stdout. Runs in about 90 s (``--window`` 60 by default).

    .venv/bin/python bench/agent_overhead.py [--window 60] [--warmup 10]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import psutil

from transom import contracts
from transom.broker import EmbeddedBroker, free_udp_port
from transom.kafka import read_topic

CPU_TARGET = 0.01      # of one core
RSS_TARGET_MB = 80.0

TRAINER = r"""
import time
from transom.agents.intake import report
step = 0
while True:
    report(step=step, loss=2.0 / (1 + step) ** 0.5, tokens_per_s=250000.0, step_time=0.1, grad_norm=1.0)
    step += 1
    time.sleep(0.1)
"""

FLOOR = "import confluent_kafka, psutil, pynvml, sys, time; print('ready', flush=True); time.sleep(3600)"


def say(msg: str) -> None:
    print(f"[agent_overhead] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=float, default=60.0, help="seconds of measurement (default 60)")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring (default 10)")
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRANSOM_LOG_LEVEL": "WARNING"}
    procs: list[subprocess.Popen] = []
    with EmbeddedBroker() as broker:
        try:
            port = free_udp_port()            # the agent's intake is UDP
            agent = subprocess.Popen(
                [sys.executable, "-m", "transom.cli", "agent", "--node", "bench", "--gpu-source", "simulated",
                 "--gpus", str(args.gpus), "--interval", "1", "--intake-port", str(port), "--bootstrap", broker.bootstrap],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            procs.append(agent)
            first = agent.stdout.readline()
            if not first.startswith("agent bench"):
                raise SystemExit(f"agent did not start: {first!r}")
            trainer = subprocess.Popen([sys.executable, "-c", TRAINER], stdin=subprocess.DEVNULL,
                                       env={**env, "TRANSOM_AGENT_ADDR": f"127.0.0.1:{port}", "TRANSOM_NODE": "bench",
                                            "TRANSOM_JOB": "bench-job", "RANK": "0"})
            procs.append(trainer)
            floor = subprocess.Popen([sys.executable, "-c", FLOOR], stdout=subprocess.PIPE, text=True)
            procs.append(floor)
            floor.stdout.readline()
            say(f"agent pid {agent.pid} with {args.gpus} simulated GPUs at 1 Hz; warming up {args.warmup:.0f}s")
            time.sleep(args.warmup)
            p = psutil.Process(agent.pid)
            t0, c0 = time.monotonic(), p.cpu_times()
            rss = []
            while time.monotonic() - t0 < args.window:
                time.sleep(1.0)
                rss.append(p.memory_info().rss)
                if len(rss) % 15 == 0:
                    say(f"{len(rss)}s of {args.window:.0f}s, RSS {rss[-1] / 2**20:.1f} MB")
            t1, c1 = time.monotonic(), p.cpu_times()
            cpu = ((c1.user - c0.user) + (c1.system - c0.system)) / (t1 - t0)
            uss = p.memory_full_info().uss
            floor_rss = psutil.Process(floor.pid).memory_info().rss
            agent.send_signal(signal.SIGTERM)
            agent.wait(30)
            node_batches = [contracts.decode(contracts.METRICS, v) for k, v, _p, _o in
                            read_topic(broker.bootstrap, contracts.METRICS) if k == b"bench"]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
    seqs = [b.seq for b in node_batches]
    gpus_seen = max((len(b.of(contracts.Source.GPU)) for b in node_batches), default=0)
    train_seen = sum(1 for b in node_batches if b.of(contracts.Source.TRAIN))
    rss_mb = max(rss) / 2**20
    out = {
        "bench": "agent_overhead", "gpus": args.gpus, "interval_s": 1.0, "window_s": round(t1 - t0, 1),
        "collectors": "host,gpu,nic,train,agent",
        "cpu_core_fraction": round(cpu, 5), "cpu_target": CPU_TARGET,
        "cpu_ratio_to_target": round(cpu / CPU_TARGET, 3), "cpu_met": cpu <= CPU_TARGET,
        "rss_mb": round(rss_mb, 1), "uss_mb": round(uss / 2**20, 1), "rss_target_mb": RSS_TARGET_MB,
        "rss_ratio_to_target": round(rss_mb / RSS_TARGET_MB, 3), "rss_met": rss_mb <= RSS_TARGET_MB,
        "peer_python_floor_rss_mb": round(floor_rss / 2**20, 1),
        "rss_ratio_to_floor": round(rss_mb / (floor_rss / 2**20), 2),
        "batches": len(seqs), "seq_gapless": seqs == list(range(len(seqs))), "gpus_per_batch": gpus_seen,
        "batches_with_train": train_seen,
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
