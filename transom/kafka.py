"""Kafka clients configured one way for every component, topic creation, and topic reading.

Producers are idempotent with ``acks=all`` and compression. Security settings (TLS, SASL) come
from the environment through :class:`transom.security.KafkaSecurity` and reach every client built
here (:func:`client_config` is the one place a librdkafka configuration starts from).

:func:`publish` signs fault events (``transom.faults``) with the producer's key when one is
configured (:func:`transom.security.fault_signer`): two Kafka headers, principal and HMAC.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewPartitions, NewTopic

from . import contracts
from .config import kafka_security
from .log import get
from .security import FaultSigner, fault_signer
from .topics import Difference, TopicMismatch, TopicSettings, compare

__all__ = ["BrokerUnavailable", "PROBE_S", "client_config", "make_producer", "make_consumer", "wait_ready",
           "ensure_topics", "check_topics", "read_topic", "read_records", "Record", "DeadLetterWriter", "publish", "produce",
           "SIGNED_TOPICS", "env_signer", "FETCH_WAIT_MS", "QUIET_FETCH_WAIT_MS",
           "RECOVERY_FETCH_WAIT_MS", "CONTROL_FETCH_WAIT_MS"]

log = get("kafka")


class BrokerUnavailable(RuntimeError):
    """No Kafka broker answered at the bootstrap address in time."""


#: fetch.wait.max.ms of a consumer on a latency path (a command reading a topic, the default of
#: make_consumer): each consumer sends the broker a fetch this often while its partitions are idle.
FETCH_WAIT_MS = 100
#: fetch.wait.max.ms of a consumer that can hear of news a little later (the service registry, the
#: controller's lease and metrics): an idle fetch is the broker's main cost beside a job (a 5-node
#: stack sent ~100 requests/s, ~2/3 of them the registry readers' at 100 ms; 34/s with this, and
#: the broker's CPU halved). Tansu answers a held fetch early when data comes, though not at once
#: (measured: a message seen ~0.14 s after it is written, 0.4 s at most), so this costs little latency.
QUIET_FETCH_WAIT_MS = 1000
#: fetch.wait.max.ms of a consumer on the path from a fault to its recovery, held for the whole job
#: (the controller's faults). Measured with random arrivals: a message seen ~40 ms after it is
#: written, 0.1 s at most (100 ms: ~15 ms).
RECOVERY_FETCH_WAIT_MS = 250
#: fetch.wait.max.ms of a rank's control channel (transom.elastic), one per rank and warm spare for the
#: whole job: at 50 ms they were the broker's main work beside a healthy job; a ``reforming`` was
#: still seen 8-15 ms after it was written in a test at this wait.
CONTROL_FETCH_WAIT_MS = 500

#: Topics whose events carry the producer's signature when a signing key is configured.
SIGNED_TOPICS = frozenset({contracts.FAULTS})


def client_config(bootstrap: str, **extra: Any) -> dict[str, Any]:
    """librdkafka settings: ``bootstrap``, then the security settings, then ``extra`` (``a_b`` -> ``a.b``)."""
    # log_level 0: librdkafka's own log lines (hundreds of "Connection refused" while a broker is away) are
    # off; a client that must know about errors sets an error_cb, and commands probe first (wait_ready)
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap, "log_level": 0}
    conf.update(kafka_security())
    conf.update({k.replace("_", "."): v for k, v in extra.items()})
    return conf


def make_producer(bootstrap: str, **extra: Any) -> Producer:
    conf = client_config(bootstrap, **{
        "enable_idempotence": True, "acks": "all", "compression_type": "lz4",
        "linger_ms": 20, "message_timeout_ms": 30000,
    })
    conf.update({k.replace("_", "."): v for k, v in extra.items()})
    return Producer(conf)


def make_consumer(bootstrap: str, group: str, **extra: Any) -> Consumer:
    conf = client_config(bootstrap, **{
        "group_id": group, "auto_offset_reset": "earliest", "enable_auto_commit": False,
        "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000, "fetch_wait_max_ms": FETCH_WAIT_MS,
    })
    conf.update({k.replace("_", "."): v for k, v in extra.items()})
    return Consumer(conf)


#: Seconds a command waits for the broker at --bootstrap before its one-line error (the issue asks for 5 s in all).
PROBE_S = 4.0


def wait_ready(bootstrap: str, timeout: float = 30.0) -> None:
    """Block until the broker answers a metadata request; raise :class:`BrokerUnavailable`."""
    admin = AdminClient({**client_config(bootstrap), "socket.connection.setup.timeout.ms": 2000})
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            md = admin.list_topics(timeout=max(min(2.0, deadline - time.monotonic()), 0.1))
            if md.brokers:
                return
        except KafkaException as exc:
            last = exc
        time.sleep(0.1)
    why = last.args[0].str() if last and last.args and hasattr(last.args[0], "str") else (last or "no brokers in metadata")
    raise BrokerUnavailable(f"no Kafka broker answered at {bootstrap} within {timeout:.0f}s"
                            f" ({why}); check --bootstrap / TRANSOM_BOOTSTRAP")


def ensure_topics(bootstrap: str, specs: Iterable[contracts.TopicSpec] | None = None,
                  timeout: float = 30.0, *, settings: TopicSettings | None = None, grow: bool = False) -> list[str]:
    """Create every missing topic, check the existing ones; return the topics created.

    Partitions come from ``specs`` (default: ``settings.specs()``), replication and
    ``min.insync.replicas`` from ``settings`` (default: :meth:`TopicSettings.from_env`, see
    :mod:`transom.topics`). A replication factor the cluster cannot honour is a ``ConfigError``
    raised before anything is created. Every difference of an existing topic is logged; fewer
    partitions than configured raises :class:`transom.topics.TopicMismatch` (``grow``: partitions
    are added instead, where the broker can).
    """
    settings = settings or TopicSettings.from_env()
    admin = AdminClient(client_config(bootstrap))
    md = admin.list_topics(timeout=timeout)
    rf, isr = settings.replication(len(md.brokers))
    specs = [replace(s, config={**s.config, "min.insync.replicas": str(isr)})
             for s in (settings.specs() if specs is None else specs)]
    existing = set(md.topics)
    new = [NewTopic(s.name, num_partitions=s.partitions, replication_factor=rf, config=dict(s.config))
           for s in specs if s.name not in existing]
    created = []
    if new:
        for name, fut in admin.create_topics(new, operation_timeout=timeout).items():
            try:
                fut.result(timeout)
                created.append(name)
            except KafkaException as exc:
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise
    deadline = time.monotonic() + timeout
    wanted = {s.name for s in specs}
    while not wanted <= set(admin.list_topics(timeout=timeout).topics):
        if time.monotonic() > deadline:
            raise BrokerUnavailable(f"topics {sorted(wanted)} did not appear within {timeout:.0f}s")
        time.sleep(0.1)
    old = [s for s in specs if s.name not in created]
    if old:
        differences = check_topics(admin, old, rf, timeout)
        for d in differences:
            log.log(logging.ERROR if d.severe else logging.WARNING, "%s", d)
        severe = [d for d in differences if d.severe]
        if severe and grow:
            _grow(admin, severe, timeout)
        elif severe:
            raise TopicMismatch("; ".join(map(str, severe)))
    return created


def check_topics(admin: AdminClient, specs: Iterable[contracts.TopicSpec], replication_factor: int,
                 timeout: float = 30.0) -> list[Difference]:
    """How the existing topics of ``specs`` differ from them (partitions, replicas, configs)."""
    specs = list(specs)
    md = admin.list_topics(timeout=timeout)
    configs: dict[str, dict[str, str] | None] = {}
    try:     # the configs a broker describes (Tansu: the ones set at creation)
        futs = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, s.name) for s in specs])
        for res, fut in futs.items():
            configs[res.name] = {k: v.value for k, v in fut.result(timeout).items()}
    except KafkaException as exc:
        log.info("the broker did not describe topic configs (%s): only partitions and replicas checked", exc)
    out: list[Difference] = []
    for s in specs:
        t = md.topics.get(s.name)
        if t is None or not t.partitions:
            continue
        replicas = len(next(iter(t.partitions.values())).replicas)
        out += compare(s, partitions=len(t.partitions), replicas=replicas, replication_factor=replication_factor,
                       config=configs.get(s.name))
    return out


def _grow(admin: AdminClient, severe: list[Difference], timeout: float) -> None:
    grow = [NewPartitions(d.topic, int(d.want)) for d in severe]
    try:
        for name, fut in admin.create_partitions(grow, operation_timeout=timeout).items():
            fut.result(timeout)
            log.warning("topic %s grown to %s partitions (keys now map to other partitions: node state moves)",
                        name, next(d.want for d in severe if d.topic == name))
    except KafkaException as exc:
        raise TopicMismatch(f"could not add partitions ({exc}); " + "; ".join(map(str, severe))) from None


@dataclass(frozen=True)
class Record:
    """One message as :func:`read_records` yields it."""

    key: bytes | None
    value: bytes | None
    partition: int
    offset: int
    headers: list[tuple[str, bytes]]


def read_topic(bootstrap: str, topic: str, *, timeout: float = 30.0) -> Iterator[tuple[bytes | None, bytes | None, int, int]]:
    """Yield ``(key, value, partition, offset)`` of every message now on ``topic``, then stop (see :func:`read_records`)."""
    for r in read_records(bootstrap, topic, timeout=timeout):
        yield r.key, r.value, r.partition, r.offset


def read_records(bootstrap: str, topic: str, *, timeout: float = 30.0) -> Iterator[Record]:
    """Yield a :class:`Record` (with its headers) of every message now on ``topic``, then stop.

    Reads without a consumer group from the beginning of every partition. A partition is done
    at end-of-partition, or shortly after reaching the high watermark taken at the start (a
    partition that producers keep writing never reports its end). The embedded broker's
    watermark can lag one producer batch behind the last offset, which is why reaching it
    leaves a short grace for the rest of that batch instead of stopping at once.
    """
    consumer = Consumer(client_config(bootstrap, group_id="transom-reader", enable_auto_commit=False,
                                      enable_partition_eof=True, fetch_wait_max_ms=50))
    grace = 0.3
    try:
        md = consumer.list_topics(topic, timeout=timeout)
        if topic not in md.topics or md.topics[topic].error is not None:
            return
        ends: dict[int, int] = {}
        for p in md.topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)
            ends[p] = high if high > low else -1
        pending = set(ends)
        reached: dict[int, float] = {}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in pending])
        deadline = time.monotonic() + timeout
        while pending:
            now = time.monotonic()
            for p, when in list(reached.items()):
                if now - when > grace:
                    pending.discard(p)
                    del reached[p]
            if not pending:
                break
            if now > deadline:
                raise BrokerUnavailable(f"reading {topic} did not reach its end within {timeout:.0f}s")
            msg = consumer.poll(0.05)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    pending.discard(msg.partition())
                    reached.pop(msg.partition(), None)
                continue
            p, off = msg.partition(), msg.offset()
            if p not in pending:
                continue
            yield Record(msg.key(), msg.value(), p, off, list(msg.headers() or ()))
            if ends[p] >= 0 and off + 1 >= ends[p] and p not in reached:
                reached[p] = time.monotonic()
    finally:
        consumer.close()


_SIGNER_ENV = ("TRANSOM_FAULT_PRINCIPAL", "TRANSOM_SIGNING_KEY", "TRANSOM_SIGNING_KEY_FILE")
_signer_cache: dict[tuple, FaultSigner | None] = {}


def env_signer() -> FaultSigner | None:
    """This process's fault signer from the environment (read once per distinct setting), or None."""
    marker = tuple(os.environ.get(k) for k in _SIGNER_ENV)
    if marker not in _signer_cache:
        _signer_cache.clear()
        _signer_cache[marker] = fault_signer()
    return _signer_cache[marker]


