"""The results store: one SQLite file (WAL) under MLENG_HOME; rank 0 alone writes."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import tempfile
from pathlib import Path
from typing import Any, Iterator

from mleng.errors import MlengError, StoreError, UsageError
from mleng.results.record import (
    SCHEMA_VERSION, Measurement, check_schema, current_check, current_kind, stored_kinds, upgrade,
)

APPLICATION_ID = 0x6D6C6E67  # "mlng": marks the file as ours
STORE_FILENAME = "results.sqlite"
SQLITE_HEADER = b"SQLite format 3\x00"

_DDL = """
CREATE TABLE IF NOT EXISTS measurements (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    started_at TEXT NOT NULL,
    host TEXT NOT NULL,
    schema TEXT NOT NULL,
    summary TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS measurements_kind ON measurements(kind, started_at);
"""
# Doctor findings per GPU, by the GPU's UUID (which follows the card from node to node), so a run can say
# "failed sm_clock on 3 of its last 5 runs". Derived from the doctor records: rebuilt from them when missing
# (a store written before this table), so it never holds anything the records do not.
_GPU_FINDINGS_DDL = """
CREATE TABLE IF NOT EXISTS gpu_findings (
    measurement_id TEXT NOT NULL,
    gpu_uuid TEXT NOT NULL,
    started_at TEXT NOT NULL,
    host TEXT NOT NULL,
    gpu_index INTEGER,
    check_name TEXT NOT NULL,
    severity TEXT NOT NULL,
    PRIMARY KEY (measurement_id, gpu_uuid, check_name)
);
CREATE INDEX IF NOT EXISTS gpu_findings_uuid ON gpu_findings(gpu_uuid, started_at);
"""
_SEVERITY_ORDER = {"fail": 0, "warn": 1, "inconclusive": 2, "ok": 3, "skipped": 4}


def mleng_home() -> Path:
    """MLENG_HOME, else $XDG_DATA_HOME/mleng, else ~/.local/share/mleng."""
    if os.environ.get("MLENG_HOME"):
        return Path(os.environ["MLENG_HOME"]).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg).expanduser() / "mleng"


def default_store_path() -> Path:
    return mleng_home() / STORE_FILENAME


class Store:
    """A handle on the results file. Every write is one transaction."""

    def __init__(self, path: str | os.PathLike | None = None, create: bool = True):
        """create=False: a reader's handle; a store that does not exist yet reads as empty and is not made."""
        self.path = Path(path) if path is not None else default_store_path()
        self.create = create
        self._conn: sqlite3.Connection | None = None

    def __enter__(self) -> "Store":
        if self.create or self.path.exists():
            self.connect()
        else:
            self._refuse_if_not_ours_before_open()
        return self

    @property
    def exists(self) -> bool:
        return self.path.exists()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def connect(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        self._refuse_if_not_ours_before_open()
        if not self.create and not self.path.exists():
            raise UsageError(f"no results stored yet: {self.path} does not exist",
                             hint="run a benchmark first, e.g. `mleng mamf`")
        home = self.path.parent
        for parent in (home, *home.parents):
            if parent.exists():
                if not parent.is_dir():
                    raise StoreError(f"results store folder {home} cannot be made: {parent} is a file, not a folder",
                                     hint="set MLENG_HOME to a folder (it is created if missing), or --no-store")
                break
        try:
            home.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"results store folder {home} cannot be made: {exc.strerror or exc}",
                             hint="set MLENG_HOME to a folder you can write to, or pass --no-store") from None
        try:
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            conn.execute("PRAGMA busy_timeout = 30000")
            self._check_or_initialize(conn)
        except sqlite3.DatabaseError as exc:
            raise StoreError(
                f"results store {self.path} is not a readable SQLite database ({exc})",
                hint="move the file away (it was left untouched) or set MLENG_HOME to another directory",
            ) from exc
        self._conn = conn
        return conn

    def _refuse_if_not_ours_before_open(self) -> None:
        blocking = next((p for p in self.path.parents if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise StoreError(f"results store folder {self.path.parent} cannot be used: {blocking} is a file, not a folder",
                             hint="set MLENG_HOME to a folder (it is created if missing), or --no-store")
        if not self.path.exists():
            return
        if self.path.is_dir():
            raise StoreError(f"results store path {self.path} is a directory",
                             hint="set MLENG_HOME to a directory where mleng may create results.sqlite")
        size = self.path.stat().st_size
        if size == 0:
            return
        with open(self.path, "rb") as f:
            header = f.read(len(SQLITE_HEADER))
        if header != SQLITE_HEADER:
            raise StoreError(
                f"results store {self.path} is not an SQLite database (corrupt or a foreign file)",
                hint="move the file away (it was left untouched) or set MLENG_HOME to another directory",
            )

    def _check_or_initialize(self, conn: sqlite3.Connection) -> None:
        app_id, user_version, tables = self._header(conn)
        if app_id == 0:
            # Read again under the write lock: another process may be initializing it right now, and reads made
            # outside one transaction can straddle its commit (an id of 0 next to its new table).
            conn.execute("BEGIN IMMEDIATE")
            try:
                app_id, user_version, tables = self._header(conn)
                if app_id == 0 and not tables:
                    for statement in _DDL.split(";"):
                        if statement.strip():
                            conn.execute(statement)
                    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                    conn.execute("COMMIT")
                    conn.execute("PRAGMA journal_mode = WAL")
                    return
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        if app_id != APPLICATION_ID:
            raise StoreError(
                f"results store {self.path} is an SQLite database that mleng did not create "
                f"(application_id {app_id:#x}, tables: {', '.join(tables) or 'none'})",
                hint="left untouched; move it away or set MLENG_HOME to another directory",
            )
        if user_version > SCHEMA_VERSION:
            raise StoreError(
                f"results store {self.path} was written by a newer mleng (store version {user_version}, "
                f"this mleng knows {SCHEMA_VERSION})",
                hint="upgrade mleng to read it, or set MLENG_HOME to another directory",
            )
        integrity = conn.execute("PRAGMA quick_check").fetchone()[0]
        if integrity != "ok":
            raise StoreError(f"results store {self.path} is corrupt: {integrity}",
                             hint="left untouched; move it away or set MLENG_HOME to another directory")
        conn.execute("PRAGMA journal_mode = WAL")

    @staticmethod
    def _header(conn: sqlite3.Connection) -> tuple[int, int, list[str]]:
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        user_version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return app_id, user_version, tables

    # -- writes -------------------------------------------------------------------------------
    def save(self, measurement: Measurement | dict[str, Any]) -> str:
        record = measurement.to_dict() if isinstance(measurement, Measurement) else dict(measurement)
        check_schema(record)
        m = Measurement.from_dict(record)
        conn = self.connect()
        values = (m.id, m.kind, m.status, m.started_at, m.host, m.schema,
                  json.dumps(m.summary, default=str), json.dumps(record, default=str))
        with self._write(conn):
            conn.execute(
                "INSERT OR REPLACE INTO measurements (id, kind, status, started_at, host, schema, summary, record)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)", values)
            if m.kind == "doctor":
                self._index_gpu_findings(conn, record)
        return m.id

    def _has_gpu_findings(self, conn: sqlite3.Connection) -> bool:
        return conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='gpu_findings'").fetchone() \
            is not None

    def _index_gpu_findings(self, conn: sqlite3.Connection, record: dict[str, Any]) -> None:
        """Inside save()'s transaction: this doctor run's findings per GPU UUID (the table made, and filled from
        the stored doctor records, the first time)."""
        if not self._has_gpu_findings(conn):
            for statement in _GPU_FINDINGS_DDL.split(";"):
                if statement.strip():
                    conn.execute(statement)
            for (text,) in conn.execute("SELECT record FROM measurements WHERE kind = 'doctor'").fetchall():
                try:
                    self._insert_gpu_findings(conn, json.loads(text))
                except (ValueError, TypeError, AttributeError):
                    continue  # a record this mleng cannot read has no findings to index
            return
        self._insert_gpu_findings(conn, record)

    @staticmethod
    def _insert_gpu_findings(conn: sqlite3.Connection, record: dict[str, Any]) -> None:
        conn.execute("DELETE FROM gpu_findings WHERE measurement_id = ?", (record.get("id"),))
        rows = gpu_findings_of(record)
        conn.executemany(
            "INSERT OR REPLACE INTO gpu_findings (measurement_id, gpu_uuid, started_at, host, gpu_index, check_name,"
            " severity) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(record.get("id"), uuid, record.get("started_at") or "", _record_host(record), index, check, severity)
             for (uuid, check), (index, severity) in rows.items()])

    def gpu_history(self, uuids: list[str], limit_runs: int = 5, exclude_id: str | None = None
                    ) -> dict[str, list[dict[str, Any]]]:
        """Per GPU UUID, its last doctor runs (newest first): {measurement_id, started_at, host, gpu_index,
        checks: {check: severity}}. Empty for a store that does not exist or has no doctor run yet."""
        if not self.path.exists() or not uuids:
            return {}
        conn = self.connect()
        if not self._has_gpu_findings(conn):
            # A store from before the index: read the doctor records directly (what save() would index).
            runs: dict[str, dict[str, dict[str, Any]]] = {}
            for (text,) in conn.execute("SELECT record FROM measurements WHERE kind = 'doctor' "
                                        "ORDER BY started_at DESC, rowid DESC").fetchall():
                try:
                    record = json.loads(text)
                except ValueError:
                    continue
                for (uuid, check), (index, severity) in gpu_findings_of(record).items():
                    if uuid in uuids and record.get("id") != exclude_id:
                        run = runs.setdefault(uuid, {}).setdefault(record["id"], {
                            "measurement_id": record["id"], "started_at": record.get("started_at"),
                            "host": _record_host(record), "gpu_index": index, "checks": {}})
                        run["checks"][check] = severity
            # dicts keep the newest-first order of the query; sorted() is stable, so same-second runs keep it
            return {uuid: sorted(r.values(), key=lambda r: r["started_at"] or "", reverse=True)[:limit_runs]
                    for uuid, r in runs.items()}
        out: dict[str, list[dict[str, Any]]] = {}
        for uuid in uuids:
            # runs in the same second (scripts, tests) keep the order they were stored in
            ids = conn.execute("SELECT g.measurement_id, g.started_at, g.host, MIN(g.gpu_index) FROM gpu_findings g "
                               "JOIN measurements m ON m.id = g.measurement_id "
                               "WHERE g.gpu_uuid = ? AND g.measurement_id != ? GROUP BY g.measurement_id "
                               "ORDER BY g.started_at DESC, MAX(m.rowid) DESC LIMIT ?",
                               (uuid, exclude_id or "", int(limit_runs))).fetchall()
            runs_list = []
            for measurement_id, started_at, host, index in ids:
                checks: dict[str, str] = {}
                for check, severity in conn.execute("SELECT check_name, severity FROM gpu_findings WHERE gpu_uuid = ? "
                                                    "AND measurement_id = ?", (uuid, measurement_id)).fetchall():
                    # an index row of a doctor run made before the findings' renames: read under the new name
                    check = current_check(check)
                    if check not in checks or _SEVERITY_ORDER.get(severity, 9) < _SEVERITY_ORDER.get(checks[check], 9):
                        checks[check] = severity
                runs_list.append({"measurement_id": measurement_id, "started_at": started_at, "host": host,
                                  "gpu_index": index, "checks": checks})
            if runs_list:
                out[uuid] = runs_list
        return out

    @contextlib.contextmanager
    def _write(self, conn: sqlite3.Connection):
        """One write transaction; SQLite's own errors (read-only file, disk full) become a StoreError."""
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreError(f"results store {self.path} cannot be written: {exc}",
                             hint="fix the file's permissions, set MLENG_HOME to a writable folder, "
                                  "or pass --no-store") from None

    def check_writable(self) -> None:
        """Open (creating if needed) and take the write lock once: a long run learns at its start, not its end."""
        conn = self.connect()
        with self._write(conn):
            pass

    def delete(self, measurement_id: str) -> None:
        full_id = self.resolve_id(measurement_id)
        conn = self.connect()
        with self._write(conn):
            conn.execute("DELETE FROM measurements WHERE id = ?", (full_id,))
            if self._has_gpu_findings(conn):
                conn.execute("DELETE FROM gpu_findings WHERE measurement_id = ?", (full_id,))

    # -- reads --------------------------------------------------------------------------------
    def list(self, kind: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        conn = self.connect()
        sql = "SELECT id, kind, status, started_at, host, summary, schema FROM measurements"
        args: list[Any] = []
        if kind:
            kinds = stored_kinds(kind)
            sql += f" WHERE kind IN ({', '.join('?' * len(kinds))})"
            args.extend(kinds)
        sql += " ORDER BY started_at DESC, id DESC"
        if limit:
            sql += " LIMIT ?"
            args.append(int(limit))
        rows = []
        for id_, kind_, status, started_at, host, summary, schema in conn.execute(sql, args):  # noqa: B007
            summary = upgrade({"schema": schema, "kind": kind_, "summary": json.loads(summary)})["summary"]
            rows.append({"id": id_, "kind": current_kind(kind_), "status": status, "started_at": started_at,
                         "host": host, "summary": summary})
        return rows

    def resolve_id(self, measurement_id: str) -> str:
        """Accept a full id or a unique prefix, or 'last' for the newest."""
        if not measurement_id.strip():
            raise UsageError("the run id is empty", hint="`mleng results list` shows the stored ids; 'last' is the newest")
        conn = self.connect()
        if measurement_id == "last":
            row = conn.execute("SELECT id FROM measurements ORDER BY started_at DESC, id DESC LIMIT 1").fetchone()
            if row is None:
                raise UsageError("no measurements stored yet", hint="run a benchmark first, e.g. `mleng mamf`")
            return row[0]
        matches = [r[0] for r in conn.execute(
            "SELECT id FROM measurements WHERE id = ? OR id LIKE ? ESCAPE '\\' LIMIT 5",
            (measurement_id, _like_prefix(measurement_id)))]
        if measurement_id in matches:
            return measurement_id
        if not matches:
            raise UsageError(f"no measurement with id {measurement_id!r}",
                             hint="`mleng results list` shows the stored ids")
        if len(matches) > 1:
            raise UsageError(f"id prefix {measurement_id!r} is ambiguous: {', '.join(matches)}",
                             hint="give more of the id")
        return matches[0]

    def get(self, measurement_id: str) -> Measurement:
        full_id = self.resolve_id(measurement_id)
        (record,) = self.connect().execute("SELECT record FROM measurements WHERE id = ?", (full_id,)).fetchone()
        return Measurement.from_dict(json.loads(record))

    def iter_records(self, kind: str | None = None) -> Iterator[Measurement]:
        for row in self.list(kind=kind):
            yield self.get(row["id"])


def _record_host(record: dict[str, Any]) -> str:
    return str(((record.get("machine") or {}).get("host") or {}).get("hostname") or record.get("host") or "")


def gpu_findings_of(record: dict[str, Any]) -> dict[tuple[str, str], tuple[int | None, str]]:
    """{(GPU UUID, check): (GPU index, worst severity)} of one doctor record's rows.

    Rows carry gpu_uuid since mleng learned it; older rows name the GPU only as 'gpu N (...)', which the
    record's own fingerprint maps to its UUID.
    """
    devices = ((record.get("machine") or {}).get("gpus") or {}).get("devices") or []
    by_index = {d.get("index"): d.get("uuid") for d in devices if isinstance(d, dict) and d.get("uuid")}
    out: dict[tuple[str, str], tuple[int | None, str]] = {}
    for row in record.get("rows") or []:
        if not isinstance(row, dict) or not row.get("check") or row.get("severity") not in _SEVERITY_ORDER:
            continue
        uuid, index = row.get("gpu_uuid"), None
        subject = str(row.get("subject") or "")
        if subject.startswith("gpu ") and subject.split(" ")[1].isdigit():
            index = int(subject.split(" ")[1])
            uuid = uuid or by_index.get(index)
        if not uuid:
            continue
        key = (uuid, current_check(row["check"]))
        previous = out.get(key)
        if previous is None or _SEVERITY_ORDER[row["severity"]] < _SEVERITY_ORDER[previous[1]]:
            out[key] = (index, row["severity"])
    return out


def _like_prefix(prefix: str) -> str:
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "%"


def save_measurement(measurement: Measurement, store_path: str | os.PathLike | None = None) -> str:
    """Save one record in the default (or given) store; the usual call at the end of a run."""
    with Store(store_path) as store:
        return store.save(measurement)


def save_or_reason(measurement: Measurement) -> tuple[str | None, str | None]:
    """(id, None) or (None, why not): a store problem at the end of a run never hides the measurement."""
    try:
        return save_measurement(measurement), None
    except MlengError as exc:
        return None, exc.message


def check_store_writable(store_path: str | os.PathLike | None = None) -> None:
    """Before a long run: StoreError now, rather than a finished measurement with nowhere to go.
    A store that does not exist yet is not created here (a run refused later leaves nothing behind):
    the nearest existing folder on its path must take a new file."""
    store = Store(store_path)
    if store.path.exists():
        with store:
            store.check_writable()
        return
    store._refuse_if_not_ours_before_open()
    ancestor = next(p for p in store.path.parents if p.exists())
    try:
        fd, probe = tempfile.mkstemp(prefix=".mleng-write-probe-", dir=ancestor)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StoreError(f"results store {store.path} cannot be created: {ancestor} is not writable "
                         f"({exc.strerror or exc})",
                         hint="set MLENG_HOME to a folder you can write to, or pass --no-store") from None


def kinds_stored(store: "Store") -> dict[str, int]:
    if not store.exists:
        return {}
    counts: dict[str, int] = {}
    for kind, n in store.connect().execute("SELECT kind, COUNT(*) FROM measurements GROUP BY kind").fetchall():
        counts[current_kind(kind)] = counts.get(current_kind(kind), 0) + n
    return counts
