"""Dev-set threads that an entry cites but whose labels name none of the citing entries. Each is either a source
cited for another cause than the thread's confirmed one (the entry should drop it) or a label that missed an entry
(the dev set should name it). A thread behind several dev-set cases (log-line sets take several lines of one log)
counts the labels of all of them. Prints one line per case and the totals; exit 1 when there is any
(tests/test_handbook_devsets.py runs it).

    python scripts/handbook_citation_labels.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mleng.handbook.model import load_entries, thread_url  # noqa: E402


# Threads an entry cites for a log line it quotes (the line's wording), not for the cause, while the dev set takes
# another line of the same log: thread -> the entries that cite it so.
LOG_LINE_ONLY = {
    # a dmesg sample: Xid 13 lines, then an Xid 109 five seconds later on the same GPU; the dev case is an Xid 13 line
    "https://github.com/leptonai/gpud/pull/46": ("xid-109-ctx-switch-timeout",),
    # the FAILED box of a rank that died after a vLLM engine's TCPStore timeout; the dev case is the TCPStore line
    "https://github.com/lzhxmu/CPPO/issues/6": ("torchrun-child-failed-exitcode",),
}


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    entries, _ = load_entries(ROOT / "src" / "mleng" / "handbook" / "entries")
    citing: dict[str, set[str]] = {}
    for entry in entries:
        for source in entry.sources:
            citing.setdefault(thread_url(source), set()).add(entry.id)
    labels: dict[str, set[str]] = {}
    files: dict[str, str] = {}
    for path in sorted((ROOT / "tests").glob("handbook_devset*.yaml")):
        for case in yaml.safe_load(path.read_text()):
            url = thread_url(case["source"])
            if url not in citing:
                continue
            expected = case.get("expected") or []
            labels.setdefault(url, set()).update([expected] if isinstance(expected, str) else expected)
            files.setdefault(url, path.name)
    cited = disagree = 0
    for url, named in labels.items():
        cited += 1
        ids = citing[url] - set(LOG_LINE_ONLY.get(url, ()))
        if ids and not named & ids:
            disagree += 1
            print(f"{files[url]}: {url} cited by {', '.join(sorted(ids))}; "
                  f"labelled {', '.join(sorted(named)) or '[]'}")
    print(f"{disagree} of {cited} cited dev-set threads are labelled with none of the entries citing them")
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
