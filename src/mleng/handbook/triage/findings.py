"""Triage's findings: who wrote a line (rank, host), the findings grouped by the entries that explain them,
and a finding as `mleng triage --json` prints it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mleng.handbook.triage.match import Matcher

MAX_EXAMPLE_CHARS = 400
MAX_LABELS = 4096               # distinct ranks/hosts kept per finding, so memory stays bounded

# Prefixes that launchers put in front of each line, tried in turn at the start of a line.
_RANK_PREFIXES = (
    re.compile(r"\[rank(?P<rank>\d+)\]:\s?"),                        # torch's per-rank prefix
    re.compile(r"\[default(?P<rank>\d+)\]:\s?"),                     # torchrun --tee (run id 'default')
    re.compile(r"(?P<host>[A-Za-z][\w.-]*):(?P<rank>\d+):\s"),        # host:rank: (srun -l behind pdsh)
    re.compile(r"\s*(?P<rank>\d+):\s"),                              # srun --label
    re.compile(r"(?P<host>[A-Za-z][\w-]*\d[\w.-]*):\s"),              # pdsh/clush 'node017: '
)
# NCCL's own prefix: hostname:pid:tid [cuda device] NCCL INFO|WARN
_NCCL_PREFIX = re.compile(r"(?P<host>[A-Za-z0-9][\w.-]*):\d+:\d+ \[(?P<gpu>\d+)\] NCCL ")
_SRUN_TASK = re.compile(r"srun: error: (?P<host>[\w.-]+): tasks? (?P<rank>\d+)")


def attribute(line: str) -> tuple[str | None, str | None]:
    """(rank, host) as the line's prefixes show them, or None where the line does not say."""
    rank = host = None
    rest = line
    for _ in range(3):
        for prefix in _RANK_PREFIXES:
            match = prefix.match(rest)
            if match:
                groups = match.groupdict()
                rank = rank if groups.get("rank") is None else groups["rank"]
                host = host if groups.get("host") is None else groups["host"]
                rest = rest[match.end():]
                break
        else:
            break
    nccl = _NCCL_PREFIX.search(rest, 0, 200)
    if nccl:
        host = host or nccl.group("host")
    srun = _SRUN_TASK.search(line)
    if srun:
        host, rank = srun.group("host"), srun.group("rank")
    return rank, host


@dataclass
class Finding:
    entry_ids: tuple[str, ...]
    first_line: int
    last_line: int
    count: int
    example: str
    ranks: set = field(default_factory=set)
    hosts: set = field(default_factory=set)
    labels_truncated: bool = False

    def add_labels(self, rank: str | None, host: str | None) -> None:
        for value, bucket in ((rank, self.ranks), (host, self.hosts)):
            if value is None or value in bucket:
                continue
            if len(bucket) >= MAX_LABELS:
                self.labels_truncated = True
            else:
                bucket.add(value)


@dataclass
class TriageResult:
    lines: int
    bytes: int
    elapsed_s: float
    findings: list[Finding]
    engine: str = ""


def record_match(findings: dict, matcher: Matcher, matched: list[tuple[int, int]], line: str,
                 line_number: int) -> None:
    """Count a matched line in the finding of its entries (one per set of entries), its rank and host."""
    ids = tuple(matcher.entries[i]["id"] for i, _ in matched)
    key = tuple(sorted(ids))
    finding = findings.get(key)
    if finding is None:
        example = line if len(line) <= MAX_EXAMPLE_CHARS else line[:MAX_EXAMPLE_CHARS] + "..."
        finding = findings[key] = Finding(ids, line_number, line_number, 0, example)
    if finding.last_line == line_number and finding.count:
        return   # two '\\r' parts of one line: one occurrence
    finding.last_line = line_number
    finding.count += 1
    finding.add_labels(*attribute(line))


def _label_sort(values: set) -> list[str]:
    return sorted(values, key=lambda v: (0, int(v), "") if v.isdigit() else (1, 0, v))


def finding_to_dict(finding: Finding, entries_by_id: dict[str, dict]) -> dict:
    return {
        "entries": [{k: entries_by_id[i][k] for k in ("id", "title", "category", "cause", "confirm", "fix")}
                    for i in finding.entry_ids],
        "first_line": finding.first_line, "last_line": finding.last_line, "count": finding.count,
        "ranks": _label_sort(finding.ranks), "hosts": _label_sort(finding.hosts),
        "labels_truncated": finding.labels_truncated, "example": finding.example,
    }
