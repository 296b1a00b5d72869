"""The InfluxDB sink's core, free of Faust: events to points, the schema, and the two write paths.

Conversion (:func:`to_points`, one topic's decoded event -> influxdb-client ``Point`` s); every
numeric field is written as a float, so a field's type never changes between points (InfluxDB
refuses a later point whose field type differs), and booleans become 0.0/1.0:

================  ============================================  =====================================
measurement       tags                                          fields
================  ============================================  =====================================
gpu, nic, host,   node, job (when known), the device index as   every metric of the sample (float);
train, agent      ``gpu`` / ``port`` / ``rank`` / ``index``,    time = the sample's ``ts`` (else the
(= the source)    and the sample's tags except ``pid``          batch's)
faults            node, job, kind, severity, detector, action,  active (1 fault, 0 resolution), score,
                  resolved ("true"/"false")                     threshold, rank, delay_s (detected -
                                                                observed), fault_id, summary; time =
                                                                observed_ts
lifecycle         job, event (the lifecycle name), node         seq, state (string), text, and when
                  (when the event names one)                    present generation, step, resume_step,
                                                                steps_lost
checkpoints       job                                           step, generation, world_size, shards,
                                                                bytes, copies, copies_memory,
                                                                copies_disk, copies_shared,
                                                                replicated, persisted
annotations       job, node, kind, source (fault/lifecycle)     text, title (strings): one point per
                                                                fault and per lifecycle event, ready
                                                                for Grafana annotation queries
================  ============================================  =====================================

``kind`` of an annotation: the fault kind for faults (``resolved`` when one clears); for
lifecycle events ``eviction`` (a relaunch that evicts a node), ``relaunch``, ``checkpoint`` or
the event's name. :data:`SCHEMA` lists the measurements, tags and fields the sink writes (for
metrics: the names the agent's collectors use), so the dashboards can be checked against it.

Write paths (:func:`open_writer`), chosen from the version the server reports on ``/ping``
(:func:`choose_api`): :class:`V2Writer` (influxdb-client's write API: InfluxDB 2.x, 3.x, and
1.8+ through its v2 compatibility endpoints) and :class:`V1Writer` (the ``/write`` endpoint of
older 1.x, with line protocol built by influxdb-client's ``Point``). Both write a whole batch
in one request.

Exception tree::

    SinkError(RuntimeError)
    ├── ServerUnavailable     the server did not answer, or answered 5xx/429: retry later
    └── PointsRejected        the server refused the points (4xx): retrying will not help
"""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from influxdb_client import Point, WritePrecision

from transom import contracts
from transom.config import ENV, ConfigError, env_float, env_int, env_str
from transom.contracts import DCGM

__all__ = [
    "SinkError", "ServerUnavailable", "PointsRejected", "SinkConfig", "SINK_ENV", "SCHEMA",
    "INDEX_TAG", "to_points", "choose_api", "parse_version", "server_version", "open_writer",
    "V1Writer", "V2Writer", "RESTORE_TIERS", "TOPICS", "points_of", "lifecycle_kind",
]


class SinkError(RuntimeError):
    """Writing to InfluxDB failed."""


class ServerUnavailable(SinkError):
    """The server did not answer, or answered 5xx or 429: the write may succeed later."""


class PointsRejected(SinkError):
    """The server refused the points (4xx other than 429): the same write will fail again."""


#: Environment variables the sink reads (``transom sink`` flags win over them).
SINK_ENV: Mapping[str, str] = {k: v for k, v in ENV.items() if k.startswith(("TRANSOM_INFLUX_", "TRANSOM_SINK_"))}

APIS = ("auto", "v1", "v2")

#: Tag naming the device index of each metric source.
INDEX_TAG: Mapping[str, str] = {"gpu": "gpu", "nic": "port", "train": "rank", "host": "index", "agent": "index"}

#: ``restore_tier`` values the training script reports after a resume.
RESTORE_TIERS: Mapping[int, str] = {0: "local memory", 1: "peer memory", 2: "local disk", 3: "shared store"}

