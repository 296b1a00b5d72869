"""Delivery without loss: a confluent-kafka producer in front of a bounded on-disk spool.

:class:`Publisher` owns one thread, the producer and the :class:`~transom.agents.spool.Spool`.
The agent hands it encoded batches with :meth:`Publisher.submit` (never blocks). The producer is
idempotent, ``acks=all``, lz4-compressed, with a linger; every delivery report is counted.

Routing, in the publisher thread, keeps a node's batches in ``seq`` order:

- while the broker is reachable, the spool holds nothing waiting, and fewer than
  ``max_in_flight`` batches are in librdkafka's queue, a batch goes to the producer; otherwise
  (broker unreachable, local queue full, or older batches still spooled) it goes to the spool;
- a failed delivery (``delivery_timeout_s`` passed, broker gone) puts the batch into the spool
  (ordered by seq: it comes back before every later batch) and starts an *outage*: the
  producer's queue is purged into the spool too and the producer is dropped, since an
  idempotent producer's state may not survive a broker that lost it;
- every ``retry_s`` during an outage a fresh producer asks the broker for the metrics topic;
  once it answers, the spool is replayed in seq order (at most ``max_in_flight`` at a time),
  each record deleted only after its delivery report says delivered, while new batches queue
  behind it in the spool until it is empty.

:meth:`Publisher.stop` (SIGTERM) flushes what is in flight for up to its timeout, then purges
and spools the rest: nothing in flight is lost; with a persistent spool directory it is replayed
by the next start. Counters (the agent publishes them as self-metrics): ``produced``,
``delivered``, ``spooled``, ``replayed``, ``dropped`` (by the spool bound), ``delivery_errors``,
``outages``, and the delivery latency (produce to delivery report) of the batches delivered since
the last :meth:`take_latency`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from transom import contracts
from transom.kafka import client_config
from transom.log import get

from .spool import FAULT, Spool

__all__ = ["Publisher", "DeliverySettings"]

log = get("agent.delivery")


@dataclass
class DeliverySettings:
    delivery_timeout_s: float = 10.0
    retry_s: float = 2.0
    linger_ms: int = 20
    max_in_flight: int = 1000


def _producer(bootstrap: str, s: DeliverySettings, on_error: Callable[[Any], None]) -> Any:
    from confluent_kafka import Producer

    conf = client_config(bootstrap, **{
        "enable_idempotence": True, "acks": "all", "compression_type": "lz4",
        "linger_ms": int(s.linger_ms), "message_timeout_ms": max(1000, int(s.delivery_timeout_s * 1000)),
        "socket_connection_setup_timeout_ms": 3000, "reconnect_backoff_max_ms": 1000,
        # never auto-create the topic with the broker's defaults (a restarted broker gets it from its
        # operator, with the partitions of contracts.TOPICS); the probe waits until it exists
        "allow_auto_create_topics": False,
    })
    conf["log_level"] = 2  # the broker going away is handled here, not logged by librdkafka each retry
    conf["error_cb"] = on_error
    return Producer(conf)


class Publisher:
    """Publishes encoded batches of one node to ``topic`` keyed by ``key``. See the module docstring."""

    def __init__(self, bootstrap: str, key: str, spool: Spool, settings: DeliverySettings | None = None,
                 topic: str = contracts.METRICS) -> None:
        self.bootstrap, self.key, self.topic = bootstrap, key.encode(), topic
        self.spool = spool
        self.s = settings or DeliverySettings()
        self.produced = self.delivered = self.spooled = self.replayed = 0
        self.delivery_errors = self.outages = 0
        self._latency: list[float] = []
        self._in: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: dict[int, tuple[bool, bytes, int]] = {}  # seq -> (from the spool, payload, flags)
        self._stop_timeout = 10.0
        self._producer: Any = None
        self._outage = False
        self._purge = False
        self._next_retry = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the agent's side

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def connected(self) -> bool:
        return self._producer is not None and not self._outage

    @property
    def dropped(self) -> int:
        return self.spool.dropped

    def submit(self, seq: int, payload: bytes, fault: bool = False) -> None:
        """Hand one encoded batch over; returns at once (thread-safe)."""
        self.produced += 1
        self._in.put((seq, payload, FAULT if fault else 0))

    def take_latency(self) -> list[float]:
        with self._lock:
            out, self._latency = self._latency, []
        return out

    def start(self) -> "Publisher":
        self._producer = _producer(self.bootstrap, self.s, self._on_error)
        self._thread = threading.Thread(target=self._run, name="transom-publisher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> int:
        """Deliver or spool everything; return how many batches are left in the spool."""
        self._stop_timeout = max(0.0, timeout)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout + 15)
        return len(self.spool)

    # ------------------------------------------------------------------ the thread

    def _on_error(self, err: Any) -> None:
        log.debug("kafka client error: %s", err)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._step(0.1)
            self._shutdown()
        except Exception:  # a bug here must be loud, and the batches kept
            log.exception("publisher thread failed; spooling what is left")
            self._drain_input(to_spool=True)
            self.spool.close()

    def _drain_input(self, to_spool: bool = False) -> None:
        while True:
            try:
                seq, payload, flags = self._in.get_nowait()
            except queue.Empty:
                return
            if to_spool:
                self._to_spool(seq, payload, flags)
            else:
                self._route(seq, payload, flags)

    def _step(self, wait: float) -> None:
        try:
            first = self._in.get(timeout=wait)
        except queue.Empty:
            first = None
        if first is not None:
            self._route(*first)
            self._drain_input()
        if self._producer is not None:
            self._producer.poll(0)
        if self._purge:
            self._begin_outage()
        if self._outage:
            if time.monotonic() >= self._next_retry:
                self._reconnect()
        elif self.spool.untaken():
            self._replay()

    def _to_spool(self, seq: int, payload: bytes, flags: int) -> None:
        before = self.spool.dropped
        self.spool.append(seq, payload, flags)
        self.spooled += 1
        if self.spool.dropped != before:
            log.debug("spool bound: %d batches dropped so far", self.spool.dropped)

    def _route(self, seq: int, payload: bytes, flags: int) -> None:
        if (self._outage or self._producer is None or self.spool.untaken()
                or len(self._in_flight) >= self.s.max_in_flight or not self._produce(seq, payload, flags, False)):
            self._to_spool(seq, payload, flags)

    def _produce(self, seq: int, payload: bytes, flags: int, from_spool: bool) -> bool:
        t0 = time.monotonic()

        def report(err: Any, msg: Any) -> None:
            self._delivered(err, msg, seq, flags, from_spool, t0)

        try:
            self._producer.produce(self.topic, value=payload, key=self.key, on_delivery=report)
        except BufferError:
            return False
        self._in_flight[seq] = (from_spool, payload, flags)
        return True

    def _delivered(self, err: Any, msg: Any, seq: int, flags: int, from_spool: bool, t0: float) -> None:
        self._in_flight.pop(seq, None)
        if err is None:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("delivered batch %d%s at %s[%s]@%s", seq, " (replayed)" if from_spool else "",
                          msg.topic(), msg.partition(), msg.offset())
            self.delivered += 1
            with self._lock:
                self._latency.append(time.monotonic() - t0)
            if from_spool:
                self.spool.ack(seq)
                self.replayed += 1
            return
        self.delivery_errors += 1
        if from_spool:
            self.spool.untake(seq)
        else:
            self._to_spool(seq, msg.value(), flags)
        if not self._outage:
            self._purge = True

    def _begin_outage(self) -> None:
        self._purge = False
        if not self._outage:
            self.outages += 1
            log.warning("agent: the broker at %s does not take batches; spooling to %s and retrying every %gs",
                        self.bootstrap, self.spool.dir, self.s.retry_s)
        self._outage = True
        self._drop_producer()
        self._next_retry = time.monotonic() + self.s.retry_s

    def _drop_producer(self) -> None:
        p, self._producer = self._producer, None
        if p is None:
            return
        try:
            p.purge(in_queue=True, in_flight=True, blocking=True)
        except Exception as exc:  # a broken client: its reports may still come below
            log.debug("purge failed: %s", exc)
        p.poll(0)  # serves the purged messages' reports: each goes back to the spool
        p.flush(0)
        for seq, (from_spool, payload, flags) in list(self._in_flight.items()):  # reports that never came
            log.warning("agent: no delivery report for batch %d; it stays spooled", seq)
            if from_spool:
                self.spool.untake(seq)
            else:
                self._to_spool(seq, payload, flags)
            self._in_flight.pop(seq, None)
        self._purge = False

    def _reconnect(self) -> None:
        self._next_retry = time.monotonic() + self.s.retry_s
        if self._producer is None:
            self._producer = _producer(self.bootstrap, self.s, self._on_error)
        try:
            md = self._producer.list_topics(self.topic, timeout=min(2.0, self.s.retry_s))
            topic = md.topics.get(self.topic)
            ok = bool(md.brokers) and topic is not None and topic.error is None and bool(topic.partitions)
        except Exception as exc:
            log.debug("broker probe failed: %s", exc)
            ok = False
        if ok:
            self._outage = False
            log.warning("agent: the broker at %s is back; replaying %d spooled batch(es) in order",
                        self.bootstrap, len(self.spool))

    def _replay(self) -> None:
        room = self.s.max_in_flight - len(self._in_flight)
        if room <= 0:
            return
        for rec, payload in self.spool.head(min(room, 200)):
            if not self._produce(rec.seq, payload, rec.flags, True):
                break
            self.spool.take(rec.seq)

    def _shutdown(self) -> None:
        self._drain_input()
        deadline = time.monotonic() + self._stop_timeout
        while self._producer is not None and not self._outage and time.monotonic() < deadline:
            if self.spool.untaken():
                self._replay()
            if not self._in_flight and not self.spool.untaken():
                break
            self._producer.flush(0.2)
            if self._purge:
                self._begin_outage()
        self._drain_input(to_spool=True)
        self._drop_producer()
        self.spool.close()
        level = logging.WARNING if len(self.spool) else logging.INFO
        log.log(level, "publisher stopped: %d produced, %d delivered, %d replayed, %d spooled, %d dropped; "
                "%d left in the spool", self.produced, self.delivered, self.replayed, self.spooled,
                self.dropped, len(self.spool))
