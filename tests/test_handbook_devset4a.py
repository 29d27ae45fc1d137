"""Dev set 4a (training-stack queries: HF Trainer/accelerate, DeepSpeed, FSDP, Lightning, torch.compile,
checkpoint loading, attention kernels, NCCL/driver versions): well-formed, labelled with real entries, and
`mleng ask` keeps finding the right entry."""

from __future__ import annotations

from pathlib import Path

import yaml

from mleng.handbook.model import load_entries
from test_handbook_devsets import search_quality

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = ROOT / "src" / "mleng" / "handbook" / "entries"
DEVSET4A = ROOT / "tests" / "handbook_devset4a.yaml"

# Measured on this set once the gaps were filled: hit@1 0.951, hit@3 0.976 (41 queries). The set guided
# the new entries and symptom lines, so these are not unseen-query numbers; the floor catches regressions.
MIN_HIT_AT_3 = 0.92


def _cases() -> list[dict]:
    return yaml.safe_load(DEVSET4A.read_text())


def test_devset4a_is_real_and_labelled():
    cases = _cases()
    ids = {e.id for e in load_entries(ENTRIES)[0]}
    assert len(cases) >= 40
    for case in cases:
        assert case["source"].startswith("https://"), case
        assert case["cause"].strip(), case["source"]
        assert isinstance(case["expected"], list) and case["expected"], f"no entry named for {case['source']}"
        for entry_id in case["expected"]:
            assert entry_id in ids, f"dev set 4a names {entry_id!r}, which is not an entry"
    assert len({c["query"].strip() for c in cases}) == len(cases), "duplicate queries"
    assert len({c["source"] for c in cases}) == len(cases), "two cases from one thread"


def test_devset4a_gap_cases_name_the_entries_written_for_them():
    gaps = [c for c in _cases() if c.get("added_after")]
    assert gaps, "the cases that had no entry when the set was collected are marked added_after"
    for case in gaps:
        text = "".join((ENTRIES / f"{entry_id}.md").read_text() for entry_id in case["expected"])
        assert case["source"] in text, f"{case['expected']} should cite the thread it was written from"


def test_search_quality_on_devset4a(dev_search):
    result, misses = search_quality("dev set 4a", _cases(), dev_search)
    assert result["hit_at_3"] >= MIN_HIT_AT_3, misses
