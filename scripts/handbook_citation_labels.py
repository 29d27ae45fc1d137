"""Dev-set threads that an entry cites but whose labels name none of the citing entries. Each is either a source
cited for another cause than the thread's confirmed one (the entry should drop it) or a label that missed an entry
(the dev set should name it). Prints one line per case and the totals; exit 1 when there is any.

    python scripts/handbook_citation_labels.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mleng.handbook.model import load_entries  # noqa: E402


def _url(url: str) -> str:
    return url.split("#")[0].rstrip("/").lower()


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    entries, _ = load_entries(ROOT / "src" / "mleng" / "handbook" / "entries")
    citing: dict[str, set[str]] = {}
    for entry in entries:
        for source in entry.sources:
            citing.setdefault(_url(source), set()).add(entry.id)
    cited = disagree = 0
    for path in sorted((ROOT / "tests").glob("handbook_devset*.yaml")):
        for case in yaml.safe_load(path.read_text()):
            ids = citing.get(_url(case["source"]))
            if not ids:
                continue
            cited += 1
            expected = case.get("expected") or []
            labels = {expected} if isinstance(expected, str) else set(expected)
            if not labels & ids:
                disagree += 1
                print(f"{path.name}: {case['source']} cited by {', '.join(sorted(ids))}; "
                      f"labelled {', '.join(sorted(labels)) or '[]'}")
    print(f"{disagree} of {cited} cited dev-set threads are labelled with none of the entries citing them")
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
