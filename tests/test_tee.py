"""TEE: the engine's rules and ECOD detector (pure), then a real `transom tee` worker on the broker."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from transom import contracts as c
from transom import kafka
from transom.config import ConfigError
from transom.streams.config import TEEConfig
from transom.streams.engine import TEEEngine
from util import topic_values, wait_until

T0 = 1_700_000_000.0


# --------------------------------------------------------------------------- builders

def gpu(i: int, util=95.0, temp=65.0, power=300.0, clock=1980.0, **extra) -> c.Sample:
    fields = {c.DCGM.GPU_UTIL: util, c.DCGM.GPU_TEMP: temp, c.DCGM.POWER_USAGE: power,
              c.DCGM.SM_CLOCK: clock, c.DCGM.FB_USED: 40000.0}
    return c.Sample(c.Source.GPU, {**fields, **extra}, index=i)


def train(rank: int, step: int, *, job="job1", generation=0, alive=1, step_time=0.1, **fields) -> c.Sample:
    return c.Sample(c.Source.TRAIN, {"step": step, "loss": 2.0, "tokens_per_s": 1e4, "step_time": step_time,
                                     "alive": alive, **fields}, index=rank,
                    tags={"job": job, "generation": str(generation), "pid": "4242"})


def batch(ts: float, *samples: c.Sample, node="node1", seq=0, job="job1") -> c.MetricBatch:
    base = (c.Sample(c.Source.HOST, {"cpu_percent": 20.0}), c.Sample(c.Source.AGENT, {"uptime_s": 10.0}))
    return c.MetricBatch(node=node, ts=ts, seq=seq, job=job, samples=base + samples)


def clean(ts: float, step: int = 1, **kw) -> c.MetricBatch:
    return batch(ts, gpu(0), gpu(1), train(0, step), **kw)


def kinds(faults) -> list[str]:
    return [f.kind.value for f in faults]


@pytest.fixture(scope="module")
def engine_cfg() -> TEEConfig:
    return TEEConfig(hang_timeout=3.0, heartbeat_timeout=2.0, hang_stale_s=2.0, soft_detectors=("ecod",))


# --------------------------------------------------------------------------- rules (pure)

def test_clean_batches_raise_nothing(engine_cfg):
    engine = TEEEngine(engine_cfg)
    found = [f for i in range(20) for f in engine.process(clean(T0 + i, step=i, seq=i), now=T0 + i)]
    assert found == []
    assert engine.check_heartbeats(now=T0 + 20) == []


def test_xid_79_fires_once_as_critical_evict(engine_cfg):
    engine = TEEEngine(engine_cfg)
    xid = c.Sample(c.Source.GPU, {c.DCGM.XID_ERRORS: 79}, index=1, ts=T0 + 0.5)
    [f] = engine.process(batch(T0 + 1, gpu(0), xid), now=T0 + 1.2)
    assert (f.kind, f.severity, f.action) == (c.FaultKind.XID, c.Severity.CRITICAL, c.Action.EVICT)
    assert (f.node, f.job, f.observed_ts, f.detected_ts) == ("node1", "job1", T0 + 0.5, T0 + 1.2)
    assert f.fault_id == c.stable_id("node1", "xid", 1, 79, T0 + 0.5)
    assert f.evidence["xid"] == 79 and f.evidence["gpu"] == 1 and "fallen off the bus" in f.summary
    c.decode(c.FAULTS, c.encode(f))   # follows its contract
    assert engine.process(clean(T0 + 2), now=T0 + 2) == []


def test_application_xid_is_only_observed(engine_cfg):
    engine = TEEEngine(engine_cfg)
    [f] = engine.process(batch(T0, gpu(0, **{c.DCGM.XID_ERRORS: 13})), now=T0)
    assert (f.kind, f.severity, f.action) == (c.FaultKind.XID, c.Severity.WARNING, c.Action.OBSERVE)


def test_gpu_lost_fires_once_per_gpu(engine_cfg):
    engine = TEEEngine(engine_cfg)
    lost1 = c.Sample(c.Source.GPU, {c.DCGM.GPU_LOST: 1}, index=1)
    found = [f for i in range(4) for f in engine.process(batch(T0 + i, gpu(0), lost1), now=T0 + i)]
    assert kinds(found) == ["gpu_lost"]
    assert (found[0].severity, found[0].action, found[0].evidence["gpu"]) == (c.Severity.CRITICAL, c.Action.EVICT, 1)
    lost0 = c.Sample(c.Source.GPU, {c.DCGM.GPU_LOST: 1}, index=0)
    [f] = engine.process(batch(T0 + 5, lost0, lost1), now=T0 + 5)
    assert f.evidence["gpu"] == 0


def test_nan_loss_fires_once_per_rank(engine_cfg):
    engine = TEEEngine(engine_cfg)
    found = []
    for i in range(3):
        nan = train(1, 7 + i, loss_nonfinite=1)
        found += engine.process(batch(T0 + i, gpu(0), train(0, 7 + i), nan), now=T0 + i)
    [f] = found
    assert (f.kind, f.severity, f.action, f.rank, f.job) == (c.FaultKind.NAN_LOSS, c.Severity.CRITICAL,
                                                             c.Action.RESTART, 1, "job1")
    assert f.evidence["step"] == 7


def test_hang_fires_once_when_step_stops_while_alive(engine_cfg):
    """A rank whose step stops and whose heartbeat stops with it (SIGSTOPped) is hung."""
    engine = TEEEngine(engine_cfg)
    steps = [10, 11, 12, 12, 12, 12, 12, 12, 12, 12]
    found = [f for i, s in enumerate(steps)
             for f in engine.process(batch(T0 + i, train(0, s, heartbeat_age_s=max(0, i - 2))), now=T0 + i)]
    [f] = found
    assert (f.kind, f.severity, f.action, f.rank, f.node) == (c.FaultKind.HANG, c.Severity.CRITICAL,
                                                              c.Action.RESTART, 0, "node1")
    assert f.observed_ts == T0 + 6       # first sample stalled for more than 3 s
    assert f.fault_id == c.stable_id("job1", "0", "hang", "node1", 0, T0 + 2)
    assert f.evidence["step"] == 12 and f.threshold == 3.0 and f.score > 3.0
    assert f.evidence["cause"] == "stuck" and f.evidence["heartbeat_age_s"] == 4


def test_no_hang_while_progressing_or_after_exit(engine_cfg):
    engine = TEEEngine(engine_cfg)
    found = [f for i in range(10) for f in engine.process(batch(T0 + i, train(0, i // 2)), now=T0 + i)]
    assert found == []
    # a rank that exited (alive=0) is forgotten; its frozen step is not a hang
    engine.process(batch(T0 + 10, train(0, 5, alive=0)), now=T0 + 10)
    assert engine.process(batch(T0 + 20, train(0, 5, alive=0)), now=T0 + 20) == []


def test_hang_limit_follows_slow_steps(engine_cfg):
    engine = TEEEngine(engine_cfg)   # hang_timeout 3 s, but steps take 2 s: limit is 3 x 2 = 6 s
    found = []
    ts = T0
    for s in range(5):
        ts += 2
        found += engine.process(batch(ts, train(0, s, step_time=2.0)), now=ts)
    for age in range(4):             # stalled 4 s (its heartbeat too): under 6 s
        ts += 1
        found += engine.process(batch(ts, train(0, 4, step_time=2.0, heartbeat_age_s=age + 1)), now=ts)
    assert found == []
    ts += 3
    [f] = engine.process(batch(ts, train(0, 4, step_time=2.0, heartbeat_age_s=7)), now=ts)
    assert f.kind == c.FaultKind.HANG and f.threshold == 6.0


def test_a_spare_node_whose_agent_says_goodbye_is_lost_only_after_the_grace():
    """A node in no job (a spare: GPUs, no training rank) whose agent stops on purpose: its last batch says so
    (the agent's ``stopping``). Lost at the 6 s timeout without it; with it, after ``heartbeat_bye_grace_s``,
    with the cause. Back before the grace: nothing."""
    def spare(ts, bye=False, **kw):
        b = batch(ts, gpu(0, util=0.0), gpu(1, util=0.0), job=None, **kw)
        if bye:
            b = c.MetricBatch(node=b.node, ts=ts, seq=b.seq, job=None,
                              samples=b.samples + (c.Sample(c.Source.AGENT, {"stopping": 1}),))
        return b

    def lost_at(bye, back=None):
        engine = TEEEngine(TEEConfig(soft_detectors=(), heartbeat_bye_grace_s=30.0))
        for i in range(5):
            engine.process(spare(T0 + i, bye=bye and i == 4, seq=i), now=T0 + i)
        for t in range(5, 60):
            if back is not None and t >= back:          # its agent back, reporting again
                engine.process(spare(T0 + t, seq=t), now=T0 + t)
            found = engine.check_heartbeats(now=T0 + t)
            if found:
                [f] = found
                return t, f.evidence.get("cause")
        return None

    assert lost_at(bye=False) == (11, None)                  # 6 s past its last batch (t=4)
    assert lost_at(bye=True) == (35, "its agent said it stops and did not come back")
    assert lost_at(bye=True, back=20) is None


def test_node_lost_after_heartbeat_timeout_once(engine_cfg):
    engine = TEEEngine(engine_cfg)
    for i in range(3):
        engine.process(clean(T0 + i, step=i), now=T0 + i)
    assert engine.check_heartbeats(now=T0 + 3.5) == []          # 1.5 s silent: under 2 s
    [f] = engine.check_heartbeats(now=T0 + 4.5)
    assert (f.kind, f.severity, f.action, f.node, f.job) == (c.FaultKind.NODE_LOST, c.Severity.CRITICAL,
                                                             c.Action.EVICT, "node1", "job1")
    assert f.fault_id == c.stable_id("node1", "node_lost", T0 + 2)
    assert engine.check_heartbeats(now=T0 + 9) == []
    # back, then silent again: a new loss with a new id
    engine.process(clean(T0 + 20, step=3), now=T0 + 20)
    [g] = engine.check_heartbeats(now=T0 + 23)
    assert g.fault_id != f.fault_id


def test_a_node_whose_agent_reports_every_5_s_is_lost_after_as_many_missed_reports_not_at_a_late_batch():
    """docs/architecture.md sizes 16,000 nodes at a 5 s report interval. The 6 s timeout of 1 s agents made
    such a node lost whenever one of its batches came a second late (bench/tee_quality.py --interval-s 5 with
    late batches: 561 false evictions in 72 node-hours). The interval is learnt from the node's batches (per
    seq) and the timeout waits as many reports: 30 s."""
    engine = TEEEngine(TEEConfig())
    late = (0.2, 0.4, 0.3, 2.5, 1.8, 3.0, 0.9, 2.2, 0.1, 1.5)       # seconds after each batch's sample time
    found, t = [], T0
    for i, d in enumerate(late):
        while t < T0 + 5 * i + d:
            found += engine.check_heartbeats(now=t)
            t += 0.5
        found += engine.process(clean(T0 + 5 * i, step=i, seq=i), now=T0 + 5 * i + d)
    assert found == []
    last = T0 + 45 + 1.5
    assert engine.check_heartbeats(now=last + 29) == []
    [f] = engine.check_heartbeats(now=last + 31)
    assert (f.kind, f.fault_id) == (c.FaultKind.NODE_LOST, c.stable_id("node1", "node_lost", T0 + 45))
    assert (f.evidence["report_interval_s"], f.evidence["heartbeat_timeout_s"]) == (5.0, 30.0)
    assert "timeout 30s" in f.summary


def test_an_agent_that_says_it_reports_every_10_s_is_given_as_long_from_its_first_batch():
    """The agent's self-metrics carry its ``interval_s``: known before a gap between its batches is."""
    engine = TEEEngine(TEEConfig())
    says = c.Sample(c.Source.AGENT, {"uptime_s": 10.0, "interval_s": 10.0})
    engine.process(c.MetricBatch(node="n", ts=T0, seq=0, job="job1", samples=(gpu(0), says)), now=T0 + 0.2)
    assert engine.check_heartbeats(now=T0 + 12) == []                  # its second batch is 2 s late
    engine.process(c.MetricBatch(node="n", ts=T0 + 10, seq=1, job="job1", samples=(gpu(0), says)), now=T0 + 12)
    assert engine.check_heartbeats(now=T0 + 12 + 59) == []
    [f] = engine.check_heartbeats(now=T0 + 12 + 61)
    assert (f.node, f.evidence["heartbeat_timeout_s"], f.evidence["report_interval_s"]) == ("n", 60.0, 10.0)