_FROM_ENV: Any = object()


def publish(producer: Producer, topic: str, key: str | None, event: Any,
            on_delivery: Callable | None = None, *, signer: FaultSigner | None = _FROM_ENV) -> None:
    """Encode ``event`` by its contract and produce it (retrying while the local queue is full).

    Events of :data:`SIGNED_TOPICS` get the signature headers of ``signer`` (default: the one the
    environment configures, :func:`env_signer`; None: unsigned).
    """
    value = contracts.encode(event)
    kbytes = key.encode() if key else None
    if signer is _FROM_ENV:
        signer = env_signer() if topic in SIGNED_TOPICS else None
    headers = signer.headers(topic, kbytes, value) if signer is not None and topic in SIGNED_TOPICS else None
    produce(producer, topic, kbytes, value, on_delivery=on_delivery, headers=headers)


def produce(producer: Producer, topic: str, key: bytes | str | None, value: bytes | None, *,
            on_delivery: Callable | None = None, headers: Any = None) -> None:
    """Produce ``value`` (already encoded) under ``key``, waiting while the producer's local queue is full."""
    if isinstance(key, str):
        key = key.encode()
    while True:
        try:
            producer.produce(topic, value=value, key=key, on_delivery=on_delivery, headers=headers)
            return
        except BufferError:
            producer.poll(0.1)


class DeadLetterWriter:
    """Sends rejected messages to ``transom.deadletter`` with the reason, and counts them."""

    def __init__(self, producer: Producer, component: str) -> None:
        self.producer = producer
        self.component = component
        self.count = 0

    def reject(self, *, topic: str, key: bytes | None, value: bytes | None, reason: str,
               partition: int | None = None, offset: int | None = None) -> None:
        letter = contracts.DeadLetter.of(value, topic=topic, reason=reason, component=self.component,
                                         partition=partition, offset=offset)
        self.count += 1
        log.warning("dead-lettered a message from %s: %s", topic, reason)
        publish(self.producer, contracts.DEADLETTER, key.decode("utf-8", "replace") if key else None, letter)
        self.producer.poll(0)
