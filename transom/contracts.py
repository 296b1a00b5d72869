"""The contracts between Transom's components: topic names, event types, JSON codecs.

This module is the only place that names a topic. Every value on a topic is a JSON object with a
schema version ``v``; ``decode_*`` functions validate what they read and raise
:class:`ContractError` with a reason that is fit for the dead-letter topic.

Exception tree::

    ContractError(ValueError)      a value does not follow its contract (the reason says why)

Topics (see ``TOPICS`` for partition counts and configs):

=====================  ==========  ================================================
topic                  key         value
=====================  ==========  ================================================
transom.metrics        node id     :class:`MetricBatch`
transom.faults         job id      :class:`FaultEvent`
transom.checkpoints    job id      :class:`CheckpointReady`
transom.lifecycle      job id      :class:`LifecycleEvent` (compacted; carries a job snapshot)
transom.deadletter     orig. key   :class:`DeadLetter`
transom.registry       CL/KIND/NODE :class:`Registration` (compacted; a null value, the tombstone,
                                   says the service left cleanly; see :mod:`transom.registry`)
transom.peer-windows   job id      :class:`JobFeed`: node windows and rank progress (the TEE's
                                   internal repartition topic)
=====================  ==========  ================================================
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import orjson      # 3-4x faster parsing of metric batches (the TEE reads thousands a second)

__all__ = [
    "SCHEMA_VERSION", "ContractError", "TopicSpec", "TOPICS",
    "METRICS", "FAULTS", "CHECKPOINTS", "LIFECYCLE", "HISTORY", "DEADLETTER", "PEER_WINDOWS", "PeerWindow",
    "RankReport", "JobFeed", "RANK_LIFECYCLE_EVENTS",
    "Source", "Sample", "MetricBatch", "FaultKind", "Severity", "Action", "FaultEvent",
    "Shard", "Copy", "Tier", "CheckpointReady", "LifecycleEvent", "DeadLetter",
    "REGISTRY", "ServiceKind", "Registration", "UNROUTABLE", "registry_key",
    "decode", "encode", "stable_id", "DCGM",
]

SCHEMA_VERSION = 1

METRICS = "transom.metrics"
FAULTS = "transom.faults"
CHECKPOINTS = "transom.checkpoints"
LIFECYCLE = "transom.lifecycle"
#: Events a rank's elastic API (transom.elastic) sends the controller on LIFECYCLE under the key
#: ``__elastic__JOB``: not steps of the controller's timeline (their seq is not the job's).
#: ``collective_failed``: a rank's collective failed (a peer gone); the controller looks at the ranks at once.
RANK_LIFECYCLE_EVENTS = frozenset({"elastic_joined", "spare_ready", "elastic_synced", "collective_failed"})
HISTORY = "transom.history"
DEADLETTER = "transom.deadletter"
REGISTRY = "transom.registry"
#: The TEE's own repartition topic: per-node window summaries and rank progress keyed by job
#: (:class:`JobFeed`, see streams/app.py).
PEER_WINDOWS = "transom.peer-windows"


class ContractError(ValueError):
    """A message does not follow its contract; ``str(err)`` is the reason."""


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: Mapping[str, str] = field(default_factory=dict)


#: Every topic Transom uses, created up front by :func:`transom.kafka.ensure_topics`.
#: Metrics are partitioned by node so a node's samples stay in order and one TEE worker owns
#: a node's window; the lifecycle topic is compacted and keyed by job (each value carries the
#: job's full snapshot, so compaction keeps what a restarted controller needs: the newest snapshot
#: per job, the newest lease event). What users read (a job's timeline: `transom jobs show`,
#: `transom report`) is the history topic: every lifecycle event again, in order, never compacted,
#: deleted after its retention (90 days).
#: Partition counts here are the defaults; :mod:`transom.topics` takes others from configuration.
HISTORY_RETENTION_MS = 90 * 24 * 3600 * 1000
TOPICS: tuple[TopicSpec, ...] = (
    TopicSpec(METRICS, 12, {"retention.ms": str(24 * 3600 * 1000)}),
    TopicSpec(FAULTS, 2),
    TopicSpec(CHECKPOINTS, 2),
    TopicSpec(LIFECYCLE, 1, {"cleanup.policy": "compact"}),
    TopicSpec(HISTORY, 1, {"cleanup.policy": "delete", "retention.ms": str(HISTORY_RETENTION_MS)}),
    TopicSpec(DEADLETTER, 1),
    TopicSpec(REGISTRY, 1, {"cleanup.policy": "compact"}),
    TopicSpec(PEER_WINDOWS, 12, {"retention.ms": str(3600 * 1000)}),
)


class DCGM:
    """Metric names, following NVIDIA DCGM field names where one exists."""

    GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
    MEM_COPY_UTIL = "DCGM_FI_DEV_MEM_COPY_UTIL"
    FB_USED = "DCGM_FI_DEV_FB_USED"
    FB_FREE = "DCGM_FI_DEV_FB_FREE"
    GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"
    MEMORY_TEMP = "DCGM_FI_DEV_MEMORY_TEMP"
    POWER_USAGE = "DCGM_FI_DEV_POWER_USAGE"
    SM_CLOCK = "DCGM_FI_DEV_SM_CLOCK"
    MEM_CLOCK = "DCGM_FI_DEV_MEM_CLOCK"
    XID_ERRORS = "DCGM_FI_DEV_XID_ERRORS"
    ECC_DBE_VOL_TOTAL = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
    ECC_SBE_VOL_TOTAL = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
    #: Not a DCGM field: 1 when NVML answers GPU_IS_LOST for this device.
    GPU_LOST = "transom_gpu_lost"


class Source(str, enum.Enum):
    GPU = "gpu"
    NIC = "nic"
    HOST = "host"
    TRAIN = "train"
    AGENT = "agent"


class FaultKind(str, enum.Enum):
    XID = "xid"
    GPU_LOST = "gpu_lost"
    NODE_LOST = "node_lost"      # the agent's heartbeat stopped
    HANG = "hang"                # ranks alive, no step progress
    RANK_EXIT = "rank_exit"      # a training process died
    NAN_LOSS = "nan_loss"
    ANOMALY = "anomaly"          # a soft fault from a pyod detector
    STRAGGLER = "straggler"      # a node slower than its job's peers (soft, from the peers detector)


class Severity(str, enum.Enum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class Action(str, enum.Enum):
    EVICT = "evict"        # take the node out, replace it with a spare, relaunch
    RESTART = "restart"    # relaunch on the same nodes
    OBSERVE = "observe"    # record only


class Tier(str, enum.Enum):
    MEMORY = "memory"
    DISK = "disk"
    SHARED = "shared"


# --------------------------------------------------------------------------- validation helpers

_NUM = (int, float)
_PLAIN_NUMBERS = frozenset((int, float))
_PLAIN_STR = frozenset((str,))


def _get(d: Mapping[str, Any], key: str, types: type | tuple[type, ...], *, what: str,
         optional: bool = False, default: Any = None) -> Any:
    if key not in d or d[key] is None:
        if optional:
            return default
        raise ContractError(f"{what}: missing required field '{key}'")
    value = d[key]
    if type(value) is types or (types is Mapping and type(value) is dict):
        return value              # the common case, decided without abc instance checks
    if types is _NUM or types == float:
        if isinstance(value, bool) or not isinstance(value, _NUM):
            raise ContractError(f"{what}: field '{key}' must be a number, got {type(value).__name__}")
        return value
    if isinstance(value, bool) and types is int:
        raise ContractError(f"{what}: field '{key}' must be an integer, got bool")
    if not isinstance(value, types):
        names = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise ContractError(f"{what}: field '{key}' must be {names}, got {type(value).__name__}")
    return value


def _enum(cls: type[enum.Enum], d: Mapping[str, Any], key: str, *, what: str,
          optional: bool = False) -> Any:
    raw = _get(d, key, str, what=what, optional=optional)
    if raw is None:
        return None
    try:
        return cls(raw)
    except ValueError:
        valid = ", ".join(m.value for m in cls)  # type: ignore[attr-defined]
        raise ContractError(f"{what}: field '{key}' is '{raw}', expected one of: {valid}") from None


def _check_version(d: Mapping[str, Any], what: str) -> None:
    v = _get(d, "v", int, what=what)
    if v != SCHEMA_VERSION:
        raise ContractError(f"{what}: schema version {v} is not supported (this build reads {SCHEMA_VERSION})")


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _finite_sum(values: Any) -> bool:
    try:
        return math.isfinite(sum(values))
    except OverflowError:           # an integer beyond float's range
        return False


def stable_id(*parts: Any) -> str:
    """A short id that is the same for the same parts, in any process: for de-duplication."""
    text = "\x1f".join(str(p) for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


# --------------------------------------------------------------------------- metrics

@dataclass(frozen=True)
class Sample:
    """Values of one source (and one device of it) at one instant."""

    source: Source
    fields: Mapping[str, float]
    index: int | None = None                  # device index (GPU 0..7, NIC port, rank)
    tags: Mapping[str, str] = field(default_factory=dict)
    ts: float | None = None                   # set when the sample's time differs from the batch's

    @classmethod
    def from_dict(cls, d: Any, what: str = "sample", *, owned: bool = False) -> "Sample":
        """``owned``: ``d`` was just parsed and nobody else holds it, so its dicts need no copy."""
        if type(d) is not dict and not isinstance(d, Mapping):
            raise ContractError(f"{what}: must be an object")
        fields_ = d.get("fields")
        if type(fields_) is not dict:          # the common case is decided without a call
            fields_ = _get(d, "fields", Mapping, what=what)
        values = fields_.values()
        if not set(map(type, values)) <= _PLAIN_NUMBERS:     # fast check; the loop names the culprit
            for name, value in fields_.items():
                if isinstance(value, bool) or not isinstance(value, _NUM):
                    raise ContractError(f"{what}: metric '{name}' must be a number, got {type(value).__name__}")
        if not _finite_sum(values):     # a finite sum means every value is finite (one C call)
            for name, value in fields_.items():
                if not _finite_sum((value,)):
                    raise ContractError(f"{what}: metric '{name}' must be a finite number, got {value}")
        tags = d.get("tags")
        if tags is None:
            tags = {}
        elif type(tags) is not dict:
            tags = _get(d, "tags", Mapping, what=what, optional=True, default={})
        if tags and not set(map(type, tags.values())) <= _PLAIN_STR:
            for name, value in tags.items():
                if not isinstance(value, str):
                    raise ContractError(f"{what}: tag '{name}' must be a string")
        source = _SOURCES.get(d.get("source")) if type(d.get("source")) is str else None
        # validated above: build the frozen instance without its __init__'s five object.__setattr__ calls
        # (the TEE decodes a dozen samples per node batch, thousands of batches a second)
        index, ts = d.get("index"), d.get("ts")
        if index is not None and (type(index) is not int or index < 0):
            index = _get(d, "index", int, what=what, optional=True)
            if index < 0:
                raise ContractError(f"{what}: field 'index' must not be negative, got {index}")
        if ts is not None and (type(ts) not in _PLAIN_NUMBERS or not math.isfinite(ts) or ts <= 0):
            ts = _get(d, "ts", _NUM, what=what, optional=True)
            if not math.isfinite(ts) or ts <= 0:
                raise ContractError(f"{what}: field 'ts' must be a positive epoch time, got {ts}")
        obj = object.__new__(cls)
        obj.__dict__.update(source=source if source is not None else _enum(Source, d, "source", what=what),
                            fields=fields_ if owned and type(fields_) is dict else dict(fields_), index=index,
                            tags=tags if owned and type(tags) is dict else dict(tags), ts=ts)
        return obj


_SOURCES = {m.value: m for m in Source}


def _owned_samples(samples: list, no_bools: bool = False) -> tuple[Sample, ...] | None:
    """The samples of a just-parsed batch, checked together: the same checks as :meth:`Sample.from_dict`
    made once per batch (one finite sum over every value of every sample, a type check unless
    ``no_bools``: the text held no ``true``/``false``), or None when any sample is not the plain case
    (then each is decoded alone and the culprit named). The TEE decodes a dozen samples per node
    batch, thousands of batches a second."""
    out = []
    values: list = []         # only where a value may be a bool: their types are checked
    total = 0.0
    new, sources, plain = object.__new__, _SOURCES, _PLAIN_NUMBERS
    try:      # sum refuses what is not a number (TypeError): of the rest only bools pass
        for s in samples:
            if type(s) is not dict:
                return None
            fields_, source, index, ts, tags = s.get("fields"), s.get("source"), s.get("index"), s.get("ts"), \
                s.get("tags")
            if type(fields_) is not dict or type(source) is not str:
                return None
            source = sources.get(source)
            if source is None or index is not None and (type(index) is not int or index < 0):
                return None
            if ts is not None and (type(ts) not in plain or not 0 < ts < math.inf):
                return None
            if tags is None:
                tags = {}
            elif type(tags) is not dict:
                return None
            elif tags and not set(map(type, tags.values())) <= _PLAIN_STR:
                return None
            if fields_:
                total = sum(fields_.values(), total)
                if not no_bools:
                    values.extend(fields_.values())
            obj = new(Sample)
            obj.__dict__.update(source=source, fields=fields_, index=index, tags=tags, ts=ts)
            out.append(obj)
    except (TypeError, OverflowError):
        return None
    if not math.isfinite(total) or values and not set(map(type, values)) <= plain:
        return None
    return tuple(out)


class _SampleWhere:
    """'metric batch sample 3', formatted only when an error message needs it."""

    __slots__ = ("what", "i")

    def __init__(self, what: str, i: int) -> None:
        self.what, self.i = what, i

    def __str__(self) -> str:
        return f"{self.what} sample {self.i}"

    def __format__(self, spec: str) -> str:      # f-strings call __format__, not __str__
        return format(str(self), spec)


@dataclass(frozen=True)
class MetricBatch:
    """All samples of one node at one instant; ``seq`` counts batches per node from 0."""

    node: str
    ts: float
    seq: int
    samples: tuple[Sample, ...]
    job: str | None = None
    v: int = SCHEMA_VERSION

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, owned: bool = False, no_bools: bool = False) -> "MetricBatch":
        """``owned``: ``d`` was just parsed (its dicts are used as they are); ``no_bools``: its text held
        no ``true``/``false``, so no value is a bool."""
        what = "metric batch"
        _check_version(d, what)
        node = _get(d, "node", str, what=what)
        if not node:
            raise ContractError(f"{what}: field 'node' is empty")
        ts = _get(d, "ts", _NUM, what=what)
        if not math.isfinite(ts) or ts <= 0:
            raise ContractError(f"{what}: field 'ts' must be a positive epoch time, got {ts}")
        samples = _get(d, "samples", list, what=what)
        seq = _get(d, "seq", int, what=what)
        if seq < 0:
            raise ContractError(f"{what}: field 'seq' must not be negative, got {seq}")
        built = _owned_samples(samples, no_bools) if owned else None
        if built is None:     # not just parsed, or a sample the fast checks do not pass: one by one, saying why
            built = tuple(Sample.from_dict(s, _SampleWhere(what, i), owned=owned) for i, s in enumerate(samples))
        job = d.get("job")
        if job is not None and type(job) is not str:
            job = _get(d, "job", str, what=what, optional=True)
        obj = object.__new__(cls)     # validated: no frozen __init__ (thousands a second)
        obj.__dict__.update(node=node, ts=float(ts), seq=seq, samples=built, job=job, v=SCHEMA_VERSION)
        return obj

    def of(self, source: Source) -> tuple[Sample, ...]:
        """The samples of ``source``, in batch order (grouped once per batch: the TEE's rules ask often)."""
        groups = self.__dict__.get("_by_source")
        if groups is None:
            lists: dict[Source, list[Sample]] = {}
            for s in self.samples:
                lists.setdefault(s.source, []).append(s)
            groups = {k: tuple(v) for k, v in lists.items()}
            object.__setattr__(self, "_by_source", groups)     # a cache, not a field: eq, hash, asdict ignore it
        return groups.get(source, ())


# --------------------------------------------------------------------------- faults

@dataclass(frozen=True)
class FaultEvent:
    """A detected fault. ``fault_id`` is stable: a redelivered input yields the same id."""

    fault_id: str
    job: str | None
    node: str
    kind: FaultKind
    severity: Severity
    detector: str
    action: Action
    observed_ts: float          # timestamp of the sample that triggered the detection
    detected_ts: float          # when the detector decided
    rank: int | None = None
    score: float | None = None
    threshold: float | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)
    summary: str = ""
    resolved: bool = False
    v: int = SCHEMA_VERSION

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FaultEvent":
        what = "fault event"
        _check_version(d, what)
        return cls(
            fault_id=_get(d, "fault_id", str, what=what),
            job=_get(d, "job", str, what=what, optional=True),
            node=_get(d, "node", str, what=what),
            kind=_enum(FaultKind, d, "kind", what=what),
            severity=_enum(Severity, d, "severity", what=what),
            detector=_get(d, "detector", str, what=what),
            action=_enum(Action, d, "action", what=what),
            observed_ts=float(_get(d, "observed_ts", _NUM, what=what)),
            detected_ts=float(_get(d, "detected_ts", _NUM, what=what)),
            rank=_get(d, "rank", int, what=what, optional=True),
            score=_get(d, "score", _NUM, what=what, optional=True),
            threshold=_get(d, "threshold", _NUM, what=what, optional=True),
            evidence=dict(_get(d, "evidence", Mapping, what=what, optional=True, default={})),
            summary=_get(d, "summary", str, what=what, optional=True, default=""),
            resolved=_get(d, "resolved", bool, what=what, optional=True, default=False),
        )


