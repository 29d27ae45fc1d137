"""How the ranking's constants move hit@1 / hit@3 on the frozen sets as they were measured: each retired frozen
set is searched against the entries of the commit that measured it (`git archive`), over the cases its labels
cover with an entry of that snapshot, once with the shipped constants and once per variant.

    python bench/handbook_param_sweep.py                         # the default variants
    python bench/handbook_param_sweep.py BM25_K1=2.0 COLUMN_WEIGHTS.seen=6

A variant is NAME=VALUE (a constant of mleng.handbook.search) or DICT.KEY=VALUE (a key of one of its dicts), several
joined by commas. Prints a table; writes JSON. The sets are dev sets now: a gain here says nothing about unseen
queries, and a change that moves only a few hits either way is noise. The base rate's reports (reports.json) come from
today's dev sets, these among them, so REPORT_WEIGHT variants are in-sample here; its out-of-sample record is each
frozen set's own measurement (`--report-weight` of bench/handbook_eval.py, README).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from io import BytesIO
from pathlib import Path

import yaml

from mleng.handbook import search as S
from mleng.handbook.index import open_index

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = "src/mleng/handbook/entries"
# (retired frozen set, the commit whose entries it was measured against)
SNAPSHOTS = (("tests/handbook_devset9.yaml", "dd604c8"), ("tests/handbook_devset10.yaml", "e1eb0d1"),
             ("tests/handbook_devset11.yaml", "d369069"), ("tests/handbook_devset13.yaml", "b92a9d6"),
             ("tests/handbook_devset14.yaml", "273f18b"), ("tests/handbook_devset15.yaml", "c188077"),
             ("tests/handbook_devset16.yaml", "1bc8b8d"), ("tests/handbook_devset17.yaml", "5708178"),
             ("tests/handbook_devset18.yaml", "5f92422"),
             ("tests/handbook_devset19.yaml", "5eae54e"), ("tests/handbook_devset20.yaml", "2696c64"),
             ("tests/handbook_devset21.yaml", "73adeeb"), ("tests/handbook_devset22.yaml", "9765544"),
             ("tests/handbook_devset23.yaml", "61249b3"), ("tests/handbook_devset24.yaml", "41c8bc3"),
             ("tests/handbook_devset25.yaml", "695e29d"), ("tests/handbook_devset26.yaml", "00ce490"),
             ("tests/handbook_devset27.yaml", "ded8999"), ("tests/handbook_devset28.yaml", "d579b6a"),
             ("tests/handbook_devset29.yaml", "1f6bfa0"), ("tests/handbook_devset30.yaml", "9cae166"),
             ("tests/handbook_devset31.yaml", "3b968f3"), ("tests/handbook_devset32.yaml", "5c3e92d"),
             ("tests/handbook_devset33.yaml", "2814c57"), ("tests/handbook_devset34.yaml", "3ba59f3"),
             ("tests/handbook_devset35.yaml", "bea1365"),
             ("tests/handbook_devset36.yaml", "9db2c6a"),
             ("tests/handbook_devset37.yaml", "dff94d5"))
DEFAULT_VARIANTS = (
    "BM25_K1=0.8", "BM25_K1=2.0", "BM25_B=0.5", "BM25_B=0.9",
    "COLUMN_WEIGHTS.title=10", "COLUMN_WEIGHTS.symptoms=6", "COLUMN_WEIGHTS.symptoms=14", "COLUMN_WEIGHTS.seen=6",
    "COLUMN_WEIGHTS.cause=4", "COLUMN_WEIGHTS.fix=2", "COLUMN_WEIGHTS.body=0.3", "COLUMN_WEIGHTS.body=1.5",
    "PHRASE_WEIGHT=0.5", "PHRASE_WEIGHT=2", "SIGNATURE_WEIGHT=1", "SIGNATURE_WEIGHT=3",
    "OTHER_FRAMEWORK_FACTOR=0.5", "OTHER_FRAMEWORK_FACTOR=0.85", "FRAME_WEIGHT=0.25",
    "REPORT_WEIGHT=0", "REPORT_WEIGHT=0.4",
)


def snapshot(rev: str, into: Path) -> Path:
    """The entries directory of commit `rev`, extracted under `into`."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, ENTRIES], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into / ENTRIES