def test_a_batch_delivered_again_late_does_not_make_its_node_look_silent(engine_cfg):
    """On the event clock a batch is received at its own sample time: one delivered again after newer
    ones (a producer's retry, a partition re-read after a rebalance) leaves the node's newest arrival
    where it was, so the node is not reported lost while its newer batches keep coming."""
    engine = TEEEngine(engine_cfg)
    for i in range(10):
        engine.process(clean(T0 + i, step=i), now=T0 + i)
    engine.process(clean(T0 + 2, step=2), now=T0 + 2)              # delivered again, 7 s late
    assert engine.check_heartbeats(now=T0 + 10) == []             # 1 s after its newest batch
    [f] = engine.check_heartbeats(now=T0 + 12)                    # 3 s: lost, at its newest batch
    assert f.fault_id == c.stable_id("node1", "node_lost", T0 + 9)


def test_event_clock_judges_each_partition_on_its_own_time():
    """A replay read faster on one partition than another: a node of the fast partition that fell
    silent is lost on that partition's time (the slowest partition's clock would wait until it came
    back); a partition read to its end is at least as late as the slowest one with more to read."""
    from transom.streams.app import partition_clocks

    assert partition_clocks({0: 1000.0, 1: 500.0}, {0, 1}) == {0: 1000.0, 1: 500.0}
    assert partition_clocks({0: 400.0, 1: 500.0, 2: 900.0}, {1, 2}) == {0: 500.0, 1: 500.0, 2: 900.0}
    assert partition_clocks({0: 400.0, 1: 500.0}, set()) == {0: 500.0, 1: 500.0}
    assert partition_clocks({}, set()) == {}


