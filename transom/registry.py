"""The service registry: how Transom's services on different hosts find each other, through the broker.

Every host reaches the Kafka broker, so the broker is where services say where they are. A
service publishes a :class:`transom.contracts.Registration` (kind, node, the address a peer can
route to, port, a pid-free identity) on the compacted topic ``transom.registry``, keyed
``CLUSTER/KIND/NODE``, and refreshes it every ``ttl_s / 3`` seconds; on a clean exit it writes a
tombstone (a null value) so compaction forgets it. A reader keeps the newest entry per key and
treats one whose heartbeat is older than its TTL as stale: a host that was killed or cut off
drops out of every reader's view within one TTL, without anyone deleting it.

API (stable; other services build on it)::

    from transom.contracts import ServiceKind
    from transom import registry

    addr = registry.advertise_address(bootstrap, bind="0.0.0.0")   # never 0.0.0.0 (see below)
    reg = registry.registration(ServiceKind.LAUNCHER, node="node3", addr=addr, port=7000,
                                meta={"zygote": True})              # host, instance, boot id, times filled in
    writer = registry.RegistryWriter(bootstrap, reg).start()        # publishes now, then every ttl/3 s
    writer.update(meta={...})                                       # publish a changed entry now
    writer.stop()                                                   # tombstone: the entry goes at once

    reader = registry.RegistryReader(bootstrap).start()             # caught up with the topic when it returns
    reader.live(ServiceKind.CKPT_DAEMON)    # {node: Registration}, live entries of this cluster only
    reader.get(ServiceKind.AGENT, "node3")  # Registration or None (absent, left or stale)
    reader.wait_for(lambda r: "node3" in r.live(ServiceKind.LAUNCHER), timeout=10)
    reader.close()

    registry.read_registry(bootstrap)       # a one-shot RegistryView of the topic (no thread)

Addresses: :func:`advertise_address` returns, in order, the explicit address (``--advertise`` or
``TRANSOM_ADVERTISE_ADDR``), the bind address when it is a specific one, else the source address
of the route from this host to the broker (the interface a peer on the broker's network reaches),
which is loopback only when the broker itself is on loopback. A wildcard is never advertised.
:func:`default_bind` is where a service listens when not told: that same interface (or every
interface when an address to advertise is given; loopback when the broker is on loopback).

Scope: ``TRANSOM_CLUSTER`` (default ``default``) names the cluster; readers see only their own, so
several clusters (or concurrent test runs) can share one broker. ``TRANSOM_REGISTRY_TTL``
(seconds, default 10) is the TTL writers put in their entries.

Trust: the registry is as trustworthy as the broker's ACLs. A reader only learns where to connect;
what it then sends (checkpoint shards) is verified by sha256 against the committed manifest on
the way back, and stale generations are refused by the daemons (see docs/checkpoint.md).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, Callable, Mapping

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition

from . import contracts
from .config import ConfigError
from .contracts import Registration, ServiceKind, registry_key
from .log import get

__all__ = ["advertise_address", "default_bind", "is_loopback", "route_source", "boot_id", "cluster_name", "registry_ttl", "registration", "RegistryWriter",
           "RegistryView", "RegistryReader", "read_registry", "INSTANCE"]

log = get("registry")

#: This process's identity in the registry: drawn once per process, survives no restart.
INSTANCE = uuid.uuid4().hex

_WILDCARDS = ("", "0.0.0.0", "::", "[::]", "*")


def boot_id() -> str:
    """The host's boot id (a new one after every boot), or "" where the kernel has none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def cluster_name() -> str:
    return os.environ.get("TRANSOM_CLUSTER") or "default"


def registry_ttl() -> float:
    raw = os.environ.get("TRANSOM_REGISTRY_TTL")
    if not raw:
        return 10.0
    try:
        ttl = float(raw)
    except ValueError:
        ttl = -1.0
    if not ttl > 0:
        raise ConfigError(f"TRANSOM_REGISTRY_TTL: expected a positive number of seconds, got {raw!r}")
    return ttl


