"""Node health for the pre-check, from the agents' latest batches on ``transom.metrics``.

:class:`HealthBook` keeps, per node, what the newest batch said; :meth:`HealthBook.problem`
answers why a node must not run ranks now, or None. A node fails when:

- no batch arrived from its agent within ``stale_s`` seconds (no fresh heartbeat);
- its newest batch has no GPU sample while ``require_gpus`` is set (GPUs not present);
- a GPU answers "GPU is lost" (``transom_gpu_lost``) in its newest batch;
- a GPU reported an XID within the last ``xid_window_s`` seconds;
- a NIC link that this book saw up is now down (``link_up == 0``); links that were never up
  (unused or administratively down interfaces) do not count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transom.contracts import DCGM, MetricBatch, Source

__all__ = ["HealthBook", "NodeHealth"]


@dataclass
class NodeHealth:
    last_ts: float = 0.0
    gpus: int = 0
    lost: list[int] = field(default_factory=list)
    last_xid: tuple[float, int, int] | None = None     # (ts, code, gpu)
    links_down: list[str] = field(default_factory=list)
    links_seen_up: set[str] = field(default_factory=set)


class HealthBook:
    def __init__(self, *, stale_s: float = 5.0, xid_window_s: float = 600.0, require_gpus: bool = True) -> None:
        self.stale_s = stale_s
        self.xid_window_s = xid_window_s
        self.require_gpus = require_gpus
        self.nodes: dict[str, NodeHealth] = {}

    def observe(self, batch: MetricBatch) -> None:
        h = self.nodes.setdefault(batch.node, NodeHealth())
        if batch.ts < h.last_ts:
            return
        h.last_ts = batch.ts
        gpu = batch.of(Source.GPU)
        h.gpus = len({s.index for s in gpu})
        h.lost = sorted({s.index for s in gpu if s.fields.get(DCGM.GPU_LOST)})
        for s in gpu:
            code = s.fields.get(DCGM.XID_ERRORS)
            if code:
                h.last_xid = (s.ts or batch.ts, int(code), s.index if s.index is not None else -1)
        down = []
        for s in batch.of(Source.NIC):
            if "link_up" not in s.fields:
                continue
            name = ":".join(x for x in (s.tags.get("device"), s.tags.get("port")) if x) or str(s.index)
            if s.fields["link_up"]:
                h.links_seen_up.add(name)
            elif name in h.links_seen_up:
                down.append(name)
        h.links_down = down

    def fresh(self, node: str, now: float | None = None) -> bool:
        h = self.nodes.get(node)
        return h is not None and (now or time.time()) - h.last_ts <= self.stale_s

    def problem(self, node: str, now: float | None = None) -> str | None:
        now = now or time.time()
        h = self.nodes.get(node)
        if h is None:
            return "no heartbeat from its agent"
        if now - h.last_ts > self.stale_s:
            return f"no fresh heartbeat (newest batch {now - h.last_ts:.1f}s old, limit {self.stale_s:.0f}s)"
        if h.lost:
            return f"GPU {','.join(map(str, h.lost))} lost"
        if h.last_xid and now - h.last_xid[0] <= self.xid_window_s:
            return f"XID {h.last_xid[1]} on GPU {h.last_xid[2]} {now - h.last_xid[0]:.0f}s ago"
        if self.require_gpus and h.gpus == 0:
            return "no GPU samples in its newest batch"
        if h.links_down:
            return f"link down: {','.join(h.links_down)}"
        return None