#: NIC counters (``/sys/class/net/*/statistics``, InfiniBand ``counters``): each also as ``<name>_per_s``
_NIC_COUNTERS = ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets", "rx_errors", "tx_errors", "rx_dropped",
                 "tx_dropped", "port_rcv_bytes", "port_xmit_bytes", "port_rcv_packets", "port_xmit_packets",
                 "port_rcv_errors", "port_xmit_discards", "symbol_error", "link_downed", "link_error_recovery")

_DROPPED_TAGS = frozenset({"pid"})     # a new value per process: would only multiply series

#: What the sink writes: measurement -> {"tags": ..., "fields": ...}. Metric fields are those the
#: agent's collectors and the training script report (others are written too, just not listed).
SCHEMA: Mapping[str, Mapping[str, frozenset[str]]] = {
    "gpu": {"tags": frozenset({"node", "job", "gpu", "uuid"}),
            "fields": frozenset(v for k, v in vars(DCGM).items() if k.isupper())},
    "nic": {"tags": frozenset({"node", "job", "device", "kind", "port"}),
            "fields": frozenset({"link_up", "carrier", "carrier_changes", "state", "phys_state", "rate_gbps"}
                                | {f"{c}{suffix}" for suffix in ("", "_per_s") for c in _NIC_COUNTERS})},
    "host": {"tags": frozenset({"node", "job", "index"}),
             "fields": frozenset({"cpu_percent", "mem_used_percent", "mem_available_mib", "swap_used_percent",
                                  "load1", "load5", "load15", "procs", "disk_read_bytes_per_s",
                                  "disk_write_bytes_per_s", "net_recv_bytes_per_s", "net_sent_bytes_per_s"})},
    # "event": a one-off event of the rank (report_event: checkpoint_save, restore), one point each
    "train": {"tags": frozenset({"node", "job", "rank", "generation", "event"}),
              "fields": frozenset({"step", "loss", "tokens_per_s", "step_time", "alive", "report_age_s",
                                   "loss_nonfinite", "ckpt_stall_s", "ckpt_bytes", "restore_s", "restore_tier",
                                   "restore_step", "restore_bytes", "restore_shard_rank"})},
    "agent": {"tags": frozenset({"node", "job", "index"}),
              "fields": frozenset({"uptime_s", "interval_s", "batches_sent", "collector_errors", "dropped_fields",
                                   "intake_received", "intake_rejected", "training_ranks", "gpus", "produced",
                                   "delivered", "spooled", "replayed", "dropped", "delivery_errors", "outages",
                                   "in_flight", "spool_batches", "spool_bytes", "connected"})},
    "faults": {"tags": frozenset({"node", "job", "kind", "severity", "detector", "action", "resolved"}),
               "fields": frozenset({"active", "score", "threshold", "rank", "delay_s", "fault_id", "summary"})},
    "lifecycle": {"tags": frozenset({"job", "event", "node"}),
                  "fields": frozenset({"seq", "state", "text", "generation", "step", "resume_step", "steps_lost"})},
    "checkpoints": {"tags": frozenset({"job"}),
                    "fields": frozenset({"step", "generation", "world_size", "shards", "bytes", "copies",
                                         "copies_memory", "copies_disk", "copies_shared", "replicated",
                                         "persisted"})},
    "annotations": {"tags": frozenset({"job", "node", "kind", "source"}), "fields": frozenset({"text", "title"})},
}


# --------------------------------------------------------------------------- conversion

def _us(ts: float) -> int:
    return int(round(ts * 1_000_000))


def _point(measurement: str, ts: float, tags: Mapping[str, Any]) -> Point:
    p = Point(measurement).time(_us(ts), WritePrecision.US)
    for k, v in tags.items():
        if v is not None and str(v) != "":
            p.tag(k, str(v))
    return p


def _num(p: Point, name: str, value: Any) -> None:
    if value is None:
        return
    p.field(name, float(value))   # floats only: a field's type must never change


