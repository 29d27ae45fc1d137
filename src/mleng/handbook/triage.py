"""Log triage: stream a log of any size, find the handbook's signatures, group them by rank and host."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import BinaryIO

from mleng.handbook import terms as T

CHUNK_BYTES = 8 << 20
MAX_LINE_BYTES = 1 << 20        # a longer "line" is examined in pieces of this size
MAX_EXAMPLE_CHARS = 400
MAX_LABELS = 4096               # distinct ranks/hosts kept per finding, so memory stays bounded

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
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
class Signature:
    entry: int                 # index into Matcher.entries
    regex: re.Pattern
    anchors: list[str] | None  # one of these (lowercase) is in every line the regex matches


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


def _trie_pattern(words: list[str]) -> str:
    """A regex alternation factored by common prefixes: far fewer branches tried per byte."""
    trie: dict = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def emit(node: dict) -> str:
        if "" in node:
            return ""   # a whole anchor matched: a longer one sharing this prefix adds nothing
        branches = [re.escape(c) + emit(child) for c, child in sorted(node.items())]
        return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"

    return emit(trie)


class Matcher:
    """All signatures of all entries, compiled once, with a byte-level prefilter over their anchors."""

    def __init__(self, entries: list[dict], anchors: list[list] | None = None):
        self.entries = entries
        self.signatures: list[Signature] = []
        for i, entry in enumerate(entries):
            entry_anchors = anchors[i] if anchors is not None else [T.regex_anchor(s) for s in entry["signatures"]]
            for pattern, anchor in zip(entry["signatures"], entry_anchors):
                try:
                    regex = re.compile(pattern)
                except re.error:
                    continue
                self.signatures.append(Signature(i, regex, anchor))
        words = sorted({a for s in self.signatures for a in s.anchors or ()})
        # An anchor that contains a shorter anchor adds nothing to the scan: the shorter one finds it.
        minimal = [w for w in words if not any(o != w and o in w for o in words)]
        # minimal anchor (bytes) -> signatures that a line containing it may match
        self.by_anchor: dict[bytes, list[Signature]] = {m.encode(): [] for m in minimal}
        for sig in self.signatures:
            for anchor in sig.anchors or ():
                for m in minimal:
                    if m in anchor and sig not in self.by_anchor[m.encode()]:
                        self.by_anchor[m.encode()].append(sig)
        self.unanchored = [s for s in self.signatures if not s.anchors]
        parts = [_trie_pattern([m.encode("utf-8").decode("latin-1") for m in minimal])] if minimal else []
        # Signatures without a literal anchor are run whole, case-blind, since the block is lowercased.
        parts.extend("(?i:" + s.regex.pattern + ")" for s in self.unanchored)
        pattern = "|".join(parts)
        self.prefilter = re.compile(pattern.encode("latin-1", "replace") if not self.unanchored
                                    else pattern.encode("utf-8")) if parts else None
        self.anchor_scan = re.compile(parts[0].encode("latin-1")) if minimal else None

    def match_line(self, line: str, lowered: bytes) -> list[tuple[int, int]]:
        """(entry index, matched length) for every entry with a signature matching the line."""
        candidates: list[Signature] = list(self.unanchored)
        if self.anchor_scan is not None:
            for hit in self.anchor_scan.finditer(lowered):
                for sig in self.by_anchor.get(hit.group(0), ()):
                    if sig not in candidates:
                        candidates.append(sig)
        best: dict[int, int] = {}
        for sig in candidates:
            match = sig.regex.search(line)
            if match:
                best[sig.entry] = max(best.get(sig.entry, 0), len(match.group(0)) + 1)
        # The most specific explanation first: the longest match, then the entry's order.
        return sorted(best.items(), key=lambda item: (-item[1], item[0]))


@dataclass
class TriageResult:
    lines: int
    bytes: int
    elapsed_s: float
    findings: list[Finding]


def triage_stream(stream: BinaryIO, matcher: Matcher) -> TriageResult:
    """Scan the stream block by block; memory stays bounded by the block size, whatever the log size."""
    started = time.monotonic()
    findings: dict[tuple[str, ...], Finding] = {}
    lines_before = 0
    total_bytes = 0
    tail = b""
    while True:
        data = stream.read(CHUNK_BYTES)
        total_bytes += len(data)
        if data:
            block = tail + data if tail else data
            cut = block.rfind(b"\n")
            if cut == -1:
                if len(block) < MAX_LINE_BYTES:
                    tail = block
                    continue
                cut = len(block) - 1   # an enormous line: examine what we have, count it as one line later
                tail = b""
            else:
                tail = block[cut + 1:]
            lines_before = _scan_block(block[:cut + 1], lines_before, matcher, findings)
        else:
            if tail:
                lines_before = _scan_block(tail + b"\n", lines_before, matcher, findings)
            break
    ordered = sorted(findings.values(), key=lambda f: f.first_line)
    return TriageResult(lines_before, total_bytes, time.monotonic() - started, ordered)


def _scan_block(block: bytes, lines_before: int, matcher: Matcher, findings: dict) -> int:
    """Examine the lines of the block that pass the prefilter; return the line count after the block."""
    if matcher.prefilter is None:
        return lines_before + block.count(b"\n")
    lowered = block.lower()
    position = 0
    counted_to, count_so_far = 0, lines_before
    while True:
        hit = matcher.prefilter.search(lowered, position)
        if hit is None:
            break
        start = lowered.rfind(b"\n", 0, hit.start()) + 1
        end = lowered.find(b"\n", hit.end() if hit.end() > hit.start() else hit.start())
        if end == -1:
            end = len(block)
        count_so_far += block.count(b"\n", counted_to, start)
        counted_to = start
        line_number = count_so_far + 1
        raw = block[start:min(end, start + MAX_LINE_BYTES)]
        line = _ANSI_RE.sub("", raw.decode("utf-8", "replace").rstrip("\r"))
        matched = matcher.match_line(line, lowered[start:min(end, start + MAX_LINE_BYTES)])
        if matched:
            _record(findings, matcher, matched, line, line_number)
        position = end + 1
        if position >= len(block):
            break
    return lines_before + block.count(b"\n")


def _record(findings: dict, matcher: Matcher, matched: list[tuple[int, int]], line: str, line_number: int) -> None:
    ids = tuple(matcher.entries[i]["id"] for i, _ in matched)
    key = tuple(sorted(ids))
    finding = findings.get(key)
    if finding is None:
        example = line if len(line) <= MAX_EXAMPLE_CHARS else line[:MAX_EXAMPLE_CHARS] + "..."
        finding = findings[key] = Finding(ids, line_number, line_number, 0, example)
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


class _RangeReader:
    """A read-only view of bytes [start, end) of a file, for one worker's share of a big log."""

    def __init__(self, path: str, start: int, end: int):
        self.file = open(path, "rb")
        self.file.seek(start)
        self.left = end - start

    def read(self, size: int) -> bytes:
        data = self.file.read(min(size, self.left)) if self.left > 0 else b""
        self.left -= len(data)
        return data

    def close(self) -> None:
        self.file.close()