# --------------------------------------------------------------------------- checkpoints

@dataclass(frozen=True)
class Shard:
    """One rank's shard of a step. ``digest`` is ``ALG:HEX`` (transom.checkpoint.digest); shards
    written before it existed carry only ``sha256``, which :attr:`checksum` reads as ``sha256:HEX``."""

    rank: int
    name: str
    size: int
    sha256: str = ""
    digest: str = ""

    @property
    def checksum(self) -> str:
        return self.digest or f"sha256:{self.sha256}"

    @classmethod
    def from_dict(cls, d: Any, what: str = "shard") -> "Shard":
        if not isinstance(d, Mapping):
            raise ContractError(f"{what}: must be an object")
        sha = _get(d, "sha256", str, what=what, optional=True, default="")
        digest = _get(d, "digest", str, what=what, optional=True, default="")
        if sha and len(sha) != 64:
            raise ContractError(f"{what}: field 'sha256' must be 64 hex digits")
        if digest and ":" not in digest:
            raise ContractError(f"{what}: field 'digest' must be ALGORITHM:HEX, got {digest!r}")
        if not sha and not digest:
            raise ContractError(f"{what}: needs a 'digest' (or, written by older versions, 'sha256')")
        return cls(rank=_get(d, "rank", int, what=what), name=_get(d, "name", str, what=what),
                   size=_get(d, "size", int, what=what), sha256=sha, digest=digest)


