"""The agent's configuration: one TOML file, then environment variables, then command-line flags.

Layout of the file (every key optional)::

    [agent]
    node = "gpu-node-17"            # default: TRANSOM_NODE, else the host name
    interval = 1.0
    collectors = ["host", "gpu", "nic", "train", "agent"]
    state_dir = "/var/lib/transom-agent"   # spool and sequence numbers survive restarts here
    [agent.tags]
    rack = "r12"

    [collectors.nic]
    interval = 5
    exclude = ["lo", "docker0"]

Environment: ``TRANSOM_AGENT__<KEY>`` sets ``[agent] <key>`` and
``TRANSOM_AGENT__<COLLECTOR>__<KEY>`` sets ``[collectors.<collector>] <key>`` (lists are
comma-separated, tables ``k=v,k=v``); the environment wins over the file, a flag given on the
command line wins over both. ``TRANSOM_NODE`` and ``TRANSOM_BOOTSTRAP`` keep their meaning.

An unknown section, key or collector name raises :class:`ConfigError` that names it and lists
the valid ones; a value of the wrong type names the key and the type expected.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from transom.config import ConfigError, parse_bool

from .collectors import COMMON_KEYS, collector_names, registration

__all__ = ["AgentSettings", "AgentConfig", "load_config", "validate", "describe", "coerce", "settings_from", "ENV_PREFIX",
           "GPU_SOURCES", "NIC_SOURCES", "DEFAULT_COLLECTORS"]

ENV_PREFIX = "TRANSOM_AGENT__"
GPU_SOURCES = ("nvml", "simulated", "none")
NIC_SOURCES = ("sysfs", "simulated")
DEFAULT_COLLECTORS = ("host", "gpu", "nic", "train", "agent")


@dataclass
class AgentSettings:
    """``[agent]``"""

    #: this node's id, the key of its batches (default: TRANSOM_NODE, else the host name)
    node: str = ""
    #: Kafka bootstrap servers (default: TRANSOM_BOOTSTRAP; the CLI starts an embedded broker when unset)
    bootstrap: str = ""
    #: seconds between batches
    interval: float = 1.0
    #: collectors to run, in batch order
    collectors: list[str] = field(default_factory=lambda: list(DEFAULT_COLLECTORS))
    #: tags added to every sample
    tags: dict[str, str] = field(default_factory=dict)
    #: nvml (the driver), simulated (fake GPUs for demos/tests), none
    gpu_source: str = "nvml"
    #: simulated GPUs per node
    gpus: int = 2
    #: seed of the simulated values (0: random)
    seed: int = 0
    #: fault scenario file (TOML) played by the simulated source; empty: none
    scenario: str = ""
    #: address of the training intake (UDP); port 0 picks a free one
    intake_host: str = "127.0.0.1"
    intake_port: int = 0
    #: spool and sequence state; empty: a private temp directory (sequence restarts at 0)
    state_dir: str = ""
    #: bound of the on-disk spool in MiB; beyond it the oldest metric batches are dropped
    spool_max_mb: float = 256.0
    #: seconds librdkafka tries to deliver a batch before the agent spools it
    delivery_timeout_s: float = 10.0
    #: seconds between reconnection attempts while the broker is unreachable
    retry_s: float = 2.0
    #: producer linger in ms (batches of one node are small; a little linger costs nothing)
    linger_ms: int = 20
    #: batches in librdkafka's queue beyond which new ones go to the spool
    max_in_flight: int = 1000


@dataclass
class AgentConfig:
    agent: AgentSettings = field(default_factory=AgentSettings)
    collectors: dict[str, Any] = field(default_factory=dict)   # name -> Settings instance
    common: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {interval, tags}

    def settings(self, name: str) -> Any:
        if name not in self.collectors:
            reg = registration(name)
            self.collectors[name] = reg.settings() if reg.settings else None
        return self.collectors[name]


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def coerce(value: Any, kind: Any, key: str) -> Any:
    """``value`` (from TOML or an environment string) as ``kind``; :class:`ConfigError` naming ``key``."""
    origin = typing.get_origin(kind)
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
        return list(value)
    if origin is dict:
        if isinstance(value, str):
            pairs = [p for p in value.split(",") if p.strip()]
            if not all("=" in p for p in pairs):
                raise ConfigError(f"{key}: expected k=v,k=v, got {value!r}")
            value = dict(p.split("=", 1) for p in pairs)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a table of strings, got {value!r}")
        return {str(k).strip(): str(v).strip() for k, v in value.items()}
    if kind is bool:
        if isinstance(value, str) and parse_bool(value) is not None:
            return parse_bool(value)
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if kind in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            out = kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected {'an integer' if kind is int else 'a number'}, got {value!r}") from None
        if kind is int and isinstance(value, float) and value != out:
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return out
    if kind is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


def settings_from(cls: type, values: Mapping[str, Any], where: str, base: Any = None) -> Any:
    """An instance of dataclass ``cls`` from ``values`` over ``base``; unknown keys raise."""
    hints = _hints(cls)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}'; valid keys: {', '.join(sorted(hints))}")
    obj = base if base is not None else cls()
    for k, v in values.items():
        setattr(obj, k, coerce(v, hints[k], f"{where}.{k}"))
    return obj


def _read_toml(path: str) -> dict[str, Any]:
    import tomllib

    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"agent config: file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"agent config: {path} is not valid TOML: {exc}") from None


def _env_layer(env: Mapping[str, str]) -> dict[str, Any]:
    layer: dict[str, Any] = {"agent": {}, "collectors": {}}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX):].lower().split("__")
        if len(parts) == 1 and parts[0]:
            layer["agent"][parts[0]] = value
        elif len(parts) == 2 and all(parts):
            layer["collectors"].setdefault(parts[0], {})[parts[1]] = value
        else:
            raise ConfigError(f"environment {name}: expected {ENV_PREFIX}<KEY> or {ENV_PREFIX}<COLLECTOR>__<KEY>")
    return layer


def _apply(cfg: AgentConfig, layer: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(layer) - {"agent", "collectors"})
    if unknown:
        raise ConfigError(f"{where}: unknown section '{unknown[0]}'; valid sections: agent, collectors")
    agent = layer.get("agent") or {}
    if not isinstance(agent, Mapping):
        raise ConfigError(f"{where}: [agent] must be a table")
    settings_from(AgentSettings, agent, f"{where} [agent]", cfg.agent)
    sections = layer.get("collectors") or {}
    if not isinstance(sections, Mapping):
        raise ConfigError(f"{where}: [collectors] must be a table of [collectors.<name>] sections")
    for name, values in sections.items():
        if name not in collector_names():
            raise ConfigError(f"{where}: unknown collector '{name}'; valid: {', '.join(collector_names())}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{where}: [collectors.{name}] must be a table")
        reg = registration(name)
        own = {k: v for k, v in values.items() if k not in COMMON_KEYS}
        common = cfg.common.setdefault(name, {})
        hints = {"interval": float, "tags": dict[str, str]}
        for k in COMMON_KEYS:
            if k in values:
                common[k] = coerce(values[k], hints[k], f"{where} collectors.{name}.{k}")
        if reg.settings is None:
            if own:
                raise ConfigError(f"{where}: unknown key '{sorted(own)[0]}' in [collectors.{name}]; "
                                  f"valid keys: {', '.join(sorted(COMMON_KEYS))}")
            continue
        try:
            settings_from(reg.settings, own, f"{where} [collectors.{name}]", cfg.settings(name))
        except ConfigError as exc:
            if "unknown key" in str(exc):
                raise ConfigError(f"{exc}, {', '.join(sorted(COMMON_KEYS))}") from None
            raise


def validate(cfg: AgentConfig) -> None:
    a = cfg.agent
    if not a.node:
        raise ConfigError("agent: the node id is empty (set [agent] node, --node or TRANSOM_NODE)")
    if not a.interval > 0:
        raise ConfigError(f"agent.interval: must be positive, got {a.interval}")
    if a.gpu_source not in GPU_SOURCES:
        raise ConfigError(f"agent.gpu_source: {a.gpu_source!r} is unknown; expected one of: {', '.join(GPU_SOURCES)}")
    if a.gpu_source == "simulated" and a.gpus < 1:
        raise ConfigError(f"agent.gpus: must be at least 1 for the simulated source, got {a.gpus}")
    if a.scenario and a.gpu_source != "simulated":
        raise ConfigError("agent.scenario: a fault scenario is played only by gpu_source = \"simulated\"")
    if not 0 <= a.intake_port < 65536:
        raise ConfigError(f"agent.intake_port: must be 0..65535, got {a.intake_port}")
    for key in ("spool_max_mb", "delivery_timeout_s", "retry_s"):
        if not getattr(a, key) > 0:
            raise ConfigError(f"agent.{key}: must be positive, got {getattr(a, key)}")
    if a.max_in_flight < 1:
        raise ConfigError(f"agent.max_in_flight: must be at least 1, got {a.max_in_flight}")
    for name in a.collectors:
        registration(name)  # raises naming the unknown one and the valid ones
    if len(set(a.collectors)) != len(a.collectors):
        raise ConfigError(f"agent.collectors: a collector is listed twice: {a.collectors}")
    for name, common in cfg.common.items():
        if "interval" in common and not common["interval"] > 0:
            raise ConfigError(f"collectors.{name}.interval: must be positive, got {common['interval']}")


def load_config(path: str | None = None, *, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> AgentConfig:
    """Defaults, then the TOML file at ``path``, then ``env``, then ``overrides`` (``[agent]`` keys)."""
    from . import agent  # noqa: F401  (registers the built-in collectors)

    env = os.environ if env is None else env
    cfg = AgentConfig()
    cfg.agent.node = env.get("TRANSOM_NODE") or socket.gethostname()
    cfg.agent.bootstrap = env.get("TRANSOM_BOOTSTRAP") or ""
    if path:
        _apply(cfg, _read_toml(path), f"agent config {path}")
    _apply(cfg, _env_layer(env), "environment")
    if overrides:
        settings_from(AgentSettings, {k: v for k, v in overrides.items() if v is not None}, "command line", cfg.agent)
    validate(cfg)
    return cfg


def describe(cls: type | None) -> list[tuple[str, str, Any]]:
    """``(key, type, default)`` of every field of a settings dataclass (for --list-collectors)."""
    if cls is None:
        return []
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out.append((f.name, getattr(hints[f.name], "__name__", str(hints[f.name])), default))
    return out
