"""The search index: entries parsed once into an SQLite file of postings, cached and rebuilt when stale."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

from mleng import __version__
from mleng.handbook import terms as T
from mleng.handbook import default_entries_dir
from mleng.handbook.stem import stem

# The layout of the cache file; the fingerprint also covers the code that fills it.
INDEX_SCHEMA = 11
INDEX_FILENAME = "handbook-index.sqlite"
# Per entry id, how many real user threads of the dev sets had its cause (scripts/handbook_reports.py).
REPORTS_PATH = Path(__file__).resolve().parent / "reports.json"
# The code that turns an entry file into index rows (in this directory).
CODE_FILES = ("index.py", "terms.py", "model.py", "stem.py")
FTS_COLUMNS = ("title", "symptoms", "signatures", "codes", "tags", "cause", "confirm", "fix", "seen", "body")


def default_index_path() -> Path:
    """$MLENG_HOME/handbook-index.sqlite, else the XDG cache directory."""
    if os.environ.get("MLENG_HOME"):
        return Path(os.environ["MLENG_HOME"]).expanduser() / INDEX_FILENAME
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "mleng" / INDEX_FILENAME


def fingerprint(directory: Path) -> str:
    """Changes whenever an entry file is added, removed or modified, or mleng itself changes
    (its version, or the code that decides what goes into the index). The text itself, not a digest of it:
    comparing some 40 kB costs nothing, and `mleng ask` need not load OpenSSL for hashlib."""
    parts = [f"{__version__}|{INDEX_SCHEMA}|{directory.resolve()}"]
    here = Path(__file__).resolve().parent
    for path in (*(here / name for name in CODE_FILES), REPORTS_PATH):
        stat = path.stat()
        parts.append(f"{path.name}:{stat.st_mtime_ns}:{stat.st_size}")
    try:
        listing = sorted((e.name, e.stat()) for e in os.scandir(directory) if e.name.endswith(".md"))
    except OSError:
        listing = []
    parts.extend(f"{name}:{stat.st_mtime_ns}:{stat.st_size}" for name, stat in listing)
    return "|".join(parts)


class IndexedEntry:
    """What ranking reads of every entry on every query; the whole entry (`data`) is read on demand.
    (A plain class: `mleng ask` starts faster without importing dataclasses.)"""
    __slots__ = ("rowid", "id", "category", "signatures", "tags", "codes", "anchors", "length", "reports", "index",
                 "_data")

    def __init__(self, rowid: int, id: str, category: str, signatures: list[str], tags: list[str],
                 codes: list[str], anchors: list[list[str] | None], length: int, reports: int = 0,
                 index: "Index | None" = None):
        self.rowid, self.id, self.category = rowid, id, category
        self.signatures, self.tags = signatures, tags
        self.codes = codes          # canonical error codes from error_codes + symptoms
        self.anchors = anchors      # per signature: literals one of which a match contains, or None
        self.length = length        # tokens in all columns, for BM25's length normalisation
        self.reports = reports      # real user threads with this cause in the dev sets (REPORTS_PATH)
        self.index = index
        self._data: dict | None = None

    @property
    def data(self) -> dict:
        """Entry.to_dict() of this entry, read from the index the first time it is needed."""
        if self._data is None:
            (text,) = self.index.conn.execute("SELECT data FROM entries WHERE rowid = ?", (self.rowid,)).fetchone()
            self._data = json.loads(text)
        return self._data


class Index:
    """An open index: per-term `postings`, the entries in rowid order (rowids run from 1, so rowid n is
    `entries[n - 1]`), the files skipped."""

    def __init__(self, conn: sqlite3.Connection, path: Path | None, rebuilt: bool):
        self.conn = conn
        self.path = path
        self.rebuilt = rebuilt
        # One JSON document for the columns every query reads: parsing it once is the start-up cost.
        (summary,) = conn.execute("SELECT value FROM meta WHERE key = 'summary'").fetchone()
        self.entries: list[IndexedEntry] = [IndexedEntry(*row, index=self) for row in json.loads(summary)]
        self.skipped: list[dict] = [
            {"file": f, "field": fld, "message": m}
            for f, fld, m in conn.execute("SELECT file, field, message FROM skipped ORDER BY file")
        ]
        self.lengths: dict[int, int] = {e.rowid: e.length for e in self.entries}
        self.average_length = sum(self.lengths.values()) / max(1, len(self.lengths))
        # What every query looks up: the entries under each signature-anchor literal and each error code.
        # Built on the first query, so opening the index stays cheap.
        self._anchors: dict[str, list[IndexedEntry]] | None = None
        self._code_entries: dict[str, list[IndexedEntry]] | None = None
        self._norms: tuple[tuple[float, float], list[float]] | None = None

    def length_norms(self, k1: float, b: float) -> list[float]:
        """BM25's length normalisation k1 * (1 - b + b * length / average length) by rowid (index 0 unused),
        worked out once per index rather than once per posting."""
        if self._norms is None or self._norms[0] != (k1, b):
            norms = [0.0] * (len(self.entries) + 1)
            for rowid, length in self.lengths.items():
                norms[rowid] = k1 * (1 - b + b * length / self.average_length)
            self._norms = ((k1, b), norms)
        return self._norms[1]

    def anchor_entries(self) -> dict[str, list[IndexedEntry]]:
        """Anchor literal -> the entries with a signature that needs it (each entry once per literal). A
        signature with no anchor files its entry under "", which every query contains."""
        if self._anchors is None:
            self._anchors = {}
            for entry in self.entries:
                for literal in {a for anchor in entry.anchors for a in (anchor if anchor is not None else [""])}:
                    self._anchors.setdefault(literal, []).append(entry)
        return self._anchors

    def code_entries(self) -> dict[str, list[IndexedEntry]]:
        """Canonical error code -> the entries that carry it."""
        if self._code_entries is None:
            self._code_entries = {}
            for entry in self.entries:
                for code in entry.codes:
                    self._code_entries.setdefault(code, []).append(entry)
        return self._code_entries

    def close(self) -> None:
        self.conn.close()


def _create_schema(conn: sqlite3.Connection) -> None:
    conn.executescript(f"""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE entries (rowid INTEGER PRIMARY KEY, id TEXT UNIQUE NOT NULL, data TEXT NOT NULL,
                              codes TEXT NOT NULL, anchors TEXT NOT NULL, length INTEGER NOT NULL);
        -- word 3-grams of each entry's title and symptoms (a near-verbatim paste shares several)
        CREATE TABLE shingles (shingle TEXT NOT NULL, rowid INTEGER NOT NULL);
        CREATE TABLE skipped (file TEXT NOT NULL, field TEXT NOT NULL, message TEXT NOT NULL);
        -- each indexed entry file's content digest: the next rebuild copies the rows of files still the same
        CREATE TABLE files (name TEXT PRIMARY KEY, digest TEXT NOT NULL, rowid INTEGER NOT NULL);
    """)
    _create_postings(conn, "rowid")


def _create_postings(conn: sqlite3.Connection, key: str) -> None:
    """One row per (Porter-stemmed, stem.py) term and entry, for our own BM25: the term's frequency in each
    column (FTS_COLUMNS, one SQL column each, 0 where absent) and the mask of the columns it occurs in. A query
    reads its terms' rows straight from the primary key, already in (term, entry) order."""
    counts = ", ".join(f"{c} INTEGER NOT NULL" for c in FTS_COLUMNS)
    conn.execute(f"CREATE TABLE postings (term TEXT NOT NULL, {key} INTEGER NOT NULL, {counts}, mask INTEGER NOT NULL,"
                 f" PRIMARY KEY (term, {key})) WITHOUT ROWID")