def _metric_points(batch: contracts.MetricBatch) -> list[Point]:
    out = []
    for s in batch.samples:
        if not s.fields:
            continue
        source = s.source.value
        tags: dict[str, Any] = {"node": batch.node, "job": batch.job}
        if s.index is not None:
            tags[INDEX_TAG.get(source, "index")] = s.index
        tags.update({k: v for k, v in s.tags.items() if k not in _DROPPED_TAGS})   # the sample's own win
        p = _point(source, s.ts if s.ts is not None else batch.ts, tags)
        for name, value in s.fields.items():
            _num(p, name, value)
        out.append(p)
    return out


def _fault_points(f: contracts.FaultEvent) -> list[Point]:
    tags = {"node": f.node, "job": f.job, "kind": f.kind.value, "severity": f.severity.value,
            "detector": f.detector, "action": f.action.value, "resolved": "true" if f.resolved else "false"}
    p = _point("faults", f.observed_ts, tags)
    _num(p, "active", 0.0 if f.resolved else 1.0)
    _num(p, "score", f.score)
    _num(p, "threshold", f.threshold)
    _num(p, "rank", f.rank)
    _num(p, "delay_s", round(max(0.0, f.detected_ts - f.observed_ts), 6))
    p.field("fault_id", f.fault_id)
    p.field("summary", f.summary or f"{f.kind.value} on {f.node}")
    title = f"{'resolved: ' if f.resolved else ''}{f.kind.value} on {f.node}"
    text = f.summary or title
    a = _point("annotations", f.observed_ts, {"job": f.job, "node": f.node, "source": "fault",
                                              "kind": "resolved" if f.resolved else f.kind.value})
    a.field("title", title)
    a.field("text", f"{text} [{f.detector}, {f.severity.value}]")
    return [p, a]


def lifecycle_kind(ev: contracts.LifecycleEvent) -> str:
    """The annotation kind of a lifecycle event (see the module docstring)."""
    if ev.name == "relaunching":
        return "eviction" if ev.detail.get("evicted") else "relaunch"
    if ev.name == "launched" and int(ev.detail.get("generation") or 0) > 0:
        return "relaunch"
    return ev.name


def _lifecycle_node(ev: contracts.LifecycleEvent) -> str | None:
    for source in (ev.detail, ev.cause):
        for key in ("evicted", "node"):
            if isinstance(source.get(key), str):
                return source[key]
    return None


def _lifecycle_text(ev: contracts.LifecycleEvent) -> str:
    keep = ("reason", "evicted", "replacement", "generation", "resume_step", "step", "steps_lost", "kind", "summary")
    parts = [f"{k}={ev.detail[k] if k in ev.detail else ev.cause[k]}" for k in keep
             if k in ev.detail or k in ev.cause]
    return f"{ev.name} -> {ev.state}" + (f" ({', '.join(parts)})" if parts else "")


def _lifecycle_points(ev: contracts.LifecycleEvent) -> list[Point]:
    node = _lifecycle_node(ev)
    text = _lifecycle_text(ev)
    p = _point("lifecycle", ev.ts, {"job": ev.job, "event": ev.name, "node": node})
    _num(p, "seq", ev.seq)
    p.field("state", ev.state)
    p.field("text", text)
    for key in ("generation", "step", "resume_step", "steps_lost"):
        value = ev.detail.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            _num(p, key, value)
    a = _point("annotations", ev.ts, {"job": ev.job, "node": node, "source": "lifecycle", "kind": lifecycle_kind(ev)})
    a.field("title", f"{ev.job}: {ev.name}")
    a.field("text", text)
    return [p, a]


def _checkpoint_points(c: contracts.CheckpointReady) -> list[Point]:
    p = _point("checkpoints", c.ts, {"job": c.job})
    for name, value in (("step", c.step), ("generation", c.generation), ("world_size", c.world_size),
                        ("shards", len(c.shards)), ("bytes", sum(s.size for s in c.shards)),
                        ("copies", len(c.copies)), ("replicated", c.replicated), ("persisted", c.persisted)):
        _num(p, name, value)
    for tier in contracts.Tier:
        _num(p, f"copies_{tier.value}", sum(1 for cp in c.copies if cp.tier == tier))
    return [p]


_CONVERTERS = {contracts.METRICS: _metric_points, contracts.FAULTS: _fault_points,
               contracts.LIFECYCLE: _lifecycle_points, contracts.CHECKPOINTS: _checkpoint_points}

