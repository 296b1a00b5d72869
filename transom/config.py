"""Settings shared by every command, from the environment and the command line.

Every setting has one environment variable (``TRANSOM_*``); a command-line flag wins over it.
A bad value raises :class:`ConfigError` naming the key and what was expected.
"""

from __future__ import annotations

import os

from typing import Mapping

__all__ = ["ConfigError", "ENV", "env_str", "env_float", "env_int", "env_bool", "parse_bool", "kafka_security"]


class ConfigError(ValueError):
    """A configuration value is missing or malformed; the message names the key."""


#: Environment variables the code reads, with what each means (the deploy tests check these).
ENV: Mapping[str, str] = {
    "TRANSOM_BOOTSTRAP": "Kafka bootstrap servers, host:port[,host:port]; required (services: or --embedded-broker)",
    "TRANSOM_LOG_LEVEL": "log level of every service (DEBUG, INFO, WARNING)",
    "TRANSOM_TOPIC_PARTITIONS": "partition counts of Transom's topics, TOPIC=N[,TOPIC=N] (transom/topics.py)",
    "TRANSOM_REPLICATION_FACTOR": "replicas of every topic partition, or auto (3 with 3+ brokers, else the broker count)",
    "TRANSOM_MIN_INSYNC_REPLICAS": "in-sync replicas an acks=all write needs, or auto (2 with 3+ replicas, else 1)",
    "TRANSOM_NODE": "this node's id (agent; set by the launcher for training ranks)",
    "TRANSOM_JOB": "job id (set by the launcher for training ranks)",
    "TRANSOM_AGENT_ADDR": "host:port of the local agent's training intake (UDP)",
    "TRANSOM_CKPT_DIR": "directory where checkpoints are persisted",
    "TRANSOM_RESUME_STEP": "step the relaunched ranks resume from (set by the controller)",
    "TRANSOM_GENERATION": "launch generation of the job (set by the controller)",
    "TRANSOM_AGENTS": "node=host:port table of agent intakes (set by the Slurm backend for its ranks)",
    "TRANSOM_TEST_CRASH_AT": "test hook, off by default: the controller exits at this recovery step",
    "TRANSOM_FAULT_TRACE": "benchmarks only: the real fault trace the corpus generator takes its fault mix from",
    "TRANSOM_CKPT_RUNTIME": "checkpoint daemons' registry and shared-memory segments (default /dev/shm/transom-ckpt-<uid>-<hash of TRANSOM_BOOTSTRAP>: one per stack)",
    "TRANSOM_CKPT_LOCAL_DIR": "a checkpoint daemon's local-disk directory (default /tmp/transom-ckpt-local-<uid>-<hash of TRANSOM_BOOTSTRAP>)",
    "TRANSOM_CKPT_SNAPSHOT": "how save() snapshots a rank's tensors: copy (default; blocks for a memcpy) or fork "
                             "(copy-on-write child; blocks for the fork, later writes pay page faults)",
    "TRANSOM_SERVICE_PRIORITY": "CPU priority of the services (broker, agent, TEE, sink, checkpoint daemon, controller "
                                "off the local backend): batch:N (default batch:10: SCHED_BATCH, nice N), nice:N, "
                                "idle or normal (transom/priority.py)",
    "TRANSOM_CKPT_TRANSPORT": "replication transport of the checkpoint daemons: auto (default), mooncake or tcp",
    "TRANSOM_CLUSTER": "name of this cluster in the service registry (default 'default'); services see only their own",
    "TRANSOM_REGISTRY_TTL": "seconds a service registry entry stays live without a heartbeat (default 10)",
    "TRANSOM_ADVERTISE_ADDR": "address this host's services advertise to peers (default: the interface that routes "
                              "to the broker; never 0.0.0.0)",
    "TRANSOM_CKPT_SHM_BYTES": "shared-memory budget of a node's checkpoint daemon, in bytes",
    "TRANSOM_AGENT_CONFIG": "the agent's TOML configuration file",
    "TRANSOM_AGENT__<KEY>": "sets key <KEY> of the agent's [agent] table (environment wins over the file)",
    "TRANSOM_AGENT__<COLLECTOR>__<KEY>": "sets key <KEY> of the agent's [collectors.<COLLECTOR>] table",
    "TRANSOM_INFLUX_URL": "InfluxDB URL the sink writes to, e.g. http://influxdb:8086",
    "TRANSOM_INFLUX_DB": "database (1.x) or bucket (2.x/3.x) the sink writes to (default transom)",
    "TRANSOM_INFLUX_ORG": "organisation (2.x/3.x; '-' for 1.8's compatibility API)",
    "TRANSOM_INFLUX_TOKEN": "API token (2.x/3.x); for 1.x use TRANSOM_INFLUX_USER/PASSWORD",
    "TRANSOM_INFLUX_USER": "user name (1.x with authentication)",
    "TRANSOM_INFLUX_PASSWORD": "password (1.x with authentication)",
    "TRANSOM_INFLUX_API": "the sink's write path: auto (default: from the server's version), v1 or v2",
    "TRANSOM_SINK_BATCH": "most events per InfluxDB write of the sink (default 1000)",
    "TRANSOM_SINK_FLUSH_S": "longest wait before the sink writes a partial batch, seconds (default 1)",
    "TRANSOM_KAFKA_SECURITY_PROTOCOL": "every Kafka client: PLAINTEXT (default), SSL, SASL_PLAINTEXT or SASL_SSL",
    "TRANSOM_KAFKA_SASL_MECHANISM": "SASL mechanism: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (SASL_* protocols)",
    "TRANSOM_KAFKA_SASL_USERNAME": "SASL user name (SASL_* protocols)",
    "TRANSOM_KAFKA_SASL_PASSWORD": "SASL password (SASL_* protocols); prefer TRANSOM_KAFKA_SASL_PASSWORD_FILE",
    "TRANSOM_KAFKA_SASL_PASSWORD_FILE": "file whose first line is the SASL password (instead of the variable)",
    "TRANSOM_KAFKA_SSL_CAFILE": "PEM CA bundle that signed the brokers' certificates (SSL, SASL_SSL; default: system CAs)",
    "TRANSOM_KAFKA_SSL_CERTFILE": "PEM client certificate, for brokers that require one (with TRANSOM_KAFKA_SSL_KEYFILE)",
    "TRANSOM_KAFKA_SSL_KEYFILE": "PEM private key of the client certificate (unencrypted)",
    "TRANSOM_KAFKA_SSL_CHECK_HOSTNAME": "true (default) or false: the broker certificate must name the host",
    "TRANSOM_FAULT_PRINCIPALS": "controller: NAME=KEY[,NAME=KEY] producers allowed to send fault events; "
                                "set: fault authentication ON (unsigned faults are rejected); unset: OFF",
    "TRANSOM_FAULT_PRINCIPALS_FILE": "controller: file of NAME=KEY lines (instead of TRANSOM_FAULT_PRINCIPALS)",
    "TRANSOM_FAULT_PRINCIPAL": "producer of fault events (TEE): the principal name it signs as",
    "TRANSOM_SIGNING_KEY": "producer of fault events (TEE): its HMAC-SHA256 key (at least 16 characters)",
    "TRANSOM_SIGNING_KEY_FILE": "file whose first line is the signing key (instead of TRANSOM_SIGNING_KEY)",
    "TRANSOM_CLUSTER_KEY": "controller and node launchers: HMAC key of their channel (at least 16 characters; "
                           "unset: TRANSOM_SIGNING_KEY is used; a launcher refuses to start without either)",
    "TRANSOM_CLUSTER_KEY_FILE": "file whose first line is the cluster key (instead of TRANSOM_CLUSTER_KEY)",
    "TRANSOM_RUN_DIR": "controller and launcher: directory for rank logs and launch records (default: runs)",
    "TRANSOM_CKPT_STOP_S": "rank: seconds a SIGTERM waits for the in-flight checkpoint save (default 8)",
    "TRANSOM_CKPT_PIN": "rank: 1 (default) page-locks the checkpoint segment before CUDA tensors are copied into "
                        "it; 0 copies them into pageable memory",
    "TRANSOM_CKPT_SECRET": "checkpoint daemons and ranks: shared secret (at least 16 characters); set: every "
                           "connection to a TCE daemon is authenticated (HMAC challenge); unset: OFF",
    "TRANSOM_CKPT_SECRET_FILE": "file whose first line is the checkpoint secret (instead of TRANSOM_CKPT_SECRET)",
}


def env_str(key: str, default: str | None = None) -> str | None:
    value = os.environ.get(key)
    return default if value in (None, "") else value


def env_float(key: str, default: float) -> float:
    raw = env_str(key)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r}: expected a number") from None


def parse_bool(raw: str) -> bool | None:
    """``1/true/yes/on`` -> True, ``0/false/no/off`` -> False (any case); anything else -> None."""
    return {"1": True, "true": True, "yes": True, "on": True,
            "0": False, "false": False, "no": False, "off": False}.get(raw.lower())


def env_bool(key: str, default: bool) -> bool:
    raw = env_str(key)
    if raw is None:
        return default
    value = parse_bool(raw)
    if value is None:
        raise ConfigError(f"{key}={raw!r}: expected 1 or 0 (true/false, yes/no, on/off)")
    return value


def env_int(key: str, default: int) -> int:
    raw = env_str(key)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r}: expected an integer") from None


def kafka_security() -> dict[str, str]:
    """librdkafka security settings from the environment, for every Kafka client (see :mod:`transom.security`)."""
    from .security import KafkaSecurity

    return KafkaSecurity.from_env().librdkafka()
