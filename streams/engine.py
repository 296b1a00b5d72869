"""The TEE engine: every rule and detector over per-node state, with de-duplication (no Faust).

Contract::

    engine = TEEEngine(TEEConfig(...))
    engine.process(batch) -> list[FaultEvent]      # one node's batch, in the node's order
    engine.check_heartbeats(now) -> list[FaultEvent]   # call about once a second
    engine.forget(nodes)                           # the worker no longer owns these nodes
    engine.flush(now) -> list[FaultEvent]          # decide soft windows still open (end of a replay)
    engine.restore(faults, now) -> int             # what an earlier worker already emitted (on start)
    engine.feeds() -> list[JobFeed]                # split: what the jobs' workers need (node side)
    engine.job_feed(feed) -> list[FaultEvent]      # split: judge a job's hangs and peers (job side)

Split (``split_peers=True``, the TEE workers): what needs every node of a job together is not
decided in ``process``, which runs on the worker that reads the node. The peers detector's closed
windows are collected as summaries and the hang rule's view of each batch as a
:class:`~transom.contracts.RankReport`; ``feeds()`` hands them out, one :class:`~transom.contracts.JobFeed`
per job (for the job's worker, through ``transom.peer-windows``), and ``job_feed(feed)`` is that
worker's side: the hang detector judges the job's ranks with every node's reports, and the job's
windows are held until complete (:mod:`.jobwindows`) and decided with a detector of the job's own
(its models fitted on that job's clean history), so that what is decided for a job does not depend
on which other jobs share its worker, nor on how many workers there are. (The node side then knows
no hang: its own soft detectors, temporal and ECOD, are not told a hang explains a symptom; the
peers detector is, on the job side.)

Merging: a fault of the same class (``evidence["class"]``) on the same node and device (GPU, port)
whose trigger lies within ``cooldown_s`` (sample time) of the last one is merged into it (counted in
``counts["merged"]``, not emitted), so an XID 48 and the DBE counter that moves with it, or a
link that flaps for minutes, make one fault; once the last one is resolved (a soft fault's
``resolved`` event), the next is a fault of its own. A soft fault whose anomaly began while a hard fault of
its node went on, or within ``soft_consecutive`` windows after, is explained by it and dropped
(``counts["explained"]``); one that began later is a fault of its own. Resolution events
(``resolved=True``) pass through with the id of the fault they resolve.

A fault id is emitted at most once per engine (the last ``dedup_capacity`` ids are remembered),
so a redelivered batch yields nothing new; in another process the same input yields the same
ids, for consumers to de-duplicate. The engine is not thread-safe: one worker, one engine.

Restart: a worker that starts (after a crash, or a partition moved to it) re-reads metrics from
the last committed offset, so it sees again batches whose faults the previous worker may already
have sent. :meth:`TEEEngine.restore` takes the faults already on ``transom.faults`` (the worker
reads them on start, :mod:`.resume`): their ids are remembered as emitted, their triggers feed the
merge cool-down, and the once-per-condition rules of the last ``cooldown_s`` (GPU lost, NaN loss,
hang) are told what was reported for each node, so a redelivered batch, or a later sample of a
condition already reported, yields nothing new: a worker killed and restarted neither loses nor
duplicates a fault event.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import replace
from typing import Callable, Iterable, Mapping

from transom import contracts
from transom.contracts import FaultEvent, JobFeed, MetricBatch, PeerWindow, RankReport
from transom.log import get

from .config import TEEConfig
from .classes import HARD
from .hangs import HangDetector
from .jobwindows import apart_from_marks, is_read_mark
from .rules import (EccRule, GpuLostRule, HeartbeatRule, LinkRule, NanLossRule, NodeState, RowRemapRule, Rule,
                    XidRule)

__all__ = ["TEEEngine", "encode_feed", "FEED_MAX_BYTES"]

#: Split, node side: a :class:`JobFeed` encoded to more than this is sent in parts (:func:`encode_feed`): Kafka
#: refuses a message over 1 MB by default (the producer's ``max.request.size``, the broker's
#: ``message.max.bytes``), and a refused feed stopped the worker.
FEED_MAX_BYTES = 512 * 1024

#: Classes whose rules already report once per condition (a new condition is a new fault: a second
#: NaN after a finite loss, a link that flaps again after a quiet window, goes down again after it came up).
_ONCE = frozenset({"node_lost", "hang", "nan_loss", "gpu_lost", "link_flap", "link_down"})
#: Event clock, job side: seconds (sample time) a job's rank reports wait for a node of the job that is
#: further behind (a replay reads partitions up to tens of minutes of sample time apart; a node that
#: left the job stops being waited for after this)
JOB_REPORTS_WAIT_S = 3600.0
#: Event clock, job side: a node behind its job (reports and windows) is given up on only once nothing of it
#: (a report, a window, a read mark) came for this many seconds of the worker's own time: a worker on a busy
#: machine reads a replay hours of sample time behind another worker, and a node it reads is behind, not gone
#: (its worker sends marks every feed; a stopped worker's partitions are taken over within the 6 s session)
GONE_QUIET_S = 30.0

log = get("tee")


def encode_feed(feed: JobFeed, most_bytes: int = FEED_MAX_BYTES) -> list[bytes]:
    """``feed`` encoded for ``transom.peer-windows``, in parts of at most ``most_bytes`` each where it is larger
    (halves of its windows and of its reports, in order, the read marks in the last part; a part of one item
    is sent whatever its size)."""
    value = contracts.encode(feed)
    if len(value) <= most_bytes or len(feed.windows) + len(feed.ranks) <= 1:
        return [value]
    ranks, marks = apart_from_marks(feed.ranks)
    w, r = len(feed.windows) // 2, len(ranks) // 2
    if not feed.windows and not ranks:          # only marks: halve them
        first, second = JobFeed(feed.job, (), marks[:len(marks) // 2]), JobFeed(feed.job, (), marks[len(marks) // 2:])
    else:
        first = JobFeed(job=feed.job, windows=feed.windows[:w], ranks=ranks[:r])
        second = JobFeed(job=feed.job, windows=feed.windows[w:], ranks=ranks[r:] + marks)
    return encode_feed(first, most_bytes) + encode_feed(second, most_bytes)


class TEEEngine:
    """Hard-fault rules and soft-fault detectors over each node's window."""

    def __init__(self, config: TEEConfig | None = None, *, clock: Callable[[], float] = time.time,
                 anomaly: bool = True, split_peers: bool = False) -> None:
        self.config = config or TEEConfig()
        self.clock = clock
        self._hang = HangDetector(self.config)
        self.rules: list[Rule] = [XidRule(), GpuLostRule(), NanLossRule(), self._hang, EccRule(),
                                  RowRemapRule(), LinkRule(self.config)]
        self.peers = None
        if anomaly and "ecod" in self.config.soft_detectors:
            from .detectors import GpuAnomalyDetector
            self.rules.append(GpuAnomalyDetector(self.config))
        if anomaly and "peers" in self.config.soft_detectors:
            from .peers import PeerDetector
            self.peers = PeerDetector(self.config)
            self.rules.append(self.peers)
        if anomaly and "temporal" in self.config.soft_detectors:
            from .temporal import TemporalDetector
            self.rules.append(TemporalDetector(self.config))
        self.job_windows = None
        self.split = split_peers
        self._job_peers: dict[str, object] = {}         # split, job side: job -> its PeerDetector
        self._peer_hard_at: dict[str, float] = {}       # split, job side: node -> its last hard fault (feed, hangs)
        self._ranks_out: dict[str, list[RankReport]] = {}   # split, node side: job -> rank reports not yet sent
        #: split, job side, event clock: a job's rank reports, released in time order (.jobwindows.JobReports)
        self.job_reports = None
        if split_peers:        # node side: the hang rule only collects what the job's worker judges
            self.rules[self.rules.index(self._hang)] = _RankCollector(self._ranks_out, self._hang)
            if self.config.clock == "event":
                from .jobwindows import JobReports
                self.job_reports = JobReports(JOB_REPORTS_WAIT_S, quiet_s=GONE_QUIET_S)
        if self.peers is not None and split_peers:
            from .jobwindows import JobWindows
            self.peers.outbox = []
            wait = self.config.soft_peer_wait or (360 if self.config.clock == "event" else 3)
            self.job_windows = JobWindows(wait, quiet_s=GONE_QUIET_S if self.config.clock == "event" else 0.0)
        self.heartbeat = HeartbeatRule(self.config)
        self._read: dict[int, float] = {}    # metrics partition -> the newest sample time read on it
        if not split_peers:      # one engine reads every node: it knows how far past each one it read
            self._hang.read_past_of = self._read_past
        self._nodes: dict[str, NodeState] = {}
        self._emitted: OrderedDict[str, None] = OrderedDict()
        self._last: dict[tuple, float] = {}            # (node, class, device) -> last trigger ts
        self._hard_at: dict[str, float] = {}           # node -> last hard fault trigger ts
        self._seeds: dict[str, list[FaultEvent]] = {}  # node -> restored faults not yet applied to its state
        self.counts = {"batches": 0, "faults": 0, "repeats": 0, "merged": 0, "explained": 0}

    @property
    def nodes(self) -> Mapping[str, NodeState]:
        return self._nodes

    def process(self, batch: MetricBatch, now: float | None = None, partition: int = 0) -> list[FaultEvent]:
        """Run every rule over ``batch`` (read from metrics ``partition``: one stream where there are none);
        return the faults not emitted before."""
        now = self.clock() if now is None else now
        state = self._nodes.get(batch.node)
        if state is None:
            state = self._nodes[batch.node] = NodeState(batch.node)
            for f in self._seeds.pop(batch.node, ()):
                _seed_state(state, f)
        state.note_cadence(batch)
        state.last_batch_ts = max(state.last_batch_ts, batch.ts)
        state.partition = partition
        state.read_mark = self._read[partition] = max(self._read.get(partition, 0.0), batch.ts)
        # the newest arrival: a batch delivered again or late (a producer's retry, a re-read after a
        # rebalance) must not make the node look silent on the event clock, where ``now`` is its sample time
        state.last_received = max(state.last_received, now)
        if batch.job:
            state.job = batch.job
        trains = batch.of(contracts.Source.TRAIN)
        if trains:      # the job its ranks train in: their silence is the job's worker's to judge
            state.trains_in = next((s.tags.get("job") or batch.job for s in trains
                                    if s.fields.get("alive") == 1 and not s.tags.get("event")), None) or None
        self.counts["batches"] += 1
        found: list[FaultEvent] = []
        outbox = self.peers.outbox if self.peers is not None else None
        closed = len(outbox) if outbox is not None else 0
        for rule in self.rules:
            found.extend(rule.observe(state, batch, now))
        if outbox is not None and len(outbox) > closed:
            # a window this batch closed carries the node's hard faults up to its end, not those of the
            # batches read before the feed leaves (a replay reads minutes of a node between two feeds)
            hard = self._hard_at.get(batch.node)
            if hard is not None:
                outbox[closed:] = [replace(w, hard_ts=hard) for w in outbox[closed:]]
        if self._hard_ongoing(state, batch.ts):
            self._hard_at[batch.node] = batch.ts    # soft symptoms of an ongoing hard fault are explained
        return self._new(found)

    def _read_past(self, node: str) -> float:
        """How far this engine read ``node``'s partition past the node's newest batch: how far the sample time
        of the partition's newest batch moved since that batch was read (the other nodes' progress on the same
        partition, which a worker reading late cannot fake, and a difference of one maximum, which a node's
        skewed clock does not shift)."""
        st = self._nodes.get(node)
        return 0.0 if st is None else self._read[st.partition] - st.read_mark

    def windows(self) -> list[PeerWindow]:
        """Split peers, node side: the windows closed since the last call, each with its node's last
        hard-fault trigger when it closed (the job's worker cannot see the node's hard faults otherwise)."""
        if self.peers is None or not self.peers.outbox:
            return []
        out = list(self.peers.outbox)
        self.peers.outbox.clear()
        return out

    def read_up_to(self, clocks: Mapping[str, float]) -> None:
        """Split, node side, event clock: every batch of these nodes up to these times (their partitions'
        clocks) has been read. Each node of a known job gets a rank report with no samples and no
        utilisation at that time, which judges nothing: it tells the job's worker (:class:`.jobwindows.JobReports`)
        that the node's reports up to then are all sent, so a silent node's peers are not held back."""
        for node, ts in clocks.items():
            st = self._nodes.get(node)
            if st is not None and st.job and ts >= st.last_batch_ts:
                self._ranks_out.setdefault(st.job, []).append(RankReport(node, ts))

    def read_past(self) -> None:
        """Split, node side, wall clock: each node whose partition was read a second or more past its newest
        batch (:meth:`_read_past`; up to the node's heartbeat timeout and 2 s, after which the heartbeat rule has
        decided) gets a read mark at that batch's time plus as much: the job's worker finds a node lost
        before the heartbeat timeout only when it was silent that long where lag cannot fake it."""
        timeout = self.config.heartbeat_timeout
        self.read_up_to({node: st.last_batch_ts + past for node, st in self._nodes.items()
                         if 1.0 <= (past := self._read_past(node)) <= timeout * st.beats() + 2.0})

    def feeds(self, most: int = 500, most_windows: int = 100) -> list[JobFeed]:
        """Split, node side: what the jobs' workers need since the last call, one :class:`JobFeed` per
        job (more when a job has over ``most`` rank reports or ``most_windows`` windows: a worker catching up
        on a backlog gathers minutes of a job in one call, and one message must stay well under Kafka's
        1 MB; a window of 8 GPUs is about 1.4 kB, a rank report 0.3 kB): its nodes' closed windows and rank
        reports, in their order, the reports before the windows of each feed (a hang's reports explain its
        windows' soft symptoms). The read marks go in the job's last feed, after every window they say was
        sent."""
        by_job: dict[str, list[PeerWindow]] = {}
        for w in self.windows():
            by_job.setdefault(w.job, []).append(w)
        out = []
        for job in sorted(set(by_job) | set(self._ranks_out)):
            windows = tuple(by_job.get(job, ()))
            ranks, marks = apart_from_marks(self._ranks_out.get(job, ()))
            n = max(-(-len(windows) // most_windows), -(-len(ranks) // most), 1)
            for i in range(n):
                out.append(JobFeed(job=job, windows=windows[i * most_windows:(i + 1) * most_windows],
                                   ranks=ranks[i * most:(i + 1) * most] + (marks if i == n - 1 else ())))
        self._ranks_out.clear()
        return out

    def job_feed(self, feed: JobFeed, now: float | None = None) -> list[FaultEvent]:
        """Split, job side: judge ``feed.job`` with one feed (its rank reports, then its windows); ``now``:
        the decision time (default: the engine's clock, or each item's own time on the event clock)."""
        event_clock = now is None and self.config.clock == "event"
        now = self.clock() if now is None else now
        ranks = feed.ranks
        if event_clock and self.job_reports is not None:     # a replay: the job's nodes in step
            for r in ranks:
                if is_read_mark(r):        # how far the node was read: proof of its silence (node lost, 2 s)
                    self._hang.read_to(feed.job, r.node, r.ts)
            ranks = self.job_reports.add(feed.job, ranks)
        found = self._take_ranks(feed.job, ranks, None if event_clock else now)
        for w in feed.windows:
            found += self.peer_window(w, now=w.closed_ts if event_clock else now)
        if event_clock and self.job_windows is not None:
            # after the feed's windows: how far each node was read (a node read past a window without
            # sending it had none, and the job's window does not wait for it)
            marks = {r.node: r.ts for r in feed.ranks if is_read_mark(r)}
            if marks:
                ws = self.config.soft_window_s
                released = self.job_windows.read_past(feed.job, {node: int(ts // ws) - 1 for node, ts in marks.items()})
                # each job window is decided when its last node window closed, as a live worker would: a replay's
                # marks run minutes of sample time ahead of the windows or behind them
                by_index: dict[int, list[PeerWindow]] = {}
                for w in released:
                    by_index.setdefault(w.index, []).append(w)
                for done in by_index.values():
                    found += self._take_windows(done, max(w.closed_ts for w in done))
        return found

    def _take_ranks(self, job: str, ranks, now: float | None) -> list[FaultEvent]:
        """Split, job side: judge ``job``'s hangs with its rank reports, at ``now`` (None: each at its own time)."""
        found: list[FaultEvent] = []
        hang = self._hang
        for r in ranks:
            hangs = hang.take(job, r, r.ts if now is None else now)
            if hangs:
                found += self._new(hangs, hard_at=self._peer_hard_at)
            if r.node in hang._hung and hang.ongoing(r.node, r.ts):    # soft symptoms of the hang are explained
                self._peer_hard_at[r.node] = max(self._peer_hard_at.get(r.node, r.ts), r.ts)
        return found

    def peer_window(self, w: PeerWindow, now: float | None = None) -> list[FaultEvent]:
        """Split peers, job side: take one node's window summary; return the faults of the job's windows
        it completed."""
        if self.job_windows is None:
            return []
        return self._take_windows(self.job_windows.add(w), self.clock() if now is None else now)

    def _take_windows(self, released: list[PeerWindow], now: float) -> list[FaultEvent]:
        """Split peers, job side: decide with the node windows the job's windows released."""
        found: list[FaultEvent] = []
        for r in released:
            if r.hard_ts is not None:
                self._peer_hard_at[r.node] = max(self._peer_hard_at.get(r.node, r.hard_ts), r.hard_ts)
            found += self._peers_of(r.job).take(r, now)
        # explained only by what the summaries carried: in a worker that also reads the node's metrics,
        # its own newer hard faults would make the decision depend on how the nodes are spread
        return self._new(found, hard_at=self._peer_hard_at)

    def _peers_of(self, job: str):
        detector = self._job_peers.get(job)
        if detector is None:
            detector = self._job_peers[job] = type(self.peers)(self.config)
        return detector

    def forget_jobs(self, jobs: Iterable[str]) -> None:
        """Split, job side: these jobs are another worker's now."""
        jobs = list(jobs)
        self._hang.forget(jobs)
        if self.job_reports is not None:
            self.job_reports.forget(jobs)
        if self.job_windows is not None:
            self.job_windows.forget(jobs)
            for job in jobs:
                self._job_peers.pop(job, None)

    def _hard_ongoing(self, state: NodeState, ts: float) -> bool:
        if state.node not in self._hard_at:
            return False
        if any(getattr(link, "reported_down", False) for link in state.links.values()):
            return True
        # split: hangs are judged on the job's worker, which may be another; the node side does not know
        return not self.split and self._hang.ongoing(state.node, ts)

    def _explained(self, f: FaultEvent, hard_at: Mapping[str, float]) -> bool:
        """Whether soft fault ``f`` is a symptom of the node's last hard fault: its anomaly began while
        that fault went on, or within ``soft_consecutive`` windows after. A drift that begins later is
        a fault of its own (a node that hung and was restarted can straggle minutes later)."""
        began = float(f.evidence.get("since_ts", f.observed_ts)) if isinstance(f.evidence, Mapping) else f.observed_ts
        return began - hard_at[f.node] <= self.config.soft_window_s * self.config.soft_consecutive

    def check_heartbeats(self, now: float | None = None, nodes: Iterable[str] | None = None) -> list[FaultEvent]:
        """Faults for nodes (all, or ``nodes``) that went silent; drops nodes that are only replayed history."""
        now = self.clock() if now is None else now
        states = list(self._nodes.values()) if nodes is None else \
            [st for st in map(self._nodes.get, nodes) if st is not None]
        marks: list[tuple[str, RankReport]] = []
        found, history = self.heartbeat.check(states, now, defer=lambda st, silent: marks.append(
            (st.trains_in, RankReport(st.node, st.last_batch_ts + silent, silent_s=silent))))
        for job, mark in marks:     # a node whose ranks train in a job: the job's worker judges its silence
            if self.split:
                self._ranks_out.setdefault(job, []).append(mark)
            else:
                found += self._hang.take(job, mark, now)
        if history:
            log.info("not watching %d node(s) whose newest metrics are older than %.0fs: %s",
                     len(history), self.config.heartbeat_horizon, ", ".join(sorted(history)[:10]))
            self.forget(history)
        return self._new(found)

    def flush(self, now: float | None = None) -> list[FaultEvent]:
        """Judge the rank reports (event clock) and decide the soft-detection windows still waiting for peers."""
        hangs: list[FaultEvent] = []        # already through _new (_take_ranks)
        if self.job_reports is not None:
            for job, ranks in self.job_reports.flush().items():
                hangs += self._take_ranks(job, ranks, None)
        if self.peers is None:
            return hangs
        now = self.clock() if now is None else now
        found: list[FaultEvent] = []
        if self.job_windows is not None:
            for r in self.job_windows.flush():
                found += self._peers_of(r.job).take(r, now)
            for detector in self._job_peers.values():
                found += detector.flush(now)
        return hangs + self._new(found + self.peers.flush(now))

    def restore(self, faults: Iterable[FaultEvent], now: float | None = None) -> int:
        """Remember ``faults`` as already emitted (by an earlier worker); return how many were taken.

        Ids and merge triggers are taken from every fault; the per-node state of the once-per-condition
        rules only from faults detected within ``cooldown_s`` of ``now``.
        """
        now = self.clock() if now is None else now
        taken = 0
        for f in sorted(faults, key=lambda f: f.detected_ts):
            taken += 1
            cls, key = _merge_key(f)
            if f.resolved:
                self._emitted[f.fault_id + ":resolved"] = None
                self._last.pop(key, None)
                continue
            self._emitted[f.fault_id] = None
            ev = f.evidence
            self._last[key] = max(self._last.get(key, f.observed_ts), f.observed_ts)
            if cls in {c.value for c in HARD}:
                self._hard_at[f.node] = max(self._hard_at.get(f.node, f.observed_ts), f.observed_ts)
            if now - f.detected_ts <= self.config.cooldown_s and f.kind.value == "hang":
                if f.rank is not None and ev.get("step") is not None:
                    self._hang.seed(f.node, f.job or "", str(ev.get("generation", "0")), f.rank, ev["step"])
            elif now - f.detected_ts <= self.config.cooldown_s and f.kind.value in _ONCE:
                state = self._nodes.get(f.node)
                if state is not None:
                    _seed_state(state, f)
                else:
                    self._seeds.setdefault(f.node, []).append(f)
        while len(self._emitted) > self.config.dedup_capacity:
            self._emitted.popitem(last=False)
        return taken

    def forget(self, nodes: Iterable[str]) -> None:
        for node in nodes:
            self._nodes.pop(node, None)

    def _new(self, found: list[FaultEvent], hard_at: Mapping[str, float] | None = None) -> list[FaultEvent]:
        hard_at = self._hard_at if hard_at is None else hard_at
        out = []
        cooldown = self.config.cooldown_s
        for f in found:
            if f.fault_id in self._emitted and not f.resolved:
                self.counts["repeats"] += 1
                continue
            cls, key = _merge_key(f)
            if f.resolved:
                rid = f.fault_id + ":resolved"
                if rid in self._emitted or f.fault_id not in self._emitted:
                    continue
                self._emitted[rid] = None
                self._last.pop(key, None)       # it ended: the next one is a fault of its own (every occurrence)
                out.append(f)
                continue
            last = self._last.get(key)
            self._last[key] = f.observed_ts if last is None or f.observed_ts - last > cooldown else last
            if last is not None and 0 <= f.observed_ts - last <= cooldown and cls not in _ONCE:
                self.counts["merged"] += 1
                self._emitted[f.fault_id] = None
                continue
            hard = cls in {c.value for c in HARD}
            if hard:
                hard_at[f.node] = f.observed_ts
            elif f.node in hard_at and self._explained(f, hard_at):
                self.counts["explained"] += 1
                continue
            self._emitted[f.fault_id] = None
            if len(self._emitted) > self.config.dedup_capacity:
                self._emitted.popitem(last=False)
            out.append(f)
        self.counts["faults"] += len(out)
        return out


def _merge_key(f: FaultEvent) -> tuple[str, tuple]:
    """A fault's class, and what a later fault must share with it to be merged into it (while it goes on)."""
    ev = f.evidence
    cls = ev.get("class", f.kind.value)
    device = ev.get("gpu", ev.get("device", ev.get("port")))
    return cls, (f.node, cls, device, f.rank if f.kind.value in ("hang", "nan_loss") else None)


def _seed_state(state: NodeState, f: FaultEvent) -> None:
    """Tell ``state``'s once-per-condition rules that ``f`` was reported already (by an earlier worker)."""
    ev = f.evidence
    if f.kind.value == "gpu_lost" and ev.get("gpu") is not None:
        state.lost_gpus.add(int(ev["gpu"]))
    elif f.kind.value == "nan_loss" and f.rank is not None:
        state.nan_ranks.add((f.job or "", str(ev.get("generation", "0")), f.rank))


class _RankCollector:
    """Split, node side: the hang rule's place in the rule list; keeps each batch's rank reports for
    the job's worker (:meth:`TEEEngine.feeds`) instead of judging them here."""

    name = "hang"

    def __init__(self, out: dict[str, list[RankReport]], hang: HangDetector) -> None:
        self.out = out
        self.reports = hang.reports

    def observe(self, state: NodeState, batch: MetricBatch, now: float) -> list[FaultEvent]:
        for job, report in self.reports(batch):
            self.out.setdefault(job, []).append(report)
        return []
