"""InfluxDB sink: conversion and write-path choice (pure), then real writes to Debian's influxd
(1.6.7: the v1 path) read back with InfluxQL, and a real `transom sink` worker on a real broker."""

from __future__ import annotations

import http.server
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from transom import contracts as c
from transom import kafka
from transom.config import ConfigError
from transom.streams import sink
from util import topic_values, wait_until

T0 = 1_700_000_000.0


# --------------------------------------------------------------------------- realistic events

def run_events(job: str, t0: float, *, nodes=("node0", "node1", "node2"), seconds: int = 12,
               metrics: bool = True) -> list[tuple[str, str, object]]:
    """(topic, key, event) of a short run of ``job``: 2 ranks on node0/node1, XID 79 on node1 at
    t0+6, eviction to node2, resume from the step-4 checkpoint; as the agents, TEE, controller and
    TCE publish them (``metrics=False``: without the agents' batches)."""
    out: list[tuple[str, str, object]] = []

    def life(seq, dt, name, state, detail=None, cause=None):
        out.append((c.LIFECYCLE, job, c.LifecycleEvent(job=job, seq=seq, ts=t0 + dt, name=name, state=state,
                                                       detail=detail or {}, cause=cause or {},
                                                       snapshot={"nodes": list(nodes[:2]), "spares": [nodes[2]]})))

    def ckpt(dt, step, gen, holders):
        shards = tuple(c.Shard(rank=r, name=f"rank{r}.pt", size=1_500_000, sha256="ab" * 32) for r in range(2))
        copies = tuple(cp for r, n in enumerate(holders) for cp in (
            c.Copy(rank=r, node=n, tier=c.Tier.MEMORY, location=f"shm://{n}/{step}/{r}"),
            c.Copy(rank=r, node=n, tier=c.Tier.DISK, location=f"/ckpt/{step}/{r}")))
        out.append((c.CHECKPOINTS, job, c.CheckpointReady(job=job, step=step, world_size=2, shards=shards,
                                                          copies=copies, replicated=True, persisted=True,
                                                          ts=t0 + dt, generation=gen)))

    life(0, 0.0, "submitted", "pending", {"nodes": list(nodes)})
    life(1, 0.1, "launching", "pending", {"nodes": list(nodes[:2]), "spares": [nodes[2]]})
    life(2, 0.5, "launched", "running", {"generation": 0})
    life(3, 1.0, "first_step", "running", {"generation": 0, "step": 0})
    step = 0
    for sec in range(seconds):
        ts = t0 + sec
        gen = 0 if sec < 7 else 1
        ranks = {"node0": 0, "node1": 1} if gen == 0 else {"node0": 0, "node2": 1}
        for n in nodes:
            samples = [c.Sample(c.Source.HOST, {"cpu_percent": 35.0 + sec, "mem_used_percent": 41.5,
                                                "mem_available_mib": 20000.0, "swap_used_percent": 0,
                                                "load1": 1.5, "load5": 1.2, "load15": 1.0, "procs": 310}),
                       c.Sample(c.Source.NIC, {"rx_bytes": 1e9 + sec * 1e7, "rx_bytes_per_s": 1e7, "link_up": 1,
                                               "tx_bytes_per_s": 1e7, "rx_errors_per_s": 0, "tx_errors_per_s": 0,
                                               "rx_dropped_per_s": 0, "tx_dropped_per_s": 0, "carrier_changes": 2},
                                tags={"device": "eth0", "kind": "net"}),
                       c.Sample(c.Source.NIC, {"link_up": 1, "state": 4, "phys_state": 5, "rate_gbps": 400,
                                               "port_rcv_bytes_per_s": 4e9, "port_xmit_bytes_per_s": 4e9,
                                               "symbol_error": 0, "link_downed": 0, "port_rcv_errors": 0},
                                index=1, tags={"device": "mlx5_0", "port": "1", "kind": "ib"})]
            for g in range(2):
                if n == "node1" and sec >= 6 and g == 0:
                    fields = {c.DCGM.XID_ERRORS: 79} if sec == 6 else {c.DCGM.GPU_LOST: 1}
                else:
                    fields = {c.DCGM.GPU_UTIL: 93 + g, c.DCGM.MEM_COPY_UTIL: 41, c.DCGM.FB_USED: 70000.5,
                              c.DCGM.FB_FREE: 11000.5, c.DCGM.GPU_TEMP: 61, c.DCGM.MEMORY_TEMP: 55,
                              c.DCGM.POWER_USAGE: 550.5, c.DCGM.SM_CLOCK: 1980, c.DCGM.MEM_CLOCK: 2619,
                              c.DCGM.ECC_SBE_VOL_TOTAL: 0, c.DCGM.ECC_DBE_VOL_TOTAL: 0}
                samples.append(c.Sample(c.Source.GPU, fields, index=g, tags={"uuid": f"GPU-{n}-{g}"}))
            running = n in ranks and not (gen == 1 and sec == 7)
            if running:
                train = {"step": step, "loss": 4.0 / (1 + 0.1 * step), "tokens_per_s": 5e4 + 100 * sec,
                         "step_time": 0.2, "alive": 1, "report_age_s": 0.1}
                if step % 4 == 0 and step:
                    train["ckpt_stall_s"] = 0.004 + 0.001 * ranks[n]
                if gen == 1:
                    train.update(restore_s=0.05, restore_tier=1)
                samples.append(c.Sample(c.Source.TRAIN, train, index=ranks[n],
                                        tags={"job": job, "generation": str(gen), "pid": str(1000 + sec)}))
            samples.append(c.Sample(c.Source.AGENT, {"uptime_s": float(sec), "interval_s": 1.0, "batches_sent": sec,
                                                     "gpus": 2, "training_ranks": int(running), "connected": 1,
                                                     "collector_errors": 0, "spool_batches": 0, "in_flight": 1,
                                                     "delivery_errors": 0, "dropped": 0, "outages": 0}))
            if metrics:
                out.append((c.METRICS, n, c.MetricBatch(node=n, ts=ts, seq=sec, samples=tuple(samples),
                                                        job=job if running else None)))
        if sec == 4:
            ckpt(4.5, step, 0, ("node0", "node1"))
            life(4, 4.6, "checkpoint", "running", {"step": step, "persisted": True, "replicated": True})
        step = step + 1 if sec != 6 else 4
    out.append((c.FAULTS, job, c.FaultEvent(
        fault_id=f"{job}-xid", job=job, node="node1", kind=c.FaultKind.XID, severity=c.Severity.CRITICAL,
        detector="rule:xid", action=c.Action.EVICT, observed_ts=t0 + 6.0, detected_ts=t0 + 6.3, rank=1,
        score=79, threshold=None, evidence={"xid": 79}, summary="XID 79 GPU has fallen off the bus on GPU 0")))
    out.append((c.FAULTS, job, c.FaultEvent(
        fault_id=f"{job}-ecod", job=job, node="node0", kind=c.FaultKind.ANOMALY, severity=c.Severity.WARNING,
        detector="ecod:temporal", action=c.Action.OBSERVE, observed_ts=t0 + 3.0, detected_ts=t0 + 3.2,
        score=0.93, threshold=0.8, evidence={"top": {"DCGM_FI_DEV_GPU_TEMP": [79, 61]}}, summary="GPU temp high")))
    out.append((c.FAULTS, job, c.FaultEvent(
        fault_id=f"{job}-ecod", job=job, node="node0", kind=c.FaultKind.ANOMALY, severity=c.Severity.INFO,
        detector="ecod:temporal", action=c.Action.OBSERVE, observed_ts=t0 + 5.0, detected_ts=t0 + 5.1,
        score=0.4, threshold=0.8, summary="GPU temp back to normal", resolved=True)))
    life(5, 3.3, "fault_observed", "running", {"summary": "GPU temp high"},
         {"fault_id": f"{job}-ecod", "kind": "anomaly", "node": "node0"})
    life(6, 6.4, "relaunching", "recovering", {"reason": "XID 79", "evicted": "node1", "replacement": "node2",
                                                "generation": 1, "resume_step": 4},
         {"fault_id": f"{job}-xid", "kind": "xid", "node": "node1"})
    life(7, 6.9, "launched", "running", {"generation": 1})
    life(8, 8.0, "resumed", "running", {"generation": 1, "step": 4, "resume_step": 4, "steps_lost": 2})
    ckpt(9.5, 8, 1, ("node0", "node2"))
    life(9, 9.6, "checkpoint", "running", {"step": 8, "persisted": True, "replicated": True})
    life(10, seconds - 0.5, "completed", "completed", {"generation": 1, "last_step": step})
    return out


