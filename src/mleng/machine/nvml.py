"""GPUs through NVML: raw reads guarded call by call, and pure functions that turn raw values into the record.

The split matters: `read_device_raw` is the only code that talks to the driver; everything it returns
is a plain JSON-able value, and `device_from_raw` plus the decoders below are pure, so the doctor and
the tests can run them on recorded or hand-made values on a machine without a GPU.
pynvml is imported inside functions only: importing this module stays cheap.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterable

from mleng.machine.system import format_cpulist, pci_sysfs_info

# (name in the record, pynvml constant suffix). Looked up in pynvml at call time, newest spelling
# first (nvmlClocksEventReason*, then the older nvmlClocksThrottleReason*), so the bit values are
# NVML's own and not copied here.
_CLOCK_EVENT_REASONS = (
    ("gpu_idle", "GpuIdle"),
    ("applications_clocks_setting", "ApplicationsClocksSetting"),
    ("sw_power_cap", "SwPowerCap"),
    ("hw_slowdown", "HwSlowdown"),
    ("sync_boost", "SyncBoost"),
    ("sw_thermal_slowdown", "SwThermalSlowdown"),
    ("hw_thermal_slowdown", "HwThermalSlowdown"),
    ("hw_power_brake", "HwPowerBrakeSlowdown"),
    ("display_clock_setting", "DisplayClockSetting"),
    ("board_limit", "BoardLimit"),
    ("reliability", "Reliability"),
)

# Reasons that mean the SM clock is below what the card could run at: the doctor's throttling check.
# gpu_idle, applications_clocks_setting, sync_boost and display_clock_setting are not slowdowns.
SLOWDOWN_REASONS = frozenset({
    "sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake",
    "board_limit", "reliability",
})

# The slowdowns that point at cooling or power delivery. sw_power_cap alone is the normal state of a
# busy H100/H200 at its power limit (measured: an H200 under a bf16 matmul loop ran at 1500 MHz,
# 691 W of 700 W, reason sw_power_cap); it is a fault only when the limit was lowered.
FAULT_REASONS = frozenset({"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake"})

NO_DRIVER_HINT = {
    # NVML error value -> what it means on a real machine
    12: "no NVIDIA driver on this machine",          # NVML_ERROR_LIBRARY_NOT_FOUND
    9: "the NVIDIA kernel module is not loaded",      # NVML_ERROR_DRIVER_NOT_LOADED
    18: "driver and NVML library versions differ; reboot or reload the driver",  # LIB_RM_VERSION_MISMATCH
    4: "not allowed to open the NVIDIA devices",      # NVML_ERROR_NO_PERMISSION
}

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_INVALID_ARGUMENT = 2


def clock_event_reason_bits() -> list[tuple[str, int]]:
    """(name, bit) for every clock event (throttle) reason this pynvml knows."""
    import pynvml

    bits = []
    for name, suffix in _CLOCK_EVENT_REASONS:
        value = getattr(pynvml, f"nvmlClocksEventReason{suffix}", None)
        if value is None:
            value = getattr(pynvml, f"nvmlClocksThrottleReason{suffix}", None)
        if value:
            bits.append((name, int(value)))
    return bits


def decode_clock_event_reasons(mask: int | None) -> list[str] | None:
    """NVML's clock event (throttle) reason bitmask -> names; unknown bits as 'unknown_0x...'."""
    if mask is None:
        return None
    names = []
    known = 0
    for name, bit in clock_event_reason_bits():
        known |= bit
        if mask & bit:
            names.append(name)
    leftover = mask & ~known
    if leftover:
        names.append(f"unknown_{leftover:#x}")
    return names


def slowdown_reasons(reasons: Iterable[str] | None) -> list[str]:
    """The subset of decoded reasons that actually lower clocks."""
    return [r for r in (reasons or []) if r in SLOWDOWN_REASONS]


def pcie_link_check(gen: int | None, gen_max: int | None,
                    width: int | None, width_max: int | None) -> dict[str, Any]:
    """Current PCIe link against the link's maximum.

    A narrower width than max is a hardware problem (bad seating, riser, cable). A lower
    generation is only a problem under load: GPUs drop the link to Gen1 when idle to save power,
    so `gen_ok` False at idle is expected and the caller must look at utilization.
    """
    gen_ok = None if gen is None or gen_max is None else gen >= gen_max
    width_ok = None if width is None or width_max is None else width >= width_max
    return {
        "gen_ok": gen_ok,
        "width_ok": width_ok,
        "degraded": (gen_ok is False) or (width_ok is False),
        "link": f"Gen{gen} x{width}" if gen is not None and width is not None else None,
        "link_max": f"Gen{gen_max} x{width_max}" if gen_max is not None and width_max is not None else None,
    }


