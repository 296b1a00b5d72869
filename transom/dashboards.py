"""Grafana dashboards as code: plain Python building the dashboard JSON, InfluxQL queries only.

``python -m transom.dashboards [DIR]`` writes one JSON file per dashboard into DIR (default
``deploy/grafana/dashboards``); the committed files are its output, and a test regenerates them
and fails on any difference. Every query reads what :mod:`transom.streams.sink` writes
(measurements and fields in ``sink.SCHEMA``) and uses only InfluxQL that InfluxDB 1.x, 2.x
(through a DBRP mapping) and 3.x answer: ``SELECT`` with aggregates, ``GROUP BY time()`` and
tags, ``fill()``; template variables use ``SHOW TAG VALUES``.

Dashboards (uid: title):

- ``transom-cluster``: nodes by health, active faults, jobs and their states;
- ``transom-node``: every GPU (DCGM field names), NIC and host signal of a node, and its agent;
- ``transom-job``: loss and throughput, annotated with faults, evictions, relaunches, checkpoints;
- ``transom-tee``: detector scores against thresholds, faults by kind, detection delay;
- ``transom-tce``: save stall, replication lag, where each restore came from.

Every panel and annotation names the provisioned datasource by uid :data:`DATASOURCE_UID`
(``deploy/grafana/provisioning/datasources/transom.yaml``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

from transom.contracts import DCGM

__all__ = ["DATASOURCE_UID", "DATASOURCE", "dashboards", "write_all", "queries_of", "main"]

DATASOURCE_UID = "transom-influxdb"
DATASOURCE = {"type": "influxdb", "uid": DATASOURCE_UID}
SCHEMA_VERSION = 39          # Grafana 10.x/11.x dashboard JSON
TF = "$timeFilter"
GT = "GROUP BY time($__interval)"

#: restore_tier values (the training script's) as Grafana value mappings
_TIER_MAPPING = [{"type": "value", "options": {
    "0": {"text": "local memory", "color": "green", "index": 0},
    "1": {"text": "peer memory", "color": "blue", "index": 1},
    "2": {"text": "local disk", "color": "yellow", "index": 2},
    "3": {"text": "shared store", "color": "orange", "index": 3}}}]


def _target(query: str, ref: str = "A", fmt: str = "time_series", alias: str | None = None) -> dict[str, Any]:
    t: dict[str, Any] = {"refId": ref, "datasource": DATASOURCE, "rawQuery": True, "query": query,
                         "resultFormat": fmt}
    if alias:
        t["alias"] = alias
    return t


class _Board:
    """Panels laid out left to right, 24 grid units per row."""

    def __init__(self, uid: str, title: str, description: str, tags: list[str]) -> None:
        self.uid, self.title, self.description, self.tags = uid, title, description, tags
        self.panels: list[dict[str, Any]] = []
        self.variables: list[dict[str, Any]] = []
        self.annotations: list[dict[str, Any]] = []
        self._x = self._y = self._row_h = 0

    def _place(self, w: int, h: int) -> dict[str, int]:
        if self._x + w > 24:
            self._x, self._y, self._row_h = 0, self._y + self._row_h, 0
        pos = {"x": self._x, "y": self._y, "w": w, "h": h}
        self._x += w
        self._row_h = max(self._row_h, h)
        return pos

    def row(self, title: str) -> None:
        if self._x:
            self._x, self._y, self._row_h = 0, self._y + self._row_h, 0
        self.panels.append({"id": len(self.panels) + 1, "type": "row", "title": title, "collapsed": False,
                            "gridPos": {"x": 0, "y": self._y, "w": 24, "h": 1}, "panels": []})
        self._y += 1

    def panel(self, kind: str, title: str, targets: list[dict[str, Any]], *, w: int = 12, h: int = 8,
              unit: str | None = None, description: str = "", mappings: list | None = None,
              options: dict | None = None, custom: dict | None = None) -> None:
        defaults: dict[str, Any] = {}
        if unit:
            defaults["unit"] = unit
        if mappings:
            defaults["mappings"] = mappings
        if custom:
            defaults["custom"] = custom
        self.panels.append({
            "id": len(self.panels) + 1, "type": kind, "title": title, "description": description,
            "datasource": DATASOURCE, "gridPos": self._place(w, h), "targets": targets,
            "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options or {},
        })

    def variable(self, name: str, query: str, *, multi: bool = True, label: str | None = None) -> None:
        self.variables.append({
            "name": name, "label": label or name, "type": "query", "datasource": DATASOURCE, "query": query,
            "definition": query, "refresh": 2, "multi": multi, "includeAll": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1, "hide": 0,
        })

    def annotation(self, name: str, query: str, colour: str) -> None:
        # the InfluxDB datasource's annotation form: one query, the text column, the tag columns
        self.annotations.append({
            "name": name, "datasource": DATASOURCE, "enable": True, "iconColor": colour, "query": query,
            "textColumn": "text", "tagsColumn": "kind,node", "titleColumn": "", "hide": False,
        })

    def json(self) -> dict[str, Any]:
        return {
            "uid": self.uid, "title": self.title, "description": self.description, "tags": self.tags,
            "schemaVersion": SCHEMA_VERSION, "version": 1, "editable": True, "graphTooltip": 1,
            "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "timezone": "browser",
            "templating": {"list": self.variables},
            "annotations": {"list": [{
                "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
                "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
                "type": "dashboard"}] + self.annotations},
            "panels": self.panels,
        }


NODE = '"node" =~ /^$node$/'
JOB = '"job" =~ /^$job$/'


# --------------------------------------------------------------------------- the dashboards

def cluster() -> dict[str, Any]:
    b = _Board("transom-cluster", "Transom: cluster overview",
               "Nodes by health, active faults, jobs and their states.", ["transom"])
    b.row("Nodes")
    b.panel("state-timeline", "Node heartbeats (batches per interval; 0 = silent node)",
            [_target(f'SELECT count("uptime_s") FROM "agent" WHERE {TF} {GT}, "node" fill(0)', alias="$tag_node")],
            w=24, h=7, custom={"fillOpacity": 80},
            description="An agent sends one batch per interval; a node with none is lost or cut off.",
            options={"mergeValues": False, "showValue": "never"})
    b.panel("table", "Node health (newest agent report)",
            [_target(f'SELECT last("uptime_s") AS "uptime_s", last("gpus") AS "gpus", last("training_ranks") AS '
                     f'"training_ranks", last("collector_errors") AS "collector_errors", last("connected") AS "connected", '
                     f'last("spool_batches") AS "spooled batches" FROM "agent" WHERE {TF} GROUP BY "node"', fmt="table")], w=12)
    b.panel("table", "Active faults (newest event per node and kind; active = 1)",
            [_target(f'SELECT last("active") AS "active", last("summary") AS "summary", last("fault_id") AS '
                     f'"fault_id" FROM "faults" WHERE {TF} GROUP BY "node", "kind", "severity"', fmt="table")],
            w=12)
    b.row("Jobs")
    b.panel("table", "Jobs and their states",
            [_target(f'SELECT last("state") AS "state", last("text") AS "last event", last("seq") AS "events" '
                     f'FROM "lifecycle" WHERE {TF} GROUP BY "job"', fmt="table")], w=12)
    b.panel("timeseries", "Training throughput by job (mean over ranks)",
            [_target(f'SELECT mean("tokens_per_s") FROM "train" WHERE {TF} {GT}, "job" fill(none)',
                     alias="$tag_job")], w=12, unit="short")
    b.panel("bargauge", "Faults by node (in range)",
            [_target(f'SELECT count("active") FROM "faults" WHERE "resolved" = \'false\' AND {TF} GROUP BY "node"',
                     alias="$tag_node")], w=12, options={"orientation": "horizontal"})
    b.panel("timeseries", "GPU utilisation by node (mean)",
            [_target(f'SELECT mean("{DCGM.GPU_UTIL}") FROM "gpu" WHERE {TF} {GT}, "node" fill(none)',
                     alias="$tag_node")], w=12, unit="percent")
    return b.json()


_GPU_PANELS = [
    (DCGM.GPU_UTIL, "GPU utilisation", "percent", "mean"),
    (DCGM.MEM_COPY_UTIL, "Memory copy utilisation", "percent", "mean"),
    (DCGM.FB_USED, "Framebuffer used", "decmbytes", "mean"),
    (DCGM.FB_FREE, "Framebuffer free", "decmbytes", "mean"),
    (DCGM.GPU_TEMP, "GPU temperature", "celsius", "mean"),
    (DCGM.MEMORY_TEMP, "Memory temperature", "celsius", "mean"),
    (DCGM.POWER_USAGE, "Power", "watt", "mean"),
    (DCGM.SM_CLOCK, "SM clock", "rotmhz", "mean"),
    (DCGM.MEM_CLOCK, "Memory clock", "rotmhz", "mean"),
    (DCGM.XID_ERRORS, "XID errors (code)", "none", "max"),
    (DCGM.ECC_SBE_VOL_TOTAL, "ECC single-bit errors (volatile)", "none", "max"),
    (DCGM.ECC_DBE_VOL_TOTAL, "ECC double-bit errors (volatile)", "none", "max"),
    (DCGM.GPU_LOST, "GPU lost (1 = NVML answers GPU_IS_LOST)", "none", "max"),
]


def node() -> dict[str, Any]:
    b = _Board("transom-node", "Transom: node detail",
               "Every GPU (DCGM field names), NIC and host signal of the chosen nodes, and their agents.",
               ["transom"])
    b.variable("node", 'SHOW TAG VALUES FROM "agent" WITH KEY = "node"')
    b.annotation("Faults on these nodes", f'SELECT "text", "kind", "node" FROM "annotations" WHERE "source" = '
                                          f'\'fault\' AND {NODE} AND {TF}', "red")
    b.row("GPU (DCGM fields, one series per node and GPU)")
    for field, title, unit, agg in _GPU_PANELS:
        b.panel("timeseries", f"{title} ({field})",
                [_target(f'SELECT {agg}("{field}") FROM "gpu" WHERE {NODE} AND {TF} {GT}, "node", "gpu" fill(none)',
                         alias="$tag_node gpu $tag_gpu")], w=8, h=7, unit=unit)
    b.row("NIC and InfiniBand")
    nic = f'FROM "nic" WHERE {NODE} AND {TF}'
    by_dev = f'{GT}, "node", "device", "port" fill(none)'
    b.panel("state-timeline", "Link up (Ethernet interfaces and InfiniBand ports)",
            [_target(f'SELECT min("link_up") {nic} {by_dev}', alias="$tag_node $tag_device $tag_port")], w=24, h=6,
            mappings=[{"type": "value", "options": {"0": {"text": "down", "color": "red", "index": 0},
                                                     "1": {"text": "up", "color": "green", "index": 1}}}])
    b.panel("timeseries", "Ethernet traffic", [_target(
        f'SELECT mean("rx_bytes_per_s") AS "rx", mean("tx_bytes_per_s") AS "tx" {nic} AND "kind" = \'net\' '
        f'{by_dev}', alias="$tag_node $tag_device $col")], w=12, h=7, unit="Bps")
    b.panel("timeseries", "Ethernet errors and drops", [_target(
        f'SELECT max("rx_errors_per_s") AS "rx_errors", max("tx_errors_per_s") AS "tx_errors", '
        f'max("rx_dropped_per_s") AS "rx_dropped", max("tx_dropped_per_s") AS "tx_dropped", '
        f'max("carrier_changes") AS "carrier_changes" {nic} AND "kind" = \'net\' {by_dev}',
        alias="$tag_node $tag_device $col")], w=12, h=7, unit="short")
    b.panel("timeseries", "InfiniBand traffic", [_target(
        f'SELECT mean("port_rcv_bytes_per_s") AS "rcv", mean("port_xmit_bytes_per_s") AS "xmit" {nic} AND '
        f'"kind" = \'ib\' {by_dev}', alias="$tag_node $tag_device:$tag_port $col")], w=12, h=7, unit="Bps")
    b.panel("timeseries", "InfiniBand errors (totals) and rate", [_target(
        f'SELECT max("symbol_error") AS "symbol_error", max("link_downed") AS "link_downed", '
        f'max("port_rcv_errors") AS "port_rcv_errors", min("rate_gbps") AS "rate_gbps" {nic} AND "kind" = \'ib\' '
        f'{by_dev}', alias="$tag_node $tag_device:$tag_port $col")], w=12, h=7)
    b.panel("timeseries", "Every NIC counter, per second", [_target(
        f'SELECT mean(/_per_s$/) {nic} {by_dev}', alias="$tag_node $tag_device $tag_port $col")], w=24, h=8,
        description="Every counter the agent reads from /sys/class/net and /sys/class/infiniband, as a rate.")
    b.row("Host")
    for fields, title, unit in ((("cpu_percent", "mem_used_percent", "swap_used_percent"), "CPU and memory", "percent"),
                                (("load1", "load5", "load15"), "Load average", "short"),
                                (("mem_available_mib",), "Memory available", "decmbytes"),
                                (("procs",), "Processes", "short"),
                                (("disk_read_bytes_per_s", "disk_write_bytes_per_s", "net_recv_bytes_per_s",
                                  "net_sent_bytes_per_s"), "Host disk and network IO", "Bps")):
        sel = ", ".join(f'mean("{f}") AS "{f}"' for f in fields)
        b.panel("timeseries", title, [_target(f'SELECT {sel} FROM "host" WHERE {NODE} AND {TF} {GT}, "node" '
                                              f'fill(none)', alias="$tag_node $col")], w=12, h=7, unit=unit)
    b.row("Agent and training ranks")
    b.panel("timeseries", "Agent delivery (spool while the broker is away)",
            [_target(f'SELECT max("spool_batches") AS "spooled batches", max("in_flight") AS "in flight", '
                     f'max("delivery_errors") AS "delivery errors", max("dropped") AS "dropped", max("outages") AS '
                     f'"outages", max("collector_errors") AS "collector errors" FROM "agent" WHERE {NODE} AND {TF} '
                     f'{GT}, "node" fill(none)', alias="$tag_node $col")], w=12, h=7)
    b.panel("timeseries", "Step time of the ranks on these nodes",
            [_target(f'SELECT mean("step_time") FROM "train" WHERE {NODE} AND {TF} {GT}, "node", "rank" fill(none)',
                     alias="$tag_node rank $tag_rank")], w=12, h=7, unit="s")
    return b.json()


def job() -> dict[str, Any]:
    b = _Board("transom-job", "Transom: job timeline",
               "Loss and throughput of a job, with its faults, evictions, relaunches and checkpoints marked.",
               ["transom"])
    b.variable("job", 'SHOW TAG VALUES FROM "lifecycle" WITH KEY = "job"')
    ann = f'SELECT "text", "kind", "node" FROM "annotations" WHERE {JOB} AND {TF} AND '
    b.annotation("Faults", ann + '"source" = \'fault\' AND "kind" <> \'resolved\'', "red")
    b.annotation("Evictions", ann + '"kind" = \'eviction\'', "purple")
    b.annotation("Relaunches and resumes", ann + '("kind" = \'relaunch\' OR "kind" = \'resumed\')', "orange")
    b.annotation("Checkpoints", ann + '"kind" = \'checkpoint\'', "blue")
    b.panel("timeseries", "Loss", [_target(f'SELECT mean("loss") FROM "train" WHERE {JOB} AND {TF} {GT}, "job", '
                                           f'"rank" fill(none)', alias="$tag_job rank $tag_rank")], w=24, h=9)
    b.panel("timeseries", "Throughput (tokens/s per rank)",
            [_target(f'SELECT mean("tokens_per_s") FROM "train" WHERE {JOB} AND {TF} {GT}, "job", "rank" fill(none)',
                     alias="$tag_job rank $tag_rank")], w=24, h=8, unit="short")
    b.panel("timeseries", "Step (per launch generation)",
            [_target(f'SELECT max("step") FROM "train" WHERE {JOB} AND {TF} {GT}, "job", "generation" fill(none)',
                     alias="$tag_job generation $tag_generation")], w=12, h=7)
    b.panel("timeseries", "Step time",
            [_target(f'SELECT mean("step_time") FROM "train" WHERE {JOB} AND {TF} {GT}, "job", "rank" fill(none)',
                     alias="$tag_job rank $tag_rank")], w=12, h=7, unit="s")
    b.panel("table", "Lifecycle (the controller's decisions)",
            [_target(f'SELECT "state", "text" FROM "lifecycle" WHERE {JOB} AND {TF} GROUP BY "job", "event"',
                     fmt="table")], w=24, h=9)
    return b.json()


def tee() -> dict[str, Any]:
    b = _Board("transom-tee", "Transom: TEE (fault detection)",
               "What the detectors scored against their thresholds, and the faults they raised.", ["transom"])
    b.panel("timeseries", "Detector score against threshold",
            [_target(f'SELECT max("score") AS "score", max("threshold") AS "threshold" FROM "faults" WHERE {TF} '
                     f'{GT}, "detector" fill(none)', alias="$tag_detector $col")], w=24, h=8,
            custom={"drawStyle": "points", "pointSize": 6})
    b.panel("timeseries", "Faults by kind",
            [_target(f'SELECT count("active") FROM "faults" WHERE "resolved" = \'false\' AND {TF} {GT}, "kind" '
                     f'fill(none)', alias="$tag_kind")], w=12, h=8, custom={"drawStyle": "bars", "fillOpacity": 80})
    b.panel("bargauge", "Faults by kind (in range)",
            [_target(f'SELECT count("active") FROM "faults" WHERE "resolved" = \'false\' AND {TF} GROUP BY "kind"',
                     alias="$tag_kind")], w=12, h=8, options={"orientation": "horizontal"})
    b.panel("timeseries", "Detection delay (detected - observed)",
            [_target(f'SELECT max("delay_s") FROM "faults" WHERE {TF} {GT}, "kind" fill(none)', alias="$tag_kind")],
            w=12, h=8, unit="s", custom={"drawStyle": "points", "pointSize": 6})
    b.panel("timeseries", "Soft faults cleared (resolution events)",
            [_target(f'SELECT count("active") FROM "faults" WHERE "resolved" = \'true\' AND {TF} {GT}, "kind" '
                     f'fill(none)', alias="$tag_kind")], w=12, h=8, custom={"drawStyle": "bars"})
    b.panel("table", "Fault events",
            [_target(f'SELECT "summary", "score", "threshold", "delay_s", "fault_id" FROM "faults" WHERE {TF} '
                     f'GROUP BY "node", "kind", "severity", "detector", "resolved"', fmt="table")], w=24, h=9)
    return b.json()


def tce() -> dict[str, Any]:
    b = _Board("transom-tce", "Transom: TCE (checkpoints)",
               "How long saves stall training, how far replication lags training, and where restores came from.",
               ["transom"])
    b.variable("job", 'SHOW TAG VALUES FROM "checkpoints" WITH KEY = "job"')
    b.panel("timeseries", "Save stall (ckpt_stall_s: save() blocking time per rank)",
            [_target(f'SELECT max("ckpt_stall_s") FROM "train" WHERE {JOB} AND {TF} {GT}, "job", "rank" fill(none)',
                     alias="$tag_job rank $tag_rank")], w=12, h=8, unit="s",
            custom={"drawStyle": "bars", "fillOpacity": 80})
    b.panel("timeseries", "Replication lag: training step vs newest replicated checkpoint",
            [_target(f'SELECT max("step") AS "training step" FROM "train" WHERE {JOB} AND {TF} {GT}, "job" '
                     f'fill(previous)', "A", alias="$tag_job $col"),
             _target(f'SELECT max("step") AS "replicated checkpoint" FROM "checkpoints" WHERE "replicated" = 1 AND '
                     f'{JOB} AND {TF} {GT}, "job" fill(previous)', "B", alias="$tag_job $col")], w=12, h=8,
            description="The gap between the lines is the work a node loss would cost, in steps.")
    b.panel("timeseries", "Checkpoint copies by tier",
            [_target(f'SELECT last("copies_memory") AS "memory", last("copies_disk") AS "disk", last("copies_shared") '
                     f'AS "shared" FROM "checkpoints" WHERE {JOB} AND {TF} {GT}, "job" fill(none)',
                     alias="$tag_job $col")], w=12, h=8, custom={"drawStyle": "bars", "fillOpacity": 60})
    b.panel("timeseries", "Checkpoint size",
            [_target(f'SELECT last("bytes") FROM "checkpoints" WHERE {JOB} AND {TF} {GT}, "job" fill(none)',
                     alias="$tag_job")], w=12, h=8, unit="bytes", custom={"drawStyle": "points", "pointSize": 6})
    b.panel("table", "Where each restore came from",
            [_target(f'SELECT last("restore_tier") AS "restored from", last("restore_s") AS "restore_s" FROM "train" '
                     f'WHERE "restore_tier" >= 0 AND {JOB} AND {TF} GROUP BY "job", "generation", "rank", "node"',
                     fmt="table")], w=12, h=8, mappings=_TIER_MAPPING)
    b.panel("timeseries", "Restore time",
            [_target(f'SELECT max("restore_s") FROM "train" WHERE {JOB} AND {TF} {GT}, "job", "rank" fill(none)',
                     alias="$tag_job rank $tag_rank")], w=12, h=8, unit="s", custom={"drawStyle": "points"})
    return b.json()


def dashboards() -> dict[str, dict[str, Any]]:
    """File name -> dashboard JSON."""
    return {"cluster-overview.json": cluster(), "node-detail.json": node(), "job-timeline.json": job(),
            "tee.json": tee(), "tce.json": tce()}


def queries_of(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """``(where, query)`` of every InfluxQL query in a dashboard: targets, annotations, variables."""
    for p in dashboard["panels"]:
        for t in p.get("targets", ()):
            yield f"panel {p['id']} '{p['title']}' {t['refId']}", t["query"]
    for a in dashboard["annotations"]["list"]:
        if "query" in a:
            yield f"annotation '{a['name']}'", a["query"]
    for v in dashboard["templating"]["list"]:
        yield f"variable ${v['name']}", v["query"]


def write_all(directory: str | Path) -> list[Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, board in dashboards().items():
        path = out / name
        path.write_text(json.dumps(board, indent=2, sort_keys=True) + "\n")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print("usage: python -m transom.dashboards [DIR]\n\nWrite Transom's Grafana dashboards as JSON into DIR "
              "(default deploy/grafana/dashboards).")
        return 0
    for path in write_all(args[0] if args else Path(__file__).resolve().parents[1] / "deploy/grafana/dashboards"):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
