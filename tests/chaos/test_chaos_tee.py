"""Chaos around the TEE: skewed node clocks, a flood of malformed metrics, a worker killed mid-stream.

One real broker and one real ``transom tee`` worker (Faust) for the module; metric batches are
published by the test the way agents publish them (keyed by node, one batch per node every half
second, timestamps from each node's own clock), faults are read back from ``transom.faults``.
The worker-kill test runs last: it SIGKILLs the worker and starts a new one.

Promises checked:

- clocks skewed by up to 5 s between nodes: each hard fault (XID, hang, lost node) is found on its
  node, once, with the node's own sample time as ``observed_ts``; no fault on the clean skewed
  nodes; and a node whose clock runs 5 s ahead is found lost as soon as one whose clock runs
  behind (silence is measured on the TEE's clock, not against the node's);
- a flood of thousands of malformed values (bad JSON, wrong schema version, missing fields,
  wrong types) with a real XID in the middle: every one is on ``transom.deadletter`` with its
  reason, and the XID still becomes a fault within 10 s of its sample (a generous bound on a
  shared 2-core machine, not a benchmark);
- a worker SIGKILLed right after it reported a fault, restarted while the nodes go on publishing
  (and another fault happens while it is down): every fault event is on ``transom.faults``
  exactly once (same fault id, one event per node and fault class), none is lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from transom import contracts as c
from transom import kafka
from transom.broker import EmbeddedBroker
from transom.topics import TopicSettings

from util import topic_values, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

HANG_S, HEARTBEAT_S = 3.0, 3.0
PERIOD = 0.5


class TeeWorker:
    """``transom tee`` as a process of the test; :meth:`start` waits until it owns every metrics partition."""

    def __init__(self, bootstrap: str, logfile: Path) -> None:
        self.bootstrap, self.logfile = bootstrap, logfile
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 90.0) -> None:
        mark = self.logfile.stat().st_size if self.logfile.exists() else 0
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRANSOM_LOG_LEVEL": "INFO"}
        with open(self.logfile, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "transom.cli", "tee", "--bootstrap", self.bootstrap,
                 "--hang-timeout", str(HANG_S), "--heartbeat-timeout", str(HEARTBEAT_S)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.starts += 1

        every = list(range(TopicSettings.from_env().partitions_of(c.METRICS)))

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"transom tee exited with {self.proc.returncode}:\n{self.log(mark)[-3000:]}")
            return f"{c.METRICS} partitions {every}" in self.log(mark)

        wait_until(ready, timeout, "the TEE worker to own every metrics partition")

    def log(self, since: int = 0) -> str:
        with open(self.logfile, "rb") as fh:
            fh.seek(since)
            return fh.read().decode(errors="replace")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def broker_tee(tmp_path_factory):
    """A broker of this module's own (its topics start empty) and one TEE worker on it."""
    root = tmp_path_factory.mktemp("chaos-tee")
    broker = EmbeddedBroker(log_path=str(root / "broker.log")).start()
    worker = TeeWorker(broker.bootstrap, root / "tee.log")
    try:
        worker.start()
        yield broker, worker
    finally:
        worker.stop()
        broker.stop()


def gpu(i: int, **extra) -> c.Sample:
    return c.Sample(c.Source.GPU, {c.DCGM.GPU_UTIL: 95.0, c.DCGM.GPU_TEMP: 65.0, c.DCGM.POWER_USAGE: 300.0,
                                   c.DCGM.SM_CLOCK: 1980.0, **extra}, index=i)


