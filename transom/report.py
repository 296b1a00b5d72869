"""``transom report JOB``: one self-contained HTML file telling the story of a job's run.

It reads Transom's topics (no consumer group; from the beginning), keeps what belongs to the
job, and writes one HTML file with inline SVG plots and no script or outside resource:

- loss and throughput over time (per launch generation), with faults, evictions, relaunches,
  resumes and checkpoints marked;
- checkpoint stalls (``ckpt_stall_s``, one ``checkpoint_save`` event per save and rank, sent by the
  checkpoint engine) and the checkpoint-ready events, and where each restore came from (the
  engine's ``restore`` events: ``restore_tier``, ``restore_s``; a rank that loaded several shards
  shows its slowest tier and their summed time);
- a per-node health heatmap over the job's time: no heartbeat, healthy, warning, fault;
- the timeline table of lifecycle events, faults and checkpoints.

:func:`collect` reads the topics into a :class:`RunData`, :func:`render` turns it into HTML (pure),
:func:`write_report` does both and returns the path. A job that the topics do not mention raises
:class:`ReportError`.
"""

from __future__ import annotations

import argparse
import html
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["ReportError", "RunData", "collect", "render", "write_report", "register", "TIER_NAMES"]

#: ``restore_tier`` values of the training reports.
TIER_NAMES = {0: "local memory", 1: "peer memory", 2: "local disk", 3: "shared store"}

#: Health levels of the heatmap, with their colour and meaning.
_HEALTH = {0: ("#d0d4da", "no heartbeat"), 1: ("#4caf50", "healthy"), 2: ("#ffb300", "warning"),
           3: ("#e53935", "fault")}
_MARKS = {"fault": "#e53935", "eviction": "#8e24aa", "relaunch": "#fb8c00", "resumed": "#1e88e5",
          "healed in job": "#00897b", "checkpoint": "#90a4ae", "completed": "#2e7d32", "failed": "#b71c1c"}
_GEN_COLOURS = ("#1565c0", "#2e7d32", "#6a1b9a", "#ef6c00", "#00838f", "#ad1457")


class ReportError(RuntimeError):
    """The report cannot be made (the job is unknown to the topics)."""


@dataclass
class RunData:
    """What the topics say about one job."""

    job: str
    train: list[dict[str, Any]] = field(default_factory=list)      # ts, node, rank, generation, fields...
    faults: list[Any] = field(default_factory=list)                # contracts.FaultEvent
    lifecycle: list[Any] = field(default_factory=list)             # contracts.LifecycleEvent
    checkpoints: list[Any] = field(default_factory=list)           # contracts.CheckpointReady
    heartbeats: dict[str, list[float]] = field(default_factory=dict)   # node -> batch times
    gpu_lost: dict[str, list[float]] = field(default_factory=dict)     # node -> times a GPU was lost
    nodes: list[str] = field(default_factory=list)

    @property
    def span(self) -> tuple[float, float]:
        times = [ev.ts for ev in self.lifecycle] + [t["ts"] for t in self.train]
        times += [c.ts for c in self.checkpoints] + [f.observed_ts for f in self.faults]
        if not times:
            return (0.0, 1.0)
        lo, hi = min(times), max(times)
        return (lo, hi if hi > lo else lo + 1.0)


# --------------------------------------------------------------------------- reading