def nvlink_summary(nvlinks: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Counts of active links and the ids of the inactive ones."""
    nvlinks = nvlinks or []
    inactive = [link["link"] for link in nvlinks if link.get("state") != "active"]
    return {"total": len(nvlinks), "active": len(nvlinks) - len(inactive), "inactive": inactive}


def nvlink_version_name(version: int | None) -> str | None:
    """NVML's nvmlNvlinkVersion_t value -> '4.0' (6 is NVLink 4.0, Hopper), from pynvml's own constants."""
    if version is None:
        return None
    import pynvml

    for attr in dir(pynvml):
        if attr.startswith("NVML_NVLINK_VERSION_") and attr != "NVML_NVLINK_VERSION_INVALID" \
                and getattr(pynvml, attr) == version:
            return attr[len("NVML_NVLINK_VERSION_"):].replace("_", ".")
    return None


def affinity_words_to_cpulist(words: Iterable[int] | None, word_bits: int = 64) -> str | None:
    """NVML's CPU affinity (an array of 64-bit masks, CPU 0 in bit 0 of word 0) -> '0-55,112-167'."""
    if words is None:
        return None
    cpus = [index * word_bits + bit
            for index, word in enumerate(words)
            for bit in range(word_bits) if (int(word) >> bit) & 1]
    return format_cpulist(cpus) if cpus else None


def sysfs_pci_address(nvml_bus_id: str | None) -> str | None:
    """NVML '00000000:18:00.0' -> sysfs '0000:18:00.0' (4-digit domain, lower case)."""
    if not nvml_bus_id:
        return None
    parts = nvml_bus_id.strip().lower().split(":")
    if len(parts) != 3:
        return None
    domain, bus, devfn = parts
    try:
        return f"{int(domain, 16):04x}:{bus}:{devfn}"
    except ValueError:
        return None


def cuda_version_string(version: int | None) -> str | None:
    """NVML/CUDA integer versions: 12080 -> '12.8'."""
    if not version:
        return None
    return f"{version // 1000}.{(version % 1000) // 10}"


def milliwatts_to_watts(value: int | None) -> float | None:
    return None if value is None else round(value / 1000.0, 1)


def device_from_raw(raw: dict[str, Any]) -> dict[str, Any]:
    """The per-GPU record from the raw values `read_device_raw` returns (all pure arithmetic)."""
    mask = raw.get("clock_event_reasons_mask")
    ecc_mode = raw.get("ecc_mode")
    remapped = raw.get("remapped_rows")
    retired_single = raw.get("retired_pages_single_bit")
    retired_double = raw.get("retired_pages_double_bit")
    if retired_single is None and retired_double is None:
        retired = None  # Hopper and later replace page retirement by row remapping
    else:
        retired = {"single_bit_ecc": retired_single, "double_bit_ecc": retired_double,
                   "pending": _as_bool(raw.get("retired_pages_pending"))}
    numa_node = raw.get("numa_node")
    if numa_node is None or numa_node < 0:
        numa_node = raw.get("sysfs_numa_node")
    cpu_affinity = affinity_words_to_cpulist(raw.get("cpu_affinity_words")) or raw.get("sysfs_local_cpulist")
    capability = raw.get("compute_capability")
    nvlinks = [
        {"link": link, "state": "active" if state == 1 else "inactive",
         "version": (raw.get("nvlink_versions") or {}).get(str(link)),
         "version_name": nvlink_version_name((raw.get("nvlink_versions") or {}).get(str(link)))}
        for link, state in sorted(((int(k), v) for k, v in (raw.get("nvlink_states") or {}).items()))
    ]
    return {
        "index": raw.get("index"),
        "name": raw.get("name"),
        "uuid": raw.get("uuid"),
        "serial": raw.get("serial"),
        "pci_bus_id": raw.get("pci_bus_id"),
        "compute_capability": f"{capability[0]}.{capability[1]}" if capability else None,
        "vbios": raw.get("vbios"),
        "driver": raw.get("driver"),
        "persistence_mode": _as_bool(raw.get("persistence_mode")),
        "mig_mode": _as_bool(raw.get("mig_mode")),
        "memory_total_bytes": raw.get("memory_total"),
        "memory_used_bytes": raw.get("memory_used"),
        "utilization_gpu_pct": raw.get("utilization_gpu"),
        "utilization_memory_pct": raw.get("utilization_memory"),
        "sm_clock_mhz": raw.get("sm_clock"),
        "sm_clock_max_mhz": raw.get("sm_clock_max"),
        "mem_clock_mhz": raw.get("mem_clock"),
        "mem_clock_max_mhz": raw.get("mem_clock_max"),
        "power_draw_w": milliwatts_to_watts(raw.get("power_usage_mw")),
        "power_limit_w": milliwatts_to_watts(raw.get("power_limit_mw")),
        "power_default_limit_w": milliwatts_to_watts(raw.get("power_default_limit_mw")),
        "temperature_c": raw.get("temperature"),
        "temperature_slowdown_c": raw.get("temperature_slowdown"),
        "throttle_reasons": decode_clock_event_reasons(mask),
        "throttle_reasons_mask": mask,
        "ecc_mode_enabled": _as_bool(ecc_mode[0]) if ecc_mode else None,
        # the mode after the next reboot: differing from the current one means a change is waiting
        "ecc_mode_pending": _as_bool(ecc_mode[1]) if ecc_mode and len(ecc_mode) > 1 else None,
        "ecc_errors": {
            "volatile_corrected": raw.get("ecc_volatile_corrected"),
            "volatile_uncorrected": raw.get("ecc_volatile_uncorrected"),
            "aggregate_corrected": raw.get("ecc_aggregate_corrected"),
            "aggregate_uncorrected": raw.get("ecc_aggregate_uncorrected"),
        },
        "retired_pages": retired,
        "remapped_rows": None if remapped is None else {
            "correctable": remapped[0], "uncorrectable": remapped[1],
            "pending": _as_bool(remapped[2]), "failure": _as_bool(remapped[3]),
        },
        "pcie_gen": raw.get("pcie_gen"),
        "pcie_gen_max": raw.get("pcie_gen_max"),
        "pcie_gen_gpu_max": raw.get("pcie_gen_gpu_max"),
        "pcie_width": raw.get("pcie_width"),
        "pcie_width_max": raw.get("pcie_width_max"),
        "pcie_replay_count": raw.get("pcie_replay_count"),
        "nvlinks": nvlinks,
        "nvlink_errors": nvlink_errors_from_raw(raw.get("nvlink_errors")),
        "applications_clocks": None if not any(raw.get(k) is not None for k in _APP_CLOCK_KEYS) else {
            "sm_mhz": raw.get("app_clock_sm"), "sm_default_mhz": raw.get("app_clock_sm_default"),
            "mem_mhz": raw.get("app_clock_mem"), "mem_default_mhz": raw.get("app_clock_mem_default")},
        "fabric": fabric_from_raw(raw.get("fabric_state"), raw.get("fabric_status")),
        "numa_node": numa_node,
        "cpu_affinity": cpu_affinity,
        "unreadable": dict(raw.get("unreadable") or {}),
    }


# (name in the record, pynvml constant): NVLink data-link-layer error counters, per link, since the driver loaded
NVLINK_ERROR_COUNTERS = (("replay", "NVML_NVLINK_ERROR_DL_REPLAY"), ("recovery", "NVML_NVLINK_ERROR_DL_RECOVERY"),
                         ("crc_flit", "NVML_NVLINK_ERROR_DL_CRC_FLIT"), ("crc_data", "NVML_NVLINK_ERROR_DL_CRC_DATA"))
_APP_CLOCK_KEYS = ("app_clock_sm", "app_clock_sm_default", "app_clock_mem", "app_clock_mem_default")
FABRIC_STATES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}