class Feed:
    """Publishes one batch per node every ``PERIOD`` from a thread, each node with its clock's offset.

    Per node: two GPUs, one training rank that steps every batch. ``xid(node, gpu, code)`` puts an
    XID sample into the node's next batch; ``lose_gpu`` makes a GPU report GPU_LOST from then on;
    ``freeze`` stops the rank's step (alive: a hang); ``silence`` stops the node's batches, and every
    other rank's step with them (a synchronous job cannot step without a node's ranks: one whose job
    steps on through its silence computes, and only its agent is silent, which is no lost node).
    """

    def __init__(self, bootstrap: str, offsets: dict[str, float], job: str) -> None:
        self.offsets, self.job = offsets, job
        self.producer = kafka.make_producer(bootstrap)
        self.seq = Counter()
        self.step = Counter()
        self.last_ts: dict[str, float] = {}
        self.frozen: set[str] = set()
        self.silent: set[str] = set()
        self.lost: set[tuple[str, int]] = set()
        self.pending: dict[str, list[c.Sample]] = {n: [] for n in offsets}
        self.sent_xids: dict[tuple[str, int, int], float] = {}     # (node, gpu, code) -> sample ts
        self.silenced_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self, node: str) -> float:
        return time.time() + self.offsets[node]

    def xid(self, node: str, gpu_index: int, code: int) -> None:
        with self._lock:
            self.pending[node].append(c.Sample(c.Source.GPU, {c.DCGM.XID_ERRORS: code}, index=gpu_index,
                                               tags={"xid_code": str(code)}))

    def lose_gpu(self, node: str, gpu_index: int) -> None:
        with self._lock:
            self.lost.add((node, gpu_index))

    def freeze(self, node: str) -> None:
        with self._lock:
            self.frozen.add(node)

    def silence(self, *nodes: str) -> None:
        with self._lock:
            for n in nodes:
                self.silent.add(n)
                self.silenced_at[n] = time.time()
            self.frozen.update(self.offsets)

    def _batch(self, node: str, rank: int) -> c.MetricBatch | None:
        with self._lock:
            if node in self.silent:
                return None
            extra, self.pending[node] = self.pending[node], []
            if node not in self.frozen:
                self.step[node] += 1
            lost = {g for n, g in self.lost if n == node}
        ts = self.now(node)
        samples = [gpu(g, **({c.DCGM.GPU_LOST: 1} if g in lost else {})) for g in (0, 1)]
        for s in extra:   # the XID sample carries the node's time of the event
            ts_x = ts - 0.1
            samples.append(c.Sample(c.Source.GPU, dict(s.fields), index=s.index, ts=ts_x))
            self.sent_xids[(node, s.index, int(s.fields[c.DCGM.XID_ERRORS]))] = ts_x
        samples.append(c.Sample(c.Source.TRAIN, {"step": self.step[node], "loss": 2.0, "step_time": PERIOD, "alive": 1},
                                index=rank, ts=ts, tags={"job": self.job, "generation": "0"}))
        batch = c.MetricBatch(node=node, ts=ts, seq=self.seq[node], job=self.job, samples=tuple(samples))
        self.seq[node] += 1
        self.last_ts[node] = ts
        return batch

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            for rank, node in enumerate(self.offsets):
                b = self._batch(node, rank)
                if b is not None:
                    kafka.publish(self.producer, c.METRICS, node, b)
            self.producer.flush(5)
            self._stop.wait(max(0.0, PERIOD - (time.monotonic() - t0)))

    def __enter__(self) -> "Feed":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self.producer.flush(10)


def faults_of(bootstrap: str, nodes) -> list[c.FaultEvent]:
    return [f for f in topic_values(bootstrap, c.FAULTS) if f.node in nodes and not f.resolved]


def classes(faults, node: str) -> list[str]:
    return [f.evidence.get("class", f.kind.value) for f in faults if f.node == node]


# --------------------------------------------------------------------------- restore (pure, no broker)

def test_a_restored_engine_repeats_nothing_its_predecessor_reported():
    from transom.streams.config import TEEConfig
    from transom.streams.engine import TEEEngine

    t0 = 1_700_000_000.0
    cfg = TEEConfig(hang_timeout=3.0, hang_stale_s=2.0, soft_detectors=())

    def b(i, *extra, step=None):     # from step 3 on, the rank's heartbeat stops too (it is stuck)
        train = c.Sample(c.Source.TRAIN, {"step": step if step is not None else i, "alive": 1, "step_time": 0.5,
                                          "heartbeat_age_s": 0 if step is None else i - 3},
                         index=0, tags={"job": "j", "generation": "0"})
        return c.MetricBatch(node="n1", ts=t0 + i, seq=i, job="j", samples=(gpu(0), *extra, train))

    lost = gpu(1, **{c.DCGM.GPU_LOST: 1})
    feed = [b(0), b(1, c.Sample(c.Source.GPU, {c.DCGM.XID_ERRORS: 79}, index=1, ts=t0 + 1)), b(2, lost),
            *[b(3 + i, lost, step=3) for i in range(8)]]
    first = TEEEngine(cfg)
    reported = [f for x in feed for f in first.process(x, now=x.ts + 0.1)]
    assert sorted(f.kind.value for f in reported) == ["gpu_lost", "hang", "xid"]
    # a successor that re-reads from a later offset (the lost GPU and the stall seen first later on)
    # and from an earlier one (the XID batch again) reports nothing new once it has restored them
    again = TEEEngine(cfg)
    assert again.restore(reported, now=t0 + 10) == 3
    assert [f for x in feed[1:2] + feed[5:] for f in again.process(x, now=t0 + 10)] == []
    fresh = TEEEngine(cfg)   # without restore: the XID again (same id), the lost GPU and the hang with new ids
    repeated = [f for x in feed[1:2] + feed[5:] for f in fresh.process(x, now=t0 + 10)]
    assert sorted(f.kind.value for f in repeated) == ["gpu_lost", "hang", "xid"]
    assert len({f.fault_id for f in repeated} & {f.fault_id for f in reported}) == 1
    # a new condition is still reported: another GPU lost
    later = [c.MetricBatch(node="n1", ts=t0 + 20 + i, seq=20 + i, job="j", samples=(gpu(0, **{c.DCGM.GPU_LOST: 1}),))
             for i in range(2)]
    assert [f.evidence["gpu"] for x in later for f in again.process(x, now=x.ts)] == [0]


