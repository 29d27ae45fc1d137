"""Ranking for `mleng ask`: BM25 over the weighted fields of the FTS5 index, plus signature, code and phrase matches."""

from __future__ import annotations

import itertools
import math
import operator
import re
from pathlib import Path

from mleng.handbook import terms as T
from mleng.handbook.index import FTS_COLUMNS, Index, open_index
from mleng.handbook.stem import stem

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
# A pasted exception line ("AttributeError: ...", "torch.OutOfMemoryError: ...").
_PASTED_ERROR_RE = re.compile(r"\b[A-Za-z_.]*(?:Error|Exception)\b:")

BM25_K1 = 1.2
BM25_B = 0.75


def _stems(words: list[str]) -> list[str]:
    """The Porter stems the index stores (stem.py), for the query words, in order (one per word)."""
    return [stem(w) for w in words]


def query_weights(query: str) -> dict[str, float]:
    """Each query term with its weight: 1 on error and log lines, FRAME_WEIGHT when it occurs only on
    traceback frame lines and the source lines printed under them, ASIDE_WEIGHT in a clause about
    something that happened before."""
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
        for clause in _CLAUSE_RE.split(line):
            clause_weight = weight * ASIDE_WEIGHT if _ASIDE_RE.search(clause) else weight
            for word in T.terms(clause):
                weights[word] = max(weights.get(word, 0.0), clause_weight)
    return weights


# A narrative aside ("I had an OOM earlier, but now ...") is about another problem than the one asked:
# its clause counts a fraction.
ASIDE_WEIGHT = 0.35
_CLAUSE_RE = re.compile(r"(?<=[.;!?])\s+|,\s*(?=but\b|though\b|however\b|now\b)|\s+(?=but now\b)", re.I)
_ASIDE_RE = re.compile(r"\b(?:earlier|previously|yesterday|last (?:week|month|time|year)|used to|in the past"
                       r"|a while ago|before that|at first|originally|unrelated)\b", re.I)


class QueryTerms:
    """The query's search terms as the index stores them (porter stems), each with its weight, the word
    it came from, and in how many entries it occurs (0: a word the handbook never uses)."""
    __slots__ = ("weight", "word", "df", "entries")

    def __init__(self, weight: dict[str, float], word: dict[str, str], df: dict[str, int], entries: int):
        self.weight, self.word, self.df, self.entries = weight, word, df, entries

    def idf(self, stem: str) -> float:
        n = self.df.get(stem, 0)
        return math.log(1.0 + (self.entries - n + 0.5) / (n + 0.5))


def _bm25_scores(index: Index, weighted: dict[str, float]) -> tuple[dict[int, float], QueryTerms, list]:
    """BM25 over the weighted columns, each query term counted with its weight; also the query's
    postings per (term, entry) as (term, rowid, weighted tf, mask of the columns it occurs in), which
    `_columns` reads for the few entries shown.

    FTS5's own bm25() clamps the IDF of any term found in half of the rows to ~0; in a handbook about
    GPU clusters that silences "node", "nccl" and "gpu", which still tell entries apart. The IDF here
    is the smoothed log(1 + (N - n + 0.5) / (n + 0.5)) instead, always positive, small for common terms.
    """
    words = list(weighted)[:MAX_QUERY_TERMS]
    total = len(index.lengths)
    query = QueryTerms({}, {}, {}, total)
    if not words:
        return {}, query, []
    for word, stem in zip(words, _stems(words)):
        if weighted[word] > query.weight.get(stem, 0.0):
            query.weight[stem], query.word[stem] = weighted[word], word
    # SQLite weighs each (term, entry)'s column counts and adds them in column order, in doubles, as a loop
    # here or the site's script would.
    weighted_tf = " + ".join(f"{c} * ?" for c in FTS_COLUMNS)
    placeholders = ", ".join("?" * len(query.weight))
    postings = index.conn.execute(
        f"SELECT term, rowid, {weighted_tf}, mask FROM postings WHERE term IN ({placeholders}) ORDER BY term, rowid",
        [COLUMN_WEIGHTS[c] for c in FTS_COLUMNS] + list(query.weight)).fetchall()
    scores: dict[int, float] = {}
    norms, k1_plus_1 = index.length_norms(BM25_K1, BM25_B), BM25_K1 + 1
    for term, group in itertools.groupby(postings, key=operator.itemgetter(0)):
        rows = list(group)
        query.df[term] = len(rows)
        weight = query.weight[term] * query.idf(term)
        get = scores.get
        for _, rowid, f, _ in rows:
            scores[rowid] = get(rowid, 0.0) + weight * f * k1_plus_1 / (f + norms[rowid])
    return scores, query, postings


