"""The collector seam: a small protocol, a registry by name, and the runner that applies policy.

A collector is a small class with a ``name``, an optional ``Settings`` dataclass (its config
section ``[collectors.<name>]``, every field documented and defaulted) and one
``collect() -> list[contracts.Sample]``; a push source also has ``start(emit)`` / ``stop()``
and calls ``emit(samples)`` from its own thread. It may have ``close()``. Collectors know nothing
about intervals, tags, Kafka or error handling: the agent calls each through a
:class:`RunningCollector`, which applies once, for all of them,

- the interval: ``interval`` seconds (a key every section accepts; default the agent's) rounded to
  a whole number of agent ticks;
- the tags: the agent's ``tags`` and the section's ``tags`` table are added to every sample
  (a collector's own tag of the same name wins);
- the error policy: an exception is "no samples this time", logged once per distinct error and
  counted in ``errors``; fields the metrics contract would refuse (non-numbers, NaN, Inf) are
  dropped, logged once, so one bad value never costs the whole batch.

The registry maps a name to ``(factory, Settings)``, where ``factory(ctx, settings)`` returns the
collector or ``None`` (nothing to collect on this node). A second registration under one name is
refused; an unknown name is an error that lists the known ones.

Exception tree::

    CollectorError(ConfigError)     unknown or duplicate collector name
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Hashable, Mapping, Protocol, runtime_checkable

from transom import contracts
from transom.config import ConfigError
from transom.log import get

__all__ = ["Collector", "PushCollector", "CollectorError", "LogOnce", "RunningCollector", "Registration",
           "register_collector", "create_collector", "collector_names", "registration", "COMMON_KEYS"]

log = get("agent")

#: Keys every ``[collectors.<name>]`` section accepts, applied by the runner.
COMMON_KEYS = {"interval": "seconds between collects (default: the agent's interval)",
               "tags": "table of tags added to every sample of this collector"}


@runtime_checkable
class Collector(Protocol):
    """One input of the agent: returns the samples of this instant (may be empty)."""

    name: str

    def collect(self) -> list[contracts.Sample]: ...


@runtime_checkable
class PushCollector(Collector, Protocol):
    """A collector that also hands samples to ``emit`` as they happen (e.g. XID events)."""

    def start(self, emit: Callable[[list[contracts.Sample]], None]) -> None: ...

    def stop(self) -> None: ...


class CollectorError(ConfigError):
    """A collector name is unknown, or already registered."""


@dataclasses.dataclass(frozen=True)
class Registration:
    name: str
    factory: Callable[[Any, Any], "Collector | None"]
    settings: type | None
    doc: str


_REGISTRY: dict[str, Registration] = {}


def register_collector(name: str, factory: Callable[[Any, Any], "Collector | None"],
                       settings: type | None = None, doc: str = "") -> None:
    """Register ``factory(ctx, settings)`` under ``name``; refuse a name that is taken."""
    if name in _REGISTRY:
        raise CollectorError(f"a collector named '{name}' is already registered")
    if settings is not None and not dataclasses.is_dataclass(settings):
        raise TypeError(f"collector {name}: settings must be a dataclass, got {settings!r}")
    _REGISTRY[name] = Registration(name, factory, settings, doc)


def collector_names() -> list[str]:
    return sorted(_REGISTRY)


def registration(name: str) -> Registration:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise CollectorError(f"unknown collector '{name}'; valid: {', '.join(collector_names())}") from None


def create_collector(name: str, ctx: Any, settings: Any = None) -> "Collector | None":
    reg = registration(name)
    if settings is None and reg.settings is not None:
        settings = reg.settings()
    return reg.factory(ctx, settings)


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
    """A collector with the agent's policy applied; ``errors`` counts failed collects."""

    def __init__(self, collector: Collector, logger: logging.Logger = log, *, every: int = 1,
                 tags: Mapping[str, str] | None = None) -> None:
        self.collector = collector
        self.name = collector.name
        self.every = max(1, int(every))
        self.tags = dict(tags or {})
        self.errors = 0
        self.dropped_fields = 0
        self._tick = 0
        self._once = LogOnce(logger)

    @property
    def is_push(self) -> bool:
        return callable(getattr(self.collector, "start", None))

    def start(self, emit: Callable[[list[contracts.Sample]], None]) -> None:
        if self.is_push:
            self.collector.start(lambda samples: emit([self._clean(s) for s in samples]))  # type: ignore[attr-defined]

    def due(self) -> bool:
        """True on the ticks this collector runs (every ``every``-th agent tick, the first included)."""
        due = self._tick % self.every == 0
        self._tick += 1
        return due

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
        if not bad and not self.tags:
            return sample
        self.dropped_fields += len(bad)
        for k in bad:
            self._once(("field", k), logging.WARNING,
                       "collector %s produced %s=%r, which is not a finite number; field dropped",
                       self.name, k, sample.fields[k])
        fields = {k: v for k, v in sample.fields.items() if k not in bad} if bad else sample.fields
        tags = {**self.tags, **sample.tags} if self.tags else sample.tags
        return contracts.Sample(sample.source, fields, index=sample.index, tags=tags, ts=sample.ts)

    def close(self) -> None:
        for method in ("stop", "close"):
            fn = getattr(self.collector, method, None)
            if fn is not None:
                try:
                    fn()
                except Exception as exc:
                    log.warning("%s of collector %s failed: %s", method, self.name, exc)
