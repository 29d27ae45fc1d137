"""The one measurement record every benchmark, check and doctor run produces."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import secrets
import time
from typing import Any

from mleng.errors import StoreError, UsageError

SCHEMA_NAME = "mleng.measurement"
SCHEMA_VERSION = 2
# What changed from /1 to /2: one name per concept. Records of /1 in users' stores are read through
# upgrade() below, so that every reader sees /2 names.
V1_SUMMARY_RENAMES = {"spec_note": "theoretical_source", "reference": "theoretical_source"}
V1_KEY_RENAMES = {"sm_clock_mean_mhz": "sm_clock_mhz_mean", "power_mean_w": "power_w_mean"}
# A record's kind is the name of the command that made it; records made before that carry the benchmark's
# name and are read as the command's (any schema version).
FORMER_KINDS = {"collective": "comm", "connectivity": "check", "storage": "io"}
# A doctor finding of a quick measurement is named after the command it runs (mamf, comm, membw, io), and so is
# its key in summary["measurements"]; doctor records made before carry these names and are read under the new.
FORMER_DOCTOR_CHECKS = {"matmul": "mamf", "busbw": "comm", "collective": "comm", "checkpoint_write": "io",
                        "storage": "io"}
SCHEMA = f"{SCHEMA_NAME}/{SCHEMA_VERSION}"
STATUSES = ("complete", "interrupted", "failed")


def utc_now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_id(kind: str) -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{kind}-{stamp}-{secrets.token_hex(3)}"


@dataclasses.dataclass
class Measurement:
    """A value with its statistics and its context; rows carry units in their field names."""

    kind: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    machine: dict[str, Any] = dataclasses.field(default_factory=dict)
    status: str = "complete"
    error: str | None = None
    id: str = ""
    started_at: str = ""
    elapsed_s: float = 0.0
    schema: str = SCHEMA
    _t0: float = dataclasses.field(default=0.0, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_id(self.kind)
        if not self.started_at:
            self.started_at = utc_now_iso()
        self._t0 = time.monotonic()

    @classmethod
    def start(cls, kind: str, params: dict[str, Any] | None = None,
              machine: dict[str, Any] | None = None) -> "Measurement":
        return cls(kind=kind, params=dict(params or {}), machine=dict(machine or {}))

    def finish(self, status: str = "complete", error: str | None = None) -> "Measurement":
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}")
        self.status = status
        self.error = error
        self.elapsed_s = round(time.monotonic() - self._t0, 3)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "id": self.id,
            "kind": self.kind,
            "status": self.status,
            "started_at": self.started_at,
            "elapsed_s": self.elapsed_s,
            "machine": self.machine,
            "params": self.params,
            "rows": self.rows,
            "summary": self.summary,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Measurement":
        check_schema(data)
        data = upgrade(data)
        missing = [k for k in ("id", "kind", "status") if k not in data]
        if missing:
            raise UsageError(f"measurement record lacks required fields: {', '.join(missing)}")
        return cls(
            kind=data["kind"], params=data.get("params") or {}, rows=data.get("rows") or [],
            summary=data.get("summary") or {}, machine=data.get("machine") or {},
            status=data["status"], error=data.get("error"), id=data["id"],
            started_at=data.get("started_at", ""), elapsed_s=float(data.get("elapsed_s") or 0.0),
            schema=data["schema"],
        )

    @property
    def host(self) -> str:
        return str(self.machine.get("host", {}).get("hostname") or os.uname().nodename)


def _renamed(value: Any, renames: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {renames.get(k, k) if renames.get(k, k) not in value else k: _renamed(v, renames)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, renames) for v in value]
    return value


def current_kind(kind: str) -> str:
    """The command's name for a kind, also for a record made before kinds were the commands' names."""
    return FORMER_KINDS.get(kind, kind)


def stored_kinds(kind: str) -> tuple[str, ...]:
    """The kind and the former names its records may carry in a store (comm: comm, collective)."""
    current = current_kind(kind)
    return (current, *(old for old, new in FORMER_KINDS.items() if new == current))


def current_check(check: str) -> str:
    """A doctor finding's name now, also for a finding of a doctor run made before (matmul: mamf)."""
    return FORMER_DOCTOR_CHECKS.get(check, check) if isinstance(check, str) else check


def _upgrade_doctor(data: dict[str, Any]) -> dict[str, Any]:
    """A doctor record with its measured findings and summary["measurements"] under the commands' names."""
    rows = data.get("rows")
    summary = data.get("summary")
    measurements = summary.get("measurements") if isinstance(summary, dict) else None
    old_rows = isinstance(rows, list) and any(isinstance(r, dict) and current_check(r.get("check")) != r.get("check")
                                              for r in rows)
    old_keys = isinstance(measurements, dict) and any(current_check(k) != k for k in measurements)
    if not old_rows and not old_keys:
        return data
    data = dict(data)
    if old_rows:
        data["rows"] = [{**r, "check": current_check(r.get("check"))} if isinstance(r, dict) and "check" in r else r
                        for r in rows]
    if old_keys:
        data["summary"] = {**summary, "measurements": {current_check(k): v for k, v in measurements.items()}}
    return data


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A record of an older schema in the current one's names (a copy; current records come back as they are)."""
    if data.get("kind") in FORMER_KINDS:
        data = {**data, "kind": FORMER_KINDS[data["kind"]]}
    if data.get("kind") == "doctor":
        data = _upgrade_doctor(data)
    version = int(str(data.get("schema", "")).partition("/")[2] or SCHEMA_VERSION)
    if version >= SCHEMA_VERSION:
        return data
    out = dict(data)
    summary = {V1_SUMMARY_RENAMES.get(k, k) if V1_SUMMARY_RENAMES.get(k, k) not in (data.get("summary") or {})
               else k: v for k, v in (data.get("summary") or {}).items()}
    out["summary"] = _renamed(summary, V1_KEY_RENAMES)
    out["rows"] = _renamed(data.get("rows") or [], V1_KEY_RENAMES)
    out["schema"] = SCHEMA
    return out


def check_schema(data: dict[str, Any]) -> None:
    """Refuse a record that is not ours or comes from a newer mleng."""
    schema = data.get("schema")
    if not isinstance(schema, str) or "/" not in schema:
        raise UsageError(f"not an mleng measurement record (schema field is {schema!r})")
    name, _, version = schema.partition("/")
    if name != SCHEMA_NAME or not version.isdigit():
        raise UsageError(f"not an mleng measurement record (schema {schema!r})")
    if int(version) > SCHEMA_VERSION:
        raise StoreError(
            f"record uses schema {schema}, newer than this mleng understands ({SCHEMA})",
            hint="upgrade mleng (pip install -U mleng) to read it",
        )
