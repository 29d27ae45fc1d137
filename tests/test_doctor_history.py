"""GPU history: findings carry the GPU's UUID into the store, and a later run says how often that card failed."""

import json
import sqlite3
from pathlib import Path

import pytest

from mleng.doctor.runner import run_doctor
from mleng.results.store import Store

FINGERPRINTS = Path(__file__).parent / "fixtures" / "fingerprints"
THROTTLED_UUID = "GPU-b7f8d116-4e4d-289b-6683-37dfd3264a11"  # gpu 5 of the modelled throttled node


def fingerprint(name: str) -> dict:
    data = json.loads((FINGERPRINTS / f"{name}.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def doctor(name: str):
    return run_doctor(measure=False, fingerprint=fingerprint(name), local=False)


def history_rows(record):
    return [r for r in record.rows if r["check"] == "gpu_history"]


def test_rows_carry_the_gpu_uuid():
    record = doctor("h200_throttled")
    clock = [r for r in record.rows if r["check"] == "sm_clock" and r["severity"] == "fail"]
    assert [r["gpu_uuid"] for r in clock] == [THROTTLED_UUID]
    assert all(r["gpu_uuid"] is None for r in record.rows if r["check"] in ("nccl_env", "dev_shm"))


def test_same_gpu_failing_again_is_named_with_its_count(mleng_home):
    first = doctor("h200_throttled")
    assert [r["severity"] for r in history_rows(first) if r["gpu_uuid"] == THROTTLED_UUID] == ["ok"]
    assert "the first failure on record" in history_rows(first)[0]["summary"]
    with Store() as store:
        store.save(first)
        store.save(doctor("h200_healthy"))   # same node, the card passed once
        store.save(doctor("h200_throttled"))
    now = doctor("h200_throttled")
    rows = history_rows(now)
    assert len(rows) == 1 and rows[0]["severity"] == "fail" and rows[0]["subject"] == "gpu 5 (NVIDIA H200)"
    assert f"{THROTTLED_UUID}: failed sm_clock on 3 of its last 4 run(s)" in rows[0]["summary"]
    assert rows[0]["measured"]["failures"] == {"sm_clock": 3} and "dcgm-diag-failures" in rows[0]["handbook"]


def test_intermittent_gpu_warns_and_a_clean_history_is_ok(mleng_home):
    with Store() as store:
        store.save(doctor("h200_throttled"))
    now = doctor("h200_healthy")
    rows = history_rows(now)
    assert [(r["severity"], r["subject"]) for r in rows] == [("warn", "gpu 5 (NVIDIA H200)")]
    assert "failed sm_clock on 1 of its last 2 run(s) (now ok)" in rows[0]["summary"]
    clean = history_rows(doctor("h200_pcie_downtrained"))  # the same node (same UUIDs) where gpu 2 now fails
    assert any(r["subject"] == "gpu 2 (NVIDIA H200)" and "first failure" in r["summary"] for r in clean)


def test_no_gpu_no_history_and_an_empty_store_says_so(mleng_home):
    assert history_rows(doctor("cpu_only")) == []
    rows = history_rows(doctor("h200_healthy"))
    assert [r["severity"] for r in rows] == ["ok"] and "no earlier doctor run" in rows[0]["summary"]
    assert not (mleng_home / "results.sqlite").exists()  # reading the history made no store


def test_the_index_is_built_from_records_of_a_store_that_predates_it(mleng_home):
    with Store() as store:
        store.save(doctor("h200_throttled"))
        store.save(doctor("h200_throttled"))
    conn = sqlite3.connect(mleng_home / "results.sqlite")
    conn.execute("DROP TABLE gpu_findings")   # as a store written before this table
    conn.commit()
    conn.close()
    rows = history_rows(doctor("h200_throttled"))  # read by scanning the records
    assert "failed sm_clock on 3 of its last 3 run(s)" in rows[0]["summary"]
    with Store() as store:
        store.save(doctor("h200_healthy"))  # the first save re-creates the index from all doctor records
        history = store.gpu_history([THROTTLED_UUID], limit_runs=5)[THROTTLED_UUID]
    assert [run["checks"]["sm_clock"] for run in history] == ["ok", "fail", "fail"]
    assert history[0]["host"] == "gpu-node-017" and history[0]["gpu_index"] == 5


def test_kernel_log_xids_are_not_counted_twice_across_runs(mleng_home):
    from mleng.doctor import history

    assert "xid" in history.NOT_COUNTED


def test_deleting_a_run_drops_its_gpu_findings(mleng_home):
    with Store() as store:
        run_id = store.save(doctor("h200_throttled"))
        store.delete(run_id)
        assert store.gpu_history([THROTTLED_UUID]) == {}


def _with_measured_findings(record, names: dict[str, str], tflops: float) -> dict:
    """A doctor record with its quick measurements' findings and ids under the given names (old or new)."""
    data = record.to_dict()
    data["rows"] = [
        {"check": names["mamf"], "severity": "fail", "summary": f"matmul (bfloat16): {tflops} TFLOPS", "measured": tflops,
         "expected": 989.0, "cause": None, "handbook": ["low-matmul-tflops"], "subject": None, "gpu_uuid": THROTTLED_UUID},
        {"check": names["comm"], "severity": "skipped", "summary": "one GPU: no link between GPUs to measure",
         "measured": None, "expected": None, "cause": None, "handbook": [], "subject": None, "gpu_uuid": None},
        {"check": names["io"], "severity": "warn", "summary": "/ckpt: checkpoint-style sequential write 0.14 GB/s",
         "measured": 0.14, "expected": None, "cause": None, "handbook": [], "subject": "/ckpt", "gpu_uuid": None},
        *data["rows"]]
    data["summary"]["measurements"] = {names[new]: f"{new}-{data['id']}" for new in ("mamf", "comm", "membw", "io")}
    return data


def test_doctor_runs_stored_with_the_former_finding_names_read_under_the_commands_names(run_mleng, mleng_home):
    """Before the findings were named after their commands a doctor run stored matmul, busbw (collective when
    skipped), checkpoint_write and summary["measurements"] keyed matmul/collective/membw/storage."""
    from mleng.doctor.findings import Finding
    from mleng.doctor.history import history_findings

    former = {"mamf": "matmul", "comm": "collective", "membw": "membw", "io": "storage"}
    old = _with_measured_findings(doctor("h200_throttled"), former, 550.0)
    old["rows"][2]["check"] = "checkpoint_write"
    old["summary"]["measurements"] = {"matmul": "m1", "collective": "c1", "membw": "b1", "storage": "s1"}
    busbw = {**old["rows"][1], "check": "busbw", "severity": "inconclusive"}
    old["rows"].insert(1, busbw)
    with Store() as store:
        store.save(old)
    with sqlite3.connect(mleng_home / "results.sqlite") as conn:   # as an earlier mleng wrote the row and index
        conn.execute("UPDATE measurements SET summary = ? WHERE id = ?", (json.dumps(old["summary"]), old["id"]))
        conn.execute("UPDATE gpu_findings SET check_name = 'matmul' WHERE measurement_id = ? AND check_name = 'mamf'",
                     (old["id"],))
        assert conn.execute("SELECT COUNT(*) FROM gpu_findings WHERE check_name = 'matmul'").fetchone()[0] == 1
    new = _with_measured_findings(doctor("h200_throttled"), {c: c for c in former}, 600.0)
    with Store() as store:
        store.save(new)
        history = store.gpu_history([THROTTLED_UUID], limit_runs=5)[THROTTLED_UUID]
    assert [run["checks"].get("mamf") for run in history] == ["fail", "fail"]
    assert not any("matmul" in run["checks"] for run in history)
    # the doctor's history line counts the old run's matmul failure as a mamf failure
    fp = fingerprint("h200_throttled")
    rows = history_findings([Finding("mamf", "fail", "matmul low", gpu_uuid=THROTTLED_UUID)], fp)
    assert "failed mamf on 3 of its last 3 run(s)" in rows[0].summary, rows[0].summary

    listed = json.loads(run_mleng("results", "list", "--kind", "doctor", "--json").stdout)["results"]
    assert [sorted(r["summary"]["measurements"]) for r in listed] == [["comm", "io", "mamf", "membw"]] * 2
    shown = run_mleng("results", "show", old["id"], "--json")
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    checks = [r["check"] for r in record["rows"]]
    assert checks[:4] == ["mamf", "comm", "comm", "io"]
    assert not {"matmul", "busbw", "collective", "checkpoint_write", "storage"} & set(checks)
    assert record["summary"]["measurements"] == {"mamf": "m1", "comm": "c1", "membw": "b1", "io": "s1"}
    text = run_mleng("results", "show", old["id"])
    assert text.returncode == 0 and "matmul (bfloat16)" in text.stdout and "checkpoint_write" not in text.stdout
    compared = run_mleng("results", "compare", old["id"], new["id"], "--json")
    assert compared.returncode == 0, compared.stderr
    by_check = {r["check"]: r for r in json.loads(compared.stdout)["rows"]}
    assert by_check["mamf"]["measured_ratio"] == pytest.approx(600.0 / 550.0)
    assert by_check["io"]["measured_ratio"] == pytest.approx(1.0)