# --------------------------------------------------------------------------- clocks skewed by up to 5 s

def test_skewed_clocks_faults_found_on_the_right_node_once_and_no_false_alarm(broker_tee):
    broker, worker = broker_tee
    bs = broker.bootstrap
    offsets = {"sk-m5": -5.0, "sk-m2": -2.0, "sk-0": 0.0, "sk-p2": 2.0, "sk-p5": 5.0}
    nodes = set(offsets)
    with Feed(bs, offsets, "skew-job") as feed:
        time.sleep(2.0)                     # a clean stretch on every node first
        feed.xid("sk-m5", 1, 79)            # the node 5 s behind: an XID
        feed.freeze("sk-p5")                # the node 5 s ahead: its rank hangs
        wait_until(lambda: classes(faults_of(bs, nodes), "sk-p5"), 30, "the hang on the node 5 s ahead")
        # one node behind and one ahead fall silent together: each must be found lost, at the same time
        feed.silence("sk-m2", "sk-p5")
        wait_until(lambda: sum(k == "node_lost" for k in (f.kind.value for f in faults_of(bs, nodes))) >= 2, 30,
                   "both silent nodes to be found lost")
        time.sleep(2.0)                     # a false alarm on the live skewed nodes, or a repeat, would be here now
        found = faults_of(bs, nodes)
    assert classes(found, "sk-m5") == ["xid"]
    assert classes(found, "sk-p5") == ["hang", "node_lost"]
    assert classes(found, "sk-m2") == ["node_lost"]
    assert classes(found, "sk-0") == [] and classes(found, "sk-p2") == []       # clean, skewed or not
    by = {(f.node, f.kind.value): f for f in found}
    xid = by[("sk-m5", "xid")]
    assert xid.observed_ts == feed.sent_xids[("sk-m5", 1, 79)] and xid.evidence["gpu"] == 1   # the node's own time
    hang = by[("sk-p5", "hang")]
    assert hang.rank == 4 and hang.job == "skew-job"
    ahead, behind = by[("sk-p5", "node_lost")], by[("sk-m2", "node_lost")]
    assert ahead.observed_ts == feed.last_ts["sk-p5"] and behind.observed_ts == feed.last_ts["sk-m2"]
    # silence is measured on the TEE's clock: 7 s apart clocks, the same silence, the same verdict
    # (the timer checks once a second; with sample time against the TEE's clock they would be ~7 s apart)
    assert abs(ahead.detected_ts - behind.detected_ts) < 2.5, (ahead.detected_ts, behind.detected_ts)
    for f in (ahead, behind):
        assert HEARTBEAT_S - PERIOD < f.detected_ts - feed.silenced_at[f.node] < HEARTBEAT_S + 10


# --------------------------------------------------------------------------- a flood of malformed messages

def _malformed(i: int, now: float) -> bytes:
    tag = f"flood-{i:05d}"
    kind = i % 6
    if kind == 0:
        return f'{{"v": 1, "node": "{tag}", "ts": {now}, "seq": '.encode()               # truncated JSON
    if kind == 1:
        return json.dumps({"v": 2, "node": tag, "ts": now, "seq": i, "samples": []}).encode()   # future schema
    if kind == 2:
        return json.dumps({"v": 1, "ts": now, "seq": i, "samples": [], "tag": tag}).encode()    # no node
    if kind == 3:
        return json.dumps({"v": 1, "node": tag, "ts": now, "seq": i}).encode()                  # no samples
    if kind == 4:
        return json.dumps({"v": 1, "node": tag, "ts": now, "seq": i, "samples": [
            {"source": "gpu", "index": 0, "fields": {c.DCGM.GPU_TEMP: "hot"}}]}).encode()       # a string metric
    return json.dumps([tag, now]).encode()                                                     # not an object


_REASONS = {0: "not JSON", 1: "schema version 2", 2: "missing required field 'node'",
            3: "missing required field 'samples'", 4: "must be a number", 5: "must be a JSON object"}


