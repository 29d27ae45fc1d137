"""Health checks: each a small pure function from a fingerprint to findings (a measurement's: measured.py).

Each check reads the recorded fingerprint of `mleng env --json`, so it can be run on a fingerprint
recorded elsewhere (a throttled node, a downtrained link) as well as on this machine.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable

from mleng.doctor.findings import Finding, fail, inconclusive, ok, skipped, warn
from mleng.doctor.measured import check_busbw, check_matmul, check_membw, check_storage  # noqa: F401 - re-exported
from mleng.machine.nvml import FAULT_REASONS, nvlink_summary, pcie_link_check, slowdown_reasons
from mleng.machine.system import format_cpulist, parse_cpulist
from mleng.measure.sizes import GIB

CLOCK_UNDER_LOAD_OK = 0.90  # mean SM clock under load over the card's max
CLOCK_POWER_CAPPED_OK = 0.70  # at the power cap alone, clocks this far below max are still normal
LOAD_UTILIZATION_PCT = 50   # above this a fingerprint sample counts as "under load"
SHM_FAIL_BYTES = 512 * 2**20   # Docker's default /dev/shm is 64 MiB
SHM_WARN_BYTES = 4 * GIB
DISK_FAIL_FRACTION, DISK_WARN_FRACTION = 0.05, 0.15
DISK_FAIL_BYTES = 10 * GIB
INODE_FAIL_FRACTION = 0.02


def gpu_devices(fp: dict[str, Any]) -> list[dict[str, Any]]:
    gpus = fp.get("gpus") or {}
    return [d for d in gpus.get("devices") or [] if "error" not in d] if gpus.get("available") else []


def _no_gpu(check: str, fp: dict[str, Any]) -> Finding:
    reason = (fp.get("gpus") or {}).get("reason") or "no GPU found"
    return skipped(check, f"not applicable here: {reason}")


def _gpu_subject(d: dict[str, Any]) -> str:
    return f"gpu {d.get('index')} ({d.get('name')})"


def expected_gpu_count(env: dict[str, str]) -> tuple[int | None, str | None]:
    """What the job expects on this node, from SLURM or torchrun variables."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "LOCAL_WORLD_SIZE"):
        value = env.get(name, "")
        digits = value.split(":")[-1].split("(")[0]
        if digits.isdigit():
            return int(digits), name
    return None, None


def check_gpu_count(fp: dict[str, Any], expect_gpus: int | None = None) -> list[Finding]:
    env = fp.get("env") or {}
    source = "--expect-gpus"
    if expect_gpus is None:
        expect_gpus, source = expected_gpu_count(env)
    gpus = fp.get("gpus") or {}
    found = len(gpu_devices(fp))
    lost = [d for d in gpus.get("devices") or [] if "error" in d]
    if lost:
        return [fail("gpu_count", f"{len(lost)} GPU(s) present but unreadable: "
                     + "; ".join(f"gpu {d.get('index')}: {d.get('error')}" for d in lost),
                     measured=found, expected=expect_gpus, handbook=["xid-79-fallen-off-bus"])]
    if expect_gpus is None:
        if not gpus.get("available"):
            return [_no_gpu("gpu_count", fp)]
        return [ok("gpu_count", f"{found} GPU(s) visible; no expected count given (--expect-gpus)", measured=found)]
    if found < expect_gpus:
        return [fail("gpu_count", f"{found} GPU(s) visible, the job expects {expect_gpus} ({source})",
                     measured=found, expected=expect_gpus,
                     cause="a GPU fell off the bus, is hidden by CUDA_VISIBLE_DEVICES, or the allocation differs",
                     handbook=["xid-79-fallen-off-bus", "slurm-gpu-binding-wrong"])]
    if found > expect_gpus:
        return [warn("gpu_count", f"{found} GPU(s) visible, the job expects {expect_gpus} ({source})",
                     measured=found, expected=expect_gpus, handbook=["slurm-gpu-binding-wrong"])]
    return [ok("gpu_count", f"{found} GPU(s), as expected ({source})", measured=found, expected=expect_gpus)]


