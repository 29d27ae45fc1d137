"""NVML decoding: the pure functions from raw values, and the per-field guards of the raw reader."""

from __future__ import annotations

import types

import pynvml
import pytest

from mleng.machine import nvml


def test_throttle_mask_decodes_with_pynvmls_own_bits():
    mask = pynvml.nvmlClocksThrottleReasonHwSlowdown | pynvml.nvmlClocksThrottleReasonSwThermalSlowdown
    assert nvml.decode_clock_event_reasons(mask) == ["hw_slowdown", "sw_thermal_slowdown"]
    assert nvml.decode_clock_event_reasons(pynvml.nvmlClocksThrottleReasonSwPowerCap) == ["sw_power_cap"]
    assert nvml.decode_clock_event_reasons(pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown) == ["hw_power_brake"]
    assert nvml.decode_clock_event_reasons(pynvml.nvmlClocksThrottleReasonHwThermalSlowdown) == ["hw_thermal_slowdown"]
    assert nvml.decode_clock_event_reasons(pynvml.nvmlClocksThrottleReasonGpuIdle) == ["gpu_idle"]
    assert nvml.decode_clock_event_reasons(0) == []
    assert nvml.decode_clock_event_reasons(None) is None


def test_every_bit_of_nvmls_all_mask_has_a_name():
    names = nvml.decode_clock_event_reasons(pynvml.nvmlClocksThrottleReasonAll)
    assert not [n for n in names if n.startswith("unknown_")]
    assert len(names) == len(set(names)) >= 9


def test_unknown_bits_are_kept_not_dropped():
    assert nvml.decode_clock_event_reasons(0x4 | (1 << 40)) == ["sw_power_cap", "unknown_0x10000000000"]


def test_slowdown_and_fault_reasons():
    reasons = ["gpu_idle", "sw_power_cap", "hw_slowdown", "sw_thermal_slowdown"]
    assert nvml.slowdown_reasons(reasons) == ["sw_power_cap", "hw_slowdown", "sw_thermal_slowdown"]
    assert "sw_power_cap" not in nvml.FAULT_REASONS and "hw_slowdown" in nvml.FAULT_REASONS
    assert nvml.slowdown_reasons(None) == []


def test_pcie_link_check():
    healthy = nvml.pcie_link_check(5, 5, 16, 16)
    assert healthy == {"gen_ok": True, "width_ok": True, "degraded": False, "link": "Gen5 x16", "link_max": "Gen5 x16"}
    downtrained = nvml.pcie_link_check(4, 5, 8, 16)
    assert downtrained["gen_ok"] is False and downtrained["width_ok"] is False and downtrained["degraded"] is True
    assert downtrained["link"] == "Gen4 x8"
    narrow_only = nvml.pcie_link_check(5, 5, 8, 16)
    assert narrow_only["gen_ok"] is True and narrow_only["width_ok"] is False and narrow_only["degraded"]
    unknown = nvml.pcie_link_check(None, 5, 16, None)
    assert unknown["gen_ok"] is None and unknown["width_ok"] is None and unknown["degraded"] is False


def test_nvlink_summary():
    links = [{"link": i, "state": "active"} for i in range(18)]
    links[7]["state"] = "inactive"
    assert nvml.nvlink_summary(links) == {"total": 18, "active": 17, "inactive": [7]}
    assert nvml.nvlink_summary([]) == {"total": 0, "active": 0, "inactive": []}


def test_nvlink_version_names_follow_pynvml():
    assert nvml.nvlink_version_name(pynvml.NVML_NVLINK_VERSION_4_0) == "4.0"
    assert nvml.nvlink_version_name(pynvml.NVML_NVLINK_VERSION_3_1) == "3.1"
    assert nvml.nvlink_version_name(None) is None
    assert nvml.nvlink_version_name(0) is None


def test_affinity_words_to_cpulist():
    # DGX-like: CPUs 0-55 and 112-167 over four 64-bit words
    cpus = set(range(0, 56)) | set(range(112, 168))
    words = [sum(1 << (c - 64 * w) for c in cpus if 64 * w <= c < 64 * (w + 1)) for w in range(4)]
    assert nvml.affinity_words_to_cpulist(words) == "0-55,112-167"
    assert nvml.affinity_words_to_cpulist([0b1011]) == "0-1,3"
    assert nvml.affinity_words_to_cpulist([0, 0]) is None
    assert nvml.affinity_words_to_cpulist(None) is None


def test_sysfs_pci_address_and_versions():
    assert nvml.sysfs_pci_address("00000000:1B:00.0") == "0000:1b:00.0"
    assert nvml.sysfs_pci_address("00000001:DB:00.0") == "0001:db:00.0"
    assert nvml.sysfs_pci_address("nonsense") is None
    assert nvml.cuda_version_string(12080) == "12.8"
    assert nvml.cuda_version_string(13000) == "13.0"
    assert nvml.milliwatts_to_watts(691412) == 691.4


