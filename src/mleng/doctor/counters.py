"""Error-counter checks: NVLink replay/recovery/CRC per link, the PCIe replay counter, InfiniBand port
counters, state and rate. Each reads the fingerprint (NVML and /sys/class/infiniband), so it runs on a node's
recorded fingerprint as on this machine; a counter the fingerprint does not carry is inconclusive, not ok.
"""

from __future__ import annotations

from typing import Any

from mleng.doctor.findings import Finding, fail, inconclusive, ok, skipped, warn

# imbue-ai/cluster-health warns on `nvidia-smi nvlink -e` from 5 errors in total on a node
# (health_checks.py MIN_NVLINK_ERRORS_TO_WARN); mleng applies it per GPU, over its links.
NVLINK_ERRORS_WARN = 5
# Replays are retransmissions on the GPU's PCIe link since the driver loaded; a healthy Gen5 link shows
# none or a handful, a marginal riser thousands. DCGM's PCIe diagnostic flags replays during its test.
PCIE_REPLAY_WARN = 100
# IB port counters (since the HCA came up or the counters were cleared). A port that lost its link even
# once (link_downed) broke every RDMA connection over it; the error counters grow from signal trouble.
IB_COUNTER_WARN = {"link_downed": 1, "link_error_recovery": 1, "symbol_error": 10, "port_rcv_errors": 10,
                   "port_rcv_remote_physical_errors": 10, "local_link_integrity_errors": 1,
                   "excessive_buffer_overrun_errors": 1}


def _devices(fp: dict[str, Any]) -> list[dict[str, Any]]:
    gpus = fp.get("gpus") or {}
    return [d for d in gpus.get("devices") or [] if "error" not in d] if gpus.get("available") else []


def _subject(d: dict[str, Any]) -> str:
    return f"gpu {d.get('index')} ({d.get('name')})"


def _no_gpu(check: str, fp: dict[str, Any]) -> Finding:
    return skipped(check, f"not applicable here: {(fp.get('gpus') or {}).get('reason') or 'no GPU found'}")


def _not_recorded(check: str, subject: str, what: str) -> Finding:
    return inconclusive(check, f"{subject}: {what} not in this fingerprint (NVML answered Not Supported, or it was "
                        "recorded by an older mleng)", subject=subject)


def check_nvlink_errors(fp: dict[str, Any]) -> list[Finding]:
    devices = _devices(fp)
    if not devices:
        return [_no_gpu("nvlink_errors", fp)]
    findings = []
    for d in devices:
        subject = _subject(d)
        if not d.get("nvlinks"):
            findings.append(skipped("nvlink_errors", f"{subject}: no NVLink links (a PCIe card)", subject=subject))
            continue
        errors = d.get("nvlink_errors")
        if not errors:
            findings.append(_not_recorded("nvlink_errors", subject, "NVLink error counters"))
            continue
        total = errors.get("total") or {}
        per_link = errors.get("per_link") or {}
        count = sum(v for v in total.values() if v)
        worst = sorted(((sum(v for v in c.values() if v), link) for link, c in per_link.items()), reverse=True)
        worst = [f"link {link}: {n}" for n, link in worst[:3] if n]
        text = (f"{subject}: NVLink errors since the driver loaded over {len(per_link)} link(s): "
                + ", ".join(f"{name} {value}" for name, value in total.items() if value is not None))
        if count >= NVLINK_ERRORS_WARN:
            findings.append(warn("nvlink_errors", text + f" (worst {', '.join(worst)})", subject=subject,
                                 measured=errors, expected=f"< {NVLINK_ERRORS_WARN}",
                                 cause="link-level retransmissions: a marginal NVLink (baseboard, connector) costs "
                                       "bandwidth before it fails; recovery errors mean the link retrained",
                                 handbook=["xid-74-nvlink-error", "nvlink-link-down"]))
        else:
            findings.append(ok("nvlink_errors", text, subject=subject, measured=errors))
    return findings


def check_pcie_replay(fp: dict[str, Any]) -> list[Finding]:
    devices = _devices(fp)
    if not devices:
        return [_no_gpu("pcie_replay", fp)]
    findings = []
    for d in devices:
        subject = _subject(d)
        count = d.get("pcie_replay_count")
        if count is None:
            findings.append(_not_recorded("pcie_replay", subject, "the PCIe replay counter"))
        elif count >= PCIE_REPLAY_WARN:
            findings.append(warn("pcie_replay", f"{subject}: {count} PCIe replays since the driver loaded: the link "
                                 "retransmits (riser, slot, retimer)", subject=subject, measured=count,
                                 expected=f"< {PCIE_REPLAY_WARN}", handbook=["pcie-aer-errors", "pcie-link-downtrained"]))
        else:
            findings.append(ok("pcie_replay", f"{subject}: {count} PCIe replays since the driver loaded",
                               subject=subject, measured=count))
    return findings