def collect(bootstrap: str, job: str, *, progress: Any = None) -> RunData:
    """Read the topics at ``bootstrap`` and keep what concerns ``job``."""
    from . import contracts
    from .kafka import read_topic

    say = progress or (lambda text: None)
    data = RunData(job)

    def events(topic: str) -> Iterable[Any]:
        n = 0
        for _key, value, _p, _o in read_topic(bootstrap, topic):
            n += 1
            if n % 5000 == 0:
                say(f"read {n} messages of {topic}")
            try:
                yield contracts.decode(topic, value)
            except contracts.ContractError:
                continue                     # the dead-letter topic already has it
        say(f"read {n} messages of {topic}")

    data.lifecycle = sorted((ev for ev in events(contracts.HISTORY) if ev.job == job), key=lambda e: e.seq)
    data.checkpoints = sorted((c for c in events(contracts.CHECKPOINTS) if c.job == job), key=lambda c: c.ts)
    nodes: set[str] = set()
    for ev in data.lifecycle:
        for key in ("nodes", "spares", "evicted"):
            for value in (ev.snapshot.get(key), ev.detail.get(key)):    # submit_requested's spares is a count
                if isinstance(value, str):
                    nodes.add(value)
                elif isinstance(value, (list, tuple)):
                    nodes.update(v for v in value if isinstance(v, str))
    batches = []
    for batch in events(contracts.METRICS):
        mine = False
        for s in batch.of(contracts.Source.TRAIN):
            if s.tags.get("job") == job:
                mine = True
                data.train.append({"ts": s.ts or batch.ts, "node": batch.node, "rank": s.index or 0,
                                   "generation": int(s.tags.get("generation") or 0),
                                   "event": s.tags.get("event") or "", **s.fields})
        if mine or batch.job == job:
            nodes.add(batch.node)
        batches.append(batch)
    data.nodes = sorted(nodes)
    lo, hi = data.span if (data.lifecycle or data.train) else (0.0, 0.0)
    for batch in batches:
        if batch.node in nodes and lo - 60 <= batch.ts <= hi + 60:
            data.heartbeats.setdefault(batch.node, []).append(batch.ts)
            for s in batch.of(contracts.Source.GPU):
                if s.fields.get(contracts.DCGM.GPU_LOST):
                    data.gpu_lost.setdefault(batch.node, []).append(s.ts or batch.ts)
    data.faults = sorted((f for f in events(contracts.FAULTS)
                          if f.job == job or (f.job is None and f.node in nodes and lo <= f.observed_ts <= hi)),
                         key=lambda f: f.observed_ts)
    if not (data.lifecycle or data.train or data.checkpoints):
        raise ReportError(f"the topics at {bootstrap} hold no lifecycle, training or checkpoint event of job "
                          f"{job!r}; check the job id and --bootstrap")
    return data


# --------------------------------------------------------------------------- SVG helpers

def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e6:
        return f"{v / 1e6:.3g}M"
    if abs(v) >= 1e4:
        return f"{v / 1e3:.3g}k"
    return f"{v:.4g}"


@dataclass
class _Mark:
    x: float
    kind: str
    label: str


def _chart(series: Sequence[tuple[str, str, Sequence[tuple[float, float]]]], marks: Sequence[_Mark], *,
           x_range: tuple[float, float], ylabel: str, bars: bool = False, width: int = 960,
           height: int = 240) -> str:
    """An SVG line (or bar) chart of ``series`` = (label, colour, [(x, y)]), x in seconds from start."""
    left, right, top, bottom = 64, 16, 12, 34
    pw, ph = width - left - right, height - top - bottom
    ys = [y for _l, _c, pts in series for _x, y in pts if math.isfinite(y)]
    if not ys:
        return f'<p class="empty">no {_esc(ylabel)} reported</p>'
    y0, y1 = min(ys), max(ys)
    if bars or y0 > 0 and y0 < 0.25 * y1:
        y0 = min(0.0, y0)
    if y1 <= y0:
        y1 = y0 + 1.0
    pad = 0.05 * (y1 - y0)
    y0, y1 = (y0 - pad if y0 != 0 else 0.0), y1 + pad
    x0, x1 = x_range

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + ph - (y - y0) / (y1 - y0) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="100%" '
           f'role="img" aria-label="{_esc(ylabel)}">',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafbfc" stroke="#c8ccd2"/>']
    for t in _ticks(y0, y1, 4):
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#e4e7eb"/>'
                   f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end" class="tick">{_fmt(t)}</text>')
    for t in _ticks(x0, x1, 8):
        out.append(f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="#888"/>'
                   f'<text x="{sx(t):.1f}" y="{top + ph + 16}" text-anchor="middle" class="tick">{_fmt(t)}s</text>')
    out.append(f'<text x="14" y="{top + ph / 2:.0f}" transform="rotate(-90 14 {top + ph / 2:.0f})" '
               f'text-anchor="middle" class="axis">{_esc(ylabel)}</text>')
    for m in marks:
        colour = _MARKS.get(m.kind, "#607d8b")
        dash = ' stroke-dasharray="3 3"' if m.kind == "checkpoint" else ""
        out.append(f'<line x1="{sx(m.x):.1f}" x2="{sx(m.x):.1f}" y1="{top}" y2="{top + ph}" stroke="{colour}" '
                   f'stroke-width="{1 if m.kind == "checkpoint" else 2}"{dash}><title>{_esc(m.label)}</title></line>')
    for label, colour, pts in series:
        pts = [(x, y) for x, y in pts if math.isfinite(y)]
        if bars:
            w = max(2.0, pw / max(60, len(pts) * 3))
            for x, y in pts:
                out.append(f'<rect x="{sx(x) - w / 2:.1f}" y="{sy(y):.1f}" width="{w:.1f}" '
                           f'height="{max(0.5, sy(y0) - sy(y)):.1f}" fill="{colour}">'
                           f'<title>{_esc(label)}: {_fmt(y)} at {x:.1f}s</title></rect>')
        else:
            d = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for i, (x, y) in enumerate(pts))
            out.append(f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="1.6">'
                       f'<title>{_esc(label)}</title></path>')
    out.append("</svg>")
    legend = "".join(f'<span class="key"><i style="background:{c}"></i>{_esc(l)}</span>' for l, c, _p in series)
    return "".join(out) + f'<div class="legend">{legend}</div>'


