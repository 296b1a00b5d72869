"""The TEE as a faust-streaming app: Kafka at the edge, :class:`TEEEngine` inside.

Wiring (app id ``transom-tee``, at-least-once, raw bytes in and out)::

    transom.metrics --agent "tee"--> contracts.decode --ok--> engine.process --> transom.faults
                                                      \\--ContractError--> transom.deadletter
    timer, every 1 s -----------------------------------> engine.check_heartbeats --> transom.faults
    engine.feeds() (node windows, rank reports) --key job, every FEED_EVERY s--> transom.peer-windows
    transom.peer-windows --agent "tee-peers"--> engine.job_feed (hangs, peers) --> transom.faults

Hangs and peers, repartitioned by job (the Faust way: a second agent on an internal topic keyed by
the new key): the metrics are keyed by node, so one worker reads all of a node's batches and runs
the per-node rules, the heartbeat check, the ECOD and temporal detectors and the peers detector's
window building there. What must see every node of a job goes, keyed by job, to
``transom.peer-windows``: each node window closed (a :class:`~transom.contracts.PeerWindow`
summary) and each batch's rank progress and GPU utilisation (a :class:`~transom.contracts.RankReport`),
gathered per job for ``FEED_EVERY`` seconds into one :class:`~transom.contracts.JobFeed` message; the
worker that owns the job's partition of that topic judges the job's hangs and peers with all its
nodes (:meth:`TEEEngine.job_feed`, :mod:`.hangs`, :mod:`.jobwindows`). With one worker or twelve, a
job is judged with all its nodes, by detectors of the job's own.

With ``TEEConfig.clock == "event"`` (``transom tee --clock event``, for replays) the engine's
clock is the sample time instead: each batch is processed at its own time, and the heartbeats of a
partition's nodes are checked whenever that partition's clock reaches a new second: its newest
sample time while it has more to read (its nodes report in time order), else at least the slowest
time of the partitions with more to read, or the newest of all once every partition is read to
its end. A partition counts as read to its end only after it stayed there for ``END_SETTLE_S``
of wall time (while a replay is still being published, the end a fetch saw is not the end), and
the 1 s timer checks the clocks between batches too. A batch moves its partition's clock before it
is taken, and a clock that jumps by more than the heartbeat timeout (a node alone on its partition,
back after a silence) has its partition's nodes checked first at the last check plus the timeout,
where a live worker would have found the silence. Each flush of the feeds also tells the jobs'
workers how far each node was read (:meth:`TEEEngine.read_up_to`, the partition's clock), so that they
take a job's rank reports in time order without waiting for a node gone silent.

Faults are keyed by job id (node id when the job is unknown); dead letters keep the original key.
With a signing key configured (``TRANSOM_FAULT_PRINCIPAL`` + ``TRANSOM_SIGNING_KEY``, see
:mod:`transom.security`) every fault carries the principal and HMAC headers the controller checks.
Kafka security (TLS, SASL) comes from ``TRANSOM_KAFKA_*`` as Faust broker credentials.
Topics are never declared here: :func:`transom.kafka.ensure_topics` creates them. Metrics are
partitioned by node, so a node's state lives in the one worker that owns its partition; when a
partition is revoked, the worker forgets that partition's nodes (their heartbeats are no longer
its business).

:func:`run_worker` runs one worker in this process until SIGINT or SIGTERM and returns 0.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import defaultdict
from typing import Any, Iterable, Mapping

import faust
from faust.types import TP

from transom import contracts
from transom.log import get
from transom.security import fault_signer

from .config import TEEConfig
from .engine import TEEEngine, encode_feed
from .resume import emitted_faults
from .worker import BoundedWorker, faust_app, new_event_loop, settle_gc, take_events

__all__ = ["APP_ID", "make_app", "partition_clocks", "run_worker"]

APP_ID = "transom-tee"
#: The agent takes metric batches in lists of up to this many, or what arrived within TAKE_WITHIN seconds.
TAKE, TAKE_WITHIN = 1000, 0.05
#: Seconds (wall) the node side gathers a job's windows and rank reports into one message: a hang waits
#: at least 10 s, a window 10 s, so a second costs little latency; the feeds are a cost per job, worker
#: and second whatever the batch rate (each worker sends one per job it reads nodes of), so not less.
FEED_EVERY = 1.0
#: Event clock: most bytes fetched from one partition at a time.
REPLAY_FETCH_BYTES = 64 * 1024
#: Event clock: seconds (wall) a partition must stay read to its end before its time may move on
#: with the other partitions' (a fetch may not yet have seen what is still being published).
END_SETTLE_S = 2.0
#: Wall clock: a partition with batches left to read whose newest batch read is older than this
#: (sample time against the worker's clock) is behind: the worker is catching up (started or restarted
#: behind a backlog), and says so every CATCHUP_LOG_S until it is not.
CATCHUP_LAG_S, CATCHUP_LOG_S = 30.0, 10.0
log = get("tee")


def partition_clocks(marks: Mapping[int, float], behind: Iterable[int]) -> dict[int, float]:
    """Each partition's time on the event clock, from its newest sample time read (``marks``) and
    the partitions with more to read (``behind``). A partition with more to read is at its own
    newest sample time: its nodes' batches are read in time order, so a node that sent nothing since
    is silent on that partition's time, however far behind or ahead the other partitions are. One
    read to its end is at least at the slowest time of the partitions with more to read (a node
    there may be read later), or at the newest of all once every partition is read to its end."""
    behind = {p for p in behind if p in marks}
    floor = min(marks[p] for p in behind) if behind else max(marks.values(), default=0.0)
    return {p: mark if p in behind else max(mark, floor) for p, mark in marks.items()}


def make_app(bootstrap: str, engine: TEEEngine, *, datadir: str) -> faust.App:
    """Build the Faust app that feeds ``engine`` from ``bootstrap`` (host:port[,host:port])."""
    signer = fault_signer()                                       # None: faults go unsigned
    event_clock = engine.config.clock == "event"
    # event clock (a replay read at full speed): small fetches, so that the partitions, read in turn,
    # stay close in sample time (a 1 MB fetch of one partition holds minutes of its nodes' batches)
    # producer_linger_ms: the feeds of a flush (one per job) and the faults of a list leave in one request
    # per partition leader instead of one each (the socket writes were a tenth of a busy worker's time)
    app = faust_app(APP_ID, bootstrap, datadir=datadir, service="TEE", reads="metrics", producer_linger_ms=10,
                    **({"consumer_max_fetch_size": REPLAY_FETCH_BYTES} if event_clock else {}))
    metrics = app.topic(contracts.METRICS, key_type=bytes, value_type=bytes)
    faults = app.topic(contracts.FAULTS, key_type=bytes, value_type=bytes)
    deadletter = app.topic(contracts.DEADLETTER, key_type=bytes, value_type=bytes)
    peer_windows = app.topic(contracts.PEER_WINDOWS, key_type=bytes, value_type=bytes)
    nodes_of: dict[int, set[str]] = defaultdict(set)   # metrics partition -> nodes seen on it
    jobs_of: dict[int, set[str]] = defaultdict(set)    # peer-windows partition -> jobs judged from it
    watermarks: dict[int, float] = {}                    # partition -> newest sample time read
    checked: dict[int, int] = {}                         # event clock: partition -> second last checked
    positions: dict[int, int] = {}                       # partition -> offset last processed
    behind_since: dict[str, float] = {}                  # wall clock: since when catching up, last said
    at_end: dict[int, tuple[int, float]] = {}            # event clock: partition -> (its end offset, since when)
    moved_on: dict[int, int] = {}                        # event clock: partition -> end offset it moved on at

    def highwater(p: int) -> int | None:
        """The end offset of metrics partition ``p`` the consumer's last fetch saw (None: none yet)."""
        try:
            return app.consumer.highwater(TP(contracts.METRICS, p))
        except Exception:
            return None

    def event_clocks() -> dict[int, float]:
        behind, wall = set(), time.monotonic()
        for p in watermarks:
            high = highwater(p)
            if high is None or positions.get(p, -1) + 1 < high:
                behind.add(p)
                at_end.pop(p, None)
                continue
            # read to the end the last fetch saw: while the replay is still being published, the next
            # fetch may bring more, so the partition counts as read to its end only once it stayed there
            # for END_SETTLE_S (else its clock would jump to the others' and its nodes look silent)
            if at_end.get(p, (None,))[0] != high:
                at_end[p] = (high, wall)
            if wall - at_end[p][1] < END_SETTLE_S:
                behind.add(p)
        clocks = partition_clocks(watermarks, behind)
        for p in clocks.keys() - behind:
            now = clocks[p]
            if now - watermarks[p] > 1.0 and moved_on.get(p) != at_end[p][0]:
                moved_on[p] = at_end[p][0]       # once per end: its nodes are judged on the others' time
                log.info("metrics partition %d read to its end (offset %d, %.1f s ago): its clock moves with the "
                         "other partitions' to %.1f, %.1f s past its newest sample", p, at_end[p][0],
                         wall - at_end[p][1], now, now - watermarks[p])
        return clocks

    def catching_up() -> None:
        """Wall clock: while some partition has batches left to read and its newest read is more than
        CATCHUP_LAG_S old (a backlog: the worker started or restarted behind), say every CATCHUP_LOG_S
        how far behind it reads, then once how long catching up took."""
        now, wall = time.time(), time.monotonic()
        behind: dict[int, tuple[int, float]] = {}
        for p, mark in watermarks.items():
            unread = (highwater(p) or 0) - positions.get(p, -1) - 1
            if unread > 0 and now - mark > CATCHUP_LAG_S:
                behind[p] = (unread, now - mark)
        if behind:
            behind_since.setdefault("since", wall)
            if wall - behind_since.get("said", -CATCHUP_LOG_S) >= CATCHUP_LOG_S:
                behind_since["said"] = wall
                log.info("TEE catching up: %d batches left to read on %s partitions %s, up to %.0f s behind "
                         "(sample time)", sum(u for u, _ in behind.values()), contracts.METRICS, sorted(behind),
                         max(lag for _, lag in behind.values()))
        elif "since" in behind_since:
            log.info("TEE caught up in %.0f s: every %s partition is read to within %.0f s of now",
                     wall - behind_since["since"], contracts.METRICS, CATCHUP_LAG_S)
            behind_since.clear()

    def event_heartbeats() -> list[contracts.FaultEvent]:
        found: list[contracts.FaultEvent] = []
        timeout = engine.config.heartbeat_timeout
        for p, now in event_clocks().items():
            last = checked.get(p, 0)
            if int(now) > last:
                checked[p] = int(now)
                if last and now - last > timeout + 1:
                    # the clock jumped (a node alone on its partition came back after a long silence): the
                    # nodes silent since are judged when a live worker would have judged them, before the
                    # silence grew past heartbeat_horizon (where a node counts as replayed history); a node
                    # that reports every N > 1 s at N times the timeout
                    waits = {timeout * st.beats() for n in nodes_of[p] if (st := engine.nodes.get(n)) is not None}
                    for wait in sorted(w for w in waits if now - last > w + 1):
                        found += engine.check_heartbeats(last + wait + 1, nodes_of[p])
                found += engine.check_heartbeats(now, nodes_of[p])
        return found

    async def emit(found: list[contracts.FaultEvent]) -> None:
        for f in found:
            rank = "" if f.rank is None else f" rank={f.rank}"
            log.warning("fault %s node=%s job=%s%s id=%s: %s", f.kind.value, f.node, f.job, rank, f.fault_id,
                        f.summary)
            key, value = (f.job or f.node).encode(), contracts.encode(f)
            headers = signer.headers(contracts.FAULTS, key, value) if signer else None
            await faults.send(key=key, value=value, headers=headers)

    feeding = asyncio.Lock()      # the agent and the timer both send feeds: a job's must stay in order
    fed = [0.0]

    async def send_feeds() -> None:
        if time.monotonic() - fed[0] < FEED_EVERY:
            return
        async with feeding:
            fed[0] = time.monotonic()
            if event_clock:      # how far each node was read: its job's worker does not wait for it beyond that
                engine.read_up_to({node: now for p, now in event_clocks().items() for node in nodes_of[p]})
            else:                # nodes silent on a partition read past them (node_lost_fast_s)
                engine.read_past()
            for feed in engine.feeds():      # drained and sent under the lock: in order per job
                for value in encode_feed(feed):      # (in parts where it is large: a backlog caught up on)
                    await peer_windows.send(key=feed.job.encode(), value=value)

    async def reject(raw: Any, key: bytes | None, reason: str, partition: int, offset: int,
                     topic: str = contracts.METRICS) -> None:
        log.warning("dead-lettered %s partition %d offset %d: %s", topic, partition, offset, reason)
        letter = contracts.DeadLetter.of(raw if isinstance(raw, bytes) else None, topic=topic,
                                         reason=reason, component="tee", partition=partition, offset=offset)
        await deadletter.send(key=key, value=contracts.encode(letter))

    def handle(event) -> tuple[list, tuple | None]:
        """(faults found, None) for a batch; ([], (reason, ...)) for one to dead-letter. No await on the
        common path: a coroutine per batch is a measurable share of the worker's time."""
        msg = event.message
        try:
            batch = contracts.decode(contracts.METRICS, event.value)
        except contracts.ContractError as err:
            return [], (str(err), msg)
        nodes_of[msg.partition].add(batch.node)
        found: list[contracts.FaultEvent] = []
        watermarks[msg.partition] = max(watermarks.get(msg.partition, 0.0), batch.ts)
        if event_clock:
            # the partition's clock moves to this batch's time before the batch is taken: a node that was
            # silent and is back (alone on its partition, nothing else moved the clock while it was away)
            # is found silent at its return, as a live worker would have found it while it was away
            found = event_heartbeats()
        try:
            found += engine.process(batch, now=batch.ts if event_clock else None, partition=msg.partition)
        except Exception as exc:   # a detector bug must not stop the stream: keep the input
            log.exception("the engine failed on a batch of %s", batch.node)
            return found, (f"tee failed to process the batch: {exc!r}", msg)
        positions[msg.partition] = msg.offset
        return found, None

    @app.agent(metrics, name="tee")
    async def tee(stream):
        # events in lists of up to TAKE (or what arrived within TAKE_WITHIN s): Faust's per-event cost
        # in the agent is paid once per list; each list is acknowledged after it is processed
        async for events in take_events(stream, TAKE, TAKE_WITHIN):
            for event in events:
                found, bad = handle(event)
                if bad is not None:
                    reason, msg = bad
                    await reject(event.value, event.key, reason, msg.partition, msg.offset)
                if found:
                    await emit(found)
            await send_feeds()            # what the list gave the jobs' workers, every FEED_EVERY s

    @app.agent(peer_windows, name="tee-peers")
    async def tee_peers(stream):
        async for events in take_events(stream, TAKE, TAKE_WITHIN):
            for event in events:
                msg = event.message
                try:
                    feed = contracts.decode(contracts.PEER_WINDOWS, event.value)
                except contracts.ContractError as err:
                    await reject(event.value, event.key, str(err), msg.partition, msg.offset, contracts.PEER_WINDOWS)
                    continue
                jobs_of[msg.partition].add(feed.job)
                try:
                    found = engine.job_feed(feed)      # the event clock: each item at its own time
                except Exception as exc:   # a detector bug must not stop the stream: keep the input
                    log.exception("the TEE failed to judge a feed of job %s", feed.job)
                    await reject(event.value, event.key, f"tee failed to judge the job's feed: {exc!r}",
                                 msg.partition, msg.offset, contracts.PEER_WINDOWS)
                    continue
                if found:
                    await emit(found)

    @app.timer(1.0)
    async def heartbeats():
        # event clock: also between batches, so a partition that settled at its end is judged then
        await emit(event_heartbeats() if event_clock else engine.check_heartbeats(time.time()))
        await send_feeds()        # what the last lists left (no metrics since)
        if not event_clock:
            catching_up()

    @app.on_partitions_revoked.connect
    async def on_revoked(sender, revoked, **_):
        for tp in revoked:
            if tp.topic == contracts.METRICS:
                engine.forget(nodes_of.pop(tp.partition, ()))
                watermarks.pop(tp.partition, None)
                positions.pop(tp.partition, None)
                checked.pop(tp.partition, None)
                at_end.pop(tp.partition, None)
                moved_on.pop(tp.partition, None)
            elif tp.topic == contracts.PEER_WINDOWS:
                engine.forget_jobs(jobs_of.pop(tp.partition, ()))

    @app.on_partitions_assigned.connect
    async def on_assigned(sender, assigned, **_):
        mine = sorted(tp.partition for tp in assigned if tp.topic == contracts.METRICS)
        jobs = sorted(tp.partition for tp in assigned if tp.topic == contracts.PEER_WINDOWS)
        log.info("TEE assigned %s partitions %s, %s partitions %s", contracts.METRICS, mine, contracts.PEER_WINDOWS,
                 jobs)

    return app