def _first_broker(bootstrap: str) -> tuple[str, int]:
    first = bootstrap.split(",")[0].strip()
    first = first.split("://", 1)[-1]
    host, _, port = first.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"bootstrap: expected host:port[,host:port], got {bootstrap!r}")
    return host.strip("[]"), int(port)


def route_source(host: str, port: int) -> str:
    """The local address the kernel uses to reach ``host:port`` (no packet is sent: a UDP connect)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, 0, socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def advertise_address(bootstrap: str | None = None, *, bind: str | None = None,
                      explicit: str | None = None) -> str:
    """The address peers on other hosts should use for a service bound to ``bind`` (see module doc)."""
    explicit = explicit or os.environ.get("TRANSOM_ADVERTISE_ADDR") or None
    if explicit:
        if explicit.strip("[]") in _WILDCARDS:
            raise ConfigError(f"--advertise / TRANSOM_ADVERTISE_ADDR: {explicit!r} is a wildcard, not an address "
                              "a peer can route to; give this host's own address")
        return explicit.strip("[]")
    if bind and bind.strip("[]") not in _WILDCARDS:
        return bind.strip("[]")
    if bootstrap:
        return _broker_route(bootstrap, "set --advertise / TRANSOM_ADVERTISE_ADDR")
    return "127.0.0.1"      # one host, no broker: everything meets on loopback


def default_bind(bootstrap: str | None = None, *, explicit: str | None = None) -> str:
    """Where a service listens when not told: every interface when an address to advertise is given
    (``--advertise`` / ``TRANSOM_ADVERTISE_ADDR``: it may be a NAT or load balancer address), else
    the address of the interface that routes to the broker (peers on the broker's network reach it,
    nothing else is exposed), else, with no broker or a broker on loopback, 127.0.0.1 (one host)."""
    if explicit or os.environ.get("TRANSOM_ADVERTISE_ADDR"):
        return "0.0.0.0"
    if bootstrap:
        return _broker_route(bootstrap, "give --host / --advertise (TRANSOM_ADVERTISE_ADDR)")
    return "127.0.0.1"


def _broker_route(bootstrap: str, remedy: str) -> str:
    """This host's address on the route to the first broker of ``bootstrap``; a ConfigError ending
    in ``remedy`` when the kernel has no route there."""
    host, port = _first_broker(bootstrap)
    try:
        return route_source(host, port)
    except OSError as exc:
        raise ConfigError(f"cannot tell which address of this host reaches the broker {host}:{port} "
                          f"({exc}): {remedy}") from None


def is_loopback(addr: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return addr == "localhost"


def registration(kind: ServiceKind | str, node: str, *, addr: str, port: int, meta: Mapping[str, Any] | None = None,
                 ttl: float | None = None, cluster: str | None = None) -> Registration:
    """A :class:`Registration` of this process: host name, instance, boot id and times filled in."""
    now = time.time()
    return Registration(kind=ServiceKind(kind), node=node, host=socket.gethostname(), addr=addr, port=port,
                        instance=INSTANCE, started_ts=now, heartbeat_ts=now,
                        ttl_s=registry_ttl() if ttl is None else ttl, boot_id=boot_id(),
                        cluster=cluster or cluster_name(), meta=dict(meta or {}))


class RegistryWriter:
    """Publishes one registration and keeps it fresh; :meth:`stop` writes its tombstone."""

    def __init__(self, bootstrap: str, reg: Registration, *, interval: float | None = None) -> None:
        from .kafka import make_producer

        self.bootstrap = bootstrap
        self.reg = reg
        self.interval = interval if interval is not None else reg.ttl_s / 3
        # not idempotent: a heartbeat is superseded by the next one, so neither order nor exactly-once
        # matters, and an idempotent producer whose messages time out during a partition is fenced by
        # the broker for good (PRODUCER_FENCED), which kept a healed host out of the registry
        self._producer = make_producer(bootstrap, linger_ms=0, enable_idempotence=False,
                                       message_timeout_ms=int(max(reg.ttl_s, 5) * 1000))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"registry-{reg.kind.value}", daemon=True)
        self.failures = 0

    def start(self, timeout: float = 10.0) -> "RegistryWriter":
        """Publish now (wait up to ``timeout`` for the broker to take it), then refresh in the background."""
        self._publish()
        if self._producer.flush(timeout):
            log.warning("registration of %s %s not yet delivered to %s; retrying in the background",
                        self.reg.kind.value, self.reg.node, self.bootstrap)
        self._thread.start()
        log.info("registered %s of %s at %s in cluster %s (ttl %.0fs)", self.reg.kind.value, self.reg.node,
                 self.reg.endpoint, self.reg.cluster, self.reg.ttl_s)
        return self

    def update(self, **changes: Any) -> None:
        """Change fields of the registration (``meta=...``) and publish it now."""
        with self._lock:
            self.reg = replace(self.reg, **changes)
        self._publish()

    def _publish(self) -> None:
        from .kafka import produce

        with self._lock:
            self.reg = replace(self.reg, heartbeat_ts=time.time())
            value = contracts.encode(self.reg)
        produce(self._producer, contracts.REGISTRY, self.reg.key, value, on_delivery=self._delivered)
        self._producer.poll(0)

    def _delivered(self, err, _msg) -> None:
        if err is not None:
            self.failures += 1
            log.warning("registry heartbeat of %s %s not delivered: %s", self.reg.kind.value, self.reg.node, err)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._publish()
            except Exception as exc:  # noqa: BLE001 - the next heartbeat tries again
                log.warning("registry heartbeat of %s %s failed: %s", self.reg.kind.value, self.reg.node, exc)

    def stop(self, clean: bool = True, timeout: float = 5.0) -> None:
        """Stop refreshing; ``clean``: write the tombstone so readers forget this entry at once."""
        from .kafka import produce

        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if clean:
            produce(self._producer, contracts.REGISTRY, self.reg.key, None)
        if self._producer.flush(timeout):
            log.warning("registry: %s of %s left without its tombstone being delivered (readers drop it "
                        "after its ttl)", self.reg.kind.value, self.reg.node)


class RegistryView:
    """The newest entry per key of the registry topic, as a pure fold (tests drive it directly)."""

    def __init__(self, cluster: str | None = None, ttl: float | None = None) -> None:
        self.cluster = cluster or cluster_name()
        self.ttl = ttl                                  # None: each entry's own ttl_s
        self.entries: dict[str, Registration] = {}
        self.rejected = 0

    def apply(self, key: bytes | str | None, value: bytes | None) -> None:
        """Fold one record: a tombstone drops the key; an entry replaces an older heartbeat of it."""
        if isinstance(key, bytes):
            key = key.decode("utf-8", "replace")
        if not key or not key.startswith(self.cluster + "/"):
            return
        if value is None or value == b"":
            self.entries.pop(key, None)
            return
        try:
            reg = contracts.decode(contracts.REGISTRY, value)
        except contracts.ContractError as exc:
            self.rejected += 1
            log.warning("registry: ignored the entry under %s: %s", key, exc)
            return
        if reg.key != key:
            self.rejected += 1
            log.warning("registry: ignored an entry under %s that describes %s", key, reg.key)
            return
        old = self.entries.get(key)
        if old is None or reg.heartbeat_ts >= old.heartbeat_ts:
            self.entries[key] = reg

    def live(self, kind: ServiceKind | str, now: float | None = None) -> dict[str, Registration]:
        """Live entries of ``kind`` by node, in node order."""
        kind = ServiceKind(kind)
        now = time.time() if now is None else now
        return {r.node: r for r in sorted(self.entries.values(), key=lambda r: r.node)
                if r.kind is kind and not r.stale(now, self.ttl)}

    def get(self, kind: ServiceKind | str, node: str, now: float | None = None) -> Registration | None:
        reg = self.entries.get(registry_key(self.cluster, kind, node))
        return reg if reg is not None and not reg.stale(now, self.ttl) else None


class RegistryReader:
    """A :class:`RegistryView` kept current by a background consumer (no consumer group: no join wait)."""

    def __init__(self, bootstrap: str, *, cluster: str | None = None, ttl: float | None = None) -> None:
        self.bootstrap = bootstrap
        self.view = RegistryView(cluster, ttl)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-reader", daemon=True)
        self._consumer = None
        self.error: str | None = None

    def start(self, timeout: float = 15.0) -> "RegistryReader":
        """Start reading from the topic's beginning; return once caught up (or after ``timeout``)."""
        from confluent_kafka import Consumer

        from .kafka import QUIET_FETCH_WAIT_MS, client_config

        self._consumer = Consumer(client_config(
            self.bootstrap, group_id=f"transom-registry-{INSTANCE}", enable_auto_commit=False,
            enable_partition_eof=True, fetch_wait_max_ms=QUIET_FETCH_WAIT_MS, auto_offset_reset="earliest"))
        self._thread.start()
        if not self._synced.wait(timeout):
            log.warning("registry: not caught up with %s on %s within %.0fs; reading on in the background",
                        contracts.REGISTRY, self.bootstrap, timeout)
        return self

    def _run(self) -> None:
        c = self._consumer
        try:
            md = c.list_topics(contracts.REGISTRY, timeout=10)
            t = md.topics.get(contracts.REGISTRY)
            parts = sorted(t.partitions) if t is not None and t.partitions else [0]   # not created yet: wait for it
            pending = set()
            ends = {}
            for p in parts:
                try:
                    low, high = c.get_watermark_offsets(TopicPartition(contracts.REGISTRY, p), timeout=10)
                except KafkaException:       # no such topic yet: nothing to catch up with
                    low = high = 0
                if high > low:
                    pending.add(p)
                    ends[p] = high
            if not pending:
                self._synced.set()
            c.assign([TopicPartition(contracts.REGISTRY, p, OFFSET_BEGINNING) for p in parts])
        except Exception as exc:  # noqa: BLE001 - reported through .error and the log
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("registry: cannot read %s on %s: %s", contracts.REGISTRY, self.bootstrap, self.error)
            self._synced.set()
            return
        while not self._stop.is_set():
            msg = c.poll(0.5)        # a message returns at once; the timeout is only how often _stop is seen
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    pending.discard(msg.partition())
                    if not pending:
                        self._synced.set()
                continue
            with self._changed:
                self.view.apply(msg.key(), msg.value())
                self._changed.notify_all()
            if msg.partition() in pending and msg.offset() + 1 >= ends.get(msg.partition(), 0):
                pending.discard(msg.partition())
                if not pending:
                    self._synced.set()

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def live(self, kind: ServiceKind | str) -> dict[str, Registration]:
        with self._lock:
            return self.view.live(kind)

    def get(self, kind: ServiceKind | str, node: str) -> Registration | None:
        with self._lock:
            return self.view.get(kind, node)

    def wait_for(self, predicate: Callable[["RegistryReader"], Any], timeout: float) -> Any:
        """Wait until ``predicate(self)`` is truthy (re-checked on every change and every 0.5 s);
        return its value, or the falsy value it had at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            got = predicate(self)
            left = deadline - time.monotonic()
            if got or left <= 0:
                return got
            with self._changed:
                self._changed.wait(min(left, 0.5))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self._consumer is not None:
            try:
                self._consumer.close()
            except RuntimeError:
                pass

    def __enter__(self) -> "RegistryReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_registry(bootstrap: str, *, cluster: str | None = None, ttl: float | None = None,
                  timeout: float = 10.0) -> RegistryView:
    """The registry as it is now, read once from the topic's beginning (no background thread)."""
    from .kafka import read_records

    view = RegistryView(cluster, ttl)
    for r in read_records(bootstrap, contracts.REGISTRY, timeout=timeout):
        view.apply(r.key, r.value)
    return view
