"""Configuration checks: persistence mode, ECC mode, MIG mode, application clocks left set, the NVSwitch fabric
(Fabric Manager) where NVSwitches exist, and GPUDirect RDMA's module where RDMA NICs exist. Each reads the
fingerprint; a setting the fingerprint does not carry is inconclusive."""

from __future__ import annotations

from typing import Any

from mleng.doctor.findings import Finding, fail, inconclusive, ok, skipped, warn


def _devices(fp: dict[str, Any]) -> list[dict[str, Any]]:
    gpus = fp.get("gpus") or {}
    return [d for d in gpus.get("devices") or [] if "error" not in d] if gpus.get("available") else []


def _subject(d: dict[str, Any]) -> str:
    return f"gpu {d.get('index')} ({d.get('name')})"


def _no_gpu(check: str, fp: dict[str, Any]) -> list[Finding]:
    return [skipped(check, f"not applicable here: {(fp.get('gpus') or {}).get('reason') or 'no GPU found'}")]


def check_persistence_mode(fp: dict[str, Any]) -> list[Finding]:
    devices = _devices(fp)
    if not devices:
        return _no_gpu("persistence_mode", fp)
    findings = []
    for d in devices:
        subject, mode = _subject(d), d.get("persistence_mode")
        if mode is None:
            findings.append(inconclusive("persistence_mode", f"{subject}: persistence mode not readable", subject=subject))
        elif mode:
            findings.append(ok("persistence_mode", f"{subject}: persistence mode on", subject=subject, measured=True))
        else:
            findings.append(warn("persistence_mode", f"{subject}: persistence mode off: every CUDA start pays the "
                                 "driver's initialization and settings (power limit, clocks) reset between jobs",
                                 subject=subject, measured=False, expected=True, handbook=["persistence-mode-off"]))
    return findings


def check_ecc_mode(fp: dict[str, Any]) -> list[Finding]:
    devices = _devices(fp)
    if not devices:
        return _no_gpu("ecc_mode", fp)
    findings = []
    for d in devices:
        subject = _subject(d)
        current, pending = d.get("ecc_mode_enabled"), d.get("ecc_mode_pending")
        if current is None:
            findings.append(inconclusive("ecc_mode", f"{subject}: ECC mode not readable (a consumer card has none)",
                                         subject=subject))
        elif pending is not None and pending != current:
            findings.append(warn("ecc_mode", f"{subject}: ECC {'on' if current else 'off'} now, "
                                 f"{'on' if pending else 'off'} after the next reboot: a change is waiting",
                                 subject=subject, measured={"current": current, "pending": pending},
                                 handbook=["ecc-uncorrectable-errors"]))
        elif not current:
            findings.append(warn("ecc_mode", f"{subject}: ECC is off: memory errors go undetected and uncorrected",
                                 subject=subject, measured={"current": current, "pending": pending}, expected=True,
                                 handbook=["ecc-uncorrectable-errors"]))
        else:
            findings.append(ok("ecc_mode", f"{subject}: ECC on" + (" (and after reboot)" if pending else ""),
                               subject=subject, measured={"current": current, "pending": pending}))
    return findings


def check_mig_mode(fp: dict[str, Any]) -> list[Finding]:
    devices = _devices(fp)
    if not devices:
        return _no_gpu("mig_mode", fp)
    visible = (fp.get("env") or {}).get("CUDA_VISIBLE_DEVICES") or ""
    findings = []
    for d in devices:
        subject, mode = _subject(d), d.get("mig_mode")
        if mode is None:
            findings.append(skipped("mig_mode", f"{subject}: no MIG on this GPU", subject=subject))
        elif mode and "MIG-" in visible:
            findings.append(ok("mig_mode", f"{subject}: MIG on, and the job selects MIG instances "
                               "(CUDA_VISIBLE_DEVICES=MIG-...)", subject=subject, measured=True))
        elif mode:
            findings.append(warn("mig_mode", f"{subject}: MIG is on: a training job sees MIG slices (or no device) "
                                 "instead of the whole GPU; NVLink peer access is off", subject=subject,
                                 measured=True, expected=False, cause="left on after an inference or sharing setup: "
                                 "sudo nvidia-smi -i <index> -mig 0 (and a GPU reset)"))
        else:
            findings.append(ok("mig_mode", f"{subject}: MIG off", subject=subject, measured=False))
    return findings


