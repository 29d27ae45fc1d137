"""Quality of `mleng ask` on a query set: hit@1, hit@3, how often a hit is confident, and the confident
rate on out-of-scope sets; a frozen set is checked against its recorded sha256 before it is measured.

    python bench/handbook_eval.py --frozen                 # the frozen held-out sets (once per release)
    python bench/handbook_eval.py --set tests/handbook_devset.yaml --oos tests/handbook_oos_dev.yaml
    python bench/handbook_eval.py --frozen --report-weight 0 --out /tmp/x.json   # ablation: no base rate

A frozen set's queries carry no entry ids (they were collected before the entries they judge); their
labels live in tests/handbook_frozen34_labels.yaml, joined by source URL. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import yaml

from mleng.handbook.index import open_index
from mleng.handbook.model import thread_url
import mleng.handbook.search
from mleng.handbook.search import REPORT_WEIGHT, accepted_ids, search, words_only

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
FROZEN = TESTS / "handbook_frozen34.yaml"
FROZEN_OOS = TESTS / "handbook_oos_frozen.yaml"
LABELS = TESTS / "handbook_frozen34_labels.yaml"
HASHES = TESTS / "handbook_frozen.sha256"


def fail(message: str) -> None:
    print(f"handbook_eval.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_frozen(path: Path) -> str:
    """The file's sha256, after checking it equals the one recorded when the set was frozen."""
    recorded = {}
    for line in HASHES.read_text().splitlines():
        digest, name = line.split()
        recorded[Path(name).name] = digest
    if not path.exists():
        fail(f"{path} does not exist: the last frozen set was retired to a dev set once measured, and the "
             "next one is collected before the work it judges (see the README's handbook quality notes)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if recorded.get(path.name) != digest:
        fail(f"{path} changed since it was frozen (sha256 {digest}, recorded "
             f"{recorded.get(path.name)}): a frozen set is never edited")
    return digest


def labelled_cases(path: Path) -> list[dict]:
    cases = yaml.safe_load(path.read_text())
    if path == FROZEN:
        if not LABELS.exists():
            fail(f"{LABELS} does not exist: a frozen set is measured once its labels are committed, "
                 "assigned from the entries' text without running the search")
        labels = {thread_url(x["source"]): x for x in yaml.safe_load(LABELS.read_text())}
        for case in cases:
            label = labels.get(thread_url(case["source"]))
            if label is None:
                fail(f"no label for {case['source']} in {LABELS}")
            case["expected"] = label["expected"]
    return cases


def cited_urls() -> set[str]:
    urls = set()
    for path in (ROOT / "src" / "mleng" / "handbook" / "entries").glob("*.md"):
        urls.update(thread_url(u) for u in re.findall(r"https?://[^\s\"'<>]+", path.read_text()))
    return urls


def measure_labelled(index, cases: list[dict]) -> dict:
    rows = []
    for case in cases:
        expected = case["expected"] if isinstance(case["expected"], list) else [case["expected"]]
        accepted = accepted_ids(case)
        answer = search(index, case["query"], 3)
        got = [r["id"] for r in answer["results"]]
        position = next((i + 1 for i, rid in enumerate(got) if rid in accepted), None)
        rows.append({"query": case["query"], "expected": expected, "got": got, "position": position,
                     "confident": answer["confident"], "evidence": evidence(answer),
                     "source": case.get("source"), "area": case.get("area")})
    return rows


def evidence(answer: dict) -> str | None:
    """What a confident first answer rests on: a log signature or a specific error code, or words alone."""
    if not answer["confident"]:
        return None
    return "words" if words_only(answer["results"][0]["matched"]) else "signature or code"


def summary(rows: list[dict]) -> dict:
    n = len(rows) or 1
    hits = [r for r in rows if r["position"]]
    unanswerable = [r for r in rows if not r["expected"]]
    return {"queries": len(rows), "hit_at_1": round(sum(r["position"] == 1 for r in rows) / n, 3),
            "hit_at_3": round(len(hits) / n, 3),
            "confident_among_hits": round(sum(r["confident"] for r in hits) / (len(hits) or 1), 3),
            "confident_overall": round(sum(r["confident"] for r in rows) / n, 3),
            "no_entry_labelled": len(unanswerable),
            "confident_by_evidence": {
                kind: {"answers": len(group), "right_in_top3": round(sum(bool(r["position"]) for r in group)
                                                                   / (len(group) or 1), 3)}
                for kind in ("signature or code", "words")
                for group in [[r for r in rows if r["evidence"] == kind]]}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frozen", action="store_true", help="measure the frozen held-out sets")
    parser.add_argument("--set", action="append", default=[], help="a labelled query set (repeatable)")
    parser.add_argument("--oos", action="append", default=[], help="an out-of-scope query set (repeatable)")
    parser.add_argument("--out", default=None, help="JSON output (default docs/results/handbook_eval[_frozen].json)")
    parser.add_argument("--report-weight", type=float, default=None,
                        help=f"weight of the entries' user reports, for an ablation (default {REPORT_WEIGHT})")
    args = parser.parse_args()
    if args.report_weight is not None:
        if not 0 <= args.report_weight <= 10:
            parser.error(f"--report-weight {args.report_weight}: give a weight between 0 and 10")
        mleng.handbook.search.REPORT_WEIGHT = args.report_weight
    sets = [Path(p) for p in args.set]
    oos_sets = [Path(p) for p in args.oos]
    digests = {}
    if args.frozen:
        sets.append(FROZEN)
        oos_sets.append(FROZEN_OOS)
        digests = {p.name: check_frozen(p) for p in (FROZEN, FROZEN_OOS)}
    if not sets and not oos_sets:
        parser.error("name a set: --frozen, --set FILE or --oos FILE")
    missing = [str(p) for p in sets + oos_sets if not p.is_file()]
    if missing:
        parser.error(f"no such query set: {', '.join(missing)} (the sets are tests/handbook_*.yaml)")
    cited = cited_urls()
    report = {"command": " ".join(["python", "bench/handbook_eval.py", *sys.argv[1:]]), "sha256": digests,
              "report_weight": mleng.handbook.search.REPORT_WEIGHT, "sets": {}, "oos": {}}
    with tempfile.TemporaryDirectory() as tmp:
        index = open_index(cache_path=Path(tmp) / "index.sqlite")
        report["entries"] = len(index.entries)
        started = time.perf_counter()
        for path in sets:
            rows = measure_labelled(index, labelled_cases(path))
            fresh = [r for r in rows if not r["source"] or thread_url(r["source"]) not in cited]
            report["sets"][path.name] = {"all": summary(rows), "threads_not_cited_by_entries": summary(fresh),
                                         "rows": rows}
        for path in oos_sets:
            cases = yaml.safe_load(path.read_text())
            confident = [c["query"] for c in cases if search(index, c["query"], 3)["confident"]]
            report["oos"][path.name] = {"queries": len(cases), "confident": len(confident),
                                        "confident_rate": round(len(confident) / (len(cases) or 1), 3),
                                        "confident_queries": confident}
        report["elapsed_s"] = round(time.perf_counter() - started, 2)
        index.close()
    print(f"mleng ask against {report['entries']} entries")
    print(f"{'set':<34} {'subset':<12} {'queries':>7} {'hit@1':>6} {'hit@3':>6} {'conf|hit':>8}")
    for name, result in report["sets"].items():
        for subset, key in (("all", "all"), ("not cited", "threads_not_cited_by_entries")):
            s = result[key]
            print(f"{name:<34} {subset:<12} {s['queries']:>7} {s['hit_at_1']:>6.3f} {s['hit_at_3']:>6.3f} "
                  f"{s['confident_among_hits']:>8.3f}")
    pooled = summary([row for result in report["sets"].values() for row in result["rows"]])["confident_by_evidence"]
    report["confident_by_evidence_pooled"] = pooled
    print("confident first answers, all labelled sets pooled: " + "; ".join(
        f"{kind}: {v['answers']}, right entry in the top 3 for {v['right_in_top3']:.3f}" for kind, v in pooled.items()))
    for name, result in report["oos"].items():
        print(f"{name:<34} {'out of scope':<12} {result['queries']:>7}   confident {result['confident_rate']:.3f}")
    for name, digest in digests.items():
        print(f"frozen {name}: sha256 {digest} (matches tests/handbook_frozen.sha256)")
    out = Path(args.out) if args.out else ROOT / "docs" / "results" / (
        "handbook_eval_frozen.json" if args.frozen else "handbook_eval.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