def check_clocks(fp: dict[str, Any], load_samples: dict[int, dict[str, Any]] | None = None) -> list[Finding]:
    """SM clock under load against the card's max, with the throttle reasons NVML gives.

    load_samples: per GPU index, the NVML monitor summary of a run under load
    ({"sm_clock_mhz_mean", "sm_clock_max_mhz", "throttle_reasons"}); without it the fingerprint's
    own sample is judged only where the GPU was busy when it was taken.
    """
    devices = gpu_devices(fp)
    if not devices:
        return [_no_gpu("sm_clock", fp)]
    findings = []
    for d in devices:
        sample = (load_samples or {}).get(d.get("index"))
        if sample:
            clock, reasons = sample.get("sm_clock_mhz_mean"), sample.get("throttle_reasons") or []
        elif (d.get("utilization_gpu_pct") or 0) >= LOAD_UTILIZATION_PCT:
            clock, reasons = d.get("sm_clock_mhz"), d.get("throttle_reasons") or []
        else:
            reasons = slowdown_reasons(d.get("throttle_reasons"))
            if reasons:
                findings.append(warn("sm_clock", f"{_gpu_subject(d)}: idle, but NVML reports {', '.join(reasons)}",
                                     measured=d.get("sm_clock_mhz"), subject=_gpu_subject(d),
                                     handbook=["gpu-clock-throttling"]))
            else:
                findings.append(inconclusive("sm_clock", f"{_gpu_subject(d)}: idle when sampled; clocks under load "
                                             "need a measurement (mleng doctor runs one on GPUs)",
                                             subject=_gpu_subject(d)))
            continue
        max_clock = (sample or {}).get("sm_clock_max_mhz") or d.get("sm_clock_max_mhz")
        slow = slowdown_reasons(reasons)
        temperature = d.get("temperature_c")
        if not clock or not max_clock:
            findings.append(inconclusive("sm_clock", f"{_gpu_subject(d)}: clock not readable", subject=_gpu_subject(d)))
            continue
        ratio = clock / max_clock
        detail = (f"{_gpu_subject(d)}: SM clock {clock:.0f} MHz under load, max {max_clock:.0f} MHz "
                  f"({ratio * 100:.0f}%)" + (f"; throttle reasons: {', '.join(slow)}" if slow else "")
                  + (f"; {temperature} C" if temperature is not None else ""))
        hard = FAULT_REASONS & set(slow)
        if ratio < CLOCK_UNDER_LOAD_OK and hard:
            findings.append(fail("sm_clock", detail, measured=clock, expected=max_clock, subject=_gpu_subject(d),
                                 cause="thermal or hardware slowdown: cooling, power delivery or a failing part",
                                 handbook=["gpu-clock-throttling"]))
        elif ratio < CLOCK_UNDER_LOAD_OK and set(slow) <= {"sw_power_cap"} and ratio >= CLOCK_POWER_CAPPED_OK:
            # Heavy matmuls hold H100/H200-class cards at their power limit below max clock: normal.
            findings.append(ok("sm_clock", detail + " (power-capped, normal under heavy load)", measured=clock,
                               expected=max_clock, subject=_gpu_subject(d)))
        elif ratio < CLOCK_UNDER_LOAD_OK:
            findings.append(warn("sm_clock", detail, measured=clock, expected=max_clock, subject=_gpu_subject(d),
                                 cause="power capping or a lowered power limit" if slow else None,
                                 handbook=["gpu-clock-throttling"]))
        else:
            findings.append(ok("sm_clock", detail, measured=clock, expected=max_clock, subject=_gpu_subject(d)))
    return findings