def report_counts() -> dict[str, int]:
    """REPORTS_PATH: entry id -> real user threads of the dev sets whose confirmed cause it is."""
    try:
        return json.loads(REPORTS_PATH.read_text())
    except (OSError, ValueError):
        return {}


def entry_codes(entry: dict) -> set[str]:
    codes: set[str] = T.error_codes(entry["title"])
    for text in entry["error_codes"]:
        codes |= T.error_codes(text)
    for text in entry["symptoms"]:
        codes |= T.error_codes(text)
    return codes


def symptom_terms(data: dict) -> list[list[str]]:
    """The terms of each symptom line of an entry (Entry.to_dict())."""
    return [T.terms(line) for line in data["symptoms"]]


def entry_columns(data: dict, symptoms: list[list[str]]) -> list[list[str]]:
    """The search terms of each column (FTS_COLUMNS order) of an entry (Entry.to_dict()), unstemmed;
    `symptoms`: its symptom_terms, which make the symptoms column."""
    sections = data.get("sections") or {}
    fields = {
        "title": data["title"],
        "signatures": "\n".join(data["signatures"]),
        "codes": "\n".join(data["error_codes"]), "tags": " ".join(data["tags"] + [data["category"], data["id"]]),
        "cause": data["cause"], "confirm": "\n".join(data["confirm"]), "fix": "\n".join(data["fix"]),
        # "What you see" is the plain-language symptom, what a described problem matches best.
        "seen": sections.get("What you see", ""),
        "body": "\n".join(v for k, v in sections.items() if k != "What you see"),
    }
    symptom_words = [w for line in symptoms for w in line]
    return [symptom_words if c == "symptoms" else T.terms(fields[c]) for c in FTS_COLUMNS]