def nvlink_errors_from_raw(raw: dict[str, dict[str, int | None]] | None) -> dict[str, Any] | None:
    """{link: {replay, recovery, crc_flit, crc_data}} -> the same per link plus the totals over links."""
    if not raw:
        return None
    links = {str(link): dict(counters) for link, counters in sorted(raw.items(), key=lambda kv: int(kv[0]))}
    totals = {}
    for name, _constant in NVLINK_ERROR_COUNTERS:
        values = [c.get(name) for c in links.values() if c.get(name) is not None]
        totals[name] = sum(values) if values else None
    return {"per_link": links, "total": totals}


def fabric_from_raw(state: int | None, status: int | None) -> dict[str, Any] | None:
    """NVML's GPU fabric info (NVSwitch systems): registration state with Fabric Manager and its result code."""
    if state is None:
        return None
    return {"state": FABRIC_STATES.get(state, f"unknown_{state}"), "status": status,
            "status_ok": None if status is None else status == 0}


def _as_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


def _text(value: Any) -> Any:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def read_device_raw(pynvml: Any, index: int, cpu_count: int | None = None) -> dict[str, Any]:
    """Every raw NVML value of one GPU; a field that cannot be read is None (reason in 'unreadable')."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    unreadable: dict[str, str] = {}
    raw: dict[str, Any] = {"index": index, "unreadable": unreadable}

    def get(field: str, function_name: str, *args: Any) -> Any:
        try:
            return _text(getattr(pynvml, function_name)(handle, *args))
        except pynvml.NVMLError as exc:
            # Not Supported is normal (a feature this GPU lacks); anything else is worth showing
            if exc.value not in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT):
                unreadable[field] = str(exc)
            return None
        except (AttributeError, TypeError, ValueError, OSError) as exc:
            # an older pynvml without this function, or a driver returning junk
            unreadable[field] = f"{type(exc).__name__}: {exc}"
            return None

    raw["name"] = get("name", "nvmlDeviceGetName")
    raw["uuid"] = get("uuid", "nvmlDeviceGetUUID")
    raw["serial"] = get("serial", "nvmlDeviceGetSerial")
    pci = get("pci_bus_id", "nvmlDeviceGetPciInfo")
    raw["pci_bus_id"] = _text(getattr(pci, "busId", None)) if pci is not None else None
    raw["compute_capability"] = get("compute_capability", "nvmlDeviceGetCudaComputeCapability")
    raw["vbios"] = get("vbios", "nvmlDeviceGetVbiosVersion")
    raw["persistence_mode"] = get("persistence_mode", "nvmlDeviceGetPersistenceMode")
    mig = get("mig_mode", "nvmlDeviceGetMigMode")
    raw["mig_mode"] = mig[0] if mig else None

    memory = get("memory", "nvmlDeviceGetMemoryInfo")
    raw["memory_total"] = int(memory.total) if memory is not None else None
    raw["memory_used"] = int(memory.used) if memory is not None else None
    utilization = get("utilization", "nvmlDeviceGetUtilizationRates")
    raw["utilization_gpu"] = int(utilization.gpu) if utilization is not None else None
    raw["utilization_memory"] = int(utilization.memory) if utilization is not None else None

    raw["sm_clock"] = get("sm_clock", "nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_SM)
    raw["sm_clock_max"] = get("sm_clock_max", "nvmlDeviceGetMaxClockInfo", pynvml.NVML_CLOCK_SM)
    raw["mem_clock"] = get("mem_clock", "nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_MEM)
    raw["mem_clock_max"] = get("mem_clock_max", "nvmlDeviceGetMaxClockInfo", pynvml.NVML_CLOCK_MEM)

    raw["power_usage_mw"] = get("power_draw", "nvmlDeviceGetPowerUsage")
    raw["power_limit_mw"] = get("power_limit", "nvmlDeviceGetEnforcedPowerLimit")
    raw["power_default_limit_mw"] = get("power_default_limit", "nvmlDeviceGetPowerManagementDefaultLimit")
    raw["temperature"] = get("temperature", "nvmlDeviceGetTemperature", pynvml.NVML_TEMPERATURE_GPU)
    raw["temperature_slowdown"] = get("temperature_slowdown", "nvmlDeviceGetTemperatureThreshold",
                                      pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    reasons_fn = ("nvmlDeviceGetCurrentClocksEventReasons"
                  if hasattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons")
                  else "nvmlDeviceGetCurrentClocksThrottleReasons")
    raw["clock_event_reasons_mask"] = get("throttle_reasons", reasons_fn)

    raw["ecc_mode"] = get("ecc_mode", "nvmlDeviceGetEccMode")
    if raw["ecc_mode"] is not None:
        for counter_name, counter in (("volatile", pynvml.NVML_VOLATILE_ECC),
                                      ("aggregate", pynvml.NVML_AGGREGATE_ECC)):
            for error_name, error_type in (("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                           ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
                field = f"ecc_{counter_name}_{error_name}"
                raw[field] = get(field, "nvmlDeviceGetTotalEccErrors", error_type, counter)
    single = get("retired_pages_single_bit", "nvmlDeviceGetRetiredPages",
                 pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    double = get("retired_pages_double_bit", "nvmlDeviceGetRetiredPages",
                 pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    raw["retired_pages_single_bit"] = len(single) if single is not None else None
    raw["retired_pages_double_bit"] = len(double) if double is not None else None
    if single is not None or double is not None:
        raw["retired_pages_pending"] = get("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus")
    remapped = get("remapped_rows", "nvmlDeviceGetRemappedRows")
    raw["remapped_rows"] = list(remapped) if remapped is not None else None

    raw["pcie_gen"] = get("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration")
    raw["pcie_gen_max"] = get("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration")
    raw["pcie_gen_gpu_max"] = get("pcie_gen_gpu_max", "nvmlDeviceGetGpuMaxPcieLinkGeneration")
    raw["pcie_width"] = get("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth")
    raw["pcie_width_max"] = get("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth")

    raw["pcie_replay_count"] = get("pcie_replay_count", "nvmlDeviceGetPcieReplayCounter")
    raw["app_clock_sm"] = get("app_clock_sm", "nvmlDeviceGetApplicationsClock", pynvml.NVML_CLOCK_SM)
    raw["app_clock_sm_default"] = get("app_clock_sm_default", "nvmlDeviceGetDefaultApplicationsClock",
                                      pynvml.NVML_CLOCK_SM)
    raw["app_clock_mem"] = get("app_clock_mem", "nvmlDeviceGetApplicationsClock", pynvml.NVML_CLOCK_MEM)
    raw["app_clock_mem_default"] = get("app_clock_mem_default", "nvmlDeviceGetDefaultApplicationsClock",
                                       pynvml.NVML_CLOCK_MEM)
    raw["fabric_state"], raw["fabric_status"] = _fabric_info(pynvml, handle, unreadable)

    states: dict[str, int] = {}
    versions: dict[str, int] = {}
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            states[str(link)] = int(pynvml.nvmlDeviceGetNvLinkState(handle, link))
        except pynvml.NVMLError:
            continue  # links past the last one answer Not Supported / Invalid Argument
        try:
            versions[str(link)] = int(pynvml.nvmlDeviceGetNvLinkVersion(handle, link))
        except pynvml.NVMLError:
            pass
    raw["nvlink_states"] = states
    raw["nvlink_versions"] = versions
    raw["nvlink_errors"] = _nvlink_error_counters(pynvml, handle, [int(link) for link in states])

    raw["numa_node"] = get("numa_node", "nvmlDeviceGetNumaNodeId")
    words = math.ceil((cpu_count or os.cpu_count() or 1) / 64)
    affinity = get("cpu_affinity", "nvmlDeviceGetCpuAffinity", words)
    raw["cpu_affinity_words"] = [int(w) for w in affinity] if affinity is not None else None
    sysfs = pci_sysfs_info(sysfs_pci_address(raw["pci_bus_id"]) or "") if raw["pci_bus_id"] else {}
    raw["sysfs_numa_node"] = sysfs.get("numa_node")
    raw["sysfs_local_cpulist"] = sysfs.get("local_cpulist")
    return raw


def _nvlink_error_counters(pynvml: Any, handle: Any, links: list[int]) -> dict[str, dict[str, int | None]]:
    """Replay, recovery and CRC counters of each link that reported a state; None where the GPU has no such counter."""
    out: dict[str, dict[str, int | None]] = {}
    reader = getattr(pynvml, "nvmlDeviceGetNvLinkErrorCounter", None)
    if reader is None:
        return out
    for link in links:
        counters: dict[str, int | None] = {}
        for name, constant in NVLINK_ERROR_COUNTERS:
            try:
                counters[name] = int(reader(handle, link, getattr(pynvml, constant)))
            except (pynvml.NVMLError, AttributeError, TypeError, ValueError):
                counters[name] = None  # Blackwell moved these to other counters; Not Supported is common
        if any(v is not None for v in counters.values()):
            out[str(link)] = counters
    return out


def _fabric_info(pynvml: Any, handle: Any, unreadable: dict[str, str]) -> tuple[int | None, int | None]:
    """(state, status) of nvmlDeviceGetGpuFabricInfo, or (None, None) where the GPU has no fabric (PCIe cards)."""
    import ctypes

    struct = getattr(pynvml, "c_nvmlGpuFabricInfo_t", None)
    function = getattr(pynvml, "nvmlDeviceGetGpuFabricInfo", None)
    if struct is None or function is None:
        return None, None
    info = struct()
    try:
        function(handle, ctypes.byref(info))
    except pynvml.NVMLError as exc:
        if exc.value not in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT):
            unreadable["fabric"] = str(exc)
        return None, None
    except (TypeError, ValueError, OSError) as exc:
        unreadable["fabric"] = f"{type(exc).__name__}: {exc}"
        return None, None
    return int(info.state), int(info.status)


_INITIALIZED: tuple[Any, str | None] | None = None


def nvml() -> tuple[Any, str | None]:
    """pynvml, initialised once per process, and None; or None and why NVML cannot be used here.

    Every NVML user goes through this: one nvmlInit per process, never a shutdown while another
    part of the process (the monitor thread of a run) still holds handles.
    """
    global _INITIALIZED
    if _INITIALIZED is not None:
        return _INITIALIZED
    try:
        import pynvml
    except ImportError as exc:
        return None, f"nvidia-ml-py is not installed ({exc}); pip install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        _INITIALIZED = (None, init_failure_reason(exc))
    except OSError as exc:
        _INITIALIZED = (None, f"NVML could not be loaded: {exc}")
    else:
        _INITIALIZED = (pynvml, None)
    return _INITIALIZED


def uuid_text(uuid: Any) -> str | None:
    """A GPU UUID in NVML's spelling ('GPU-' + the hex groups), from torch's or NVML's form."""
    if uuid is None or str(uuid) == "":
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def torch_gpu_uuid(device: Any) -> str | None:
    """The NVML UUID of the GPU that torch calls `device` (an index or torch.device): the same card
    under any CUDA_VISIBLE_DEVICES, where indices differ between torch and NVML."""
    import torch

    return uuid_text(getattr(torch.cuda.get_device_properties(device), "uuid", None))


