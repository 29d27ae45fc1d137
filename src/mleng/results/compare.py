"""Two runs side by side with the ratio per row: before/after an upgrade, node 3 against node 5."""

from __future__ import annotations

from typing import Any

from mleng.cli.render import table
from mleng.errors import UsageError
from mleng.results.record import Measurement

# Fields that identify a row (a shape, a size, a pair, a check) rather than measure it. Every one of
# them takes part in the key: membw's pinned and pageable rows differ only in host_memory, mamf's
# coarse and final rows of one shape only in phase.
KEY_FIELDS = ("op", "name", "check", "subject", "dtype", "m", "n", "k", "phase", "size_bytes", "bytes",
              "block_bytes", "src", "dst", "pair", "device", "host", "rank", "local_rank", "target", "workload",
              "direction", "engine", "test", "host_memory", "constant_data")


def _row_key(row: dict[str, Any]) -> tuple:
    return tuple((f, row[f]) for f in KEY_FIELDS if f in row)


def _keyed(rows: list[dict[str, Any]]) -> list[tuple[tuple, dict[str, Any]]]:
    """(key, row) with the n-th repeat of a key told apart, so no two rows of one run collapse."""
    seen: dict[tuple, int] = {}
    out = []
    for row in rows:
        key = _row_key(row)
        count = seen.get(key, 0)
        seen[key] = count + 1
        out.append((key + ((("repeat", count),) if count else ()), row))
    return out


def _numeric_fields(rows: list[dict[str, Any]]) -> list[str]:
    fields: list[str] = []
    for row in rows:
        for key, value in row.items():
            if key in KEY_FIELDS or key in fields:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                fields.append(key)
    return fields


def compare_measurements(a: Measurement, b: Measurement) -> dict[str, Any]:
    """Match rows by their identifying fields and give b/a for every numeric field."""
    if a.kind != b.kind:
        raise UsageError(f"cannot compare a {a.kind} run with a {b.kind} run",
                         hint="compare two runs of the same kind (`mleng results list --kind KIND`)")
    b_rows = dict(_keyed(b.rows))
    fields = [f for f in _numeric_fields(a.rows) if f in set(_numeric_fields(b.rows))]
    rows = []
    for key, row_a in _keyed(a.rows):
        row_b = b_rows.get(key)
        if row_b is None:
            continue
        out: dict[str, Any] = dict(key)
        for field in fields:
            va, vb = row_a.get(field), row_b.get(field)
            out[f"{field}_a"] = va
            out[f"{field}_b"] = vb
            out[f"{field}_ratio"] = (vb / va) if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else None
        rows.append(out)
    summary_ratio = None
    va, vb = a.summary.get("value"), b.summary.get("value")
    if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va:
        summary_ratio = vb / va
    return {
        "a": {"id": a.id, "host": a.host, "started_at": a.started_at, "summary": a.summary},
        "b": {"id": b.id, "host": b.host, "started_at": b.started_at, "summary": b.summary},
        "kind": a.kind,
        "fields": fields,
        "rows": rows,
        "unmatched_a": len(a.rows) - len(rows),
        "unmatched_b": len(b.rows) - len(rows),
        "summary_ratio": summary_ratio,
    }


def render_comparison(comparison: dict[str, Any]) -> str:
    a, b = comparison["a"], comparison["b"]
    lines = [f"A: {a['id']} on {a['host']} at {a['started_at']}",
             f"B: {b['id']} on {b['host']} at {b['started_at']}"]
    if comparison["summary_ratio"] is not None:
        unit = a["summary"].get("unit", "")
        lines.append(f"headline: {a['summary']['value']:.4g} -> {b['summary']['value']:.4g} {unit} "
                     f"(B/A = {comparison['summary_ratio']:.3f})")
    rows = comparison["rows"]
    if rows:
        key_columns = [c for c in KEY_FIELDS + ("repeat",) if any(c in r for r in rows)]
        # Show the first few measured fields; --json has them all.
        shown = comparison["fields"][:3]
        columns = key_columns + [f"{f}{s}" for f in shown for s in ("_a", "_b", "_ratio")]
        lines.append(table(rows, columns))
    lines.append(f"rows matched: {len(rows)}; only in A: {comparison['unmatched_a']}, "
                 f"only in B: {comparison['unmatched_b']}")
    return "\n".join(lines)
