"""What the TEE and the sink share as Faust apps: how the app is built, and a worker whose
shutdown on a signal cannot hang.

:func:`faust_app` builds an app at-least-once over raw bytes, with the ``TRANSOM_KAFKA_*`` TLS /
SASL settings as broker credentials, topics never declared (``transom.kafka.ensure_topics`` does).
Faust's own shutdown waits for the broker, which may be the very thing that is gone; a
:class:`BoundedWorker` exits ``STOP_GRACE`` seconds after SIGINT/SIGTERM whatever happens.
:func:`new_event_loop` is the loop a worker runs on: uvloop where it is installed (the TEE worker's
event loop is its bottleneck; uvloop's measured 10-12 % more batches a second and a lower latency,
see docs/tee.md), asyncio's own with ``TRANSOM_EVENT_LOOP=asyncio``. :func:`take_events` is
Faust's ``Stream.take_events`` without its wakeups while nothing comes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
from typing import Any, AsyncGenerator, Sequence

import faust
from mode.utils.aiter import aiter
from mode.utils.futures import notify

from transom.config import ConfigError
from transom.log import get
from transom.security import KafkaSecurity

__all__ = ["BoundedWorker", "STOP_GRACE", "faust_app", "new_event_loop", "settle_gc", "take_events", "EVENT_LOOP_ENV"]

log = get("streams.worker")

#: Seconds a worker may take to stop after SIGINT/SIGTERM before it exits anyway.
STOP_GRACE = 15.0
#: Allocations between two collections of the youngest generation in a worker (Python's default: 700).
GC_GEN0 = 20000
#: The workers' event loop: "uvloop" (the default where installed) or "asyncio".
EVENT_LOOP_ENV = "TRANSOM_EVENT_LOOP"


def new_event_loop(service: str) -> asyncio.AbstractEventLoop:
    """A new event loop for the ``service`` worker, as ``TRANSOM_EVENT_LOOP`` says (unset: uvloop where
    it is installed, else asyncio's; set to uvloop: uvloop or a :class:`ConfigError` saying how to get it)."""
    choice = os.environ.get(EVENT_LOOP_ENV, "").strip().lower()
    if choice not in ("", "uvloop", "asyncio"):
        raise ConfigError(f"{EVENT_LOOP_ENV}={choice!r}: expected uvloop or asyncio")
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ConfigError(f"{EVENT_LOOP_ENV}=uvloop: uvloop is not installed (pip install uvloop)") from None
            log.info("%s: uvloop is not installed: running on asyncio's event loop", service)
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def settle_gc(gen0: int = GC_GEN0) -> None:
    """Before a worker starts consuming: move every object made so far (modules, detectors, models) out
    of the collector's reach (``gc.freeze``) and collect the young generation every ``gen0`` allocations
    instead of 700. A worker allocates a few dozen containers per message, nearly all freed at once by
    their reference counts; the collector's passes over the long-lived heap were a share of its CPU."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(gen0)


def faust_app(app_id: str, bootstrap: str, *, datadir: str, service: str, reads: str, **settings: Any) -> faust.App:
    """The Faust app ``app_id`` on ``bootstrap`` (host:port[,host:port]); ``service`` and ``reads`` name
    who needs lz4 for what in the error raised when aiokafka cannot decompress it; ``settings``: more
    Faust settings."""
    credentials = KafkaSecurity.from_env().faust_credentials()   # TLS / SASL, or None for PLAINTEXT
    from aiokafka.codec import has_lz4
    if not has_lz4():   # transom's producers compress with lz4; without it the fetcher crashes later
        raise ConfigError(f"the {service} needs the 'cramjam' package (aiokafka's lz4 codec) to read transom's "
                          f"lz4-compressed {reads}: pip install 'aiokafka[lz4]'")
    brokers = ";".join(f"kafka://{b.strip()}" for b in bootstrap.split(",") if b.strip())
    return faust.App(
        app_id, broker=brokers, value_serializer="raw", key_serializer="raw",
        processing_guarantee="at_least_once", topic_allow_declare=False, topic_disable_leader=True,
        web_enabled=False, store="memory://", datadir=datadir, autodiscover=False,
        producer_acks=-1,        # acks=all: a fault event is written once every in-sync replica has it
        broker_session_timeout=6.0, broker_heartbeat_interval=1.0, consumer_auto_offset_reset="earliest",
        broker_credentials=credentials, **settings,
    )


def take_events(stream: Any, max_: int, within: float) -> AsyncGenerator[Sequence[Any], None]:
    """``stream.take_events(max_, within)`` (Faust: lists of up to ``max_`` events, or what arrived
    within ``within`` seconds; each list acknowledged once the consumer asks for the next), except
    that the ``within`` timer runs only while a list is being gathered: an idle stream sleeps until
    its next event. Faust's wakes every ``within`` seconds to find nothing (its wait creates tasks
    each time): beside a job, at 0.05 s for the TEE's two agents, that was ~40 % of the TEE
    worker's CPU. An event still waits at most ``within`` (from the first of its list)."""
    agen = _take_events(stream, max_, within)
    stream._active_agens.add(agen)       # as Faust's: Stream.on_stop closes what a caller left
    return agen


async def _take_events(stream: Any, max_: int, within: float) -> AsyncGenerator[Sequence[Any], None]:
    # Faust's take_events (faust/streams.py), with ``started``: set by the first event of a list
    events: list = []
    full, consumed, started = asyncio.Event(), asyncio.Event(), asyncio.Event()
    consuming: asyncio.Future | None = None
    enable_acks = stream.enable_acks
    channel_it = aiter(stream.channel)

    async def add_to_buffer(value: Any) -> Any:
        nonlocal consuming
        try:
            if consuming is not None:       # the list is being handed over: add to the next one
                try:
                    await consuming
                finally:
                    consuming = None
            event = stream.current_event
            if event is None:
                raise RuntimeError("take_events: no current event")
            events.append(event)
            started.set()
            if len(events) >= max_:
                full.set()
                consumed.clear()
                await stream.wait(consumed)       # never more than max_ in a list
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            stream.log.exception("Error adding to take buffer: %r", exc)
            await stream.crash(exc)
        return value

    stream.enable_acks = False                # this generator acknowledges what it handed over
    stream.add_processor(add_to_buffer)
    stream._enable_passive(channel_it)
    try:
        while not stream.should_stop:
            if not started.is_set():
                await stream.wait_for_stopped(started)            # idle: no timer
            if not full.is_set():
                await stream.wait_for_stopped(full, timeout=within)
            if events:
                consuming = stream.loop.create_future()
                try:
                    yield list(events)
                finally:
                    for event in events:
                        await stream.ack(event)
                    events.clear()
                    notify(consuming)
                    full.clear()
                    started.clear()
                    consumed.set()
    finally:
        stream.enable_acks = enable_acks
        stream._processors.remove(add_to_buffer)


class BoundedWorker(faust.Worker):
    """``faust.Worker`` that exits ``STOP_GRACE`` s after a stop signal; ``service`` names it in logs."""

    service = "worker"

    def _arm(self, signame: str) -> None:
        def deadline() -> None:
            log.warning("%s did not stop within %gs of %s (broker gone?): exiting now", self.service, STOP_GRACE,
                        signame)
            logging.shutdown()
            os._exit(0)

        timer = threading.Timer(STOP_GRACE, deadline)
        timer.daemon = True
        timer.start()

    def _on_sigterm(self) -> None:
        self._arm("SIGTERM")
        super()._on_sigterm()

    def _on_sigint(self) -> None:
        self._arm("SIGINT")
        super()._on_sigint()