# --------------------------------------------------------------------------- the story

def _marks(data: RunData, t0: float) -> list[_Mark]:
    from transom.streams.sink import lifecycle_kind

    marks = [_Mark(f.observed_ts - t0, "fault", f"{f.kind.value} on {f.node}: {f.summary}")
             for f in data.faults if not f.resolved]
    for ev in data.lifecycle:
        kind = lifecycle_kind(ev)
        if kind in ("eviction", "relaunch", "resumed", "completed", "failed"):
            marks.append(_Mark(ev.ts - t0, kind, f"{ev.name}: {_detail(ev.detail)}"))
        elif ev.name == "healed":
            marks.append(_Mark(ev.ts - t0, "healed in job", f"{ev.name}: {_detail(ev.detail)}"))
    marks += [_Mark(c.ts - t0, "checkpoint", f"checkpoint step {c.step} ready") for c in data.checkpoints]
    return marks


def _detail(detail: dict) -> str:
    keep = ("path", "reason", "evicted", "replacement", "spare", "generation", "resume_step", "step", "steps_lost",
            "seconds", "fallback", "summary")
    return ", ".join(f"{k}={detail[k]}" for k in keep if k in detail)


def _train_series(data: RunData, t0: float, name: str) -> list[tuple[str, str, list[tuple[float, float]]]]:
    """``name`` of rank 0 (the ranks train the same model), one series per generation."""
    by_gen: dict[int, dict[float, float]] = defaultdict(dict)
    for t in data.train:
        if t.get("rank") == 0 and name in t:
            by_gen[t["generation"]][t["ts"] - t0] = float(t[name])
    return [(f"generation {g}", _GEN_COLOURS[i % len(_GEN_COLOURS)], sorted(pts.items()))
            for i, (g, pts) in enumerate(sorted(by_gen.items()))]


def _stall_series(data: RunData, t0: float) -> list[tuple[str, str, list[tuple[float, float]]]]:
    seen: dict[tuple[int, int], tuple[float, float]] = {}
    for t in data.train:
        if t.get("ckpt_stall_s") and "step" in t:
            key = (t["generation"], int(t["step"]))
            if key not in seen or t["ckpt_stall_s"] > seen[key][1]:   # the slowest rank stalls the step
                seen[key] = (t["ts"] - t0, float(t["ckpt_stall_s"]))
    return [("save stall (slowest rank)", "#5e35b1", sorted(seen.values()))] if seen else []


