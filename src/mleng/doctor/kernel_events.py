"""Kernel-log lines turned into events, judging nothing: the patterns of NVIDIA Xid/SXid lines, PCIe AER,
machine checks, the OOM killer, hung tasks, NVLink errors and limited PCIe links, and the PCI address forms.
Pure, so it runs on fixtures and on saved logs; mleng.doctor.kernel_log judges the events."""

from __future__ import annotations

import re
from typing import Any, Iterable


_PCI = r"(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-9a-fA-F])?"
XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?(" + _PCI + r")\): (\d+)(?:, (.*))?")
GPU_UUID_RE = re.compile(r"NVRM: GPU at PCI:(" + _PCI + r"): (GPU-[0-9a-fA-F-]+)")
GPU_LOST_RE = re.compile(r"NVRM: (?:The NVIDIA )?GPU (?:at )?(?:PCI:)?(" + _PCI + r")(?: \(PCI ID: [0-9a-f:]+\))?"
                         r":? (?:GPU )?(?:installed in this system )?has fallen off the bus", re.I)
RMINIT_RE = re.compile(r"NVRM: (?:GPU (" + _PCI + r"): )?RmInitAdapter failed!?(.*)")
SXID_RE = re.compile(r"nvidia-nvswitch(\d+): SXid \(PCI:(" + _PCI + r")\): (\d+)(?:, (.*))?")
AER_RE = re.compile(r"^(?:(\S+) (" + _PCI + r"): )?(?:AER: )?PCIe Bus Error: severity=([A-Za-z-]+(?: \([A-Za-z-]+\))?)"
                    r"(?:, type=([^,]+))?")
AER_RECEIVED_RE = re.compile(r"AER: (?:Multiple )?(Corrected|Correctable|Uncorrected \((?:Fatal|Non-Fatal)\)|"
                             r"Uncorrectable \((?:Fatal|Non-Fatal)\)) error(?: message)? received:? (?:from )?"
                             r"(?:id=)?(" + _PCI + r")?")
MCE_RE = re.compile(r"\[Hardware Error\]|Machine check events logged|^EDAC [^:]*: \d+ (?:CE|UE) |mce: .*Machine Check",
                    re.I)
MCE_UNCORRECTED_RE = re.compile(r"\bUE\b|uncorrect|fatal|Machine Check Exception|Processor context corrupt|"
                                r"event severity: (?:fatal|recoverable)", re.I)
OOM_RE = re.compile(r"(Memory cgroup out of memory|Out of memory): Killed process (\d+) \(([^)]*)\)")
HUNG_RE = re.compile(r"INFO: task (.+):(\d+) blocked for more than (\d+) seconds")
SOFT_LOCKUP_RE = re.compile(r"(?:watchdog: )?BUG: soft lockup - CPU#(\d+) stuck for (\d+)s!(?: \[(.+):(\d+)\])?")
RCU_STALL_RE = re.compile(r"rcu: INFO: rcu_\w+ (?:self-)?detected stalls? on CPUs?")
NVLINK_WORDS_RE = re.compile(r"nvlink|nvswitch", re.I)
NVLINK_FAULT_RE = re.compile(r"error|fatal|failed|assert|timed out|timeout", re.I)
LIMITED_RE = re.compile(r"^(\S+) (" + _PCI + r"): ([\d.]+ Gb/s) available PCIe bandwidth, limited by (.+?) at "
                        r"(" + _PCI + r") \(capable of ([\d.]+ Gb/s) with (.+?)\)")
RECOVERY_ACTION_RE = re.compile(r"recovery action changed from (0x[0-9a-f]+) \(([^)]*)\) to (0x[0-9a-f]+) \(([^)]*)\)",
                                re.I)
# cheap pre-filter: a line that contains none of these cannot be an event
_ANY = re.compile(r"NVRM|nvswitch|nvlink|PCIe Bus Error|AER:|Hardware Error|Machine check|EDAC|Killed process|"
                  r"blocked for more than|soft lockup|detected stall|PCIe bandwidth, limited", re.I)


def pci_key(address: str | None) -> tuple[int, int, int] | None:
    """'0000:3b:00', 'PCI:0000:3B:00.0', '00000000:3B:00.0' or '3b:00.0' -> (domain, bus, device)."""
    if not address:
        return None
    parts = address.strip().lower().removeprefix("pci:").split(":")
    try:
        if len(parts) == 3:
            domain, bus, devfn = parts
        elif len(parts) == 2:
            domain, (bus, devfn) = "0", parts
        else:
            return None
        return int(domain, 16), int(bus, 16), int(devfn.split(".")[0], 16)
    except ValueError:
        return None


