"""Build mleng's mamf seed list (src/mleng/measure/data/mamf_seeds.toml) from recorded mamf runs.

A seed is a shape that was among the fastest finalists of a full `mleng mamf` run on a device model;
short budgets (the doctor's quick tier) screen the seeds first. Each input is a mamf record as
`mleng mamf --json` or `mleng results show ID --json` prints it. Prints the table and writes TOML:

    python bench/mamf_seeds.py docs/results/mamf_h200_adaptive*.json docs/results/mamf_h200_grid.json --write
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mleng.measure.matmul import FINALIST_DISTANCE, SEEDS_FILE  # noqa: E402

PER_MODEL = 8


def distinct(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return any(abs(x - y) >= min(FINALIST_DISTANCE, max(x, y) // 4) for x, y in zip(a, b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+", help="mamf record JSON files")
    parser.add_argument("--per-model", type=int, default=PER_MODEL, help="seeds kept per device model and dtype")
    parser.add_argument("--write", action="store_true", help=f"write {SEEDS_FILE}")
    args = parser.parse_args()

    rows_by_model: dict[tuple[str, str], list[tuple[float, tuple[int, int, int], str]]] = defaultdict(list)
    sources: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in args.records:
        record = json.loads(Path(path).read_text())
        summary = record.get("summary") or {}
        if record.get("kind") != "mamf" or record.get("status") != "complete":
            print(f"skipped {path}: not a complete mamf record", file=sys.stderr)
            continue
        key = (summary["device_name"], summary["dtype"])
        sources[key].append(Path(path).name)
        for row in record.get("rows", []):
            if row.get("phase") == "final":  # the headline is a final median; bursts rank differently
                rows_by_model[key].append((row["tflops_median"], (row["m"], row["n"], row["k"]), row["phase"]))

    out = ["# Shapes that were fastest on a device model, screened first by `mleng mamf`'s adaptive search",
           "# (see seed_shapes in mleng/measure/matmul/run.py). A seed is only where the search looks first: it is",
           "# measured like any other shape. Written by:",
           "#   python bench/mamf_seeds.py " + " ".join(args.records) + " --write",
           f"# on {datetime.date.today().isoformat()}.", ""]
    print(f"{'device':<24} {'dtype':<10} {'shape':<18} {'phase':<6} {'TFLOPS':>8}")
    for (name, dtype), rows in sorted(rows_by_model.items()):
        chosen: list[tuple[float, tuple[int, int, int], str]] = []
        for row in sorted(rows, reverse=True):
            if len(chosen) >= args.per_model:
                break
            if all(distinct(row[1], other[1]) for other in chosen):
                chosen.append(row)
        for tflops, shape, phase in chosen:
            print(f"{name:<24} {dtype:<10} {'x'.join(map(str, shape)):<18} {phase:<6} {tflops:>8.1f}")
        out += ["[[seed]]", f'device_name = "{name}"', f'dtype = "{dtype}"',
                "shapes = [" + ", ".join(f'"{"x".join(map(str, s))}"' for _, s, _ in chosen) + "]",
                "from = [" + ", ".join(f'"{s}"' for s in sources[(name, dtype)]) + "]", ""]
    if args.write:
        Path(SEEDS_FILE).write_text("\n".join(out))
        print(f"wrote {SEEDS_FILE}")
    else:
        print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