def test_heartbeats_of_some_nodes_leave_the_others_alone(engine_cfg):
    engine = TEEEngine(engine_cfg)
    for node in ("a", "b"):
        engine.process(clean(T0, node=node), now=T0)
    [f] = engine.check_heartbeats(now=T0 + 5, nodes=["a", "gone"])     # an unknown node is skipped
    assert f.node == "a"
    [g] = engine.check_heartbeats(now=T0 + 5)
    assert g.node == "b"


def test_replayed_history_is_not_a_lost_node(engine_cfg):
    engine = TEEEngine(engine_cfg)
    now = T0 + 1000
    # old metrics of a node arriving now (a replay): nothing while they keep arriving ...
    for i in range(3):
        engine.process(clean(T0 + i, step=i), now=now + i)
        assert engine.check_heartbeats(now=now + i + 0.5) == []
    # ... and after they stop, the node is history beyond the horizon: dropped, not reported
    assert engine.check_heartbeats(now=now + 10) == []
    assert "node1" not in engine.nodes


def test_refed_batches_keep_their_fault_ids(engine_cfg):
    lost = c.Sample(c.Source.GPU, {c.DCGM.GPU_LOST: 1}, index=0)
    feed = [batch(T0, gpu(0, **{c.DCGM.XID_ERRORS: 79}), train(0, 1)),
            batch(T0 + 1, lost, train(0, 2, loss_nonfinite=1)),
            *[batch(T0 + 2 + i, lost, train(0, 3, heartbeat_age_s=i)) for i in range(6)]]
    first, second = TEEEngine(engine_cfg), TEEEngine(engine_cfg)
    a = [f for fed in feed for f in first.process(fed, now=fed.ts + 0.1)]
    b = [f for fed in feed for f in second.process(fed, now=fed.ts + 7.5)]   # another process, another clock
    assert sorted(kinds(a)) == ["gpu_lost", "hang", "nan_loss", "xid"]
    assert [f.fault_id for f in a] == [f.fault_id for f in b]
    assert [f for fed in feed for f in first.process(fed, now=fed.ts + 9)] == []   # a redelivery: nothing new
    assert first.counts["repeats"] >= 1     # the XID again (the once-per-condition rules remember theirs)


def test_config_refuses_bad_values():
    with pytest.raises(ConfigError, match="hang_timeout"):
        TEEConfig(hang_timeout=0)
    with pytest.raises(ConfigError, match="unknown TEE setting"):
        TEEConfig.from_mapping({"hang_timeot": 3})


# --------------------------------------------------------------------------- ECOD (pure)

def _noisy(rng, n: int) -> list[tuple[float, float, float, float]]:
    return list(zip(rng.normal(95, 2, n), rng.normal(65, 1, n), rng.normal(300, 10, n), rng.normal(1980, 10, n)))