def check_ecc(fp: dict[str, Any]) -> list[Finding]:
    devices = gpu_devices(fp)
    if not devices:
        return [_no_gpu("ecc", fp)]
    findings = []
    for d in devices:
        errors = d.get("ecc_errors") or {}
        retired = d.get("retired_pages") or {}
        remapped = d.get("remapped_rows") or {}
        problems = []
        if (errors.get("volatile_uncorrected") or 0) > 0:
            problems.append(f"{errors['volatile_uncorrected']} uncorrected ECC errors since the driver loaded")
        if retired.get("pending"):
            problems.append("a page retirement is pending (needs a GPU reset)")
        if remapped.get("pending"):
            problems.append("a row remapping is pending (needs a GPU reset)")
        if remapped.get("failure"):
            problems.append("row remapping failed: the GPU has run out of spare rows")
        if (remapped.get("uncorrectable") or 0) > 0 and not problems:
            problems.append(f"{remapped['uncorrectable']} rows remapped for uncorrectable errors")
        subject = _gpu_subject(d)
        if problems:
            findings.append(fail("ecc", f"{subject}: " + "; ".join(problems), subject=subject,
                                 measured={"ecc_errors": errors, "retired_pages": retired, "remapped_rows": remapped},
                                 cause="HBM errors: reset the GPU; if they recur, drain the node and RMA the GPU",
                                 handbook=["ecc-uncorrectable-errors", "xid-48-double-bit-ecc",
                                           "xid-94-95-contained-uncontained-ecc", "xid-63-64-row-remapping"]))
        elif d.get("ecc_mode_enabled") is False:
            # the ecc_mode check warns about the setting; here: with ECC off no error is detected or counted
            findings.append(inconclusive("ecc", f"{subject}: ECC is off, so memory errors are neither detected nor "
                                         "counted", subject=subject))
        elif (errors.get("aggregate_corrected") or 0) > 1000:
            findings.append(warn("ecc", f"{subject}: {errors['aggregate_corrected']} corrected ECC errors over its "
                                 "lifetime; watch for growth", subject=subject, measured=errors,
                                 handbook=["ecc-uncorrectable-errors"]))
        else:
            findings.append(ok("ecc", f"{subject}: no uncorrected ECC errors, no pending retirement or remap",
                               subject=subject, measured=errors))
    return findings


def check_pcie(fp: dict[str, Any]) -> list[Finding]:
    devices = gpu_devices(fp)
    if not devices:
        return [_no_gpu("pcie_link", fp)]
    findings = []
    for d in devices:
        subject = _gpu_subject(d)
        link = pcie_link_check(d.get("pcie_gen"), d.get("pcie_gen_max"), d.get("pcie_width"), d.get("pcie_width_max"))
        busy = (d.get("utilization_gpu_pct") or 0) >= LOAD_UTILIZATION_PCT
        if link["width_ok"] is None and link["gen_ok"] is None:
            findings.append(inconclusive("pcie_link", f"{subject}: PCIe link not readable", subject=subject))
        elif link["width_ok"] is False or (busy and link["gen_ok"] is False):
            findings.append(fail("pcie_link", f"{subject}: PCIe link {link['link']}, the link can do {link['link_max']}",
                                 measured=link["link"], expected=link["link_max"], subject=subject,
                                 cause="a downtrained link: reseat the card or riser, check the slot; "
                                       "host-device copies and GPUDirect traffic run at the lower rate",
                                 handbook=["pcie-link-downtrained"]))
        elif link["gen_ok"] is False:
            findings.append(ok("pcie_link", f"{subject}: {link['link']} at idle (max {link['link_max']}); GPUs "
                               "lower the PCIe generation when idle, width is full", subject=subject,
                               measured=link["link"], expected=link["link_max"]))
        else:
            findings.append(ok("pcie_link", f"{subject}: PCIe {link['link']} (max {link['link_max']})",
                               subject=subject, measured=link["link"], expected=link["link_max"]))
    return findings


def check_nvlink(fp: dict[str, Any]) -> list[Finding]:
    devices = gpu_devices(fp)
    if not devices:
        return [_no_gpu("nvlink", fp)]
    findings = []
    for d in devices:
        subject = _gpu_subject(d)
        summary = nvlink_summary(d.get("nvlinks"))
        if summary["total"] == 0:
            findings.append(skipped("nvlink", f"{subject}: no NVLink links reported (a PCIe card)", subject=subject))
        elif summary["inactive"]:
            findings.append(fail("nvlink", f"{subject}: NVLink links {summary['inactive']} down, "
                                 f"{summary['active']} of {summary['total']} active", subject=subject,
                                 measured=summary["active"], expected=summary["total"],
                                 cause="a link that failed training or an NVSwitch/fabric manager problem: "
                                       "collectives fall back to slower paths or hang",
                                 handbook=["nvlink-link-down", "xid-74-nvlink-error", "fabric-manager-not-running"]))
        else:
            findings.append(ok("nvlink", f"{subject}: all {summary['total']} NVLink links active", subject=subject,
                               measured=summary["active"], expected=summary["total"]))
    return findings


def _mask_cpus(mask: str) -> list[int]:
    """A SLURM/taskset hex mask ('0xff00') -> CPU numbers."""
    value = int(mask, 16)
    return [i for i in range(value.bit_length()) if value >> i & 1]


