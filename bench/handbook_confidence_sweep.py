"""How the words-only confidence thresholds of `mleng ask` trade right answers called confident against
noise called confident, on dev sets only. For each (MIN_COVERAGE, MIN_STRONG_IDF, HIGH_COVERAGE,
HIGH_COVERAGE_IDF, MIN_SHARED_PHRASES) it prints, per labelled set: the share of top-3 hits that are confident,
the share of confident first answers with the right entry in the top 3, and how many cases no entry covers got
a confident answer anyway; and the confident count on the out-of-scope sets.

    python bench/handbook_confidence_sweep.py --set tests/handbook_devset7.yaml --entries-rev 4c13677 \\
        --set tests/handbook_devset2.yaml --oos tests/handbook_oos_dev.yaml

--entries-rev REV measures the sets that follow it against the entries (and labels) as they were at that
commit (a set measured before work was done for it), the others against the working tree. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

import mleng.handbook.search as S
from mleng.handbook.index import open_index

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handbook_eval import measure_labelled  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KNOBS = ("MIN_COVERAGE", "MIN_STRONG_IDF", "HIGH_COVERAGE", "HIGH_COVERAGE_IDF", "MIN_SHARED_PHRASES")
GRID = [(0.3, 8.0, 0.6, 6.0, 2), (0.25, 8.0, 0.6, 6.0, 2), (0.2, 8.0, 0.5, 6.0, 2), (0.25, 7.0, 0.5, 5.0, 2),
        (0.15, 6.0, 0.4, 5.0, 1), (0.1, 4.0, 0.3, 3.0, 1)]


class SetAt(argparse.Action):
    def __call__(self, parser, namespace, value, option_string=None):
        namespace.sets.append((Path(value), namespace.entries_rev))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(sets=[], entries_rev=None)
    parser.add_argument("--entries-rev", help="the entries and labels of this commit, for the sets after it")
    parser.add_argument("--set", action=SetAt, help="a labelled dev set (repeatable)")
    parser.add_argument("--oos", action="append", default=[], help="an out-of-scope dev set (repeatable)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "handbook_confidence_sweep.json"))
    args = parser.parse_args()
    if not args.sets:
        parser.error("name at least one --set FILE")
    missing = [str(p) for p, _ in args.sets if not p.is_file()] + [p for p in args.oos if not Path(p).is_file()]
    if missing:
        parser.error(f"no such query set: {', '.join(missing)} (the sets are tests/handbook_*.yaml)")
    if any("frozen" in p.name for p, _ in args.sets) or any("frozen" in p for p in args.oos):
        parser.error("a frozen set is measured once per release with bench/handbook_eval.py --frozen, never swept")
    with tempfile.TemporaryDirectory() as tmp:
        indexes, cases = {}, {}
        for path, rev in args.sets:
            if rev not in indexes:
                if rev is None:
                    indexes[rev] = open_index(cache_path=Path(tmp) / "now.sqlite")
                else:
                    tree = Path(tmp) / rev
                    tree.mkdir()
                    archive = subprocess.run(["git", "archive", rev, "src/mleng/handbook/entries"], cwd=ROOT,
                                             check=True, capture_output=True).stdout
                    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
                    indexes[rev] = open_index(tree / "src/mleng/handbook/entries", Path(tmp) / f"{rev}.sqlite")
            rel = path.resolve().relative_to(ROOT)
            text = path.read_text() if rev is None else _git("show", f"{rev}:{rel}")
            cases[(path.name, rev)] = yaml.safe_load(text)
        oos = [c for p in args.oos for c in yaml.safe_load(Path(p).read_text())]
        now = indexes.get(None) or open_index(cache_path=Path(tmp) / "now.sqlite")
        saved = {k: getattr(S, k) for k in KNOBS}
        results = []
        print(f"{'thresholds':<28} {'set':<34} {'conf|hit':>8} {'hit|conf':>8} {'conf|none':>9}")
        try:
            for knobs in GRID:
                for name, value in zip(KNOBS, knobs):
                    setattr(S, name, value)
                row = {"thresholds": dict(zip(KNOBS, knobs)), "sets": {}}
                for (name, rev), labelled in cases.items():
                    rows = measure_labelled(indexes[rev], labelled)
                    hits = [r for r in rows if r["position"]]
                    sure = [r for r in rows if r["confident"]]
                    none = [r for r in rows if not r["expected"]]
                    got = {"confident_among_hits": round(sum(r["confident"] for r in hits) / (len(hits) or 1), 3),
                           "hit_among_confident": round(sum(bool(r["position"]) for r in sure) / (len(sure) or 1), 3),
                           "confident_no_entry": f"{sum(r['confident'] for r in none)}/{len(none)}"}
                    label = f"{name}@{rev}" if rev else name
                    row["sets"][label] = got
                    print(f"{str(knobs):<28} {label:<34} {got['confident_among_hits']:>8.3f} "
                          f"{got['hit_among_confident']:>8.3f} {got['confident_no_entry']:>9}")
                row["oos_confident"] = f"{sum(S.search(now, c['query'], 3)['confident'] for c in oos)}/{len(oos)}"
                print(f"{str(knobs):<28} {'out of scope':<34} confident {row['oos_confident']}")
                results.append(row)
        finally:
            for name, value in saved.items():
                setattr(S, name, value)
            for index in {id(i): i for i in [*indexes.values(), now]}.values():
                index.close()
    command = "python bench/handbook_confidence_sweep.py " + " ".join(sys.argv[1:])
    Path(args.out).write_text(json.dumps({"command": command, "current": saved, "grid": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
