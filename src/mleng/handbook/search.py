"""Ranking for `mleng ask`: FTS5 BM25 over weighted fields, plus signature, code and phrase matches."""

from __future__ import annotations

import math
import re
from pathlib import Path

from mleng.handbook import terms as T
from mleng.handbook.index import FTS_COLUMNS, Index, open_index

# BM25 weight per FTS column: where the user's words usually come from (an error line, a symptom)
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


def fts_match_expression(words: list[str]) -> str | None:
    """An FTS5 OR-of-terms query. Terms are alphanumeric and quoted, so no FTS syntax gets through."""
    unique = list(dict.fromkeys(words))[:MAX_QUERY_TERMS]
    if not unique:
        return None
    return " OR ".join('"' + w.replace('"', '""') + '"' for w in unique)


def _bm25_scores(index: Index, words: list[str]) -> dict[int, float]:
    expression = fts_match_expression(words)
    if expression is None:
        return {}
    weights = ", ".join(str(COLUMN_WEIGHTS[c]) for c in FTS_COLUMNS)
    rows = index.conn.execute(f"SELECT rowid, bm25(docs, {weights}) FROM docs WHERE docs MATCH ?", (expression,))
    # bm25() is negative, more negative is better
    return {rowid: -score for rowid, score in rows}


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
    bm25 = _bm25_scores(index, words)
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
    """hit@1 and hit@depth of the ranking over labelled cases ({"query", "expected", "also"?})."""
    rows = []
    for case in cases:
        accepted = {case["expected"], *case.get("also", [])}
        ranked = [r["id"] for r in rank(index, case["query"], limit=depth)]
        position = next((i + 1 for i, rid in enumerate(ranked) if rid in accepted), None)
        rows.append({"query": case["query"], "expected": case["expected"], "got": ranked, "position": position,
                     "source": case.get("source")})
    total = len(rows) or 1
    return {"cases": len(rows), "hit_at_1": sum(r["position"] == 1 for r in rows) / total,
            f"hit_at_{depth}": sum(r["position"] is not None for r in rows) / total, "rows": rows}