def job_binding(fp: dict[str, Any], cpus: str | None = None) -> tuple[set[int] | None, str]:
    """The CPUs the job's rank will be bound to, and where that comes from.

    The doctor's own affinity is not the job's: under a plain shell it is every CPU. What binds a
    rank is the launcher: --cpus (a planned binding), SLURM's --cpu-bind (SLURM_CPU_BIND_LIST, one
    mask per local task), or the affinity this process inherited when a launcher already narrowed it.
    """
    if cpus:
        return set(parse_cpulist(cpus)), "--cpus"
    env = fp.get("env") or {}
    masks = [m for m in (env.get("SLURM_CPU_BIND_LIST") or "").split(",") if m.strip()]
    if masks and (env.get("SLURM_CPU_BIND_TYPE") or "mask_cpu").startswith(("mask_cpu", "map_cpu", "")):
        local = int(env.get("SLURM_LOCALID") or env.get("LOCAL_RANK") or 0)
        mask = masks[local % len(masks)]
        try:
            return set(_mask_cpus(mask)), f"SLURM --cpu-bind (SLURM_CPU_BIND_LIST, local task {local})"
        except ValueError:
            pass
    process = set(parse_cpulist((fp.get("process") or {}).get("cpu_affinity") or ""))
    total = (fp.get("cpu") or {}).get("logical_cores")
    if process and total and len(process) < total:
        return process, "the affinity this process inherited from its launcher"
    return None, "no binding"


def check_numa_affinity(fp: dict[str, Any], cpus: str | None = None) -> list[Finding]:
    devices = gpu_devices(fp)
    if not devices:
        return [_no_gpu("numa_affinity", fp)]
    process_text = (fp.get("process") or {}).get("cpu_affinity") or ""
    if not process_text and not cpus and not (fp.get("env") or {}).get("SLURM_CPU_BIND_LIST"):
        return [inconclusive("numa_affinity", "the process's CPU affinity is not in the fingerprint")]
    bound, source = job_binding(fp, cpus)
    if bound is None:
        return [inconclusive("numa_affinity", f"the job's CPU binding is unknown: nothing binds its ranks (the "
                             f"doctor itself may run on every CPU, {process_text}); bind each rank near its GPU "
                             "(srun --cpu-bind, numactl) or pass --cpus LIST to check a planned binding",
                             handbook=["numa-affinity-mismatch"])]
    shown = format_cpulist(bound)
    local_rank = (fp.get("env") or {}).get("LOCAL_RANK") or (fp.get("env") or {}).get("SLURM_LOCALID")
    selected = [d for d in devices if local_rank is None or str(d.get("index")) == local_rank]
    findings = []
    for d in selected or devices:
        subject = _gpu_subject(d)
        gpu_cpus = set(parse_cpulist(d.get("cpu_affinity") or ""))
        if not gpu_cpus:
            findings.append(inconclusive("numa_affinity", f"{subject}: CPU affinity of the GPU unknown", subject=subject))
            continue
        overlap = len(bound & gpu_cpus) / len(bound)
        numa = d.get("numa_node") if d.get("numa_node") is not None else "unknown"
        text = (f"{subject} is local to CPUs {d.get('cpu_affinity')} (NUMA node {numa}); "
                f"the job's rank is bound to {shown} ({source})")
        if overlap == 0:
            findings.append(warn("numa_affinity", text + ": none of them local to the GPU", subject=subject,
                                 cause="data loading and kernel launches cross the socket interconnect",
                                 handbook=["numa-affinity-mismatch"]))
        elif overlap < 1 and local_rank is not None:
            findings.append(warn("numa_affinity", text + f": {overlap * 100:.0f}% of them local", subject=subject,
                                 handbook=["numa-affinity-mismatch"]))
        else:
            findings.append(ok("numa_affinity", text, subject=subject))
    return findings


def _socket_ifname_missing(spec: str, interfaces: list[str]) -> list[str]:
    """Names in NCCL_SOCKET_IFNAME that match no interface here (prefix match unless '=')."""
    if spec.startswith("^"):
        return []  # an exclusion list cannot name a missing interface
    exact = spec.startswith("=")
    names = [n for n in spec.lstrip("=").split(",") if n]
    missing = []
    for name in names:
        if exact and name not in interfaces:
            missing.append(name)
        if not exact and not any(i.startswith(name) for i in interfaces):
            missing.append(name)
    return missing


