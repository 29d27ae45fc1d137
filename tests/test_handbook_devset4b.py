"""Dev set 4b (issue 12): DataLoader workers, AMP/GradScaler, /dev/shm, Kubernetes, CPU-side failures,
launchers, NCCL network set-up and numerics. Real queries from threads with confirmed causes; measured
once unseen (docs/results/handbook_eval_devset4b_first.json: hit@1 0.575, hit@3 0.700), a dev set since."""

from __future__ import annotations

from pathlib import Path

import yaml

from mleng.handbook.model import load_entries
from test_handbook_devsets import search_quality

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = ROOT / "src" / "mleng" / "handbook" / "entries"
DEVSET4B = ROOT / "tests" / "handbook_devset4b.yaml"
OTHER_DEVSETS = ("handbook_devset.yaml", "handbook_devset2.yaml", "handbook_devset3.yaml")


def _cases() -> list[dict]:
    return yaml.safe_load(DEVSET4B.read_text())


def test_devset4b_is_real_labelled_and_new():
    cases = _cases()
    ids = {e.id for e in load_entries(ENTRIES)[0]}
    others = set()
    for name in OTHER_DEVSETS:
        path = ROOT / "tests" / name
        if path.is_file():
            others |= {c["query"].strip() for c in yaml.safe_load(path.read_text())}
    assert len(cases) >= 40
    for case in cases:
        assert case["source"].startswith("https://github.com/"), case
        assert case["cause"].strip(), case
        assert isinstance(case["expected"], list) and case["expected"], f"no label: {case['query'][:80]}"
        for entry_id in case["expected"]:
            assert entry_id in ids, f"devset4b names {entry_id!r}, which is not an entry"
        if not case.get("seen_before"):
            assert case["query"].strip() not in others, f"also in an older dev set: {case['query'][:80]}"
    assert len({c["query"].strip() for c in cases}) == len(cases), "duplicate queries"
    assert len({c["source"] for c in cases}) == len(cases), "duplicate sources"
    # The cases whose cause no entry covered when the set was measured are marked, and name the new entry.
    assert sum(1 for c in cases if c.get("added_after")) == 5
    assert sum(1 for c in cases if c.get("seen_before")) <= 1


def test_search_quality_on_devset4b(dev_search):
    result, misses = search_quality("dev set 4b", _cases(), dev_search)
    # Measured 0.750 / 0.950 after the gap entries were written; a small margin for ranking changes. The base rate
    # (reports.json) costs it one first answer: a worker-RNG query also names num_workers, whose stall entry more
    # users reported, and that entry now comes first of the two.
    assert result["hit_at_3"] >= 0.90, misses
    assert result["hit_at_1"] >= 0.65