def _heatmap(data: RunData, t0: float, t1: float, max_bins: int = 60) -> str:
    if not data.nodes:
        return '<p class="empty">no node reported for this job</p>'
    # a cell spans at least two agent intervals, so a healthy node never shows a gap
    gaps = sorted(b - a for times in data.heartbeats.values() for a, b in zip(sorted(times), sorted(times)[1:]))
    interval = gaps[len(gaps) // 2] if gaps else 1.0
    bins = max(1, min(max_bins, int((t1 - t0) / (2 * interval))))
    width = (t1 - t0) / bins
    cell_w, cell_h, left, top = 14, 18, 90, 8
    grid: dict[str, list[int]] = {}
    for node in data.nodes:
        row = [0] * bins
        for ts in data.heartbeats.get(node, ()):
            b = int((ts - t0) / width)
            if 0 <= b < bins:
                row[b] = max(row[b], 1)
        for f in data.faults:
            if f.node == node and not f.resolved:
                b = int((f.observed_ts - t0) / width)
                if 0 <= b < bins:
                    row[b] = max(row[b], 3 if f.severity.value == "critical" else 2)
        for ts in data.gpu_lost.get(node, ()):
            b = int((ts - t0) / width)
            if 0 <= b < bins:
                row[b] = 3
        grid[node] = row
    w, h = left + bins * cell_w + 10, top + len(grid) * cell_h + 24
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="100%" role="img" '
           f'aria-label="node health">']
    for r, (node, row) in enumerate(grid.items()):
        y = top + r * cell_h
        out.append(f'<text x="{left - 8}" y="{y + 13}" text-anchor="end" class="tick">{_esc(node)}</text>')
        for b, level in enumerate(row):
            colour, meaning = _HEALTH[level]
            out.append(f'<rect x="{left + b * cell_w}" y="{y}" width="{cell_w - 1}" height="{cell_h - 2}" '
                       f'fill="{colour}"><title>{_esc(node)} {b * width:.0f}-{(b + 1) * width:.0f}s: '
                       f'{meaning}</title></rect>')
    y = top + len(grid) * cell_h + 14
    out.append(f'<text x="{left}" y="{y}" class="tick">0s</text>'
               f'<text x="{left + bins * cell_w}" y="{y}" text-anchor="end" class="tick">{t1 - t0:.0f}s</text></svg>')
    legend = "".join(f'<span class="key"><i style="background:{c}"></i>{m}</span>' for c, m in _HEALTH.values())
    return "".join(out) + f'<div class="legend">{legend}</div>'


def _timeline(data: RunData, t0: float) -> str:
    rows: list[tuple[float, str, str, str]] = []
    for ev in data.lifecycle:
        rows.append((ev.ts, "lifecycle", f"{ev.name} &rarr; {_esc(ev.state)}", _esc(_detail(ev.detail))))
    for f in data.faults:
        what = f"{'resolved ' if f.resolved else ''}{f.kind.value} on {f.node}"
        rows.append((f.observed_ts, "fault", _esc(what), _esc(f"{f.summary} [{f.detector}, {f.severity.value}, "
                                                             f"detected +{f.detected_ts - f.observed_ts:.2f}s]")))
    for c in data.checkpoints:
        tiers = sorted({cp.tier.value for cp in c.copies})
        rows.append((c.ts, "checkpoint", f"step {c.step} ready",
                     _esc(f"{len(c.shards)} shards, {sum(s.size for s in c.shards) / 1e6:.1f} MB, copies in "
                          f"{', '.join(tiers)}")))
    rows.sort(key=lambda r: r[0])
    body = "".join(f'<tr class="{kind}"><td>{time.strftime("%H:%M:%S", time.localtime(ts))}</td>'
                   f'<td>+{ts - t0:.1f}s</td><td>{kind}</td><td>{what}</td><td>{detail}</td></tr>'
                   for ts, kind, what, detail in rows)
    return ('<table><thead><tr><th>time</th><th>since start</th><th>source</th><th>event</th><th>detail</th>'
            f'</tr></thead><tbody>{body}</tbody></table>')


def _restores(data: RunData) -> str:
    rows: dict[tuple[int, int], tuple[str, int, float | None]] = {}
    for t in data.train:
        if "restore_tier" in t:
            key, s = (t["generation"], t["rank"]), t.get("restore_s")
            if key in rows and t.get("event"):          # one more shard loaded by this rank: its slowest tier,
                node, tier, before = rows[key]          # the time of all
                s = None if s is None and before is None else (s or 0.0) + (before or 0.0)
                rows[key] = (t["node"], max(tier, int(t["restore_tier"])), s)
            else:
                rows[key] = (t["node"], int(t["restore_tier"]), s)
    if not rows:
        return '<p class="empty">no restore reported (the job never resumed from a checkpoint)</p>'
    body = "".join(f"<tr><td>{g}</td><td>{r}</td><td>{_esc(n)}</td><td>{_esc(TIER_NAMES.get(tier, tier))}</td>"
                   f"<td>{'' if s is None else f'{s:.3f}'}</td></tr>" for (g, r), (n, tier, s) in sorted(rows.items()))
    return ("<table><thead><tr><th>generation</th><th>rank</th><th>node</th><th>restored from</th>"
            f"<th>restore s</th></tr></thead><tbody>{body}</tbody></table>")


