"""Contracts: every event type round-trips; malformed values are refused with a reason."""

import time

import pytest

from transom import contracts as c


def _events():
    now = time.time()
    yield c.METRICS, c.MetricBatch(node="n0", ts=now, seq=3, job="j", samples=(
        c.Sample(c.Source.GPU, {c.DCGM.GPU_UTIL: 97.0}, index=0, tags={"uuid": "GPU-1"}),
        c.Sample(c.Source.TRAIN, {"step": 10, "loss": 2.5}, index=1, tags={"job": "j"}),
    ))
    yield c.FAULTS, c.FaultEvent(fault_id="f1", job="j", node="n0", kind=c.FaultKind.XID,
                                 severity=c.Severity.CRITICAL, detector="rule:xid", action=c.Action.EVICT,
                                 observed_ts=now, detected_ts=now + 0.1, rank=2,
                                 evidence={"xid": 79}, summary="XID 79")
    sha = "0" * 64
    yield c.CHECKPOINTS, c.CheckpointReady(
        job="j", step=100, world_size=2,
        shards=(c.Shard(0, "rank-0", 10, sha), c.Shard(1, "rank-1", 10, sha)),
        copies=(c.Copy(0, "n0", c.Tier.SHARED, "/x/0"), c.Copy(1, "n1", c.Tier.SHARED, "/x/1")),
        replicated=False, persisted=True, ts=now)
    yield c.LIFECYCLE, c.LifecycleEvent(job="j", seq=0, ts=now, name="submitted", state="pending",
                                        snapshot={"nodes": ["n0"]})
    yield c.DEADLETTER, c.DeadLetter.of(b"\xff\x00", topic=c.METRICS, reason="bad", component="t")


@pytest.mark.parametrize("topic,event", list(_events()), ids=lambda x: getattr(x, "__name__", str(x))[:20])
def test_round_trip(topic, event):
    assert c.decode(topic, c.encode(event)) == event


@pytest.mark.parametrize("raw,reason", [
    (b"", "empty value"),
    (b"{not json", "not JSON"),
    (b"[1,2]", "must be a JSON object"),
    (b'{"v":1,"node":"n0","ts":1.0,"seq":0}', "missing required field 'samples'"),
    (b'{"v":2,"node":"n0","ts":1.0,"seq":0,"samples":[]}', "schema version 2"),
    (b'{"v":1,"node":"n0","ts":1.0,"seq":0,"samples":[{"source":"gpu","fields":{"x":"hot"}}]}',
     "metric 'x' must be a number"),
    (b'{"v":1,"node":"n0","ts":1.0,"seq":0,"samples":[{"source":"disk","fields":{}}]}',
     "expected one of: gpu, nic"),
    (b'{"v":1,"node":"n0","ts":NaN,"seq":0,"samples":[]}', "NaN"),
    # the batch-level checks (every sample at once) hand a bad sample to the one-by-one checks that name it
    (b'{"v":1,"node":"n0","ts":1.0,"seq":0,"samples":[{"source":"gpu","fields":{"a":1.0}},'
     b'{"source":"gpu","fields":{"x":true}}]}', "sample 1: metric 'x' must be a number, got bool"),
    (b'{"v":1,"node":"n0","ts":1.0,"seq":0,"samples":[{"source":"gpu","fields":{"x":[1]}}]}',
     "metric 'x' must be a number, got list"),
    (b'{"v":1,"node":"n0","ts":1.0,"seq":0,"samples":[{"source":"nic","fields":{},"tags":{"port":1}}]}',
     "tag 'port' must be a string"),
    (b'{"v":1,"node":"n0","ts":1.0,"seq":0,"samples":[{"source":"gpu","fields":{},"index":true}]}',
     "'index' must be an integer, got bool"),
])
def test_malformed_metrics_are_refused_with_reason(raw, reason):
    with pytest.raises(c.ContractError, match=reason):
        c.decode(c.METRICS, raw)


def test_checkpoint_ready_must_cover_every_rank():
    ev = c.CheckpointReady(job="j", step=1, world_size=3, shards=(c.Shard(0, "a", 1, "0" * 64),),
                           copies=(), replicated=False, persisted=True, ts=1.0)
    with pytest.raises(c.ContractError, match="cover ranks 0..2"):
        c.decode(c.CHECKPOINTS, c.encode(ev))


def test_stable_id_is_deterministic():
    assert c.stable_id("n0", 79, 1.5) == c.stable_id("n0", 79, 1.5)
    assert c.stable_id("n0", 79, 1.5) != c.stable_id("n1", 79, 1.5)


def test_no_other_module_names_a_topic():
    """Topic names live in transom.contracts only."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for path in root.glob("*/**/*.py"):
        if ".venv" in path.parts or path.name == "contracts.py" or "tests" in path.parts:
            continue
        if '"transom.metrics"' in path.read_text() or "'transom.metrics'" in path.read_text():
            offenders.append(str(path))
    assert offenders == []


_BATCH = '{"v":1,"node":"n0","ts":%s,"seq":%s,"samples":[{"source":"gpu","index":%s,"fields":{"x":%s}%s}]}'


@pytest.mark.parametrize("raw,reason", [
    (_BATCH % ("1.0", "0", "0", "1e999", ""), "out of range"),
    (_BATCH % ("1.0", "0", "0", "-1e999", ""), "out of range"),
    (_BATCH % ("1e999", "0", "0", "1", ""), "out of range"),
    (_BATCH % ("1.0", "0", "0", "1", ',"ts":1e999'), "out of range"),
    (_BATCH % ("1.0", "0", "0", "1", ',"ts":-5'), "'ts' must be a positive epoch time"),
    (_BATCH % ("1.0", "-1", "0", "1", ""), "'seq' must not be negative"),
    (_BATCH % ("1.0", "0", "-2", "1", ""), "'index' must not be negative"),
    (_BATCH % ("1.0", "0", "0", "1" + "0" * 400, ""), "metric 'x' must be a finite number"),
])
def test_out_of_range_numbers_are_refused_with_reason(raw, reason):
    """Infinity, negative counters and impossible times go to the dead letter, not to the rules."""
    with pytest.raises(c.ContractError, match=reason):
        c.decode(c.METRICS, raw.encode())


def test_non_finite_values_are_refused_when_built_from_a_dict():
    d = {"v": 1, "node": "n0", "ts": 1.0, "seq": 0,
         "samples": [{"source": "gpu", "fields": {"ok": 1.0, "x": float("inf")}}]}
    with pytest.raises(c.ContractError, match="metric 'x' must be a finite number"):
        c.MetricBatch.from_dict(d)
