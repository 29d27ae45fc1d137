"""GPU history: a finding remembers the GPU's UUID in the store, so the doctor can say "GPU-... failed sm_clock
on 3 of its last 5 runs" (the same broken card again, even after it moved to another node)."""

from __future__ import annotations

from typing import Any

from mleng.doctor.findings import Finding, fail, inconclusive, ok, warn

RUNS = 5
# This many failures of one check among a GPU's last RUNS runs (this one included) make it a repeat offender.
REPEAT_FAILS = 2
# Checks left out of the count: a kernel-log Xid is read again by every run until the node reboots, so the
# same event would count as a repeat. The checks counted read the GPU's present state.
NOT_COUNTED = frozenset({"xid", "gpu_history"})


def attach_gpu_uuids(findings: list[Finding], fp: dict[str, Any]) -> None:
    """Set gpu_uuid on every finding about one GPU ('gpu N (...)', or a kernel-log line that named its UUID)."""
    devices = ((fp.get("gpus") or {}).get("devices")) or []
    by_index = {d.get("index"): d.get("uuid") for d in devices if d.get("uuid")}
    for finding in findings:
        if finding.gpu_uuid:
            continue
        subject = finding.subject or ""
        if subject.startswith("gpu ") and subject.split(" ")[1].isdigit():
            finding.gpu_uuid = by_index.get(int(subject.split(" ")[1]))
        elif isinstance(finding.measured, dict) and str(finding.measured.get("uuid") or "").startswith("GPU-"):
            finding.gpu_uuid = finding.measured["uuid"]


def _short(uuid: str) -> str:
    return uuid[:12] + "..." if len(uuid) > 15 else uuid


def history_findings(findings: list[Finding], fp: dict[str, Any], store_path=None, runs: int = RUNS,
                     current_id: str | None = None) -> list[Finding]:
    """One finding per GPU that failed a check in its recent runs; or one ok line when none did."""
    from mleng.errors import MlengError
    from mleng.results.store import Store

    current: dict[str, dict[str, str]] = {}
    index_of: dict[str, int | None] = {}
    order = {"fail": 0, "warn": 1, "inconclusive": 2, "ok": 3, "skipped": 4}
    for finding in findings:
        if not finding.gpu_uuid or finding.check in NOT_COUNTED:
            continue
        checks = current.setdefault(finding.gpu_uuid, {})
        if finding.check not in checks or order[finding.severity] < order[checks[finding.check]]:
            checks[finding.check] = finding.severity
        subject = finding.subject or ""
        if subject.startswith("gpu ") and subject.split(" ")[1].isdigit():
            index_of[finding.gpu_uuid] = int(subject.split(" ")[1])
    if not current:
        return []
    try:
        with Store(store_path, create=False) as store:
            past = store.gpu_history(sorted(current), limit_runs=runs - 1, exclude_id=current_id)
    except MlengError as exc:
        return [inconclusive("gpu_history", f"GPU history not read: {exc}")]
    out = []
    names = {d.get("uuid"): d.get("name") for d in (fp.get("gpus") or {}).get("devices") or []}
    for uuid, now in sorted(current.items(), key=lambda kv: (index_of.get(kv[0]) is None, index_of.get(kv[0]) or 0)):
        earlier = past.get(uuid) or []
        total = len(earlier) + 1
        checks = sorted((set(now) | {c for run in earlier for c in run["checks"]}) - NOT_COUNTED)
        repeated = []
        for check in checks:
            failed = (now.get(check) == "fail") + sum(run["checks"].get(check) == "fail" for run in earlier)
            if failed:
                repeated.append((check, failed, now.get(check)))
        if not repeated:
            continue
        index = index_of.get(uuid)
        subject = f"gpu {index} ({names.get(uuid)})" if index is not None else _short(uuid)
        hosts = sorted({run["host"] for run in earlier if run.get("host")} | {(fp.get("host") or {}).get("hostname") or ""})
        moved = [h for h in hosts if h]
        parts = [f"failed {check} on {n} of its last {total} run(s)" + ("" if now_sev == "fail" else
                                                                          f" (now {now_sev or 'not checked'})")
                 for check, n, now_sev in repeated]
        text = f"{uuid}: " + "; ".join(parts) + (f"; seen on {', '.join(moved)}" if len(moved) > 1 else "")
        measured = {"uuid": uuid, "runs": total, "failures": {c: n for c, n, _ in repeated},
                    "previous": [r["measurement_id"] for r in earlier]}
        worst_now = [c for c, n, now_sev in repeated if now_sev == "fail" and n >= REPEAT_FAILS]
        if worst_now:
            out.append(fail("gpu_history", text + ": the same GPU again, drain it rather than retry",
                            subject=subject, measured=measured, gpu_uuid=uuid,
                            handbook=["dcgm-diag-failures", "stragglers-across-nodes"]))
        elif any(now_sev != "fail" for _c, _n, now_sev in repeated):
            out.append(warn("gpu_history", text + ": intermittent: it passes now but failed before",
                            subject=subject, measured=measured, gpu_uuid=uuid, handbook=["dcgm-diag-failures"]))
        else:
            out.append(ok("gpu_history", text + ": the first failure on record for this GPU", subject=subject,
                          measured=measured, gpu_uuid=uuid))
    if not out:
        seen = sum(1 for uuid in current if past.get(uuid))
        out.append(ok("gpu_history", f"{len(current)} GPU(s) by UUID: none failed a check of its state (clocks, "
                      "ECC, links, counters, settings) in this run"
                      + (f" or in its last {runs - 1} stored run(s) ({seen} with earlier runs)" if seen else
                         "; no earlier doctor run of them in the store") + " (kernel-log Xids are not counted: "
                      "each run reads them again until the node reboots)",
                      measured={"gpus": len(current), "with_history": seen}))
    return out
