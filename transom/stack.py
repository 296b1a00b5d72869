"""Start the whole Transom loop on one machine: broker, agents, TEE, controller, as real processes.

Used by ``transom demo``, the end-to-end tests and the benchmarks. Every process gets its own
log file under ``run_dir/logs``; :meth:`LocalStack.stop` ends everything it started (SIGTERM,
then SIGKILL after a grace period), in reverse order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, TopicPartition

from . import contracts
from .broker import EmbeddedBroker, free_port
from .kafka import client_config
from .log import get

__all__ = ["LocalStack", "Monitor", "train_command"]

log = get("stack")


def train_command(steps: int, ckpt_every: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "transom.examples.train_lm", "--steps", str(steps),
            "--ckpt-every", str(ckpt_every), *extra]


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    logfile: Path


@dataclass
class LocalStack:
    run_dir: Path
    bootstrap: str | None = None
    nodes: int = 5
    gpus_per_node: int = 2
    interval: float = 1.0
    procs: list[_Proc] = field(default_factory=list)
    agents: dict[str, str] = field(default_factory=dict)
    broker: EmbeddedBroker | None = None

    ckpt_runtime: Path | None = None

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        if self.ckpt_runtime is None:
            # the TCE daemons' shared memory and registry; every process started here gets it
            import hashlib
            base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
            tag = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:10]
            self.ckpt_runtime = base / f"transom-ckpt-{tag}"

    # ------------------------------------------------------------------ parts
    def start_broker(self) -> str:
        if self.bootstrap is None:
            self.broker = EmbeddedBroker(log_path=str(self.run_dir / "logs" / "broker.log")).start()
            self.bootstrap = self.broker.bootstrap
        return self.bootstrap

    def _spawn(self, name: str, args: Sequence[str], env: dict[str, str] | None = None) -> _Proc:
        logfile = self.run_dir / "logs" / f"{name}.log"
        full_env = {**os.environ, "TRANSOM_BOOTSTRAP": self.bootstrap or "", "PYTHONUNBUFFERED": "1",
                    "TRANSOM_CKPT_RUNTIME": str(self.ckpt_runtime),
                    # this stack's services see only each other in the service registry, even on a
                    # broker that other stacks (tests, benches) share
                    "TRANSOM_CLUSTER": os.environ.get("TRANSOM_CLUSTER") or f"stack-{self.ckpt_runtime.name}",
                    "TRANSOM_CKPT_LOCAL_DIR": str(self.run_dir / "ckpt-local"), **(env or {})}
        popen = subprocess.Popen([sys.executable, "-m", "transom.cli", *args], env=full_env,
                                 stdout=open(logfile, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        proc = _Proc(name, popen, logfile)
        self.procs.append(proc)
        return proc

    def start_agents(self) -> dict[str, str]:
        for i in range(self.nodes):
            node, port = f"node{i}", free_port()
            self._spawn(f"agent-{node}", ["agent", "--node", node, "--gpu-source", "simulated",
                                          "--gpus", str(self.gpus_per_node), "--intake-port", str(port),
                                          "--interval", str(self.interval), "--bootstrap", self.bootstrap])
            self.agents[node] = f"127.0.0.1:{port}"
            self._spawn(f"ckpt-{node}", ["ckpt-server", "--node", node])    # the node's TCE daemon
        return self.agents

    def start_tee(self, *extra: str, name: str = "tee") -> _Proc:
        return self._spawn(name, ["tee", "--bootstrap", self.bootstrap, *extra])

    def start_controller(self, job_id: str | None = None, command: Sequence[str] = (), *, world_size: int = 4,
                         extra: Sequence[str] = (), name: str = "controller") -> _Proc:
        args = ["controller", "--bootstrap", self.bootstrap, "--run-dir", str(self.run_dir / "jobs")]
        for node, addr in self.agents.items():
            args += ["--node", f"{node}={addr}"]
        args += list(extra)
        if job_id:
            args += ["--job-id", job_id, "--world-size", str(world_size), "--", *command]
        return self._spawn(name, args)

    # ------------------------------------------------------------------ teardown
    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        for proc in self.procs:
            if proc.name == name and proc.popen.poll() is None:
                os.killpg(proc.popen.pid, sig)
                proc.popen.wait(30)

    def stop(self, grace: float = 15.0) -> None:
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                try:
                    os.killpg(proc.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for proc in reversed(self.procs):
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs: killing it", proc.name, grace)
                try:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.popen.wait(10)
        # rank processes run in their own sessions: stop any the controller left behind
        from transom.controller.local import LocalBackend
        jobs_dir = self.run_dir / "jobs"
        if jobs_dir.exists():
            for gen_dir in jobs_dir.glob("*/gen-*"):
                LocalBackend(jobs_dir, {}).stop(gen_dir.parent.name, int(gen_dir.name.split("-")[1]), timeout=5)
        if self.broker is not None:
            self.broker.stop()
        if self.ckpt_runtime is not None:
            import shutil
            shutil.rmtree(self.ckpt_runtime, ignore_errors=True)   # segments of daemons that were killed

    def __enter__(self) -> "LocalStack":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Monitor:
    """Reads Transom's topics without a consumer group and yields ``(topic, event)`` as they come."""

    def __init__(self, bootstrap: str, topics: Sequence[str] = (contracts.LIFECYCLE, contracts.FAULTS,
                                                                 contracts.CHECKPOINTS, contracts.METRICS),
                 *, from_beginning: bool = True) -> None:
        self.consumer = Consumer(client_config(bootstrap, group_id="transom-monitor", enable_auto_commit=False,
                                                 fetch_wait_max_ms=100))
        start = OFFSET_BEGINNING if from_beginning else OFFSET_END
        parts = []
        for topic in topics:
            md = self.consumer.list_topics(topic, timeout=30)
            parts += [TopicPartition(topic, p, start) for p in md.topics[topic].partitions]
        self.consumer.assign(parts)

    def poll(self, timeout: float = 0.2) -> tuple[str, object] | None:
        msg = self.consumer.poll(timeout)
        if msg is None or msg.error():
            return None
        try:
            return msg.topic(), contracts.decode(msg.topic(), msg.value())
        except contracts.ContractError:
            return None

    def events(self, duration: float) -> Iterator[tuple[str, object]]:
        deadline = time.monotonic() + duration
        while time.monotonic() < deadline:
            got = self.poll()
            if got is not None:
                yield got

    def close(self) -> None:
        self.consumer.close()