def publish_all(bootstrap: str, events, extra_raw=()) -> None:
    producer = kafka.make_producer(bootstrap)
    for topic, key, ev in events:
        kafka.publish(producer, topic, key, ev)
        if topic == c.LIFECYCLE:                 # as the controller writes them: the history topic too
            kafka.publish(producer, c.HISTORY, key, ev)
    for topic, key, raw in extra_raw:
        producer.produce(topic, value=raw, key=key.encode())
    assert producer.flush(30) == 0


# --------------------------------------------------------------------------- pure

def test_write_path_follows_the_server_version():
    assert sink.choose_api("1.6.7") == "v1"
    assert sink.choose_api("1.7.11") == "v1"
    assert sink.choose_api("1.8.10") == "v2"
    assert sink.choose_api("v2.7.4") == "v2"
    assert sink.choose_api("3.0.1") == "v2"
    with pytest.raises(ConfigError, match="TRANSOM_INFLUX_API"):
        sink.choose_api("unknown")


def test_config_names_the_bad_key():
    with pytest.raises(ConfigError, match="TRANSOM_INFLUX_URL"):
        sink.SinkConfig(url="influx:8086")
    with pytest.raises(ConfigError, match="TRANSOM_INFLUX_API"):
        sink.SinkConfig(url="http://x:8086", api="v3")
    with pytest.raises(ConfigError, match="TRANSOM_SINK_BATCH"):
        sink.SinkConfig(url="http://x:8086", batch_size=0)


