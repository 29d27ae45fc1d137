"""NVML's raw values turned into the record: pure functions, no driver call, so the doctor and the tests run
them on recorded or hand-made values on a machine without a GPU. The one throttle (clock event) decoder is here."""

from __future__ import annotations

from typing import Any, Iterable

from mleng.machine.system import format_cpulist


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