def _columns(postings: list, rowids: set[int]) -> dict[int, dict[str, int]]:
    """rowid -> {query stem: mask of the columns it occurs in}, for the given entries."""
    columns: dict[int, dict[str, int]] = {}
    for term, rowid, _, mask in postings:
        if rowid in rowids:
            columns.setdefault(rowid, {})[term] = mask
    return columns


def _shared_shingles(index: Index, query_shingles: set[str]) -> dict[int, int]:
    """rowid -> how many of the query's word 3-grams the entry's title and symptoms contain."""
    shared: dict[int, int] = {}
    chunk = sorted(query_shingles)
    for start in range(0, len(chunk), 500):  # SQLite's limit on bound parameters
        part = chunk[start:start + 500]
        for (rowid,) in index.conn.execute(
                f"SELECT rowid FROM shingles WHERE shingle IN ({','.join('?' * len(part))})", part):
            shared[rowid] = shared.get(rowid, 0) + 1
    return shared


def _signature_score(entry, lines: list[str], lowered: str, hits: list[str] | None = None) -> float:
    """Signature matches, each weighted by how much of the matched text the regex fixed literally:
    'failed \\(exitcode: -9\\)' matched verbatim says more than a pattern full of wildcards."""
    found = []
    for pattern, anchor in zip(entry.signatures, entry.anchors):
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
                if hits is not None:
                    hits.append(pattern)
                break
    return SIGNATURE_WEIGHT * sum(sorted(found, reverse=True)[:MAX_SIGNATURE_HITS])


# Columns where a shared term says the entry is about the query's problem (what users see and
# write), rather than only mentioned in its explanation or commands.
STRONG_COLUMNS = frozenset(FTS_COLUMNS.index(c) for c in ("title", "symptoms", "signatures", "codes", "tags", "seen"))
_STRONG_MASK = sum(1 << c for c in STRONG_COLUMNS)


class Match:
    """Why an entry matched: what `mleng ask --json` reports as `matched`, and what confidence reads.
    (A plain class, like QueryTerms: `mleng ask` starts faster without importing dataclasses.)"""
    __slots__ = ("signatures", "codes", "terms", "other_terms", "phrases", "coverage", "strong_idf", "domain",
                 "general", "pasted_error")

    def __init__(self, signatures: list[str], codes: list[str], terms: list[str], other_terms: list[str],
                 phrases: int, coverage: float, strong_idf: float, domain: list[str], general: bool = False,
                 pasted_error: bool = False):
        self.signatures, self.codes = signatures, codes
        self.terms = terms              # query words found in the entry's title, symptoms, signatures, codes or tags
        self.other_terms = other_terms  # query words found only in its explanation, confirm or fix text
        self.phrases = phrases          # word 3-grams shared with the entry's title and symptoms
        self.coverage = coverage        # share of the query's term weight (IDF x line weight) in strong columns
        self.strong_idf = strong_idf    # the IDF mass of those strong-column matches
        self.domain = domain            # words of the query from the handbook's world (T.DOMAIN_WORDS)
        self.general = general          # a diagnosis entry (tag 'general') answering a short, vague query
        self.pasted_error = pasted_error  # the query holds an exception line ("KeyError: ...")

    def to_dict(self) -> dict:
        return {"signatures": self.signatures, "codes": self.codes, "terms": self.terms,
                "other_terms": self.other_terms, "phrases": self.phrases,
                "coverage": round(self.coverage, 3), "strong_idf": round(self.strong_idf, 2),
                "domain": self.domain}


def _match(entry, query: QueryTerms, columns: dict[str, int], signatures: list[str], codes: list[str],
           phrases: int, domain: list[str]) -> Match:
    strong = [t for t, mask in columns.items() if mask & _STRONG_MASK]
    other = [t for t, mask in columns.items() if not mask & _STRONG_MASK]
    mass = {t: query.weight[t] * query.idf(t) for t in query.weight}
    total = sum(mass.values()) or 1.0
    strong_mass = sum(mass[t] for t in strong)
    return Match(signatures, codes, sorted(query.word[t] for t in strong), sorted(query.word[t] for t in other),
                 phrases, strong_mass / total, sum(query.idf(t) for t in strong), domain)


def rank(index: Index, query: str, limit: int = 5) -> list[dict]:
    """The best entries for the query text, best first, each with its score and its parts."""
    return search(index, query, limit)["results"]