def test_metrics_become_float_fields_with_node_and_device_tags():
    batch = c.MetricBatch(node="n1", ts=T0, seq=0, job="j", samples=(
        c.Sample(c.Source.GPU, {c.DCGM.GPU_UTIL: 93, c.DCGM.POWER_USAGE: 512.5}, index=3, tags={"uuid": "GPU-x"}),
        c.Sample(c.Source.TRAIN, {"step": 7, "loss": 2.5}, index=1, tags={"job": "j", "generation": "2", "pid": "9"}),
        c.Sample(c.Source.GPU, {c.DCGM.XID_ERRORS: 79}, index=0, ts=T0 - 0.5)))
    lines = [p.to_line_protocol() for p in sink.to_points(c.METRICS, batch)]
    assert lines[0] == f"gpu,gpu=3,job=j,node=n1,uuid=GPU-x DCGM_FI_DEV_GPU_UTIL=93,DCGM_FI_DEV_POWER_USAGE=512.5 {int(T0 * 1e6)}"
    assert lines[1] == f"train,generation=2,job=j,node=n1,rank=1 loss=2.5,step=7 {int(T0 * 1e6)}"   # pid dropped
    assert lines[2].endswith(f"DCGM_FI_DEV_XID_ERRORS=79 {int((T0 - 0.5) * 1e6)}")   # the event's own time
    assert not any(re.search(r"=-?\d+i(,| )", line) for line in lines), "an integer field would fix the type"


def test_faults_and_lifecycle_are_also_annotations():
    evs = run_events("j", T0)
    fault = next(e for t, _k, e in evs if t == c.FAULTS and e.kind == c.FaultKind.XID)
    point, ann = [p.to_line_protocol() for p in sink.to_points(c.FAULTS, fault)]
    assert point.startswith("faults,action=evict,detector=rule:xid,job=j,kind=xid,node=node1,resolved=false,"
                            "severity=critical active=1,delay_s=0.3")
    assert ann.startswith("annotations,job=j,kind=xid,node=node1,source=fault text=\"XID 79")
    evict = next(e for t, _k, e in evs if t == c.LIFECYCLE and e.name == "relaunching")
    life, ann = [p.to_line_protocol() for p in sink.to_points(c.LIFECYCLE, evict)]
    assert life.startswith("lifecycle,event=relaunching,job=j,node=node1 generation=1,resume_step=4,seq=6,"
                           "state=\"recovering\"")
    assert "annotations,job=j,kind=eviction,node=node1,source=lifecycle" in ann
    ready = next(e for t, _k, e in evs if t == c.CHECKPOINTS)
    (ck,) = [p.to_line_protocol() for p in sink.to_points(c.CHECKPOINTS, ready)]
    assert "bytes=3000000,copies=4,copies_disk=2,copies_memory=2,copies_shared=0," in ck