class _BoundedWorker(BoundedWorker):
    service = "TEE"


def run_worker(bootstrap: str, config: TEEConfig, *, datadir: str | None = None) -> int:
    """Run one TEE worker in this process until SIGINT/SIGTERM; return its exit status."""
    loop = new_event_loop("TEE")   # a bad TRANSOM_EVENT_LOOP stops here, before anything starts
    engine = TEEEngine(config, split_peers=True)   # builds the detectors (imports pyod) before joining the group
    restored = engine.restore(emitted_faults(bootstrap))   # a predecessor's faults are not sent again
    with tempfile.TemporaryDirectory(prefix="transom-tee-") as tmp:
        app = make_app(bootstrap, engine, datadir=datadir or tmp)
        asyncio.set_event_loop(loop)
        # Our logging stays (override_logging=False); quiet and no spinner: no banner on stdout.
        worker = _BoundedWorker(app, loop=loop, quiet=True, override_logging=False, redirect_stdouts=False)
        worker.spinner = None
        settle_gc()          # the detectors, models and modules are built: out of the collector's way
        log.info("TEE consuming %s from %s (hang timeout %gs, heartbeat timeout %gs; %d fault(s) already on %s; "
                 "event loop %s)", contracts.METRICS, bootstrap, config.hang_timeout, config.heartbeat_timeout,
                 restored, contracts.FAULTS, type(loop).__module__.split(".")[0])
        try:
            worker.execute_from_commandline()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        else:
            code = 0
        log.info("TEE stopped (%d batches, %d faults, %d repeats dropped, %d peer windows too late for their "
                 "job's)", engine.counts["batches"], engine.counts["faults"], engine.counts["repeats"],
                 engine.job_windows.late if engine.job_windows is not None else 0)
        return code