def pci_text(key: tuple[int, int, int] | None, raw: str | None = None) -> str:
    return f"{key[0]:04x}:{key[1]:02x}:{key[2]:02x}" if key else (raw or "?")


def parse_events(lines: Iterable[tuple[float | None, str]]) -> tuple[list[dict[str, Any]], dict[tuple, str]]:
    """Events in the log, and the GPU UUIDs the driver logged per PCI address ('NVRM: GPU at PCI:...: GPU-...')."""
    events: list[dict[str, Any]] = []
    uuids: dict[tuple, str] = {}
    for seconds, text in lines:
        if not _ANY.search(text):
            continue
        base = {"t": seconds, "text": text.strip()}
        if match := GPU_UUID_RE.search(text):
            uuids[pci_key(match.group(1))] = match.group(2)
            continue
        if match := XID_RE.search(text):
            detail = match.group(3) or ""
            pid = re.search(r"pid=('?<?[\w]+>?'?)", detail)
            name = re.search(r"name=([^,]+)", detail)
            events.append({**base, "kind": "xid", "code": int(match.group(2)), "pci": pci_key(match.group(1)),
                           "pci_raw": match.group(1), "detail": detail,
                           "pid": pid.group(1).strip("'") if pid else None,
                           "process": name.group(1).strip() if name else None})
            continue
        if match := GPU_LOST_RE.search(text):
            events.append({**base, "kind": "gpu_lost", "pci": pci_key(match.group(1)), "pci_raw": match.group(1)})
            continue
        if match := RMINIT_RE.search(text):
            events.append({**base, "kind": "gpu_init_failed", "pci": pci_key(match.group(1)),
                           "pci_raw": match.group(1)})
            continue
        if match := SXID_RE.search(text):
            detail = match.group(4) or ""
            fatal = None
            if re.search(r"\bNon-fatal\b", detail, re.I):
                fatal = False
            elif re.search(r"\bFatal\b", detail, re.I):
                fatal = True
            link = re.search(r"\bLink (\d+)", detail)
            events.append({**base, "kind": "sxid", "switch": int(match.group(1)), "pci": match.group(2),
                           "code": int(match.group(3)), "fatal": fatal, "link": int(link.group(1)) if link else None})
            continue
        if match := AER_RE.search(text):
            severity = match.group(3).lower()
            events.append({**base, "kind": "aer", "driver": match.group(1), "device": match.group(2),
                           "severity": _aer_severity(severity), "type": (match.group(4) or "").strip() or None})
            continue
        if match := AER_RECEIVED_RE.search(text):
            events.append({**base, "kind": "aer_received", "severity": _aer_severity(match.group(1).lower()),
                           "device": match.group(2)})
            continue
        if match := LIMITED_RE.search(text):
            events.append({**base, "kind": "pcie_limited", "driver": match.group(1), "device": match.group(2),
                           "available": match.group(3), "limited_by": match.group(4), "at": match.group(5),
                           "capable": match.group(6), "capable_link": match.group(7)})
            continue
        if MCE_RE.search(text):
            events.append({**base, "kind": "mce", "uncorrected": bool(MCE_UNCORRECTED_RE.search(text))})
            continue
        if match := OOM_RE.search(text):
            events.append({**base, "kind": "oom", "cgroup": match.group(1).startswith("Memory cgroup"),
                           "pid": int(match.group(2)), "process": match.group(3)})
            continue
        if match := HUNG_RE.search(text):
            events.append({**base, "kind": "hung_task", "process": match.group(1), "pid": int(match.group(2)),
                           "blocked_s": int(match.group(3))})
            continue
        if match := SOFT_LOCKUP_RE.search(text):
            events.append({**base, "kind": "soft_lockup", "cpu": int(match.group(1)), "stuck_s": int(match.group(2)),
                           "process": match.group(3)})
            continue
        if RCU_STALL_RE.search(text):
            events.append({**base, "kind": "rcu_stall"})
            continue
        if NVLINK_WORDS_RE.search(text) and NVLINK_FAULT_RE.search(text):
            events.append({**base, "kind": "nvlink"})
    return events, uuids


def _aer_severity(text: str) -> str:
    if "non-fatal" in text:
        return "uncorrected_nonfatal"
    if "uncorrect" in text or "fatal" in text:
        return "uncorrected_fatal"
    return "corrected"
