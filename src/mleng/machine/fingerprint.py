"""The environment fingerprint: one JSON-able dict describing this machine, embedded in every record.

Importing this module is cheap (no torch, no pynvml); they are imported inside collect().
Nothing here raises for a missing part: a section that cannot be read is
{"available": false, "reason": "..."} and a single field that cannot be read is null.

Shape (schema "mleng.fingerprint/1"). Examples in tests/fixtures/fingerprints/: h200_*.json model an
8x H200 SXM node mid-run in one state each (healthy, throttled, pcie_downtrained, nvlink_down,
ecc_errors, bad_ifname); h200_vm_idle/h200_vm_load.json are real output from a one-GPU H200 VM;
cpu_only.json is a machine without a GPU.

    schema         "mleng.fingerprint/1"
    collected_at   ISO-8601 UTC time
    host           {hostname, fqdn}                       fqdn null if resolving took over 2 s
    os             {name, id, version, kernel, arch}      name/version from /etc/os-release
    cpu            {model, logical_cores, physical_cores, sockets, flags_of_interest: [avx512f, amx_bf16, ...]}
    memory         {total_bytes, available_bytes, hugepages_total}              from /proc/meminfo
    python         {version, implementation, executable, prefix, in_virtualenv}
    process        {pid, cpu_affinity: "0-55,112-167", cpu_affinity_count}     os.sched_getaffinity
    software       {torch, torch_git, cuda, hip, cudnn, nccl: version strings or null,
                    distributed_backends: ["gloo", "nccl", ...], nvidia_ml_py, driver, cuda_driver,
                    unavailable: {name: reason} for every one of those that is null}
                   cuda/cudnn/nccl are what torch was built with; driver/cuda_driver come from NVML.
    gpus           {available, reason, driver, cuda_driver, nvml_version, count, devices: [device...]}
                   reason e.g. "NVML Shared Library Not Found (no NVIDIA driver on this machine)"
      device       index, name ("NVIDIA H200"), uuid, serial, pci_bus_id ("00000000:18:00.0"),
                   compute_capability ("9.0"), vbios, driver, persistence_mode, mig_mode,
                   memory_total_bytes, memory_used_bytes, utilization_gpu_pct, utilization_memory_pct,
                   sm_clock_mhz, sm_clock_max_mhz, mem_clock_mhz, mem_clock_max_mhz,
                   power_draw_w, power_limit_w (enforced), power_default_limit_w,
                   temperature_c, temperature_slowdown_c,
                   throttle_reasons: ["sw_power_cap", "hw_slowdown", "sw_thermal_slowdown",
                                      "hw_thermal_slowdown", "hw_power_brake", "gpu_idle", ...],
                   throttle_reasons_mask (NVML's raw bitmask; nvml.SLOWDOWN_REASONS are the real slowdowns),
                   ecc_mode_enabled,
                   ecc_errors: {volatile_corrected, volatile_uncorrected, aggregate_corrected, aggregate_uncorrected},
                   retired_pages: {single_bit_ecc, double_bit_ecc, pending} or null (Hopper+ has no page
                                  retirement: it remaps rows instead),
                   remapped_rows: {correctable, uncorrectable, pending, failure} or null (pre-Ampere),
                   pcie_gen, pcie_gen_max (of the link), pcie_gen_gpu_max (of the GPU), pcie_width, pcie_width_max
                                  (GPUs drop to Gen1 at idle: compare gen only under load; width always),
                   nvlinks: [{link, state: "active"|"inactive", version (NVML enum: 6), version_name ("4.0")}]
                                  (empty on PCIe cards and single-GPU VMs),
                   numa_node, cpu_affinity ("0-55,112-167"; NVML, else sysfs local_cpulist),
                   unreadable: {field: NVML error} for reads that failed other than Not Supported,
                   ecc_mode_pending (the mode after the next reboot), pcie_replay_count (since the driver loaded),
                   nvlink_errors: {per_link: {link: {replay, recovery, crc_flit, crc_data}}, total: {...}} or null,
                   applications_clocks: {sm_mhz, sm_default_mhz, mem_mhz, mem_default_mhz} or null,
                   fabric: {state ("completed", "in_progress", "not_started", "not_supported"), status (NVML
                            return code), status_ok} or null (no fabric API / not an NVSwitch GPU)
                   A GPU NVML cannot open at all is {index, error} (e.g. "GPU is lost").
                   Fingerprints recorded by an older mleng lack the fields after unreadable: the doctor says so.
      nvswitches   {count, pci: ["0000:05:00.0", ...]} NVIDIA PCI bridges (class 0x0680) = NVSwitches (with GPUs only)
      fabric_manager {running, pid} nv-fabricmanager among the processes this one can see (with GPUs only)
    numa           {available, nodes: [{node, cpulist, memory_total_bytes}]}   /sys/devices/system/node
    infiniband     {available, devices: [{name, hca_type, fw_ver, board_id, netdevs: [ifname...],
                    ports: [{port, state ("ACTIVE"), state_code (4), phys_state ("LinkUp"), phys_state_code (5),
                             rate ("400 Gb/sec (4X NDR)"), rate_gbps (400.0), link_layer ("InfiniBand"|"Ethernet"),
                             counters: {symbol_error, link_downed, link_error_recovery, port_rcv_errors, ... } or null}]}],
                    gpudirect: {nvidia_peermem: bool or null, module}}
                   or {available: false, reason: "/sys/class/infiniband absent: no InfiniBand/RoCE devices"}
    network        {available, interfaces: [{name, state ("up"), speed_mbps (null if unknown), mtu,
                    kind ("ethernet"|"infiniband"|"loopback"|...), virtual}]}      /sys/class/net
    limits         {memlock_soft_bytes, memlock_hard_bytes, nofile_soft, nofile_hard, nproc_soft, nproc_hard
                    (int, or "unlimited"), shm: {available, path, total_bytes, free_bytes}}
    env            {NAME: value} for NCCL_*, TORCH_*, CUDA_*, SLURM_*, FI_*, UCX_*, PYTORCH_*, ... and
                   MASTER_ADDR, WORLD_SIZE, RANK, LOCAL_RANK, OMP_NUM_THREADS, LD_LIBRARY_PATH, ...
                   (redact.CAPTURED_*); any name that looks secret has the value "<redacted>".

The doctor reads these fields; decoders for raw NVML values (mleng.machine.nvml.device_from_raw,
decode_clock_event_reasons, pcie_link_check, nvlink_summary) are pure and work on recorded data.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, Callable

from mleng.machine import redact, system

SCHEMA = "mleng.fingerprint/1"

TOP_LEVEL_KEYS = ("schema", "collected_at", "host", "os", "cpu", "memory", "python", "process", "software",
                  "gpus", "numa", "infiniband", "network", "limits", "env")


def _section(read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    # One unreadable corner of /sys must never cost the whole fingerprint.
    try:
        return read()
    except Exception as exc:  # noqa: BLE001 - reported in the record instead of raised
        return system.unavailable(f"could not be read: {type(exc).__name__}: {exc}")


def collect(gpus: bool = True, torch_versions: bool = True) -> dict[str, Any]:
    """Fingerprint this machine. gpus=False skips NVML; torch_versions=False skips importing torch."""
    from mleng.machine import software

    fingerprint: dict[str, Any] = {
        "schema": SCHEMA,
        "collected_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": _section(system.host_info),
        "os": _section(system.os_info),
        "cpu": _section(system.cpu_info),
        "memory": _section(system.memory_info),
        "python": _section(system.python_info),
        "process": _section(system.process_info),
        "software": _section(lambda: software.software_info(torch=torch_versions)),
    }
    if gpus:
        from mleng.machine import nvml

        fingerprint["gpus"] = _section(nvml.collect_gpus)
    else:
        fingerprint["gpus"] = {"available": False, "reason": "not collected (gpus=False)", "count": 0,
                               "devices": []}
    gpu_section = fingerprint["gpus"]
    soft = fingerprint["software"]
    if "unavailable" in soft:
        soft["driver"] = gpu_section.get("driver")
        soft["cuda_driver"] = gpu_section.get("cuda_driver")
        if soft["driver"] is None:
            soft["unavailable"]["driver"] = gpu_section.get("reason") or "NVML did not report a driver version"
        if soft["cuda_driver"] is None:
            soft["unavailable"]["cuda_driver"] = gpu_section.get("reason") or "NVML did not report a CUDA version"
    gpu_section.setdefault("devices", [])
    if gpu_section.get("available"):
        # what the doctor needs to judge the NVLink fabric: the switches on PCI and the daemon that runs them
        gpu_section["nvswitches"] = _section(system.nvswitch_info)
        gpu_section["fabric_manager"] = _section(system.fabric_manager_info)
    fingerprint["numa"] = _section(system.numa_info)
    fingerprint["infiniband"] = _section(system.infiniband_info)
    fingerprint["network"] = _section(system.network_info)
    fingerprint["limits"] = _section(system.limits_info)
    fingerprint["env"] = _section(redact.captured_env)
    return fingerprint


def collect_for_record(gpus: bool = True) -> dict[str, Any]:
    """collect() for embedding in a measurement: a fingerprint problem must never cost the measurement."""
    try:
        return collect(gpus=gpus)
    except Exception as exc:  # noqa: BLE001 - reported in the record instead of raised
        return {"error": f"fingerprint failed: {type(exc).__name__}: {exc}"}


def without_annotations(data: dict[str, Any]) -> dict[str, Any]:
    """A fingerprint read from a file, without keys that annotate the file rather than the machine
    (the test fixtures' "_provenance": recorded where, or modelled by what)."""
    return {k: v for k, v in data.items() if not str(k).startswith("_")}