def term_rows(columns: list[list[str]]) -> list[tuple]:
    """The postings-table rows of an entry's columns (FTS_COLUMNS order), without the entry: (stem, tf per
    column..., mask of the columns it occurs in), with our own Porter stems (stem.py, also run by the site)."""
    width = len(FTS_COLUMNS)
    per_term: dict[str, list[int]] = {}
    for col, words in enumerate(columns):
        bit = 1 << col
        for word in words:
            term = stem(word)
            row = per_term.get(term)
            if row is None:
                row = per_term[term] = [0] * (width + 1)
            row[col] += 1
            row[width] |= bit
    return [(term, *row) for term, row in per_term.items()]


def _entry_rows(paths: list[Path]) -> list:
    """The Python work of a rebuild, per entry file in order: (file, id, (data, codes, anchors, length,
    (term rows, shingles))), or the EntryError of a file that cannot be used (model.first_of_each_id's input)."""
    from mleng.handbook.model import EntryError, parse_entry

    rows: list = []
    for path in paths:
        try:
            entry = parse_entry(path, verified=False)
        except EntryError as exc:
            rows.append(exc)
            continue
        data = entry.to_dict()
        lines = symptom_terms(data)
        columns = entry_columns(data, lines)
        shingles = sorted(T.entry_shingles(columns[FTS_COLUMNS.index("title")], lines))
        anchors = [T.regex_anchor(s) for s in entry.signatures]
        rows.append((str(path), entry.id, (data, sorted(entry_codes(data)), anchors,
                                           sum(len(words) for words in columns), (term_rows(columns), shingles))))
    return rows


def _connect_for_writing(path: Path | str) -> sqlite3.Connection:
    conn = sqlite3.connect(path)
    # The file is used only once complete (renamed into place, or copied from): a crash mid-fill loses
    # nothing, so the rollback journal and fsyncs buy nothing here.
    conn.execute("PRAGMA journal_mode = OFF")
    conn.execute("PRAGMA synchronous = OFF")
    # Room for the whole file (some 30 MiB): the postings' B-tree is filled out of key order.
    conn.execute("PRAGMA cache_size = -131072")
    return conn


def _part_rows(paths: list[Path], part: str) -> list:
    """The helper's half of a rebuild: _entry_rows, with each entry's postings and shingles written to the
    SQLite file `part` under the entry's position in `paths` instead of sent back; its row ends in that
    position."""
    conn = _connect_for_writing(part)
    try:
        _create_postings(conn, "pos")
        conn.execute("CREATE TABLE shingles (shingle TEXT NOT NULL, pos INTEGER NOT NULL)")
        rows, numbered = [], []
        for pos, row in enumerate(_entry_rows(paths)):
            if isinstance(row, tuple):
                file, entry_id, (data, codes, anchors, length, terms) = row
                numbered.append((pos, terms))
                row = (file, entry_id, (data, codes, anchors, length, pos))
            rows.append(row)
        _insert_terms(conn, numbered)   # the part's tables have the index's columns, keyed by position
        conn.commit()
    finally:
        conn.close()
    return rows