def _raw_h200() -> dict:
    # values as NVML returned them on a real H200 under load (see tests/fixtures/fingerprints/generate.py)
    return {
        "index": 0, "name": "NVIDIA H200", "uuid": "GPU-a54501c3-ceb6-c46e-d804-da551b02746d",
        "serial": "1653724024756", "pci_bus_id": "00000000:18:00.0", "compute_capability": [9, 0],
        "vbios": "96.00.A5.00.1A", "driver": "580.159.04", "persistence_mode": 1, "mig_mode": 0,
        "memory_total": 150754820096, "memory_used": 1839071232, "utilization_gpu": 100, "utilization_memory": 40,
        "sm_clock": 1500, "sm_clock_max": 1980, "mem_clock": 3201, "mem_clock_max": 3201,
        "power_usage_mw": 691412, "power_limit_mw": 700000, "power_default_limit_mw": 700000,
        "temperature": 54, "temperature_slowdown": 89, "clock_event_reasons_mask": 4,
        "ecc_mode": [1, 1], "ecc_volatile_corrected": 0, "ecc_volatile_uncorrected": 2,
        "ecc_aggregate_corrected": 3, "ecc_aggregate_uncorrected": 2,
        "retired_pages_single_bit": None, "retired_pages_double_bit": None,
        "remapped_rows": [0, 2, 1, 0],
        "pcie_gen": 4, "pcie_gen_max": 5, "pcie_gen_gpu_max": 5, "pcie_width": 8, "pcie_width_max": 16,
        "nvlink_states": {"0": 1, "1": 0, "2": 1}, "nvlink_versions": {"0": 6, "1": 6, "2": 6},
        "numa_node": None, "cpu_affinity_words": [0xFFFF], "sysfs_numa_node": 1, "sysfs_local_cpulist": "0-15",
        "unreadable": {"serial": "Insufficient Permissions"},
    }


def test_device_from_raw_builds_the_record():
    device = nvml.device_from_raw(_raw_h200())
    assert device["power_draw_w"] == 691.4 and device["power_limit_w"] == 700.0
    assert device["throttle_reasons"] == ["sw_power_cap"] and device["throttle_reasons_mask"] == 4
    assert device["compute_capability"] == "9.0"
    assert device["persistence_mode"] is True and device["mig_mode"] is False
    assert device["ecc_mode_enabled"] is True
    assert device["ecc_errors"] == {"volatile_corrected": 0, "volatile_uncorrected": 2,
                                    "aggregate_corrected": 3, "aggregate_uncorrected": 2}
    assert device["retired_pages"] is None
    assert device["remapped_rows"] == {"correctable": 0, "uncorrectable": 2, "pending": True, "failure": False}
    assert device["nvlinks"] == [
        {"link": 0, "state": "active", "version": 6, "version_name": "4.0"},
        {"link": 1, "state": "inactive", "version": 6, "version_name": "4.0"},
        {"link": 2, "state": "active", "version": 6, "version_name": "4.0"}]
    # NVML had no NUMA node: the sysfs one is used; the affinity comes from NVML's mask
    assert device["numa_node"] == 1 and device["cpu_affinity"] == "0-15"
    assert device["unreadable"] == {"serial": "Insufficient Permissions"}
    assert nvml.pcie_link_check(device["pcie_gen"], device["pcie_gen_max"],
                                device["pcie_width"], device["pcie_width_max"])["degraded"] is True


def test_device_from_raw_with_nothing_readable_is_all_none():
    device = nvml.device_from_raw({"index": 3})
    assert device["index"] == 3
    assert device["throttle_reasons"] is None and device["nvlinks"] == [] and device["remapped_rows"] is None
    assert device["ecc_errors"] == {"volatile_corrected": None, "volatile_uncorrected": None,
                                    "aggregate_corrected": None, "aggregate_uncorrected": None}
    assert device["retired_pages"] is None and device["unreadable"] == {}


def test_retired_pages_on_pre_hopper_gpus():
    device = nvml.device_from_raw({"retired_pages_single_bit": 0, "retired_pages_double_bit": 3,
                                   "retired_pages_pending": 1})
    assert device["retired_pages"] == {"single_bit_ecc": 0, "double_bit_ecc": 3, "pending": True}


def test_collect_gpus_here_says_why_there_are_none():
    section = nvml.collect_gpus()
    assert section["available"] is False and section["devices"] == [] and section["count"] == 0
    assert section["reason"] == "NVML Shared Library Not Found (no NVIDIA driver on this machine)"


def test_init_failure_reasons():
    assert nvml.init_failure_reason(pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)) == \
        "Driver Not Loaded (the NVIDIA kernel module is not loaded)"
    assert nvml.init_failure_reason(pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)) == "Unknown Error"


