"""Triage's matching: the signatures of the entries, the Matcher that picks the lines worth the regexes with a
multi-literal scan of their anchors, and the scan of one block's '\\n'/'\\r' parts where anchors occur."""

from __future__ import annotations

import re
from dataclasses import dataclass

from mleng.handbook import terms as T
from mleng.handbook.triage.engines import scan_engine
from mleng.handbook.triage.findings import record_match

_ANSI_RE = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")


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
        self.scan = scan_engine(words, engine, self.line_start) if words else None

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


def scan_block(block: bytes, end: int, lines_before: int, matcher: Matcher, findings: dict) -> int:
    """Examine the parts of block[:end] where anchors occur; return the line count after them."""
    if matcher.scan is None and not matcher.unanchored:
        return lines_before + block.count(b"\n", 0, end)
    if block.find(b"\x1b", 0, end) != -1:
        # Colour codes go before the anchor scan: an anchor's literal may run across one ("\x1b[1mAutoBatch:
        # \x1b[0mUsing ..."). They hold no line breaks, so the line count is unchanged.
        block = _ANSI_RE.sub(b"", block[:end])
        end = len(block)
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
        line = block[start:spans[start]].decode("utf-8", "replace")
        matched = matcher.match_line(line, candidates[start])
        if matched:
            record_match(findings, matcher, matched, line, count_so_far + 1)
    return count_so_far + block.count(b"\n", counted_to, end)
