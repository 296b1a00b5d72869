"""The collector seam: a small protocol, a registry by name, and the wrapper that applies policy.

A collector is anything with a ``name`` and ``collect() -> list[contracts.Sample]``; it may have
``close()``. Collectors know nothing about intervals, Kafka or error handling: the agent calls
each one through a :class:`RunningCollector` once per interval, which

- turns an exception into "no samples this time", logged once per distinct error (the agent
  keeps going and counts the failures);
- drops fields that the metrics contract would refuse (non-numbers, NaN, Inf), logged once, so
  one bad value never costs the whole batch.

The registry maps a name to a factory ``factory(agent) -> Collector | None`` (``None``: nothing
to collect on this node, e.g. no GPU); a second registration under one name is refused.

Exception tree::

    CollectorError(ValueError)     unknown or duplicate collector name
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Hashable, Protocol, runtime_checkable

from transom import contracts
from transom.log import get

__all__ = ["Collector", "CollectorError", "LogOnce", "RunningCollector",
           "register_collector", "create_collector", "collector_names"]

log = get("agent")


@runtime_checkable
class Collector(Protocol):
    """One input of the agent: returns the samples of this instant (may be empty)."""

    name: str

    def collect(self) -> list[contracts.Sample]: ...


class CollectorError(ValueError):
    """A collector name is unknown, or already registered."""


Factory = Callable[[Any], "Collector | None"]
_REGISTRY: dict[str, Factory] = {}


def register_collector(name: str, factory: Factory) -> None:
    """Register ``factory(agent)`` under ``name``; refuse a name that is taken."""
    if name in _REGISTRY:
        raise CollectorError(f"a collector named '{name}' is already registered")
    _REGISTRY[name] = factory


def collector_names() -> list[str]:
    return sorted(_REGISTRY)


def create_collector(name: str, agent: Any) -> "Collector | None":
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise CollectorError(f"unknown collector '{name}'; known: {', '.join(collector_names())}") from None
    return factory(agent)


class LogOnce:
    """Logs a message the first time its key is seen (bounded memory: forgets after ``limit`` keys)."""

    def __init__(self, logger: logging.Logger, limit: int = 256) -> None:
        self.logger = logger
        self.limit = limit
        self._seen: set[Hashable] = set()

    def __call__(self, key: Hashable, level: int, msg: str, *args: Any) -> bool:
        if key in self._seen:
            return False
        if len(self._seen) >= self.limit:
            self._seen.clear()
        self._seen.add(key)
        self.logger.log(level, msg, *args)
        return True


def _finite_number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value))


class RunningCollector:
    """A collector with the agent's error policy applied; ``errors`` counts failed collects."""

    def __init__(self, collector: Collector, logger: logging.Logger = log) -> None:
        self.collector = collector
        self.name = collector.name
        self.errors = 0
        self.dropped_fields = 0
        self._once = LogOnce(logger)

    def collect(self) -> list[contracts.Sample]:
        try:
            samples = list(self.collector.collect())
        except Exception as exc:  # the policy: one bad collector never stops the agent
            self.errors += 1
            self._once(("error", type(exc).__name__, str(exc)), logging.WARNING,
                       "collector %s failed: %s: %s (logged once per distinct error; the agent goes on)",
                       self.name, type(exc).__name__, exc)
            return []
        return [self._clean(s) for s in samples]

    def _clean(self, sample: contracts.Sample) -> contracts.Sample:
        bad = [k for k, v in sample.fields.items() if not _finite_number(v)]
        if not bad:
            return sample
        self.dropped_fields += len(bad)
        for k in bad:
            self._once(("field", k), logging.WARNING,
                       "collector %s produced %s=%r, which is not a finite number; field dropped",
                       self.name, k, sample.fields[k])
        return contracts.Sample(sample.source, {k: v for k, v in sample.fields.items() if k not in bad},
                                index=sample.index, tags=sample.tags, ts=sample.ts)

    def close(self) -> None:
        close = getattr(self.collector, "close", None)
        if close is not None:
            try:
                close()
            except Exception as exc:
                log.warning("closing collector %s failed: %s", self.name, exc)
