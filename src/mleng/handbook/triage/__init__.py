"""Log triage: stream a log of any size, find the handbook's signatures, group them by rank and host.

This module reads a log block by block (`triage_stream`), a big plain file on several cores (`triage_file`),
a compressed one through its decompressor (`triage_compressed`). The rest: `read` (binary detection,
decompression), `engines` (the anchor scanners), `match` (signatures, the Matcher, one block's scan),
`findings` (rank and host of a line, the findings grouped, as printed).
"""

from __future__ import annotations

import os
import time
from typing import BinaryIO

from mleng.handbook.triage.engines import SCAN_ENGINES
from mleng.handbook.triage.findings import (MAX_EXAMPLE_CHARS, MAX_LABELS, Finding, TriageResult, attribute,
                                            finding_to_dict)
from mleng.handbook.triage.match import Matcher, Signature, scan_block
from mleng.handbook.triage.read import NotText, check_text, compression, open_log, zstd_errors

__all__ = ["CHUNK_BYTES", "MAX_LINE_BYTES", "MIN_BYTES_PER_WORKER", "MAX_EXAMPLE_CHARS", "MAX_LABELS",
           "SCAN_ENGINES", "Finding", "Matcher", "NotText", "Signature", "TriageResult", "attribute",
           "check_text", "compression", "finding_to_dict", "open_log", "triage_compressed", "triage_file",
           "triage_stream"]

CHUNK_BYTES = 2 << 20          # larger blocks are no faster and cost their size several times in RSS
MAX_LINE_BYTES = 1 << 20        # a longer "line" is examined in pieces of this size


def triage_stream(stream: BinaryIO, matcher: Matcher, check: bool = True) -> TriageResult:
    """Scan the stream block by block; memory stays bounded by the block size, whatever the log size.

    Lines end at '\\n'; a line's '\\r'-separated parts (progress bars rewriting one terminal line, as in
    SLURM .out files) are examined one by one, so an error inside a long progress line is found.
    Raises NotText when the stream starts with binary data.
    """
    started = time.monotonic()
    findings: dict[tuple[str, ...], Finding] = {}
    lines_before = 0
    total_bytes = 0
    tail = b""
    first = True
    while True:
        data = stream.read(CHUNK_BYTES)
        if first and check:
            check_text(data)
        first = False
        total_bytes += len(data)
        if not data:
            if tail:
                lines_before = scan_block(tail + b"\n", len(tail) + 1, lines_before, matcher, findings)
            break
        block = tail + data if tail else data
        cut = block.rfind(b"\n")
        if cut == -1 and len(block) >= MAX_LINE_BYTES:
            cut = block.rfind(b"\r")   # one huge progress line: cut between its parts (no line ends here)
        if cut == -1 and len(block) >= MAX_LINE_BYTES * 8:
            cut = len(block) - 1        # no separator at all in 8 MiB: examine it as it is
        if cut == -1:
            tail = block
            continue
        lines_before = scan_block(block, cut + 1, lines_before, matcher, findings)
        tail = block[cut + 1:]
    ordered = sorted(findings.values(), key=lambda f: f.first_line)
    return TriageResult(lines_before, total_bytes, time.monotonic() - started, ordered,
                        matcher.scan.name if matcher.scan else "")


def triage_file(path: str, matcher: Matcher, workers: int | None = None) -> TriageResult:
    """Triage a file, plain or compressed. Raises OSError when it cannot be read, NotText when it is binary.

    A big plain file is split at line boundaries and its parts scanned on several cores at once; line
    numbers are shifted by the lines of the parts before, so the result equals a serial scan.
    """
    import multiprocessing
    import stat

    global _WORKER_MATCHER
    started = time.monotonic()
    with open(path, "rb") as raw:
        info = os.fstat(raw.fileno())
        stream, kind = open_log(raw)
        workers = workers or min(os.cpu_count() or 1, 8)
        workers = max(1, min(workers, info.st_size // MIN_BYTES_PER_WORKER))
        if (kind is not None or not stat.S_ISREG(info.st_mode) or workers == 1
                or "fork" not in multiprocessing.get_all_start_methods()):
            return triage_compressed(stream, matcher, kind)
        check_text(stream.peek(8192)[:8192])
        size = info.st_size
        offsets = [0]
        for k in range(1, workers):
            raw.seek(max(size * k // workers, offsets[-1]))
            raw.readline()   # to the start of the next line
            offsets.append(min(raw.tell(), size))
        offsets.append(size)
    ranges = [(path, a, b) for a, b in zip(offsets, offsets[1:]) if b > a]
    _WORKER_MATCHER = matcher
    try:
        with multiprocessing.get_context("fork").Pool(len(ranges), initializer=_worker_signals) as pool:
            parts = pool.starmap(_scan_range, ranges)
    finally:
        _WORKER_MATCHER = None
    return _merge(parts, time.monotonic() - started, matcher)


MIN_BYTES_PER_WORKER = 64 << 20


def _worker_signals() -> None:
    """A worker leaves Ctrl-C to the parent and dies quietly of the SIGTERM that ends the pool: the handler it
    inherits would turn that into a KeyboardInterrupt traceback on stderr after the findings were printed."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
_WORKER_MATCHER: Matcher | None = None


class _RangeReader:
    """Bytes [start, end) of a file, for one worker's part of a big log."""

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


def _scan_range(path: str, start: int, end: int) -> TriageResult:
    reader = _RangeReader(path, start, end)
    try:
        return triage_stream(reader, _WORKER_MATCHER, check=False)
    finally:
        reader.close()


def _merge(parts: list[TriageResult], elapsed_s: float, matcher: Matcher) -> TriageResult:
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
    return TriageResult(lines_before, sum(p.bytes for p in parts), elapsed_s, ordered,
                        matcher.scan.name if matcher.scan else "")


def triage_compressed(stream: BinaryIO, matcher: Matcher, kind: str | None) -> TriageResult:
    """triage_stream over a decompressing stream, a damaged archive reported as NotText."""
    import lzma
    import zlib

    if kind is None:
        return triage_stream(stream, matcher)
    try:
        return triage_stream(stream, matcher)
    except NotText:
        raise
    except (EOFError, OSError, zlib.error, lzma.LZMAError, *zstd_errors()) as exc:
        raise NotText(f"its {kind} data is damaged or truncated ({exc})") from None
