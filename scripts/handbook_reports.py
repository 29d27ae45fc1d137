"""Write src/mleng/handbook/reports.json from the dev sets: for each entry, how many of the real user threads
in tests/handbook_devset*.yaml (each thread once) had its cause as their confirmed cause (a case naming several
entries counts for each). Ranking uses it as a small base rate on matches of words alone: a cause many users hit
is the better guess between two entries that match a vague description about as well. Frozen sets never count.

    python scripts/handbook_reports.py          # rewrite the file
    python scripts/handbook_reports.py --check  # exit 1 when it is stale (tests/test_handbook_devsets.py runs this)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from generated import write_or_check
from mleng.handbook.model import thread_url

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "src" / "mleng" / "handbook" / "reports.json"


def counts() -> dict[str, int]:
    threads: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").glob("handbook_devset*.yaml")):
        for case in yaml.safe_load(path.read_text()):
            expected = case.get("expected") or []
            source = thread_url(case["source"])
            for entry_id in [expected] if isinstance(expected, str) else expected:
                threads.setdefault(entry_id, set()).add(source)
    return {entry_id: len(urls) for entry_id, urls in sorted(threads.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    args = parser.parse_args()
    text = json.dumps(counts(), indent=0, sort_keys=True) + "\n"
    return write_or_check(OUTPUT, text, ROOT, "python scripts/handbook_reports.py", args.check)


if __name__ == "__main__":
    sys.exit(main())
