"""Ranking for `mleng ask`: BM25 over the weighted fields of the FTS5 index, plus signature, code and phrase matches."""

from __future__ import annotations

import math
import re
import sqlite3
from pathlib import Path

from mleng.handbook import terms as T
from mleng.handbook.index import FTS_COLUMNS, Index, open_index

# BM25 weight per column: where the user's words usually come from (an error line, a symptom)
# counts most; the explanation and the commands count less.
COLUMN_WEIGHTS = {"title": 6.0, "symptoms": 10.0, "signatures": 3.0, "codes": 5.0, "tags": 3.0,
                  "cause": 2.0, "confirm": 1.0, "fix": 1.0, "seen": 3.0, "body": 0.7}
SIGNATURE_WEIGHT = 2.0      # a regex from the entry matched a line of the query
MAX_SIGNATURE_HITS = 2
PHRASE_WEIGHT = 1.0         # shared word 3-grams with the entry's symptoms (a near-verbatim paste)
PHRASE_SATURATION = 6
MAX_QUERY_TERMS = 300
MAX_QUERY_CHARS = 200_000

RESULT_FIELDS = ("id", "title", "category", "score", "symptoms", "cause", "confirm", "fix", "applies_to", "sources")


# A pasted traceback is mostly frames: 'File "x.py", line 12, in forward' and the source line under it.
# Their words (function and variable names) say where the error surfaced, rarely what it is, so they
# count a fraction of the words of the error and log lines around them.
FRAME_WEIGHT = 0.5
_FRAME_RE = re.compile(r'^\s*(?:File "[^"]*", line \d+|frame #\d+:|at [\w.$]+\(|#\d+\s+0x[0-9a-f]+ in )')
_CARET_RE = re.compile(r"^\s*[\^~]+\s*$")

BM25_K1 = 1.2
BM25_B = 0.75