def _stand_in_pynvml(failures: dict[str, int]) -> types.SimpleNamespace:
    """The real pynvml module's constants and error classes, with device calls answering like one GPU.

    There is no NVIDIA driver on this machine, so the driver side is played here; every error raised is
    pynvml's own NVMLError built from NVML's error code. `failures` maps function name -> NVML error code.
    """
    answers = {
        "nvmlDeviceGetName": b"NVIDIA H200", "nvmlDeviceGetUUID": "GPU-1", "nvmlDeviceGetSerial": "1653",
        "nvmlDeviceGetPciInfo": types.SimpleNamespace(busId=b"00000000:18:00.0"),
        "nvmlDeviceGetCudaComputeCapability": (9, 0), "nvmlDeviceGetVbiosVersion": "96.00.A5.00.1A",
        "nvmlDeviceGetPersistenceMode": 1, "nvmlDeviceGetMigMode": [0, 0],
        "nvmlDeviceGetMemoryInfo": types.SimpleNamespace(total=150754820096, used=648347648),
        "nvmlDeviceGetUtilizationRates": types.SimpleNamespace(gpu=0, memory=0),
        "nvmlDeviceGetClockInfo": 345, "nvmlDeviceGetMaxClockInfo": 1980, "nvmlDeviceGetPowerUsage": 77200,
        "nvmlDeviceGetEnforcedPowerLimit": 700000, "nvmlDeviceGetPowerManagementDefaultLimit": 700000,
        "nvmlDeviceGetTemperature": 30, "nvmlDeviceGetTemperatureThreshold": 89,
        "nvmlDeviceGetCurrentClocksEventReasons": 1, "nvmlDeviceGetCurrentClocksThrottleReasons": 1,
        "nvmlDeviceGetEccMode": [1, 1], "nvmlDeviceGetTotalEccErrors": 0, "nvmlDeviceGetRetiredPages": [],
        "nvmlDeviceGetRetiredPagesPendingStatus": 0, "nvmlDeviceGetRemappedRows": (0, 0, 0, 0),
        "nvmlDeviceGetCurrPcieLinkGeneration": 5, "nvmlDeviceGetMaxPcieLinkGeneration": 5,
        "nvmlDeviceGetGpuMaxPcieLinkGeneration": 5, "nvmlDeviceGetCurrPcieLinkWidth": 16,
        "nvmlDeviceGetMaxPcieLinkWidth": 16, "nvmlDeviceGetNumaNodeId": 0, "nvmlDeviceGetCpuAffinity": [0b11],
        "nvmlDeviceGetPcieReplayCounter": 0, "nvmlDeviceGetApplicationsClock": 1980,
        "nvmlDeviceGetDefaultApplicationsClock": 1980,
    }
    module = types.SimpleNamespace(**{name: getattr(pynvml, name) for name in dir(pynvml)
                                      if name.startswith(("NVML_", "NVMLError", "nvmlClocks"))})

    def answer(name):
        def call(handle, *args):
            if name in failures:
                raise pynvml.NVMLError(failures[name])
            return answers[name]
        return call

    for name in answers:
        setattr(module, name, answer(name))
    module.nvmlDeviceGetHandleByIndex = lambda index: object()

    def link_state(handle, link):
        if link >= 2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 1

    module.nvmlDeviceGetNvLinkState = link_state
    module.nvmlDeviceGetNvLinkVersion = lambda handle, link: pynvml.NVML_NVLINK_VERSION_4_0
    return module


def test_each_nvml_field_is_guarded():
    fake = _stand_in_pynvml({
        "nvmlDeviceGetSerial": pynvml.NVML_ERROR_NO_PERMISSION,
        "nvmlDeviceGetRetiredPages": pynvml.NVML_ERROR_NOT_SUPPORTED,
        "nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_GPU_IS_LOST,
        "nvmlDeviceGetNumaNodeId": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    })
    del fake.nvmlDeviceGetGpuMaxPcieLinkGeneration  # an older pynvml without this call
    device = nvml.device_from_raw(nvml.read_device_raw(fake, 0, cpu_count=2))
    assert device["name"] == "NVIDIA H200" and device["pci_bus_id"] == "00000000:18:00.0"
    assert device["serial"] is None and device["power_draw_w"] is None and device["retired_pages"] is None
    assert device["pcie_gen_gpu_max"] is None
    # Not Supported is silent; the rest say why
    assert set(device["unreadable"]) == {"serial", "power_draw", "numa_node", "pcie_gen_gpu_max"}
    assert device["unreadable"]["serial"] == "Insufficient Permissions"
    assert device["unreadable"]["power_draw"] == "GPU is lost"
    assert device["throttle_reasons"] == ["gpu_idle"]
    assert device["nvlinks"] == [{"link": 0, "state": "active", "version": 6, "version_name": "4.0"},
                                 {"link": 1, "state": "active", "version": 6, "version_name": "4.0"}]
    assert device["cpu_affinity"] == "0-1"
    assert device["memory_total_bytes"] == 150754820096 and device["sm_clock_max_mhz"] == 1980


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_UNKNOWN])
def test_unreadable_ecc_mode_skips_the_counters(code):
    fake = _stand_in_pynvml({"nvmlDeviceGetEccMode": code})
    device = nvml.device_from_raw(nvml.read_device_raw(fake, 0, cpu_count=2))
    assert device["ecc_mode_enabled"] is None
    assert set(device["ecc_errors"].values()) == {None}
    assert ("ecc_mode" in device["unreadable"]) == (code != pynvml.NVML_ERROR_NOT_SUPPORTED)
