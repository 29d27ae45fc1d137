"""Search quality of `mleng ask` on a labelled query set (a dev set; the frozen sets are measured by bench/handbook_eval.py --frozen): hit@1, hit@3, every miss; JSON out."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

from mleng.handbook.index import open_index
from mleng.handbook.search import evaluate

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--set", "--devset", dest="devset", metavar="PATH", default=str(ROOT / "tests" / "handbook_devset.yaml"),
                        help="YAML list of {query, expected, also?, source}; expected may be a list of ids")
    parser.add_argument("--out", default=None,
                        help="where to write the JSON result (default docs/results/handbook_search[_<set>].json)")
    args = parser.parse_args()
    if args.out is None:
        stem = Path(args.devset).stem.replace("handbook_", "")
        name = "handbook_search.json" if stem == "devset" else f"handbook_search_{stem}.json"
        args.out = str(ROOT / "docs" / "results" / name)
    cases = yaml.safe_load(Path(args.devset).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        index = open_index(cache_path=Path(tmp) / "index.sqlite")
        started = time.perf_counter()
        result = evaluate(cases, index, depth=3)
        elapsed = time.perf_counter() - started
        entries = len(index.entries)
        index.close()
    print(f"query set {args.devset}: {result['cases']} queries against {entries} entries "
          f"({elapsed * 1000 / max(1, result['cases']):.1f} ms per query)")
    print(f"hit@1 {result['hit_at_1']:.3f}   hit@3 {result['hit_at_3']:.3f}")
    misses = [r for r in result["rows"] if r["position"] != 1]
    if misses:
        print("\nnot first:")
        print(f"{'pos':>4}  {'expected':<40} got (top 3) / query")
        for r in misses:
            pos = "-" if r["position"] is None else str(r["position"])
            expected = "/".join(r["expected"]) if isinstance(r["expected"], list) else r["expected"]
            print(f"{pos:>4}  {expected:<40} {', '.join(r['got'])}")
            print(f"      {r['query'][:150]}")
    result["entries"] = entries
    result["elapsed_s"] = round(elapsed, 4)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
