"""scripts/handbook_release.py, the file steps of a handbook release, run as a release runs them on a small set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "handbook_release.py"
URL = "https://github.com/o/r/issues/"


def release(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), *map(str, args)],
                          capture_output=True, text=True)


def label(n: int, expected: list[str], kind: str = "signature") -> dict:
    return {"source": URL + str(n), "expected": expected, "kind": kind, "note": f"labeller note {n}"}


def make_set(tmp_path: Path) -> tuple[Path, Path]:
    root, work = tmp_path / "repo", tmp_path / "work"
    (root / "tests").mkdir(parents=True)
    work.mkdir()
    cases = [{"query": f"query {n}", "source": URL + str(n), "cause": f"cause {n}", "area": "slurm"} for n in (1, 2, 3)]
    (root / "tests" / "handbook_frozen99.yaml").write_text("# frozen\n" + yaml.safe_dump(cases, sort_keys=False))
    a = [label(1, ["x"]), label(2, []), label(3, ["z"])]
    b = [label(1, ["y"], "words"), label(2, []), label(3, [])]
    for quarter in (1, 2, 3, 4):
        (work / f"label_{quarter}_A.yaml").write_text(yaml.safe_dump(a if quarter == 1 else []))
        (work / f"label_{quarter}_B.yaml").write_text(yaml.safe_dump(b if quarter == 1 else []))
    (tmp_path / "hdr.txt").write_text("# labels of set 99\n")
    return root, work


def test_labels_are_pooled_judged_and_retired_into_a_dev_set(tmp_path):
    root, work = make_set(tmp_path)
    merged = release(root, "merge-labels", 99, work)
    assert merged.returncode == 0, merged.stderr
    assert "3 cases; agree covered-or-not 2; exact 1; judge 1" in merged.stdout
    pooled = yaml.safe_load((work / "pooled.yaml").read_text())
    assert pooled[0]["expected"] == ["x", "y"] and pooled[0]["kind"] == "signature/words"
    assert pooled[2]["expected"] is None
    assert [j["source"] for j in yaml.safe_load((work / "judge.yaml").read_text())] == [URL + "3"]

    unjudged = release(root, "finalize-labels", 99, work, tmp_path / "hdr.txt")
    assert unjudged.returncode == 2 and "no verdict for " + URL + "3" in unjudged.stderr
    assert "Traceback" not in unjudged.stderr
    assert not (root / "tests" / "handbook_frozen99_labels.yaml").exists()

    (work / "judged.yaml").write_text(yaml.safe_dump([{"source": URL + "3", "expected": ["z"], "note": "judge"}]))
    final = release(root, "finalize-labels", 99, work, tmp_path / "hdr.txt")
    assert final.returncode == 0 and "2 covered of 3" in final.stdout
    labels_text = (root / "tests" / "handbook_frozen99_labels.yaml").read_text()
    assert labels_text.startswith("# labels of set 99\n")
    assert yaml.safe_load(labels_text)[2] == {"source": URL + "3", "expected": ["z"], "kind": "signature",
                                             "note": "judge"}

    (tmp_path / "dev.txt").write_text("# dev set 77, retired\n")
    retired = release(root, "retire", 99, 77, tmp_path / "dev.txt")
    assert retired.returncode == 0, retired.stderr
    dev = yaml.safe_load((root / "tests" / "handbook_devset77.yaml").read_text())
    assert [c["expected"] for c in dev] == [["x", "y"], [], ["z"]]
    assert dev[1]["query"] == "query 2" and dev[1]["cause"] == "cause 2"

    (work / "pairs.yaml").write_text(yaml.safe_dump([{"source": URL + "2", "add": ["w"], "note_add": "Dev work."}]))
    relabelled = release(root, "relabel", 77, work / "pairs.yaml")
    assert "added 1 ; covered 3 of 3" in relabelled.stdout
    text = (root / "tests" / "handbook_devset77.yaml").read_text()
    assert text.startswith("# dev set 77, retired\n")
    assert yaml.safe_load(text)[1]["note"] == "labeller note 2 Dev work."


def test_a_header_with_a_non_comment_line_is_refused(tmp_path):
    root, work = make_set(tmp_path)
    release(root, "merge-labels", 99, work)
    (tmp_path / "bad.txt").write_text("# fine\nnot a comment\n")
    result = release(root, "retire", 99, 77, tmp_path / "bad.txt")
    assert result.returncode == 2 and "header lines must start with '#'" in result.stderr
    assert not (root / "tests" / "handbook_devset77.yaml").exists()


def test_used_urls_and_round_two_lists(tmp_path):
    root, work = make_set(tmp_path)
    (root / "tests" / "notes.txt").write_text(f"see {URL}7#issuecomment-1, and {URL}8/.\n(https://x.org/a)\n")
    result = release(root, "used-urls", work)
    urls = (work / "used_urls.txt").read_text().split()
    assert result.returncode == 0 and {URL + "1", URL + "7", URL + "8", "https://x.org/a"} <= set(urls)
    (work / "prev_searches.txt").write_text("# set 98\n")
    (work / "collect_1.yaml").write_text("# area: slurm\n#  1. a hang, the problem was\n"
                                         + yaml.safe_dump([{"source": URL + "50#x", "query": "q"}]))
    two = release(root, "round-two", 99, work)
    assert "1 round-one cases" in two.stdout
    assert URL + "50" in (work / "used_urls_r2.txt").read_text().split()
    assert "#  1. a hang, the problem was" in (work / "prev_searches_r2.txt").read_text()


def test_add_symptoms_appends_once(tmp_path):
    entries = tmp_path / "tree" / "src" / "mleng" / "handbook" / "entries"
    entries.mkdir(parents=True)
    (entries / "e1.md").write_text('---\nid: e1\nsymptoms:\n  - "old line"\nsources: []\n---\nbody\n')
    (tmp_path / "p.yaml").write_text(yaml.safe_dump([{"entry": "e1", "line": 'a user\'s "own" line'}]))
    first = release(tmp_path, "add-symptoms", tmp_path / "tree", tmp_path / "p.yaml")
    again = release(tmp_path, "add-symptoms", tmp_path / "tree", tmp_path / "p.yaml")
    assert first.stdout.strip() == "added e1" and again.stdout.strip() == "already e1"
    meta = yaml.safe_load((entries / "e1.md").read_text().split("\n---", 1)[0].lstrip("-\n"))
    assert meta["symptoms"] == ["old line", 'a user\'s "own" line']


def test_compare_counts_moves_per_set(tmp_path):
    def run(positions):
        rows = [{"query": f"q{i}", "source": f"s{i}", "position": p, "expected": ["e"], "got": ["e"]}
                for i, p in enumerate(positions)]
        return {"entries": 10, "oos": {}, "sets": {"a.yaml": {"rows": rows, "all": {"hit_at_1": 0.5, "hit_at_3": 1.0}}}}

    (tmp_path / "a.json").write_text(json.dumps(run([1, 4, None])))
    (tmp_path / "b.json").write_text(json.dumps(run([2, 1, 3])))
    out = release(tmp_path, "compare", tmp_path / "a.json", tmp_path / "b.json").stdout
    assert "a.yaml                         +0 +2" in out and "total +0 +2" in out