def search(index: Index, query: str, limit: int = 5) -> dict:
    """{"confident": bool, "results": [...]}: the best entries, best first, each with its score, its parts
    and what matched; `confident` says whether the best one is a real answer (see `confident`)."""
    query = query[:MAX_QUERY_CHARS]
    words = T.terms(query)
    bm25, terms, postings = _bm25_scores(index, query_weights(query))
    best_bm25 = max(bm25.values(), default=0.0)
    lines = [line for line in query.splitlines() if line.strip()] or [query]
    lowered = query.lower()
    query_codes = T.error_codes(query)
    triples, pairs = T.query_shingles(words)
    shared_shingles = _shared_shingles(index, triples)
    whole_lines = _shared_shingles(index, pairs)
    short = len(terms.weight) <= SHORT_QUERY_TERMS
    domain = sorted(T.domain_words(words))
    word_set = set(words)
    pasted_error = bool(_PASTED_ERROR_RE.search(query))

    code_entries = index.code_entries()
    code_df = {code: len(code_entries[code]) for code in query_codes if code in code_entries}
    # Only an entry that shares a term, a word 3-gram, an error code or a signature anchor with the query
    # can score above 0; the others are skipped without a look.
    with_anchor = {entry.rowid for literal, found in index.anchor_entries().items() if literal in lowered
                   for entry in found}
    candidates = with_anchor.union(bm25, shared_shingles, whole_lines,
                                   (entry.rowid for code in code_df for entry in code_entries[code]))

    scored = []
    for rowid in candidates:
        entry = index.entries[rowid - 1]
        text_score = bm25.get(entry.rowid, 0.0) / best_bm25 if best_bm25 > 0 else 0.0
        signature_hits: list[str] = []
        signature_score = _signature_score(entry, lines, lowered, signature_hits) if rowid in with_anchor else 0.0
        shared_codes = sorted(query_codes.intersection(entry.codes))
        code_score = sum(T.code_weight(c) / math.sqrt(code_df[c]) for c in shared_codes)
        whole_line = whole_lines.get(entry.rowid, 0)
        shared_phrases = shared_shingles.get(entry.rowid, 0) + whole_line
        phrase_score = PHRASE_WEIGHT * min(shared_phrases, PHRASE_SATURATION) / PHRASE_SATURATION
        # A short, vague query ("training hangs at step 3000") is best answered by the entry on how
        # to diagnose that kind of problem, not by whichever narrow cause shares the most words.
        framework = T.FRAMEWORK_WORDS.get(entry.category)
        if framework is not None and not signature_score and not whole_line and not framework.intersection(word_set):
            text_score *= OTHER_FRAMEWORK_FACTOR
            phrase_score *= OTHER_FRAMEWORK_FACTOR
        general = GENERAL_WEIGHT * text_score if short and "general" in entry.tags else 0.0
        # Between entries that a description matches in words alone about as well, the cause that more
        # users really hit is the better guess (a short query is left to the general entries above).
        base_rate = (0.0 if short or signature_score or code_score
                     else REPORT_WEIGHT * text_score * math.log1p(entry.reports))
        score = text_score + signature_score + code_score + phrase_score + general + base_rate
        if score > 0:
            scored.append((score, entry, signature_hits, shared_codes, shared_phrases))
    scored.sort(key=lambda item: (-item[0], item[1].id))
    results = []
    columns = _columns(postings, {item[1].rowid for item in scored[:limit]})
    for score, entry, signature_hits, shared_codes, shared_phrases in scored[:limit]:
        match = _match(entry, terms, columns.get(entry.rowid, {}), signature_hits, shared_codes, shared_phrases,
                       domain)
        match.general = short and "general" in entry.tags
        match.pasted_error = pasted_error
        result = {k: round(score, 4) if k == "score" else entry.data[k] for k in RESULT_FIELDS}
        result["matched"] = match.to_dict()
        result["confident"] = confident(match)
        results.append(result)
    return {"confident": bool(results) and results[0]["confident"], "results": results}


SHORT_QUERY_TERMS = 5
# An entry about one framework, for a query that does not name it and matches none of its signatures.
OTHER_FRAMEWORK_FACTOR = 0.7
GENERAL_WEIGHT = 0.35
# Weight of an entry's real user reports (index.REPORTS_PATH) on matches with no signature or code. Chosen on
# the retired frozen sets 9-11, each at the entries and dev sets of the day it was measured: 0.2 gave covered
# hit@1 +2, +2, +3 and hit@3 +2, +1, +11 of 78, 43 and 163 cases, and no confident out-of-scope answer.
REPORT_WEIGHT = 0.2
# Codes specific enough that sharing one names the problem (an Xid, a CUDA or NCCL error number).
SPECIFIC_CODE_KINDS = ("xid ", "cuda error ", "nccl error ", "vendor err ")
# A match on words alone (no signature, no specific code) is confident when a good share of the query's
# weight falls on what the entry says users see, in words rare enough to say something (or most of it, in
# somewhat rarer words), or when the query shares several word 3-grams with its symptom lines. The looser
# 0.2 / 4.0 of earlier releases made more confident wrong answers on words alone, the weakest evidence
# (`python bench/handbook_eval.py --set ...` prints how often each kind of confident answer is right).
MIN_COVERAGE = 0.25
MIN_STRONG_IDF = 8.0
HIGH_COVERAGE = 0.6
HIGH_COVERAGE_IDF = 6.0
MIN_SHARED_PHRASES = 2
# A signature match on a query with no domain word counts when the query is nearly the entry's own
# symptom line (most of its weight and several word 3-grams): "trying to initialize the default process
# group twice" is torch.distributed's, though no word in it says so.
NEAR_VERBATIM_COVERAGE = 0.8
NEAR_VERBATIM_PHRASES = 3


