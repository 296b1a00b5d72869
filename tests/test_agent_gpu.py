"""GPU collector against FakeNVML (pynvml's names, signatures and error codes; there is no GPU here),
and the simulated source's fault scenario read through the same collector."""

from __future__ import annotations

import logging
import threading
import time

import pynvml
import pytest

from transom import contracts
from transom.agents.fakenvml import NVLINK_FIELDS, FakeHandle, FakeNVML
from transom.agents.gpu import FIELDS, F, GPUCollector, GPUSettings
from transom.agents.simulated import SimulatedGPUSource, SimulatedSysfs, load_scenario
from transom.config import ConfigError

UNC, COR = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED


def _fake(n: int = 2) -> FakeNVML:
    fake = FakeNVML(n)
    fake.nvmlInit()
    for d in fake.devices:
        d.util, d.mem_util, d.fb_used_mib, d.temp, d.mem_temp = 93, 41, 70000.0, 61, 68
        d.power_mw, d.energy_mj, d.sm_clock, d.mem_clock = 565_250, 123_456_789, 1980, 2619
    return fake


def _by_gpu(samples):
    return {s.index: s for s in samples if F.XID not in s.fields}


def test_fake_nvml_answers_with_pynvmls_error_classes_and_the_event_wait_timeout():
    fake = FakeNVML(1)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_NOT_SUPPORTED)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetPowerUsage(h)
    es = fake.nvmlEventSetCreate()
    t0 = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(es, 50)
    assert time.monotonic() - t0 >= 0.04  # it waited, as NVML does
    fake.devices[0].lost = True
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetMemoryInfo(h)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetMemoryInfo(FakeHandle(7))


def test_every_dcgm_field_with_units_and_tags(monkeypatch):
    fake = _fake(2)
    d = fake.devices[1]
    d.ecc = {(COR, pynvml.NVML_VOLATILE_ECC): 3, (UNC, pynvml.NVML_VOLATILE_ECC): 1,
             (COR, pynvml.NVML_AGGREGATE_ECC): 30, (UNC, pynvml.NVML_AGGREGATE_ECC): 2}
    d.retired_sbe, d.retired_dbe, d.retired_pending = [1, 2], [3], 1
    d.remapped_corr, d.remapped_unc, d.remap_pending, d.remap_failure = 4, 1, 1, 0
    d.pcie_replay, d.clocks_event_reasons = 17, pynvml.nvmlClocksEventReasonHwThermalSlowdown
    d.nvlink = {f: 10 * (i + 1) for i, f in enumerate(NVLINK_FIELDS)}
    gpu = GPUCollector(fake, host="node-a")
    s = _by_gpu(gpu.collect())
    assert set(s[0].fields) == set(FIELDS) == set(s[1].fields)
    f = s[1].fields
    assert (f[F.GPU_UTIL], f[F.MEM_COPY_UTIL], f[F.FB_USED], f[F.GPU_TEMP], f[F.MEMORY_TEMP]) == (93, 41, 70000.0, 61, 68)
    assert f[F.FB_FREE] == pytest.approx(81559 - 70000, abs=1)
    assert (f[F.POWER_USAGE], f[F.TOTAL_ENERGY], f[F.SM_CLOCK], f[F.MEM_CLOCK]) == (565.25, 123456789, 1980, 2619)
    assert (f[F.ECC_SBE_VOL], f[F.ECC_DBE_VOL], f[F.ECC_SBE_AGG], f[F.ECC_DBE_AGG]) == (3, 1, 30, 2)
    assert (f[F.RETIRED_SBE], f[F.RETIRED_DBE], f[F.RETIRED_PENDING]) == (2, 1, 1)
    assert (f[F.REMAPPED_COR], f[F.REMAPPED_UNC], f[F.ROW_REMAP_PENDING], f[F.ROW_REMAP_FAILURE]) == (4, 1, 1, 0)
    assert (f[F.PCIE_REPLAY], f[F.CLOCKS_EVENT_REASONS]) == (17, 64)
    assert [f[k] for k in (F.NVLINK_CRC_FLIT, F.NVLINK_CRC_DATA, F.NVLINK_REPLAY, F.NVLINK_RECOVERY)] == [10, 20, 30, 40]
    assert dict(s[1].tags) == {"host": "node-a", "gpu": "1", "uuid": d.uuid, "pci_bus_id": "00000000:28:00.0",
                               "model": "NVIDIA H100 80GB HBM3"}
    for sample in s.values():
        contracts.encode(sample)