def check_application_clocks(fp: dict[str, Any]) -> list[Finding]:
    devices = _devices(fp)
    if not devices:
        return _no_gpu("app_clocks", fp)
    findings = []
    for d in devices:
        subject, clocks = _subject(d), d.get("applications_clocks")
        if not clocks or clocks.get("sm_mhz") is None or clocks.get("sm_default_mhz") is None:
            findings.append(inconclusive("app_clocks", f"{subject}: application clocks not in this fingerprint "
                                         "(NVML Not Supported, or recorded by an older mleng)", subject=subject))
            continue
        changed = []
        for what, now_key, default_key in (("SM", "sm_mhz", "sm_default_mhz"), ("memory", "mem_mhz", "mem_default_mhz")):
            now, default = clocks.get(now_key), clocks.get(default_key)
            if now is not None and default is not None and now != default:
                changed.append(f"{what} {now} MHz, default {default} MHz")
        if changed:
            findings.append(warn("app_clocks", f"{subject}: application clocks left set: {'; '.join(changed)}",
                                 subject=subject, measured=clocks,
                                 cause="an earlier job or benchmark ran nvidia-smi -ac; reset with "
                                       "sudo nvidia-smi -i <index> -rac",
                                 handbook=["gpu-clock-throttling", "persistence-mode-off"]))
        else:
            findings.append(ok("app_clocks", f"{subject}: application clocks at their defaults "
                               f"(SM {clocks['sm_mhz']} MHz, memory {clocks.get('mem_mhz')} MHz)",
                               subject=subject, measured=clocks))
    return findings


def check_fabric(fp: dict[str, Any]) -> list[Finding]:
    """Where NVSwitches exist, every GPU must have joined the NVLink fabric (Fabric Manager brought it up)."""
    devices = _devices(fp)
    if not devices:
        return _no_gpu("fabric", fp)
    gpus = fp.get("gpus") or {}
    switches = (gpus.get("nvswitches") or {}).get("count")
    states = {d.get("index"): (d.get("fabric") or {}) for d in devices}
    on_fabric = any(s.get("state") not in (None, "not_supported") for s in states.values())
    if not switches and not on_fabric:
        if switches is None and all(d.get("fabric") is None for d in devices) and "nvswitches" not in gpus:
            return [inconclusive("fabric", "NVSwitch presence and GPU fabric state not in this fingerprint "
                                 "(recorded by an older mleng)")]
        return [skipped("fabric", "no NVSwitch on this node (no NVIDIA PCI bridge, no GPU on a fabric): "
                        "Fabric Manager is not needed")]
    manager = gpus.get("fabric_manager") or {}
    seen = ("nv-fabricmanager running" if manager.get("running") else
            "nv-fabricmanager not among the processes visible here" if manager.get("running") is False else
            "Fabric Manager process not checked")
    findings = []
    for d in devices:
        subject, state = _subject(d), states[d.get("index")]
        if not state:
            findings.append(inconclusive("fabric", f"{subject}: fabric state not readable ({switches} NVSwitch(es) "
                                         f"on PCI; {seen})", subject=subject))
        elif state.get("state") == "completed" and state.get("status_ok") is not False:
            findings.append(ok("fabric", f"{subject}: joined the NVLink fabric ({switches} NVSwitch(es); {seen})",
                               subject=subject, measured=state))
        else:
            why = (f"fabric state {state.get('state')}" + (f", status {state.get('status')}"
                                                           if state.get("status") not in (None, 0) else ""))
            findings.append(fail("fabric", f"{subject}: not on the NVLink fabric: {why} ({switches} NVSwitch(es); "
                                 f"{seen})", subject=subject, measured=state, expected="completed",
                                 cause="Fabric Manager is not running, failed, or its version differs from the "
                                       "driver's: CUDA reports error 802 'system not yet initialized'",
                                 handbook=["fabric-manager-not-running", "fabricmanager-driver-version-mismatch"]))
    return findings


def check_gpudirect_rdma(fp: dict[str, Any]) -> list[Finding]:
    ib = fp.get("infiniband") or {}
    if not _devices(fp):
        return _no_gpu("gpudirect_rdma", fp)
    if not ib.get("available"):
        return [skipped("gpudirect_rdma", "no RDMA NICs here: GPUDirect RDMA does not apply")]
    gdr = ib.get("gpudirect")
    if not gdr or gdr.get("nvidia_peermem") is None:
        return [inconclusive("gpudirect_rdma", "whether nvidia_peermem is loaded is not in this fingerprint"
                             + (f" ({gdr['reason']})" if gdr and gdr.get("reason") else ""))]
    if gdr["nvidia_peermem"]:
        return [ok("gpudirect_rdma", f"{gdr.get('module')} loaded: NICs can read and write GPU memory directly",
                   measured=gdr)]
    return [warn("gpudirect_rdma", f"RDMA NICs present ({len(ib.get('devices') or [])}) but nvidia_peermem is not "
                 "loaded: inter-node traffic is staged through host memory unless NCCL uses DMA-BUF (kernel 5.12+, "
                 "open GPU modules; NCCL_DMABUF_ENABLE)", measured=gdr, cause="sudo modprobe nvidia-peermem",
                 handbook=["nccl-gdr-nvidia-peermem-missing"])]


CONFIG_CHECKS = {"persistence_mode": check_persistence_mode, "ecc_mode": check_ecc_mode, "mig_mode": check_mig_mode,
                 "app_clocks": check_application_clocks, "fabric": check_fabric,
                 "gpudirect_rdma": check_gpudirect_rdma}