def has_specific_code(codes: list[str]) -> bool:
    """Whether one of the shared codes names the problem by itself: an Xid, a CUDA or NCCL error number,
    a vendor error, or a source line such as socket.cc:538."""
    return any(c.startswith(SPECIFIC_CODE_KINDS) or (c.startswith("source ") and ":" in c) for c in codes)


def words_only(matched: dict) -> bool:
    """Whether a result's `matched` rests on words alone: no log signature and no specific error code,
    the weakest evidence (what `mleng ask` calls a best guess, and what bench/handbook_eval.py counts apart)."""
    return not matched["signatures"] and not has_specific_code(matched["codes"])


def confident(match: Match) -> bool:
    """Whether a result is a real answer, not the least bad of unrelated entries.

    Yes when they share a specific error code (an Xid, a CUDA or NCCL error number, a source line), or
    when a signature matched a query that is nearly the entry's own symptom line. Else only for a query
    about the handbook's world (a GPU, training or cluster word, T.DOMAIN_WORDS): when one of the entry's
    log signatures matched; when enough of the query's weight (MIN_COVERAGE of its IDF mass, or
    HIGH_COVERAGE) falls on what the entry says users see, in words rare enough (MIN_STRONG_IDF, or
    HIGH_COVERAGE_IDF) to say something; when the query shares MIN_SHARED_PHRASES word 3-grams with its
    symptoms; or when a short vague query ("training hangs") is nearly all in a diagnosis entry's words.
    A query that pastes an exception line gets no words-only answer from an entry that shares not one
    word 3-gram with it: the error is then one the entry never shows (the 3 such confident answers on
    dev set 9 as first frozen, and the 3 on all dev sets today, were all wrong).
    Chit-chat, binary junk and errors of other software fail: their words are unknown to the handbook,
    common to all of it, or outside its world.
    """
    if has_specific_code(match.codes):
        return True
    if match.signatures and (match.domain or (match.coverage >= NEAR_VERBATIM_COVERAGE
                                               and match.phrases >= NEAR_VERBATIM_PHRASES)):
        return True
    if not match.domain:
        return False
    if match.general and match.coverage >= NEAR_VERBATIM_COVERAGE:
        return True
    if match.pasted_error and not match.phrases:
        return False
    return (match.coverage >= MIN_COVERAGE and match.strong_idf >= MIN_STRONG_IDF) or \
        (match.coverage >= HIGH_COVERAGE and match.strong_idf >= HIGH_COVERAGE_IDF) or \
        match.phrases >= MIN_SHARED_PHRASES


def ask(query: str, limit: int = 5, directory: Path | None = None) -> tuple[dict, list[dict]]:
    """search() for the query ({"confident", "results"}), and the entry files skipped as malformed."""
    index = open_index(directory)
    try:
        return search(index, query, limit), index.skipped
    finally:
        index.close()


def accepted_ids(case: dict) -> set[str]:
    """The entry ids that answer a labelled case ({"expected", "also"?}); `expected` is an id or a list of ids that
    answer the query equally well."""
    expected = case["expected"] if isinstance(case["expected"], list) else [case["expected"]]
    return {*expected, *case.get("also", [])}


def evaluate(cases: list[dict], index: Index | None, depth: int = 3, answers=None) -> dict:
    """hit@1 and hit@depth of the ranking over labelled cases ({"query", "expected", "also"?}, see accepted_ids).
    `answers`: query -> search() output with at least `depth` results, where they are already at hand (the first
    results do not depend on the limit)."""
    rows = []
    for case in cases:
        accepted = accepted_ids(case)
        found = answers(case["query"])["results"] if answers else rank(index, case["query"], limit=depth)
        ranked = [r["id"] for r in found[:depth]]
        position = next((i + 1 for i, rid in enumerate(ranked) if rid in accepted), None)
        rows.append({"query": case["query"], "expected": case["expected"], "got": ranked, "position": position,
                     "source": case.get("source")})
    total = len(rows) or 1
    return {"cases": len(rows), "hit_at_1": sum(r["position"] == 1 for r in rows) / total,
            f"hit_at_{depth}": sum(r["position"] is not None for r in rows) / total, "rows": rows}