@dataclass(frozen=True)
class Copy:
    """Where one rank's shard lives: a node and a tier, with a locator for that tier."""

    rank: int
    node: str
    tier: Tier
    location: str

    @classmethod
    def from_dict(cls, d: Any, what: str = "copy") -> "Copy":
        if not isinstance(d, Mapping):
            raise ContractError(f"{what}: must be an object")
        return cls(rank=_get(d, "rank", int, what=what), node=_get(d, "node", str, what=what),
                   tier=_enum(Tier, d, "tier", what=what), location=_get(d, "location", str, what=what))


@dataclass(frozen=True)
class CheckpointReady:
    """Published once every rank's shard of ``step`` exists where ``copies`` say."""

    job: str
    step: int
    world_size: int
    shards: tuple[Shard, ...]
    copies: tuple[Copy, ...]
    replicated: bool
    persisted: bool
    ts: float
    generation: int = 0
    v: int = SCHEMA_VERSION

    @property
    def checkpoint_id(self) -> str:
        return f"{self.job}@{self.step}"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CheckpointReady":
        what = "checkpoint-ready event"
        _check_version(d, what)
        shards = tuple(Shard.from_dict(s, f"{what} shard {i}")
                       for i, s in enumerate(_get(d, "shards", list, what=what)))
        world = _get(d, "world_size", int, what=what)
        if sorted(s.rank for s in shards) != list(range(world)):
            raise ContractError(f"{what}: shards must cover ranks 0..{world - 1} exactly once")
        return cls(
            job=_get(d, "job", str, what=what), step=_get(d, "step", int, what=what),
            world_size=world, shards=shards,
            copies=tuple(Copy.from_dict(c, f"{what} copy {i}")
                         for i, c in enumerate(_get(d, "copies", list, what=what))),
            replicated=_get(d, "replicated", bool, what=what),
            persisted=_get(d, "persisted", bool, what=what),
            ts=float(_get(d, "ts", _NUM, what=what)),
            generation=_get(d, "generation", int, what=what, optional=True, default=0),
        )


