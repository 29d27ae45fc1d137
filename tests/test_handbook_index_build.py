"""The index rebuild splits its work over two processes where it can (the helper writes its half's postings
into a part file that the parent copies in): the index it writes must be the one a serial build writes, skipped
files and duplicate ids included, and a helper that dies costs time, not entries. A rebuild over a stale index
copies the rows of the files it still holds unchanged and parses the rest: the index must be a fresh build's, and a
stale index of other code, damaged or of an older layout is not used."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import threading

import pytest

from mleng.handbook import default_entries_dir
from mleng.handbook import index as I
from mleng.handbook.model import entry_files, load_entries

TABLES = {"entries": "rowid", "postings": "term, rowid", "shingles": "shingle, rowid", "meta": "key",
          "skipped": "file", "files": "name"}


def dump(path) -> dict:
    conn = sqlite3.connect(path)
    try:
        return {table: conn.execute(f"SELECT * FROM {table} ORDER BY {order}").fetchall()
                for table, order in TABLES.items()}
    finally:
        conn.close()


def build(directory, cache, monkeypatch, min_files: int) -> dict:
    monkeypatch.setattr(I, "PARALLEL_MIN_FILES", min_files)
    I.open_index(directory, cache).close()
    return dump(cache)


needs_two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2 or threading.active_count() > 1,
                                     reason="the parallel rebuild runs only on two or more cores and with no other thread")


@needs_two_cores
def test_parallel_rebuild_writes_the_serial_index(tmp_path, monkeypatch):
    serial = build(default_entries_dir(), tmp_path / "serial.sqlite", monkeypatch, 10**9)
    parallel = build(default_entries_dir(), tmp_path / "parallel.sqlite", monkeypatch, 0)
    assert len(serial["entries"]) == len(entry_files(default_entries_dir()))
    assert parallel == serial


@needs_two_cores
def test_parallel_rebuild_skips_what_load_entries_skips(tmp_path, monkeypatch):
    entries = tmp_path / "entries"
    entries.mkdir()
    for path in entry_files(default_entries_dir())[:40]:
        shutil.copy(path, entries / path.name)
    first = sorted(entries.glob("*.md"))
    (entries / "zz-broken.md").write_text("---\nid: [not closed\n---\n")
    (entries / "zz-duplicate.md").write_text(first[0].read_text())   # the same id in a later file
    serial = build(entries, tmp_path / "serial.sqlite", monkeypatch, 10**9)
    parallel = build(entries, tmp_path / "parallel.sqlite", monkeypatch, 0)
    assert parallel == serial
    loaded, skipped = load_entries(entries)
    assert [row[1] for row in parallel["entries"]] == [e.id for e in loaded]
    assert [row[0] for row in parallel["skipped"]] == sorted(e.file for e in skipped)
    assert {row[0] for row in parallel["skipped"]} == {str(entries / "zz-broken.md"), str(entries / "zz-duplicate.md")}


PARENT = os.getpid()
_serial_rows = I._entry_rows


def _rows_or_die(paths):
    """_entry_rows in the parent; in the forked helper, the helper is killed as the OOM killer would."""
    if os.getpid() != PARENT:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    return _serial_rows(paths)


@needs_two_cores
def test_a_killed_helper_costs_time_not_entries(tmp_path, monkeypatch):
    serial = build(default_entries_dir(), tmp_path / "serial.sqlite", monkeypatch, 10**9)
    monkeypatch.setattr(I, "_entry_rows", _rows_or_die)
    survived = build(default_entries_dir(), tmp_path / "survived.sqlite", monkeypatch, 0)
    assert survived == serial
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serial.sqlite", "survived.sqlite"]  # no part file left


@needs_two_cores
def test_the_helpers_part_file_is_removed(tmp_path, monkeypatch):
    build(default_entries_dir(), tmp_path / "index.sqlite", monkeypatch, 0)
    assert [p.name for p in tmp_path.iterdir()] == ["index.sqlite"]


def test_index_reads_entries_without_their_verified_lists_and_show_still_has_them(tmp_path):
    """The rebuild leaves each entry's `verified` block out of its YAML (search never reads it): everything else
    must parse the same as the whole file does, and `mleng handbook show --json` still prints the whole list."""
    import argparse

    from mleng.cli.handbook import show_result
    from mleng.handbook.model import parse_entry, split_front_matter

    for path in entry_files(default_entries_dir()):
        text = path.read_text()
        whole, body = split_front_matter(text, str(path))
        fast, fast_body = split_front_matter(text, str(path), verified=False)
        assert fast == {k: v for k, v in whole.items() if k != "verified"}, path.name
        assert fast_body == body
    entry = parse_entry(entry_files(default_entries_dir())[0])
    assert entry.verified
    index = I.open_index(default_entries_dir(), tmp_path / "index.sqlite")
    try:
        assert all(e.data["verified"] == [] for e in index.entries[:50])
        shown = show_result(argparse.Namespace(id=entry.id), index)
    finally:
        index.close()
    assert shown["verified"] == entry.verified


def test_show_says_so_when_an_entrys_verified_list_is_malformed(tmp_path, run_mleng):
    """The index skips the `verified` block, so an entry whose block is broken is still found; `handbook show`
    reads the file again and must say the list is missing rather than print an empty one as if nothing was checked."""
    source = default_entries_dir() / "xid-79-fallen-off-bus.md"
    book = tmp_path / "entries"
    book.mkdir()
    text = source.read_text()
    head, rest = text.split("\nverified:\n", 1)
    (book / source.name).write_text(head + "\nverified: checked by hand\n" + _after_block(rest))
    env = {"MLENG_HANDBOOK_DIR": str(book)}
    shown = run_mleng("handbook", "show", "xid-79-fallen-off-bus", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["verified"] == []
    assert "verified: must be a list of mappings" in shown.stderr and "mleng handbook lint" in shown.stderr
    assert "Traceback" not in shown.stderr
    intact = run_mleng("handbook", "show", "xid-79-fallen-off-bus", "--json")
    assert json.loads(intact.stdout)["verified"] and "warning" not in intact.stderr


def _after_block(front_rest: str) -> str:
    """What follows a top-level YAML block: its indented lines dropped."""
    lines = front_rest.splitlines(keepends=True)
    while lines and (lines[0].startswith((" ", "-")) or not lines[0].strip()):
        lines.pop(0)
    return "".join(lines)


def entry_copy(tmp_path, count: int):
    entries = tmp_path / "entries"
    entries.mkdir()
    for path in entry_files(default_entries_dir())[:count]:
        shutil.copy(path, entries / path.name)
    return entries


def edit_like_an_upgrade(entries) -> set[str]:
    """What a new release does to the entries: one rewritten, one removed, one added, and two unusable files
    (one broken, one reusing an id in a file that sorts before the id's own file, which it displaces). Returns
    the names of the files that are new or changed, and of the displaced one."""
    files = sorted(entries.glob("*.md"))
    text = files[3].read_text()
    files[3].write_text(text.replace("\n## Fix", "\nOne more sentence of the body.\n\n## Fix", 1))
    files[5].unlink()
    shutil.copy(entry_files(default_entries_dir())[-1], entries)
    (entries / "aaa-broken.md").write_text("---\nid: [not closed\n---\n")
    (entries / "aab-duplicate.md").write_text(files[7].read_text())
    for path in entries.glob("*.md"):   # a reinstall: every file written anew, unchanged or not
        os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)
    new_or_changed = {files[3].name, entry_files(default_entries_dir())[-1].name, "aaa-broken.md", "aab-duplicate.md"}
    return new_or_changed, files[7].name


def rebuild(entries, cache, monkeypatch) -> tuple[dict, list[str]]:
    """The index rebuilt over a stale cache, and the files it parsed rather than copied."""
    parsed: list[str] = []

    def recording(paths):
        parsed.extend(p.name for p in paths)
        return _serial_rows(paths)

    monkeypatch.setattr(I, "_entry_rows", recording)
    index = I.open_index(entries, cache)
    assert index.rebuilt
    index.close()
    monkeypatch.setattr(I, "_entry_rows", _serial_rows)
    return dump(cache), parsed


def test_a_rebuild_copies_unchanged_files_and_writes_the_index_a_fresh_build_writes(tmp_path, monkeypatch):
    entries = entry_copy(tmp_path, 60)
    cache = tmp_path / "cache" / "index.sqlite"
    cache.parent.mkdir()
    I.open_index(entries, cache).close()
    changed, displaced = edit_like_an_upgrade(entries)
    upgraded, parsed = rebuild(entries, cache, monkeypatch)
    fresh = build(entries, tmp_path / "fresh.sqlite", monkeypatch, 10**9)
    assert upgraded == fresh
    assert sorted(parsed) == sorted(changed)
    assert len(upgraded["entries"]) == 60   # one removed, one added; the broken file and the displaced one skipped
    assert {row[0] for row in upgraded["skipped"]} == {str(entries / "aaa-broken.md"), str(entries / displaced)}


def run_sql(cache, *statements: str) -> None:
    conn = sqlite3.connect(cache)
    for statement in statements:
        conn.execute(statement)
    conn.commit()
    conn.close()


STALE = "UPDATE meta SET value = 'stale' WHERE key = 'fingerprint'"


@pytest.mark.parametrize("damage", ["other code", "truncated", "garbage", "older layout", "postings pages"])
def test_a_previous_index_of_other_code_damaged_or_older_is_not_reused(tmp_path, monkeypatch, damage):
    entries = entry_copy(tmp_path, 30)
    cache = tmp_path / "index.sqlite"
    I.open_index(entries, cache).close()
    if damage == "other code":
        run_sql(cache, "UPDATE meta SET value = 'other code' WHERE key = 'reuse'", STALE)
    elif damage == "truncated":
        cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 3])
    elif damage == "garbage":
        cache.write_bytes(b"not an index at all\n" * 100)
    elif damage == "older layout":
        run_sql(cache, "DROP TABLE files", STALE)
    else:   # postings pages overwritten: its meta and files tables still read, the copy itself fails
        run_sql(cache, STALE)
        data = bytearray(cache.read_bytes())
        size = len(data)
        data[size * 2 // 5: size * 3 // 5] = b"\xff" * (size * 3 // 5 - size * 2 // 5)
        cache.write_bytes(bytes(data))
    upgraded, parsed = rebuild(entries, cache, monkeypatch)
    assert len(parsed) == 30
    assert upgraded == build(entries, tmp_path / "fresh.sqlite", monkeypatch, 10**9)