def recoveries(data: RunData) -> list[dict[str, Any]]:
    """Each recovery of the job: the path it took (``in-job``, ``relaunch``, or ``in-job -> relaunch`` when the
    in-job heal fell back), why, and its cost in seconds (decision to the re-formed group, or to the first
    step of the relaunched generation; None while unfinished)."""
    out: list[dict[str, Any]] = []
    for ev in data.lifecycle:
        if ev.name == "healing":
            out.append({"path": "in-job", "ts": ev.ts, "reason": ev.detail.get("reason", ""), "seconds": None,
                        "rank": ev.detail.get("rank"), "to": ev.detail.get("spare")})
        elif ev.name == "healed" and out and out[-1]["path"] == "in-job" and out[-1]["seconds"] is None:
            out[-1]["seconds"] = round(ev.ts - out[-1]["ts"], 3)
        elif ev.name == "relaunching":
            if ev.detail.get("fallback") and out and out[-1]["path"] == "in-job" and out[-1]["seconds"] is None:
                out[-1].update(path="in-job -> relaunch", fallback=ev.detail["fallback"])
                out[-1]["reason"] += f"; fallback: {ev.detail.get('reason', '')}"
            else:
                out.append({"path": "relaunch", "ts": ev.ts, "reason": ev.detail.get("reason", ""), "seconds": None,
                            "rank": None, "to": ev.detail.get("replacement")})
        elif ev.name == "resumed" and out and out[-1]["path"] != "in-job" and out[-1]["seconds"] is None:
            if ev.detail.get("seen") == "exit":    # it ran to its end before a step of it was seen: cost unknown
                out[-1]["reason"] += "; the relaunch ran to its end before a step of it was reported"
            else:
                out[-1]["seconds"] = round(ev.ts - out[-1]["ts"], 3)
    return out


def _recoveries(data: RunData, t0: float) -> str:
    rows = recoveries(data)
    if not rows:
        return '<p class="empty">no recovery: the job took no fault it had to recover from</p>'
    def cost(r: dict[str, Any]) -> str:
        return "" if r["seconds"] is None else f"{r['seconds']:.2f}"

    body = "".join(f"<tr><td>{_esc(r['path'])}</td><td>+{r['ts'] - t0:.1f}s</td><td>{cost(r)}</td>"
                   f"<td>{_esc(r['to'] or '')}</td><td>{_esc(r['reason'])}</td></tr>" for r in rows)
    return ("<table><thead><tr><th>path</th><th>decided</th><th>cost s</th><th>replacement</th><th>why</th>"
            f"</tr></thead><tbody>{body}</tbody></table>")


