"""A proxy for how `mleng ask` ranks queries it has never seen, with no query set to overfit: leave one
symptom line out of its entry, search for it, and see where the entry lands.

Symptom lines are what users wrote or pasted in real threads. In fold f every entry with more than one
symptom loses its f-th line (the index is built without it) and that line becomes a query whose answer is
its own entry. Lines that one of the entry's signatures still matches are reported apart ("signature"):
the regex finds them whatever the ranking does; the rest ("words") depend on the text ranking alone.

    python bench/handbook_symptom_holdout.py                 # 3 folds, prints a table, writes JSON
    python bench/handbook_symptom_holdout.py --folds 5 --out /tmp/holdout.json

The numbers rank ranking changes against each other; they are not a quality figure for users (a held-out
symptom is closer to its entry's other lines than a fresh user's words are).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import yaml

from mleng.handbook.index import open_index
from mleng.handbook import default_entries_dir
from mleng.handbook.model import entry_files, split_front_matter
from mleng.handbook.search import rank

ROOT = Path(__file__).resolve().parents[1]


def write_fold(source: Path, target: Path, fold: int) -> list[dict]:
    """Copy the entries to `target` with each entry's `fold`-th symptom removed; the removed lines as cases."""
    cases = []
    for path in entry_files(source):
        text = path.read_text()
        meta, body = split_front_matter(text, str(path))
        symptoms = meta.get("symptoms") or []
        if len(symptoms) > 1 and fold < len(symptoms):
            held = symptoms.pop(fold)
            signature = any(_matches(p, held) for p in meta.get("signatures") or [])
            cases.append({"query": held, "expected": meta["id"], "signature": signature})
            text = "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=10_000) + "---\n" + body
        (target / path.name).write_text(text)
    return cases


def _matches(pattern: str, line: str) -> bool:
    try:
        return re.search(pattern, line) is not None
    except re.error:
        return False


def measure(folds: int, depth: int = 3) -> dict:
    rows = []
    for fold in range(folds):
        with tempfile.TemporaryDirectory() as tmp:
            entries = Path(tmp) / "entries"
            entries.mkdir()
            cases = write_fold(default_entries_dir(), entries, fold)
            index = open_index(entries, Path(tmp) / "index.sqlite")
            try:
                for case in cases:
                    got = [r["id"] for r in rank(index, case["query"], limit=depth)]
                    position = got.index(case["expected"]) + 1 if case["expected"] in got else None
                    rows.append({**case, "fold": fold, "position": position, "got": got})
            finally:
                index.close()
    summary = {}
    for kind, subset in (("all", rows), ("words", [r for r in rows if not r["signature"]]),
                         ("signature", [r for r in rows if r["signature"]])):
        n = len(subset) or 1
        summary[kind] = {"cases": len(subset), "hit_at_1": round(sum(r["position"] == 1 for r in subset) / n, 4),
                         f"hit_at_{depth}": round(sum(r["position"] is not None for r in subset) / n, 4)}
    return {"folds": folds, "summary": summary, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folds", type=int, default=3, help="symptom positions held out, one index each (default 3)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "handbook_symptom_holdout.json")
    args = parser.parse_args()
    if args.folds < 1:
        parser.error("--folds must be at least 1")
    start = time.perf_counter()
    result = measure(args.folds)
    result["elapsed_s"] = round(time.perf_counter() - start, 1)
    print(f"{'held-out symptoms':20s} {'cases':>6s} {'hit@1':>7s} {'hit@3':>7s}")
    for kind, row in result["summary"].items():
        print(f"{kind:20s} {row['cases']:6d} {row['hit_at_1']:7.3f} {row['hit_at_3']:7.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {args.out} ({result['elapsed_s']} s)")


if __name__ == "__main__":
    main()