def _gpu_batches(rows, start=0) -> list[c.MetricBatch]:
    out = []
    for i, (util, temp, power, clock) in enumerate(rows, start):
        out.append(batch(T0 + i, gpu(0, util, temp, power, clock), gpu(1, util + 1, temp, power, clock), seq=i))
    return out


def test_ecod_fires_on_a_step_change_after_a_clean_window(engine_cfg):
    rng = np.random.default_rng(7)
    rows = _noisy(rng, 60)
    for i in range(45, 60):          # throttling: clocks and power drop, utilisation falls, heat rises
        util, temp, power, clock = rows[i]
        rows[i] = (util - 30, temp + 6, power - 100, clock - 400)
    engine = TEEEngine(engine_cfg)
    found = [(b.seq, f) for b in _gpu_batches(rows) for f in engine.process(b, now=b.ts)]
    [(seq, f)] = found
    n = engine_cfg.ecod_consecutive
    assert seq == 45 + n - 1         # the n-th anomalous sample in a row
    assert (f.kind, f.severity, f.action, f.detector) == (c.FaultKind.ANOMALY, c.Severity.WARNING,
                                                          c.Action.OBSERVE, "pyod.ecod")
    assert f.score > f.threshold and f.evidence["consecutive"] == n
    clock = f.evidence["features"][c.DCGM.SM_CLOCK]
    assert clock["value"] < 1700 < clock["median"]
    assert f.fault_id == c.stable_id("node1", "anomaly", "ecod", T0 + 45)


def test_ecod_stays_quiet_on_clean_noise(engine_cfg):
    engine = TEEEngine(engine_cfg)
    rows = _noisy(np.random.default_rng(11), 200)
    found = [f for b in _gpu_batches(rows) for f in engine.process(b, now=b.ts)]
    assert found == []
    assert len(engine.nodes["node1"].detectors["ecod"].window) == engine_cfg.ecod_window


# --------------------------------------------------------------------------- a real worker

