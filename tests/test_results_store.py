"""The results store: round trips, concurrent writers, refusal of corrupt, foreign and newer files."""

import json
import multiprocessing
import sqlite3

import pytest

from mleng.errors import StoreError, UsageError
from mleng.results.record import SCHEMA, Measurement
from mleng.results.store import Store, default_store_path


def _measurement(value: float, kind: str = "mamf") -> Measurement:
    m = Measurement.start(kind, params={"dtype": "float32"}, machine={"host": {"hostname": "node1"}})
    m.rows = [{"m": 256, "n": 256, "k": 256, "tflops_median": value}]
    m.summary = {"value": value, "unit": "TFLOPS", "theoretical": 10.0, "ratio": value / 10.0}
    return m.finish()


def test_round_trip_keeps_every_field(mleng_home):
    m = _measurement(1.5)
    with Store() as store:
        store.save(m)
        back = store.get(m.id)
    assert back.to_dict() == m.to_dict()
    assert default_store_path().parent == mleng_home
    assert back.schema == SCHEMA


def test_prefix_and_last_resolve(mleng_home):
    first, second = _measurement(1.0), _measurement(2.0)
    second.started_at = "2099-01-01T00:00:00+00:00"
    with Store() as store:
        store.save(first)
        store.save(second)
        assert store.resolve_id("last") == second.id
        assert store.get(first.id[:-1]).id == first.id
        with pytest.raises(UsageError, match="no measurement"):
            store.get("nope")


def _write_many(path: str, worker: int, count: int) -> None:
    with Store(path) as store:
        for i in range(count):
            m = _measurement(float(worker * 1000 + i))
            m.id = f"w{worker}-{i}"
            store.save(m)


def test_two_processes_writing_at_once_both_land(tmp_path):
    path = str(tmp_path / "results.sqlite")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(path, w, 40)) for w in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with Store(path) as store:
        ids = {r["id"] for r in store.list(limit=1000)}
    assert ids == {f"w{w}-{i}" for w in (1, 2) for i in range(40)}


def test_corrupt_file_is_reported_and_left_untouched(tmp_path):
    path = tmp_path / "results.sqlite"
    garbage = b"this is not a database\x00" * 100
    path.write_bytes(garbage)
    with pytest.raises(StoreError) as info:
        Store(path).connect()
    assert str(path) in str(info.value)
    assert path.read_bytes() == garbage


def test_damaged_sqlite_pages_are_reported_and_left_untouched(tmp_path):
    path = tmp_path / "results.sqlite"
    with Store(path) as store:
        for i in range(50):
            store.save(_measurement(float(i)))
    raw = bytearray(path.read_bytes())
    raw[4096:] = b"\xff" * (len(raw) - 4096)  # keep the header page, destroy the rest
    path.write_bytes(bytes(raw))
    before = path.read_bytes()
    with pytest.raises(StoreError):
        with Store(path) as store:
            store.list()
    assert path.read_bytes() == before


def test_foreign_sqlite_file_is_refused(tmp_path):
    path = tmp_path / "results.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE customers (name TEXT)")
    conn.execute("INSERT INTO customers VALUES ('alice')")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="did not create"):
        Store(path).connect()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT name FROM customers").fetchall() == [("alice",)]


def test_newer_record_schema_is_refused(mleng_home):
    record = _measurement(1.0).to_dict()
    record["schema"] = "mleng.measurement/7"
    with Store() as store:
        with pytest.raises(StoreError, match="newer"):
            store.save(record)


def test_newer_store_version_is_refused(tmp_path):
    path = tmp_path / "results.sqlite"
    with Store(path) as store:
        store.save(_measurement(1.0))
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="newer mleng"):
        Store(path).connect()


def test_not_our_record_is_refused():
    with pytest.raises(UsageError, match="not an mleng measurement"):
        Measurement.from_dict({"schema": "something/1", "id": "x", "kind": "y", "status": "complete"})