def test_flood_of_malformed_metrics_is_dead_lettered_and_an_xid_in_it_is_still_found(broker_tee):
    broker, worker = broker_tee
    bs = broker.bootstrap
    n = 3000
    producer = kafka.make_producer(bs)
    now = time.time()
    xid_node, xid_ts = "fl-xid", None
    for i in range(n):
        if i == n // 2:   # the real fault, in the middle of the flood
            xid_ts = time.time()
            batch = c.MetricBatch(node=xid_node, ts=xid_ts, seq=0, job="flood-job", samples=(
                gpu(0), c.Sample(c.Source.GPU, {c.DCGM.XID_ERRORS: 79}, index=1, ts=xid_ts)))
            kafka.publish(producer, c.METRICS, xid_node, batch)
        key = f"fl-{i % 8}".encode()       # spread over every partition
        kafka.produce(producer, c.METRICS, key, _malformed(i, now))
    assert producer.flush(30) == 0
    # (the node then falls silent: its node_lost later on is the heartbeat rule doing its job)
    [f] = wait_until(lambda: [f for f in faults_of(bs, {xid_node}) if f.kind == c.FaultKind.XID], 60,
                     "the XID fault in the flood")
    latency = f.detected_ts - f.observed_ts
    assert f.observed_ts == xid_ts and f.evidence["xid"] == 79 and f.evidence["gpu"] == 1
    assert latency < 10.0, f"the XID took {latency:.1f}s from its sample to its fault event"

    def letters():
        got = [d for d in topic_values(bs, c.DEADLETTER) if "flood-" in d.value]
        return got if len(got) >= n else None

    got = wait_until(letters, 90, f"all {n} malformed values on {c.DEADLETTER}", interval=1.0)
    by_tag = {}
    for d in got:
        tag = d.value[d.value.index("flood-"):][:11]
        assert tag not in by_tag, f"{tag} dead-lettered twice"
        by_tag[tag] = d
    assert sorted(by_tag) == [f"flood-{i:05d}" for i in range(n)]
    for tag, d in by_tag.items():
        i = int(tag[6:])
        assert _REASONS[i % 6] in d.reason, (tag, d.reason)
        assert (d.topic, d.component) == (c.METRICS, "tee") and d.partition is not None and d.offset is not None
    assert not [d for d in topic_values(bs, c.DEADLETTER) if xid_node in d.value]
    print(f"flood of {n}: the XID took {latency:.2f}s from sample to fault event")


# --------------------------------------------------------------------------- the worker killed mid-stream

def test_worker_killed_and_restarted_loses_no_fault_and_duplicates_none(broker_tee):
    broker, worker = broker_tee
    bs = broker.bootstrap
    offsets = {"kl-0": 0.0, "kl-1": 0.0, "kl-2": 0.0}
    nodes = set(offsets)
    with Feed(bs, offsets, "kill-job") as feed:
        time.sleep(1.5)
        feed.xid("kl-1", 0, 79)               # GPU 0 falls off the bus, and is lost from then on
        feed.lose_gpu("kl-1", 0)
        wait_until(lambda: "xid" in classes(faults_of(bs, nodes), "kl-1"), 30, "the XID 79 fault")
        worker.kill()                         # right after it reported: its offsets are not committed yet
        feed.xid("kl-2", 1, 74)               # a fault while no worker runs
        time.sleep(2.0)
        worker.start()
        wait_until(lambda: "xid" in classes(faults_of(bs, nodes), "kl-2"), 60, "the fault that happened while down")
        feed.xid("kl-1", 1, 13)               # a marker: once it is reported, kl-1's backlog has been seen again
        wait_until(lambda: len([f for f in faults_of(bs, nodes) if f.node == "kl-1" and f.evidence.get("xid") == 13]),
                   30, "the marker XID 13")
        feed.xid("kl-0", 1, 13)
        wait_until(lambda: "xid" in classes(faults_of(bs, nodes), "kl-0"), 30, "the marker XID 13 of kl-0")
        time.sleep(1.0)
        found = faults_of(bs, nodes)
        last = dict(feed.last_ts)
    ids = Counter(f.fault_id for f in found)
    assert [i for i, k in ids.items() if k > 1] == [], "a fault event was sent twice"
    # node_lost only for the silence after the feed stopped (observed at the node's last batch)
    live = [f for f in found if not (f.kind == c.FaultKind.NODE_LOST and f.observed_ts >= last[f.node])]
    assert sorted(classes(live, "kl-1")) == ["gpu_lost", "xid", "xid"]
    assert sorted((f.evidence.get("xid"), f.evidence.get("gpu")) for f in live
                  if f.node == "kl-1" and f.kind == c.FaultKind.XID) == [(13, 1), (79, 0)]
    assert [(f.evidence.get("xid"), f.evidence.get("gpu")) for f in live if f.node == "kl-2"] == [(74, 1)]
    assert [f.evidence.get("xid") for f in live if f.node == "kl-0"] == [13]
    xid79 = next(f for f in live if f.evidence.get("xid") == 79)
    assert xid79.observed_ts == feed.sent_xids[("kl-1", 0, 79)]
    assert worker.starts == 2 and "fault(s) already on transom.faults" in worker.log()
