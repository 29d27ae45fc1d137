"""A self-contained HTML page for stored runs: plots as inline SVG, tables, no external resources."""

from __future__ import annotations

import html
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from mleng.measure.sizes import format_bytes
from mleng.report.svg import bar_chart, line_chart
from mleng.results.record import Measurement

STYLE = """
body { font-family: system-ui, -apple-system, Segoe UI, Roboto, sans-serif; margin: 24px auto; max-width: 1000px;
       color: #222; line-height: 1.4; }
h1 { font-size: 22px; } h2 { font-size: 18px; border-bottom: 1px solid #ddd; padding-bottom: 4px; margin-top: 36px; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: right; }
th { background: #f4f4f4; } td.text { text-align: left; }
.headline { font-size: 16px; margin: 6px 0 12px; }
.sev-fail { background: #fdd; } .sev-warn { background: #ffeebb; } .sev-ok { background: #e6f4e6; }
.sev-skipped, .sev-inconclusive { background: #f0f0f0; color: #666; }
.scroll { overflow-x: auto; } .meta { color: #666; font-size: 12px; } .chart { margin: 8px 0; border: 1px solid #eee; }
"""
MAX_TABLE_ROWS = 60


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return _esc(str(value)[:80])
    return _esc("-" if value is None else value)



def rows_table(rows: list[dict[str, Any]], columns: list[str] | None = None, limit: int = MAX_TABLE_ROWS) -> str:
    if not rows:
        return ""
    if columns is None:
        columns = []
        for row in rows:
            columns += [k for k, v in row.items() if k not in columns and not isinstance(v, (dict, list))]
    head = "".join(f"<th>{_esc(c)}</th>" for c in columns)
    body = []
    for row in rows[:limit]:
        cells = "".join(f'<td class="{"text" if isinstance(row.get(c), str) else ""}">{_fmt(row.get(c))}</td>'
                        for c in columns)
        severity = row.get("severity")
        body.append(f'<tr class="sev-{_esc(severity)}">{cells}</tr>' if severity else f"<tr>{cells}</tr>")
    more = f'<p class="meta">{len(rows) - limit} more rows in the record</p>' if len(rows) > limit else ""
    return f"<div class=\"scroll\"><table><tr>{head}</tr>{''.join(body)}</table></div>{more}"


def _collective_section(m: Measurement) -> str:
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in m.rows:
        if row.get("busbw_gbps") is not None and row.get("size_bytes"):
            series[str(row.get("op", "op"))].append((float(row["size_bytes"]), float(row["busbw_gbps"])))
    theoretical = m.summary.get("theoretical")
    reference = (float(theoretical), f"link spec {theoretical:.4g} GB/s") if theoretical else None
    chart = line_chart("busbw against message size", series, "message size per rank", "busbw (GB/s, base 10)",
                       log_x=True, reference=reference, x_format=format_bytes)
    note = "" if reference else f'<p class="meta">{_esc(m.summary.get("theoretical_source") or "no link spec to compare")}</p>'
    columns = ["op", "size_bytes", "count", "dtype", "time_us", "time_p99_us", "time_cv", "algbw_gbps", "busbw_gbps"]
    return chart + note + rows_table(m.rows, [c for c in columns if any(c in r for r in m.rows)])