@contextlib.contextmanager
def tee_worker(bootstrap: str, logfile: Path, *args: str, joined: bool = True):
    """A `transom tee` process with ``args``, its output in ``logfile`` (``proc.logfile``); with ``joined``,
    yielded once it holds its partitions. Stopped (SIGTERM, then SIGKILL after 30 s) on the way out."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRANSOM_LOG_LEVEL": "INFO"}
    with open(logfile, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "transom.cli", "tee", "--bootstrap", bootstrap, *args],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    proc.logfile = logfile
    try:
        if joined:
            wait_until(lambda: proc.poll() is not None or "TEE assigned" in logfile.read_text(), 90,
                       "the TEE worker to join its consumer group")
            assert proc.poll() is None, f"transom tee exited with {proc.returncode}:\n{logfile.read_text()}"
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def tee(broker, tmp_path_factory):
    """One `transom tee` process for this module (hang timeout 3 s, heartbeat timeout 6 s, the default)."""
    with tee_worker(broker.bootstrap, tmp_path_factory.mktemp("tee") / "tee.log",
                    "--hang-timeout", "3", "--heartbeat-timeout", "6") as proc:
        yield proc


@pytest.fixture(scope="module")
def producer(broker):
    p = kafka.make_producer(broker.bootstrap)
    yield p
    p.flush(10)


def _ids() -> tuple[str, str]:
    u = uuid.uuid4().hex[:8]
    return f"node-{u}", f"job-{u}"


def _send(producer, node: str, *values) -> None:
    for v in values:
        if isinstance(v, c.MetricBatch):
            kafka.publish(producer, c.METRICS, node, v)
        else:
            producer.produce(c.METRICS, key=node.encode(), value=v)
    producer.flush(10)


def _faults(bootstrap: str, node: str, kind: c.FaultKind) -> list[c.FaultEvent]:
    return [f for f in topic_values(bootstrap, c.FAULTS) if f.node == node and f.kind == kind]


def _xid_batch(node: str, job: str, ts: float, gpu_index: int = 0) -> c.MetricBatch:
    xid = c.Sample(c.Source.GPU, {c.DCGM.XID_ERRORS: 79}, index=gpu_index, ts=ts)
    return c.MetricBatch(node=node, ts=ts, seq=0, job=job, samples=(gpu(1), xid))


@pytest.mark.integration
def test_worker_turns_xid_79_into_a_fault_once(broker, tee, producer):
    node, job = _ids()
    ts = time.time()
    _send(producer, node, _xid_batch(node, job, ts))
    [f] = wait_until(lambda: _faults(broker.bootstrap, node, c.FaultKind.XID), 30, "the XID fault")
    assert (f.job, f.severity, f.action, f.evidence["xid"]) == (job, c.Severity.CRITICAL, c.Action.EVICT, 79)
    keys = [k for k, v, _, _ in kafka.read_topic(broker.bootstrap, c.FAULTS) if json.loads(v)["fault_id"] == f.fault_id]
    assert keys == [job.encode()]
    # the same batch again, then a later XID of another GPU as a marker (the same GPU's would be merged
    # into the first within the cool-down): the marker's fault proves the repeat was read
    _send(producer, node, _xid_batch(node, job, ts), _xid_batch(node, job, ts + 1, gpu_index=2))
    def both():
        fs = _faults(broker.bootstrap, node, c.FaultKind.XID)
        return fs if len(fs) >= 2 else None

    found = wait_until(both, 30, "the marker XID fault")
    assert [x.fault_id for x in found].count(f.fault_id) == 1
    assert len({x.fault_id for x in found}) == 2


@pytest.mark.integration
def test_worker_dead_letters_malformed_metrics_and_carries_on(broker, tee, producer):
    node, job = _ids()
    bad_json = f'{{bad json {node}'.encode()
    string_metric = json.dumps({"v": 1, "node": node, "ts": time.time(), "seq": 1, "samples": [
        {"source": "gpu", "index": 0, "fields": {c.DCGM.GPU_TEMP: "hot"}}]}).encode()
    _send(producer, node, bad_json, string_metric, _xid_batch(node, job, time.time()))
    wait_until(lambda: _faults(broker.bootstrap, node, c.FaultKind.XID), 30, "the fault after the bad messages")
    letters = {d.value: d for d in topic_values(broker.bootstrap, c.DEADLETTER) if node in d.value}
    assert set(letters) == {bad_json.decode(), string_metric.decode()}
    assert "not JSON" in letters[bad_json.decode()].reason
    assert "'DCGM_FI_DEV_GPU_TEMP' must be a number" in letters[string_metric.decode()].reason
    for d in letters.values():
        assert (d.topic, d.component, d.encoding) == (c.METRICS, "tee", "utf-8")
        assert d.partition is not None and d.offset is not None


@pytest.mark.integration
def test_worker_reports_a_hang(broker, tee, producer):
    node, job = _ids()
    base = time.time() - 20
    steps = [10, 11, 12, 12, 12, 12, 12, 12, 12, 12]     # and its heartbeat stops at step 12
    _send(producer, node, *[c.MetricBatch(node=node, ts=base + i, seq=i, job=job, samples=(
        gpu(0), train(0, s, job=job, generation=2, heartbeat_age_s=max(0, i - 2)))) for i, s in enumerate(steps)])
    [f] = wait_until(lambda: _faults(broker.bootstrap, node, c.FaultKind.HANG), 30, "the HANG fault")
    assert (f.job, f.rank, f.action) == (job, 0, c.Action.RESTART)
    assert f.fault_id == c.stable_id(job, "2", "hang", node, 0, base + 2)


@pytest.mark.integration
def test_worker_reports_a_silent_node_lost(broker, tee, producer):
    node, job = _ids()
    now = time.time()
    _send(producer, node, batch(now - 1, gpu(0), node=node, job=job, seq=0),
          batch(now, gpu(0), node=node, job=job, seq=1))
    [f] = wait_until(lambda: _faults(broker.bootstrap, node, c.FaultKind.NODE_LOST), 30, "the NODE_LOST fault")
    assert (f.job, f.action, f.observed_ts) == (job, c.Action.EVICT, now)
    assert f.fault_id == c.stable_id(node, "node_lost", now)


@pytest.mark.integration
def test_worker_reports_each_new_hard_class_once_on_its_node(broker, tee, producer):
    """ECC DBE (counter + XID 48), a row-remap failure and a link down: one event each, right node."""
    nodes = {cls: _ids() for cls in ("ecc_dbe", "row_remap_failure", "link_down")}
    now = time.time() - 10

    def ib(up):
        return c.Sample(c.Source.NIC, {"link_up": float(up)}, index=1, tags={"device": "mlx5_0", "port": "1"})

    for cls, (node, job) in nodes.items():
        feed = []
        for i in range(6):
            extra = {}
            samples = []
            if cls == "ecc_dbe" and i >= 2:
                extra[c.DCGM.ECC_DBE_VOL_TOTAL] = 1.0
                if i == 2:
                    samples.append(c.Sample(c.Source.GPU, {c.DCGM.XID_ERRORS: 48}, index=0, ts=now + i))
            if cls == "row_remap_failure" and i >= 2:
                extra["DCGM_FI_DEV_ROW_REMAP_FAILURE"] = 1.0
            samples += [gpu(0, **extra), ib(0 if cls == "link_down" and i >= 2 else 1)]
            feed.append(c.MetricBatch(node=node, ts=now + i, seq=i, job=job, samples=tuple(samples)))
        _send(producer, node, *feed)

    def all_found():
        fs = [f for f in topic_values(broker.bootstrap, c.FAULTS) if f.node in {n for n, _ in nodes.values()}]
        return fs if {f.evidence.get("class") for f in fs} >= set(nodes) else None

    wait_until(all_found, 30, "the three faults")
    time.sleep(2)   # anything duplicated would be here by now
    found = all_found()
    for cls, (node, _) in nodes.items():
        # (the nodes then fall silent: their heartbeat loss is the fixture's 6 s timeout doing its job)
        assert [f.evidence["class"] for f in found if f.node == node and not f.resolved
                and f.evidence.get("class") != "node_lost"] == [cls]


def _job_feed(nodes, seconds: int, base: float, job: str, per_node) -> list[tuple[str, c.MetricBatch]]:
    """One batch per node per second of history; ``per_node(node, t)`` -> (step, gpu kwargs, train kwargs).
    The last batch of every node carries an XID 13 (observe only): its fault proves the node's batches were read."""
    feed = []
    for t in range(seconds):
        for i, node in enumerate(nodes):
            step, g, tr = per_node(node, t)
            samples = [gpu(k, **g) for k in range(2)] + [train(i, step, job=job, **tr)]
            if t == seconds - 1:
                samples.append(c.Sample(c.Source.GPU, {c.DCGM.XID_ERRORS: 13}, index=1))
            feed.append((node, c.MetricBatch(node=node, ts=base + t, seq=t, job=job, samples=tuple(samples))))
    return feed


def _feed_and_settle(broker, producer, nodes, feed) -> list[c.FaultEvent]:
    for node, b in feed:
        kafka.publish(producer, c.METRICS, node, b)
    producer.flush(10)

    def markers():
        fs = [f for f in topic_values(broker.bootstrap, c.FAULTS, valid_only=True) if f.node in nodes]
        return fs if {f.node for f in fs if f.evidence.get("xid") == 13} == set(nodes) else None

    wait_until(markers, 60, "the marker XID of every node")
    return [f for f in markers() if f.evidence.get("xid") != 13 and f.kind != c.FaultKind.NODE_LOST]