# Below this many entry files a second process costs more than it saves.
PARALLEL_MIN_FILES = 400


def _can_fork(files: int) -> bool:
    """Whether a forked helper is worth it and safe: enough files, two or more cores, fork available, no
    other thread running, not a daemonic process (such as a DataLoader worker)."""
    import threading

    if files < PARALLEL_MIN_FILES or (os.cpu_count() or 1) < 2 or threading.active_count() > 1:
        return False
    import multiprocessing

    return "fork" in multiprocessing.get_all_start_methods() and not multiprocessing.current_process().daemon


def _ignore_sigint() -> None:
    """Ctrl-C during a rebuild is the parent's to handle; the pool ends the helper on the way out."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _insert_terms(conn: sqlite3.Connection, numbered: list) -> None:
    """The postings and shingles of (rowid, (term rows, shingles)) pairs."""
    values = ", ".join("?" * (len(FTS_COLUMNS) + 3))
    conn.executemany(f"INSERT INTO postings VALUES ({values})",
                     [(row[0], rowid, *row[1:]) for rowid, (entry_terms, _) in numbered for row in entry_terms])
    conn.executemany("INSERT INTO shingles VALUES (?, ?)",
                     [(shingle, rowid) for rowid, (_, entry_shingles) in numbered for shingle in entry_shingles])


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


def reuse_key(directory: Path) -> str:
    """What an index's rows depend on besides each file's text: the layout, the content of the code that turns
    a file into rows (not its mtime: a reinstall of the same code keeps the key), and the directory as read,
    which the entries' `path` holds."""
    import hashlib

    here = Path(__file__).resolve().parent
    code = hashlib.blake2b(digest_size=16)
    for name in CODE_FILES:
        code.update((here / name).read_bytes())
    return f"{INDEX_SCHEMA}|{code.hexdigest()}|{directory}"


class _Reused:
    """An entry whose file is unchanged since the previous index: its rows are copied from there."""
    __slots__ = ("rowid", "summary")

    def __init__(self, rowid: int, summary: list):
        self.rowid, self.summary = rowid, summary


def _previous_rows(conn: sqlite3.Connection, previous: Path | None, key: str, files: list[Path],
                   digests: list[str]) -> dict[int, tuple]:
    """File position -> (file, id, _Reused) for each file whose name and digest the previous index (attached
    as `old`) has an entry row for; empty, with nothing attached, where there is no usable previous index."""
    if previous is None or not previous.is_file():
        return {}
    try:
        conn.execute("ATTACH DATABASE ? AS old", (str(previous),))
    except sqlite3.Error:
        return {}
    try:
        meta = dict(conn.execute("SELECT key, value FROM old.meta WHERE key IN ('reuse', 'summary')"))
        if meta.get("reuse") != key:
            raise LookupError
        old = {name: (digest, rowid)
               for name, digest, rowid in conn.execute("SELECT name, digest, rowid FROM old.files")}
        summary = {row[0]: row for row in json.loads(meta["summary"])}
    except (sqlite3.Error, ValueError, LookupError, TypeError, IndexError):
        conn.execute("DETACH DATABASE old")
        return {}
    found = {}
    for pos, (path, digest) in enumerate(zip(files, digests)):
        was = old.get(path.name)
        if was is not None and was[0] == digest and was[1] in summary:
            row = summary[was[1]]
            found[pos] = (str(path), row[1], _Reused(was[1], row))
    if not found:
        conn.execute("DETACH DATABASE old")
    return found