def _stems(words: list[str]) -> list[str]:
    """The porter stems FTS5 gave the index, for the query words, in order (one per word)."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute("CREATE VIRTUAL TABLE q USING fts5(t, tokenize='porter unicode61')")
        conn.execute("CREATE VIRTUAL TABLE qv USING fts5vocab(q, instance)")
        conn.execute("INSERT INTO q VALUES (?)", (" ".join(words),))
        stems = [term for term, _ in sorted(conn.execute("SELECT term, offset FROM qv"), key=lambda r: r[1])]
    finally:
        conn.close()
    return stems if len(stems) == len(words) else words


def query_weights(query: str) -> dict[str, float]:
    """Each query term with its weight: 1 on error and log lines, FRAME_WEIGHT when it occurs only on
    traceback frame lines and the source lines printed under them."""
    weights: dict[str, float] = {}
    after_frame = False
    for line in query.splitlines() or [query]:
        if _CARET_RE.match(line):
            continue
        if _FRAME_RE.match(line):
            weight, after_frame = FRAME_WEIGHT, True
        elif after_frame and line[:1].isspace():
            weight, after_frame = FRAME_WEIGHT, False   # the source line a frame prints under itself
        else:
            weight, after_frame = 1.0, False
        for word in T.terms(line):
            weights[word] = max(weights.get(word, 0.0), weight)
    return weights


def _bm25_scores(index: Index, weighted: dict[str, float]) -> dict[int, float]:
    """BM25 over the weighted columns, each query term counted with its weight.

    FTS5's own bm25() clamps the IDF of any term found in half of the rows to ~0; in a handbook about
    GPU clusters that silences "node", "nccl" and "gpu", which still tell entries apart. The IDF here
    is the smoothed log(1 + (N - n + 0.5) / (n + 0.5)) instead, always positive, small for common terms.
    """
    words = list(weighted)[:MAX_QUERY_TERMS]
    if not words:
        return {}
    query: dict[str, float] = {}
    for word, stem in zip(words, _stems(words)):
        query[stem] = max(query.get(stem, 0.0), weighted[word])
    column_weight = [COLUMN_WEIGHTS[c] for c in FTS_COLUMNS]
    frequency: dict[str, dict[int, float]] = {}
    placeholders = ", ".join("?" * len(query))
    for term, rowid, col, tf in index.conn.execute(
            f"SELECT term, rowid, col, tf FROM postings WHERE term IN ({placeholders})", list(query)):
        per_row = frequency.setdefault(term, {})
        per_row[rowid] = per_row.get(rowid, 0.0) + column_weight[col] * tf
    total = len(index.lengths)
    scores: dict[int, float] = {}
    for term, per_row in frequency.items():
        idf = math.log(1.0 + (total - len(per_row) + 0.5) / (len(per_row) + 0.5))
        for rowid, f in per_row.items():
            norm = BM25_K1 * (1 - BM25_B + BM25_B * index.lengths[rowid] / index.average_length)
            scores[rowid] = scores.get(rowid, 0.0) + query[term] * idf * f * (BM25_K1 + 1) / (f + norm)
    return scores


def _signature_score(entry, lines: list[str], lowered: str) -> float:
    """Signature matches, each weighted by how much of the matched text the regex fixed literally:
    'failed \\(exitcode: -9\\)' matched verbatim says more than a pattern full of wildcards."""
    found = []
    for pattern, anchor in zip(entry.data["signatures"], entry.anchors):
        if anchor is not None and not any(a in lowered for a in anchor):
            continue
        try:
            regex = re.compile(pattern)
        except re.error:
            continue
        for line in lines:
            match = regex.search(line)
            if match:
                literal = T.literal_length(pattern)
                found.append(0.5 + 0.5 * min(1.0, literal / max(1, len(match.group(0)))))
                break
    return SIGNATURE_WEIGHT * sum(sorted(found, reverse=True)[:MAX_SIGNATURE_HITS])


def rank(index: Index, query: str, limit: int = 5) -> list[dict]:
    """The best entries for the query text, best first, each with its score and its parts."""
    query = query[:MAX_QUERY_CHARS]
    words = T.terms(query)
    bm25 = _bm25_scores(index, query_weights(query))
    best_bm25 = max(bm25.values(), default=0.0)
    lines = [line for line in query.splitlines() if line.strip()] or [query]
    lowered = query.lower()
    query_codes = T.error_codes(query)
    query_shingles = T.shingles(words)

    code_df: dict[str, int] = {}
    for entry in index.entries:
        for code in entry.codes:
            code_df[code] = code_df.get(code, 0) + 1

    scored = []
    for entry in index.entries:
        text_score = bm25.get(entry.rowid, 0.0) / best_bm25 if best_bm25 > 0 else 0.0
        signature_score = _signature_score(entry, lines, lowered)
        code_score = sum(T.code_weight(c) / math.sqrt(code_df[c]) for c in query_codes.intersection(entry.codes))
        phrase_score = PHRASE_WEIGHT * min(len(query_shingles.intersection(entry.shingles)), PHRASE_SATURATION) \
            / PHRASE_SATURATION
        score = text_score + signature_score + code_score + phrase_score
        if score > 0:
            scored.append((score, entry))
    scored.sort(key=lambda pair: (-pair[0], pair[1].data["id"]))
    return [{k: round(score, 4) if k == "score" else entry.data[k] for k in RESULT_FIELDS}
            for score, entry in scored[:limit]]


def ask(query: str, limit: int = 5, directory: Path | None = None) -> tuple[list[dict], list[dict]]:
    """Results for the query, and the entry files that were skipped as malformed."""
    index = open_index(directory)
    try:
        return rank(index, query, limit), index.skipped
    finally:
        index.close()


def evaluate(cases: list[dict], index: Index, depth: int = 3) -> dict:
    """hit@1 and hit@depth of the ranking over labelled cases ({"query", "expected", "also"?});
    `expected` is an id or a list of ids that answer the query equally well."""
    rows = []
    for case in cases:
        expected = case["expected"] if isinstance(case["expected"], list) else [case["expected"]]
        accepted = {*expected, *case.get("also", [])}
        ranked = [r["id"] for r in rank(index, case["query"], limit=depth)]
        position = next((i + 1 for i, rid in enumerate(ranked) if rid in accepted), None)
        rows.append({"query": case["query"], "expected": case["expected"], "got": ranked, "position": position,
                     "source": case.get("source")})
    total = len(rows) or 1
    return {"cases": len(rows), "hit_at_1": sum(r["position"] == 1 for r in rows) / total,
            f"hit_at_{depth}": sum(r["position"] is not None for r in rows) / total, "rows": rows}