@pytest.mark.integration
def test_worker_takes_a_job_wide_60s_pause_for_no_fault(broker, tee, producer):
    """Three nodes of one job stop stepping together for 60 s (GPUs idle, heartbeats fresh: a
    synchronous checkpoint without a phase marker), then step on: no fault. Sample time: the
    history is replayed in seconds, not minutes."""
    _, job = _ids()
    nodes = [f"{job}-n{i}" for i in range(3)]

    def per_node(node, t):
        paused = 40 <= t < 100
        return (40 if paused else (t if t < 40 else t - 60)), {"util": 2.0 if paused else 95.0}, {"heartbeat_age_s": 0.4}

    found = _feed_and_settle(broker, producer, nodes, _job_feed(nodes, 130, time.time() - 135, job, per_node))
    assert [(f.node, f.kind.value, f.summary) for f in found] == []


@pytest.mark.integration
def test_worker_reports_a_nan_that_comes_back_as_a_second_event(broker, tee, producer):
    _, job = _ids()
    nodes = [f"{job}-n0"]

    def per_node(node, t):
        nan = t in (10, 11) or t in (210, 211)
        return t, {}, ({"loss_nonfinite": 1} if nan else {})

    found = _feed_and_settle(broker, producer, nodes, _job_feed(nodes, 230, time.time() - 235, job, per_node))
    assert [(f.kind, f.evidence["step"]) for f in found] == [(c.FaultKind.NAN_LOSS, 10), (c.FaultKind.NAN_LOSS, 210)]


@pytest.mark.integration
def test_worker_gives_no_event_to_the_peers_of_a_slow_node(broker, tee, producer):
    """One node of four runs its GPUs at 70 % clock for good: the job slows, its peers wait at the
    all-reduce (their utilisation drops). Whatever is found, nothing names a peer."""
    _, job = _ids()
    nodes = [f"{job}-n{i}" for i in range(4)]
    slow = nodes[3]

    def per_node(node, t):
        if t < 240:
            return t, {}, {}
        if node == slow:
            return t, {"util": 99.0, "clock": 1386.0, "power": 230.0}, {"step_time": 0.14}
        return t, {"util": 70.0, "power": 240.0}, {"step_time": 0.14}

    found = _feed_and_settle(broker, producer, nodes, _job_feed(nodes, 480, time.time() - 485, job, per_node))
    assert [(f.node, f.kind.value) for f in found if f.node != slow] == []


@pytest.mark.integration
def test_worker_finds_a_node_lost_within_its_jobs_stop_on_a_partition_read_past_it(broker, tee, producer):
    """Live (wall clock): three nodes of one job on one metrics partition report every second; node2
    falls silent at once as its job stops, the others' ranks standing still with their GPUs spinning
    (waiting for it in a collective). The worker finds node2 lost on that evidence (its partition was
    read past its newest batch by its peers' reports), before its 6 s heartbeat timeout; nothing is
    named hung."""
    _, job = _ids()
    nodes = [f"{job}-n{i}" for i in range(3)]
    start = time.time()
    for t in range(16):
        for i, node in enumerate(nodes):
            if t >= 5 and i == 2:
                continue
            stepping = t < 5
            b = c.MetricBatch(node=node, ts=time.time(), seq=t, job=job, samples=(
                gpu(0, util=95.0 if stepping else 100.0), gpu(1, util=95.0 if stepping else 100.0),
                train(i, t if stepping else 4, job=job, step_time=1.0, heartbeat_age_s=0.3)))
            producer.produce(c.METRICS, key=node.encode(), value=c.encode(b), partition=0)
        producer.flush(10)
        time.sleep(max(0.0, start + t + 1 - time.time()))
        if _faults(broker.bootstrap, nodes[2], c.FaultKind.NODE_LOST):
            break
    [f] = wait_until(lambda: _faults(broker.bootstrap, nodes[2], c.FaultKind.NODE_LOST), 30, "node2 found lost")
    assert (f.job, f.action, f.evidence.get("cause")) == (job, c.Action.EVICT, "its job stopped as it fell silent")
    assert f.evidence["read_past_s"] >= 2.0 and f.evidence["silent_s"] < 6
    # its peers waiting, as heard in the last node_lost_fast_s: both, or one when this loop's own reads of the
    # faults topic held the next second's batches back and the worker decided between the two nodes' batches
    shown = {w["node"] for w in f.evidence["waiting_ranks"]}
    assert shown and shown <= set(nodes[:2])
    assert [x for x in topic_values(broker.bootstrap, c.FAULTS) if x.kind == c.FaultKind.HANG and x.job == job] == []


