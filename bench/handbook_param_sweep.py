"""How the ranking's constants move hit@1 / hit@3 on the frozen sets as they were measured: each retired frozen
set is searched against the entries of the commit that measured it (`git archive`), over the cases its labels
cover with an entry of that snapshot, once with the shipped constants and once per variant.

    python bench/handbook_param_sweep.py                         # the default variants
    python bench/handbook_param_sweep.py BM25_K1=2.0 COLUMN_WEIGHTS.seen=6

A variant is NAME=VALUE (a constant of mleng.handbook.search) or DICT.KEY=VALUE (a key of one of its dicts), several
joined by commas. Prints a table; writes JSON. The sets are dev sets now: a gain here says nothing about unseen
queries, and a change that moves only a few hits either way is noise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import yaml

from mleng.handbook import search as S
from mleng.handbook.index import open_index

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = "src/mleng/handbook/entries"
# (retired frozen set, the commit whose entries it was measured against)
SNAPSHOTS = (("tests/handbook_devset9.yaml", "dd604c8"), ("tests/handbook_devset10.yaml", "e1eb0d1"),
             ("tests/handbook_devset11.yaml", "d369069"))
DEFAULT_VARIANTS = (
    "BM25_K1=0.8", "BM25_K1=2.0", "BM25_B=0.5", "BM25_B=0.9",
    "COLUMN_WEIGHTS.title=10", "COLUMN_WEIGHTS.symptoms=6", "COLUMN_WEIGHTS.symptoms=14", "COLUMN_WEIGHTS.seen=6",
    "COLUMN_WEIGHTS.cause=4", "COLUMN_WEIGHTS.fix=2", "COLUMN_WEIGHTS.body=0.3", "COLUMN_WEIGHTS.body=1.5",
    "PHRASE_WEIGHT=0.5", "PHRASE_WEIGHT=2", "SIGNATURE_WEIGHT=1", "SIGNATURE_WEIGHT=3",
    "OTHER_FRAMEWORK_FACTOR=0.5", "OTHER_FRAMEWORK_FACTOR=0.85", "FRAME_WEIGHT=0.25",
)


def snapshot(rev: str, into: Path) -> Path:
    """The entries directory of commit `rev`, extracted under `into`."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, ENTRIES], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into / ENTRIES


def covered_hits(index, cases: list[dict]) -> dict:
    ids = {e.id for e in index.entries}
    covered = hit1 = hit3 = 0
    for case in cases:
        expected = case["expected"] if isinstance(case["expected"], list) else [case["expected"]]
        accepted = {*expected, *case.get("also", [])} & ids
        if not accepted:
            continue
        covered += 1
        got = [r["id"] for r in S.rank(index, case["query"], limit=3)]
        hit1 += bool(got) and got[0] in accepted
        hit3 += any(g in accepted for g in got)
    return {"covered": covered, "hit_at_1": hit1, "hit_at_3": hit3}


def apply(variant: str) -> list[tuple]:
    """Set the variant's constants; returns what to restore."""
    saved = []
    for part in variant.split(","):
        name, value = part.split("=")
        if "." in name:
            table, key = name.split(".")
            target = getattr(S, table)
            if key not in target:
                raise SystemExit(f"{table} has no key {key!r}")
            saved.append((target, key, target[key]))
            target[key] = float(value)
        else:
            if not hasattr(S, name):
                raise SystemExit(f"mleng.handbook.search has no constant {name!r}")
            saved.append((S, name, getattr(S, name)))
            setattr(S, name, float(value))
    return saved


def restore(saved: list[tuple]) -> None:
    for target, key, value in reversed(saved):
        if isinstance(target, dict):
            target[key] = value
        else:
            setattr(target, key, value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=list(DEFAULT_VARIANTS))
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "handbook_param_sweep.json")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        indexes = []
        for path, rev in SNAPSHOTS:
            entries = snapshot(rev, Path(tmp) / rev)
            indexes.append((Path(path).name, rev, open_index(entries, Path(tmp) / f"{rev}.sqlite"),
                            yaml.safe_load((ROOT / path).read_text())))
        for variant in ["shipped", *args.variants]:
            saved = [] if variant == "shipped" else apply(variant)
            try:
                result = {name: covered_hits(index, cases) for name, _, index, cases in indexes}
            finally:
                restore(saved)
            rows.append({"variant": variant, "sets": result})
            cells = "  ".join(f"{r['hit_at_1']:3d}/{r['hit_at_3']:3d} of {r['covered']:3d}" for r in result.values())
            print(f"{variant:32s} {cells}", flush=True)
        for _, _, index, _ in indexes:
            index.close()
    header = "  ".join(f"{name}@{rev}" for name, rev, _, _ in indexes)
    print(f"columns (covered cases, hit@1/hit@3): {header}")
    args.out.write_text(json.dumps({
        "command": "python bench/handbook_param_sweep.py" + "".join(f" {v}" for v in sys.argv[1:]),
        "snapshots": [{"set": p, "entries_at": r} for p, r in SNAPSHOTS],
        "rows": rows, "elapsed_s": round(time.perf_counter() - started, 1)}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