def test_every_written_field_and_tag_is_in_the_schema():
    """SCHEMA is what the dashboards are checked against: it must list what conversion writes."""
    for topic, _key, ev in run_events("j", T0):
        for p in sink.to_points(topic, ev):
            m = p._name
            assert set(p._tags) <= sink.SCHEMA[m]["tags"], (m, p._tags)
            assert set(p._fields) <= sink.SCHEMA[m]["fields"], (m, set(p._fields) - sink.SCHEMA[m]["fields"])


class _FakeInfluxV2(http.server.BaseHTTPRequestHandler):
    """A fake of an InfluxDB 2 server's /ping and /api/v2/write (records what it is sent)."""

    requests: list = []

    def do_GET(self):
        self.send_response(204)
        self.send_header("X-Influxdb-Version", "v2.7.4")
        self.end_headers()

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            import gzip
            body = gzip.decompress(body)
        type(self).requests.append((self.path, self.headers.get("Authorization"), body.decode()))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_v2_server_gets_the_v2_write_api():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeInfluxV2)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = sink.SinkConfig(url=f"http://127.0.0.1:{server.server_port}", database="tb", org="acme", token="tok")
        writer = sink.open_writer(cfg)
        assert isinstance(writer, sink.V2Writer) and writer.version == "v2.7.4"
        writer.write(sink.points_of((t, e) for t, _k, e in run_events("j", T0)[:3]))
        writer.close()
    finally:
        server.shutdown()
    (path, auth, body), = _FakeInfluxV2.requests
    assert path.startswith("/api/v2/write?") and "org=acme" in path and "bucket=tb" in path and "precision=us" in path
    assert auth == "Token tok"
    assert body.startswith("lifecycle,event=submitted,job=j")


# --------------------------------------------------------------------------- real InfluxDB 1.6.7

@pytest.mark.integration
def test_real_influxdb_gets_the_v1_path_and_reads_back(influxdb):
    db = f"t_{uuid.uuid4().hex[:8]}"
    cfg = sink.SinkConfig(url=influxdb.url, database=db)
    assert sink.server_version(influxdb.url).startswith("1.6")
    writer = sink.open_writer(cfg)                 # auto: from the version the real server reports
    assert isinstance(writer, sink.V1Writer) and writer.api == "v1"
    events = run_events("j", T0)
    writer.write(sink.points_of((t, e) for t, _k, e in events))
    # the same field first as an integer-looking value, then as a fraction: both floats, no conflict
    writer.write(sink.points_of([(c.METRICS, c.MetricBatch(node="n9", ts=T0 + 99, seq=0, samples=(
        c.Sample(c.Source.HOST, {"cpu_percent": 35.25}),)))]))
    rows = influxdb.series('SELECT count("cpu_percent") FROM "host"', db)[0]["values"]
    assert rows[0][1] == 3 * 12 + 1
    types = {v[0]: v[1] for s in influxdb.series("SHOW FIELD KEYS", db) for v in s["values"]}
    assert types["cpu_percent"] == "float" and types["DCGM_FI_DEV_XID_ERRORS"] == "float"
    assert types["step"] == "float" and types["text"] == "string"
    (xid,) = influxdb.series('SELECT "DCGM_FI_DEV_XID_ERRORS", "gpu" FROM "gpu" WHERE "DCGM_FI_DEV_XID_ERRORS" > 0', db)
    assert xid["values"][0][1:] == [79, "0"]
    ann = influxdb.series('SELECT "text", "kind", "node" FROM "annotations" WHERE "source" = \'lifecycle\' '
                          'AND "kind" = \'eviction\'', db)
    assert ann[0]["values"][0][2:] == ["eviction", "node1"]
    writer.close()


