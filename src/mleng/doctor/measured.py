"""The doctor's quick measurements judged: each headline against its spec, in bands that say what is normal.
Each finding is named after the command that measured it: mamf, comm, membw, io."""

from __future__ import annotations

from typing import Any

from mleng.doctor.findings import Finding, inconclusive, ok, warn

# Bands that say what is normal. MAMF efficiency against the datasheet: the book's measured
# table spans 72-87% on NVIDIA parts (H100 SXM 80.3%, B200 77.6%), 51-68% on AMD, 74-97% on Gaudi.
MATMUL_BANDS = {"nvidia": (0.72, 0.60), "amd": (0.50, 0.40), "intel": (0.70, 0.55), "default": (0.65, 0.50)}
# busbw against the link's unidirectional spec: a well-set node reaches about 80% (A100 78%, H200 82%).
BUSBW_BANDS = (0.70, 0.50)
# Copy bandwidth against the HBM spec (H200: ~4.3 of 4.8 TB/s through PyTorch).
MEMBW_BANDS = (0.80, 0.65)
CHECKPOINT_WRITE_WARN_GBPS = 0.2


def _band(ratio: float, bands: tuple[float, float]) -> str:
    good, poor = bands
    return "ok" if ratio >= good else ("warn" if ratio >= poor else "fail")


def judge_ratio(check: str, what: str, value: float | None, theoretical: float | None, unit: str,
                bands: tuple[float, float], handbook: list[str], subject: str | None = None,
                no_reference: str = "no reference rate for this device") -> Finding:
    if value is None:
        return inconclusive(check, f"{what}: not measured", subject=subject)
    if not theoretical:
        return inconclusive(check, f"{what}: {value:.4g} {unit}; {no_reference}", measured=value, subject=subject)
    ratio = value / theoretical
    severity = _band(ratio, bands)
    text = (f"{what}: {value:.4g} {unit}, {ratio * 100:.0f}% of the spec {theoretical:.4g} {unit} "
            f"(normal: >= {bands[0] * 100:.0f}%)")
    return Finding(check, severity, text, measured=value, expected=theoretical, subject=subject,
                   handbook=handbook if severity != "ok" else [])


def check_matmul(summary: dict[str, Any], vendor: str | None) -> Finding:
    bands = MATMUL_BANDS.get((vendor or "").lower(), MATMUL_BANDS["default"])
    finding = judge_ratio("mamf", f"matmul ({summary.get('dtype', '?')})", summary.get("value"),
                          summary.get("theoretical"), "TFLOPS", bands, ["low-matmul-tflops", "gpu-clock-throttling"],
                          no_reference="no datasheet peak for this device (a CPU has none in the specs)")
    if finding.severity in ("warn", "fail") and summary.get("stop_reason") in ("time budget", "interrupted"):
        # A search cut short is a lower bound on the ceiling: enough to pass a card, never to fail one.
        finding.severity = "inconclusive"
        finding.handbook = []
        finding.summary += (f"; the search stopped ({summary.get('stop_reason')}) after {summary.get('shapes_tried')} "
                            "shapes, so this is a lower bound, not a verdict: run `mleng mamf` for the full search")
    return finding


def check_busbw(summary: dict[str, Any]) -> Finding:
    return judge_ratio("comm", f"{summary.get('op', 'all_reduce')} peak busbw", summary.get("value"),
                       summary.get("theoretical"), "GB/s", BUSBW_BANDS,
                       ["nccl-low-busbw-intra-node", "nccl-p2p-disable-left-set"],
                       no_reference="no link spec for this transport (gloo over loopback has none)")


def check_membw(summary: dict[str, Any]) -> Finding:
    return judge_ratio("membw", f"{summary.get('device', 'device')} memory copy bandwidth", summary.get("value"), summary.get("theoretical"),
                       summary.get("unit", "GB/s"), MEMBW_BANDS, ["low-matmul-tflops"],
                       no_reference="no memory-bandwidth spec for this device")


def check_storage(write_gbps: float | None, path: str) -> Finding:
    if write_gbps is None:
        return inconclusive("io", f"{path}: checkpoint write throughput not measured", subject=path)
    text = f"{path}: checkpoint-style sequential write {write_gbps:.2f} GB/s (fsync'd)"
    if write_gbps < CHECKPOINT_WRITE_WARN_GBPS:
        return warn("io", text + f": a 100 GB checkpoint would take {100 / write_gbps / 60:.0f} min",
                    measured=write_gbps, subject=path, handbook=["slow-checkpoint-save-shared-fs"])
    return ok("io", text, measured=write_gbps, subject=path)
