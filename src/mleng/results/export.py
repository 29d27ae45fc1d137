"""Export a measurement as JSON (the whole record) or CSV (its rows)."""

from __future__ import annotations

import csv
import io
import json

from mleng.errors import UsageError
from mleng.results.record import Measurement

FORMATS = ("json", "csv")


def export_text(measurement: Measurement, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(measurement.to_dict(), indent=2, default=str) + "\n"
    if fmt == "csv":
        return rows_to_csv(measurement.rows)
    raise UsageError(f"unknown export format {fmt!r}", hint=f"use one of: {', '.join(FORMATS)}")


def rows_to_csv(rows: list[dict]) -> str:
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(key)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _flat(v) for k, v in row.items()})
    return buffer.getvalue()


def _flat(value):
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str)
    return value
