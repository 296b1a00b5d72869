"""GPU collector over an NVML-like module: ``pynvml`` itself, :class:`FakeNVML` or the simulated source.

The hardware boundary is the ``nvml`` object given to :class:`GPUCollector`; it needs pynvml's
function names and signatures, ``NVMLError`` with ``.value`` and the ``NVML_*`` constants. The
collector only reads.

Every collect gives, per GPU, one ``Source.GPU`` sample (index = GPU index) tagged ``host``,
``gpu``, ``uuid``, ``pci_bus_id``, ``model``, with the DCGM-named fields of :data:`FIELDS`
(units as DCGM: %, MiB, C, W, mJ, MHz, counts). Errors are data, never crashes:

- a query the GPU answers ``NVML_ERROR_NOT_SUPPORTED`` (or the driver lacks:
  ``NVML_ERROR_FUNCTION_NOT_FOUND``) is logged once ("unsupported") and not asked again for that
  GPU; its fields are simply absent, as are field values answered not supported;
- a device that answers ``NVML_ERROR_GPU_IS_LOST`` gives ``{transom_gpu_lost: 1}`` and nothing else;
- any other NVML error (a driver error) leaves that query's fields out and sets
  ``transom_nvml_error`` = the NVML error code in the sample (logged once per query and code).

XID events: :meth:`start` registers an NVML event set and waits on it in its own thread
(``nvmlEventSetWait_v2`` with ``xid_wait_ms``); each XID is handed at once to ``emit`` as a sample
``{DCGM_FI_DEV_XID_ERRORS: code}`` with ``ts`` = when it was seen (or the event's ``timestamp``
where the source provides one), so the agent publishes it as it happens rather than as a
last-value gauge. Without :meth:`start` (a bare collector), :meth:`collect` drains pending events.

:func:`open_nvml` is the ``--gpu-source nvml`` path: the initialised ``pynvml`` module, or
``None`` after one log line when there is no driver.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from transom import contracts
from transom.contracts import DCGM
from transom.log import get

from .collectors import LogOnce

__all__ = ["GPUCollector", "GPUSettings", "open_nvml", "F", "FIELDS"]

log = get("agent.gpu")

_MIB = 2**20
_MAX_EVENTS = 1000  # per drain: a storm of events must not hold up the batch


class F:
    """DCGM field names this collector fills (contracts.DCGM holds the ones other components read)."""

    GPU_UTIL = DCGM.GPU_UTIL
    MEM_COPY_UTIL = DCGM.MEM_COPY_UTIL
    FB_USED = DCGM.FB_USED
    FB_FREE = DCGM.FB_FREE
    GPU_TEMP = DCGM.GPU_TEMP
    MEMORY_TEMP = DCGM.MEMORY_TEMP
    POWER_USAGE = DCGM.POWER_USAGE
    TOTAL_ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
    SM_CLOCK = DCGM.SM_CLOCK
    MEM_CLOCK = DCGM.MEM_CLOCK
    CLOCKS_EVENT_REASONS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
    ECC_SBE_VOL = DCGM.ECC_SBE_VOL_TOTAL
    ECC_DBE_VOL = DCGM.ECC_DBE_VOL_TOTAL
    ECC_SBE_AGG = "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"
    ECC_DBE_AGG = "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"
    RETIRED_SBE = "DCGM_FI_DEV_RETIRED_SBE"
    RETIRED_DBE = "DCGM_FI_DEV_RETIRED_DBE"
    RETIRED_PENDING = "DCGM_FI_DEV_RETIRED_PENDING"
    REMAPPED_COR = "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"
    REMAPPED_UNC = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
    ROW_REMAP_PENDING = "DCGM_FI_DEV_ROW_REMAP_PENDING"
    ROW_REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
    PCIE_REPLAY = "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"
    NVLINK_CRC_FLIT = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"
    NVLINK_CRC_DATA = "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"
    NVLINK_REPLAY = "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"
    NVLINK_RECOVERY = "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"
    XID = DCGM.XID_ERRORS
    GPU_LOST = DCGM.GPU_LOST
    NVML_ERROR = "transom_nvml_error"


#: Every metric field a healthy GPU that supports everything reports each collect.
FIELDS = tuple(v for k, v in vars(F).items() if k.isupper() and k not in ("XID", "GPU_LOST", "NVML_ERROR"))


@dataclass
class GPUSettings:
    """``[collectors.gpu]``"""

    #: milliseconds one wait for NVML events blocks (the XID thread's poll period)
    xid_wait_ms: int = 500


# nvmlFieldValue_t.valueType -> the member of its value union (NVML_VALUE_TYPE_DOUBLE = 0 ... UNSIGNED_SHORT = 6)
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


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
        log.warning("gpu source nvml: no usable NVIDIA driver (%s); running without GPU samples, the other "
                    "collectors go on (for a demo without GPUs use --gpu-source simulated)", exc)
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
    Settings = GPUSettings

    def __init__(self, nvml: Any, settings: GPUSettings | None = None, host: str | None = None) -> None:
        self.nvml = nvml
        self.settings = settings or GPUSettings()
        self._once = LogOnce(log)
        self._host = host or socket.gethostname()
        count = nvml.nvmlDeviceGetCount()
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._index = {_key(h): i for i, h in enumerate(self._handles)}
        self._tags = [self._device_tags(i, h) for i, h in enumerate(self._handles)]
        self._unsupported: set[tuple[int, str]] = set()
        n = nvml
        self._nvlink_ids = [n.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, n.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
                            n.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, n.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL]
        self._field_names = {n.NVML_FI_DEV_MEMORY_TEMP: F.MEMORY_TEMP, **dict(zip(self._nvlink_ids, (
            F.NVLINK_CRC_FLIT, F.NVLINK_CRC_DATA, F.NVLINK_REPLAY, F.NVLINK_RECOVERY)))}
        self._queries: list[tuple[str, Callable[[Any], dict[str, float]]]] = [
            ("utilization", self._utilization), ("memory", self._memory), ("temperature", self._temperature),
            ("power", self._power), ("energy", self._energy), ("sm clock", self._sm_clock),
            ("memory clock", self._mem_clock), ("clocks event reasons", self._reasons), ("ecc", self._ecc),
            ("retired pages", self._retired), ("remapped rows", self._remapped), ("pcie replay", self._pcie),
            ("field values", self._field_values),
        ]
        self._lock = threading.Lock()
        self._pending: list[contracts.Sample] = []
        self._emit: Callable[[list[contracts.Sample]], None] | None = None
        self._events = self._register_xid_events()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        log.info("gpu collector: %d device(s) (%s), XID events %s", count,
                 ", ".join(sorted({t["model"] for t in self._tags})) or "none",
                 "on" if self._events is not None else "off")

    @property
    def count(self) -> int:
        return len(self._handles)

    def _device_tags(self, i: int, h: Any) -> dict[str, str]:
        tags = {"host": self._host, "gpu": str(i)}
        for tag, query in (("uuid", lambda: _text(self.nvml.nvmlDeviceGetUUID(h))),
                           ("pci_bus_id", lambda: _text(self.nvml.nvmlDeviceGetPciInfo(h).busId)),
                           ("model", lambda: _text(self.nvml.nvmlDeviceGetName(h)))):
            try:
                tags[tag] = query()
            except self.nvml.NVMLError as exc:
                tags[tag] = "unknown"
                log.warning("gpu collector: GPU %d %s unknown (%s)", i, tag, exc)
        return tags

    # one NVML query each; units converted to DCGM's

    def _utilization(self, h: Any) -> dict[str, float]:
        u = self.nvml.nvmlDeviceGetUtilizationRates(h)
        return {F.GPU_UTIL: float(u.gpu), F.MEM_COPY_UTIL: float(u.memory)}

    def _memory(self, h: Any) -> dict[str, float]:
        m = self.nvml.nvmlDeviceGetMemoryInfo(h)
        return {F.FB_USED: m.used / _MIB, F.FB_FREE: m.free / _MIB}

    def _temperature(self, h: Any) -> dict[str, float]:
        return {F.GPU_TEMP: float(self.nvml.nvmlDeviceGetTemperature(h, self.nvml.NVML_TEMPERATURE_GPU))}

    def _power(self, h: Any) -> dict[str, float]:
        return {F.POWER_USAGE: self.nvml.nvmlDeviceGetPowerUsage(h) / 1000.0}  # NVML answers mW

    def _energy(self, h: Any) -> dict[str, float]:
        return {F.TOTAL_ENERGY: float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h))}  # mJ, as DCGM

    def _sm_clock(self, h: Any) -> dict[str, float]:
        return {F.SM_CLOCK: float(self.nvml.nvmlDeviceGetClockInfo(h, self.nvml.NVML_CLOCK_SM))}

    def _mem_clock(self, h: Any) -> dict[str, float]:
        return {F.MEM_CLOCK: float(self.nvml.nvmlDeviceGetClockInfo(h, self.nvml.NVML_CLOCK_MEM))}

    def _reasons(self, h: Any) -> dict[str, float]:
        n = self.nvml
        fn = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
        return {F.CLOCKS_EVENT_REASONS: float(fn(h))}

    def _ecc(self, h: Any) -> dict[str, float]:
        n = self.nvml
        get = n.nvmlDeviceGetTotalEccErrors
        cor, unc = n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return {F.ECC_SBE_VOL: float(get(h, cor, n.NVML_VOLATILE_ECC)), F.ECC_DBE_VOL: float(get(h, unc, n.NVML_VOLATILE_ECC)),
                F.ECC_SBE_AGG: float(get(h, cor, n.NVML_AGGREGATE_ECC)), F.ECC_DBE_AGG: float(get(h, unc, n.NVML_AGGREGATE_ECC))}

    def _retired(self, h: Any) -> dict[str, float]:
        n = self.nvml
        return {F.RETIRED_SBE: float(len(n.nvmlDeviceGetRetiredPages(h, n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS))),
                F.RETIRED_DBE: float(len(n.nvmlDeviceGetRetiredPages(h, n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))),
                F.RETIRED_PENDING: float(n.nvmlDeviceGetRetiredPagesPendingStatus(h))}

    def _remapped(self, h: Any) -> dict[str, float]:
        cor, unc, pending, failure = self.nvml.nvmlDeviceGetRemappedRows(h)
        return {F.REMAPPED_COR: float(cor), F.REMAPPED_UNC: float(unc),
                F.ROW_REMAP_PENDING: float(pending), F.ROW_REMAP_FAILURE: float(failure)}

    def _pcie(self, h: Any) -> dict[str, float]:
        return {F.PCIE_REPLAY: float(self.nvml.nvmlDeviceGetPcieReplayCounter(h))}

    def _field_values(self, h: Any) -> dict[str, float]:
        n = self.nvml
        ids = [n.NVML_FI_DEV_MEMORY_TEMP, *self._nvlink_ids]
        out = {}
        for v in n.nvmlDeviceGetFieldValues(h, ids):
            if v.nvmlReturn != n.NVML_SUCCESS:
                continue  # per-field NOT_SUPPORTED: absent (a GPU without NVLink, or without HBM sensor)
            member = _VALUE_MEMBER.get(v.valueType)
            if member is None:
                continue
            out[self._field_names[v.fieldId]] = float(getattr(v.value, member))
        return out

    # ------------------------------------------------------------------ XID events

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

    def _wait_one(self, timeout_ms: int) -> contracts.Sample | None | bool:
        """One event wait: a sample, ``None`` for a non-XID event, ``False`` when none came."""
        n = self.nvml
        try:
            data = n.nvmlEventSetWait_v2(self._events, timeout_ms)
        except n.NVMLError as exc:
            if exc.value != n.NVML_ERROR_TIMEOUT:
                self._once(("wait", exc.value), logging.WARNING, "gpu collector: waiting for XID events failed: %s", exc)
                if timeout_ms > 0:
                    time.sleep(timeout_ms / 1000.0)  # a broken event set must not spin
            return False
        if not data.eventType & n.nvmlEventTypeXidCriticalError:
            return None
        i = self._index.get(_key(data.device))
        ts = getattr(data, "timestamp", None) or time.time()
        log.warning("gpu collector: XID %d on GPU %s", int(data.eventData), i if i is not None else "?")
        return contracts.Sample(contracts.Source.GPU, {F.XID: int(data.eventData)}, index=i,
                                tags=self._tags[i] if i is not None else {"host": self._host}, ts=float(ts))

    def start(self, emit: Callable[[list[contracts.Sample]], None]) -> None:
        """Wait for XID events in a thread and hand each to ``emit`` as it happens."""
        self._emit = emit
        if self._events is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="transom-xid", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        wait = max(1, int(self.settings.xid_wait_ms))
        while not self._stop.is_set():
            got = self._wait_one(wait)
            if got and self._emit is not None:
                self._emit([got])

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _drain(self) -> list[contracts.Sample]:
        out = []
        if self._events is None or self._thread is not None:
            return out
        for _ in range(_MAX_EVENTS):
            got = self._wait_one(0)
            if got is False:
                break
            if got:
                out.append(got)
        return out

    # ------------------------------------------------------------------ the collect

    def _read(self, i: int, handle: Any) -> tuple[dict[str, float], bool]:
        """The device's metrics, and whether it is lost."""
        n = self.nvml
        fields: dict[str, float] = {}
        for what, query in self._queries:
            if (i, what) in self._unsupported:
                continue
            try:
                fields.update(query(handle))
            except n.NVMLError as exc:
                if exc.value == n.NVML_ERROR_GPU_IS_LOST:
                    return {}, True
                if exc.value in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_FUNCTION_NOT_FOUND):
                    self._unsupported.add((i, what))
                    log.info("gpu collector: GPU %d does not support %s; not asked again", i, what)
                    continue
                fields.setdefault(F.NVML_ERROR, float(exc.value))
                self._once(("query", i, what, exc.value), logging.WARNING,
                           "gpu collector: GPU %d %s query failed (%s); field left out, "
                           "transom_nvml_error=%d reported", i, what, exc, exc.value)
        return fields, False

    def collect(self) -> list[contracts.Sample]:
        gpu = contracts.Source.GPU
        samples = self._drain()
        for i, h in enumerate(self._handles):
            fields, lost = self._read(i, h)
            if lost:
                self._once(("lost", i), logging.ERROR, "gpu collector: GPU %d is lost (NVML_ERROR_GPU_IS_LOST)", i)
                samples.append(contracts.Sample(gpu, {F.GPU_LOST: 1}, index=i, tags=self._tags[i]))
            elif fields:
                samples.append(contracts.Sample(gpu, fields, index=i, tags=self._tags[i]))
        return samples

    def close(self) -> None:
        self.stop()
        if self._events is not None:
            try:
                self.nvml.nvmlEventSetFree(self._events)
            except Exception:  # best effort at shutdown
                pass
            self._events = None