# --------------------------------------------------------------------------- lifecycle

@dataclass(frozen=True)
class LifecycleEvent:
    """One state change or action of the controller, with its cause and the job's snapshot.

    ``snapshot`` is the job's whole record after this event; a controller that starts replays
    the topic and keeps the last snapshot of each job, so a compacted topic is enough.
    """

    job: str
    seq: int                    # per job, from 0, no gaps
    ts: float
    name: str                   # e.g. "submitted", "launched", "fault", "evicted", "relaunched"
    state: str                  # the job state after the event
    cause: Mapping[str, Any] = field(default_factory=dict)
    detail: Mapping[str, Any] = field(default_factory=dict)
    snapshot: Mapping[str, Any] = field(default_factory=dict)
    v: int = SCHEMA_VERSION

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LifecycleEvent":
        what = "lifecycle event"
        _check_version(d, what)
        return cls(
            job=_get(d, "job", str, what=what), seq=_get(d, "seq", int, what=what),
            ts=float(_get(d, "ts", _NUM, what=what)), name=_get(d, "name", str, what=what),
            state=_get(d, "state", str, what=what),
            cause=dict(_get(d, "cause", Mapping, what=what, optional=True, default={})),
            detail=dict(_get(d, "detail", Mapping, what=what, optional=True, default={})),
            snapshot=dict(_get(d, "snapshot", Mapping, what=what, optional=True, default={})),
        )


