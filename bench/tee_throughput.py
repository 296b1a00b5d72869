"""bench/tee_throughput: how fast real TEE workers drain a backlog, per worker and per CPU-second,
and the end-to-end latency at a steady rate.

Each run starts its own embedded broker (topics as configured: ``transom.metrics`` has 12 partitions
by default, ``TRANSOM_TOPIC_PARTITIONS``) and ``transom tee`` worker processes with peer detection on
(the workers' default: each node belongs to a job of 20 nodes, so the workers also send their nodes'
windows and rank reports to ``transom.peer-windows`` and judge their jobs' hangs and peers from there).
Node batches are realistic (8 GPUs, 2 IB ports, a train and a host sample; ``--nodes`` nodes reporting
once a second of sample time) and encoded before any timing starts.

**Drain** (``--workers``, default 1, 2 and 4): the backlog (``--backlog`` batches) is published and
flushed *before* the workers start; then they start, join, and read it. Every ``MARK_EVERY``-th batch
is a marker: a batch of a node of its own carrying an XID 79, whose fault event's ``detected_ts`` says
when its worker reached that offset of its partition (the producer's delivery reports give the
offsets; the last batch of every partition is a marker). The rate is measured from the moment every
worker holds its partitions (the group is settled) for ``--window`` seconds or until the backlog is
drained, whichever comes first; the default backlog (200,000 batches) lasts longer than the window
here, so the window does not end in the drain's tail, where a worker whose partitions ran dry idles
while another still works (with 60,000 the two-worker window lasted 6-7 s and the ratio moved
between 1.57 and 2.03 from run to run) (the bench itself sleeps meanwhile and reads the markers' faults once, after
the window: a reader polling ``transom.faults`` would take CPU from the workers when they are as many
as the cores): batches processed in that window (per partition, interpolated
between its markers; a partition not yet begun when the window opens counts from its start, so the
figure is off by less than ``MARK_EVERY`` batches a partition) over its length. The workers' CPU time
over the same window (user + system of the worker processes and their children, from
``/proc/PID/stat``, sampled every 0.2 s) gives batches per worker-CPU-second, the figure that compares
worker counts fairly on a machine whose cores are shared with other work.

**Paced** (``--paced``, default 2,000 batches/s per worker, ``--paced-workers`` 1): once the workers
hold their partitions, batches are published at the steady rate for ``--paced-seconds``; each marker's
XID sample time is the wall clock when it is published, so ``detected_ts - observed_ts`` is the
end-to-end latency (publish, broker, worker decode and rules, fault publish). p50 / p99 / max of it,
and whether the worker kept up (the last marker decided within the latency target).

Targets (issue 18): two workers drain at least 1.8x one; batches per worker-CPU-second with the most
workers at least 0.8x one worker's; p99 at most 2 s at 2,000 batches/s per worker. On a shared
machine the wall-rate ratios follow what else runs: the load average and the machine's busy share
are printed with every run; compare the CPU figures there.

Run: ``.venv/bin/python bench/tee_throughput.py`` (about 3-4 minutes on 2 cores) or ``--quick``
(about 2 minutes: a shorter window and paced run); one JSON line on stdout, a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import orjson

from transom import contracts as c
from transom import kafka
from transom.broker import EmbeddedBroker
from transom.topics import TopicSettings

MARK_EVERY = 50
TARGET_RATE = 2000.0
TARGET_P99_S = 2.0
TARGET_TWO_TO_ONE = 1.8          # two workers drain at least this many times one worker's rate
TARGET_CPU_EFFICIENCY = 0.8      # the most workers: batches per worker-CPU-second at least this share of one's
WINDOW_SLACK_S = 3.0             # drain: the markers are read this long after the window closes
_TICK = os.sysconf("SC_CLK_TCK")


def node_batch(node: str, ts: float, seq: int, rng, xid: bool = False) -> c.MetricBatch:
    samples = []
    for g in range(8):
        samples.append(c.Sample(c.Source.GPU, {
            c.DCGM.GPU_UTIL: float(round(rng.normal(93, 2))), c.DCGM.GPU_TEMP: float(round(rng.normal(62, 1))),
            c.DCGM.POWER_USAGE: round(float(rng.normal(540, 12)), 1), c.DCGM.SM_CLOCK: float(1980 - int(abs(rng.normal(0, 20)))),
            c.DCGM.FB_USED: 71000.0, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0.0, c.DCGM.ECC_DBE_VOL_TOTAL: 0.0,
            "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0.0}, index=g))
    if xid:
        samples.append(c.Sample(c.Source.GPU, {c.DCGM.XID_ERRORS: 79.0}, index=0, ts=ts))
    for p in range(2):
        samples.append(c.Sample(c.Source.NIC, {"link_up": 1.0, "state": 4.0, "phys_state": 5.0, "symbol_error_per_s": 0.0,
                                               "port_rcv_errors_per_s": 0.0, "port_rcv_bytes_per_s": 4e10},
                                index=1, tags={"device": f"mlx5_{p}", "port": "1", "kind": "ib"}))
    samples.append(c.Sample(c.Source.TRAIN, {"step": float(seq), "step_time": 1.0, "loss": 2.0, "alive": 1.0,
                                             "heartbeat_age_s": 0.2},
                            index=0, tags={"job": f"job-{node[-2:]}", "generation": "0"}))
    samples.append(c.Sample(c.Source.HOST, {"cpu_percent": 30.0}))
    return c.MetricBatch(node=node, ts=ts, seq=seq, job=f"job-{node[-2:]}", samples=tuple(samples))


def start_workers(bootstrap: str, n: int, logdir: str,
                  args: tuple[str, ...] = ("--heartbeat-timeout", "600")) -> list[subprocess.Popen]:
    """Start ``n`` ``transom tee`` workers with ``args``; return once each holds partitions."""
    procs = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRANSOM_LOG_LEVEL": "INFO"}
    for i in range(n):
        log = open(os.path.join(logdir, f"tee{i}.log"), "wb")
        procs.append(subprocess.Popen([sys.executable, "-m", "transom.cli", "tee", "--bootstrap", bootstrap,
                                       *args], stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env))
        procs[-1].logpath = log.name
    deadline = time.time() + 180
    while time.time() < deadline:
        texts = [open(p.logpath).read() for p in procs]
        if all("TEE assigned" in t for t in texts) and all(p.poll() is None for p in procs):
            # with several workers, wait for the rebalance to settle (each assigned something non-empty)
            if n == 1 or all("partitions [" in t and "partitions []" not in t.split("TEE assigned")[-1] for t in texts):
                return procs
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a TEE worker exited: " + open(procs[0].logpath).read()[-2000:])
        time.sleep(0.2)
    raise RuntimeError("TEE workers did not join in 180 s")


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def kill(procs) -> None:
    """The bench's workers: nothing of theirs is kept, so no graceful stop to wait for."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) of ``pid``, its reaped children, and its live descendants."""
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / _TICK      # utime stime cutime cstime
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return total