def torch_pci_bus_id(device: Any) -> str | None:
    """The PCI address of torch's `device` as NVML and sysfs write it: 0000:3b:00.0 (4-digit domain)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    if not hasattr(props, "pci_bus_id"):
        return None
    return f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


def gpu_handle(pynvml: Any, *, uuid: str | None = None, index: int | None = None) -> Any:
    """The NVML handle of a GPU: by UUID when one is given (and then never another card), else by index."""
    if uuid:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid_text(uuid))
    return pynvml.nvmlDeviceGetHandleByIndex(index or 0)


def init_failure_reason(exc: BaseException) -> str:
    """The reason shown when NVML cannot start, e.g. 'NVML Shared Library Not Found (no NVIDIA driver...)'."""
    hint = NO_DRIVER_HINT.get(getattr(exc, "value", None))
    return f"{exc} ({hint})" if hint else str(exc)


def collect_gpus() -> dict[str, Any]:
    """The 'gpus' section: {'available', 'reason', 'driver', 'cuda_driver', 'nvml_version', 'count', 'devices'}."""
    section: dict[str, Any] = {"available": False, "reason": None, "driver": None, "cuda_driver": None,
                               "nvml_version": None, "count": 0, "devices": []}
    pynvml, reason = nvml()
    if pynvml is None:
        section["reason"] = reason
        return section
    section["driver"] = _safe_text(pynvml.nvmlSystemGetDriverVersion, pynvml)
    section["nvml_version"] = _safe_text(pynvml.nvmlSystemGetNVMLVersion, pynvml)
    section["cuda_driver"] = cuda_version_string(_safe_text(pynvml.nvmlSystemGetCudaDriverVersion, pynvml))
    try:
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        section["reason"] = f"NVML could not count GPUs: {exc}"
        return section
    section["count"] = count
    for index in range(count):
        try:
            raw = read_device_raw(pynvml, index)
            raw["driver"] = section["driver"]
            section["devices"].append(device_from_raw(raw))
        except pynvml.NVMLError as exc:
            # typically 'GPU is lost': keep the index so the doctor can name the dead card
            section["devices"].append({"index": index, "error": str(exc)})
    section["available"] = count > 0
    if count == 0:
        section["reason"] = "NVML is working but reports no GPUs"
    return section


def _safe_text(fn: Callable[[], Any], pynvml: Any) -> Any:
    try:
        return _text(fn())
    except pynvml.NVMLError:
        return None
