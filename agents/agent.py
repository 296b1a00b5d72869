"""The node agent: runs its collectors every interval and publishes one MetricBatch to Kafka.

Each interval the agent calls every collector through a
:class:`~transom.agents.collectors.RunningCollector` (the error policy lives there), and
publishes one :class:`contracts.MetricBatch` to ``contracts.METRICS`` keyed by the node id, with
``seq`` counting from 0 and ``job`` = the job of the newest training report. Collectors, in
batch order: ``host``, ``gpu``, ``train``, ``agent`` (the heartbeat, always last so its counters
cover the batch). A batch that falls behind schedule is not made up for: the next one follows.

GPU source (``gpu_source``): ``"nvml"`` (the driver via pynvml; without one the agent logs one
line and publishes no GPU samples), ``"simulated"`` (a :class:`SimulatedGPUSource` with ``gpus``
devices, ``seed``), ``"none"``, or any pynvml-like object. Fault injections that arrive on the
intake are carried out only with a simulated source, and refused with a log line otherwise.

``start()`` binds the intake (``intake_addr``) and starts the loop thread; ``stop()`` ends it
and flushes the producer. Also a context manager.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

from transom import contracts
from transom.config import ConfigError
from transom.kafka import make_producer, publish
from transom.log import get

from .collectors import LogOnce, RunningCollector, create_collector, register_collector
from .gpu import GPUCollector, open_nvml
from .host import HostCollector
from .intake import InjectRequest, IntakeServer
from .simulated import SimulatedGPUSource
from .training import TrainingCollector

__all__ = ["Agent", "AgentCollector", "GPU_SOURCES", "DEFAULT_COLLECTORS"]

log = get("agent")

GPU_SOURCES = ("nvml", "simulated", "none")
DEFAULT_COLLECTORS = ("host", "gpu", "train", "agent")


class AgentCollector:
    """The heartbeat: one ``Source.AGENT`` sample with the agent's own counters."""

    name = "agent"

    def __init__(self, agent: "Agent") -> None:
        self.agent = agent

    def collect(self) -> list[contracts.Sample]:
        a = self.agent
        intake = a._intake
        return [contracts.Sample(contracts.Source.AGENT, {
            "uptime_s": time.monotonic() - a._started,
            "interval_s": a.interval,
            "batches_sent": a.batches_sent,
            "publish_errors": a.publish_errors,
            "delivery_errors": a.delivery_errors,
            "producer_queue": len(a._producer) if a._producer is not None else 0,
            "intake_received": intake.received if intake else 0,
            "intake_rejected": intake.rejected if intake else 0,
            "collector_errors": sum(rc.errors for rc in a._running),
            "training_ranks": len(a.training),
            "gpus": a.gpu_count,
        })]


register_collector("host", lambda agent: HostCollector())
register_collector("gpu", lambda agent: GPUCollector(agent.nvml) if agent.nvml is not None else None)
register_collector("train", lambda agent: agent.training)
register_collector("agent", lambda agent: AgentCollector(agent))


