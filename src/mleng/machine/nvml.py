"""GPUs through NVML: raw reads guarded call by call, and pure functions that turn raw values into the record.

The split matters: `read_device_raw` is the only code that talks to the driver; everything it returns
is a plain JSON-able value, and `device_from_raw` plus the decoders (in `nvml_values.py`) are pure, so the
doctor and the tests can run them on recorded or hand-made values on a machine without a GPU.
pynvml is imported inside functions only: importing this module stays cheap.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

from mleng.machine.nvml_values import NVLINK_ERROR_COUNTERS, cuda_version_string, device_from_raw
from mleng.machine.nvml_values import (  # noqa: F401 - the one NVML layer: its callers import them from here
    FAULT_REASONS, SLOWDOWN_REASONS, affinity_words_to_cpulist, decode_clock_event_reasons, milliwatts_to_watts,
    nvlink_summary, nvlink_version_name, pcie_link_check, slowdown_reasons,
)
from mleng.machine.system import pci_sysfs_info


NO_DRIVER_HINT = {
    # NVML error value -> what it means on a real machine
    12: "no NVIDIA driver on this machine",          # NVML_ERROR_LIBRARY_NOT_FOUND
    9: "the NVIDIA kernel module is not loaded",      # NVML_ERROR_DRIVER_NOT_LOADED
    18: "driver and NVML library versions differ; reboot or reload the driver",  # LIB_RM_VERSION_MISMATCH
    4: "not allowed to open the NVIDIA devices",      # NVML_ERROR_NO_PERMISSION
}

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_INVALID_ARGUMENT = 2


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
