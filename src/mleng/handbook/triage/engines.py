"""Triage's anchor scanners: every anchor of every signature found in one pass over a block, with Hyperscan,
Aho-Corasick, or the portable regex alternation."""

from __future__ import annotations

import re


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


def scan_engine(anchors: list[bytes], preferred: str | None = None,
                line_start: dict[int, list[str]] | None = None):
    names = [preferred] if preferred else list(SCAN_ENGINES)
    for name in names:
        try:
            return SCAN_ENGINES[name](anchors, line_start)
        except ImportError:
            continue
    return _RegexScan(anchors, line_start)
