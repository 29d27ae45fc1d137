"""Consistency: the same driver, CUDA, NCCL, torch, VBIOS and HCA firmware on every node of a job (the odd node
named), and the same VBIOS and HCA firmware on every GPU and HCA of one node. Pure functions of fingerprints."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from mleng.doctor.findings import Finding, fail, inconclusive, ok, warn


def _devices(fp: dict[str, Any]) -> list[dict[str, Any]]:
    gpus = fp.get("gpus") or {}
    return [d for d in gpus.get("devices") or [] if "error" not in d] if gpus.get("available") else []


def _spread(values: list[str | None]) -> str | None:
    """'96.00.A5.00.1A' when all agree, '96.00.A5.00.1A x6, 96.00.74.00.01 x2' when not, None when none is known."""
    known = Counter(v for v in values if v)
    if not known:
        return None
    if len(known) == 1:
        return next(iter(known))
    return ", ".join(f"{v} x{n}" for v, n in sorted(known.items(), key=lambda kv: (-kv[1], kv[0])))


def _hca_firmware(fp: dict[str, Any]) -> str | None:
    ib = fp.get("infiniband") or {}
    if not ib.get("available"):
        return None
    by_type: dict[str, list[str | None]] = {}
    for dev in ib.get("devices") or []:
        by_type.setdefault(dev.get("hca_type") or "?", []).append(dev.get("fw_ver"))
    parts = [f"{hca} {_spread(fw)}" for hca, fw in sorted(by_type.items()) if _spread(fw)]
    return "; ".join(parts) or None


# (field, what it is, how to read it from a fingerprint, severity when nodes differ)
FIELDS: tuple[tuple[str, str, Callable[[dict[str, Any]], Any], str], ...] = (
    ("driver", "NVIDIA driver", lambda fp: (fp.get("gpus") or {}).get("driver"), "fail"),
    ("cuda_driver", "CUDA version of the driver", lambda fp: (fp.get("gpus") or {}).get("cuda_driver"), "fail"),
    ("torch", "torch", lambda fp: (fp.get("software") or {}).get("torch"), "fail"),
    ("cuda", "CUDA torch was built with", lambda fp: (fp.get("software") or {}).get("cuda"), "fail"),
    ("nccl", "NCCL", lambda fp: (fp.get("software") or {}).get("nccl"), "fail"),
    ("gpu_model", "GPU model and count",
     lambda fp: _spread([d.get("name") for d in _devices(fp)]) and
     f"{len(_devices(fp))}x {_spread([d.get('name') for d in _devices(fp)])}", "warn"),
    ("vbios", "GPU VBIOS", lambda fp: _spread([d.get("vbios") for d in _devices(fp)]), "warn"),
    ("hca_firmware", "HCA firmware", _hca_firmware, "warn"),
    ("os", "OS release", lambda fp: (fp.get("os") or {}).get("name"), "warn"),
    ("kernel", "Linux kernel", lambda fp: (fp.get("os") or {}).get("kernel"), "warn"),
)
WHY = {
    "fail": "ranks on different driver/CUDA/NCCL/torch builds can hang or disagree in a collective; install the "
            "same stack everywhere",
    "warn": "firmware or kernel drift: the odd node behaves differently under load; update it to match",
}


def compare_nodes(fingerprints: dict[str, dict[str, Any]]) -> list[Finding]:
    """One finding per field: ok when every node agrees, else the odd node(s) named against the majority."""
    nodes = sorted(fingerprints)
    if len(nodes) < 2:
        return [inconclusive("consistency", f"{len(nodes)} node(s) with a fingerprint: nothing to compare")]
    findings = []
    for field, what, read, severity in FIELDS:
        values = {}
        for node in nodes:
            try:
                values[node] = read(fingerprints[node] or {})
            except (AttributeError, TypeError):
                values[node] = None
        known = {n: v for n, v in values.items() if v is not None}
        unknown = [n for n in nodes if values[n] is None]
        note = f" (unknown on {', '.join(unknown)})" if unknown else ""
        if not known:
            if field in ("vbios", "hca_firmware", "gpu_model"):
                continue  # no GPU or no HCA anywhere: nothing of this kind to compare
            findings.append(inconclusive("consistency", f"{what}: not known on any node", subject=field))
            continue
        counts = Counter(known.values())
        if len(counts) == 1:
            findings.append(ok("consistency", f"{what}: {next(iter(counts))} on all {len(known)} node(s){note}",
                               subject=field, measured=values))
            continue
        ranked = counts.most_common()
        majority, top = ranked[0]
        if len(ranked) > 1 and ranked[1][1] == top:
            groups = "; ".join(f"{', '.join(n for n in nodes if values[n] == v)}: {v}" for v, _ in ranked)
            # no majority (two nodes, or an even split): which one is odd cannot be told, so none is named to drain
            text, odd = f"{what} differs with no majority: {groups}{note}", []
        else:
            odd = [n for n in nodes if n in known and values[n] != majority]
            text = (f"{what}: {', '.join(f'{n} has {values[n]}' for n in odd)}, the other {top} node(s) "
                    f"{majority}{note}")
        finding = (fail if severity == "fail" else warn)("consistency", text, subject=field, cause=WHY[severity],
                                                         measured={"values": values, "odd_nodes": odd,
                                                                   "majority": majority if top > 1 else None},
                                                         handbook=["stragglers-across-nodes"] + (
                                                             ["cuda-driver-too-old"] if field in ("driver", "cuda_driver")
                                                             else []))
        findings.append(finding)
    return findings


def check_firmware_within_node(fp: dict[str, Any]) -> list[Finding]:
    """Every GPU on the same VBIOS and every HCA of one model on the same firmware (a board swapped in from
    spares often brings an older one)."""
    findings = []
    devices = _devices(fp)
    if devices:
        vbios = Counter(d.get("vbios") for d in devices if d.get("vbios"))
        if not vbios:
            findings.append(inconclusive("firmware", "GPU VBIOS versions not readable"))
        elif len(vbios) > 1:
            majority = vbios.most_common(1)[0][0]
            odd = [f"gpu {d.get('index')} {d.get('vbios')}" for d in devices if d.get("vbios") not in (None, majority)]
            findings.append(warn("firmware", f"GPU VBIOS differs across this node's GPUs: {', '.join(odd)}; the "
                                 f"others {majority}", subject="vbios", measured=dict(vbios),
                                 cause="a GPU or baseboard replaced from spares: flash the fleet's VBIOS"))
        else:
            findings.append(ok("firmware", f"all {len(devices)} GPU(s) on VBIOS {next(iter(vbios))}", subject="vbios",
                               measured=dict(vbios)))
    ib = fp.get("infiniband") or {}
    if ib.get("available"):
        by_type: dict[str, Counter] = {}
        for dev in ib.get("devices") or []:
            if dev.get("fw_ver"):
                by_type.setdefault(dev.get("hca_type") or "?", Counter())[dev["fw_ver"]] += 1
        for hca, versions in sorted(by_type.items()):
            if len(versions) > 1:
                majority = versions.most_common(1)[0][0]
                odd = [f"{d['name']} {d['fw_ver']}" for d in ib.get("devices") or []
                       if (d.get("hca_type") or "?") == hca and d.get("fw_ver") not in (None, majority)]
                findings.append(warn("firmware", f"{hca} HCA firmware differs on this node: {', '.join(odd)}; the "
                                     f"others {majority}", subject="hca_firmware", measured=dict(versions),
                                     cause="update with mlxfwmanager / flint so every port runs the same firmware"))
            else:
                findings.append(ok("firmware", f"{sum(versions.values())} {hca} HCA(s) on firmware "
                                   f"{next(iter(versions))}", subject="hca_firmware", measured=dict(versions)))
    return findings