def check_nccl_env(fp: dict[str, Any]) -> list[Finding]:
    env = fp.get("env") or {}
    findings: list[Finding] = []
    interfaces = [i["name"] for i in (fp.get("network") or {}).get("interfaces") or []]
    ifname = env.get("NCCL_SOCKET_IFNAME")
    if ifname and interfaces:
        missing = _socket_ifname_missing(ifname, interfaces)
        if missing:
            findings.append(fail("nccl_env", f"NCCL_SOCKET_IFNAME={ifname} names {', '.join(missing)}, which this "
                                 f"host does not have (it has {', '.join(interfaces)})", subject="NCCL_SOCKET_IFNAME",
                                 cause="NCCL bootstrap finds no interface and fails, or picks the wrong one",
                                 handbook=["nccl-socket-ifname-wrong"]))
        elif ifname.lstrip("=").startswith("lo"):
            findings.append(warn("nccl_env", f"NCCL_SOCKET_IFNAME={ifname} selects loopback: fine on one node, "
                                 "other nodes cannot reach it", subject="NCCL_SOCKET_IFNAME",
                                 handbook=["nccl-socket-ifname-wrong"]))
    hca = env.get("NCCL_IB_HCA")
    ib = fp.get("infiniband") or {}
    if hca and not ib.get("available") and not hca.startswith("^"):
        findings.append(fail("nccl_env", f"NCCL_IB_HCA={hca} names RDMA devices, and this host has none "
                             f"({ib.get('reason') or 'no InfiniBand/RoCE device found'})", subject="NCCL_IB_HCA",
                             cause="NCCL finds no IB device and falls back to TCP sockets (slow), or the variable "
                                   "was copied from another cluster",
                             handbook=["nccl-low-busbw-inter-node"]))
    if hca and ib.get("available"):
        devices = [d["name"] for d in ib.get("devices") or []]
        names = [n.split(":")[0] for n in hca.lstrip("^=").split(",") if n]
        absent = [n for n in names if not hca.startswith("^") and not any(d.startswith(n) for d in devices)]
        if absent:
            findings.append(fail("nccl_env", f"NCCL_IB_HCA={hca} names {', '.join(absent)}, not among this host's "
                                 f"RDMA devices ({', '.join(devices)})", subject="NCCL_IB_HCA",
                                 handbook=["nccl-low-busbw-inter-node"]))
    for name, entry, why in (
        ("NCCL_P2P_DISABLE", "nccl-p2p-disable-left-set",
         "GPU peer-to-peer (NVLink, PCIe P2P) is off: intra-node collectives go through host memory"),
        ("NCCL_IB_DISABLE", "nccl-ib-disable-left-set",
         "InfiniBand/RoCE is off: inter-node traffic falls back to TCP sockets"),
        ("NCCL_SHM_DISABLE", "nccl-p2p-disable-left-set", "shared-memory transport is off"),
    ):
        if env.get(name, "0") not in ("", "0"):
            findings.append(warn("nccl_env", f"{name}={env[name]}: {why}", subject=name, handbook=[entry]))
    debug = env.get("NCCL_DEBUG", "").upper()
    if debug in ("INFO", "TRACE"):
        findings.append(warn("nccl_env", f"NCCL_DEBUG={env['NCCL_DEBUG']} left set: very verbose logs and slower "
                             "start-up; use WARN in production", subject="NCCL_DEBUG", handbook=["nccl-debug-noisy"]))
    traps = (
        ("CUDA_LAUNCH_BLOCKING", "1", "every kernel launch waits for the GPU: a debugging setting that costs speed",
         "cuda-device-side-assert"),
        ("NCCL_ASYNC_ERROR_HANDLING", None, "the old name: PyTorch 2.2+ reads TORCH_NCCL_ASYNC_ERROR_HANDLING",
         "nccl-watchdog-timeout"),
        ("NCCL_BLOCKING_WAIT", None, "the old name: PyTorch 2.2+ reads TORCH_NCCL_BLOCKING_WAIT",
         "nccl-watchdog-timeout"),
        ("TORCH_NCCL_BLOCKING_WAIT", "1", "every collective blocks the host thread: slower, meant for debugging",
         "nccl-watchdog-timeout"),
    )
    for name, value, why, entry in traps:
        if name in env and (value is None or env[name] == value):
            findings.append(warn("nccl_env", f"{name}={env[name]}: {why}", subject=name, handbook=[entry]))
    if not findings:
        shown = {k: v for k, v in env.items() if k.startswith(("NCCL_", "TORCH_NCCL"))}
        findings.append(ok("nccl_env", "no known-bad NCCL/TORCH settings" + (f" ({len(shown)} set)" if shown else ""),
                           measured=shown))
    return findings


