"""FakeNVML: a named fake of the ``pynvml`` module, for tests and the simulated source. Never a default.

It answers pynvml's own function names with pynvml's signatures, return types (the real ctypes
structures where the collector reads them: ``c_nvmlUtilization_t``, ``c_nvmlMemory_t``,
``c_nvmlFieldValue_t`` arrays) and error class: every failure is ``pynvml.NVMLError(code)``,
which pynvml turns into its own subclass (``NVMLError_NotSupported``, ``NVMLError_GPUIsLost``,
``NVMLError_Timeout``...). Device values are plain attributes of :class:`FakeDevice` that a test
sets; nothing is random here (the noise lives in :class:`~transom.agents.simulated.SimulatedGPUSource`).

Error injection, with the real codes:

- ``fake.fail(function_name, code, gpu=None)``: that function raises ``NVMLError(code)`` for one
  GPU (or all); ``fake.heal(...)`` undoes it. ``NVML_ERROR_NOT_SUPPORTED`` is how a test says
  "this GPU has no such sensor";
- ``device.unsupported_fields``: field ids that ``nvmlDeviceGetFieldValues`` answers with
  ``nvmlReturn = NVML_ERROR_NOT_SUPPORTED`` (as the driver does per field);
- ``device.lost = True``: every query of the device raises ``NVML_ERROR_GPU_IS_LOST``;
- ``fake.init_error``: ``nvmlInit`` raises it (e.g. ``NVML_ERROR_DRIVER_NOT_LOADED``: no driver);
- ``fake.push_xid(gpu, code)``: queues an XID event; ``nvmlEventSetWait_v2(set, timeout_ms)``
  blocks up to ``timeout_ms`` for one and raises ``NVML_ERROR_TIMEOUT`` when none came, as NVML does.

Thread-safe: events are pushed from one thread and waited for on another.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

__all__ = ["FakeNVML", "FakeDevice", "FakeHandle", "NVLINK_FIELDS"]

#: The NVLink error totals, as nvmlDeviceGetFieldValues field ids.
NVLINK_FIELDS = (pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
                 pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL)

_MIB = 2**20


@dataclass(frozen=True)
class FakeHandle:
    index: int


@dataclass
class FakeDevice:
    """One fake GPU: the values NVML would answer (units as NVML answers them, except *_mib)."""

    index: int
    uuid: str = ""
    name: str = "NVIDIA H100 80GB HBM3"
    bus_id: str = ""
    util: int = 0
    mem_util: int = 0
    fb_total_mib: float = 81559.0
    fb_used_mib: float = 0.0
    temp: int = 30
    mem_temp: int = 35
    power_mw: int = 70_000
    energy_mj: int = 0
    sm_clock: int = 1980
    mem_clock: int = 2619
    clocks_event_reasons: int = 0
    #: (error type, counter type) -> count, e.g. (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)
    retired_sbe: list[int] = field(default_factory=list)
    retired_dbe: list[int] = field(default_factory=list)
    retired_pending: int = 0
    remapped_corr: int = 0
    remapped_unc: int = 0
    remap_pending: int = 0
    remap_failure: int = 0
    pcie_replay: int = 0
    nvlink: dict[int, int] = field(default_factory=lambda: {f: 0 for f in NVLINK_FIELDS})
    unsupported_fields: set[int] = field(default_factory=set)
    lost: bool = False

    def __post_init__(self) -> None:
        self.uuid = self.uuid or f"GPU-fake-{self.index:08x}-0000-0000-0000-000000000000"
        self.bus_id = self.bus_id or f"00000000:{0x18 + 0x10 * self.index:02X}:00.0"


class FakeNVML:
    """A pynvml-shaped module over :class:`FakeDevice` values. See the module docstring."""

    NVMLError = pynvml.NVMLError

    def __init__(self, num_gpus: int = 2) -> None:
        if num_gpus < 0:
            raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
        self.devices = [FakeDevice(i) for i in range(num_gpus)]
        self.init_error: int | None = None
        self.calls = 0
        self._initialised = False
        self._errors: dict[tuple[str, int | None], int] = {}
        self._cond = threading.Condition()
        self._events: deque[SimpleNamespace] = deque()
        self._registered: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        # pynvml's constants (NVML_ERROR_*, NVML_FI_*, nvmlEventType*, nvmlClocksEventReason*...)
        if name.startswith(("NVML_", "nvmlEventType", "nvmlClocks")):
            return getattr(pynvml, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (pynvml function not faked)")

    # ------------------------------------------------------------------ test controls

    def fail(self, function: str, code: int, gpu: int | None = None) -> None:
        self._errors[(function, gpu)] = code

    def heal(self, function: str, gpu: int | None = None) -> None:
        self._errors.pop((function, gpu), None)

    def push_xid(self, gpu: int, code: int, timestamp: float | None = None) -> None:
        with self._cond:
            if self._registered.get(gpu, 0) & pynvml.nvmlEventTypeXidCriticalError:
                ev = SimpleNamespace(device=FakeHandle(gpu), eventType=pynvml.nvmlEventTypeXidCriticalError,
                                     eventData=int(code), gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
                if timestamp is not None:
                    ev.timestamp = timestamp
                self._events.append(ev)
                self._cond.notify_all()

    # ------------------------------------------------------------------ plumbing

    @staticmethod
    def _raise(code: int) -> None:
        raise pynvml.NVMLError(code)

    def _check(self, function: str, index: int | None = None) -> None:
        self.calls += 1
        if not self._initialised:
            self._raise(pynvml.NVML_ERROR_UNINITIALIZED)
        code = self._errors.get((function, index), self._errors.get((function, None)))
        if code is not None:
            self._raise(code)

    def _dev(self, function: str, handle: Any) -> FakeDevice:
        if type(handle) is not FakeHandle or not 0 <= handle.index < len(self.devices):
            self._check(function)
            self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        dev = self.devices[handle.index]
        if dev.lost:
            self._check(function)
            self._raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        if self._errors or not self._initialised:
            self._check(function, handle.index)
        else:
            self.calls += 1
        self._refresh(dev)
        return dev

    def _refresh(self, dev: FakeDevice) -> None:
        """Hook for subclasses that move values with time (the simulated source)."""

    # ------------------------------------------------------------------ pynvml's functions

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            self._raise(self.init_error)
        self._initialised = True

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self._initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return "550.54.15 (fake)"

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._check("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.devices):
            self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(index)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._dev("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._dev("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetPciInfo(self, handle: Any) -> SimpleNamespace:
        d = self._dev("nvmlDeviceGetPciInfo", handle)
        return SimpleNamespace(busId=d.bus_id.encode(), busIdLegacy=d.bus_id[4:].encode(), domain=0,
                               bus=int(d.bus_id.split(":")[1], 16), device=0, pciDeviceId=0x233010DE)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        d = self._dev("nvmlDeviceGetUtilizationRates", handle)
        return pynvml.c_nvmlUtilization_t(int(d.util), int(d.mem_util))

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        d = self._dev("nvmlDeviceGetMemoryInfo", handle)
        total, used = int(d.fb_total_mib * _MIB), int(d.fb_used_mib * _MIB)
        return pynvml.c_nvmlMemory_t(total, total - used, used)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        d = self._dev("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(d.temp)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return int(self._dev("nvmlDeviceGetPowerUsage", handle).power_mw)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return int(self._dev("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj)

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:  # noqa: A002 (pynvml's name)
        d = self._dev("nvmlDeviceGetClockInfo", handle)
        if type == pynvml.NVML_CLOCK_SM:
            return int(d.sm_clock)
        if type == pynvml.NVML_CLOCK_MEM:
            return int(d.mem_clock)
        self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return int(self._dev("nvmlDeviceGetCurrentClocksEventReasons", handle).clocks_event_reasons)

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        d = self._dev("nvmlDeviceGetTotalEccErrors", handle)
        return int(d.ecc.get((errorType, counterType), 0))

    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int) -> list[int]:
        d = self._dev("nvmlDeviceGetRetiredPages", device)
        if sourceFilter == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR:
            return list(d.retired_dbe)
        return list(d.retired_sbe)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        return int(self._dev("nvmlDeviceGetRetiredPagesPendingStatus", device).retired_pending)

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        d = self._dev("nvmlDeviceGetRemappedRows", device)
        return (d.remapped_corr, d.remapped_unc, d.remap_pending, d.remap_failure)

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return int(self._dev("nvmlDeviceGetPcieReplayCounter", handle).pcie_replay)

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[int]) -> Any:
        d = self._dev("nvmlDeviceGetFieldValues", handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        now_us = int(time.time() * 1e6)
        for i, fid in enumerate(fieldIds):
            v = values[i]
            v.fieldId, v.timestamp = fid, now_us
            if fid in d.unsupported_fields:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            elif fid == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                v.valueType, v.value.uiVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, int(d.mem_temp)
            elif fid in d.nvlink:
                v.valueType, v.value.ullVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, int(d.nvlink[fid])
            else:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlEventSetCreate(self) -> object:
        self._check("nvmlEventSetCreate")
        return object()

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: object) -> None:
        d = self._dev("nvmlDeviceRegisterEvents", handle)
        with self._cond:
            self._registered[d.index] = self._registered.get(d.index, 0) | int(eventTypes)

    def nvmlEventSetWait_v2(self, eventSet: object, timeoutms: int) -> SimpleNamespace:
        self._check("nvmlEventSetWait_v2")
        with self._cond:
            if not self._events and timeoutms > 0:
                self._cond.wait(timeoutms / 1000.0)
            if self._events:
                return self._events.popleft()
        self._raise(pynvml.NVML_ERROR_TIMEOUT)

    nvmlEventSetWait = nvmlEventSetWait_v2

    def nvmlEventSetFree(self, eventSet: object) -> None:
        self._check("nvmlEventSetFree")
