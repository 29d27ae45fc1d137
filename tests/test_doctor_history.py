"""GPU history: findings carry the GPU's UUID into the store, and a later run says how often that card failed."""

import json
import sqlite3
from pathlib import Path

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
