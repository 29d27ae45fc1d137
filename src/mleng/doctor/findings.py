"""A finding: one check's verdict with the numbers behind it and where to read about it."""

from __future__ import annotations

import dataclasses
from typing import Any

# ok, warn and fail are verdicts of a check that ran; skipped and inconclusive say why it did not
# reach one, so nothing that never ran reads as ok.
SEVERITIES = ("ok", "warn", "fail", "skipped", "inconclusive")
SEVERITY_RANK = {"fail": 0, "warn": 1, "inconclusive": 2, "ok": 3, "skipped": 4}


@dataclasses.dataclass
class Finding:
    check: str
    severity: str
    summary: str
    measured: Any = None
    expected: Any = None
    cause: str | None = None
    handbook: list[str] = dataclasses.field(default_factory=list)
    subject: str | None = None  # "gpu 3", "NCCL_SOCKET_IFNAME", a path
    gpu_uuid: str | None = None  # the GPU's UUID where the finding is about one GPU: it follows the card

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")

    def to_row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def ok(check: str, summary: str, **kw) -> Finding:
    return Finding(check, "ok", summary, **kw)


def warn(check: str, summary: str, **kw) -> Finding:
    return Finding(check, "warn", summary, **kw)


def fail(check: str, summary: str, **kw) -> Finding:
    return Finding(check, "fail", summary, **kw)


def skipped(check: str, reason: str, **kw) -> Finding:
    return Finding(check, "skipped", reason, **kw)


def inconclusive(check: str, reason: str, **kw) -> Finding:
    return Finding(check, "inconclusive", reason, **kw)


def worst(findings: list[Finding]) -> str:
    severities = {f.severity for f in findings}
    for level in ("fail", "warn"):
        if level in severities:
            return level
    return "ok"