def _mamf_section(m: Measurement) -> str:
    parts = []
    per_device = m.summary.get("per_device")
    theoretical = m.summary.get("theoretical")
    reference = (float(theoretical), f"datasheet {theoretical:.4g} TFLOPS") if theoretical else None
    if per_device:
        slowest = m.summary.get("slowest_device")
        bars = [(f"GPU {d['device']}", float(d["tflops_median"] or 0)) for d in per_device]
        parts.append(bar_chart("best median TFLOPS per GPU (slowest in red)", bars, "TFLOPS", reference,
                               highlight={f"GPU {slowest}"}, highlight_label="slowest"))
        parts.append(rows_table(per_device, ["device", "device_name", "best_shape", "tflops_median", "tflops_max",
                                             "sm_clock_mhz_mean", "power_w_mean", "below_max_clock", "status"]))
    ranked = _ranked_shapes(m)
    if ranked:
        # One bar per shape (its most-measured row) and one "best": the headline's shape, not a
        # few-iteration screening sample that happened to read higher.
        s = m.summary
        best_label = (f"{s['m']}x{s['n']}x{s['k']}" if s.get("m") else f"{ranked[0]['m']}x{ranked[0]['n']}x{ranked[0]['k']}")
        per_shape: dict[str, dict[str, Any]] = {}
        for r in ranked:
            per_shape.setdefault(f"{r['m']}x{r['n']}x{r['k']}", r)
        bars = [(label, float(r["tflops_median"])) for label, r in list(per_shape.items())[:25]]
        parts.append(bar_chart("TFLOPS per shape around the best (median per shape, MxNxK)", bars, "TFLOPS",
                               reference, highlight={best_label}, highlight_label="best"))
    timeline = (m.summary.get("gpu_monitor") or {}).get("timeline") or []
    if timeline:
        clocks = [(s["t_s"], s["sm_clock_mhz"]) for s in timeline if s.get("sm_clock_mhz") is not None]
        power = [(s["t_s"], s["power_w"]) for s in timeline if s.get("power_w") is not None]
        max_clock = (m.summary.get("gpu_monitor") or {}).get("sm_clock_max_mhz")
        parts.append(line_chart("SM clock during the run", {"SM clock (MHz)": clocks}, "seconds", "MHz",
                                reference=(float(max_clock), f"max {max_clock:.0f} MHz") if max_clock else None))
        if power:
            parts.append(line_chart("power during the run", {"power (W)": power}, "seconds", "W"))
    parts.append(rows_table(ranked[:20], ["m", "n", "k", "dtype", "tflops_median", "tflops_mean", "tflops_max",
                                          "time_us_median", "iters", "phase"]))
    return "".join(parts)


def _ranked_shapes(m: Measurement) -> list[dict[str, Any]]:
    """Rows of the headline's phase first (the re-measured finalists), each group fastest first."""
    headline_phase = m.summary.get("best_phase") or "final"
    rows = [r for r in m.rows if r.get("tflops_median") is not None]
    return sorted(rows, key=lambda r: (r.get("phase") != headline_phase, -(r.get("iters") or 0) if r.get("phase")
                                       != headline_phase else 0, -r["tflops_median"]))


def _membw_section(m: Measurement) -> str:
    bars = [(f"{r.get('device')} {r.get('test')} {r.get('engine', '')}".strip(), float(r["gbps"]))
            for r in m.rows if r.get("gbps") is not None]
    theoretical = m.summary.get("theoretical")
    reference = (float(theoretical), f"spec {theoretical:.4g} GB/s") if theoretical else None
    return bar_chart("memory bandwidth per test (median)", bars, "GB/s", reference) + rows_table(m.rows)


def _storage_section(m: Measurement) -> str:
    bars = [(f"{r.get('target')} {r.get('workload')}", float(r["bandwidth_gbps"]))
            for r in m.rows if r.get("bandwidth_gbps")]
    return bar_chart("storage bandwidth per workload", bars, "GB/s") + rows_table(m.rows)


def _doctor_section(m: Measurement) -> str:
    counts = m.summary.get("counts") or {}
    head = (f'<p class="headline">verdict: <b>{_esc(m.summary.get("verdict", "?")).upper()}</b> - '
            + ", ".join(f"{v} {k}" for k, v in counts.items()) + "</p>")
    columns = ["severity", "check", "summary", "cause", "handbook"]
    rows = [{**r, "handbook": ", ".join(r.get("handbook") or [])} for r in m.rows]
    linked = m.summary.get("measurements") or {}
    links = ("<p class='meta'>measurements of this run: " + ", ".join(f"{k}: {_esc(v)}" for k, v in linked.items())
             + "</p>") if linked else ""
    return head + links + rows_table(rows, columns, limit=500)


