"""Search quality of `mleng ask` on the dev sets (real queries that guided ranking and entry work)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mleng.handbook.model import load_entries
from mleng.handbook.search import evaluate, query_weights

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = ROOT / "src" / "mleng" / "handbook" / "entries"
DEVSET2 = ROOT / "tests" / "handbook_devset2.yaml"
DEVSET = ROOT / "tests" / "handbook_devset.yaml"


def _expected(case: dict) -> list[str]:
    return case["expected"] if isinstance(case["expected"], list) else [case["expected"]]


def test_devset2_is_real_new_and_labelled():
    cases = yaml.safe_load(DEVSET2.read_text())
    dev_queries = {c["query"].strip() for c in yaml.safe_load(DEVSET.read_text())}
    ids = {e.id for e in load_entries(ENTRIES)[0]}
    assert len(cases) >= 60
    for case in cases:
        assert case["source"].startswith("https://"), case
        assert case["query"].strip() not in dev_queries, f"also in the dev set: {case['query'][:80]}"
        for entry_id in _expected(case):
            assert entry_id in ids, f"dev set 2 names {entry_id!r}, which is not an entry"
    assert len({c["query"] for c in cases}) == len(cases), "duplicate queries"


@pytest.fixture(scope="module")
def entry_ids():
    return {e.id for e in load_entries(ENTRIES)[0]}


def search_quality(name: str, cases: list[dict], dev_search) -> tuple[dict, str]:
    """hit@1/hit@3 of `mleng ask` on a dev set, printed, and its top-3 misses as one text (the session's answers,
    which the site's and the MCP server's parity tests compare with too)."""
    result = evaluate(cases, None, depth=3, answers=dev_search)
    print(f"\n{name}: {result['cases']} queries, hit@1 {result['hit_at_1']:.3f}, hit@3 {result['hit_at_3']:.3f}")
    misses = [f"{'/'.join(_expected(c))} <- {r['query'][:80]!r} (got {r['got']})"
              for c, r in zip(cases, result["rows"]) if not r["position"]]
    return result, "\n".join(misses)


def test_search_quality_on_devset2(dev_search):
    result, misses = search_quality("dev set 2", yaml.safe_load(DEVSET2.read_text()), dev_search)
    assert result["hit_at_3"] >= 0.9, misses


def test_traceback_frames_count_less_than_the_error_line():
    paste = (
        '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1790, in inner\n'
        "    result = forward_call(*args, **kwargs)\n"
        "             ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        "RuntimeError: CUDA error: unspecified launch failure\n"
    )
    weights = query_weights(paste)
    assert weights["inner"] < 1.0 and weights["forward"] < 1.0     # frame line and its source line
    assert weights["unspecified"] == 1.0 and weights["launch"] == 1.0
    assert set(query_weights("RuntimeError: CUDA error: unspecified launch failure").values()) == {1.0}


def test_plain_language_synonyms_meet_the_entry_words():
    from mleng.handbook import terms as T

    assert "hang" in T.terms("training is stuck at step 200")
    assert "hang" in T.terms("the job freezes")
    assert "slow" in T.terms("two nodes are slower than one") and "slow" in T.terms("low-speed node")
    assert "memory" in T.terms("OOM on rank 3") and "oom" in T.terms("CUDA out of memory")
    assert "utilization" in T.terms("GPU utilisation is low") and "utilization" in T.terms("GPU-Util 100%")
    assert "initialize" in T.terms("failed to initialise NCCL")
    assert "sync" in T.terms("a hidden synchronization every step")
    assert "precise" in T.terms("precise")   # not every word ending in -ise is British spelling


def test_chinese_words_become_the_english_words_of_the_entries():
    from mleng.handbook import terms as T

    assert T.terms("多卡训练卡住") == ["multi", "gpu", "training", "stuck", "hang"]
    assert T.terms("显存不足") == ["cuda", "oom", "memory"]  # the longer word before 显存 alone
    # what the glossary does not know is dropped, and no longer glues itself to the English around it
    assert T.terms("有些token会输出nan") == ["token", "nan"]


RETIRED = {  # frozen held-out sets retired to dev sets: (file, queries, covered hit@3 floor)
    "devset5": (ROOT / "tests" / "handbook_devset5.yaml", 137, 0.78),
    "devset6": (ROOT / "tests" / "handbook_devset6.yaml", 131, 0.60),
    "devset7": (ROOT / "tests" / "handbook_devset7.yaml", 130, 0.60),
    "devset8": (ROOT / "tests" / "handbook_devset8.yaml", 130, 0.55),
    "devset9": (ROOT / "tests" / "handbook_devset9.yaml", 131, 0.70),
    "devset10": (ROOT / "tests" / "handbook_devset10.yaml", 131, 0.65),
    "devset11": (ROOT / "tests" / "handbook_devset11.yaml", 139, 0.65),
    "devset12": (ROOT / "tests" / "handbook_devset12.yaml", 25, 0.70),
    "devset13": (ROOT / "tests" / "handbook_devset13.yaml", 123, 0.65),
    "devset14": (ROOT / "tests" / "handbook_devset14.yaml", 80, 0.50),
    "devset15": (ROOT / "tests" / "handbook_devset15.yaml", 239, 0.60),
    "devset16": (ROOT / "tests" / "handbook_devset16.yaml", 123, 0.60),
    "devset17": (ROOT / "tests" / "handbook_devset17.yaml", 177, 0.60),
    "devset18": (ROOT / "tests" / "handbook_devset18.yaml", 59, 0.60),
    "devset19": (ROOT / "tests" / "handbook_devset19.yaml", 67, 0.60),
    "devset20": (ROOT / "tests" / "handbook_devset20.yaml", 46, 0.60),
    "devset21": (ROOT / "tests" / "handbook_devset21.yaml", 60, 0.60),
    "devset22": (ROOT / "tests" / "handbook_devset22.yaml", 65, 0.60),
    "devset23": (ROOT / "tests" / "handbook_devset23.yaml", 129, 0.60),
    "devset24": (ROOT / "tests" / "handbook_devset24.yaml", 167, 0.60),
    "devset25": (ROOT / "tests" / "handbook_devset25.yaml", 212, 0.60),
    "devset26": (ROOT / "tests" / "handbook_devset26.yaml", 201, 0.60),
    "devset27": (ROOT / "tests" / "handbook_devset27.yaml", 204, 0.60),
    "devset28": (ROOT / "tests" / "handbook_devset28.yaml", 162, 0.60),
    "devset29": (ROOT / "tests" / "handbook_devset29.yaml", 173, 0.60),
    "devset30": (ROOT / "tests" / "handbook_devset30.yaml", 130, 0.60),
    "devset31": (ROOT / "tests" / "handbook_devset31.yaml", 194, 0.60),
    "devset32": (ROOT / "tests" / "handbook_devset32.yaml", 169, 0.60),
    "devset33": (ROOT / "tests" / "handbook_devset33.yaml", 202, 0.60),
    "devset34": (ROOT / "tests" / "handbook_devset34.yaml", 219, 0.60),
    "devset35": (ROOT / "tests" / "handbook_devset35.yaml", 197, 0.60),
    "devset36": (ROOT / "tests" / "handbook_devset36.yaml", 240, 0.60),
    "devset37": (ROOT / "tests" / "handbook_devset37.yaml", 169, 0.45),
}


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_retired_frozen_set_labels_name_entries(name, entry_ids):
    """A retired frozen set keeps all its queries; every label is an entry; [] marks a cause no entry covers."""
    path, size, _ = RETIRED[name]
    cases = yaml.safe_load(path.read_text())
    assert len(cases) == size and len({c["source"] for c in cases}) == size
    for case in cases:
        assert case["source"].startswith("https://") and case["cause"].strip(), case
        assert isinstance(case["expected"], list), case
        for entry_id in case["expected"]:
            assert entry_id in entry_ids, f"{name} names {entry_id!r}, which is not an entry"


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_search_quality_on_retired_frozen_set_covered(name, dev_search):
    path, _, floor = RETIRED[name]
    covered = [c for c in yaml.safe_load(path.read_text()) if c["expected"]]
    result, misses = search_quality(f"{name} (covered cases)", covered, dev_search)
    assert result["hit_at_3"] >= floor, misses


def test_frozen_sets_are_unchanged():
    """A frozen evaluation set is never edited after it is committed with its sha256."""
    import hashlib

    lines = (ROOT / "tests" / "handbook_frozen.sha256").read_text().split("\n")
    recorded = dict(reversed(line.split(None, 1)) for line in lines if line.strip())
    assert "tests/handbook_oos_frozen.yaml" in recorded
    for name, digest in recorded.items():
        assert hashlib.sha256((ROOT / name).read_bytes()).hexdigest() == digest, f"{name} changed since frozen"


def test_report_counts_are_current():
    """src/mleng/handbook/reports.json counts the dev sets' threads per entry; a new or relabelled dev set
    must be followed by `python scripts/handbook_reports.py`."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "handbook_reports.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_cited_dev_set_thread_is_labelled_with_an_entry_that_cites_it():
    """A thread an entry cites as a source must name that entry in its dev-set labels, or the entry cites it for
    another cause (scripts/handbook_citation_labels.py says which; its exit is 1 when any case is left)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "handbook_citation_labels.py")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert result.stdout.startswith("0 of ")
