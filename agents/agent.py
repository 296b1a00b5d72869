"""The node agent: runs its collectors every interval and publishes one MetricBatch per tick.

Each tick the agent calls every due collector through a
:class:`~transom.agents.collectors.RunningCollector` (interval, tags and error policy live
there) and publishes one :class:`contracts.MetricBatch` to ``contracts.METRICS`` keyed by the
node id, with ``job`` = the job of the newest training report. Collectors, in batch order, are
``[agent] collectors`` (default ``host``, ``gpu``, ``nic``, ``train``, ``agent``; ``agent`` is the
self-metrics sample and should stay last so that its counters cover the batch). Push samples
(an XID) are published at once in a batch of their own. A tick that falls behind schedule is
not made up for: the next one follows.

``seq`` numbers every batch of the node: 0, 1, 2... across restarts when ``state_dir`` is
set (it is kept there with the spool), from 0 in a private temp directory otherwise. Downstream,
a gap in ``seq`` is a loss (counted here as ``dropped`` when the spool bound forced it) and a
repeat is a duplicate. Delivery (producer, spool, replay, SIGTERM) is
:class:`~transom.agents.delivery.Publisher`'s.

GPU source (``gpu_source``): ``"nvml"`` (the driver via pynvml; without one the agent logs one
line and publishes no GPU samples), ``"simulated"`` (a :class:`SimulatedGPUSource` with
``gpus`` devices, ``seed`` and an optional ``scenario`` file), ``"none"``, or any pynvml-like
object (a :class:`~transom.agents.fakenvml.FakeNVML` in tests). Fault injections that arrive on
the intake are carried out only with a simulated source, and refused with a log line otherwise.

``start()`` binds the intake and starts the loop and the publisher; ``stop()`` ends them,
delivering or spooling every batch. Also a context manager.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Any

from transom import contracts
from transom.config import ConfigError
from transom.log import get

from .collectors import LogOnce, RunningCollector, create_collector, register_collector
from .config import AgentConfig, AgentSettings, settings_from, validate
from .delivery import DeliverySettings, Publisher
from .gpu import F, GPUCollector, GPUSettings, open_nvml
from .host import HostCollector, HostSettings
from .intake import InjectRequest, IntakeServer
from .nic import NICCollector, NICSettings
from .simulated import Fault, SimulatedGPUSource, SimulatedSysfs, load_scenario
from .spool import SeqState, Spool
from .training import TrainingCollector

__all__ = ["Agent", "AgentCollector", "is_fault_class", "encode_batch"]

log = get("agent")


def encode_batch(batch: contracts.MetricBatch) -> bytes:
    """``contracts.encode(batch)``, byte for byte, without its generic dataclass walk (a batch of a
    node with 8 GPUs and a few NICs is ~15 kB every second; this is about 4x cheaper)."""
    samples = [{"source": s.source.value, "fields": dict(s.fields), "index": s.index, "tags": dict(s.tags), "ts": s.ts}
               for s in batch.samples]
    doc = {"node": batch.node, "ts": batch.ts, "seq": batch.seq, "samples": samples, "job": batch.job, "v": batch.v}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def is_fault_class(batch: contracts.MetricBatch) -> bool:
    """A batch the spool bound never drops: an XID, a lost GPU, a driver error, a NaN loss, a dead rank."""
    for s in batch.samples:
        f = s.fields
        if F.XID in f or F.GPU_LOST in f or F.NVML_ERROR in f or f.get("alive") == 0:
            return True
        if s.source == contracts.Source.TRAIN and any(k.endswith("_nonfinite") for k in f):
            return True
    return False


class AgentCollector:
    """The self-metrics: one ``Source.AGENT`` sample with the agent's and the publisher's counters."""

    name = "agent"

    def __init__(self, agent: "Agent") -> None:
        self.agent = agent

    def collect(self) -> list[contracts.Sample]:
        a = self.agent
        p = a.publisher
        intake = a._intake
        lat = p.take_latency() if p is not None else []
        fields = {
            "uptime_s": time.monotonic() - a._started,
            "interval_s": a.interval,
            "batches_sent": a.batches_sent,
            "collector_errors": sum(rc.errors for rc in a._running),
            "dropped_fields": sum(rc.dropped_fields for rc in a._running),
            "intake_received": intake.received if intake else 0,
            "intake_rejected": intake.rejected if intake else 0,
            "training_ranks": len(a.training),
            "gpus": a.gpu_count,
        }
        if p is not None:
            fields.update({
                "produced": p.produced, "delivered": p.delivered, "spooled": p.spooled, "replayed": p.replayed,
                "dropped": p.dropped, "delivery_errors": p.delivery_errors, "outages": p.outages,
                "in_flight": p.in_flight, "spool_batches": len(p.spool), "spool_bytes": p.spool.bytes,
                "connected": int(p.connected),
            })
        if lat:
            fields["delivery_latency_ms_mean"] = 1000.0 * sum(lat) / len(lat)
            fields["delivery_latency_ms_max"] = 1000.0 * max(lat)
        return [contracts.Sample(contracts.Source.AGENT, fields)]


def _nic(agent: "Agent", s: NICSettings) -> NICCollector:
    if s.source == "simulated":
        sysfs = agent.simulated_sysfs()
        s.root = sysfs.root
        return NICCollector(s, advance=sysfs.advance)
    if s.source != "sysfs":
        raise ConfigError(f"collectors.nic.source: {s.source!r} is unknown; expected sysfs or simulated")
    return NICCollector(s)


register_collector("host", lambda agent, s: HostCollector(s), HostSettings, "host CPU, memory, load, disk and network IO (psutil)")
register_collector("gpu", lambda agent, s: GPUCollector(agent.nvml, s, agent.node) if agent.nvml is not None else None,
                   GPUSettings, "GPU metrics (DCGM names) and XID events through NVML")
register_collector("nic", _nic, NICSettings, "Ethernet and InfiniBand counters, rates and link state (sysfs)")
register_collector("train", lambda agent, s: agent.training, None, "training step statistics and rank liveness (intake)")
register_collector("agent", lambda agent, s: AgentCollector(agent), None, "the agent's own counters (self-metrics)")


class Agent:
    """One node's agent. See the module docstring for what it publishes."""

    def __init__(self, node: str | None = None, bootstrap: str | None = None, *, config: AgentConfig | None = None,
                 gpu_source: Any = None, **settings: Any) -> None:
        cfg = config or AgentConfig()
        overrides = {k: v for k, v in settings.items() if v is not None}
        if node is not None:
            overrides["node"] = node
        if bootstrap is not None:
            overrides["bootstrap"] = bootstrap
        if isinstance(gpu_source, str):
            overrides["gpu_source"] = gpu_source
        if config is None:
            overrides.setdefault("gpu_source", "nvml" if gpu_source is None or isinstance(gpu_source, str) else "none")
        elif gpu_source is not None and not isinstance(gpu_source, str):
            overrides["gpu_source"] = "none"
        if "collectors" in overrides:
            overrides["collectors"] = list(overrides["collectors"])
        settings_from(AgentSettings, overrides, "agent", cfg.agent)
        validate(cfg)
        if not cfg.agent.bootstrap:
            raise ConfigError("agent: no Kafka bootstrap (give --bootstrap or set TRANSOM_BOOTSTRAP)")
        self.config = cfg
        a = cfg.agent
        self.node, self.bootstrap, self.interval = a.node, a.bootstrap, float(a.interval)
        self.collector_names = tuple(a.collectors)
        self.simulated: SimulatedGPUSource | None = None
        self._gpu_object = gpu_source if gpu_source is not None and not isinstance(gpu_source, str) else None
        if self._gpu_object is not None:
            self.gpu_source_name = type(self._gpu_object).__name__
            if isinstance(self._gpu_object, SimulatedGPUSource):
                self.simulated = self._gpu_object
        else:
            self.gpu_source_name = a.gpu_source
            if a.gpu_source == "simulated":
                scenario = load_scenario(a.scenario, a.gpus) if a.scenario else None
                self.simulated = SimulatedGPUSource(a.gpus, a.seed or None, scenario=scenario)
        if self.simulated is not None:
            self.simulated.on_hang = lambda fault: self._hang("scenario")
        self.nvml: Any | None = None
        self.training = TrainingCollector(self.node)
        self.batches_sent = 0
        self.publisher: Publisher | None = None
        self._seq: SeqState | None = None
        self._tmp_state: str | None = None
        self._sysfs: SimulatedSysfs | None = None
        self._running: list[RunningCollector] = []
        self._intake: IntakeServer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._push: list[contracts.Sample] = []
        self._push_lock = threading.Lock()
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

    @property
    def seq(self) -> int:
        """The seq the next batch gets."""
        return self._seq.next if self._seq is not None else 0

    @property
    def state_dir(self) -> str:
        return self.config.agent.state_dir or self._tmp_state or ""

    def simulated_sysfs(self) -> SimulatedSysfs:
        """The simulated node's NIC tree (created on first use, under the state directory)."""
        if self._sysfs is None:
            self._sysfs = SimulatedSysfs(os.path.join(self.state_dir, "simulated-sysfs"), seed=self.config.agent.seed or None)
            if self.simulated is not None:
                self.simulated.nic = self._sysfs
        return self._sysfs

    def start(self) -> "Agent":
        if self._thread is not None:
            raise RuntimeError("agent: already started")
        a = self.config.agent
        self._started = time.monotonic()
        if not a.state_dir:
            self._tmp_state = tempfile.mkdtemp(prefix=f"transom-agent-{self.node}-")
        spool = Spool(os.path.join(self.state_dir, "spool"), int(a.spool_max_mb * 2**20))
        self._seq = SeqState(self.state_dir, floor=(spool.max_seq + 1) if spool.max_seq is not None else 0)
        self.publisher = Publisher(self.bootstrap, self.node, spool, DeliverySettings(
            delivery_timeout_s=a.delivery_timeout_s, retry_s=a.retry_s, linger_ms=a.linger_ms,
            max_in_flight=a.max_in_flight)).start()
        self._intake = IntakeServer(a.intake_host, a.intake_port, on_train=self.training.update,
                                    on_inject=self._inject, logger=log)
        try:
            self._intake.start()
        except OSError as exc:
            self._intake = None
            self.publisher.stop(0)
            raise ConfigError(f"agent: cannot listen for training reports on UDP "
                              f"{a.intake_host}:{a.intake_port} ({exc}); choose another --intake-port") from None
        self._open_gpu_source()
        for name in self.collector_names:
            try:
                collector = create_collector(name, self, self.config.settings(name))
            except ConfigError:
                raise
            except Exception as exc:
                log.warning("collector %s could not start (%s: %s); running without it", name, type(exc).__name__, exc)
                continue
            if collector is None:
                continue
            common = self.config.common.get(name, {})
            every = round(common.get("interval", self.interval) / self.interval)
            rc = RunningCollector(collector, every=max(1, every), tags={**a.tags, **common.get("tags", {})})
            rc.start(self._emit)
            self._running.append(rc)
        self._thread = threading.Thread(target=self._run, name=f"transom-agent-{self.node}", daemon=True)
        self._thread.start()
        log.info("agent of node %s: publishing to %s every %gs from seq %d; intake %s; gpu source %s; "
                 "collectors %s; state %s", self.node, self.bootstrap, self.interval, self.seq, self.intake_addr,
                 self.gpu_source_name, ", ".join(rc.name for rc in self._running),
                 a.state_dir or f"{self._tmp_state} (temporary: seq restarts at 0 and the spool is lost on exit)")
        return self

    def _open_gpu_source(self) -> None:
        if self.gpu_source_name == "none":
            return
        if self.gpu_source_name == "nvml" and self._gpu_object is None:
            self.nvml = open_nvml()
            return
        nvml = self.simulated if self.simulated is not None else self._gpu_object
        try:
            nvml.nvmlInit()
        except Exception as exc:
            log.warning("gpu source %s: nvmlInit failed (%s); running without GPU samples", self.gpu_source_name, exc)
            return
        self.nvml = nvml

    def stop(self, timeout: float = 10.0) -> None:
        """Stop collecting, close the intake, deliver or spool every batch (flush up to ``timeout`` s)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._goodbye()
        if self._intake is not None:
            self._intake.stop()
        for rc in self._running:
            rc.close()
        left = self.publisher.stop(timeout) if self.publisher is not None else 0
        if self._seq is not None:
            self._seq.close()
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception as exc:
                log.warning("agent: nvmlShutdown failed: %s", exc)
            self.nvml = None
        if self._tmp_state is not None:
            if left:
                log.warning("agent: %d undelivered batch(es) are lost with the temporary state directory "
                            "(set [agent] state_dir / --state-dir to keep them for the next start)", left)
            shutil.rmtree(self._tmp_state, ignore_errors=True)
        elif left:
            log.warning("agent: %d undelivered batch(es) kept in %s; the next start replays them", left, self.state_dir)
        log.info("agent of node %s stopped after %d batches", self.node, self.batches_sent)

    def __enter__(self) -> "Agent":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ the loop

    def _emit(self, samples: list[contracts.Sample]) -> None:
        """A push collector's samples: published by the loop at once, in a batch of their own."""
        with self._push_lock:
            self._push.extend(samples)
        self._wake.set()

    def _take_push(self) -> list[contracts.Sample]:
        with self._push_lock:
            out, self._push = self._push, []
        return out

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            pushed = self._take_push()
            if pushed:
                self._publish(pushed)
            if time.monotonic() >= due:
                self.publish_once()
                due += self.interval
                if due < time.monotonic():  # behind schedule: carry on from now rather than burst
                    due = time.monotonic() + self.interval
            self._wake.wait(max(0.0, due - time.monotonic()))
            self._wake.clear()
        pushed = self._take_push()
        if pushed:
            self._publish(pushed)

    def _goodbye(self) -> None:
        """The last batch of a stop (SIGTERM: a restart, an upgrade, a drain): every collector once, as any
        batch, its training ranks each marked ``agent_stopping`` and the agent's own sample ``stopping``. The
        TEE then takes the silence that follows for the agent's, not the node's: it waits for the ranks' peers
        to show the node lost, or for ``heartbeat_bye_grace_s``, instead of evicting at the heartbeat timeout."""
        if self.publisher is None or self._seq is None:
            return
        samples: list[contracts.Sample] = []
        for rc in self._running:
            for s in rc.collect():
                if s.source is contracts.Source.TRAIN and not s.tags.get("event"):
                    s = contracts.Sample(s.source, {**s.fields, "agent_stopping": 1}, s.index, s.tags, s.ts)
                elif s.source is contracts.Source.AGENT:
                    s = contracts.Sample(s.source, {**s.fields, "stopping": 1}, s.index, s.tags, s.ts)
                samples.append(s)
        if not any(s.source is contracts.Source.AGENT for s in samples):       # the agent collector left out
            samples.append(contracts.Sample(contracts.Source.AGENT, {"stopping": 1, "interval_s": self.interval}))
        try:
            self._publish(samples)
        except Exception as exc:   # the stop goes on: the TEE then sees a silence, as after a crash
            log.warning("agent: the goodbye batch could not be published: %s", exc)

    def publish_once(self) -> None:
        """Collect every due collector once and publish the batch (the loop calls this)."""
        samples: list[contracts.Sample] = []
        for rc in self._running:
            if rc.due():
                samples.extend(rc.collect())
        self._publish(samples)

    def _publish(self, samples: list[contracts.Sample]) -> None:
        assert self._seq is not None and self.publisher is not None
        seq = self._seq.take()
        batch = contracts.MetricBatch(node=self.node, ts=time.time(), seq=seq, samples=tuple(samples),
                                      job=self.training.job)
        try:
            payload = encode_batch(batch)
        except Exception as exc:  # a bug: say so, and keep the seq visible as a gap
            self._once(("encode", type(exc).__name__), logging.ERROR, "agent: batch %d cannot be encoded: %s", seq, exc)
            return
        self.publisher.submit(seq, payload, is_fault_class(batch))
        self.batches_sent += 1

    # ------------------------------------------------------------------ fault injection

    def _hang(self, why: str) -> dict[str, Any]:
        stopped = []
        for proc in self.training.processes():
            try:
                proc.suspend()  # SIGSTOP: a real hang, the process stays alive
                stopped.append(proc.pid)
            except Exception as exc:
                log.warning("agent: could not SIGSTOP pid %d: %s", proc.pid, exc)
        if not stopped:
            reason = "no live training process has reported to this agent"
            log.warning("agent: refused a hang injection (%s): %s", why, reason)
            return {"ok": False, "fault": "hang", "error": reason}
        log.warning("agent: injected a hang (%s): SIGSTOP sent to pid(s) %s", why, ", ".join(map(str, stopped)))
        return {"ok": True, "fault": "hang", "node": self.node, "pids": stopped, "ts": time.time()}

    def _inject(self, req: InjectRequest) -> dict[str, Any]:
        if self.simulated is None:
            why = f"fault injection needs --gpu-source simulated; this agent reads {self.gpu_source_name}"
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
        if req.fault == "straggler":       # SM clock and power at 70% for good (the GPU's part of a slow node)
            if not 0 <= req.gpu < self.simulated.num_gpus:
                return {"ok": False, "fault": req.fault, "error": f"no GPU {req.gpu} on this simulated node"}
            self.simulated.apply(Fault(at=0.0, kind="straggler", gpu=req.gpu))
            log.warning("agent: injected a straggler on simulated GPU %d of node %s", req.gpu, self.node)
            return {"ok": True, "fault": req.fault, "gpu": req.gpu, "node": self.node, "ts": time.time()}
        return self._hang("inject")