# --------------------------------------------------------------------------- service registry

class ServiceKind(str, enum.Enum):
    """What a :class:`Registration` advertises (one entry per kind and node)."""

    CKPT_DAEMON = "ckpt-daemon"     # a node's TCE daemon: replication, restore reads (wire of checkpoint/wire.py)
    AGENT = "agent"                 # a node agent's training intake
    LAUNCHER = "launcher"           # a node-side launcher that starts and stops ranks on its host
    CONTROLLER = "controller"


#: Addresses a peer on another host can never reach: refused as an advertised address.
UNROUTABLE = frozenset({"", "0.0.0.0", "::", "[::]", "*"})


@dataclass(frozen=True)
class Registration:
    """One running service, where peers on other hosts reach it, and when it last said so.

    ``addr`` is the address a peer routes to (never a wildcard); ``instance`` is a uuid drawn
    when the process started and ``boot_id`` the host's boot id: together they tell a restarted
    service from the old one without a PID (which means nothing in another PID namespace).
    ``heartbeat_ts`` is refreshed every ``ttl_s / 3`` s by the writer; a reader treats the entry as
    stale once ``heartbeat_ts + ttl_s`` is past (clocks of the hosts are assumed NTP-synced).
    ``cluster`` scopes entries: services of one cluster only see each other, so several clusters
    (or test runs) can share one broker.
    """

    kind: ServiceKind
    node: str
    host: str
    addr: str
    port: int
    instance: str
    started_ts: float
    heartbeat_ts: float
    ttl_s: float = 10.0
    boot_id: str = ""
    cluster: str = "default"
    meta: Mapping[str, Any] = field(default_factory=dict)
    v: int = SCHEMA_VERSION

    @property
    def key(self) -> str:
        """The compaction key: one live entry per cluster, kind and node."""
        return registry_key(self.cluster, self.kind, self.node)

    @property
    def endpoint(self) -> str:
        """``addr:port`` (``[addr]:port`` for IPv6), what a client connects to."""
        return f"[{self.addr}]:{self.port}" if ":" in self.addr else f"{self.addr}:{self.port}"

    def stale(self, now: float | None = None, ttl: float | None = None) -> bool:
        """Whether the last heartbeat is older than ``ttl`` (default: the entry's own ``ttl_s``)."""
        return (time.time() if now is None else now) > self.heartbeat_ts + (self.ttl_s if ttl is None else ttl)

    def __post_init__(self) -> None:
        what = "registration"
        for name in ("node", "host", "instance", "cluster"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ContractError(f"{what}: field '{name}' must be a non-empty string")
        if not isinstance(self.kind, ServiceKind):
            object.__setattr__(self, "kind", _enum(ServiceKind, {"kind": self.kind}, "kind", what=what))
        if not isinstance(self.addr, str) or self.addr.strip("[]") in UNROUTABLE:
            raise ContractError(f"{what}: field 'addr' is {self.addr!r}, not an address a peer can route to "
                                f"(advertise the host's own address: --advertise / TRANSOM_ADVERTISE_ADDR)")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ContractError(f"{what}: field 'port' must be an integer in 1..65535, got {self.port!r}")
        if not isinstance(self.ttl_s, _NUM) or not self.ttl_s > 0:
            raise ContractError(f"{what}: field 'ttl_s' must be a positive number of seconds, got {self.ttl_s!r}")
        for name in ("started_ts", "heartbeat_ts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, _NUM) or not math.isfinite(value) or value <= 0:
                raise ContractError(f"{what}: field '{name}' must be a positive epoch time, got {value!r}")
        if "/" in self.cluster or "/" in self.node:
            raise ContractError(f"{what}: fields 'cluster' and 'node' may not contain '/' (it separates the key)")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Registration":
        what = "registration"
        _check_version(d, what)
        return cls(
            kind=_enum(ServiceKind, d, "kind", what=what), node=_get(d, "node", str, what=what),
            host=_get(d, "host", str, what=what), addr=_get(d, "addr", str, what=what),
            port=_get(d, "port", int, what=what), instance=_get(d, "instance", str, what=what),
            started_ts=float(_get(d, "started_ts", _NUM, what=what)),
            heartbeat_ts=float(_get(d, "heartbeat_ts", _NUM, what=what)),
            ttl_s=float(_get(d, "ttl_s", _NUM, what=what, optional=True, default=10.0)),
            boot_id=_get(d, "boot_id", str, what=what, optional=True, default=""),
            cluster=_get(d, "cluster", str, what=what, optional=True, default="default"),
            meta=dict(_get(d, "meta", Mapping, what=what, optional=True, default={})),
        )


def registry_key(cluster: str, kind: ServiceKind | str, node: str) -> str:
    """The key of a registration on ``transom.registry``: ``CLUSTER/KIND/NODE``."""
    return f"{cluster}/{ServiceKind(kind).value}/{node}"


# --------------------------------------------------------------------------- dead letters

@dataclass(frozen=True)
class DeadLetter:
    """A rejected message, kept whole (base64 when it is not UTF-8), and why it was rejected."""

    topic: str
    reason: str
    value: str
    encoding: str               # "utf-8" or "base64"
    component: str
    ts: float
    partition: int | None = None
    offset: int | None = None
    v: int = SCHEMA_VERSION

    @classmethod
    def of(cls, raw: bytes | None, *, topic: str, reason: str, component: str,
           partition: int | None = None, offset: int | None = None) -> "DeadLetter":
        raw = raw or b""
        try:
            value, enc = raw.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            value, enc = base64.b64encode(raw).decode(), "base64"
        return cls(topic=topic, reason=reason, value=value, encoding=enc, component=component,
                   ts=time.time(), partition=partition, offset=offset)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DeadLetter":
        what = "dead letter"
        _check_version(d, what)
        return cls(topic=_get(d, "topic", str, what=what), reason=_get(d, "reason", str, what=what),
                   value=_get(d, "value", str, what=what), encoding=_get(d, "encoding", str, what=what),
                   component=_get(d, "component", str, what=what),
                   ts=float(_get(d, "ts", _NUM, what=what)),
                   partition=_get(d, "partition", int, what=what, optional=True),
                   offset=_get(d, "offset", int, what=what, optional=True))


# --------------------------------------------------------------------------- TEE internal

@dataclass(frozen=True)
class PeerWindow:
    """One node's closed soft-detection window, summarised by the TEE worker that reads the node's
    metrics and sent, keyed by job, to the worker that judges the job's peers.

    ``gpu``: GPU index -> DCGM field -> the window's median; ``reasons``: GPU index -> OR of its clock
    event reasons; ``nic_err``: mean error rate over the node's up ports (None: no port sample);
    ``nic_bw``: port device -> median receive rate; ``closed_ts``: the node worker's clock when the
    window closed; ``hard_ts``: trigger time of the node's last hard fault, if any (it explains soft
    symptoms that begin while it goes on); ``steps``: the lowest and highest training step the window
    saw, counting the step the node stood at as it opened (empty: no training reports; equal: the job
    did not move, the window is judged on ``nic_err`` alone);
    ``outside``: the node's batches carried no job, after it trained in ``job`` (its ranks are gone: a
    relaunch's gap, a node replaced and cordoned): the window counts as closed for the job's windows
    and is neither judged nor learned from."""

    node: str
    job: str
    index: int
    first_ts: float
    last_ts: float
    closed_ts: float
    gpu: Mapping[str, Mapping[str, float]]
    reasons: Mapping[str, int] = field(default_factory=dict)
    nic_err: float | None = None
    nic_bw: Mapping[str, float] = field(default_factory=dict)
    hard_ts: float | None = None
    steps: tuple[float, ...] = ()
    outside: bool = False
    v: int = SCHEMA_VERSION

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PeerWindow":
        what = "peer window"
        _check_version(d, what)
        gpu = _get(d, "gpu", Mapping, what=what)
        for gi, fields in gpu.items():
            if not isinstance(fields, Mapping) or not all(isinstance(v, _NUM) and not isinstance(v, bool)
                                                          for v in fields.values()):
                raise ContractError(f"{what}: gpu[{gi!r}] must map field names to numbers")
        steps = _get(d, "steps", list, what=what, optional=True, default=[])
        if not all(isinstance(v, _NUM) and not isinstance(v, bool) for v in steps):
            raise ContractError(f"{what}: steps must be a list of numbers")
        return cls(node=_get(d, "node", str, what=what), job=_get(d, "job", str, what=what),
                   index=_get(d, "index", int, what=what),
                   first_ts=float(_get(d, "first_ts", _NUM, what=what)),
                   last_ts=float(_get(d, "last_ts", _NUM, what=what)),
                   closed_ts=float(_get(d, "closed_ts", _NUM, what=what)),
                   gpu={str(k): dict(v) for k, v in gpu.items()},
                   reasons={str(k): int(v) for k, v in _get(d, "reasons", Mapping, what=what, optional=True,
                                                            default={}).items()},
                   nic_err=_get(d, "nic_err", _NUM, what=what, optional=True),
                   nic_bw={str(k): float(v) for k, v in _get(d, "nic_bw", Mapping, what=what, optional=True,
                                                              default={}).items()},
                   hard_ts=_get(d, "hard_ts", _NUM, what=what, optional=True),
                   steps=tuple(float(v) for v in steps),
                   outside=_get(d, "outside", bool, what=what, optional=True, default=False))


@dataclass(frozen=True)
class RankReport:
    """One node batch as the job's hang judgement needs it: the node, the batch time, the mean
    utilisation of its GPUs (None: no GPU sample) and its training samples of the job (step, step time,
    alive, heartbeat age, stopped; tags generation, phase, stack, state, pid). No samples: the node's
    GPUs only (a node of the job that reported no training progress this time). ``gpus``: how many of its
    GPUs reported utilisation, how many of those idle and how many spin (the hang thresholds of the node's
    worker), so the job's worker can tell one idle GPU among spinning ones; None: not counted. Neither
    samples nor utilisation: a read mark, the node's worker saying it read the node's partition up to
    ``ts`` (on the node's own clock) without a newer batch of it. ``gpu_power``: the mean power draw of
    its GPUs in watts (None: no power sample): ranks that wait in a collective spin their GPUs at a
    fraction of the power they draw stepping. ``silent_s`` (a read mark only): nothing of the node has come
    to its worker for that many seconds, its heartbeat timeout or more, and the node's ranks were in the
    job: its worker leaves to the job's worker whether the node is lost (its job stopped with it) or only its
    agent is silent (its job steps on without a pause, which it cannot without the node's ranks)."""

    node: str
    ts: float
    gpu_util: float | None = None
    samples: tuple[Sample, ...] = ()
    gpus: tuple[int, int, int] | None = None
    gpu_power: float | None = None
    silent_s: float | None = None

    @classmethod
    def from_dict(cls, d: Any, what: str = "rank report") -> "RankReport":
        if type(d) is not dict:
            raise ContractError(f"{what}: must be an object")
        node, ts, util, samples = d.get("node"), d.get("ts"), d.get("gpu_util"), d.get("samples")
        gpus = d.get("gpus")
        if type(node) is not str or type(ts) is not float or not 0 < ts < math.inf or type(samples) is not list \
                or not (util is None or type(util) is float and math.isfinite(util)):   # the slow path says why
            node = _get(d, "node", str, what=what)
            ts = _get(d, "ts", _NUM, what=what)
            if not math.isfinite(ts) or ts <= 0:
                raise ContractError(f"{what}: field 'ts' must be a positive epoch time, got {ts}")
            util = _get(d, "gpu_util", _NUM, what=what, optional=True)
            samples = _get(d, "samples", list, what=what, optional=True, default=[])
        if gpus is not None:
            if type(gpus) is not list or len(gpus) != 3 or type(gpus[0]) is not int or type(gpus[1]) is not int \
                    or type(gpus[2]) is not int or gpus[1] < 0 or gpus[2] < 0 or gpus[1] + gpus[2] > gpus[0]:
                raise ContractError(f"{what}: field 'gpus' must be [count, idle, spinning] (counts, idle + "
                                    f"spinning at most count), got {gpus!r}")
            gpus = tuple(gpus)
        power = d.get("gpu_power")
        if power is not None and (type(power) not in _NUM or not 0 <= power < math.inf):
            raise ContractError(f"{what}: field 'gpu_power' must be a finite number of watts >= 0, got {power!r}")
        silent = d.get("silent_s")
        if silent is not None and (type(silent) not in _NUM or not 0 <= silent < math.inf or samples
                                   or util is not None):
            raise ContractError(f"{what}: field 'silent_s' must be a finite number of seconds >= 0 on a read mark "
                                f"(no samples, no gpu_util), got {silent!r}")
        obj = object.__new__(cls)       # validated: no frozen __init__ (thousands a second)
        obj.__dict__.update(node=node, ts=float(ts), gpu_util=None if util is None else float(util), gpus=gpus,
                            gpu_power=None if power is None else float(power),
                            silent_s=None if silent is None else float(silent),
                            samples=tuple(Sample.from_dict(s, _SampleWhere(what, i), owned=True)
                                          for i, s in enumerate(samples)))
        return obj


def _window_plain(w: PeerWindow) -> dict[str, Any]:
    d = {f.name: getattr(w, f.name) for f in _WINDOW_FIELDS}
    for k in ("gpu", "reasons", "nic_bw"):       # orjson writes dicts (of dicts) of numbers itself
        if type(d[k]) is not dict or (k == "gpu" and any(type(v) is not dict for v in d[k].values())):
            d[k] = _plain(d[k])
    return d


_WINDOW_FIELDS = dataclasses.fields(PeerWindow)


@dataclass(frozen=True)
class JobFeed:
    """What the TEE workers that read a job's nodes send the worker that judges the job (keyed by
    job on ``transom.peer-windows``): the nodes' closed soft-detection windows and their rank
    progress, each in its node's order, gathered over a fraction of a second (one message per job
    instead of one per node window and batch)."""

    job: str
    windows: tuple[PeerWindow, ...] = ()
    ranks: tuple[RankReport, ...] = ()
    v: int = SCHEMA_VERSION

    def plain(self) -> dict[str, Any]:
        """The JSON object of this feed, built directly (the generic walk costs more than the rules)."""
        return {"job": self.job, "windows": [_window_plain(w) for w in self.windows],
                "ranks": [{"node": r.node, "ts": r.ts, "gpu_util": r.gpu_util, "gpus": r.gpus,
                           "gpu_power": r.gpu_power,
                           "samples": [{"source": s.source.value, "index": s.index, "ts": s.ts,
                                        "fields": s.fields if type(s.fields) is dict else dict(s.fields),
                                        "tags": s.tags if type(s.tags) is dict else dict(s.tags)}
                                       for s in r.samples],
                           **({} if r.silent_s is None else {"silent_s": r.silent_s})} for r in self.ranks],
                "v": self.v}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JobFeed":
        what = "job feed"
        _check_version(d, what)
        windows = _get(d, "windows", list, what=what)
        ranks = _get(d, "ranks", list, what=what)
        for i, w in enumerate(windows):
            if type(w) is not dict:
                raise ContractError(f"{what}: window {i} must be an object")
        return cls(job=_get(d, "job", str, what=what),
                   windows=tuple(PeerWindow.from_dict(w) for w in windows),
                   ranks=tuple(RankReport.from_dict(r, f"{what} rank report {i}") for i, r in enumerate(ranks)))


# --------------------------------------------------------------------------- codec

_BY_TOPIC: dict[str, type] = {
    METRICS: MetricBatch, FAULTS: FaultEvent, CHECKPOINTS: CheckpointReady,
    LIFECYCLE: LifecycleEvent, HISTORY: LifecycleEvent, DEADLETTER: DeadLetter, REGISTRY: Registration,
    PEER_WINDOWS: JobFeed,
}


def encode(event: Any) -> bytes:
    """Serialise an event to its JSON bytes (NaN and Inf are refused: JSON has none)."""
    if type(event) is JobFeed:      # the TEE's internal feed, thousands of values a second, all of them
        return orjson.dumps(event.plain())   # from validated (finite) input: the fast encoder is safe
    return json.dumps(_plain(event), separators=(",", ":"), allow_nan=False).encode()


def _reject_constant(name: str) -> Any:
    raise ContractError(f"value contains {name}, which is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):      # 1e999 parses as infinity; orjson refuses it, json does not
        raise ContractError(f"value contains the number {text}, which is out of range (infinite)")
    return value


def decode(topic: str, raw: bytes | str | None) -> Any:
    """Parse and validate a value read from ``topic``; raise :class:`ContractError` with the reason."""
    cls = _BY_TOPIC.get(topic)
    if cls is None:
        raise ContractError(f"unknown topic '{topic}'")
    if raw is None or raw == b"" or raw == "":
        raise ContractError("empty value")
    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError:
        d = None          # the standard parser below says precisely why (or takes what orjson refuses)
    try:
        if d is None:
            d = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except ContractError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ContractError(f"value is not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ContractError(f"value must be a JSON object, got {type(d).__name__}")
    if cls is MetricBatch:
        return cls.from_dict(d, owned=True, no_bools=type(raw) is bytes and b"true" not in raw and b"false" not in raw)
    return cls.from_dict(d)