def test_unsupported_is_said_once_and_not_asked_again(caplog):
    fake = _fake(2)
    fake.fail("nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=0)  # e.g. a pre-Ampere GPU
    fake.devices[0].unsupported_fields = {pynvml.NVML_FI_DEV_MEMORY_TEMP, *NVLINK_FIELDS}  # PCIe card, no HBM sensor
    gpu = GPUCollector(fake)
    with caplog.at_level(logging.INFO, logger="transom.agent.gpu"):
        samples = [_by_gpu(gpu.collect()) for _ in range(5)]
    calls = fake.calls
    gpu.collect()
    per_collect = fake.calls - calls
    missing = {F.REMAPPED_COR, F.REMAPPED_UNC, F.ROW_REMAP_PENDING, F.ROW_REMAP_FAILURE, F.MEMORY_TEMP,
               F.NVLINK_CRC_FLIT, F.NVLINK_CRC_DATA, F.NVLINK_REPLAY, F.NVLINK_RECOVERY}
    for s in samples:
        assert set(s[0].fields) == set(FIELDS) - missing and set(s[1].fields) == set(FIELDS)
        assert F.NVML_ERROR not in s[0].fields  # unsupported is not an error
    said = [r for r in caplog.records if "does not support" in r.getMessage()]
    assert len(said) == 1 and "GPU 0 does not support remapped rows" in said[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    fake.heal("nvmlDeviceGetRemappedRows", gpu=0)
    assert F.REMAPPED_COR not in _by_gpu(gpu.collect())[0].fields  # not asked again
    assert fake.calls - calls - per_collect == per_collect


def test_gpu_lost_and_driver_errors_are_signals_not_crashes(caplog):
    fake = _fake(3)
    gpu = GPUCollector(fake)
    fake.devices[1].lost = True
    fake.fail("nvmlDeviceGetTemperature", pynvml.NVML_ERROR_UNKNOWN, gpu=2)
    with caplog.at_level(logging.WARNING, logger="transom.agent.gpu"):
        for _ in range(3):
            s = _by_gpu(gpu.collect())
            assert dict(s[1].fields) == {F.GPU_LOST: 1} and s[1].tags["uuid"] == fake.devices[1].uuid
            assert s[2].fields[F.NVML_ERROR] == pynvml.NVML_ERROR_UNKNOWN and F.GPU_TEMP not in s[2].fields
            assert F.GPU_UTIL in s[2].fields and F.NVML_ERROR not in s[0].fields
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("GPU 1 is lost" in m for m in msgs) == 1 and sum("temperature query failed" in m for m in msgs) == 1


def test_xids_are_waited_for_in_a_thread_and_emitted_as_they_happen():
    fake = _fake(2)
    gpu = GPUCollector(fake, GPUSettings(xid_wait_ms=50))
    got: list[tuple[float, contracts.Sample]] = []
    arrived = threading.Event()

    def emit(samples):
        got.extend((time.time(), s) for s in samples)
        if len(got) >= 3:
            arrived.set()

    gpu.start(emit)
    try:
        t0 = time.time()
        for code in (48, 94, 79):
            fake.push_xid(1, code)
        assert arrived.wait(5)
    finally:
        gpu.close()
    assert [(s.index, dict(s.fields)) for _, s in got] == [(1, {F.XID: 48}), (1, {F.XID: 94}), (1, {F.XID: 79})]
    assert all(t0 <= s.ts <= when for when, s in got) and got[0][1].tags["gpu"] == "1"
    assert all(F.XID not in s.fields for s in gpu.collect())  # sent as events, not left for the next collect


def test_a_bare_collector_drains_xids_in_collect():
    fake = _fake(1)
    gpu = GPUCollector(fake)
    fake.push_xid(0, 63, timestamp=1234.5)
    xid = [s for s in gpu.collect() if F.XID in s.fields]
    assert [(s.index, dict(s.fields), s.ts) for s in xid] == [(0, {F.XID: 63}, 1234.5)]


def test_simulated_source_values_then_xid79_then_lost():
    src = SimulatedGPUSource(num_gpus=2, seed=7)
    src.nvmlInit()
    gpu = GPUCollector(src)
    for sample in gpu.collect():
        f = sample.fields
        assert 50 <= f[F.GPU_UTIL] <= 100 and 40 <= f[F.GPU_TEMP] <= 90 and f[F.MEMORY_TEMP] > f[F.GPU_TEMP]
        assert 300 <= f[F.POWER_USAGE] <= 700 and 60_000 <= f[F.FB_USED] <= 81_559
        assert f[F.SM_CLOCK] > 1500 and f[F.CLOCKS_EVENT_REASONS] == 0 and sample.tags["uuid"].startswith("GPU-sim-")
    ts = src.inject_xid(1, 79)
    first = gpu.collect()
    assert [(s.index, dict(s.fields), s.ts) for s in first if F.XID in s.fields] == [(1, {F.XID: 79}, ts)]
    assert [dict(s.fields) for s in first if s.index == 1 and F.XID not in s.fields] == [{F.GPU_LOST: 1}]
    with pytest.raises(ValueError, match="no GPU 5"):
        src.inject_xid(5, 79)


SCENARIO = """
[[fault]]
at = 0.0
kind = "thermal"
gpu = 0
duration = 30
[[fault]]
at = 0.0
kind = "straggler"
gpu = 1
factor = 0.5
[[fault]]
at = 0.0
kind = "ecc_dbe"
gpu = 2
count = 2
[[fault]]
at = 0.0
kind = "nvlink"
gpu = 3
count = 7
[[fault]]
at = 0.0
kind = "power"
gpu = 3
[[fault]]
at = 0.0
kind = "xid"
gpu = 2
code = 64
[[fault]]
at = 0.0
kind = "nic_flap"
device = "mlx5_1"
duration = 30
[[fault]]
at = 0.0
kind = "hang"
gpu = 1
"""


def test_scenario_faults_show_as_the_driver_would(tmp_path):
    path = tmp_path / "scenario.toml"
    path.write_text(SCENARIO)
    hung = []
    src = SimulatedGPUSource(4, seed=1, scenario=load_scenario(str(path), 4), on_hang=hung.append)
    src.nic = SimulatedSysfs(str(tmp_path / "sys"), seed=1)
    src.nvmlInit()
    gpu = GPUCollector(src)
    src._player.join(5)  # every fault is at 0 s
    assert len(src.played) == 8 and len(hung) == 1
    samples = gpu.collect()
    s = _by_gpu(samples)
    th, pc = pynvml.nvmlClocksEventReasonHwThermalSlowdown, pynvml.nvmlClocksEventReasonSwPowerCap
    assert int(s[0].fields[F.CLOCKS_EVENT_REASONS]) & th and s[0].fields[F.GPU_TEMP] >= 75 and s[0].fields[F.SM_CLOCK] < 1300
    assert s[1].fields[F.GPU_UTIL] == 100 and s[1].fields[F.POWER_USAGE] < 200   # hang: spinning at idle power
    assert s[2].fields[F.ECC_DBE_VOL] == 2 and s[2].fields[F.RETIRED_DBE] == 2 and s[2].fields[F.ROW_REMAP_FAILURE] == 1
    assert s[3].fields[F.NVLINK_CRC_FLIT] == 7 and int(s[3].fields[F.CLOCKS_EVENT_REASONS]) & pc
    assert s[3].fields[F.POWER_USAGE] <= 410
    assert sorted((x.index, x.fields[F.XID]) for x in samples if F.XID in x.fields) == [(2, 48), (2, 64)]
    src.nic.advance()
    state = (tmp_path / "sys" / "class/infiniband/mlx5_1/ports/1/state").read_text().strip()
    assert state == "1: DOWN" and (tmp_path / "sys" / "class/infiniband/mlx5_0/ports/1/state").read_text().strip() == "4: ACTIVE"
    src.nvmlShutdown()


def test_scenario_errors_name_the_fault_and_key(tmp_path):
    path = tmp_path / "bad.toml"
    for body, expected in [('[[fault]]\nat = 1\nkind = "meltdown"', "kind 'meltdown' is unknown; expected one of: xid"),
                           ('[[fault]]\nat = 1\nkind = "xid"\ncode = 13', "fault #1: xid 'code' must be one of 79, 48"),
                           ('[[fault]]\nat = 1\nkind = "thermal"\ngpu = 9', "'gpu' must be 0..3"),
                           ('[[fault]]\nat = 1\nkind = "thermal"\ncolour = 1', "unknown key 'colour'; valid keys: at, kind"),
                           ('[[fault]]\nkind = "thermal"', "'at' (seconds after start, >= 0) is required")]:
        path.write_text(body)
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            load_scenario(str(path), 4)