@contextmanager
def open_snapshots():
    """(set file name, commit, index of that commit's entries, the set's cases) for each of SNAPSHOTS; the
    indexes are closed and their files removed on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        opened = []
        try:
            for path, rev in SNAPSHOTS:
                entries = snapshot(rev, Path(tmp) / rev)
                opened.append((Path(path).name, rev, open_index(entries, Path(tmp) / f"{rev}.sqlite"),
                               yaml.safe_load((ROOT / path).read_text())))
            yield opened
        finally:
            for _, _, index, _ in opened:
                index.close()


def write_result(out: Path, script: str, rows: list[dict], started: float) -> None:
    """The JSON of a run over the snapshots, with the command that reproduces it."""
    out.write_text(json.dumps({
        "command": f"python bench/{script}" + "".join(f" {v}" for v in sys.argv[1:]),
        "snapshots": [{"set": p, "entries_at": r} for p, r in SNAPSHOTS],
        "rows": rows, "elapsed_s": round(time.perf_counter() - started, 1)}, indent=2) + "\n")
    print(f"wrote {out}")


def covered_hits(index, cases: list[dict]) -> dict:
    """search.evaluate() over the cases whose labels name an entry of this snapshot, as counts."""
    ids = {e.id for e in index.entries}
    covered = []
    for case in cases:
        accepted = sorted(S.accepted_ids(case) & ids)
        if accepted:
            covered.append({"query": case["query"], "expected": accepted})
    rows = S.evaluate(covered, index)["rows"]
    return {"covered": len(rows), "hit_at_1": sum(r["position"] == 1 for r in rows),
            "hit_at_3": sum(r["position"] is not None for r in rows)}


def parse(variant: str) -> list[tuple]:
    """(target, key, value) for each NAME=VALUE or DICT.KEY=VALUE of a variant; a wrong one is a usage error."""
    settings = []
    for part in variant.split(","):
        name, sep, value = part.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or number is None:
            raise ValueError(f"{part!r} is not NAME=NUMBER or DICT.KEY=NUMBER")
        table, dot, key = name.partition(".")
        if dot:
            target = getattr(S, table, None)
            if not isinstance(target, dict) or key not in target:
                raise ValueError(f"mleng.handbook.search has no dict {table!r} with key {key!r}")
            settings.append((target, key, number))
        elif isinstance(getattr(S, name, None), (int, float)):
            settings.append((S, name, number))
        else:
            raise ValueError(f"mleng.handbook.search has no numeric constant {name!r}")
    return settings


def current(settings: list[tuple]) -> list[tuple]:
    """The values the parsed settings would replace, in the same form."""
    return [(t, k, t[k] if isinstance(t, dict) else getattr(t, k)) for t, k, _ in settings]


def assign(settings: list[tuple]) -> None:
    for target, key, value in settings:
        if isinstance(target, dict):
            target[key] = value
        else:
            setattr(target, key, value)


def parse_variants(parser: argparse.ArgumentParser, variants: list[str], example: str) -> list[tuple[str, list]]:
    """(variant, parsed settings) for each; a wrong one is the parser's usage error."""
    try:
        return [(v, parse(v)) for v in variants]
    except ValueError as error:
        parser.error(f"{error} (e.g. {example})")


def under_variants(variants: list[tuple[str, list]], measure):
    """(variant, measure()) with the shipped constants first, then with each variant's settings in place;
    the shipped values are restored after each."""
    for variant, settings in [("shipped", []), *variants]:
        saved = current(settings)
        assign(settings)
        try:
            result = measure()
        finally:
            assign(saved[::-1])
        yield variant, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=list(DEFAULT_VARIANTS))
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "handbook_param_sweep.json")
    args = parser.parse_args()
    variants = parse_variants(parser, args.variants, "BM25_K1=2.0 or COLUMN_WEIGHTS.seen=6")
    started = time.perf_counter()
    rows = []
    with open_snapshots() as indexes:
        for variant, result in under_variants(
                variants, lambda: {name: covered_hits(index, cases) for name, _, index, cases in indexes}):
            rows.append({"variant": variant, "sets": result})
            cells = "  ".join(f"{r['hit_at_1']:3d}/{r['hit_at_3']:3d} of {r['covered']:3d}" for r in result.values())
            print(f"{variant:32s} {cells}", flush=True)
    header = "  ".join(f"{name}@{rev}" for name, rev, _, _ in indexes)
    print(f"columns (covered cases, hit@1/hit@3): {header}")
    write_result(args.out, "handbook_param_sweep.py", rows, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