def _step_section(m: Measurement) -> str:
    """Where the step's time goes (the profiled window's shares) and the timed steps' numbers."""
    s = m.summary
    facts = [f"{s.get('model')}, seq {s.get('seq')}, {s.get('global_batch')} sequence(s) per step, {s.get('dtype')}, "
             f"parallel {s.get('parallel')}, compile {'on' if s.get('compile') else 'off'}, "
             f"{s.get('world_size')} rank(s)"]
    for key, label in (("mfu", "MFU"), ("mamfu", "MAMFU"), ("hfu", "HFU")):
        if isinstance(s.get(key), (int, float)):
            facts.append(f"{label} {s[key] * 100:.1f}%")
    if s.get("mfu_inconclusive"):
        facts.append(f"MFU inconclusive: {s['mfu_inconclusive']}")
    profile = [r for r in m.rows if r.get("phase") == "profile" and r.get("share") is not None
               and r.get("name") != "communication_total"]
    bars = [(str(r["name"]).replace("_", " "), float(r["share"]) * 100) for r in profile]
    chart = bar_chart("where the time goes (share of the profiled steps, %)", bars, "% of the window")
    timed = [r for r in m.rows if r.get("phase") == "timed"]
    return (f'<p class="meta">{_esc("; ".join(facts))}</p>' + chart
            + rows_table(timed, ["tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "mamfu", "hfu",
                                 "step_time_s_median", "step_time_s_p90", "steps", "peak_allocated_bytes"])
            + rows_table(profile + [r for r in m.rows if r.get("name") == "communication_total"],
                         ["name", "time_s", "share"]))


SECTIONS = {"comm": _collective_section, "mamf": _mamf_section, "membw": _membw_section,
            "io": _storage_section, "doctor": _doctor_section, "step": _step_section}


def _headline(m: Measurement) -> str:
    s = m.summary
    if s.get("value") is None:
        return ""
    text = f"{s['value']:.4g} {s.get('unit', '')}"
    if s.get("theoretical"):
        text += f" = {s['value'] / s['theoretical'] * 100:.1f}% of the spec {s['theoretical']:.4g}"
    if s.get("best_shape"):
        text += f" at {s['best_shape']}"
    return f'<p class="headline">{_esc(text)}</p>'


def render_report(measurements: Iterable[Measurement], title: str = "mleng report") -> str:
    sections = []
    for m in measurements:
        gpus = (m.machine.get("gpus") or {})
        device = ", ".join(sorted({d.get("name", "?") for d in gpus.get("devices") or []})) or "no GPU"
        software = m.machine.get("software") or {}
        meta = (f"{_esc(m.kind)} on {_esc(m.host)} ({_esc(device)}), started {_esc(m.started_at)}, "
                f"{m.elapsed_s:.1f} s, status {_esc(m.status)}; torch {_esc(software.get('torch'))}, "
                f"CUDA {_esc(software.get('cuda'))}")
        body = SECTIONS.get(m.kind, lambda r: rows_table(r.rows))(m)
        error = f"<p class='sev-fail'>error: {_esc(m.error)}</p>" if m.error else ""
        sections.append(f'<section id="{_esc(m.id)}"><h2>{_esc(m.id)}</h2><p class="meta">{meta}</p>'
                        f"{_headline(m)}{error}{body}</section>")
    index = "".join(f'<li><a href="#{_esc(m.id)}">{_esc(m.id)}</a></li>' for m in measurements)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>'
            f"<style>{STYLE}</style></head><body><h1>{_esc(title)}</h1>"
            f'<p class="meta">Bandwidth in GB/s base 10; sizes with binary prefixes. Generated by mleng.</p>'
            f"<ul>{index}</ul>{''.join(sections)}</body></html>")


def write_report(measurements: list[Measurement], path: str | Path, title: str = "mleng report") -> Path:
    """Write the page; the folder must exist (the CLI checks the path before any work, as cp does)."""
    target = Path(path)
    target.write_text(render_report(measurements, title))
    return target