def _machine_busy() -> tuple[float, float]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return float(sum(v) - idle), float(sum(v))


class CpuClock:
    """Samples the workers' CPU seconds every ``every`` s in a thread: ``at(t)`` interpolates."""

    def __init__(self, pids: list[int], every: float = 0.2) -> None:
        self.pids, self.every, self.samples = pids, every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), sum(_cpu_of(p) for p in self.pids), *_machine_busy()))
            self._stop.wait(self.every)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float, column: int = 1) -> float:
        s = np.array(self.samples)
        return float(np.interp(t, s[:, 0], s[:, column]))

    def busy_share(self, t0: float, t1: float) -> float:
        busy, total = self.at(t1, 2) - self.at(t0, 2), self.at(t1, 3) - self.at(t0, 3)
        return round(100.0 * busy / total, 1) if total else 0.0


def encode_batches(count: int, nodes: int, base: float) -> list[tuple[str, bytes]]:
    """``count`` node batches, ``nodes`` nodes reporting once a second from ``base``, encoded (the training
    step moves on every second; the GPU values vary per node). Each node's batch is made into its JSON
    object once; each second changes its time, sequence number and step, and orjson writes it."""
    rng = np.random.default_rng(0)
    names = [f"node{i:05d}" for i in range(nodes)]
    template = {name: json.loads(c.encode(node_batch(name, base, 0, rng))) for name in names}
    out = []
    for i in range(count):
        name, sec = names[i % nodes], i // nodes
        d = template[name]
        d["ts"], d["seq"] = base + sec, sec
        d["samples"][-2]["fields"]["step"] = float(sec)     # the train sample
        out.append((name, orjson.dumps(d)))
    return out