def _fill(conn: sqlite3.Connection, directory: Path, print_fingerprint: str, scratch: Path | None = None,
          previous: Path | None = None) -> None:
    """Parse every entry file and write the index. The rows of files unchanged since the `previous` index
    (same name and content, same reuse_key) are copied from it; only the others are parsed. When there is
    nothing to reuse and two or more cores, a forked helper parses the second half of the files and writes
    their postings into its own SQLite file in `scratch`, while this process parses the first half and
    writes theirs; SQLite then copies the helper's rows in, renumbered. Serial with no `scratch` or where
    forking is not worth it or not safe (_can_fork), and for the second half when the helper dies; the
    index is the same either way."""
    import contextlib
    import tempfile
    from concurrent.futures.process import BrokenProcessPool

    from mleng.handbook.model import entry_files, first_of_each_id

    files = entry_files(directory)
    _create_schema(conn)
    key = reuse_key(directory)
    digests = [_digest(path) for path in files]
    reused = _previous_rows(conn, previous, key, files, digests)
    todo = [path for pos, path in enumerate(files) if pos not in reused]
    with contextlib.ExitStack() as stack:
        half, future, part = len(todo), None, None
        if not reused and scratch is not None and _can_fork(len(todo)):
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            try:
                fd, part = tempfile.mkstemp(prefix=".handbook-part-", suffix=".tmp", dir=scratch)
                os.close(fd)
                stack.callback(Path(part).unlink, missing_ok=True)
                pool = stack.enter_context(ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("fork"), initializer=_ignore_sigint))
                half = len(todo) // 2
                future = pool.submit(_part_rows, todo[half:], part)
            except (OSError, BrokenProcessPool):
                half, future = len(todo), None
        parsed = _entry_rows(todo[:half])
        early = 0
        if not reused:
            # The first half's rowids are final whatever the second half holds (a later file never displaces
            # an earlier one), so its postings go in while the helper works.
            first, _ = first_of_each_id(parsed)
            _insert_terms(conn, list(enumerate((value[4] for value in first), start=1)))
            early = len(first)
        if future is not None:
            try:
                parsed += future.result()
            except (BrokenProcessPool, OSError, sqlite3.Error):  # the helper died (out of memory, a signal,
                parsed += _entry_rows(todo[half:])                # a full disk): do its half here
        pending = iter(parsed)
        rows = []
        for pos, path in enumerate(files):
            row = reused[pos] if pos in reused else next(pending)
            rows.append(row if isinstance(row, Exception) else (row[0], row[1], (path.name, digests[pos], row[2])))
        kept, skipped = first_of_each_id(rows)
        reports = report_counts()
        summary, inline, renumber, copied, indexed = [], [], [], [], []
        for rowid, (name, digest, value) in enumerate(kept, start=1):
            indexed.append((name, digest, rowid))
            if isinstance(value, _Reused):
                copied.append((value.rowid, rowid))
                summary.append([rowid, *value.summary[1:8], reports.get(value.summary[1], 0)])
                continue
            data, codes, anchors, length, terms = value
            entry_id = data["id"]
            conn.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?)", (
                rowid, entry_id, json.dumps(data), json.dumps(codes), json.dumps(anchors), length))
            summary.append([rowid, entry_id, data["category"], data["signatures"], data["tags"], codes, anchors,
                            length, reports.get(entry_id, 0)])
            if isinstance(terms, int):
                renumber.append((terms, rowid))
            elif rowid > early:
                inline.append((rowid, terms))
        _insert_terms(conn, inline)
        counts = ", ".join(f"p.{c}" for c in FTS_COLUMNS)
        if copied:
            conn.execute("CREATE TEMP TABLE copied (old INTEGER PRIMARY KEY, rowid INTEGER NOT NULL)")
            conn.executemany("INSERT INTO copied VALUES (?, ?)", copied)
            conn.execute("INSERT INTO entries SELECT c.rowid, o.id, o.data, o.codes, o.anchors, o.length "
                         "FROM old.entries o JOIN copied c ON o.rowid = c.old")
            conn.execute(f"INSERT INTO postings SELECT p.term, c.rowid, {counts}, p.mask "
                         "FROM old.postings p JOIN copied c ON p.rowid = c.old")
            conn.execute("INSERT INTO shingles SELECT s.shingle, c.rowid "
                         "FROM old.shingles s JOIN copied c ON s.rowid = c.old")
            conn.commit()
            conn.execute("DROP TABLE temp.copied")
        if reused:
            conn.execute("DETACH DATABASE old")
        if renumber:
            conn.execute("CREATE TEMP TABLE renumber (pos INTEGER PRIMARY KEY, rowid INTEGER NOT NULL)")
            conn.executemany("INSERT INTO renumber VALUES (?, ?)", renumber)
            conn.commit()
            conn.execute("ATTACH DATABASE ? AS part", (part,))
            conn.execute(f"INSERT INTO postings SELECT p.term, r.rowid, {counts}, p.mask "
                         "FROM part.postings p JOIN renumber r USING (pos)")
            conn.execute("INSERT INTO shingles SELECT s.shingle, r.rowid FROM part.shingles s JOIN renumber r USING (pos)")
            conn.commit()
            conn.execute("DETACH DATABASE part")
            conn.execute("DROP TABLE temp.renumber")
    conn.execute("CREATE INDEX shingles_shingle ON shingles (shingle)")
    conn.execute("INSERT INTO meta VALUES ('summary', ?)", (json.dumps(summary),))
    conn.executemany("INSERT INTO skipped VALUES (?, ?, ?)", [(e.file, e.field, e.message) for e in skipped])
    conn.executemany("INSERT INTO files VALUES (?, ?, ?)", indexed)
    conn.execute("INSERT INTO meta VALUES ('fingerprint', ?)", (print_fingerprint,))
    conn.execute("INSERT INTO meta VALUES ('reuse', ?)", (key,))
    conn.commit()