def _summary(data: RunData) -> list[tuple[str, str]]:
    last = data.lifecycle[-1] if data.lifecycle else None
    steps = [int(t["step"]) for t in data.train if "step" in t]
    # the fault the controller acted on (else the first critical one) tells detection and recovery
    acted = {ev.cause.get("fault_id") for ev in data.lifecycle if ev.name == "relaunching"}
    live = [f for f in data.faults if not f.resolved]
    first_fault = next((f for f in live if f.fault_id in acted), None) or \
        next((f for f in live if f.severity.value == "critical"), None)
    resumed = [ev for ev in data.lifecycle if ev.name == "resumed"]
    out = [("state", last.state if last else "unknown"),
           ("newest step", str(max(steps)) if steps else "n/a"),
           ("launch generations", str(1 + max((t["generation"] for t in data.train), default=0))),
           ("faults", str(sum(1 for f in data.faults if not f.resolved))),
           ("checkpoints", str(len(data.checkpoints)))]
    if first_fault:
        out.append(("time to detect", f"{first_fault.detected_ts - first_fault.observed_ts:.2f} s"))
        after = [ev for ev in resumed if ev.ts >= first_fault.observed_ts and ev.detail.get("seen") != "exit"]
        if after:
            out.append(("time to recover", f"{after[0].ts - first_fault.observed_ts:.1f} s (fault to first step "
                                           f"after resume)"))
    lost = [ev.detail.get("steps_lost") for ev in resumed if ev.detail.get("steps_lost") is not None]
    if lost:
        out.append(("steps lost", ", ".join(str(v) for v in lost)))
    rec = recoveries(data)
    if rec:
        paths = [r["path"] for r in rec]
        out.append(("recoveries", ", ".join(f"{paths.count(p)} {p}" for p in dict.fromkeys(paths))))
    return out


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1040px;
color:#1f2328;background:#fff}h1{font-size:22px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px;
border-bottom:1px solid #e4e7eb;padding-bottom:4px}.sub{color:#59636e}.cards{display:flex;flex-wrap:wrap;gap:8px;
margin-top:12px}.card{border:1px solid #d8dee4;border-radius:6px;padding:6px 12px}.card b{display:block;
font-size:18px}.tick{font-size:11px;fill:#59636e}.axis{font-size:12px;fill:#1f2328}.legend{font-size:12px;
color:#59636e;margin:2px 0 0 64px}.key{margin-right:14px;white-space:nowrap}.key i{display:inline-block;width:10px;
height:10px;margin-right:4px;border-radius:2px}table{border-collapse:collapse;width:100%;font-size:13px}
th,td{text-align:left;padding:3px 8px;border-bottom:1px solid #eef0f2;vertical-align:top}th{background:#f6f8fa}
tr.fault td:nth-child(3){color:#c62828;font-weight:600}tr.checkpoint td:nth-child(3){color:#607d8b}
.empty{color:#8c959f;font-style:italic}
"""


def render(data: RunData) -> str:
    """The report of ``data`` as one HTML document (inline SVG and CSS; no script, nothing fetched)."""
    t0, t1 = data.span
    marks = _marks(data, t0)
    x_range = (0.0, t1 - t0)
    mark_legend = "".join(f'<span class="key"><i style="background:{c}"></i>{k}</span>' for k, c in _MARKS.items())
    cards = "".join(f'<div class="card">{_esc(k)}<b>{_esc(v)}</b></div>' for k, v in _summary(data))
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0))
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Transom run report: {_esc(data.job)}</title><style>{_CSS}</style></head><body>",
        f"<h1>Transom run report: job {_esc(data.job)}</h1>",
        f'<div class="sub">from {started}, {t1 - t0:.0f} s; nodes {_esc(", ".join(data.nodes) or "none")}</div>',
        f'<div class="cards">{cards}</div>',
        "<h2>Loss</h2>", _chart(_train_series(data, t0, "loss"), marks, x_range=x_range, ylabel="loss"),
        "<h2>Throughput</h2>", _chart(_train_series(data, t0, "tokens_per_s"), marks, x_range=x_range,
                                      ylabel="tokens/s (rank 0)"),
        f'<div class="legend">markers: {mark_legend}</div>',
        "<h2>Checkpoint stalls</h2>", _chart(_stall_series(data, t0), marks, x_range=x_range,
                                             ylabel="save stall s", bars=True),
        "<h2>Recoveries</h2>", _recoveries(data, t0),
        "<h2>Restores</h2>", _restores(data),
        "<h2>Node health</h2>", _heatmap(data, t0, t1),
        "<h2>Timeline</h2>", _timeline(data, t0),
        f'<p class="sub">written by transom report at {time.strftime("%Y-%m-%d %H:%M:%S")}</p>',
        "</body></html>",
    ]
    return "\n".join(parts)


def write_report(bootstrap: str, job: str, path: str | Path | None = None, *, progress: Any = None) -> Path:
    """Read the topics, render the report of ``job`` and write it (default ``transom-report-JOB.html``)."""
    out = Path(path) if path else Path(f"transom-report-{job}.html")
    data = collect(bootstrap, job, progress=progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(data), encoding="utf-8")
    return out


# --------------------------------------------------------------------------- command

def register(sub: argparse._SubParsersAction) -> None:
    from .cli import add_bootstrap

    p = sub.add_parser("report", help="write one self-contained HTML report of a job's run",
                       description="Read Transom's topics and write one HTML file (no outside resources) with "
                                   "loss and throughput over time marked with faults and recoveries, checkpoint "
                                   "stalls and restores, a per-node health heatmap and the timeline table.")
    p.add_argument("job", help="the job id")
    add_bootstrap(p)
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="where to write the report (default: transom-report-JOB.html)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from .cli import need_bootstrap

    need_bootstrap(args.bootstrap)
    try:
        path = write_report(args.bootstrap, args.job, args.output,
                            progress=lambda text: print(f"report: {text}", file=sys.stderr, flush=True))
    except ReportError as exc:
        print(f"transom report: error: {exc}", file=sys.stderr)
        return 1
    print(path.resolve(), flush=True)
    return 0