@pytest.mark.integration
def test_sink_worker_writes_every_topic_and_dead_letters_malformed(fresh_broker, influxdb, tmp_path):
    db = f"s_{uuid.uuid4().hex[:8]}"
    events = run_events("job-s", time.time() - 60)
    bad = [(c.METRICS, "node9", b'{"v":1,"node":"node9","ts":-1,"seq":0,"samples":[]}'),
           (c.FAULTS, "job-s", b"not json")]
    publish_all(fresh_broker.bootstrap, events, bad)
    # a field someone else wrote as an integer: the server refuses the sink's float "bytes" (400)
    influxdb.create_database(db)
    influxdb.write(db, f"checkpoints,job=other bytes=1i {int(time.time() * 1e9)}")   # (types are per shard)
    env = {**os.environ, "TRANSOM_INFLUX_URL": influxdb.url, "TRANSOM_INFLUX_DB": db, "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "sink.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "transom.cli", "sink", "--bootstrap", fresh_broker.bootstrap,
                             "--flush", "0.3", "--batch", "50"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        n_train = sum(1 for t, _k, e in events if t == c.METRICS for s in e.samples if s.source == c.Source.TRAIN)
        expected = {("gpu", c.DCGM.GPU_UTIL): 3 * 12 * 2 - 6, ("gpu", c.DCGM.XID_ERRORS): 1,
                    ("gpu", c.DCGM.GPU_LOST): 5, ("train", "step"): n_train, ("host", "cpu_percent"): 36,
                    ("lifecycle", "seq"): 11, ("faults", "active"): 3, ("checkpoints", "step"): 0,
                    ("annotations", "text"): 11 + 3}
        got = {}

        def counts():
            if proc.poll() is not None:
                raise AssertionError(f"the sink exited: {(tmp_path / 'sink.log').read_text()[-3000:]}")
            for (m, f) in expected:
                series = influxdb.series(f'SELECT count("{f}") FROM "{m}"', db) if _has_db(influxdb, db) else []
                got[m, f] = series[0]["values"][0][1] if series else 0
            return got == expected

        try:
            wait_until(counts, 40, "every event's points in InfluxDB")
        except AssertionError:
            raise AssertionError(f"in InfluxDB {got}, expected {expected}") from None
        letters = wait_until(lambda: [d for d in topic_values(fresh_broker.bootstrap, c.DEADLETTER)
                                      if d.component == "sink"], 20, "the sink's dead letters")
        assert len(letters) == 2 + 2
        reasons = {d.topic: d.reason for d in letters}
        assert "field type conflict" in reasons[c.CHECKPOINTS]
        assert "'ts' must be a positive epoch time" in reasons[c.METRICS]
        assert "not JSON" in reasons[c.FAULTS]
        stops = influxdb.series('SELECT "state" FROM "lifecycle" WHERE "job" = \'job-s\' ORDER BY time DESC LIMIT 1', db)
        assert stops[0]["values"][0][1] == "completed"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    assert proc.returncode == 0, (tmp_path / "sink.log").read_text()[-3000:]
    assert "v1 write path" in (tmp_path / "sink.log").read_text()


def _has_db(influxdb, db: str) -> bool:
    return any(db in v for s in influxdb.series("SHOW DATABASES", None) for v in s.get("values", []))


@pytest.mark.integration
def test_write_errors_are_sorted_into_retry_and_refused(influxdb):
    from transom.broker import free_port

    down = sink.V1Writer(sink.SinkConfig(url=f"http://127.0.0.1:{free_port()}", create_database=False))
    pts = sink.points_of([(c.CHECKPOINTS, next(e for t, _k, e in run_events("j", T0) if t == c.CHECKPOINTS))])
    with pytest.raises(sink.ServerUnavailable, match="did not answer"):
        down.write(pts)                                        # nothing listens: retry later
    nodb = sink.V1Writer(sink.SinkConfig(url=influxdb.url, database=f"none_{uuid.uuid4().hex[:6]}",
                                         create_database=False))
    with pytest.raises(sink.PointsRejected, match="database not found"):
        nodb.write(pts)                                        # 404: the same write fails again
