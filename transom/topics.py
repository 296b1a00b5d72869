"""How many partitions and replicas Transom's topics get, from configuration, and what an existing
topic lacks.

Settings (environment, or ``transom topics`` flags, which win):

=================================  ===========================================================  ==========
variable                           what                                                         default
=================================  ===========================================================  ==========
``TRANSOM_TOPIC_PARTITIONS``       ``topic=N[,topic=N]`` partition counts (``metrics=24`` or    ``contracts.TOPICS``
                                   ``transom.metrics=24``)
``TRANSOM_REPLICATION_FACTOR``     replicas of every partition, or ``auto``                     auto: 3 with 3+ brokers,
                                                                                                else the broker count
``TRANSOM_MIN_INSYNC_REPLICAS``    replicas an ``acks=all`` write waits for, or ``auto``         auto: 2 with 3+ replicas,
                                                                                                else 1
=================================  ===========================================================  ==========

A replication factor above the brokers in the cluster's metadata, or ``min.insync.replicas`` above
the replication factor, is a :class:`ConfigError` naming the setting and the broker count (checked
before anything is created: Tansu, the embedded broker, accepts any factor and lists the one broker
several times).

:func:`compare` says how an existing topic differs from its spec (:class:`Difference`); fewer
partitions than configured is an error (``severe``): a worker count sized to the configuration would
find partitions missing, and metrics keyed by node would not spread as planned. Kafka can add
partitions (``transom topics --grow``); Tansu cannot (no CreatePartitions): recreate the topic there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Mapping

from . import contracts
from .config import ConfigError

__all__ = ["TopicSettings", "Difference", "TopicMismatch", "compare", "PARTITIONS_ENV", "REPLICATION_ENV",
           "MIN_ISR_ENV"]

PARTITIONS_ENV = "TRANSOM_TOPIC_PARTITIONS"
REPLICATION_ENV = "TRANSOM_REPLICATION_FACTOR"
MIN_ISR_ENV = "TRANSOM_MIN_INSYNC_REPLICAS"
#: Replication factor in production: a partition survives the loss of two brokers, writes with one.
PRODUCTION_REPLICAS = 3


class TopicMismatch(ConfigError):
    """An existing topic has fewer partitions than configured; the message says what to do."""


def _auto_int(key: str, raw: str | None) -> int | None:
    if raw is None or raw.strip() in ("", "auto"):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r}: expected a positive integer or 'auto'") from None
    if value < 1:
        raise ConfigError(f"{key}={raw!r}: expected a positive integer or 'auto'")
    return value


def parse_partitions(raw: str | None, key: str = PARTITIONS_ENV) -> dict[str, int]:
    """``"metrics=24,transom.faults=4"`` -> ``{METRICS: 24, FAULTS: 4}`` (topic names of :mod:`.contracts`)."""
    known = {s.name for s in contracts.TOPICS}
    out: dict[str, int] = {}
    for item in (raw or "").split(","):
        if not item.strip():
            continue
        name, sep, count = item.partition("=")
        name = name.strip()
        name = name if name in known else f"transom.{name}"
        if not sep or name not in known:
            raise ConfigError(f"{key}: {item.strip()!r}: expected TOPIC=N with TOPIC one of "
                              f"{', '.join(sorted(known))} (the 'transom.' prefix may be left out)")
        try:
            n = int(count)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"{key}: {item.strip()!r}: expected a positive partition count")
        out[name] = n
    return out


@dataclass(frozen=True)
class TopicSettings:
    """Partitions per topic (overrides of ``contracts.TOPICS``) and the replication settings.

    ``replication_factor`` / ``min_insync_replicas`` None mean ``auto`` (see the module doc)."""

    #: topic -> partition count, for the topics whose default is not wanted.
    partitions: Mapping[str, int] = field(default_factory=dict)
    #: replicas of each partition; None: 3 with 3+ brokers, else the broker count.
    replication_factor: int | None = None
    #: in-sync replicas an acks=all write needs; None: 2 with 3+ replicas, else 1.
    min_insync_replicas: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "TopicSettings":
        env = os.environ if env is None else env
        return cls(partitions=parse_partitions(env.get(PARTITIONS_ENV)),
                   replication_factor=_auto_int(REPLICATION_ENV, env.get(REPLICATION_ENV)),
                   min_insync_replicas=_auto_int(MIN_ISR_ENV, env.get(MIN_ISR_ENV)))

    def partitions_of(self, topic: str) -> int:
        return next(s.partitions for s in self.specs() if s.name == topic)

    def replication(self, brokers: int) -> tuple[int, int]:
        """``(replication factor, min.insync.replicas)`` for a cluster of ``brokers``; ConfigError if it cannot."""
        rf = self.replication_factor or min(PRODUCTION_REPLICAS, max(brokers, 1))
        if rf > brokers:
            raise ConfigError(f"{REPLICATION_ENV}={rf}: the cluster has {brokers} broker(s), so no partition can "
                              f"have more than {brokers} replica(s); set {REPLICATION_ENV} to at most {brokers} "
                              f"(or 'auto'), or add brokers")
        isr = self.min_insync_replicas or (2 if rf >= 3 else 1)
        if isr > rf:
            raise ConfigError(f"{MIN_ISR_ENV}={isr}: above the replication factor {rf} ({REPLICATION_ENV}, "
                              f"{brokers} broker(s)): no acks=all write could succeed; set it to at most {rf}")
        return rf, isr

    def specs(self, min_insync_replicas: int | None = None) -> tuple[contracts.TopicSpec, ...]:
        """``contracts.TOPICS`` with these partition counts (and ``min.insync.replicas`` when given)."""
        out = []
        for s in contracts.TOPICS:
            conf = dict(s.config)
            if min_insync_replicas is not None:
                conf["min.insync.replicas"] = str(min_insync_replicas)
            out.append(replace(s, partitions=self.partitions.get(s.name, s.partitions), config=conf))
        return tuple(out)


@dataclass(frozen=True)
class Difference:
    """How one existing topic differs from its spec; ``severe``: it must not be used as it is."""

    topic: str
    what: str          # "partitions", "replication" or a config key
    have: str
    want: str
    severe: bool = False

    def __str__(self) -> str:
        if self.what == "partitions":
            hint = (f"; more workers than {self.have} cannot share it. Add partitions with `transom topics --grow` "
                    f"(Kafka; Tansu cannot), recreate the topic, or set {PARTITIONS_ENV}={self.topic}={self.have}"
                    if self.severe else " (more than configured: kept)")
            return f"topic {self.topic} has {self.have} partitions, configured {self.want}{hint}"
        if self.what == "replication":
            return (f"topic {self.topic} has {self.have} replica(s) per partition, configured {self.want} "
                    f"({REPLICATION_ENV}); change it with a partition reassignment (kafka-reassign-partitions)")
        return f"topic {self.topic} has {self.what}={self.have}, configured {self.want} (kafka-configs --alter)"


def compare(spec: contracts.TopicSpec, *, partitions: int, replicas: int, replication_factor: int,
            config: Mapping[str, str] | None) -> list[Difference]:
    """What an existing topic (``partitions``, ``replicas`` per partition, its ``config`` when the broker
    describes it) lacks against ``spec`` and ``replication_factor``."""
    out = []
    if partitions != spec.partitions:
        out.append(Difference(spec.name, "partitions", str(partitions), str(spec.partitions),
                              severe=partitions < spec.partitions))
    if replicas != replication_factor:
        out.append(Difference(spec.name, "replication", str(replicas), str(replication_factor)))
    if config is not None:
        for k, v in spec.config.items():
            if config.get(k) != v:
                out.append(Difference(spec.name, k, str(config.get(k, "(default)")), v))
    return out