def _fill_file(path: str, directory: Path, print_fingerprint: str, scratch: Path, previous: Path | None) -> None:
    """_fill into the SQLite file `path`, emptied first."""
    Path(path).write_bytes(b"")
    conn = _connect_for_writing(path)
    try:
        _fill(conn, directory, print_fingerprint, scratch, previous)
    finally:
        conn.close()


def _read_fingerprint(path: Path) -> str | None:
    """The cached file's fingerprint, or None when it is missing, foreign or corrupt."""
    if not path.is_file():
        return None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            row = conn.execute("SELECT value FROM meta WHERE key = 'fingerprint'").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        return None
    return row[0] if row else None


def open_index(directory: Path | None = None, cache_path: Path | None = None) -> Index:
    """The index for the entries directory, from the cache when it is current, rebuilt when not.

    The cache is derived data we own: a stale, foreign or corrupt file is replaced, atomically,
    so two processes rebuilding at once never see a half-written index.
    """
    directory = Path(directory) if directory is not None else default_entries_dir()
    if not directory.is_dir():
        from mleng.errors import UsageError

        raise UsageError(f"handbook entries directory {directory} does not exist",
                         hint="unset MLENG_HANDBOOK_DIR or point it at a directory of <id>.md entries")
    cache_path = Path(cache_path) if cache_path is not None else default_index_path()
    current = fingerprint(directory)
    if _read_fingerprint(cache_path) == current:
        try:
            return Index(sqlite3.connect(f"file:{cache_path}?mode=ro", uri=True), cache_path, rebuilt=False)
        except (sqlite3.DatabaseError, ValueError, KeyError):
            pass  # damaged beyond its meta table: rebuild below
    import tempfile

    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=".handbook-index-", suffix=".tmp", dir=cache_path.parent)
        os.close(fd)
    except OSError:
        # No writable cache directory: build in memory; ask stays correct, only slower.
        conn = sqlite3.connect(":memory:")
        _fill(conn, directory, current)
        return Index(conn, None, rebuilt=True)
    try:
        try:
            # The stale cache (if any) is the previous index: the rows of unchanged files come from it.
            _fill_file(tmp_name, directory, current, cache_path.parent, previous=cache_path)
        except sqlite3.DatabaseError:
            # The previous index was damaged past the tables that said it could be used: start again without it.
            _fill_file(tmp_name, directory, current, cache_path.parent, previous=None)
        os.replace(tmp_name, cache_path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return Index(sqlite3.connect(f"file:{cache_path}?mode=ro", uri=True), cache_path, rebuilt=True)
