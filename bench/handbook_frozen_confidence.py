"""What `confident` and the ranking do on queries the handbook had not seen: each retired frozen set is searched
against the entries of the commit that measured it (the snapshots of bench/handbook_param_sweep.py), with today's
ranking code. Per set and pooled it prints the confident first answers by evidence (a signature or specific code, or
words alone) and how many of them have the right entry in the top 3, how many causes no entry covered still got a
confident answer, the share of top-3 hits that are confident, and where the right entry of a covered cause ranks.

    python bench/handbook_frozen_confidence.py                       # today's thresholds
    python bench/handbook_frozen_confidence.py MIN_COVERAGE=0.35     # and a variant beside them

Variants are NAME=VALUE of mleng.handbook.search, as in bench/handbook_param_sweep.py. Prints a table; writes JSON.
The sets are dev sets now: these numbers guide work, they do not measure it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mleng.handbook import search as S

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handbook_eval import evidence  # noqa: E402
from handbook_param_sweep import ROOT, open_snapshots, parse_variants, under_variants, write_result  # noqa: E402

RANKS = (("1", 1), ("2-3", 3), ("4-10", 10), ("11-50", 50))


def measure(index, cases: list[dict]) -> dict:
    """Counts for one set against one snapshot's entries."""
    ids = {e.id for e in index.entries}
    out = empty()
    for case in cases:
        accepted = S.accepted_ids(case) & ids
        found = S.search(index, case["query"], 50)
        position = next((i + 1 for i, r in enumerate(found["results"]) if r["id"] in accepted), None)
        hit = position is not None and position <= 3
        out["queries"] += 1
        if accepted:
            out["covered"] += 1
            bucket = next((name for name, top in RANKS if position is not None and position <= top), "beyond 50")
            out["rank"][bucket] += 1
        elif found["confident"]:
            out["no_entry_confident"] += 1
        if hit:
            out["hits_at_3"] += 1
            out["confident_hits"] += found["confident"]
        if found["confident"]:
            kind = evidence(found)
            out["confident"][kind][0] += 1
            out["confident"][kind][1] += hit
    return out


def empty() -> dict:
    """Zero counts; each `confident` pair is [answers, right entry in the top 3]."""
    return {"queries": 0, "covered": 0, "hits_at_3": 0, "confident_hits": 0, "no_entry_confident": 0,
            "confident": {"signature or code": [0, 0], "words": [0, 0]},
            "rank": {name: 0 for name, _ in RANKS} | {"beyond 50": 0}}


def pooled(per_set: dict) -> dict:
    total = empty()
    for counts in per_set.values():
        for key in ("queries", "covered", "hits_at_3", "confident_hits", "no_entry_confident"):
            total[key] += counts[key]
        for kind, (answers, right) in counts["confident"].items():
            total["confident"][kind][0] += answers
            total["confident"][kind][1] += right
        for bucket, n in counts["rank"].items():
            total["rank"][bucket] += n
    return total


def line(label: str, c: dict) -> str:
    sig, words = c["confident"]["signature or code"], c["confident"]["words"]
    ranks = " ".join(f"{c['rank'][k]:3d}" for k in [name for name, _ in RANKS] + ["beyond 50"])
    share = c["confident_hits"] / (c["hits_at_3"] or 1)
    return (f"{label:<34} {c['queries']:4d} {c['covered']:4d} {sig[1]:4d}/{sig[0]:<4d} {words[1]:4d}/{words[0]:<4d} "
            f"{c['no_entry_confident']:4d}/{c['queries'] - c['covered']:<4d} {share:6.3f}   {ranks}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "handbook_frozen_confidence.json")
    args = parser.parse_args()
    variants = parse_variants(parser, args.variants, "MIN_COVERAGE=0.35")
    started = time.perf_counter()
    rows = []
    print(f"{'set@entries':<34} {'qry':>4} {'cov':>4} {'sig right/conf':>14} {'words r/c':>9} {'no-entry conf':>13} "
          f"{'conf|hit':>6}   rank of the right entry: 1 2-3 4-10 11-50 beyond")
    with open_snapshots() as indexes:
        for variant, per_set in under_variants(
                variants, lambda: {f"{name}@{rev}": measure(index, cases) for name, rev, index, cases in indexes}):
            total = pooled(per_set)
            rows.append({"variant": variant, "sets": per_set, "pooled": total})
            print(f"-- {variant}")
            for label, counts in per_set.items():
                print(line(label, counts))
            print(line("pooled", total), flush=True)
    write_result(args.out, "handbook_frozen_confidence.py", rows, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