#: Topics the sink reads.
TOPICS: tuple[str, ...] = tuple(_CONVERTERS)


def to_points(topic: str, event: Any) -> list[Point]:
    """The points of one decoded event read from ``topic`` (see the module docstring)."""
    try:
        convert = _CONVERTERS[topic]
    except KeyError:
        raise ValueError(f"the sink does not read topic {topic!r}; it reads {', '.join(TOPICS)}") from None
    return convert(event)


# --------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class SinkConfig:
    """Where and how the sink writes. ``from_env`` reads :data:`SINK_ENV`; overrides win."""

    url: str
    database: str = "transom"          # 1.x database, or the bucket on 2.x/3.x
    org: str = "-"
    token: str | None = None
    username: str | None = None
    password: str | None = None
    api: str = "auto"                   # auto, v1, v2
    batch_size: int = 1000              # events per write, at most
    flush_s: float = 1.0                # a partial batch waits at most this long
    create_database: bool = True        # v1 path: CREATE DATABASE at start (idempotent)

    def __post_init__(self) -> None:
        if not self.url or not re.match(r"^https?://[^/]+", self.url):
            raise ConfigError(f"TRANSOM_INFLUX_URL / --influx-url={self.url!r}: expected http(s)://host:port")
        if not self.database:
            raise ConfigError("TRANSOM_INFLUX_DB / --influx-db is empty: expected a database or bucket name")
        if self.api not in APIS:
            raise ConfigError(f"TRANSOM_INFLUX_API / --influx-api={self.api!r}: expected one of {', '.join(APIS)}")
        if self.batch_size < 1:
            raise ConfigError(f"TRANSOM_SINK_BATCH={self.batch_size}: expected an integer >= 1")
        if not self.flush_s > 0:
            raise ConfigError(f"TRANSOM_SINK_FLUSH_S={self.flush_s}: expected a positive number of seconds")

    @classmethod
    def from_env(cls, **overrides: Any) -> "SinkConfig":
        values: dict[str, Any] = {
            "url": env_str("TRANSOM_INFLUX_URL"), "database": env_str("TRANSOM_INFLUX_DB", "transom"),
            "org": env_str("TRANSOM_INFLUX_ORG", "-"), "token": env_str("TRANSOM_INFLUX_TOKEN"),
            "username": env_str("TRANSOM_INFLUX_USER"), "password": env_str("TRANSOM_INFLUX_PASSWORD"),
            "api": env_str("TRANSOM_INFLUX_API", "auto"), "batch_size": env_int("TRANSOM_SINK_BATCH", 1000),
            "flush_s": env_float("TRANSOM_SINK_FLUSH_S", 1.0),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        if not values["url"]:
            raise ConfigError("TRANSOM_INFLUX_URL is not set: give --influx-url http://host:8086")
        return cls(**values)


# --------------------------------------------------------------------------- server version

def parse_version(text: str | None) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``1.6.7``, ``v2.7.4`` or ``3.0.1``."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def choose_api(version: str | None) -> str:
    """``"v2"`` for InfluxDB 2.x, 3.x and 1.8+ (v2 write API), ``"v1"`` for older 1.x."""
    parsed = parse_version(version)
    if parsed is None:
        raise ConfigError(f"the InfluxDB server reported version {version!r}, which is not a version "
                          f"number; set TRANSOM_INFLUX_API / --influx-api to v1 or v2")
    major, minor = parsed
    return "v2" if major >= 2 or (major == 1 and minor >= 8) else "v1"


def _request(url: str, *, data: bytes | None = None, headers: Mapping[str, str] = {},
             timeout: float = 10.0) -> tuple[int, Mapping[str, str], bytes]:
    req = urllib.request.Request(url, data=data, headers=dict(headers), method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", "replace")[:500]
        if exc.code == 429 or exc.code >= 500:
            raise ServerUnavailable(f"{url.split('?')[0]} answered {exc.code}: {body}") from None
        raise PointsRejected(f"{url.split('?')[0]} answered {exc.code}: {body}") from None
    except (OSError, urllib.error.URLError) as exc:
        raise ServerUnavailable(f"{url.split('?')[0]} did not answer: {exc}") from None


def server_version(url: str, timeout: float = 10.0) -> str:
    """The version InfluxDB reports in its ``/ping`` answer's ``X-Influxdb-Version`` header."""
    _status, headers, body = _request(url.rstrip("/") + "/ping", timeout=timeout)
    for k, v in headers.items():
        if k.lower() == "x-influxdb-version":
            return v
    try:   # InfluxDB 3 answers /ping with JSON as well
        return str(json.loads(body or b"{}").get("version"))
    except ValueError:
        return ""


# --------------------------------------------------------------------------- writers

class V1Writer:
    """Writes line protocol to the 1.x ``/write`` endpoint (microsecond precision)."""

    api = "v1"

    def __init__(self, config: SinkConfig, version: str = "") -> None:
        self.config, self.version = config, version
        self.base = config.url.rstrip("/")
        self.headers = {"Content-Type": "text/plain; charset=utf-8"}
        if config.username:
            cred = base64.b64encode(f"{config.username}:{config.password or ''}".encode()).decode()
            self.headers["Authorization"] = f"Basic {cred}"
        if config.create_database:
            self._query(f'CREATE DATABASE "{config.database}"')

    def _query(self, q: str) -> None:
        _status, _h, body = _request(f"{self.base}/query", data=urllib.parse.urlencode({"q": q}).encode(),
                                     headers={**self.headers, "Content-Type": "application/x-www-form-urlencoded"})
        for result in json.loads(body or b"{}").get("results", []):
            if "error" in result:
                raise PointsRejected(f"{q}: {result['error']}")

    def write(self, points: Sequence[Point]) -> None:
        if not points:
            return
        body = "\n".join(p.to_line_protocol() for p in points).encode()
        params = urllib.parse.urlencode({"db": self.config.database, "precision": "u"})
        _request(f"{self.base}/write?{params}", data=body, headers=self.headers, timeout=30)

    def close(self) -> None:
        pass


class V2Writer:
    """Writes through influxdb-client's synchronous write API (2.x, 3.x, 1.8+ compatibility)."""

    api = "v2"

    def __init__(self, config: SinkConfig, version: str = "") -> None:
        from influxdb_client import InfluxDBClient
        from influxdb_client.client.write_api import SYNCHRONOUS

        self.config, self.version = config, version
        token = config.token or (f"{config.username}:{config.password or ''}" if config.username else "")
        self.client = InfluxDBClient(url=config.url, token=token, org=config.org, timeout=30_000)
        self.write_api = self.client.write_api(write_options=SYNCHRONOUS)

    def write(self, points: Sequence[Point]) -> None:
        from influxdb_client.rest import ApiException
        from urllib3.exceptions import HTTPError

        if not points:
            return
        try:
            self.write_api.write(bucket=self.config.database, org=self.config.org, record=list(points),
                                 write_precision=WritePrecision.US)
        except ApiException as exc:
            why = f"{self.config.url} write answered {exc.status}: {str(exc.body)[:500]}"
            if exc.status == 429 or (exc.status or 500) >= 500:
                raise ServerUnavailable(why) from None
            raise PointsRejected(why) from None
        except (HTTPError, OSError) as exc:
            raise ServerUnavailable(f"{self.config.url} did not answer: {exc}") from None

    def close(self) -> None:
        self.client.close()


def open_writer(config: SinkConfig, *, wait_s: float = 60.0) -> "V1Writer | V2Writer":
    """The writer for ``config``: by ``config.api``, or for ``auto`` by the server's version.

    Waits up to ``wait_s`` for the server to answer ``/ping`` (it may start after the sink).
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            version = server_version(config.url)
            break
        except ServerUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    api = config.api if config.api != "auto" else choose_api(version)
    return (V2Writer if api == "v2" else V1Writer)(config, version)


def points_of(items: Iterable[tuple[str, Any]]) -> list[Point]:
    """All points of ``(topic, event)`` pairs, in order."""
    out: list[Point] = []
    for topic, event in items:
        out.extend(to_points(topic, event))
    return out