class Agent:
    """One node's agent. See the module docstring for what it publishes."""

    def __init__(self, node: str, bootstrap: str, *, gpu_source: Any = "nvml", gpus: int = 2,
                 seed: int | None = None, intake_host: str = "127.0.0.1", intake_port: int = 0,
                 interval: float = 1.0, collectors: Sequence[str] = DEFAULT_COLLECTORS) -> None:
        if not node:
            raise ConfigError("agent: the node id is empty (give --node or set TRANSOM_NODE)")
        if not interval > 0:
            raise ConfigError(f"agent: --interval must be positive, got {interval}")
        if not 0 <= intake_port < 65536:
            raise ConfigError(f"agent: --intake-port must be 0..65535, got {intake_port}")
        self.node, self.bootstrap, self.interval = node, bootstrap, float(interval)
        self.intake_host, self.intake_port = intake_host, intake_port
        self.collector_names = tuple(collectors)
        self.simulated: SimulatedGPUSource | None = None
        self._nvml_from_driver = False
        if isinstance(gpu_source, str):
            if gpu_source not in GPU_SOURCES:
                raise ConfigError(f"agent: --gpu-source {gpu_source!r} is unknown; expected one of: "
                                  f"{', '.join(GPU_SOURCES)}")
            if gpu_source == "simulated":
                if gpus < 1:
                    raise ConfigError(f"agent: --gpus must be at least 1 for the simulated source, got {gpus}")
                self.simulated = SimulatedGPUSource(gpus, seed)
            self.gpu_source_name = gpu_source
        else:
            self.gpu_source_name = type(gpu_source).__name__
            if isinstance(gpu_source, SimulatedGPUSource):
                self.simulated = gpu_source
        self._gpu_source = gpu_source
        self.nvml: Any | None = None
        self.training = TrainingCollector(node)
        self.seq = 0
        self.batches_sent = 0
        self.publish_errors = 0
        self.delivery_errors = 0
        self._running: list[RunningCollector] = []
        self._producer = None
        self._intake: IntakeServer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._once = LogOnce(log)

    # ------------------------------------------------------------------ lifecycle

    @property
    def intake_addr(self) -> str:
        """``"127.0.0.1:PORT"`` of the training intake (after :meth:`start`)."""
        if self._intake is None:
            raise RuntimeError("agent: intake_addr is known only after start()")
        return self._intake.addr

    @property
    def gpu_count(self) -> int:
        return sum(getattr(rc.collector, "count", 0) for rc in self._running if rc.name == "gpu")

    def start(self) -> "Agent":
        if self._thread is not None:
            raise RuntimeError("agent: already started")
        self._started = time.monotonic()
        self._producer = make_producer(self.bootstrap)
        self._intake = IntakeServer(self.intake_host, self.intake_port, on_train=self.training.update,
                                    on_inject=self._inject, logger=log)
        try:
            self._intake.start()
        except OSError as exc:
            self._intake = None
            raise ConfigError(f"agent: cannot listen for training reports on UDP "
                              f"{self.intake_host}:{self.intake_port} ({exc}); choose another --intake-port") from None
        self._open_gpu_source()
        for name in self.collector_names:
            try:
                collector = create_collector(name, self)
            except Exception as exc:
                log.warning("collector %s could not start (%s: %s); running without it", name, type(exc).__name__, exc)
                continue
            if collector is not None:
                self._running.append(RunningCollector(collector))
        self._thread = threading.Thread(target=self._run, name=f"transom-agent-{self.node}", daemon=True)
        self._thread.start()
        log.info("agent of node %s: publishing to %s every %gs; intake %s; gpu source %s; collectors %s",
                 self.node, self.bootstrap, self.interval, self.intake_addr, self.gpu_source_name,
                 ", ".join(rc.name for rc in self._running))
        return self

    def _open_gpu_source(self) -> None:
        src = self._gpu_source
        if src == "none":
            return
        if src == "nvml":
            self.nvml = open_nvml()
            self._nvml_from_driver = self.nvml is not None
            return
        nvml = self.simulated if self.simulated is not None else src
        try:
            nvml.nvmlInit()
        except Exception as exc:
            log.warning("gpu source %s: nvmlInit failed (%s); running without GPU samples", self.gpu_source_name, exc)
            return
        self.nvml = nvml

    def stop(self, timeout: float = 10.0) -> None:
        """Stop collecting, close the intake, flush what is queued (up to ``timeout`` s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._intake is not None:
            self._intake.stop()
        for rc in self._running:
            rc.close()
        if self._producer is not None:
            left = self._producer.flush(timeout)
            if left:
                log.warning("agent: %d batch(es) not delivered to %s within %gs at shutdown", left, self.bootstrap, timeout)
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception as exc:
                log.warning("agent: nvmlShutdown failed: %s", exc)
            self.nvml = None
        log.info("agent of node %s stopped after %d batches", self.node, self.batches_sent)

    def __enter__(self) -> "Agent":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            self.publish_once()
            due += self.interval
            delay = due - time.monotonic()
            if delay < 0:  # behind schedule: carry on from now rather than burst
                due, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    def publish_once(self) -> None:
        """Collect every collector once and publish the batch (the loop calls this)."""
        ts = time.time()
        samples: list[contracts.Sample] = []
        for rc in self._running:
            samples.extend(rc.collect())
        batch = contracts.MetricBatch(node=self.node, ts=ts, seq=self.seq, samples=tuple(samples),
                                      job=self.training.job)
        try:
            publish(self._producer, contracts.METRICS, self.node, batch, on_delivery=self._delivered)
        except Exception as exc:
            self.publish_errors += 1
            self._once(("publish", type(exc).__name__, str(exc)), logging.ERROR,
                       "agent: publishing batch %d failed: %s: %s", self.seq, type(exc).__name__, exc)
            return
        self.seq += 1
        self.batches_sent += 1
        self._producer.poll(0)

    def _delivered(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.delivery_errors += 1
            self._once(("delivery", str(err)), logging.WARNING, "agent: a batch was not delivered: %s", err)

    # ------------------------------------------------------------------ fault injection

    def _inject(self, req: InjectRequest) -> dict[str, Any]:
        if self.simulated is None:
            why = (f"fault injection needs --gpu-source simulated; this agent reads {self.gpu_source_name}")
            log.warning("agent: refused a %s injection: %s", req.fault, why)
            return {"ok": False, "fault": req.fault, "error": why}
        if req.fault == "xid79":
            try:
                ts = self.simulated.inject_xid(req.gpu, 79)
            except ValueError as exc:
                log.warning("agent: refused an xid79 injection: %s", exc)
                return {"ok": False, "fault": req.fault, "error": str(exc)}
            log.warning("agent: injected XID 79 on simulated GPU %d of node %s", req.gpu, self.node)
            return {"ok": True, "fault": req.fault, "gpu": req.gpu, "node": self.node, "ts": ts}
        procs = self.training.processes()
        stopped = []
        for proc in procs:
            try:
                proc.suspend()  # SIGSTOP: a real hang, the process stays alive
                stopped.append(proc.pid)
            except Exception as exc:
                log.warning("agent: could not SIGSTOP pid %d: %s", proc.pid, exc)
        if not stopped:
            why = "no live training process has reported to this agent"
            log.warning("agent: refused a hang injection: %s", why)
            return {"ok": False, "fault": req.fault, "error": why}
        log.warning("agent: injected a hang: SIGSTOP sent to pid(s) %s", ", ".join(map(str, stopped)))
        return {"ok": True, "fault": req.fault, "node": self.node, "pids": stopped, "ts": time.time()}
