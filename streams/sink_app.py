"""The InfluxDB sink as a faust-streaming app: Kafka at the edge, :mod:`.sink` inside.

Wiring (app id ``transom-sink``, its own consumer group, at-least-once, raw bytes)::

    transom.metrics, .faults, .lifecycle, .checkpoints
        --agent "sink" (batches of up to batch_size events, or what came within flush_s)-->
        contracts.decode --ok--> sink.to_points --> one write of the whole batch --> InfluxDB
                         \\--ContractError--> transom.deadletter

A batch is written before the stream moves on, so its offsets are committed only after the
write: a restarted sink writes some points again, which InfluxDB keeps once (same series and
time: the later write replaces the earlier one). When the server is unreachable (or answers 5xx
or 429) the sink retries the batch with back-off until it succeeds, without losing it; when the
server refuses the points (4xx), the batch is written event by event and each refused event goes
to the dead-letter topic with the server's reason. Every 30 s the sink logs its counts. Kafka
security (TLS, SASL) comes from ``TRANSOM_KAFKA_*`` (:mod:`transom.security`) as Faust broker credentials.

:func:`run_sink` runs one sink worker in this process until SIGINT or SIGTERM and returns 0.
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any, Sequence

import faust

from transom import contracts
from transom.log import get

from .sink import PointsRejected, ServerUnavailable, SinkConfig, TOPICS, open_writer, to_points
from .worker import BoundedWorker, faust_app, new_event_loop

__all__ = ["APP_ID", "make_app", "run_sink", "SinkStats"]

APP_ID = "transom-sink"
log = get("sink")

_BACKOFF = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class SinkStats(dict):
    """Counters: events, points, writes, retries, deadlettered."""

    def __init__(self) -> None:
        super().__init__(events=0, points=0, writes=0, retries=0, deadlettered=0)

    def line(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.items())


def make_app(bootstrap: str, writer: Any, config: SinkConfig, *, datadir: str,
             stats: SinkStats | None = None) -> faust.App:
    """Build the Faust app that writes the topics of ``bootstrap`` through ``writer``."""
    stats = stats if stats is not None else SinkStats()
    app = faust_app(APP_ID, bootstrap, datadir=datadir, service="sink", reads="topics")
    source = app.topic(*TOPICS, key_type=bytes, value_type=bytes)
    deadletter = app.topic(contracts.DEADLETTER, key_type=bytes, value_type=bytes)

    async def reject(event: Any, reason: str) -> None:
        msg = event.message
        log.warning("dead-lettered %s partition %d offset %d: %s", msg.topic, msg.partition, msg.offset, reason)
        raw = event.value if isinstance(event.value, bytes) else None
        letter = contracts.DeadLetter.of(raw, topic=msg.topic, reason=reason, component="sink",
                                         partition=msg.partition, offset=msg.offset)
        await deadletter.send(key=event.key, value=contracts.encode(letter))
        stats["deadlettered"] += 1

    async def write(points: list) -> None:
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            try:
                await loop.run_in_executor(None, writer.write, points)
                stats["writes"] += 1
                stats["points"] += len(points)
                return
            except ServerUnavailable as exc:
                delay = _BACKOFF[min(attempt, len(_BACKOFF) - 1)]
                attempt += 1
                stats["retries"] += 1
                log.warning("InfluxDB write of %d points failed (%s); retry %d in %.1fs", len(points), exc,
                            attempt, delay)
                await asyncio.sleep(delay)

    async def write_batch(items: Sequence[tuple[Any, list]]) -> None:
        points = [p for _ev, pts in items for p in pts]
        try:
            await write(points)
        except PointsRejected:
            for ev, pts in items:   # find the events the server refuses, keep the rest
                try:
                    await write(pts)
                except PointsRejected as exc:
                    await reject(ev, f"InfluxDB refused the points of this event: {exc}")

    @app.agent(source, name="sink")
    async def sink(stream):
        async for events in stream.take_events(config.batch_size, within=config.flush_s):
            items = []
            for ev in events:
                topic = ev.message.topic
                stats["events"] += 1
                try:
                    pts = to_points(topic, contracts.decode(topic, ev.value))
                except contracts.ContractError as err:
                    await reject(ev, str(err))
                    continue
                except Exception as exc:   # a conversion bug must not stop the stream: keep the input
                    log.exception("the sink failed to convert a message of %s", topic)
                    await reject(ev, f"sink failed to convert the event: {exc!r}")
                    continue
                items.append((ev, pts))
            if items:
                await write_batch(items)

    @app.timer(30.0)
    async def progress():
        log.info("sink: %s", stats.line())

    @app.on_partitions_assigned.connect
    async def on_assigned(sender, assigned, **_):
        log.info("sink assigned %s", ", ".join(sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned)))

    return app


class _BoundedWorker(BoundedWorker):
    service = "sink"


def run_sink(bootstrap: str, config: SinkConfig, *, datadir: str | None = None) -> int:
    """Run one sink worker in this process until SIGINT/SIGTERM; return its exit status."""
    loop = new_event_loop("sink")   # a bad TRANSOM_EVENT_LOOP stops here, before anything starts
    writer = open_writer(config)
    stats = SinkStats()
    log.info("sink writing %s to %s (InfluxDB %s, %s write path, database/bucket %r)", ", ".join(TOPICS),
             config.url, writer.version or "?", writer.api, config.database)
    try:
        with tempfile.TemporaryDirectory(prefix="transom-sink-") as tmp:
            app = make_app(bootstrap, writer, config, datadir=datadir or tmp, stats=stats)
            asyncio.set_event_loop(loop)
            worker = _BoundedWorker(app, loop=loop, quiet=True, override_logging=False, redirect_stdouts=False)
            worker.spinner = None
            try:
                worker.execute_from_commandline()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            else:
                code = 0
    finally:
        writer.close()
    log.info("sink stopped: %s", stats.line())
    return code
