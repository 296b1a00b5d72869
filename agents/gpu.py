"""GPU collector over an NVML-like module (``pynvml`` itself, or :class:`SimulatedGPUSource`).

The hardware boundary is the ``nvml`` object given to :class:`GPUCollector`: it needs pynvml's
names (``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``, the ``nvmlDeviceGet*`` queries
below, ``nvmlEventSetCreate``/``nvmlDeviceRegisterEvents``/``nvmlEventSetWait_v2``,
``NVMLError`` with ``.value``, and the ``NVML_*`` constants). The collector only reads.

Per collect, for GPU index ``i``:

- each XID event drained from the event set gives one sample ``{XID_ERRORS: code}`` with
  ``ts`` = the event time (the event's ``timestamp`` attribute when the source provides one,
  which NVML's v2 event data does not; else the time it was drained);
- a device that answers ``NVML_ERROR_GPU_IS_LOST`` gives ``{GPU_LOST: 1}`` and no other field,
  except in the collect that reported its XID: there the XID sample stands for the device, so
  "XID, then lost in every later batch" reads in that order;
- otherwise one sample with the DCGM-named metrics (utilisation, framebuffer MiB, temperature,
  power W, SM and memory clocks MHz). A query that fails for another reason leaves its field out
  (logged once per field and error).

:func:`open_nvml` is the ``--gpu-source nvml`` path: it returns the initialised ``pynvml``
module, or ``None`` after logging one line when there is no driver.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any, Callable

from transom import contracts
from transom.contracts import DCGM
from transom.log import get

from .collectors import LogOnce

__all__ = ["GPUCollector", "open_nvml"]

log = get("agent.gpu")

_MIB = 2**20
_MAX_EVENTS = 1000  # per collect: a storm of events must not hold up the batch


def open_nvml() -> Any | None:
    """Import and initialise pynvml; without a driver, say so in one line and return ``None``."""
    try:
        import pynvml
    except ImportError as exc:
        log.warning("gpu source nvml: cannot import pynvml (%s); running without GPU samples", exc)
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.warning("gpu source nvml: no usable NVIDIA driver (%s); running without GPU samples "
                    "(for a demo without GPUs use --gpu-source simulated)", exc)
        return None
    return pynvml


def _key(handle: Any) -> Any:
    """A hashable identity for a device handle (pynvml's are ctypes pointers, compared by address)."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class GPUCollector:
    name = "gpu"

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._once = LogOnce(log)
        count = nvml.nvmlDeviceGetCount()
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._index = {_key(h): i for i, h in enumerate(self._handles)}
        self._tags = [{"uuid": _text(nvml.nvmlDeviceGetUUID(h))} for h in self._handles]
        self._events = self._register_xid_events()
        self._queries: list[tuple[str, Callable[[Any], dict[str, float]]]] = [
            ("utilization", self._utilization), ("memory", self._memory), ("temperature", self._temperature),
            ("power", self._power), ("sm clock", self._sm_clock), ("memory clock", self._mem_clock),
        ]
        log.info("gpu collector: %d device(s), XID events %s", count,
                 "on" if self._events is not None else "off")

    @property
    def count(self) -> int:
        return len(self._handles)

    # one NVML query each; units converted to DCGM's (MiB, W, MHz, %)

    def _utilization(self, h: Any) -> dict[str, float]:
        u = self.nvml.nvmlDeviceGetUtilizationRates(h)
        return {DCGM.GPU_UTIL: float(u.gpu), DCGM.MEM_COPY_UTIL: float(u.memory)}

    def _memory(self, h: Any) -> dict[str, float]:
        m = self.nvml.nvmlDeviceGetMemoryInfo(h)
        return {DCGM.FB_USED: m.used / _MIB, DCGM.FB_FREE: m.free / _MIB}

    def _temperature(self, h: Any) -> dict[str, float]:
        return {DCGM.GPU_TEMP: float(self.nvml.nvmlDeviceGetTemperature(h, self.nvml.NVML_TEMPERATURE_GPU))}

    def _power(self, h: Any) -> dict[str, float]:
        return {DCGM.POWER_USAGE: self.nvml.nvmlDeviceGetPowerUsage(h) / 1000.0}  # NVML answers mW

    def _sm_clock(self, h: Any) -> dict[str, float]:
        return {DCGM.SM_CLOCK: float(self.nvml.nvmlDeviceGetClockInfo(h, self.nvml.NVML_CLOCK_SM))}

    def _mem_clock(self, h: Any) -> dict[str, float]:
        return {DCGM.MEM_CLOCK: float(self.nvml.nvmlDeviceGetClockInfo(h, self.nvml.NVML_CLOCK_MEM))}

    def _register_xid_events(self) -> Any | None:
        n = self.nvml
        try:
            events = n.nvmlEventSetCreate()
        except n.NVMLError as exc:
            log.warning("gpu collector: cannot create an NVML event set (%s); XID errors will not be seen", exc)
            return None
        registered = 0
        for i, h in enumerate(self._handles):
            try:
                n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, events)
                registered += 1
            except n.NVMLError as exc:
                log.warning("gpu collector: GPU %d does not report XID events (%s)", i, exc)
        return events if registered else None

    def _drain_xids(self) -> list[tuple[int | None, int, float]]:
        if self._events is None:
            return []
        n = self.nvml
        out = []
        for _ in range(_MAX_EVENTS):
            try:
                data = n.nvmlEventSetWait_v2(self._events, 0)
            except n.NVMLError as exc:
                if exc.value != n.NVML_ERROR_TIMEOUT:
                    self._once(("wait", exc.value), logging.WARNING, "gpu collector: waiting for XID events failed: %s", exc)
                return out
            if not data.eventType & n.nvmlEventTypeXidCriticalError:
                continue
            ts = getattr(data, "timestamp", None) or time.time()
            out.append((self._index.get(_key(data.device)), int(data.eventData), float(ts)))
        return out

    def _read(self, i: int, handle: Any) -> tuple[dict[str, float], bool]:
        """The device's metrics, and whether it is lost."""
        n = self.nvml
        fields: dict[str, float] = {}
        for what, query in self._queries:
            try:
                fields.update(query(handle))
            except n.NVMLError as exc:
                if exc.value == n.NVML_ERROR_GPU_IS_LOST:
                    return {}, True
                self._once(("query", what, exc.value), logging.WARNING,
                           "gpu collector: GPU %d %s query failed (%s); field left out", i, what, exc)
        return fields, False

    def collect(self) -> list[contracts.Sample]:
        gpu = contracts.Source.GPU
        samples = []
        xid_gpus = set()
        for i, code, ts in self._drain_xids():
            xid_gpus.add(i)
            samples.append(contracts.Sample(gpu, {DCGM.XID_ERRORS: code}, index=i,
                                            tags=self._tags[i] if i is not None else {}, ts=ts))
        for i, h in enumerate(self._handles):
            fields, lost = self._read(i, h)
            if lost:
                if i not in xid_gpus:
                    samples.append(contracts.Sample(gpu, {DCGM.GPU_LOST: 1}, index=i, tags=self._tags[i]))
            elif fields:
                samples.append(contracts.Sample(gpu, fields, index=i, tags=self._tags[i]))
        return samples

    def close(self) -> None:
        if self._events is not None:
            try:
                self.nvml.nvmlEventSetFree(self._events)
            except Exception:  # best effort at shutdown
                pass
            self._events = None