@pytest.mark.integration
def test_worker_reports_a_hang_from_real_agents_naming_the_stopped_ranks_node(broker, tee):
    """Two real agents, one training process each, stepping in lockstep (each step waits for the
    other over a socket, as an all-reduce does). The agent of node B SIGSTOPs its rank: rank A then
    waits forever in its 'all_reduce'. One hang event, on node B, with B's process state and
    stack and A's stack (where it waits) as evidence; no event for node A."""
    from transom.agents.agent import Agent

    u = uuid.uuid4().hex[:6]
    job, nodes = f"job-{u}", (f"hang-a-{u}", f"hang-b-{u}")
    a_sock, b_sock = __import__("socket").socketpair()
    rank_code = (
        "import os, socket, sys, time\n"
        "from transom.agents.intake import report\n"
        "s = socket.socket(fileno=int(sys.argv[1]))\n"
        "def all_reduce():\n"
        "    s.sendall(b'x')\n"
        "    return s.recv(1)\n"
        "for step in range(100000):\n"
        "    all_reduce()\n"
        "    report(step=step, loss=2.0, step_time=0.1)\n"
        "    time.sleep(0.1)\n")
    procs, agents = [], []
    try:
        for rank, (node, sock) in enumerate(zip(nodes, (a_sock, b_sock))):
            agent = Agent(node, broker.bootstrap, gpu_source="simulated", gpus=1, interval=0.5)
            agent.__enter__()
            agents.append(agent)
            env = {**os.environ, "RANK": str(rank), "TRANSOM_JOB": job, "TRANSOM_NODE": node,
                   "TRANSOM_AGENT_ADDR": agent.intake_addr, "TRANSOM_HEARTBEAT_S": "0.5"}
            procs.append(subprocess.Popen([sys.executable, "-c", rank_code, str(sock.fileno())], env=env,
                                          pass_fds=(sock.fileno(),)))
        wait_until(lambda: all(a.training.processes() for a in agents), 30, "both ranks to report")
        time.sleep(2)       # a few steps on record
        from transom.agents.intake import send_inject
        assert send_inject(agents[1].intake_addr, "hang", timeout=10)["ok"]
        [f] = wait_until(lambda: [f for f in topic_values(broker.bootstrap, c.FAULTS, valid_only=True)
                                  if f.job == job and f.kind == c.FaultKind.HANG], 60, "the hang event")
        assert (f.node, f.rank, f.evidence["cause"], f.action) == (nodes[1], 1, "stuck", c.Action.RESTART)
        assert f.evidence["stopped"] is True and f.evidence["process_state"] == "stopped"
        if f.evidence["stack"]:       # py-spy installed (the `debug` extra): where the stopped rank is
            assert "<string>" in f.evidence["stack"]
        [waiting] = f.evidence["waiting_ranks"]
        assert waiting["node"] == nodes[0] and "all_reduce" in waiting["stack"]
        time.sleep(3)       # nothing else comes for this job
        assert [g.fault_id for g in topic_values(broker.bootstrap, c.FAULTS, valid_only=True)
                if g.job == job and g.kind != c.FaultKind.NODE_LOST] == [f.fault_id]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        for a in agents:
            a.__exit__(None, None, None)
        a_sock.close()
        b_sock.close()


@pytest.mark.integration
def test_worker_stops_cleanly_on_sigterm(tee):
    tee.send_signal(signal.SIGTERM)
    assert tee.wait(30) == 0
    text = tee.logfile.read_text()
    assert "TEE stopped" in text and "Traceback" not in text
    assert "event loop uvloop" in text            # the default where uvloop is installed (a dependency)