def check_dev_shm(fp: dict[str, Any]) -> list[Finding]:
    shm = ((fp.get("limits") or {}).get("shm")) or {}
    if not shm.get("available"):
        return [inconclusive("dev_shm", f"/dev/shm not readable: {shm.get('reason', 'unknown')}")]
    total = shm.get("total_bytes") or 0
    text = f"/dev/shm is {total / GIB:.1f} GiB ({(shm.get('free_bytes') or 0) / GIB:.1f} GiB free)"
    if total < SHM_FAIL_BYTES:
        return [fail("dev_shm", text + ": DataLoader workers and NCCL's shared-memory transport need more "
                     "(a container default of 64 MiB is a common trap)", measured=total, expected=SHM_WARN_BYTES,
                     handbook=["dev-shm-too-small"])]
    if total < SHM_WARN_BYTES:
        return [warn("dev_shm", text + ": small for many DataLoader workers", measured=total,
                     expected=SHM_WARN_BYTES, handbook=["dev-shm-too-small"])]
    return [ok("dev_shm", text, measured=total)]


def check_memlock(fp: dict[str, Any]) -> list[Finding]:
    limits = fp.get("limits") or {}
    soft = limits.get("memlock_soft_bytes")
    ib = fp.get("infiniband") or {}
    shown = "unlimited" if soft == "unlimited" else (f"{soft / 2**20:.0f} MiB" if isinstance(soft, int) else "unknown")
    if not ib.get("available"):
        return [skipped("memlock", f"no InfiniBand/RoCE devices here: the locked-memory limit ({shown}) only "
                        "matters for RDMA", measured=soft)]
    if soft == "unlimited":
        return [ok("memlock", "locked-memory limit is unlimited, as RDMA needs", measured=soft)]
    return [fail("memlock", f"locked-memory limit (ulimit -l) is {shown}: RDMA memory registration fails or "
                 "NCCL falls back to sockets", measured=soft, expected="unlimited", handbook=["memlock-ulimit-rdma"])]


def check_disk(path: str) -> list[Finding]:
    """Free space and inodes where checkpoints go."""
    if not os.path.isdir(path):
        return [inconclusive("checkpoint_disk", f"{path} is not a directory", subject=path)]
    usage = shutil.disk_usage(path)
    stat = os.statvfs(path)
    free_fraction = usage.free / usage.total if usage.total else 0.0
    inode_fraction = (stat.f_favail / stat.f_files) if stat.f_files else None
    text = (f"{path}: {usage.free / GIB:.1f} GiB free of {usage.total / GIB:.1f} GiB ({free_fraction * 100:.0f}%)"
            + (f", {inode_fraction * 100:.0f}% inodes free" if inode_fraction is not None else ""))
    measured = {"free_bytes": usage.free, "total_bytes": usage.total, "inodes_free_fraction": inode_fraction}
    if free_fraction < DISK_FAIL_FRACTION or usage.free < DISK_FAIL_BYTES or \
            (inode_fraction is not None and inode_fraction < INODE_FAIL_FRACTION):
        return [fail("checkpoint_disk", text + ": a checkpoint save may fail half-written", subject=path,
                     measured=measured, handbook=["disk-full-checkpoint"])]
    if free_fraction < DISK_WARN_FRACTION:
        return [warn("checkpoint_disk", text, subject=path, measured=measured, handbook=["disk-full-checkpoint"])]
    return [ok("checkpoint_disk", text, subject=path, measured=measured)]


FINGERPRINT_CHECKS: dict[str, Callable[..., list[Finding]]] = {
    "gpu_count": check_gpu_count,
    "sm_clock": check_clocks,
    "ecc": check_ecc,
    "pcie_link": check_pcie,
    "nvlink": check_nvlink,
    "numa_affinity": check_numa_affinity,
    "nccl_env": check_nccl_env,
    "dev_shm": check_dev_shm,
    "memlock": check_memlock,
}
