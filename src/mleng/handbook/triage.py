"""Log triage: stream a log of any size, find the handbook's signatures, group them by rank and host."""

from __future__ import annotations

import os
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
    pattern: str
    anchors: list[str] | None  # one of these (lowercase) is in every line the regex matches
    _regex: re.Pattern | None = None

    @property
    def regex(self) -> re.Pattern:
        # Compiled on first use: a scan runs the regexes of the few signatures whose anchors it met.
        if self._regex is None:
            self._regex = re.compile(self.pattern)
        return self._regex


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


class _HyperscanScan:
    """Every anchor at once, case-blind, in one pass (Hyperscan: gigabytes per second on one core)."""

    name = "hyperscan"

    def __init__(self, anchors: list[bytes], line_start: dict[int, list[str]] | None = None):
        import hyperscan

        # The anchor of signatures that match only at the start of a line (`^\s*GPU\d+`) is searched
        # as those signatures themselves, at line starts: as a plain literal a word as short as "gpu"
        # would hit in every host name. Hyperscan's regex dialect is Perl's; one it cannot compile
        # falls back to the literal at a line start.
        line_start = line_start or {}
        expressions, flags = [], []
        for i, anchor in enumerate(anchors):
            literal = re.escape(anchor.decode("latin-1")).encode("latin-1")
            if i in line_start:
                regex = "|".join(f"(?:{p})" for p in line_start[i]).encode("utf-8")
                try:
                    hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK).compile(
                        expressions=[regex], flags=[hyperscan.HS_FLAG_CASELESS | hyperscan.HS_FLAG_MULTILINE])
                except hyperscan.error:
                    regex = b"^[ \t]*" + literal
                expressions.append(regex)
                flags.append(hyperscan.HS_FLAG_CASELESS | hyperscan.HS_FLAG_MULTILINE)
            else:
                expressions.append(literal)
                flags.append(hyperscan.HS_FLAG_CASELESS)
        self._database = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        self._database.compile(expressions=expressions, ids=list(range(len(anchors))), elements=len(anchors),
                               flags=flags)

    def hits(self, block: bytes) -> list[tuple[int, int]]:
        found: list[tuple[int, int]] = []

        def on_match(anchor: int, _start: int, end: int, _flags: int, _context) -> None:
            found.append((end, anchor))

        self._database.scan(block, match_event_handler=on_match)
        return found


class _AhoCorasickScan:
    """Every anchor at once over the lowercased block (Aho-Corasick DFA, a few hundred MB/s)."""

    name = "aho-corasick"

    def __init__(self, anchors: list[bytes], line_start: dict[int, list[str]] | None = None):
        import ahocorasick_rs

        self._automaton = ahocorasick_rs.BytesAhoCorasick(
            anchors, matchkind=ahocorasick_rs.MATCHKIND_STANDARD, implementation=ahocorasick_rs.Implementation.DFA)

    def hits(self, block: bytes) -> list[tuple[int, int]]:
        return [(end, anchor) for anchor, _start, end in
                self._automaton.find_matches_as_indexes(bytes(block).lower(), overlapping=True)]


class _RegexScan:
    """The portable fallback: one alternation of the anchors, factored by prefix, over the lowercased block."""

    name = "re"

    def __init__(self, anchors: list[bytes], line_start: dict[int, list[str]] | None = None):
        self._anchors = {a: i for i, a in enumerate(anchors)}
        self._regex = re.compile(_trie_pattern([a.decode("latin-1") for a in anchors]).encode("latin-1"))

    def hits(self, block: bytes) -> list[tuple[int, int]]:
        return [(m.end(), self._anchors[m.group(0)]) for m in self._regex.finditer(bytes(block).lower())]


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


SCAN_ENGINES = {"hyperscan": _HyperscanScan, "aho-corasick": _AhoCorasickScan, "re": _RegexScan}


def _scan_engine(anchors: list[bytes], preferred: str | None = None,
                 line_start: dict[int, list[str]] | None = None):
    names = [preferred] if preferred else list(SCAN_ENGINES)
    for name in names:
        try:
            return SCAN_ENGINES[name](anchors, line_start)
        except ImportError:
            continue
    return _RegexScan(anchors, line_start)


_LINE_START_RE = re.compile(r"\^(?:\\s\*|\\s\+|\[ \\t\]\*)?")


def _starts_line_with(pattern: str, anchor: str) -> bool:
    """Whether the regex can only match with `anchor` at the start of a line (after blanks), like ^GPU\\d+."""
    lead = _LINE_START_RE.match(pattern)
    return bool(lead) and pattern[lead.end():lead.end() + len(anchor)].lower() == anchor


