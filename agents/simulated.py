"""SimulatedGPUSource: a fake of the NVML module, for demos and tests on machines without GPUs.

It answers the subset of pynvml's functions that :class:`transom.agents.gpu.GPUCollector` uses,
with pynvml's own error class and constants, so the same collector code reads it and the real
driver. It is never chosen silently: the agent uses it only for ``--gpu-source simulated``.

Values model a busy H100 SXM node: utilisation about 93% +- 2, 80 GiB framebuffer mostly used,
power following utilisation (90 W idle, about 570 W busy, of 700 W TDP), temperature
following power, boost clocks,
each GPU with its own offsets drawn from ``seed``.

Faults: :meth:`inject_xid` queues an XID event for the GPU (seen by ``nvmlEventSetWait_v2`` with
``timestamp`` = the injection time). An XID in :data:`LOST_XIDS` (79, "GPU has fallen off the
bus") also makes every later query of that GPU raise ``NVML_ERROR_GPU_IS_LOST``, as the driver
does. Thread-safe: injections arrive on the agent's intake thread.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pynvml

__all__ = ["SimulatedGPUSource", "LOST_XIDS"]

#: XID codes after which the simulated GPU is lost.
LOST_XIDS = frozenset({79})


@dataclass
class _Device:
    index: int
    uuid: str
    util_base: float
    temp_offset: float
    fb_used_mib: float
    lost: bool = False


@dataclass(frozen=True)
class _Handle:
    index: int


class SimulatedGPUSource:
    """A named fake of pynvml with ``num_gpus`` devices and fault injection."""

    NVMLError = pynvml.NVMLError
    NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
    NVML_ERROR_INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_UNINITIALIZED = pynvml.NVML_ERROR_UNINITIALIZED
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    MODEL = "NVIDIA H100 80GB HBM3 (simulated)"
    FB_TOTAL_MIB = 81559
    IDLE_W, LOAD_W = 90.0, 520.0        # power at idle, and added at 100% utilisation (700 W TDP)
    SM_CLOCK_MHZ, MEM_CLOCK_MHZ = 1980, 2619

    def __init__(self, num_gpus: int = 2, seed: int | None = None) -> None:
        if num_gpus < 1:
            raise ValueError(f"num_gpus must be at least 1, got {num_gpus}")
        self.num_gpus = num_gpus
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._initialised = False
        self._events: list[SimpleNamespace] = []
        self._registered: set[int] = set()
        rng = self._rng
        self._devices = [
            _Device(index=i, uuid=f"GPU-sim-{rng.getrandbits(64):016x}",
                    util_base=rng.uniform(90.0, 96.0), temp_offset=rng.uniform(-3.0, 3.0),
                    fb_used_mib=rng.uniform(0.80, 0.90) * self.FB_TOTAL_MIB)
            for i in range(num_gpus)
        ]

    def __repr__(self) -> str:
        return f"SimulatedGPUSource(num_gpus={self.num_gpus})"

    # ------------------------------------------------------------------ fault injection

    def inject_xid(self, gpu: int, code: int) -> float:
        """Raise XID ``code`` on GPU ``gpu`` now; return the injection time (epoch seconds)."""
        if not 0 <= gpu < self.num_gpus:
            raise ValueError(f"no GPU {gpu}: this simulated node has GPUs 0..{self.num_gpus - 1}")
        ts = time.time()
        with self._lock:
            if gpu in self._registered:
                self._events.append(SimpleNamespace(device=_Handle(gpu), eventType=self.nvmlEventTypeXidCriticalError,
                                                    eventData=int(code), gpuInstanceId=0, computeInstanceId=0,
                                                    timestamp=ts))
            if code in LOST_XIDS:
                self._devices[gpu].lost = True
        return ts

    # ------------------------------------------------------------------ the NVML subset

    def _raise(self, code: int) -> None:
        raise pynvml.NVMLError(code)

    def _device(self, handle: Any) -> _Device:
        if not self._initialised:
            self._raise(self.NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, _Handle) or not 0 <= handle.index < self.num_gpus:
            self._raise(self.NVML_ERROR_INVALID_ARGUMENT)
        dev = self._devices[handle.index]
        if dev.lost:
            self._raise(self.NVML_ERROR_GPU_IS_LOST)
        return dev

    def nvmlInit(self) -> None:
        self._initialised = True

    def nvmlShutdown(self) -> None:
        self._initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return self.num_gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < self.num_gpus:
            self._raise(self.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._device(handle).index

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if not isinstance(handle, _Handle):
            self._raise(self.NVML_ERROR_INVALID_ARGUMENT)
        return self._devices[handle.index].uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._device(handle)
        return self.MODEL

    def _util(self, dev: _Device) -> float:
        return min(100.0, max(0.0, self._rng.gauss(dev.util_base, 2.0)))

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> SimpleNamespace:
        with self._lock:
            dev = self._device(handle)
            util = self._util(dev)
            mem = min(100.0, max(0.0, util * 0.45 + self._rng.gauss(0.0, 2.0)))
        return SimpleNamespace(gpu=round(util), memory=round(mem))

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> SimpleNamespace:
        with self._lock:
            dev = self._device(handle)
            used_mib = min(self.FB_TOTAL_MIB, dev.fb_used_mib + self._rng.gauss(0.0, 64.0))
        total = self.FB_TOTAL_MIB * 2**20
        used = int(used_mib * 2**20)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def _power_w(self, dev: _Device) -> float:
        util = self._util(dev)
        return self.IDLE_W + util / 100.0 * self.LOAD_W + self._rng.gauss(0.0, 12.0)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        with self._lock:
            return int(self._power_w(self._device(handle)) * 1000)  # mW, as NVML answers

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        with self._lock:
            dev = self._device(handle)
            return round(33.0 + 0.05 * self._power_w(dev) + dev.temp_offset + self._rng.gauss(0.0, 0.7))

    def nvmlDeviceGetClockInfo(self, handle: Any, clock: int) -> int:
        with self._lock:
            self._device(handle)
            if clock == self.NVML_CLOCK_MEM:
                return self.MEM_CLOCK_MHZ
            return int(self.SM_CLOCK_MHZ - abs(self._rng.gauss(0.0, 20.0)))

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: object) -> None:
        if event_types & self.nvmlEventTypeXidCriticalError:
            with self._lock:
                self._registered.add(self._device(handle).index)

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        with self._lock:
            if self._events:
                return self._events.pop(0)
        if timeout_ms > 0:
            time.sleep(timeout_ms / 1000.0)
        self._raise(self.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: object) -> None:
        pass