def test_worker_refuses_an_unknown_event_loop_before_it_starts(broker):
    env = {**os.environ, "TRANSOM_EVENT_LOOP": "trio"}
    out = subprocess.run([sys.executable, "-m", "transom.cli", "tee", "--bootstrap", broker.bootstrap],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "TRANSOM_EVENT_LOOP='trio': expected uvloop or asyncio" in out.stderr


@pytest.mark.integration
def test_two_workers_replay_30_clean_node_hours_and_raise_no_fault(fresh_broker, monkeypatch, tmp_path):
    """The false-alarm budget through the real pipeline: 30 node-hours of a clean corpus (24 nodes in
    jobs of 8, 1.25 h at 1 Hz, GPU and NIC noise and every kind of ordinary life: job-wide pauses,
    evaluations, starts and a restore, one-node hiccups, SBE ticks; a seed no tuning used),
    published to the broker and read on the event clock by two `transom tee` workers sharing the
    partitions (bench/tee_quality.py's pipeline replay, which returns once the workers committed every
    batch), yield no fault event and no dead letter."""
    from transom.streams.corpus import Corpus, CorpusSpec

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    from tee_quality import pipeline

    corpus = Corpus(CorpusSpec(nodes=24, hours=1.25, seed=7301, faults_per_node_hour=0.0, min_per_class=0))
    assert corpus.injections == [] and corpus.spec.nodes * corpus.spec.hours == 30
    assert {o.kind for o in corpus.ordinary} == {"startup", "pause", "eval", "restore", "hiccup", "sbe"}
    events, published, _seconds = pipeline(corpus, fresh_broker.bootstrap, workers=2, logdir=str(tmp_path))
    assert published == 24 * 4500
    # on a failure, what the workers said about their partitions (assignments, clocks moved on, faults)
    said = [f"{log.name}: {line}" for log in sorted(tmp_path.glob("tee*.log"))
            for line in log.read_text().splitlines() if any(w in line for w in ("assigned", "read to its end", "fault "))]
    assert [(f.node, f.kind.value, f.summary) for f in events] == [], "\n".join(said[-60:])
    assert topic_values(fresh_broker.bootstrap, c.DEADLETTER, raw=True) == []


@pytest.mark.integration
def test_event_clock_worker_replays_an_old_hour_and_finds_the_node_that_fell_silent(fresh_broker, tmp_path):
    """`--clock event`: metrics from a day ago, replayed at full speed, are judged on their own time:
    the node that stops reporting is lost at its last sample, the one that keeps going is not, and an
    XID in the replay is found (a wall-clock worker would take the whole day for history). A node
    alone on its partition that is silent for 130 s (longer than the 120 s horizon of history) and comes
    back is lost at its last sample before the gap, decided when a live worker would have found it,
    though nothing else on its partition moved the clock while it was away."""
    bs = fresh_broker.bootstrap
    kafka.ensure_topics(bs)
    with tee_worker(bs, tmp_path / "tee.log", "--clock", "event", "--heartbeat-timeout", "5"):
        base = time.time() - 86400
        producer = kafka.make_producer(bs)
        for i in range(200):
            for part, node in enumerate(("steady", "silent", "flaky")):     # each alone on its partition
                if node == "silent" and i > 40 or node == "flaky" and 50 <= i < 180:
                    continue
                samples = (gpu(0), c.Sample(c.Source.GPU, {c.DCGM.XID_ERRORS: 79}, index=1)) \
                    if node == "steady" and i == 80 else (gpu(0), gpu(1))
                producer.produce(c.METRICS, key=node.encode(), partition=part, value=c.encode(
                    c.MetricBatch(node=node, ts=base + i, seq=i, job="old", samples=samples)))
        producer.flush(10)

        def all_three():
            fs = [f for f in topic_values(bs, c.FAULTS) if not f.resolved]
            lost = {f.node for f in fs if f.kind == c.FaultKind.NODE_LOST}
            return fs if lost >= {"silent", "flaky"} and c.FaultKind.XID in {f.kind for f in fs} else None

        faults = wait_until(all_three, 60, "the node-lost and XID faults of the replay")
        lost = sorted((f for f in faults if f.kind == c.FaultKind.NODE_LOST), key=lambda f: f.node)
        assert [(f.node, f.observed_ts) for f in lost] == [("flaky", base + 49), ("silent", base + 40)]
        # decided on the replay's clock (the wall clock says a day later): the flaky node when its silence
        # passed the timeout (5 s), found at its return; the silent node's partition, read to its end, moves
        # on with the other ones once it stayed there END_SETTLE_S of wall time, so the replay may be further
        assert base + 49 + 5 < lost[0].detected_ts <= base + 49 + 7
        assert base + 45 <= lost[1].detected_ts <= base + 200
        [xid] = [f for f in faults if f.kind == c.FaultKind.XID]
        assert (xid.node, xid.observed_ts) == ("steady", base + 80)


@pytest.mark.integration
def test_event_clock_worker_finds_a_node_of_a_5_s_agent_lost_at_its_timeout_though_its_partition_clock_jumped(
        fresh_broker, tmp_path):
    """Agents that report every 5 s, each node alone on its partition, replayed at full speed. "flaky" falls
    silent for 160 s and comes back: its partition's clock jumps 160 s at once. It is lost at its last
    sample, decided at its 30 s timeout (six reports of 5 s): checked at the 6 s timeout of 1 s agents only,
    it was not lost yet, and at the jump's end its silence was past the 120 s horizon: dropped as history,
    never reported. "steady", 5 s between every two batches, is not lost."""
    bs = fresh_broker.bootstrap
    kafka.ensure_topics(bs)
    with tee_worker(bs, tmp_path / "tee.log", "--clock", "event"):
        base = time.time() - 86400
        producer = kafka.make_producer(bs)
        seq = {"steady": 0, "flaky": 0}
        for i in range(60):
            for part, node in enumerate(("steady", "flaky")):
                if node == "flaky" and 20 < i < 53:
                    continue
                producer.produce(c.METRICS, key=node.encode(), partition=part, value=c.encode(
                    c.MetricBatch(node=node, ts=base + 5 * i, seq=seq[node], job="old", samples=(gpu(0), gpu(1)))))
                seq[node] += 1
        producer.flush(10)
        [f] = wait_until(lambda: [f for f in topic_values(bs, c.FAULTS) if not f.resolved] or None, 60,
                         "the node-lost fault of the replay")
        assert (f.kind, f.node, f.observed_ts) == (c.FaultKind.NODE_LOST, "flaky", base + 100)
        assert base + 100 + 30 < f.detected_ts <= base + 100 + 32
        assert f.evidence["report_interval_s"] == 5.0
        time.sleep(3.0)
        assert [g for g in topic_values(bs, c.FAULTS) if not g.resolved] == [f]


@pytest.mark.integration
def test_a_worker_started_behind_a_backlog_says_how_far_behind_it_reads_until_it_caught_up(fresh_broker, tmp_path):
    """A wall-clock worker that starts (or restarts) behind ten minutes of 30 nodes' batches says, while
    it reads them, how many batches it has left and how far behind it reads, then that it caught up;
    the nodes kept reporting meanwhile, and the backlog's clean batches raise no fault (the old batches
    are not a silence)."""
    bs = fresh_broker.bootstrap
    kafka.ensure_topics(bs)
    nodes = [f"bl-{i:02d}" for i in range(30)]
    producer = kafka.make_producer(bs)

    def send(node: str, ts: float, seq: int) -> None:
        kafka.produce(producer, c.METRICS, node, c.encode(
            c.MetricBatch(node=node, ts=ts, seq=seq, job="backlog", samples=(gpu(0), gpu(1)))))

    start = time.time() - 600
    for k in range(600):                       # the backlog: ten minutes before the worker starts
        for node in nodes:
            send(node, start + k, k)
    producer.flush(30)
    logfile = tmp_path / "tee.log"
    with tee_worker(bs, logfile, joined=False) as proc:
        seq, deadline = 600, time.time() + 120
        while "TEE caught up" not in logfile.read_text():     # the nodes go on reporting, once a second
            assert proc.poll() is None and time.time() < deadline, logfile.read_text()[-3000:]
            for node in nodes:
                send(node, time.time(), seq)
            producer.flush(10)
            seq += 1
            time.sleep(1.0)
        said = logfile.read_text()
        behind = [line for line in said.splitlines() if "TEE catching up:" in line]
        assert behind, said[-3000:]
        left, lag = (float(x) for x in re.search(r"(\d+) batches left to read .* up to (\d+) s behind",
                                                  behind[0]).groups())
        assert 0 < left <= 18_000 and 30 < lag <= 620
        assert re.search(r"TEE caught up in \d+ s", said)
        time.sleep(3.0)
        assert topic_values(bs, c.FAULTS) == []