class Matcher:
    """All signatures of all entries; a multi-literal scan over their anchors picks the lines worth the regexes."""

    def __init__(self, entries: list[dict], anchors: list[list] | None = None, engine: str | None = None):
        self.entries = entries
        self.signatures: list[Signature] = []
        for i, entry in enumerate(entries):
            entry_anchors = anchors[i] if anchors is not None else [T.regex_anchor(s) for s in entry["signatures"]]
            for pattern, anchor in zip(entry["signatures"], entry_anchors):
                self.signatures.append(Signature(i, pattern, anchor))
        words = sorted({a.encode("utf-8") for s in self.signatures for a in s.anchors or ()})
        self.anchor_words = words
        position = {w: n for n, w in enumerate(words)}
        # anchor number -> the signatures a line containing it may match
        self.by_anchor: list[list[Signature]] = [[] for _ in words]
        for sig in self.signatures:
            for anchor in sig.anchors or ():
                self.by_anchor[position[anchor.encode("utf-8")]].append(sig)
        # A signature without a literal anchor (the linter refuses them) is tried on every line.
        self.unanchored = [s for s in self.signatures if not s.anchors]
        # anchor number -> its signatures, for anchors whose every signature starts a line with it
        self.line_start = {n: [s.pattern for s in self.by_anchor[n]] for n, word in enumerate(words)
                           if all(_starts_line_with(s.pattern, word.decode("utf-8")) for s in self.by_anchor[n])}
        self.scan = _scan_engine(words, engine, self.line_start) if words else None

    def match_line(self, line: str, candidates: list[Signature]) -> list[tuple[int, int]]:
        """(entry index, matched length) for every entry with a signature matching the line."""
        best: dict[int, int] = {}
        for sig in candidates:
            try:
                match = sig.regex.search(line)
            except re.error:
                continue
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
    engine: str = ""


class NotText(ValueError):
    """The input is binary data, not a log: what it looks like, for the message."""


def check_text(head: bytes) -> None:
    """Raise NotText when the first bytes of an input are binary (NUL bytes or mostly non-text)."""
    sample = head[:8192]
    if not sample:
        return
    if b"\x00" in sample:
        raise NotText("it contains NUL bytes")
    text_bytes = sum(1 for b in sample if b >= 32 or b in (9, 10, 13, 27)) 
    if text_bytes / len(sample) < 0.9:
        raise NotText(f"{100 - 100 * text_bytes // len(sample)}% of its first bytes are control bytes")
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(sample) - 4 and sum(1 for b in sample if b >= 128) / len(sample) > 0.3:
            raise NotText("it is not UTF-8 text") from None


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
                lines_before = _scan_block(tail + b"\n", len(tail) + 1, lines_before, matcher, findings)
            break
        block = tail + data if tail else data
        cut = block.rfind(b"\n")
        if cut == -1 and len(block) >= MAX_LINE_BYTES:
            cut = block.rfind(b"\r")   # one huge progress line: cut between its parts (no line ends here)
        if cut == -1 and len(block) >= MAX_LINE_BYTES * 64:
            cut = len(block) - 1        # no separator at all in 64 MiB: examine it as it is
        if cut == -1:
            tail = block
            continue
        lines_before = _scan_block(block, cut + 1, lines_before, matcher, findings)
        tail = block[cut + 1:]
    ordered = sorted(findings.values(), key=lambda f: f.first_line)
    return TriageResult(lines_before, total_bytes, time.monotonic() - started, ordered,
                        matcher.scan.name if matcher.scan else "")


def _segment(block: bytes, position: int, end: int) -> tuple[int, int]:
    """The '\\n'/'\\r'-delimited part of block[:end] around a position."""
    # '\r' is looked for only inside the '\n' line: searched over the whole block it would cost a pass
    # over the block per hit in a log without carriage returns.
    line_start = block.rfind(b"\n", 0, position) + 1
    line_end = block.find(b"\n", position, end)
    line_end = end if line_end == -1 else line_end
    start = block.rfind(b"\r", line_start, position) + 1 or line_start
    stop = block.find(b"\r", position, line_end)
    return start, line_end if stop == -1 else stop


