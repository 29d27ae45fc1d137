"""The handbook engine: parser, linter, FTS5 index and cache, ask ranking, triage, site and skill."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from mleng.handbook import terms as T
from mleng.handbook.index import open_index
from mleng.handbook.lint import lint
from mleng.handbook.model import load_entries
from mleng.handbook.search import RESULT_FIELDS, evaluate, rank
from mleng.handbook import triage as triage_module
from mleng.handbook.triage import Matcher, attribute, triage_stream

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = ROOT / "src" / "mleng" / "handbook" / "entries"

BODY = """
## What you see
The job stops with the error above.

## Why
Something specific went wrong.

## Confirm
Run `true` and look.

## Fix
Change the thing.
"""


def write_entry(directory: Path, entry_id: str, body: str = BODY, **fields) -> Path:
    meta = {
        "id": entry_id,
        "title": f"Title of {entry_id}",
        "category": "launch",
        "symptoms": [f"RuntimeError: the {entry_id} failure happened after 600000 ms"],
        "signatures": [f"the {entry_id} failure happened"],
        "applies_to": {"software": "PyTorch >= 2.0", "hardware": "any"},
        "cause": f"The {entry_id} cause.",
        "confirm": ["echo confirm"],
        "fix": ["echo fix"],
        "sources": ["https://example.org/issue/1"],
    }
    meta.update(fields)
    meta = {k: v for k, v in meta.items() if v is not None}
    path = directory / f"{entry_id}.md"
    path.write_text("---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n" + body)
    return path


@pytest.fixture
def book(tmp_path, monkeypatch):
    """An entries directory of our own, selected through MLENG_HANDBOOK_DIR."""
    directory = tmp_path / "entries"
    directory.mkdir()
    monkeypatch.setenv("MLENG_HANDBOOK_DIR", str(directory))
    return directory


# --- parser and linter -------------------------------------------------------------------------

def test_shipped_entries_pass_lint(run_mleng):
    result = run_mleng("handbook", "lint", "--json")
    report = json.loads(result.stdout)
    assert report["entries"] >= 120, report["entries"]
    assert report["problems"] == [], "\n".join(f"{p['file']}: {p['field']}: {p['message']}"
                                               for p in report["problems"])
    assert result.returncode == 0


def test_lint_reports_every_rule(book, tmp_path):
    write_entry(book, "good-entry")
    write_entry(book, "Bad_Id")
    write_entry(book, "other-name", id="not-the-file-name")
    write_entry(book, "dup-a", id="dup-a")
    (book / "dup-b.md").write_text((book / "dup-a.md").read_text())
    write_entry(book, "long-title", title="x" * 101)
    write_entry(book, "bad-category", category="gpu")
    write_entry(book, "bad-regex", signatures=["unclosed (group"])
    write_entry(book, "bad-lookbehind", signatures=["(?<=NCCL +)WARN"])  # parses; only compiling rejects it
    write_entry(book, "regex-no-symptom", signatures=["nothing like this appears"])
    write_entry(book, "broad-regex", signatures=[".*"], symptoms=["error"])
    write_entry(book, "bare-word", signatures=["[Ee]rror"], symptoms=["Error"])
    # one of the shipped entries had this until a triage bench showed it read 70 MB/s instead of about 440
    unanchored = r"(?:^|[:：] ?)--[\w-]+(?:: (?:command not found|not found)|[:：] ?未找到命令)\s*$"
    write_entry(book, "unanchored", signatures=[unanchored], symptoms=["run.sh: --flag: not found"])
    write_entry(book, "no-hardware", applies_to={"software": "any"})
    write_entry(book, "bad-source", sources=["github.com/x/y"])
    write_entry(book, "bad-related", related=["no-such-entry"])
    write_entry(book, "extra-key", severity="high")
    write_entry(book, "missing-key", fix=None)
    write_entry(book, "long-cause", cause="One. Two. Three. Four.")
    write_entry(book, "repro-missing", reproduction="tests/test_handbook_repro.py::test_does_not_exist")
    write_entry(book, "repro-no-file", reproduction="tests/no_such_file.py::test_x")
    write_entry(book, "no-fix-section", body=BODY.replace("## Fix\nChange the thing.\n", ""))
    write_entry(book, "out-of-order", body="\n## Why\nw\n\n## What you see\ns\n\n## Confirm\nc\n\n## Fix\nf\n")
    write_entry(book, "stray-lead", body='  - claim: "pasted after the closing line"\n' + BODY)
    (book / "broken-yaml.md").write_text("---\nid: broken-yaml\ntitle: [unclosed\n---\n" + BODY)
    (book / "no-front-matter.md").write_text(BODY)

    count, problems = lint(book)
    assert count == 26
    by_file: dict[str, list] = {}
    for p in problems:
        by_file.setdefault(Path(p.file).stem, []).append((p.field, p.message))

    def has(stem: str, field: str, words: str) -> bool:
        return any(f == field and words in m for f, m in by_file.get(stem, []))

    assert "good-entry" not in by_file
    assert has("Bad_Id", "id", "kebab-case")
    assert has("other-name", "id", "differs from the file name")
    assert has("dup-b", "id", "already used by")
    assert has("long-title", "title", "at most 100")
    assert has("bad-category", "category", "use one of")
    assert has("bad-regex", "signatures", "does not compile")
    assert has("bad-lookbehind", "signatures", "look-behind requires fixed-width")
    assert has("regex-no-symptom", "signatures", "matches none of the entry's symptoms")
    assert has("broad-regex", "signatures", "too broad")
    assert has("bare-word", "signatures", "too broad")
    assert has("unanchored", "signatures", "no fixed text that every match contains")
    assert has("stray-lead", "body", "text before the first section")
    assert has("no-hardware", "applies_to.hardware", "non-empty string")
    assert has("bad-source", "sources", "not an http(s) URL")
    assert has("bad-related", "related", "not the id of any entry")
    assert has("extra-key", "severity", "unknown key")
    assert has("missing-key", "fix", "required key is missing")
    assert has("long-cause", "cause", "1-3")
    assert has("repro-missing", "reproduction", "has no function test_does_not_exist")
    assert has("repro-no-file", "reproduction", "does not exist")
    assert has("no-fix-section", "body", "'## Fix' is missing")
    assert has("out-of-order", "body", "out of order")
    assert has("broken-yaml", "front matter", "YAML does not parse")
    assert has("no-front-matter", "front matter", "must start with a line '---'")


def test_lint_parses_mleng_commands_and_source_urls(book):
    """An entry may not claim a mleng command, flag or capability that does not exist."""
    write_entry(book, "bad-flag", confirm=["mleng io --path /lustre/data   # bandwidth of the file system"])
    write_entry(book, "bad-command", fix=["mleng stragglers --all"])
    write_entry(book, "bad-claim", confirm=["mleng doctor   # runs the DCGM diagnostics"])
    write_entry(book, "bad-url", sources=["https://github.com/pytorch/pytorch/pull/1748.patch"])
    write_entry(book, "good-entry", confirm=["mleng io /lustre/data   # bandwidth of the file system",
                                             "srun --ntasks-per-node=1 mleng doctor --json",
                                             "mleng hang dump --pid <torchrun PID>"],
                fix=["Use `mleng mamf` for matmuls; the doctor does not run DCGM (dcgmi diag -r 3)."],
                sources=["https://github.com/pytorch/pytorch/issues/18879"])
    _, problems = lint(book)
    by_file = {Path(p.file).stem: str(p) for p in problems}
    assert set(by_file) == {"bad-flag", "bad-command", "bad-claim", "bad-url"}, by_file
    assert "unrecognized arguments: --path" in by_file["bad-flag"]
    assert "'stragglers' is not a mleng command" in by_file["bad-command"]
    assert "does not run DCGM" in by_file["bad-claim"]
    assert "not a GitHub thread" in by_file["bad-url"]


def test_lint_allows_an_entry_without_signatures(book):
    """A failure no program prints a line for (a silent slowdown) has `signatures: []`, not a quoted sentence."""
    write_entry(book, "no-signature", signatures=[])
    write_entry(book, "not-a-list", signatures="the no-signature failure happened")
    _, problems = lint(book)
    assert [Path(p.file).stem for p in problems] == ["not-a-list"], problems
    entries, _ = load_entries(book)
    assert [e.signatures for e in entries if e.id == "no-signature"] == [[]]


def test_lint_cli_exit_codes_and_lines(book, run_mleng):
    write_entry(book, "good-entry")
    ok = run_mleng("handbook", "lint", env={"MLENG_HANDBOOK_DIR": str(book)})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    write_entry(book, "bad-category", category="gpu")
    bad = run_mleng("handbook", "lint", env={"MLENG_HANDBOOK_DIR": str(book)})
    assert bad.returncode == 1
    line = next(l for l in bad.stdout.splitlines() if "bad-category" in l)
    assert re.match(r".*bad-category\.md: category: 'gpu' is not a category; use one of: nccl-hang", line), line
    report = json.loads(run_mleng("handbook", "lint", "--json", env={"MLENG_HANDBOOK_DIR": str(book)}).stdout)
    assert report["ok"] is False and report["problems"][0]["field"] == "category"


def test_reproduction_field_points_at_real_tests():
    entries, _ = load_entries(ENTRIES)
    with_repro = [e for e in entries if e.reproduction]
    assert len(with_repro) >= 12
    source = (ROOT / "tests" / "test_handbook_repro.py").read_text()
    for e in with_repro:
        file, function = e.reproduction.split("::")
        assert (ROOT / file).is_file(), e.id
        if file == "tests/test_handbook_repro.py":
            assert f"def {function}(" in source, e.id


# --- index and cache ---------------------------------------------------------------------------

def test_index_cache_is_reused_rebuilt_when_stale_and_when_corrupt(book, tmp_path):
    write_entry(book, "first-entry")
    cache = tmp_path / "cache" / "index.sqlite"
    index = open_index(book, cache)
    assert index.rebuilt and [e.data["id"] for e in index.entries] == ["first-entry"]
    index.close()
    index = open_index(book, cache)
    assert not index.rebuilt
    index.close()
    # A new entry makes the cache stale.
    write_entry(book, "second-entry")
    index = open_index(book, cache)
    assert index.rebuilt and len(index.entries) == 2
    index.close()
    # Same name, new content (size changes): rebuilt and the new title is served.
    write_entry(book, "second-entry", title="A changed title for the second entry")
    index = open_index(book, cache)
    assert index.rebuilt
    assert {e.data["title"] for e in index.entries} >= {"A changed title for the second entry"}
    index.close()
    # A corrupt cache is ours to replace.
    cache.write_bytes(b"this is not an sqlite database" * 100)
    index = open_index(book, cache)
    assert index.rebuilt and len(index.entries) == 2
    index.close()
    assert open_index(book, cache).rebuilt is False


def test_default_cache_lives_in_mleng_home(book, mleng_home, run_mleng):
    write_entry(book, "first-entry")
    result = run_mleng("ask", "first-entry failure happened", env={"MLENG_HANDBOOK_DIR": str(book)})
    assert result.returncode in (0, 1), result.stderr
    assert (mleng_home / "handbook-index.sqlite").is_file()


def test_unwritable_cache_location_still_answers(book, tmp_path, run_mleng):
    write_entry(book, "first-entry")
    not_a_dir = tmp_path / "home-is-a-file"
    not_a_dir.write_text("x")
    result = run_mleng("ask", "the first-entry failure happened on rank 3", "--json",
                       env={"MLENG_HANDBOOK_DIR": str(book), "MLENG_HOME": str(not_a_dir)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["results"][0]["id"] == "first-entry"


def test_missing_entries_directory_is_a_usage_error(tmp_path, run_mleng):
    env = {"MLENG_HANDBOOK_DIR": str(tmp_path / "nowhere")}
    for args in (("ask", "x"), ("triage", "-"), ("handbook", "lint"), ("handbook", "list")):
        result = run_mleng(*args, env=env, input="")
        assert result.returncode == 2, (args, result.stderr)
        assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_malformed_entry_is_skipped_with_a_warning(book, run_mleng, tmp_path):
    write_entry(book, "good-entry")
    (book / "broken.md").write_text("---\nid: broken\ntitle: [unclosed\n---\n")
    write_entry(book, "bad-regex-entry", signatures=["(unclosed"])
    env = {"MLENG_HANDBOOK_DIR": str(book)}
    ask = run_mleng("ask", "RuntimeError: the good-entry failure happened on rank 3", "--json", env=env)
    assert ask.returncode == 0, ask.stderr
    assert json.loads(ask.stdout)["results"][0]["id"] == "good-entry"
    assert "broken.md" in ask.stderr and "bad-regex-entry.md" in ask.stderr and "Traceback" not in ask.stderr
    log = tmp_path / "x.log"
    log.write_text("RuntimeError: the good-entry failure happened after 5 ms\n")
    triage = run_mleng("triage", str(log), env=env)
    assert triage.returncode == 1 and "good-entry" in triage.stdout
    assert "broken.md" in triage.stderr and "Traceback" not in triage.stderr
    assert run_mleng("handbook", "lint", env=env).returncode == 1


# --- ask ---------------------------------------------------------------------------------------

def test_terms_normalize_numbers_paths_and_prefixes():
    words = T.terms('[rank3]: File "/opt/conda/lib/python3.10/site-packages/torch/utils/data/dataloader.py", '
                    "line 1133, pid 4567 at 0x7f3c174611b6 on node017 ran for 600021 milliseconds")
    assert "600021" not in words and "1133" not in words and "0x7f3c174611b6" not in words
    assert "opt" not in words and "conda" not in words and "site" not in words
    assert "dataloader" in words and "milliseconds" in words
    assert "rank" in words and "node" in words


def test_error_codes_canonical_forms():
    assert "xid 79" in T.error_codes("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.")
    assert "xid 79" in T.error_codes("Xid 79")
    assert "errno 28" in T.error_codes("OSError: [Errno 28] No space left on device")
    assert "errno 28" in T.error_codes("write failed: No space left on device")
    assert "sigkill" in T.error_codes("failed (exitcode: -9) local_rank: 0 (pid: 1) of binary")
    assert "sigkill" in T.error_codes("DataLoader worker (pid 12) is killed by signal: Killed.")
    assert "sigkill" in T.error_codes("srun: error: task 0: Exited with exit code 137")
    assert "cuda error 700" in T.error_codes("cuda runtime error (77) : an illegal memory access was encountered")
    assert "source socket.cc:538" in T.error_codes("misc/socket.cc:538 NCCL WARN Net : Connection closed")
    assert "error 12" in T.error_codes("NET/IB : Got completion from peer 10.0.0.2<5213> with error 12, opcode 0")
    assert "nccl error 2" in T.error_codes("NCCL error: unhandled system error, NCCL version 2.18.1")


def test_domain_words_take_in_other_frameworks_and_gpu_names():
    """A TensorFlow, Keras or JAX question, or one naming the GPU, is in the handbook's world (it may be answered
    confidently on words); chit-chat is not."""
    tf_query = T.terms("MultiWorker Mirrored strategy fails to start with TF_CONFIG")
    assert {"tf", "strategy"} & T.domain_words(tf_query) == {"tf"}
    assert "keras" in T.domain_words(T.terms("keras model.fit freezes after the first epoch"))
    assert "v100" in T.domain_words(T.terms("one of four V100 is capped to 150W"))
    assert not T.domain_words(T.terms("hello world, how are you today"))


def test_ask_json_contract_and_hostile_queries(book, run_mleng):
    write_entry(book, "first-entry")
    write_entry(book, "second-entry")
    env = {"MLENG_HANDBOOK_DIR": str(book)}
    result = run_mleng("ask", "RuntimeError: the first-entry failure happened on rank 3 after 600021 ms", "--json",
                       "--limit", "1", env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == {"query", "confident", "results"} and data["confident"] is True
    assert len(data["results"]) == 1
    assert list(data["results"][0]) == [*RESULT_FIELDS, "matched", "confident"]
    matched = data["results"][0]["matched"]
    assert matched["signatures"] == ["the first-entry failure happened"] and "rank" in matched["domain"]
    assert data["results"][0]["id"] == "first-entry"
    for hostile in ['"', 'a:b', '(', '*', 'foo -bar', 'x-y-z*', 'NEAR(a b)', 'x AND OR NOT y', '"unclosed', "\x01\x02", "🙂"]:
        r = run_mleng("ask", hostile, "--json", env=env)
        assert r.returncode in (0, 1), (hostile, r.stderr)
        assert "results" in json.loads(r.stdout)
    nul = run_mleng("ask", "-", "--json", input="the first-entry\x00 failure happened", env=env)
    assert nul.returncode in (0, 1) and json.loads(nul.stdout)["results"][0]["id"] == "first-entry"
    empty = run_mleng("ask", "   ", env=env)
    assert empty.returncode == 2 and "empty" in empty.stderr
    bad_limit = run_mleng("ask", "x", "--limit", "0", env=env)
    assert bad_limit.returncode == 2 and "--limit" in bad_limit.stderr


def test_ask_reads_stdin_and_prints_human_output(book, run_mleng):
    write_entry(book, "first-entry")
    result = run_mleng("ask", "-", input="the first-entry failure happened on rank 3\n",
                       env={"MLENG_HANDBOOK_DIR": str(book)})
    assert result.returncode == 0, result.stderr
    for part in ("Title of first-entry", "why: The first-entry cause.", "confirm:", "echo confirm",
                 "fix:", "echo fix", "sources: https://example.org/issue/1", "id: first-entry"):
        assert part in result.stdout


def test_ask_says_when_it_does_not_know(book, run_mleng):
    """No confident match: the first line says so, nearest entries are 'possibly related', exit 1."""
    write_entry(book, "first-entry")
    env = {"MLENG_HANDBOOK_DIR": str(book)}
    for query in ("hello world", "TypeError: unsupported operand type(s) for +: 'int' and 'str'"):
        human = run_mleng("ask", query, env=env)
        assert human.returncode == 1, human.stderr
        assert human.stdout.startswith("no confident match")
        data = json.loads(run_mleng("ask", query, "--json", env=env).stdout)
        assert data["confident"] is False and all(not r["confident"] for r in data["results"])
    sure = run_mleng("ask", "RuntimeError: the first-entry failure happened on rank 3", env=env)
    assert sure.returncode == 0 and sure.stdout.startswith("1. Title of first-entry")
    assert "matched: 1 log signature" in sure.stdout
    write_entry(book, "words-entry", signatures=[],
                symptoms=["training stalls while the gradient buckets rebuild slowly on every rank"])
    guess = run_mleng("ask", "my training stalls while the gradient buckets rebuild slowly", env=env)
    assert guess.returncode == 0, guess.stderr
    assert guess.stdout.startswith("best guess from words alone") and "1. Title of words-entry" in guess.stdout


def test_out_of_scope_queries_are_not_confident(tmp_path):
    """The shipped handbook on chit-chat, noise and other software's errors (dev set; the frozen one
    is measured by bench/handbook_search.py): at most 10% confident."""
    from mleng.handbook.search import search

    cases = yaml.safe_load((ROOT / "tests" / "handbook_oos_dev.yaml").read_text())
    assert len(cases) >= 60
    index = open_index(ENTRIES, tmp_path / "idx.sqlite")
    try:
        confident = [c["query"] for c in cases if search(index, c["query"], 3)["confident"]]
    finally:
        index.close()
    assert len(confident) <= 0.1 * len(cases), confident


def test_words_alone_are_confident_only_with_enough_rare_weight_or_shared_phrases():
    """A match with no signature and no specific code: a fifth of the query's weight on a few common words
    is not an answer; a quarter in rare words, 60% in somewhat rarer ones, or two word 3-grams of a symptom line, is."""
    from mleng.handbook.search import Match, confident

    def words(coverage, strong_idf, phrases=0, pasted_error=False):
        return Match([], [], ["hang"], [], phrases, coverage, strong_idf, ["gpu"], pasted_error=pasted_error)

    assert not confident(words(0.2, 20.0))
    assert confident(words(0.25, 8.0))
    assert not confident(words(0.55, 7.0))
    assert confident(words(0.7, 7.0))  # most of the query, in somewhat rarer words
    assert confident(words(0.35, 9.0))
    assert confident(words(0.1, 2.0, phrases=2))
    assert not confident(Match([], [], ["hang"], [], 5, 0.9, 30.0, []))  # no word of the handbook's world
    # a pasted exception line that shares no 3-word phrase with the entry's symptoms: words alone do not count
    assert not confident(words(0.7, 20.0, pasted_error=True))
    assert confident(words(0.7, 20.0, phrases=1, pasted_error=True))


def test_a_short_vague_query_gets_the_diagnosis_entry_first(tmp_path):
    index = open_index(ENTRIES, tmp_path / "idx.sqlite")
    try:
        assert rank(index, "training hangs at step 3000")[0]["id"] == "training-hang-diagnosis"
        aside = ("I had an OOM earlier, but now the job fails with: NCCL WARN Error: failed to extend "
                 "/dev/shm/nccl-Ab12 to 9637892 bytes")
        assert "shm" in rank(index, aside)[0]["id"]
    finally:
        index.close()


DESCRIPTION = "after a good start my training loss becomes nan after some steps on both machines"


def test_reports_break_near_ties_on_words_alone(book, tmp_path, monkeypatch):
    """Two entries a description matches equally well in words: the one more real users reported (reports.json)
    ranks first; a signature match and a short query (left to the general entries) are not moved by reports."""
    from mleng.handbook import index as I

    for entry_id in ("aaa-rarely-reported", "bbb-often-reported"):
        write_entry(book, entry_id, title="Training loss becomes NaN after some steps",
                    symptoms=["loss becomes nan after some steps"])
    reports = tmp_path / "reports.json"
    reports.write_text('{"bbb-often-reported": 12}\n')
    monkeypatch.setattr(I, "REPORTS_PATH", reports)
    index = open_index(book, tmp_path / "idx.sqlite")
    try:
        assert rank(index, DESCRIPTION)[0]["id"] == "bbb-often-reported"
        assert rank(index, "loss becomes nan")[0]["id"] == "aaa-rarely-reported"
        assert rank(index, "the aaa-rarely-reported failure happened")[0]["id"] == "aaa-rarely-reported"
    finally:
        index.close()
    reports.write_text('{"aaa-rarely-reported": 12}\n')
    index = open_index(book, tmp_path / "idx.sqlite")   # reports.json is part of the fingerprint
    try:
        assert rank(index, DESCRIPTION)[0]["id"] == "aaa-rarely-reported"
    finally:
        index.close()


def test_a_query_holding_a_whole_two_word_symptom_line_finds_its_entry(tmp_path):
    """A two-word line ("KeyError: 'step'") has no word 3-gram to share; pasted whole, it still counts as a
    phrase and lifts the framework discount, so the entry listing it leads, above entries sharing one word."""
    assert "keyerror step" in T.entry_shingles(["t"], [T.terms("KeyError: 'step'")])
    assert T.query_shingles(["a", "b", "c"]) == ({"a b c"}, {"a b", "b c"})
    index = open_index(ENTRIES, tmp_path / "idx.sqlite")
    try:
        top = rank(index, "KeyError: 'step'")[0]
        assert top["id"] == "accelerate-load-state-keyerror-step"
    finally:
        index.close()


def test_error_codes_and_signatures_outrank_word_overlap(book):
    # A long entry that shares many words with the query, and short ones that carry the exact code.
    write_entry(book, "gpu-words", title="GPU fell off the PCIe bus and the driver lost it",
                symptoms=["the GPU has fallen off the bus and is not responding to commands, GPU lost, bus error"],
                signatures=["is not responding to commands"], tags=["gpu", "bus", "pcie", "fallen"])
    write_entry(book, "xid-specific", title="Xid 79 on a GPU", symptoms=["NVRM: Xid (PCI:0000:01:00): 79, pid=1"],
                signatures=[r"Xid \(PCI:[0-9a-f:.]+\): 79\b"], error_codes=["Xid 79"])
    write_entry(book, "disk-full", title="Checkpoint write fails", symptoms=["OSError: [Errno 28] while saving"],
                signatures=[r"\[Errno 28\] while saving"], error_codes=["errno 28"])
    write_entry(book, "socket-line", title="Connection closed by the peer",
                symptoms=["misc/socket.cc:538 NCCL WARN Net : Connection closed by remote peer"],
                signatures=["NCCL WARN Net : Connection closed by remote peer"])
    write_entry(book, "socket-other", title="Connection closed while connecting to the peer",
                symptoms=["misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to 10.0.0.1 failed"],
                signatures=["socketStartConnect: Connect to"])
    index = open_index(book, book.parent / "idx.sqlite")
    try:
        top = rank(index, "kernel: NVRM: Xid (PCI:0000:b3:00): 79, pid='<unknown>', name=<unknown>, "
                          "GPU has fallen off the bus.")[0]
        assert top["id"] == "xid-specific"
        assert rank(index, "Xid 79")[0]["id"] == "xid-specific"
        assert rank(index, "torch.save: No space left on device")[0]["id"] == "disk-full"
        assert rank(index, "node1:77:99 [0] misc/socket.cc:538 NCCL WARN something new")[0]["id"] == "socket-line"
    finally:
        index.close()


def test_ask_does_not_import_torch(book, run_mleng):
    write_entry(book, "first-entry")
    env = dict(os.environ, MLENG_HANDBOOK_DIR=str(book), MLENG_HOME=str(book.parent / "home"))
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "mleng", "ask", "first-entry failure"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "sqlite3" in imported
    assert not {m for m in imported if m.split(".")[0] in ("torch", "numpy", "matplotlib")}


def test_devset_is_real_and_labelled():
    cases = yaml.safe_load((ROOT / "tests" / "handbook_devset.yaml").read_text())
    ids = {e.id for e in load_entries(ENTRIES)[0]}
    assert len(cases) >= 40
    for case in cases:
        assert case["source"].startswith("https://github.com/"), case
        expected = [case["expected"]] if isinstance(case["expected"], str) else case["expected"]
        assert expected and set(expected) <= ids, f"dev set names {case['expected']!r}, not all entries"
        for other in case.get("also", []):
            assert other in ids, other


def test_search_quality_on_devset(dev_index):
    cases = yaml.safe_load((ROOT / "tests" / "handbook_devset.yaml").read_text())
    result = evaluate(cases, dev_index, depth=3)
    misses = [f"{r['expected']} <- {r['query'][:80]} (got {r['got']})" for r in result["rows"] if not r["position"]]
    assert result["hit_at_3"] >= 0.9, "\n".join(misses)


# --- triage ------------------------------------------------------------------------------------

TRIAGE_LOG = """\
[rank0]: step 10 loss 2.31
[rank1]:[E1202 13:50:14.123 ProcessGroupNCCL.cpp:616] [Rank 1] the alpha-entry failure happened at SeqNum=12
node017:12345:12399 [3] NCCL INFO the beta-entry failure happened on ib0
3: RuntimeError: the alpha-entry failure happened at SeqNum=12
[default2]:the beta-entry failure happened again
gpu-node-4: the alpha-entry failure happened at SeqNum=13
srun: error: nodeb12: task 5: the alpha-entry failure happened
all good here
"""


def test_triage_groups_by_rank_and_host(book, tmp_path, run_mleng):
    write_entry(book, "alpha-entry")
    write_entry(book, "beta-entry")
    log = tmp_path / "train.log"
    log.write_text(TRIAGE_LOG)
    result = run_mleng("triage", str(log), "--json", env={"MLENG_HANDBOOK_DIR": str(book)})
    assert result.returncode == 1, result.stderr
    data = json.loads(result.stdout)
    assert data["lines"] == 8
    alpha, beta = data["findings"]
    assert alpha["entries"][0]["id"] == "alpha-entry"
    assert (alpha["first_line"], alpha["last_line"], alpha["count"]) == (2, 7, 4)
    assert alpha["ranks"] == ["1", "3", "5"]
    assert alpha["hosts"] == ["gpu-node-4", "nodeb12"]
    assert beta["entries"][0]["id"] == "beta-entry"
    assert (beta["first_line"], beta["last_line"], beta["count"]) == (3, 5, 2)
    assert beta["ranks"] == ["2"] and beta["hosts"] == ["node017"]
    human = run_mleng("triage", str(log), env={"MLENG_HANDBOOK_DIR": str(book)})
    assert "lines 2..7 (4 times); ranks 1,3,5; hosts gpu-node-4,nodeb12" in human.stdout
    assert "explained by: alpha-entry" in human.stdout


def test_triage_clean_log_stdin_and_bad_file(book, tmp_path, run_mleng):
    write_entry(book, "alpha-entry")
    env = {"MLENG_HANDBOOK_DIR": str(book)}
    clean = run_mleng("triage", "-", input="step 1\nstep 2\n", env=env)
    assert clean.returncode == 0 and "no known problem found" in clean.stdout
    piped = run_mleng("triage", "-", "--json", input="x\nthe alpha-entry failure happened", env=env)
    assert piped.returncode == 1 and json.loads(piped.stdout)["findings"][0]["first_line"] == 2
    missing = run_mleng("triage", str(tmp_path / "nope.log"), env=env)
    assert missing.returncode == 2 and "cannot read" in missing.stderr and "Traceback" not in missing.stderr


def test_triage_lines_across_block_boundaries(book, monkeypatch):
    import io

    from mleng.handbook import triage as triage_module

    write_entry(book, "alpha-entry")
    entries = [e.to_dict() for e in load_entries(book)[0]]
    matcher = Matcher(entries)
    line = "[rank7]: the alpha-entry failure happened here\n"
    filler = "x" * 50 + "\n"
    text = (filler * 3 + line) * 40 + "y" * 300 + "the alpha-entry failure happened without newline"
    monkeypatch.setattr(triage_module, "CHUNK_BYTES", 37)     # every line straddles a block edge
    monkeypatch.setattr(triage_module, "MAX_LINE_BYTES", 4096)
    result = triage_stream(io.BytesIO(text.encode()), matcher)
    assert result.lines == 161
    (finding,) = result.findings
    assert (finding.first_line, finding.last_line, finding.count) == (4, 161, 41)
    assert finding.ranks == {"7"}


def _triage_log(path) -> None:
    with path.open("w") as f:
        for i in range(3000):
            f.write(f"[rank{i % 4}]: step {i} loss 2.0\n")
            if i % 700 == 5:
                f.write(f"[rank{i % 4}]: the alpha-entry failure happened at {i}\n")
            if i == 2999:
                f.write("node9: the beta-entry failure happened\n")


def _summary(result):
    return [(f.entry_ids, f.first_line, f.last_line, f.count, f.ranks, f.hosts) for f in result.findings]


@pytest.mark.parametrize("engine", sorted(triage_module.SCAN_ENGINES))
def test_every_scan_engine_finds_the_same(book, tmp_path, engine):
    """Hyperscan, Aho-Corasick and the re fallback give one result."""
    write_entry(book, "alpha-entry")
    write_entry(book, "beta-entry")
    entries = [e.to_dict() for e in load_entries(book)[0]]
    log = tmp_path / "split.log"
    _triage_log(log)
    pytest.importorskip({"hyperscan": "hyperscan", "aho-corasick": "ahocorasick_rs"}.get(engine, "re"))
    result = triage_module.triage_file(str(log), Matcher(entries, engine=engine))
    assert result.engine == engine and result.lines == 3006
    assert _summary(result) == _summary(triage_module.triage_file(str(log), Matcher(entries, engine="re")))
    assert result.findings[0].count == 5 and result.findings[1].hosts == {"node9"}


@pytest.mark.parametrize("engine", sorted(triage_module.SCAN_ENGINES))
def test_a_line_start_signature_matches_at_line_starts_only(book, tmp_path, engine):
    """`^GPU\\d+(...){2,}` has only "gpu" as its literal: every engine keeps it to line starts, so host names
    like gpu-node-017 do not send each line to the regexes (that made triage 100x slower than grep)."""
    pytest.importorskip({"hyperscan": "hyperscan", "aho-corasick": "ahocorasick_rs"}.get(engine, "re"))
    pattern = r"^GPU\d+(?:\s+(?:X|SYS|NODE|PHB|PXB|PIX)){2,}"
    write_entry(book, "topo-entry", signatures=[pattern])
    matcher = Matcher([e.to_dict() for e in load_entries(book)[0]], engine=engine)
    assert matcher.anchor_words == [b"gpu"] and matcher.line_start == {0: [pattern]}
    log = tmp_path / "topo.log"
    log.write_text("gpu-node-017:12:12 [0] NCCL INFO GPU0 X SYS NODE\n" * 50 + "GPU0\t X \tSYS\tNODE\n"
                   + "see GPU1 X SYS SYS\n")
    result = triage_module.triage_file(str(log), matcher)
    assert [(f.entry_ids, f.first_line, f.count) for f in result.findings] == [(("topo-entry",), 51, 1)]


def test_triage_file_in_parallel_equals_serial(book, tmp_path, monkeypatch):
    write_entry(book, "alpha-entry")
    write_entry(book, "beta-entry")
    matcher = Matcher([e.to_dict() for e in load_entries(book)[0]])
    log = tmp_path / "split.log"
    _triage_log(log)
    with log.open("rb") as f:
        serial = triage_stream(f, matcher)
    monkeypatch.setattr(triage_module, "MIN_BYTES_PER_WORKER", 1000)
    parallel = triage_module.triage_file(str(log), matcher, workers=3)
    assert parallel.lines == serial.lines == 3006
    assert _summary(parallel) == _summary(serial)
    assert parallel.findings[0].count == 5 and parallel.findings[1].hosts == {"node9"}


def test_triage_pool_workers_leave_signals_to_the_parent():
    """The pool ends its workers with SIGTERM: one that inherited mleng's handler printed a KeyboardInterrupt
    traceback after the findings (now and then, on a 256 MiB log). Workers ignore Ctrl-C and die of SIGTERM."""
    import multiprocessing
    import signal

    from mleng import signals

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signals.install()
    try:
        with multiprocessing.get_context("fork").Pool(1, initializer=triage_module._worker_signals) as pool:
            inside = pool.starmap(signal.getsignal, [(signal.SIGINT,), (signal.SIGTERM,)])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert inside == [signal.SIG_IGN, signal.SIG_DFL]


@pytest.mark.parametrize("compress", ["gzip", "xz", "bzip2", "zstd"])
def test_triage_reads_compressed_logs(book, tmp_path, run_mleng, compress):
    tool = shutil.which(compress)
    if tool is None:
        pytest.skip(f"{compress} is not installed")
    write_entry(book, "alpha-entry")
    write_entry(book, "beta-entry")
    log = tmp_path / "train.log"
    _triage_log(log)
    subprocess.run([tool, "-k", str(log)], check=True)
    packed = next(p for p in tmp_path.iterdir() if p.name.startswith("train.log."))
    env = {"MLENG_HANDBOOK_DIR": str(book)}
    plain = json.loads(run_mleng("triage", str(log), "--json", env=env).stdout)
    result = run_mleng("triage", str(packed), "--json", env=env)
    assert result.returncode == 1, result.stderr
    data = json.loads(result.stdout)
    assert data["findings"] == plain["findings"] and data["lines"] == 3006
    piped = run_mleng("triage", "-", "--json", input=packed.read_bytes(), env=env)
    assert json.loads(piped.stdout)["findings"] == plain["findings"]
    cut = tmp_path / f"cut{packed.suffix}"
    cut.write_bytes(packed.read_bytes()[:len(packed.read_bytes()) // 2])
    damaged = run_mleng("triage", str(cut), env=env)
    assert damaged.returncode == 2 and "damaged or truncated" in damaged.stderr
    assert "Traceback" not in damaged.stderr and damaged.stdout == ""


def test_triage_refuses_binary_input(book, tmp_path, run_mleng):
    write_entry(book, "alpha-entry")
    env = {"MLENG_HANDBOOK_DIR": str(book)}
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 64 + b"the alpha-entry failure happened\n")
    for args, kwargs in (((str(binary),), {}), (("-",), {"input": binary.read_bytes()})):
        result = run_mleng("triage", *args, env=env, **kwargs)
        assert result.returncode == 2 and "is not a text log" in result.stderr, result.stderr
        assert "no known problem" not in result.stdout and "Traceback" not in result.stderr
    folder = run_mleng("triage", str(tmp_path), env=env)
    assert folder.returncode == 2 and "is a directory" in folder.stderr


def test_triage_finds_errors_inside_carriage_return_progress_lines(book, tmp_path):
    """A SLURM .out file: a progress bar rewrites one line with '\\r' for megabytes; the error sits in it."""
    write_entry(book, "alpha-entry")
    matcher = Matcher([e.to_dict() for e in load_entries(book)[0]])
    progress = "".join(f"\r  {i % 100}%|####      | {i}/500000 [00:01<00:10, 9.1it/s]" for i in range(120_000))
    log = tmp_path / "slurm-1234.out"
    log.write_text("start\n" + progress + "\r[rank3]: the alpha-entry failure happened mid-bar" + progress
                   + "\nafter\n")
    assert log.stat().st_size > 12 << 20   # longer than one block and than the old 1 MiB line limit
    result = triage_module.triage_file(str(log), matcher)
    assert result.lines == 3
    (finding,) = result.findings
    assert (finding.first_line, finding.count, finding.ranks) == (2, 1, {"3"})
    assert finding.example == "[rank3]: the alpha-entry failure happened mid-bar"


def test_triage_finds_a_signature_whose_text_runs_across_colour_codes(book, tmp_path):
    """Coloured logs (YOLOv5's '\\x1b[1mAutoBatch: \\x1b[0mUsing ...'): the codes go before the anchor scan."""
    write_entry(book, "alpha-entry")
    matcher = Matcher([e.to_dict() for e in load_entries(book)[0]])
    log = tmp_path / "coloured.log"
    log.write_bytes(b"start\n\x1b[34m\x1b[1mthe alpha-entry\x1b[0m failure happened at step 3\nafter\n")
    result = triage_module.triage_file(str(log), matcher)
    assert result.lines == 3
    (finding,) = result.findings
    assert (finding.first_line, finding.example) == (2, "the alpha-entry failure happened at step 3")


def test_attribute_prefixes():
    assert attribute("[rank12]: boom") == ("12", None)
    assert attribute("[default3]:boom") == ("3", None)
    assert attribute("7: boom") == ("7", None)
    assert attribute("node017: boom") == (None, "node017")
    assert attribute("node017:5: boom") == ("5", "node017")
    assert attribute("gpu-a-1:1234:5678 [2] NCCL WARN boom") == (None, "gpu-a-1")
    assert attribute("RuntimeError: boom") == (None, None)


def test_triage_memory_stays_flat_on_a_50mb_log(book, tmp_path):
    write_entry(book, "alpha-entry")
    log = tmp_path / "big.log"
    block = "".join(f"[rank{i % 8}]:[I1202 13:50:14.123 train.py:88] step {i} loss 2.345 lr 3e-4 tokens/s 91234\n"
                    for i in range(10000))
    with log.open("w") as f:
        while f.tell() < 50 * 1024 * 1024:
            f.write(block)
            f.write("[rank3]: the alpha-entry failure happened in the middle\n")
    script = textwrap.dedent("""
        import json, resource, sys
        from pathlib import Path
        from mleng.handbook.index import open_index
        from mleng.handbook.triage import Matcher, triage_stream
        index = open_index(Path(sys.argv[1]), Path(sys.argv[3]))
        matcher = Matcher([e.data for e in index.entries])
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with open(sys.argv[2], "rb") as f:
            result = triage_stream(f, matcher)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"before_kib": before, "after_kib": after, "lines": result.lines,
                          "count": result.findings[0].count}))
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(book), str(log), str(tmp_path / "idx.sqlite")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    size = log.stat().st_size
    assert stats["count"] == stats["lines"] // 10001
    growth_mib = (stats["after_kib"] - stats["before_kib"]) / 1024
    # Streaming holds a few 2 MiB blocks; reading the file whole would add >= its 50 MiB (twice, lowercased).
    assert growth_mib < 16, f"peak RSS grew {growth_mib:.0f} MiB while scanning a {size >> 20} MiB log"


# --- list, show, site, skill -------------------------------------------------------------------

def test_list_and_show(book, run_mleng):
    write_entry(book, "first-entry", category="storage")
    write_entry(book, "second-entry")
    env = {"MLENG_HANDBOOK_DIR": str(book)}
    listing = json.loads(run_mleng("handbook", "list", "--json", "--category", "storage", env=env).stdout)
    assert [e["id"] for e in listing["entries"]] == ["first-entry"]
    shown = run_mleng("handbook", "show", "second-entry", env=env)
    assert shown.returncode == 0 and "## Why" in shown.stdout and "Something specific went wrong." in shown.stdout
    assert json.loads(run_mleng("handbook", "show", "second-entry", "--json", env=env).stdout)["id"] == "second-entry"
    unknown = run_mleng("handbook", "show", "second-entri", env=env)
    assert unknown.returncode == 2 and "did you mean: second-entry" in unknown.stderr
    bad = run_mleng("handbook", "list", "--category", "nope", env=env)
    assert bad.returncode == 2 and "unknown category" in bad.stderr


def test_skill_names_commands_and_every_entry(tmp_path, run_mleng):
    result = run_mleng("handbook", "skill", str(tmp_path / "skill"))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "skill" / "SKILL.md").read_text()
    assert text.startswith("---\nname: mleng\n")
    for needle in ("mleng ask", "mleng triage", "--json", "mleng handbook show", '"results"', '"findings"'):
        assert needle in text
    for e in load_entries(ENTRIES)[0]:
        assert f"`{e.id}`" in text, e.id


# The site tests (self-contained pages, search parity with ask in headless Chromium): test_handbook_site.py
