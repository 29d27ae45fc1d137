"""Rank 0 of mleng.preflight(): every rank's report judged into findings and one verdict, and the summary printed."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from mleng.measure.sizes import format_bytes
from mleng.preflight.session import SLOT_ELEMENTS, _Session

if TYPE_CHECKING:
    from mleng.results.record import Measurement


# Below this share of the link's spec the probe's bus bandwidth is worth a warning (a quick probe at one
# size does not reach the peak a full `mleng comm` sweep finds, so this is not a pass mark).
LOW_BUSBW_RATIO = 0.25

# ---------------------------------------------------------------------------------------------
# Judging, on rank 0
# ---------------------------------------------------------------------------------------------
def _ranks_text(ranks: list[int], hosts: list[str]) -> str:
    shown = ", ".join(str(r) for r in ranks[:16]) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
    on = sorted({hosts[r] for r in ranks})
    return f"rank{'s' if len(ranks) > 1 else ''} {shown} (on {', '.join(on[:8])}{', ...' if len(on) > 8 else ''})"

def stragglers(rates: dict[Any, float], ratio: float) -> list[tuple[Any, float, float]]:
    """(who, rate, median of the others) for each member below ratio x the median of the others."""
    if ratio <= 0 or len(rates) < 2:
        return []
    out = []
    for who, rate in rates.items():
        others = [v for k, v in rates.items() if k != who]
        median = statistics.median(others)
        if median > 0 and rate < ratio * median:
            out.append((who, rate, median))
    return out

def _judge(session: _Session, params: dict, reports: list[dict | None], joined_s: float, started: float):
    from mleng.doctor.findings import Finding, fail, inconclusive, ok, skipped, warn
    from mleng.measure import collectives
    from mleng.results.record import Measurement

    n = session.world_size
    hosts = [r["host"] for r in session.ranks]
    ratio = params["straggler_ratio"]
    findings: list[Finding] = []
    problems: list[str] = []

    def add(finding: Finding) -> None:
        findings.append(finding)
        if finding.severity == "fail":
            problems.append(finding.summary)

    host_list = list(dict.fromkeys(hosts))
    add(ok("join", f"{n}/{n} rank{'s' if n != 1 else ''} on {len(host_list)} host{'s' if len(host_list) != 1 else ''} "
                   f"joined in {joined_s:.2f} s ({session.mode})", measured=round(joined_s, 3)))
    launch_problems = [(r["rank"], r.get("launch_problem")) for r in session.ranks if r.get("launch_problem")]
    if launch_problems:
        bad = [r for r, _ in launch_problems]
        add(fail("launch", f"{_ranks_text(bad, hosts)}: {launch_problems[0][1]}",
                 cause="the script and its launcher disagree about which rank it is"))
    missing = [r for r in range(n) if reports[r] is None]
    if missing:
        add(fail("report", f"{_ranks_text(missing, hosts)} did not report within {session.timeout:g} s: died, hung, "
                           "or still busy", cause="look at those ranks' output"))
    got = {r: rep for r, rep in enumerate(reports) if rep is not None}
    for r, rep in got.items():
        for error in rep.get("errors") or []:
            add(fail("collective", f"rank {r} ({hosts[r]}): {error}"))

    # correctness: a sender wrong on every receiver's all-gather sent wrong data; a rank whose result (or
    # gathered pieces) alone are wrong received wrong data; a result wrong everywhere with every piece right
    # is the reduction itself
    if n > 1:
        views = {r: rep["all_reduce"] for r, rep in got.items() if rep.get("all_reduce")}
        if views:
            senders = sorted(set.intersection(*(set(v["wrong_senders"]) for v in views.values())))
            if len(views) == 1 and len(senders) == n:
                senders = []  # one view where everything is wrong says more about that rank than about all others
            reduced_wrong = {r for r, v in views.items() if v["wrong_slots"]}
            receivers = sorted(r for r, v in views.items()
                               if set(v["wrong_senders"]) - set(senders)
                               or (v["wrong_slots"] and not senders and len(reduced_wrong) < len(views)))
            example = next((v["example"] for v in views.values() if v["example"]), None)
            seen = (f" (slot {example['slot']}: expected {example['expected']}, got {example['got']})"
                    if example else "")
            if senders:
                add(fail("all_reduce", f"{_ranks_text(senders, hosts)} contributed wrong values to an all-reduce "
                                       f"of known values, seen wrong by every rank{seen}",
                         cause="that rank's GPU or memory produced wrong data before it was sent",
                         handbook=["ecc-uncorrectable-errors"]))
            if receivers:
                add(fail("all_reduce", f"{_ranks_text(receivers, hosts)} received a wrong all-reduce result "
                                       "(the other ranks' results were right)",
                         cause="a link into that rank, or its memory, corrupts data"))
            if not senders and not receivers and reduced_wrong:
                add(fail("all_reduce", f"the all-reduce of known values is wrong on every rank{seen}, though every "
                                       "rank's contribution arrived right in an all-gather: the reduction is wrong",
                         cause="a collective library or driver fault; run `mleng comm --check` and `mleng check`"))
            if not senders and not receivers and not reduced_wrong:
                worst = max(v["ms"] for v in views.values())
                add(ok("all_reduce", f"known values correct on all {len(views)} ranks ({n} x {SLOT_ELEMENTS} "
                                     f"slots, {worst:.1f} ms)"))
    else:
        add(skipped("all_reduce", "one rank: nothing to reduce across ranks"))

    # bus bandwidth: the job's, against the spec; correctness at the probe size
    busbw_rows = [rep["busbw"] for rep in got.values() if rep.get("busbw")]
    reference, note = collectives.reference_rate(session.backend or "", session.ranks, None)
    busbw = None
    if busbw_rows:
        row = busbw_rows[0]
        busbw = row["busbw_gbps"]
        wrong = {r: rep["busbw"]["wrong"] for r, rep in got.items() if rep.get("busbw") and rep["busbw"]["wrong"]}
        if wrong:
            add(fail("all_reduce", f"{_ranks_text(sorted(wrong), hosts)} got wrong elements in the "
                                   f"{format_bytes(row['size_bytes'])} all-reduce ({sum(wrong.values())} in all)",
                     cause="data corrupted on a link or in memory at large message sizes"))
        text = (f"all_reduce {format_bytes(row['size_bytes'])}: {busbw:.3g} GB/s busbw, slowest rank "
                f"({row['time_us']:.0f} us, {row['iters']} x {row['repeats']})")
        if reference:
            share = busbw / reference
            text += f" = {share * 100:.0f}% of {reference:g} GB/s ({note})"
            add((warn if share < LOW_BUSBW_RATIO else ok)("busbw", text, measured=busbw, expected=reference,
                                                          handbook=["nccl-low-busbw-intra-node" if len(host_list) == 1
                                                                    else "nccl-low-busbw-inter-node"]
                                                          if share < LOW_BUSBW_RATIO else []))
        else:
            add(inconclusive("busbw", f"{text}; {note}", measured=busbw))
    elif n > 1:
        add(inconclusive("busbw", "not measured: an earlier collective failed"))
    else:
        add(skipped("busbw", "one rank: nothing crosses a link"))

    # node against node
    node_rows = {}
    for rep in got.values():
        row = rep.get("node_busbw")
        if row and row["host"] not in node_rows:
            node_rows[row["host"]] = row["busbw_gbps"]
    if node_rows:
        slow = stragglers(node_rows, ratio)
        summary = ", ".join(f"{h} {v:.3g}" for h, v in node_rows.items())
        if slow:
            add(fail("node_busbw", "straggler node(s): " + "; ".join(
                f"{h} {v:.3g} GB/s against {m:.3g} GB/s on the others" for h, v, m in slow)
                + f" (within-node all-reduce busbw: {summary})", cause="a slower or misconfigured link inside that node",
                handbook=["nccl-low-busbw-intra-node"]))
        else:
            add(ok("node_busbw", f"within-node all-reduce busbw by node, GB/s: {summary}"))

    # stragglers: ranks, then nodes
    rates = {r: rep["compute"]["tflops"] for r, rep in got.items() if rep.get("compute")}
    if rates:
        first = next(rep["compute"] for rep in got.values() if rep.get("compute"))
        low, high = min(rates.values()), max(rates.values())
        spread = (f"{low:.3g}-{high:.3g} TFLOPS per rank" if n > 1 else f"{low:.3g} TFLOPS") + \
            f" ({first['dtype']} {first['shape']} matmuls)"
        # CPU ranks that outnumber their host's cores time their contention, not themselves
        crowded = sorted({hosts[r] for r, rep in got.items() if rep.get("compute", {}).get("device") == "cpu"
                          and sum(1 for h in hosts if h == hosts[r]) > (rep["compute"].get("host_cpus") or 10**9)})
        if crowded:
            counts = {h: sum(1 for x in hosts if x == h) for h in crowded}
            cpus = {hosts[r]: rep["compute"].get("host_cpus") for r, rep in got.items() if hosts[r] in crowded}
            add(inconclusive("straggler", "CPU ranks outnumber the cores on " + ", ".join(
                f"{h} ({counts[h]} ranks, {cpus[h]} cores)" for h in crowded)
                + f", so their speeds measure the crowding, not the ranks: {spread}", measured=rates))
            rates = {r: v for r, v in rates.items() if hosts[r] not in crowded}
        slow = stragglers(rates, ratio)
        per_host: dict[str, list[float]] = {}
        for r, v in rates.items():
            per_host.setdefault(hosts[r], []).append(v)
        host_rates = {h: statistics.median(v) for h, v in per_host.items()}
        slow_hosts = stragglers(host_rates, ratio) if len(host_rates) > 1 else []
        if slow:
            add(fail("straggler", "straggler rank(s): " + "; ".join(
                f"rank {r} ({hosts[r]}) {v:.3g} TFLOPS against {m:.3g} on the others" for r, v, m in slow)
                + f" (below {ratio:g} x; {spread})",
                cause="a throttled or busy GPU/CPU on that rank: the whole job runs at its pace",
                handbook=["gpu-clock-throttling"]))
        if slow_hosts:
            add(fail("straggler", "straggler node(s): " + "; ".join(
                f"{h} {v:.3g} TFLOPS per rank against {m:.3g} on the others" for h, v, m in slow_hosts)))
        if not slow and not slow_hosts and rates:
            add(ok("straggler", f"no rank below {ratio:g} x the others' median: {spread}"
                   if n > 1 else f"one rank: {spread}", measured=rates))

    # each rank's GPU
    for r, rep in got.items():
        for row in rep.get("gpu") or []:
            if row["severity"] in ("skipped",):
                row = dict(row, severity="inconclusive")
            finding = Finding(**row)
            if finding.severity == "fail":
                problems.append(finding.summary)
            findings.append(finding)
    cpu_only = [f for f in findings if f.check == "gpu" and f.severity == "inconclusive"]
    if len(cpu_only) > 1 and len(cpu_only) == n:  # one line for a job of CPU ranks
        findings = [f for f in findings if f not in cpu_only]
        findings.append(inconclusive("gpu", f"all {n} ranks run on the CPU: GPU clocks, ECC and NUMA binding not "
                                            "checked (no GPU visible)"))

    record = Measurement.start("preflight", params)
    record.rows = [f.to_row() for f in findings]
    counts = {s: sum(1 for f in findings if f.severity == s) for s in ("fail", "warn", "ok", "inconclusive", "skipped")}
    verdict = "fail" if counts["fail"] else ("warn" if counts["warn"] else "ok")
    record.summary = {
        "verdict": verdict, "problems": problems, "counts": counts, "world_size": n, "hosts": host_list,
        "group": session.mode, "backend": session.backend, "device": session.device.split(":")[0],
        "value": busbw, "unit": "GB/s", "metric": "probe busbw", "theoretical": reference,
        "ratio": (busbw / reference) if busbw and reference else None, "theoretical_source": note,
        "join_s": round(joined_s, 3), "compute_tflops": rates,
        "ranks": [{k: v for k, v in r.items() if k not in ("params", "params_digest", "launch_problem")}
                  for r in session.ranks],
    }
    record.params["launch"] = session.launch.mode if session.launch else None
    from mleng.machine.fingerprint import collect_for_record

    record.machine = collect_for_record(gpus=session.device.startswith("cuda"))
    record.finish("complete")
    record.elapsed_s = round(time.monotonic() - started, 3)
    return record

MARK = {"fail": "FAIL", "warn": "WARN", "ok": "ok", "inconclusive": "??", "skipped": "--"}

def render(record, stored: str | None = None) -> str:
    """Rank 0's summary: one line per check, the verdict, where the record is."""
    s = record.summary
    hosts = s["hosts"]
    lines = [f"mleng preflight: {s['world_size']} rank{'s' if s['world_size'] != 1 else ''} on {len(hosts)} "
             f"host{'s' if len(hosts) != 1 else ''} ({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''}), "
             f"{s['group']}" + (f", backend {s['backend']}" if s.get("backend") else "") + f", {record.elapsed_s:.1f} s"]
    for row in record.rows:
        lines.append(f"[{MARK[row['severity']]:>4}] {row['check']:<11} {row['summary']}")
        if row["severity"] in ("fail", "warn") and row.get("handbook"):
            lines.append(f"{'':18}read: " + ", ".join(f"mleng handbook show {h}" for h in row["handbook"][:3]))
    counts = s["counts"]
    lines.append(f"verdict: {s['verdict'].upper()} ({counts['fail']} fail, {counts['warn']} warn, {counts['ok']} ok, "
                 f"{counts['inconclusive']} inconclusive)" + (f"; stored as {stored}" if stored else ""))
    return "\n".join(lines)