def _scan_block(block: bytes, end: int, lines_before: int, matcher: Matcher, findings: dict) -> int:
    """Examine the parts of block[:end] where anchors occur; return the line count after them."""
    if matcher.scan is None and not matcher.unanchored:
        return lines_before + block.count(b"\n", 0, end)
    view = memoryview(block)[:end]
    candidates: dict[int, list[Signature]] = {}   # segment start -> signatures its anchors point at
    spans: dict[int, int] = {}
    if matcher.scan is not None:
        # Hyperscan keeps line-start anchors to line starts itself; the fallbacks find the bare literal.
        line_start = matcher.line_start if matcher.scan.name != "hyperscan" else {}
        for hit_end, anchor in sorted(matcher.scan.hits(view)):
            start, stop = _segment(block, max(0, hit_end - 1), end)
            if anchor in line_start and block[start:hit_end - len(matcher.anchor_words[anchor])].strip(b" \t"):
                continue
            sigs = candidates.setdefault(start, [])
            spans[start] = stop
            for sig in matcher.by_anchor[anchor]:
                if sig not in sigs:
                    sigs.append(sig)
    if matcher.unanchored:
        text = bytes(view).decode("utf-8", "replace")
        if any(s.regex.search(text) for s in matcher.unanchored):
            position = 0
            while position < end:
                start, stop = _segment(block, position, end)
                candidates.setdefault(start, []).extend(matcher.unanchored)
                spans[start] = stop
                position = stop + 1
    counted_to, count_so_far = 0, lines_before
    for start in sorted(candidates):
        count_so_far += block.count(b"\n", counted_to, start)
        counted_to = start
        line = _ANSI_RE.sub("", block[start:spans[start]].decode("utf-8", "replace"))
        matched = matcher.match_line(line, candidates[start])
        if matched:
            _record(findings, matcher, matched, line, count_so_far + 1)
    return count_so_far + block.count(b"\n", counted_to, end)


def _record(findings: dict, matcher: Matcher, matched: list[tuple[int, int]], line: str, line_number: int) -> None:
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


# Compressed logs are read as they are stored: the first bytes say the format.
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"\xfd7zXZ\x00", "xz"), (b"BZh", "bzip2"), (b"\x28\xb5\x2f\xfd", "zstd"))


def compression(head: bytes) -> str | None:
    return next((name for magic, name in _MAGIC if head.startswith(magic)), None)


def open_log(stream: BinaryIO) -> tuple[BinaryIO, str | None]:
    """The decompressed stream of a log (gzip, xz, bzip2, zstd or plain) and the format's name.

    Raises NotText when zstd is needed and neither Python's zstd support nor the zstd tool exists.
    """
    import io

    buffered = stream if hasattr(stream, "peek") else io.BufferedReader(stream)
    kind = compression(buffered.peek(8)[:8])
    if kind == "gzip":
        import gzip

        return gzip.GzipFile(fileobj=buffered, mode="rb"), kind
    if kind == "xz":
        import lzma

        return lzma.LZMAFile(buffered, mode="rb"), kind
    if kind == "bzip2":
        import bz2

        return bz2.BZ2File(buffered, mode="rb"), kind
    if kind == "zstd":
        return _zstd_reader(buffered), kind
    return buffered, None


def _zstd_reader(stream: BinaryIO) -> BinaryIO:
    try:
        from compression import zstd  # Python 3.14+

        return zstd.ZstdFile(stream, mode="rb")
    except ImportError:
        pass
    try:
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True)
    except ImportError:
        pass
    import shutil
    import subprocess
    import threading

    tool = shutil.which("zstd")
    if tool is None:
        raise NotText("it is zstd-compressed and this machine has neither the zstd tool nor the zstandard "
                      "package (pip install zstandard, or decompress it first: zstd -d LOG.zst)")
    process = subprocess.Popen([tool, "-dcq"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)

    def feed() -> None:
        try:
            while True:
                data = stream.read(1 << 20)
                if not data:
                    break
                process.stdin.write(data)
        except (BrokenPipeError, OSError):
            pass
        finally:
            try:
                process.stdin.close()
            except OSError:
                pass

    threading.Thread(target=feed, daemon=True).start()
    return _ProcessOutput(process)


class _ProcessOutput:
    """A decompressing tool's output; its failure at the end (damaged input) raises EOFError."""

    def __init__(self, process):
        self.process = process

    def read(self, size: int) -> bytes:
        data = self.process.stdout.read(size)
        if not data and self.process.wait() != 0:
            raise EOFError(f"zstd -d exited with status {self.process.returncode}")
        return data


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
        with multiprocessing.get_context("fork").Pool(len(ranges)) as pool:
            parts = pool.starmap(_scan_range, ranges)
    finally:
        _WORKER_MATCHER = None
    return _merge(parts, time.monotonic() - started, matcher)


MIN_BYTES_PER_WORKER = 64 << 20
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


def _zstd_errors() -> tuple[type, ...]:
    try:
        import zstandard
    except ImportError:
        return ()
    return (zstandard.ZstdError,)


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
    except (EOFError, OSError, zlib.error, lzma.LZMAError, *_zstd_errors()) as exc:
        raise NotText(f"its {kind} data is damaged or truncated ({exc})") from None
