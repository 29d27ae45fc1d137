"""Kernel-log checks: NVIDIA Xid/SXid lines with their GPU, PCIe AER, machine checks, the OOM killer, hung
tasks, NVLink errors and PCIe links the kernel found limited, each judged and pointed at the handbook.

`parse_events` (in kernel_events.py) turns (seconds since boot, message) lines into events; `check_kernel_log`
turns a log read by mleng.machine.kernel_log into findings. Both are pure, so they run on fixtures and on saved
logs.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable

from mleng.doctor.findings import Finding, fail, inconclusive, ok, warn
from mleng.doctor.kernel_events import RECOVERY_ACTION_RE, parse_events, pci_key, pci_text


DATA = Path(__file__).parent / "data"
# NVIDIA's immediate actions that take the GPU or the node out of service until someone acts.
HARDWARE_ACTIONS = frozenset({"RESET_GPU", "RESTART_BM", "RESTART_VM", "WORKFLOW_XID_48", "WORKFLOW_NVLINK_ERR",
                              "WORKFLOW_NVLINK5_ERR", "CHECK_MECHANICALS", "CONTACT_SUPPORT", "UPDATE_SWFW",
                              "CHECK_UVM", "XID_154"})
# Corrected AER errors are retried by the link; a handful since boot is normal, a flood is a marginal link.
AER_CORRECTED_WARN = 10
SAMPLE_LINES = 3
KIND_LABELS = {"xid": "Xid", "gpu_lost": "fallen off the bus", "gpu_init_failed": "RmInitAdapter failed",
               "sxid": "SXid", "aer": "PCIe AER", "aer_received": "AER summary", "pcie_limited": "limited PCIe link",
               "mce": "machine check", "oom": "OOM kill", "hung_task": "hung task", "soft_lockup": "soft lockup",
               "rcu_stall": "RCU stall", "nvlink": "NVLink error"}


@functools.lru_cache(maxsize=1)
def xid_catalog() -> dict[int, dict[str, str]]:
    import yaml

    return {int(k): v for k, v in yaml.safe_load((DATA / "xid_catalog.yaml").read_text())["xids"].items()}


@functools.lru_cache(maxsize=1)
def allowlist() -> dict[str, Any]:
    import yaml

    data = yaml.safe_load((DATA / "xid_allowlist.yaml").read_text())
    data["xid"] = {int(k): v for k, v in (data.get("xid") or {}).items()}
    data["xid_fail"] = {int(k): v for k, v in (data.get("xid_fail") or {}).items()}
    data["handbook"] = {int(k): list(v) for k, v in (data.get("handbook") or {}).items()}
    data["sxid"]["allow"] = {int(x) for x in data["sxid"]["allow"]}
    return data


def classify_xid(code: int, codes_on_gpu: set[int], detail: str = "") -> tuple[str, str]:
    """(severity, why) for one Xid code on a GPU whose log shows codes_on_gpu."""
    allowed = allowlist()["xid"].get(code)
    catalog = xid_catalog().get(code)
    if allowed:
        if allowed.get("unless_alone") and codes_on_gpu <= {code}:
            return "warn", allowed["unless_alone"]
        return "ok", allowed["why"]
    if code in allowlist()["xid_fail"]:
        return "fail", allowlist()["xid_fail"][code]
    if catalog is None:
        return "warn", "not in NVIDIA's Xid catalog (an older or newer driver's code): look it up"
    action = catalog["immediate"]
    if code == 154:
        change = RECOVERY_ACTION_RE.search(detail)
        if change and change.group(4).strip().lower() == "none":
            return "ok", "recovery action back to None"
        wanted = change.group(4) if change else "an action"
        return "fail", f"the driver asks for {wanted} before the GPU is trusted again"
    # (the description is already in the finding's text; the verdict says what NVIDIA's catalog asks for)
    if action in HARDWARE_ACTIONS:
        return "fail", f"NVIDIA's action {action}"
    if action in ("RESTART_APP", "IGNORE", ""):
        return "warn", (f"NVIDIA's action {action or 'none given'}"
                        + (f", then {catalog['investigatory']}" if catalog.get("investigatory") else "")
                        + "; once is noise, a repeat on the same GPU is the hardware")
    return "warn", f"NVIDIA's action {action}"


def gpu_index_by_pci(fp: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    gpus = fp.get("gpus") or {}
    out = {}
    for device in gpus.get("devices") or []:
        key = pci_key(device.get("pci_bus_id"))
        if key:
            out[key] = device
    return out


def _gpu_subject(device: dict[str, Any] | None, key: tuple | None, raw: str | None) -> str:
    if device and device.get("index") is not None and device.get("name"):
        return f"gpu {device['index']} ({device['name']})"
    return f"GPU at PCI {pci_text(key, raw)}"


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "time unknown"
    if seconds < 120:
        return f"{seconds:.0f} s after boot"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min after boot"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h after boot"
    return f"{seconds / 86400:.1f} d after boot"


def _span(times: list[float]) -> str:
    if not times:
        return "time unknown"
    first, last = _when(min(times)), _when(max(times))
    return first if first == last else f"first {first}, last {last}"


def _samples(events: list[dict[str, Any]]) -> list[str]:
    seen, out = set(), []
    for event in events:
        if event["text"] not in seen:
            seen.add(event["text"])
            out.append(event["text"])
    return out[:SAMPLE_LINES]


def _worst(severities: Iterable[str]) -> str:
    severities = set(severities)
    return "fail" if "fail" in severities else ("warn" if "warn" in severities else "ok")


def _codes_text(counter: Counter) -> str:
    return ", ".join(f"{code} x{n}" if n > 1 else f"{code}" for code, n in sorted(counter.items()))


def xid_findings(events: list[dict[str, Any]], uuids: dict[tuple, str], fp: dict[str, Any]) -> list[Finding]:
    by_pci = gpu_index_by_pci(fp)
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event["kind"] in ("xid", "gpu_lost", "gpu_init_failed"):
            groups[event["pci"] or ("raw", event.get("pci_raw"))].append(event)
    findings = []
    for key, group in groups.items():
        pci = key if key and key[0] != "raw" else None
        device = by_pci.get(pci) if pci else None
        subject = _gpu_subject(device, pci, group[0].get("pci_raw"))
        uuid = (device or {}).get("uuid") or uuids.get(pci)
        codes = Counter(e["code"] for e in group if e["kind"] == "xid")
        code_set = set(codes)
        verdicts: dict[int, tuple[str, str]] = {}
        for event in group:
            if event["kind"] == "xid":
                verdict = classify_xid(event["code"], code_set, event.get("detail") or "")
                # the worst verdict of a code wins (Xid 154 to None after one to a reset is still a reset)
                if event["code"] not in verdicts or _worst([verdict[0], verdicts[event["code"]][0]]) != \
                        verdicts[event["code"]][0]:
                    verdicts[event["code"]] = verdict
        # "GPU has fallen off the bus" lines beside an Xid 79 are the same event told twice
        lost = [e for e in group if e["kind"] == "gpu_lost"] if 79 not in codes else []
        init_failed = [e for e in group if e["kind"] == "gpu_init_failed"]
        severity = _worst([v[0] for v in verdicts.values()] + (["fail"] if lost or init_failed else []))
        handbook: list[str] = []
        for code in sorted(codes):
            if verdicts[code][0] != "ok" or severity == "ok":
                handbook += [h for h in allowlist()["handbook"].get(code, []) if h not in handbook]
        if lost and "xid-79-fallen-off-bus" not in handbook:
            handbook.insert(0, "xid-79-fallen-off-bus")
        if init_failed:
            handbook.append("gpu-rminitadapter-no-devices")
        parts = []
        for code in sorted(codes):
            catalog = xid_catalog().get(code) or {}
            description = (catalog.get("description") or "not in the catalog").split(" -- ")[0]
            parts.append(f"Xid {code}" + (f" x{codes[code]}" if codes[code] > 1 else "") + f" ({description})")
        if lost:
            parts.append("GPU has fallen off the bus" + (f" x{len(lost)}" if len(lost) > 1 else ""))
        if init_failed:
            parts.append("RmInitAdapter failed: the driver could not initialize it")
        times = [e["t"] for e in group if e["t"] is not None]
        when = _span(times)
        if severity == "ok":
            why = "; ".join(sorted({v[1] for v in verdicts.values()}))
            summary = f"{subject}: {', '.join(parts)} ({when}): allow-listed, not the node's fault: {why}"
        else:
            bad = [f"Xid {c}: {verdicts[c][1]}" for c in sorted(verdicts) if verdicts[c][0] == severity]
            if lost:
                bad.append("the GPU fell off the bus")
            if init_failed:
                bad.append("the driver could not initialize the GPU")
            summary = f"{subject}: {', '.join(parts)} ({when}); {'; '.join(bad)}"
        if uuid:
            summary += f" [{uuid}]"
        cause = None
        if severity == "fail":
            cause = "a GPU fault that needs the GPU reset or the node rebooted (NVIDIA's catalog); drain the node " \
                    "and, if it repeats on this GPU, open a hardware ticket"
        findings.append(_finding(severity, "xid", summary, subject=subject, cause=cause, handbook=handbook,
                                 measured={"xids": {str(c): n for c, n in sorted(codes.items())},
                                           "fallen_off_bus": len(lost), "init_failed": len(init_failed),
                                           "uuid": uuid, "pci": pci_text(pci, group[0].get("pci_raw")),
                                           "first_s": min(times) if times else None,
                                           "last_s": max(times) if times else None,
                                           "lines": _samples(group)}))
    return findings


def _finding(severity: str, check: str, summary: str, **kw) -> Finding:
    return {"ok": ok, "warn": warn, "fail": fail}[severity](check, summary, **kw)


def sxid_findings(events: list[dict[str, Any]]) -> list[Finding]:
    allow = allowlist()["sxid"]["allow"]
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event["kind"] == "sxid":
            groups[(event["switch"], event["pci"])].append(event)
    findings = []
    for (switch, pci), group in sorted(groups.items()):
        # one SXid report spans several lines (the Fatal/Non-fatal line, then Severity and Data lines)
        reports = [e for e in group if e["fatal"] is not None] or group
        counted = Counter(e["code"] for e in reports)
        fatal = sorted({e["code"] for e in group if e["fatal"] and e["code"] not in allow})
        other = sorted({e["code"] for e in group if e["code"] not in allow and e["code"] not in fatal})
        links = sorted({e["link"] for e in group if e["link"] is not None})
        subject = f"nvswitch {switch} (PCI {pci})"
        text = (f"{subject}: SXid {_codes_text(counted)}" + (f" on link(s) {', '.join(map(str, links))}" if links else ""))
        if fatal:
            severity, text = "fail", text + f"; fatal: {', '.join(map(str, fatal))}: NVLink traffic through the " \
                                            "switch stalled; reboot to reset GPUs and NVSwitches together"
        elif other:
            severity, text = "warn", text + f"; not on the allow-list: {', '.join(map(str, other))} (non-fatal or " \
                                            "unmarked): watch for repeats on the same link"
        else:
            severity, text = "ok", text + ": all on the allow-list of non-fatal SXids seen on healthy nodes"
        findings.append(_finding(severity, "sxid", text, subject=subject,
                                 handbook=["nvswitch-sxid-errors", "fabric-manager-not-running"] if severity != "ok" else [],
                                 measured={"sxids": {str(c): n for c, n in sorted(counted.items())}, "links": links,
                                           "fatal": fatal, "lines": _samples(group)}))
    return findings


def _device_subject(address: str | None, by_pci: dict[tuple, dict[str, Any]], driver: str | None = None) -> str:
    device = by_pci.get(pci_key(address)) if address else None
    if device:
        return f"gpu {device.get('index')} ({device.get('name')})"
    return f"PCI {address}" + (f" ({driver})" if driver else "") if address else "PCIe (device not named)"


def aer_findings(events: list[dict[str, Any]], fp: dict[str, Any]) -> list[Finding]:
    by_pci = gpu_index_by_pci(fp)
    bus_errors = [e for e in events if e["kind"] == "aer"]
    # The "error received" line and the "PCIe Bus Error" line usually describe one event: count the
    # detailed lines, and the summary lines only when a kernel printed no detail.
    aer = bus_errors or [e for e in events if e["kind"] == "aer_received"]
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in aer:
        groups[event.get("device") or ""].append(event)
    findings = []
    for device, group in sorted(groups.items()):
        subject = _device_subject(device or None, by_pci, group[0].get("driver"))
        counts = Counter(e["severity"] for e in group)
        types = Counter(e.get("type") for e in group if e.get("type"))
        text = (f"{subject}: PCIe AER " + ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in sorted(counts.items()))
                + (f" ({', '.join(f'{t} x{n}' for t, n in types.most_common(3))})" if types else ""))
        if counts.get("uncorrected_fatal"):
            severity, text = "fail", text + ": a fatal error breaks the link (a GPU then falls off the bus)"
        elif counts.get("uncorrected_nonfatal") or counts.get("corrected", 0) >= AER_CORRECTED_WARN:
            severity = "warn"
            text += (f": {counts.get('corrected', 0)} corrected errors is a marginal link (riser, cable, slot, retimer)"
                     if counts.get("corrected", 0) >= AER_CORRECTED_WARN else ": an uncorrected, non-fatal error")
        else:
            severity, text = "ok", text + f": below {AER_CORRECTED_WARN} corrected errors, the link retried them"
        findings.append(_finding(severity, "pcie_aer", text, subject=subject,
                                 handbook=["pcie-aer-errors", "pcie-link-downtrained"] if severity != "ok" else [],
                                 measured={"counts": dict(counts), "types": dict(types), "lines": _samples(group)}))
    return findings


def limited_link_findings(events: list[dict[str, Any]], fp: dict[str, Any]) -> list[Finding]:
    by_pci = gpu_index_by_pci(fp)
    findings = []
    for event in events:
        if event["kind"] != "pcie_limited":
            continue
        is_gpu = pci_key(event["device"]) in by_pci
        # The kernel prints this for every slow device at probe; only the GPUs' and NICs' links carry training.
        if not (is_gpu or event["driver"] in ("nvidia", "mlx5_core", "mlx4_core", "bnxt_en", "ice", "efa")):
            continue
        subject = _device_subject(event["device"], by_pci, event["driver"])
        findings.append(warn("pcie_limited", f"{subject}: {event['available']} available PCIe bandwidth, limited by "
                             f"{event['limited_by']} at {event['at']} (capable of {event['capable']} with "
                             f"{event['capable_link']})", subject=subject,
                             cause="a link trained below its width or speed at boot: reseat the card or riser",
                             handbook=["pcie-link-downtrained"],
                             measured={"available": event["available"], "capable": event["capable"],
                                       "line": event["text"]}))
    return findings


def host_findings(events: list[dict[str, Any]]) -> list[Finding]:
    findings = []
    mce = [e for e in events if e["kind"] == "mce"]
    if mce:
        uncorrected = [e for e in mce if e["uncorrected"]]
        text = f"{len(mce)} machine-check / hardware-error line(s), {len(uncorrected)} uncorrected"
        measured = {"lines": len(mce), "uncorrected": len(uncorrected), "sample": _samples(uncorrected or mce)}
        if uncorrected:
            findings.append(fail("machine_check", text + ": CPU or host memory fault (run `mcelog --client` or "
                                 "`ras-mc-ctl --errors`)", measured=measured,
                                 cause="a failing DIMM or CPU: drain the node and check the BMC event log"))
        else:
            findings.append(warn("machine_check", text + ": corrected CPU/memory errors; a growing count precedes "
                                 "an uncorrected one", measured=measured))
    oom = [e for e in events if e["kind"] == "oom"]
    if oom:
        processes = Counter(e["process"] for e in oom)
        cgroup = sum(e["cgroup"] for e in oom)
        findings.append(warn("oom_killer", f"the OOM killer ended {len(oom)} process(es) "
                             f"({', '.join(f'{p} x{n}' for p, n in processes.most_common(3))}), {cgroup} by a cgroup "
                             "limit: host memory, not GPU memory, ran out", handbook=["cpu-oom-killed"],
                             measured={"kills": len(oom), "cgroup_kills": cgroup, "processes": dict(processes),
                                       "lines": _samples(oom)}))
    hung = [e for e in events if e["kind"] == "hung_task"]
    if hung:
        processes = Counter(e["process"] for e in hung)
        findings.append(warn("hung_task", f"{len(hung)} task(s) blocked in the kernel for over "
                             f"{min(e['blocked_s'] for e in hung)} s ({', '.join(f'{p} x{n}' for p, n in processes.most_common(3))}): "
                             "uninterruptible waits on storage, a driver or a lost GPU",
                             handbook=["shared-fs-server-not-responding"],
                             measured={"tasks": len(hung), "processes": dict(processes), "lines": _samples(hung)}))
    stalls = [e for e in events if e["kind"] in ("soft_lockup", "rcu_stall")]
    if stalls:
        findings.append(warn("cpu_stall", f"{len(stalls)} soft lockup / RCU stall report(s): a CPU stopped "
                             "scheduling for seconds (a driver spinning, or an overcommitted VM host)",
                             measured={"reports": len(stalls), "lines": _samples(stalls)}))
    nvlink = [e for e in events if e["kind"] == "nvlink"]
    if nvlink:
        findings.append(warn("nvlink_log", f"{len(nvlink)} NVLink/NVSwitch error line(s) outside Xid/SXid reports",
                             handbook=["xid-74-nvlink-error", "nvlink-link-down"],
                             measured={"lines_count": len(nvlink), "lines": _samples(nvlink)}))
    return findings


def check_kernel_log(log: dict[str, Any], fp: dict[str, Any], since: dict[str, Any] | None = None) -> list[Finding]:
    """Findings from a kernel log read by mleng.machine.kernel_log (live or saved), within the --since window."""
    if not log.get("available"):
        return [inconclusive("kernel_log", f"kernel log not read: {log.get('reason')}; Xids, PCIe AER errors, "
                             "machine checks and OOM kills are unknown (run as root, or pass a saved log with "
                             "--kernel-log FILE)", handbook=["xid-79-fallen-off-bus"])]
    since = since or {"label": "since boot", "since_boot_s": None}
    lines = log["lines"]
    cutoff = since.get("since_boot_s")
    window_note = since["label"]
    if cutoff is not None:
        stamped = [line for line in lines if line[0] is not None]
        if log.get("saved") and not stamped:
            window_note = f"{since['label']} not applied: the saved log carries no time since boot"
        else:
            lines = [line for line in lines if line[0] is None or line[0] >= cutoff]
    events, uuids = parse_events(lines)
    findings = xid_findings(events, uuids, fp) + sxid_findings(events) + aer_findings(events, fp) \
        + limited_link_findings(events, fp) + host_findings(events)
    kinds = Counter(KIND_LABELS.get(e["kind"], e["kind"]) for e in events)
    uptime = log.get("uptime_s")
    text = (f"read {len(lines)} line(s) from {log['source']} ({window_note}"
            + (f", up {uptime / 3600:.1f} h" if uptime else "") + ")")
    if log.get("wrapped"):
        text += "; the ring buffer no longer holds the start of this boot, so older messages were not read"
    if log.get("tried"):
        text += f"; before it: {'; '.join(log['tried'])}"
    looked_for = "Xid, SXid, PCIe AER, limited PCIe links, machine checks, OOM kills, hung tasks, CPU stalls, NVLink errors"
    if not events:
        text += f": none of {looked_for}"
    else:
        text += ": " + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    findings.insert(0, ok("kernel_log", text, measured={"source": log["source"], "lines": len(lines),
                                                         "window": since["label"], "events": dict(kinds),
                                                         "wrapped": bool(log.get("wrapped"))}))
    return findings
