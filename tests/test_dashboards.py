"""Grafana dashboards: generated JSON is committed and well formed, names only what the sink writes,
and every query returns data from a real InfluxDB filled by a short real pipeline run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from transom import contracts as c
from transom import dashboards
from transom.agents.intake import send_inject
from transom.broker import EmbeddedBroker, free_udp_port
from transom.streams.sink import SCHEMA
from test_sink import publish_all, run_events

ROOT = Path(__file__).resolve().parents[1]
BOARDS = ROOT / "deploy/grafana/dashboards"
PROVISIONING = ROOT / "deploy/grafana/provisioning"


def _boards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(BOARDS.glob("*.json"))}


# --------------------------------------------------------------------------- structure

def test_committed_json_is_what_the_generator_writes(tmp_path):
    dashboards.write_all(tmp_path)
    fresh = {p.name: p.read_text() for p in tmp_path.glob("*.json")}
    committed = {p.name: p.read_text() for p in BOARDS.glob("*.json")}
    assert fresh.keys() == committed.keys()
    stale = [n for n in fresh if fresh[n] != committed[n]]
    assert not stale, f"{stale} differ from the generator: run `python -m transom.dashboards`"


def test_dashboards_are_well_formed_and_use_the_provisioned_datasource():
    (ds,) = yaml.safe_load((PROVISIONING / "datasources/transom.yaml").read_text())["datasources"]
    assert ds["type"] == "influxdb" and ds["uid"] == dashboards.DATASOURCE_UID
    boards = _boards()
    assert set(boards) == {"cluster-overview.json", "node-detail.json", "job-timeline.json", "tee.json", "tce.json"}
    assert len({b["uid"] for b in boards.values()}) == len(boards)
    for name, b in boards.items():
        ids = [p["id"] for p in b["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: panel ids repeat"
        for p in b["panels"]:
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, (name, p["title"], g)
            if p["type"] == "row":
                continue
            assert p["datasource"] == {"type": "influxdb", "uid": ds["uid"]}, (name, p["title"])
            assert p["targets"], (name, p["title"])
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), (name, p["title"])
            for t in p["targets"]:
                assert t["datasource"]["uid"] == ds["uid"] and t["rawQuery"] is True
                assert t["resultFormat"] in ("time_series", "table")
                assert t["query"].startswith("SELECT ") and "$timeFilter" in t["query"], (name, p["title"])
        for a in b["annotations"]["list"][1:]:
            assert a["datasource"]["uid"] == ds["uid"] and a["textColumn"] == "text", (name, a["name"])
        for v in b["templating"]["list"]:
            assert v["datasource"]["uid"] == ds["uid"] and v["query"].startswith("SHOW TAG VALUES")
            assert all(f"${v['name']}" in q for _w, q in dashboards.queries_of(b) if not q.startswith("SHOW")), \
                f"{name}: a query ignores ${v['name']}"


# --------------------------------------------------------------------------- names vs the sink

def unknown_names(query: str) -> list[str]:
    """Measurements, tags and fields in ``query`` that ``sink.SCHEMA`` does not have."""
    show = re.match(r'SHOW TAG VALUES FROM "([^"]+)" WITH KEY = "([^"]+)"', query)
    if show:
        m, key = show.groups()
        return [m] if m not in SCHEMA else ([] if key in SCHEMA[m]["tags"] else [f"{m}.{key}"])
    (m,) = re.findall(r'FROM "([^"]+)"', query)
    if m not in SCHEMA:
        return [m]
    tags, fields = SCHEMA[m]["tags"], SCHEMA[m]["fields"]
    aliases = set(re.findall(r'AS "([^"]+)"', query))
    bad = []
    group = query.split("GROUP BY", 1)[1] if "GROUP BY" in query else ""
    bad += [f"{m}.{t} (not a tag)" for t in re.findall(r'"([^"]+)"', group) if t not in tags]
    for name in re.findall(r'"([^"]+)"', query.split("GROUP BY", 1)[0]):
        if name != m and name not in aliases and name not in tags | fields:
            bad.append(f"{m}.{name}")
    for regex in re.findall(r"\(/([^/]+)/\)", query):   # a field regex must match some field
        if not any(re.search(regex, f) for f in fields):
            bad.append(f"{m}./{regex}/")
    return bad


def test_dashboards_name_only_what_the_sink_writes():
    problems = [f"{name} {where}: {bad}" for name, b in _boards().items()
                for where, q in dashboards.queries_of(b) if (bad := unknown_names(q))]
    assert not problems, "\n".join(problems)


def test_the_name_check_catches_a_wrong_name():
    assert unknown_names('SELECT mean("DCGM_FI_DEV_GPU_UTILISATION") FROM "gpu" WHERE $timeFilter') == \
        ["gpu.DCGM_FI_DEV_GPU_UTILISATION"]
    assert unknown_names('SELECT mean("loss") FROM "training" WHERE $timeFilter') == ["training"]
    assert unknown_names('SELECT mean("loss") FROM "train" WHERE $timeFilter GROUP BY "step"') == \
        ["train.step (not a tag)"]


# --------------------------------------------------------------------------- a real pipeline run

def _spawn(args, log: Path, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "transom.cli", *args], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _report(addr: str, **fields) -> None:
    import socket
    host, port = addr.rsplit(":", 1)
    msg = {"type": "train", "pid": os.getpid(), "ts": time.time(), **fields}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(json.dumps(msg).encode(), (host, int(port)))


@pytest.fixture(scope="module")
def pipeline(influxdb, tmp_path_factory):
    """Real agents (simulated GPUs, real host and NIC), a real TEE and a real sink on a broker of
    their own; a job's ranks report through the agents' intakes, XID 79 is injected on one node; the
    controller's lifecycle, the TCE's checkpoint-ready events and an ECOD anomaly are published as
    those components publish them. Yields ``(database, job, nodes)`` once InfluxDB has it all."""
    tmp = tmp_path_factory.mktemp("pipeline")
    db, job = f"dash_{uuid.uuid4().hex[:8]}", f"dash-{uuid.uuid4().hex[:6]}"
    nodes = ("dnode0", "dnode1", "dnode2")
    broker = EmbeddedBroker(log_path=str(tmp / "broker.log")).start()
    procs: list[subprocess.Popen] = []
    try:
        addrs = {}
        for n in nodes:
            port = free_udp_port()
            addrs[n] = f"127.0.0.1:{port}"
            procs.append(_spawn(["agent", "--node", n, "--gpu-source", "simulated", "--gpus", "2", "--intake-port",
                                 str(port), "--interval", "0.5", "--state-dir", str(tmp / n), "--bootstrap",
                                 broker.bootstrap], tmp / f"agent-{n}.log"))
        procs.append(_spawn(["tee", "--bootstrap", broker.bootstrap], tmp / "tee.log"))
        procs.append(_spawn(["sink", "--bootstrap", broker.bootstrap, "--influx-url", influxdb.url, "--influx-db", db,
                             "--flush", "0.5"], tmp / "sink.log"))
        t0 = time.time()
        # what the controller, the TCE and the anomaly detector publish, for the nodes of this run
        publish_all(broker.bootstrap, run_events(job, t0, nodes=nodes, metrics=False))
        # and an NVML node's batch with the signals the simulated source does not have (ECC, memory
        # temperature, InfiniBand)
        extra = next(e for t, _k, e in run_events("other", t0 - 1, nodes=("nvml-node0", "nvml-node1", "nvml-node2"), seconds=1) if t == c.METRICS)
        publish_all(broker.bootstrap, [(c.METRICS, extra.node, extra)])
        step, injected = 0, False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            gen = 0 if step < 12 else 1
            ranks = ("dnode0", "dnode1") if gen == 0 else ("dnode0", "dnode2")
            for rank, n in enumerate(ranks):
                fields = {"step": step, "loss": 5.0 / (1 + 0.05 * step), "tokens_per_s": 4e4 + 50 * rank,
                          "step_time": 0.25}
                if step and step % 5 == 0:
                    fields["ckpt_stall_s"] = 0.003 + 0.001 * rank
                if gen == 1:
                    fields.update(restore_s=0.04 + 0.01 * rank, restore_tier=1 if rank else 0)
                _report(addrs[n], job=job, rank=rank, generation=gen, node=n, **fields)
            if step == 8 and not injected:
                send_inject(addrs["dnode1"], "xid79", gpu=0)
                injected = True
            step += 1
            time.sleep(0.25)
            if step >= 24 and _ready(influxdb, db, job):
                break
            for p in procs:
                assert p.poll() is None, f"{p.args[3]} exited: see {tmp}"
        else:
            pytest.fail(f"the pipeline did not fill InfluxDB within 60 s: logs in {tmp}")
        time.sleep(1.0)                 # one more agent interval and sink flush
        yield db, job, nodes
    finally:
        _stop(procs)
        broker.stop()


def _ready(influxdb, db: str, job: str) -> bool:
    try:
        faults = influxdb.series('SELECT count("active") FROM "faults" WHERE "detector" <> \'ecod:temporal\' '
                                 'GROUP BY "kind"', db)
        restores = influxdb.series(f'SELECT count("restore_tier") FROM "train" WHERE "job" = \'{job}\'', db)
        nic = influxdb.series('SELECT count("link_up") FROM "nic" WHERE "node" = \'dnode0\'', db)
    except Exception:
        return False
    kinds = {s["tags"]["kind"] for s in faults}
    return {"xid", "gpu_lost"} <= kinds and bool(restores) and bool(nic)


def _substitute(query: str, job: str) -> str:
    return (query.replace("$timeFilter", "time > now() - 5m").replace("$__interval", "1s")
            .replace("$job", f"({re.escape(job)})").replace("$node", ".*"))


@pytest.mark.integration
def test_every_panel_query_returns_data_from_a_real_run(pipeline, influxdb):
    db, job, nodes = pipeline
    empty = []
    checked = 0
    for name, board in _boards().items():
        for where, q in dashboards.queries_of(board):
            (result,) = influxdb.query(_substitute(q, job), db)
            assert "error" not in result, f"{name} {where}: {result['error']}\n{q}"
            values = [v for s in result.get("series", []) for row in s["values"] for v in row[1:] if v is not None]
            checked += 1
            if not values:
                empty.append(f"{name} {where}: {q}")
    assert checked > 50
    assert not empty, "queries without data:\n" + "\n".join(empty)


@pytest.mark.integration
def test_every_named_field_exists_in_the_real_database(pipeline, influxdb):
    db, _job, _nodes = pipeline
    written = {(s["name"], v[0]) for show in ("SHOW FIELD KEYS", "SHOW TAG KEYS")
               for s in influxdb.series(show, db) for v in s["values"]}
    named = set()
    for board in _boards().values():
        for _where, q in dashboards.queries_of(board):
            if q.startswith("SHOW"):
                continue
            (m,) = re.findall(r'FROM "([^"]+)"', q)
            aliases = set(re.findall(r'AS "([^"]+)"', q))
            select = q.split(" FROM ", 1)[0]
            named |= {(m, f) for f in re.findall(r'"([^"]+)"', select) if f not in aliases}
    missing = sorted(named - written)
    assert not missing, f"the dashboards read fields or tags the pipeline never wrote: {missing}"
    # and the faults came from the real TEE
    kinds = {s["tags"]["kind"] for s in influxdb.series('SELECT count("active") FROM "faults" GROUP BY "kind", '
                                                        '"detector"', db) if s["tags"]["detector"] != "ecod:temporal"}
    assert {"xid", "gpu_lost"} <= kinds
