"""``transom demo --scheduler slurm``: the demo's loop on the hosts test bed, under a real Slurm cluster.

Seven hosts of a :class:`transom.testbed.Bed`: ``ctl`` runs ``slurmctld`` and node0..node4 each a
``slurmd`` (:class:`transom.slurmbed.SlurmBed`), a node agent with simulated GPUs and a checkpoint
daemon (TCE). The broker listens on the bed's root address; the TEE and the controller
(``--backend slurm``) run in the root namespace, as on a login node. The ranks are Slurm batch jobs
that ``srun`` places on the node hosts; the run directory is shared with every host (the cluster's
shared filesystem). :meth:`BedStack.stop` ends the controller and the TEE, stops Slurm and the
broker and closes the bed (every process of every host dies with it): nothing is left behind.

Needs root (namespaces) and Debian's ``slurm-wlm`` and ``munge``; :func:`available` says in one
line why not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Sequence

from .log import get
from .stack import _Proc

__all__ = ["BedStack", "available", "controller_args", "INTAKE_PORT"]

log = get("demo.slurm")
INTAKE_PORT = 7100               # each node's agent intake, on the node host's own loopback


def available() -> tuple[bool, str]:
    from .slurmbed import available as slurm_available
    return slurm_available()


def controller_args(bootstrap: str, run_dir: Path, agents: dict[str, str], extra: Sequence[str] = ()) -> list[str]:
    """The controller's arguments for the bed's Slurm cluster (nodes as Slurm names them, agents by bed address)."""
    args = ["controller", "--bootstrap", bootstrap, "--backend", "slurm", "--run-dir", str(run_dir)]
    for node, addr in agents.items():
        args += ["--node", f"{node}={addr}"]
    return args + list(extra)


class BedStack:
    """The demo's parts on a test bed with a real Slurm cluster (the interface of :class:`LocalStack` it uses)."""

    def __init__(self, run_dir: Path, nodes: int = 5, gpus_per_node: int = 2, interval: float = 1.0) -> None:
        self.run_dir = Path(run_dir).resolve()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.node_names = [f"node{i}" for i in range(nodes)]
        self.gpus_per_node, self.interval = gpus_per_node, interval
        self.bed = self.slurm = self.broker = None
        self.bootstrap: str | None = None
        self.agents: dict[str, str] = {}
        self.procs: list[_Proc] = []           # in the root namespace: TEE, controller
        self.host_procs: list = []             # on the bed's hosts: agents, checkpoint daemons
        # the TCE daemons and the ranks find each other in the registry under this cluster name only
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("TRANSOM_CKPT_RUNTIME", "TRANSOM_CKPT_LOCAL_DIR", "TRANSOM_ADVERTISE_ADDR",
                                 "MASTER_ADDR", "MASTER_PORT")}
        self.env.update(PYTHONUNBUFFERED="1", TRANSOM_CLUSTER=f"demo-slurm-{uuid.uuid4().hex[:8]}")

    def _log(self, name: str):
        return open(self.run_dir / "logs" / f"{name}.log", "ab")

    # ------------------------------------------------------------------ parts
    def start_broker(self) -> str:
        from .broker import EmbeddedBroker
        from .slurmbed import SlurmBed
        from .testbed import Bed

        self.bed = Bed(["ctl", *self.node_names], share=[self.run_dir]).up()
        self.slurm = SlurmBed(self.bed, "ctl", self.node_names, self.run_dir / "slurm").start()
        self.env["SLURM_CONF"] = str(self.slurm.conf)
        self.broker = EmbeddedBroker(host=self.bed.root_addr, log_path=str(self.run_dir / "logs" / "broker.log"))
        self.broker.start()
        self.bootstrap = self.broker.bootstrap
        self.env["TRANSOM_BOOTSTRAP"] = self.bootstrap
        return self.bootstrap

    def start_agents(self) -> dict[str, str]:
        for node in self.node_names:
            self.host_procs.append(self.bed.python(
                node, ["-m", "transom.cli", "agent", "--node", node, "--gpu-source", "simulated",
                       "--gpus", str(self.gpus_per_node), "--intake-port", str(INTAKE_PORT),
                       "--interval", str(self.interval), "--bootstrap", self.bootstrap],
                self.env, stdout=self._log(f"agent-{node}"), stderr=subprocess.STDOUT))
            self.host_procs.append(self.bed.python(
                node, ["-m", "transom.cli", "ckpt-server", "--node", node, "--host", "0.0.0.0", "--transport", "tcp",
                       "--bootstrap", self.bootstrap],
                self.env, stdout=self._log(f"ckpt-{node}"), stderr=subprocess.STDOUT))
            self.agents[node] = f"{self.bed.addr(node)}:{INTAKE_PORT}"
        self._await_agents()
        return self.agents

    def _await_agents(self, timeout: float = 120.0) -> None:
        """Until a metrics batch of every node's agent is on the broker (the controller's pre-check wants one):
        the agents start inside their hosts, slower than the controller would start here."""
        import time

        from . import contracts
        from .stack import Monitor

        monitor = Monitor(self.bootstrap, (contracts.METRICS,))
        seen: set[str] = set()
        deadline = time.monotonic() + timeout
        try:
            while not seen >= set(self.node_names):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no metrics from the agents of {sorted(set(self.node_names) - seen)} within "
                                       f"{timeout:.0f}s (see {self.run_dir / 'logs'}/agent-*.log)")
                got = monitor.poll(0.5)
                if got is not None:
                    seen.add(got[1].node)
        finally:
            monitor.close()

    def _spawn(self, name: str, args: Sequence[str]) -> _Proc:
        logfile = self.run_dir / "logs" / f"{name}.log"
        popen = subprocess.Popen([sys.executable, "-m", "transom.cli", *args], env=self.env,
                                 stdout=open(logfile, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        proc = _Proc(name, popen, logfile)
        self.procs.append(proc)
        return proc

    def start_tee(self, *extra: str, name: str = "tee") -> _Proc:
        return self._spawn(name, ["tee", "--bootstrap", self.bootstrap, *extra])

    def start_controller(self, job_id: str, command: Sequence[str], *, world_size: int = 4,
                         extra: Sequence[str] = (), name: str = "controller") -> _Proc:
        args = controller_args(self.bootstrap, self.run_dir / "jobs", self.agents, extra)
        return self._spawn(name, [*args, "--job-id", job_id, "--world-size", str(world_size), "--", *command])

    def inject(self, node: str, fault: str) -> None:
        """The fault request, sent to the node's agent from its own host (the intake is on its loopback)."""
        proc = self.bed.python(node, ["-m", "transom.cli", "inject", "--agent", f"127.0.0.1:{INTAKE_PORT}", fault,
                                      "--gpu", "0"], self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = proc.communicate(timeout=60)
        if proc.returncode != 0:
            log.warning("inject %s on %s exited %s: %s", fault, node, proc.returncode, out.decode(errors="replace"))

    def node_report(self) -> list[str]:
        """What Slurm says of the nodes now (``scontrol show nodes``): the drained one and its reason."""
        if self.slurm is None:
            return []
        try:
            states = self.slurm.node_states()
        except Exception as exc:             # the report is informative only: never fail the demo for it
            return [f"scontrol show nodes failed: {exc}"]
        return [f"{n:6s} State={st}" + (f" Reason={why}" if why else "") for n, (st, why) in states.items()]

    # ------------------------------------------------------------------ teardown
    def stop(self, grace: float = 15.0) -> None:
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                try:
                    os.killpg(proc.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in reversed(self.procs):
            try:
                proc.popen.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs: killing it", proc.name, grace)
                try:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.popen.wait(10)
        if self.slurm is not None:
            self.slurm.stop()
        if self.broker is not None:
            self.broker.stop()
        if self.bed is not None:
            self.bed.close()             # every process of every host: agents, daemons, ranks, slurmd
        for p in self.host_procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