_WORKER_MATCHER: Matcher | None = None


def _scan_range(path: str, start: int, end: int) -> TriageResult:
    reader = _RangeReader(path, start, end)
    try:
        return triage_stream(reader, _WORKER_MATCHER)
    finally:
        reader.close()


MIN_BYTES_PER_WORKER = 64 << 20


def triage_file(path: str, matcher: Matcher, workers: int | None = None) -> TriageResult:
    """Triage a file; a big regular one is split at line boundaries and scanned on several cores.

    Each worker streams its own byte range with the same bounded memory as triage_stream; line
    numbers are shifted by the lines of the ranges before it, so the result equals a serial scan.
    Pipes and devices are streamed as they come. Raises OSError when the file cannot be read.
    """
    import multiprocessing
    import os
    import stat

    global _WORKER_MATCHER
    started = time.monotonic()
    with open(path, "rb") as stream:
        info = os.fstat(stream.fileno())
        workers = workers or min(os.cpu_count() or 1, 8)
        workers = max(1, min(workers, info.st_size // MIN_BYTES_PER_WORKER))
        if (not stat.S_ISREG(info.st_mode) or workers == 1
                or "fork" not in multiprocessing.get_all_start_methods()):
            return triage_stream(stream, matcher)
    size = info.st_size
    offsets = [0]
    with open(path, "rb") as f:
        for k in range(1, workers):
            f.seek(max(size * k // workers, offsets[-1]))
            f.readline()   # move to the start of the next line
            offsets.append(min(f.tell(), size))
    offsets.append(size)
    ranges = [(path, a, b) for a, b in zip(offsets, offsets[1:]) if b > a]
    _WORKER_MATCHER = matcher
    try:
        with multiprocessing.get_context("fork").Pool(len(ranges)) as pool:
            parts = pool.starmap(_scan_range, ranges)
    finally:
        _WORKER_MATCHER = None
    merged: dict[tuple[str, ...], Finding] = {}
    lines_before = 0
    for part in parts:
        for finding in part.findings:
            finding.first_line += lines_before
            finding.last_line += lines_before
            key = tuple(sorted(finding.entry_ids))
            kept = merged.get(key)
            if kept is None:
                merged[key] = finding
                continue
            kept.last_line = finding.last_line
            kept.count += finding.count
            kept.labels_truncated |= finding.labels_truncated
            for rank in finding.ranks:
                kept.add_labels(rank, None)
            for host in finding.hosts:
                kept.add_labels(None, host)
        lines_before += part.lines
    ordered = sorted(merged.values(), key=lambda f: f.first_line)
    return TriageResult(lines_before, sum(p.bytes for p in parts), time.monotonic() - started, ordered)