def test_cli_list_show_export_delete(run_mleng, mleng_home):
    m = _measurement(3.25)
    with Store() as store:
        store.save(m)
    listed = run_mleng("results", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [r["id"] for r in json.loads(listed.stdout)["results"]] == [m.id]
    shown = run_mleng("results", "show", m.id, "--json")
    assert json.loads(shown.stdout)["summary"]["value"] == 3.25
    human = run_mleng("results", "show", m.id)
    assert "3.25" in human.stdout and "tflops_median" in human.stdout
    csv_out = run_mleng("results", "export", m.id, "--format", "csv")
    assert csv_out.stdout.splitlines()[0] == "m,n,k,tflops_median"
    deleted = run_mleng("results", "delete", m.id)
    assert deleted.returncode == 0
    assert json.loads(run_mleng("results", "list", "--json").stdout)["results"] == []


def test_cli_corrupt_store_gives_one_message_and_exit_2(run_mleng, mleng_home):
    mleng_home.mkdir(parents=True)
    (mleng_home / "results.sqlite").write_text("garbage, not sqlite")
    result = run_mleng("results", "list")
    assert result.returncode == 2
    assert "not an SQLite database" in result.stderr
    assert "Traceback" not in result.stderr
    assert (mleng_home / "results.sqlite").read_text() == "garbage, not sqlite"


def test_cli_compare_gives_ratio_per_row(run_mleng):
    a, b = _measurement(2.0), _measurement(3.0)
    with Store() as store:
        store.save(a)
        store.save(b)
    result = run_mleng("results", "compare", a.id, b.id, "--json")
    assert result.returncode == 0, result.stderr
    comparison = json.loads(result.stdout)
    assert comparison["summary_ratio"] == pytest.approx(1.5)
    assert comparison["rows"][0]["tflops_median_ratio"] == pytest.approx(1.5)


def test_records_of_schema_1_in_a_store_are_listed_shown_and_compared_in_schema_2_names(run_mleng):
    old = []
    for value in (700.0, 770.0):
        record = _measurement(value).to_dict()
        record["schema"] = "mleng.measurement/1"
        record["summary"]["spec_note"] = "h200-sxm (NVIDIA H200 SXM 141GB), dense bf16"
        record["summary"]["gpu_monitor"] = {"sm_clock_mean_mhz": 1800.0}
        record["rows"][0]["power_mean_w"] = 650.0
        old.append(record)
    with Store() as store:
        for record in old:
            store.save(record)
    listed = json.loads(run_mleng("results", "list", "--json").stdout)["results"]
    assert {r["summary"]["theoretical_source"] for r in listed} == {"h200-sxm (NVIDIA H200 SXM 141GB), dense bf16"}
    shown = run_mleng("results", "show", old[0]["id"], "--json")
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert record["schema"] == SCHEMA == "mleng.measurement/2"
    assert "spec_note" not in record["summary"] and record["summary"]["gpu_monitor"] == {"sm_clock_mhz_mean": 1800.0}
    assert record["rows"][0]["power_w_mean"] == 650.0
    compared = run_mleng("results", "compare", old[0]["id"], old[1]["id"], "--json")
    assert compared.returncode == 0, compared.stderr
    assert json.loads(compared.stdout)["summary_ratio"] == pytest.approx(1.1)


def test_schema_file_lists_every_record_field():
    from importlib import resources

    schema = json.loads(resources.files("mleng.results").joinpath("measurement.schema.json").read_text())
    assert set(schema["required"]) == set(_measurement(1.0).to_dict())


def test_records_of_former_kinds_are_read_as_the_commands_names(run_mleng):
    """Kinds are the commands' names; a store of an earlier mleng holds collective, connectivity and storage."""
    from mleng.results.store import kinds_stored

    old = {command: _measurement(1.0, kind=former).to_dict()
           for former, command in (("collective", "comm"), ("connectivity", "check"), ("storage", "io"))}
    with Store() as store:
        for record in old.values():
            store.save(record)
    with sqlite3.connect(default_store_path()) as conn:  # as an earlier version wrote them
        for former, command in (("collective", "comm"), ("connectivity", "check"), ("storage", "io")):
            conn.execute("UPDATE measurements SET kind = ? WHERE id = ?", (former, old[command]["id"]))
    with Store() as store:
        assert [r["id"] for r in store.list(kind="comm")] == [old["comm"]["id"]]
        assert [r["kind"] for r in store.list(kind="collective")] == ["comm"]
        assert store.get(old["io"]["id"]).kind == "io"
        assert kinds_stored(store) == {"comm": 1, "check": 1, "io": 1}
    listed = json.loads(run_mleng("results", "list", "--kind", "check", "--json").stdout)["results"]
    assert [(r["id"], r["kind"]) for r in listed] == [(old["check"]["id"], "check")]