def marker(node: str, ts: float) -> bytes:
    """A batch of a node of its own with an XID 79 sampled at ``ts``: its fault event says when it was read."""
    return c.encode(c.MetricBatch(node=node, ts=ts, seq=0, samples=(
        c.Sample(c.Source.GPU, {c.DCGM.XID_ERRORS: 79.0}, index=0, ts=ts),)))


def encode_backlog(batches: int, nodes: int) -> list[tuple[str, bytes]]:
    """``batches`` node batches; every MARK_EVERY-th a marker."""
    base = time.time() - 3600
    out = encode_batches(batches, nodes, base)
    for i in range(MARK_EVERY - 1, batches, MARK_EVERY):
        out[i] = (f"mark{i:07d}", marker(f"mark{i:07d}", base + i // nodes))
    return out


def _markers(bootstrap: str, want: set[str]) -> dict[str, float]:
    """node -> detected_ts of the markers' XID faults found on transom.faults so far."""
    found = {}
    for _k, v, _p, _o in kafka.read_topic(bootstrap, c.FAULTS, timeout=30):
        f = c.decode(c.FAULTS, v)
        if f.node in want and f.evidence.get("xid") == 79:
            found[f.node] = f.detected_ts
    return found


def drain(workers: int, backlog: list[tuple[str, bytes]], window: float) -> dict:
    """Publish ``backlog``, then start ``workers`` and measure the rate they drain it at."""
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as logdir:
        bootstrap = broker.bootstrap
        kafka.ensure_topics(bootstrap)
        where: dict[str, tuple[int, int]] = {}           # marker node -> (partition, offset)
        ends: dict[int, int] = {}                          # partition -> offset of its last batch

        def delivered(err, msg) -> None:
            if err is None:
                ends[msg.partition()] = max(ends.get(msg.partition(), -1), msg.offset())
                if msg.key().startswith(b"mark"):
                    where[msg.key().decode()] = (msg.partition(), msg.offset())

        producer = kafka.make_producer(bootstrap, **{"linger.ms": 50, "batch.num.messages": 10000})
        t = time.time()
        for i, (node, value) in enumerate(backlog):
            kafka.produce(producer, c.METRICS, node, value, on_delivery=delivered)
            if i % 2000 == 0:
                producer.poll(0)
        for p in range(TopicSettings.from_env().partitions_of(c.METRICS)):   # every partition ends with a marker
            node = f"mark-end{p:03d}"
            producer.produce(c.METRICS, key=node.encode(), partition=p, on_delivery=delivered,
                             value=marker(node, time.time() - 1800))
        producer.flush(120)
        publish_s = time.time() - t
        t = time.time()
        procs = start_workers(bootstrap, workers, logdir)
        clock = CpuClock([p.pid for p in procs])
        try:
            settled = time.time()
            join_s = settled - t
            # nothing of the bench runs while the workers drain: reading transom.faults (a consumer,
            # watermarks, every fault decoded) takes CPU the workers would get, and with as many busy
            # workers as cores it comes out of theirs alone. The markers' detected_ts say when each
            # was reached, so they are read once, after the window.
            time.sleep(max(0.0, settled + window + WINDOW_SLACK_S - time.time()))
            load = os.getloadavg()[0]
            found = _markers(bootstrap, set(where))
        finally:
            clock.close()
            kill(procs)
    # per partition: offsets reached over time, from its markers. A partition whose first marker was
    # decided after the window opened counts as started then, at 0 (off by less than MARK_EVERY batches);
    # one with no marker decided counts as not started
    points: dict[int, list[tuple[float, int]]] = {}
    for m, ts in found.items():
        p, o = where[m]
        points.setdefault(p, []).append((ts, o))
    if not points:
        raise RuntimeError("no marker decided: the workers processed nothing")
    start = settled
    for p in points:
        points[p].sort()
        if points[p][0][0] > start:
            points[p].insert(0, (start, 0))
    finish = max(ts for pts in points.values() for ts, _ in pts)
    end = min(finish, start + window)

    def reached(p: int, t: float) -> float:
        ts, offs = zip(*points[p])
        return float(np.interp(t, ts, offs))       # flat after the partition's last marker decided

    processed = sum(reached(p, end) - reached(p, start) for p in points)
    span = end - start
    cpu = clock.at(end) - clock.at(start)
    return {"workers": workers, "backlog": len(backlog), "publish_s": round(publish_s, 1), "join_s": round(join_s, 1),
            "window_s": round(span, 1), "processed": int(processed),
            "drained": all(any(where[m] == (p, max(o for q, o in where.values() if q == p)) for m in found) for p in ends),
            "partitions_started": len(points),
            "batches_per_s": round(processed / span, 1) if span > 0 else None,
            "worker_cpu_s": round(cpu, 2), "batches_per_worker_cpu_s": round(processed / cpu, 1) if cpu > 0 else None,
            "worker_cpu_share_percent": round(100 * cpu / span / (os.cpu_count() or 1), 1) if span > 0 else None,
            "machine_busy_percent": clock.busy_share(start, end), "load1_end": round(load, 1)}


def paced(workers: int, rate: float, seconds: float, nodes: int) -> dict:
    """Publish at ``rate`` batches/s for ``seconds`` to ``workers`` already holding their partitions."""
    total = int(rate * seconds)
    payload = encode_batches(total, nodes, time.time() - 60)
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as logdir:
        bootstrap = broker.bootstrap
        kafka.ensure_topics(bootstrap)
        procs = start_workers(bootstrap, workers, logdir)
        clock = CpuClock([p.pid for p in procs])
        try:
            time.sleep(2.0)                   # the first fetches of an empty topic
            producer = kafka.make_producer(bootstrap, **{"linger.ms": 5})
            marks: list[str] = []
            t0 = time.time()
            for i, (node, value) in enumerate(payload):
                if i % 100 == 0:
                    ahead = t0 + i / rate - time.time()
                    if ahead > 0:
                        time.sleep(ahead)
                    producer.poll(0)
                if i % MARK_EVERY == MARK_EVERY - 1:
                    node = f"mark{i:07d}"
                    value = marker(node, time.time())
                    marks.append(node)
                kafka.produce(producer, c.METRICS, node, value)
            producer.flush(60)
            t_pub = time.time()
            want, found = set(marks), {}
            deadline = t_pub + 120
            while time.time() < deadline and len(found) < len(want):
                time.sleep(1.0)
                found = {n: (ts, f) for n, ts, f in _marker_faults(bootstrap, want)}
            load = os.getloadavg()[0]
        finally:
            clock.close()
            kill(procs)
    lat = np.array([f.detected_ts - f.observed_ts for _ts, f in found.values()])
    last = max((ts for ts, _f in found.values()), default=t_pub)
    cpu = clock.at(last) - clock.at(t0)
    return {"workers": workers, "rate": rate, "batches": total, "markers": len(marks), "markers_found": len(found),
            "publish_s": round(t_pub - t0, 1), "published_per_s": round(total / (t_pub - t0), 1),
            "last_decided_after_publish_s": round(last - t_pub, 2),
            "latency_p50_s": round(float(np.percentile(lat, 50)), 3) if len(lat) else None,
            "latency_p99_s": round(float(np.percentile(lat, 99)), 3) if len(lat) else None,
            "latency_max_s": round(float(lat.max()), 3) if len(lat) else None,
            "worker_cpu_s": round(cpu, 2), "batches_per_worker_cpu_s": round(total / cpu, 1) if cpu > 0 else None,
            "machine_busy_percent": clock.busy_share(t0, last), "load1_end": round(load, 1)}


def _marker_faults(bootstrap: str, want: set[str]):
    for _k, v, _p, _o in kafka.read_topic(bootstrap, c.FAULTS, timeout=30):
        f = c.decode(c.FAULTS, v)
        if f.node in want and f.evidence.get("xid") == 79:
            yield f.node, f.detected_ts, f


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="1,2,4", help="worker counts of the drain runs (default 1,2,4)")
    p.add_argument("--backlog", type=int, default=200000, help="batches published before the workers start")
    p.add_argument("--window", type=float, default=20.0, help="seconds the drain rate is measured over (at most)")
    p.add_argument("--nodes", type=int, default=2000, help="nodes (jobs of 20), one batch a second each")
    p.add_argument("--paced", type=float, default=TARGET_RATE,
                   help=f"batches/s per worker of the paced run (default {TARGET_RATE:g}, the target; 0: skip it)")
    p.add_argument("--paced-workers", type=int, default=1, help="workers of the paced run (default 1)")
    p.add_argument("--paced-seconds", type=float, default=30.0, help="length of the paced run (default 30)")
    p.add_argument("--quick", action="store_true",
                   help="a quick look (about 2 minutes): --backlog 40000 --window 10 --paced-seconds 15")
    a = p.parse_args(argv)
    if a.quick:
        a.backlog, a.window, a.paced_seconds = min(a.backlog, 40000), min(a.window, 10.0), min(a.paced_seconds, 15.0)
    counts = sorted({int(n) for n in a.workers.split(",")} | {1})
    partitions = TopicSettings.from_env().partitions_of(c.METRICS)
    if partitions < max(counts):
        p.error(f"{c.METRICS} has {partitions} partitions: fewer than {max(counts)} workers (TRANSOM_TOPIC_PARTITIONS)")
    t0 = time.time()
    load0 = os.getloadavg()[0]
    backlog = encode_backlog(a.backlog, a.nodes)
    print(f"{len(backlog)} batches encoded in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    runs: dict[int, dict] = {}
    for n in counts:
        t = time.time()
        runs[n] = drain(n, backlog, a.window)
        print(f"drain, {n} worker(s), {time.time() - t:.0f} s: {runs[n]}", file=sys.stderr, flush=True)
    steady = None
    if a.paced:
        steady = paced(a.paced_workers, a.paced * a.paced_workers, a.paced_seconds, a.nodes)
        print(f"paced: {steady}", file=sys.stderr, flush=True)
    one = runs[1]
    rate, eff1 = one["batches_per_s"] or 0.0, one["batches_per_worker_cpu_s"] or 0.0
    scaling = {n: {"batches_per_s": r["batches_per_s"],
                   "wall_ratio": round((r["batches_per_s"] or 0) / max(rate, 1e-9), 3),
                   "batches_per_worker_cpu_s": r["batches_per_worker_cpu_s"],
                   "cpu_efficiency": round((r["batches_per_worker_cpu_s"] or 0) / max(eff1, 1e-9), 3),
                   "machine_busy_percent": r["machine_busy_percent"], "load1_end": r["load1_end"]}
               for n, r in runs.items()}
    print(f"drain of a pre-loaded {c.METRICS} ({partitions} partitions, peer and hang repartition on), "
          f"{os.cpu_count()} cores, load average {load0:.1f} at the start:", file=sys.stderr)
    print("  workers  batches/s  x one  batches/worker-CPU-s  x one  machine busy %  load1 (end)", file=sys.stderr)
    for n, s in scaling.items():
        print(f"  {n:7d}  {s['batches_per_s'] or 0:9.0f}  {s['wall_ratio']:5.2f}  {s['batches_per_worker_cpu_s'] or 0:20.0f}"
              f"  {s['cpu_efficiency']:5.2f}  {s['machine_busy_percent']:14.1f}  {s['load1_end']:5.1f}", file=sys.stderr)
    if steady:
        print(f"  paced {steady['rate']:.0f}/s to {steady['workers']} worker(s): latency p50 {steady['latency_p50_s']} s, "
              f"p99 {steady['latency_p99_s']} s, max {steady['latency_max_s']} s; "
              f"{steady['batches_per_worker_cpu_s']} batches/worker-CPU-s", file=sys.stderr)
    two, most = scaling.get(2), scaling[max(counts)]
    p99 = steady and steady["latency_p99_s"]
    out = {"bench": "tee_throughput", "partitions": partitions, "peer_detection": True, "cores": os.cpu_count(),
           "load1_start": round(load0, 1), "drain": {str(n): r for n, r in runs.items()},
           "scaling": {str(n): s for n, s in scaling.items()}, "paced": steady,
           "targets": {
               "two_workers_wall_ratio": {"value": two and two["wall_ratio"], "target": TARGET_TWO_TO_ONE,
                                          "met": bool(two and two["wall_ratio"] >= TARGET_TWO_TO_ONE)},
               "cpu_efficiency_most_workers": {"workers": max(counts), "value": most["cpu_efficiency"],
                                               "target": TARGET_CPU_EFFICIENCY,
                                               "met": most["cpu_efficiency"] >= TARGET_CPU_EFFICIENCY},
               "one_worker_batches_per_cpu_s": {"value": eff1, "target": TARGET_RATE, "met": eff1 >= TARGET_RATE},
               "latency_p99_s_paced": {"value": p99, "target": TARGET_P99_S,
                                       "at_rate_per_worker": a.paced or None,
                                       "met": bool(p99 is not None and p99 <= TARGET_P99_S)}},
           "note": ("drain: the backlog is published before the workers start; the rate is taken once every "
                    "worker holds its partitions, from the markers' decision times. On a machine shared with other "
                    "work the wall ratios follow the cores the workers got: compare batches_per_worker_cpu_s"),
           "seconds": round(time.time() - t0, 1)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