def _port_subject(dev: dict[str, Any], port: dict[str, Any]) -> str:
    netdevs = ",".join(dev.get("netdevs") or [])
    return f"{dev.get('name')} port {port.get('port')}" + (f" ({netdevs})" if netdevs else "")


def _named_by_nccl(name: str, env: dict[str, str]) -> bool:
    spec = env.get("NCCL_IB_HCA") or ""
    if not spec or spec.startswith("^"):
        return False
    return any(name.startswith(item.split(":")[0]) for item in spec.lstrip("=").split(",") if item)


def check_ib_ports(fp: dict[str, Any]) -> list[Finding]:
    """State, rate (against the fastest port of the same HCA model and link layer on this node) and error counters."""
    ib = fp.get("infiniband") or {}
    if not ib.get("available"):
        return [skipped("ib_port", f"no InfiniBand/RoCE devices: {ib.get('reason') or 'none found'}")]
    env = fp.get("env") or {}
    ports = [(dev, port) for dev in ib.get("devices") or [] for port in dev.get("ports") or []]
    fastest: dict[tuple, float] = {}
    for dev, port in ports:
        if port.get("state") == "ACTIVE" and port.get("rate_gbps"):
            key = (dev.get("hca_type"), port.get("link_layer"))
            fastest[key] = max(fastest.get(key, 0.0), port["rate_gbps"])
    findings = []
    for dev, port in ports:
        subject = _port_subject(dev, port)
        layer = port.get("link_layer") or "?"
        state, phys = port.get("state"), port.get("phys_state")
        # An RDMA port NCCL is told to use, or any InfiniBand port, carries training traffic: down is a failure.
        carries_training = layer == "InfiniBand" or _named_by_nccl(dev.get("name") or "", env)
        problems, severity = [], "ok"
        if state != "ACTIVE" or (phys and phys != "LinkUp"):
            problems.append(f"state {state or '?'} / {phys or '?'} (expected ACTIVE / LinkUp)")
            severity = "fail" if carries_training else "warn"
        key = (dev.get("hca_type"), layer)
        rate, best = port.get("rate_gbps"), fastest.get(key)
        if state == "ACTIVE" and rate and best and rate < best:
            problems.append(f"rate {port.get('rate')}, below the {best:g} Gb/s of its sibling {dev.get('hca_type')} "
                            "ports (a link trained at a lower speed or width)")
            severity = "fail" if severity == "fail" else "warn"
        counters = port.get("counters")
        grown = {}
        if counters:
            grown = {name: counters[name] for name, limit in IB_COUNTER_WARN.items()
                     if counters.get(name) is not None and counters[name] >= limit}
            if grown:
                problems.append("error counters " + ", ".join(f"{k} {v}" for k, v in grown.items()))
                severity = "fail" if severity == "fail" else "warn"
        measured = {"state": state, "phys_state": phys, "rate_gbps": rate, "fastest_sibling_gbps": best,
                    "link_layer": layer, "counters": counters, "fw_ver": dev.get("fw_ver")}
        if problems:
            findings.append(Finding("ib_port", severity, f"{subject} ({layer}): " + "; ".join(problems),
                                    subject=subject, measured=measured,
                                    cause="a cable, transceiver or switch port: reseat or replace it; counters "
                                          "count since the HCA came up (clear with perfquery -x)",
                                    handbook=["nccl-ib-async-event-port-error", "nccl-low-busbw-inter-node"]))
        elif counters is None:
            findings.append(inconclusive("ib_port", f"{subject} ({layer}): {state} at {port.get('rate')}; error "
                                         "counters not in this fingerprint", subject=subject, measured=measured))
        else:
            nonzero = {k: v for k, v in counters.items() if v}
            findings.append(ok("ib_port", f"{subject} ({layer}): {state} at {port.get('rate')}, error counters "
                               + (", ".join(f"{k} {v}" for k, v in nonzero.items()) + " (below the warning levels)"
                                  if nonzero else "0"), subject=subject, measured=measured))
    return findings


COUNTER_CHECKS = {"nvlink_errors": check_nvlink_errors, "pcie_replay": check_pcie_replay, "ib_port": check_ib_ports}
