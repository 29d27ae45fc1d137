"""`mleng mamf` as users run it: real subprocesses, the real results store, real CPU matmuls."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mleng.results.store import Store


def assert_clean_usage_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("mleng mamf: error:")
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def stored(mleng_home):
    path = mleng_home / "results.sqlite"
    if not path.exists():
        return []
    with Store(path) as store:
        return [store.get(row["id"]) for row in store.list(kind="mamf")]


@pytest.mark.parametrize("args, fragment", [
    (["--m", "0", "--n", "256", "--k", "256"], "must be positive"),
    (["--m", "-256", "--n", "256", "--k", "256"], "must be positive"),
    (["--grid", "0:1024:256"], "must be positive"),
    (["--grid", "1024:512:256"], "below START"),
    (["--m", "256", "--n", "256"], "not for K"),
    (["--m", "256", "--m-range", "256:512:256", "--n", "1", "--k", "1"], "either --m or --m-range"),
    (["--max-seconds", "0"], "--max-seconds must be positive"),
])
def test_bad_shapes_and_arguments_are_refused(run_mleng, mleng_home, args, fragment):
    proc = run_mleng("mamf", "--device", "cpu", *args)
    assert_clean_usage_error(proc, fragment)
    assert stored(mleng_home) == []


def test_shape_too_large_for_memory_is_refused_before_allocating(run_mleng, mleng_home):
    proc = run_mleng("mamf", "--device", "cpu", "--m", "300000", "--n", "300000", "--k", "300000")
    assert_clean_usage_error(proc, "300000x300000x300000", "GiB", "free")
    assert stored(mleng_home) == []


@pytest.mark.parametrize("args, fragment", [
    (["--dtype", "int4"], "unknown dtype"),
    (["--dtype", "float8_e4m3fn"], "needs a CUDA or ROCm GPU"),
    (["--all-devices"], "--all-devices needs GPUs"),
    (["--device", "cuda:0"], "CUDA is not available"),
    (["--device", "3"], "no GPU is visible"),
])
def test_unsupported_dtype_and_device_are_refused(run_mleng, args, fragment):
    device = [] if any(a.startswith("--device") or a == "--all-devices" for a in args) else ["--device", "cpu"]
    proc = run_mleng("mamf", *device, *args)
    assert_clean_usage_error(proc, fragment)


def test_small_cpu_search_end_to_end(run_mleng, mleng_home):
    started = time.monotonic()
    proc = run_mleng("mamf", "--device", "cpu", "--max-dim", "512", "--max-seconds", "15", "--json")
    assert time.monotonic() - started < 20
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["kind"] == "mamf" and record["status"] == "complete"
    summary = record["summary"]
    assert summary["unit"] == "TFLOPS" and summary["value"] > 0
    assert summary["dtype"] == "float32" and summary["search"] == "adaptive"
    assert summary["best_phase"] == "final" and summary["iters"] >= 20
    assert summary["shapes_tried"] == len({(r["m"], r["n"], r["k"]) for r in record["rows"]})
    assert summary["theoretical"] is None and summary["theoretical_source"]
    rows = record["rows"]
    assert {"coarse", "final"} <= {r["phase"] for r in rows}
    for row in rows:
        assert max(row["m"], row["n"], row["k"]) <= 512
        assert row["tflops_mean"] <= row["tflops_max"] and row["iters"] >= 1
    best_final = max(r["tflops_median"] for r in rows if r["phase"] == "final")
    assert summary["tflops_median"] == best_final
    saved = stored(mleng_home)
    assert [m.id for m in saved] == [record["id"]]


def test_exact_shapes_human_output(run_mleng, mleng_home):
    proc = run_mleng("mamf", "--device", "cpu", "--m", "256", "--n", "256", "--k", "128", "256", "--iters", "12")
    assert proc.returncode == 0, proc.stderr
    assert "best shape" in proc.stdout and "TFLOPS" in proc.stdout and "stored as mamf-" in proc.stdout
    (record,) = stored(mleng_home)
    finals = [r for r in record.rows if r["phase"] == "final"]
    assert sorted((r["m"], r["n"], r["k"]) for r in finals) == [(256, 256, 128), (256, 256, 256)]
    assert all(r["iters"] == 12 for r in finals)


def test_no_store_stores_nothing(run_mleng, mleng_home):
    proc = run_mleng("mamf", "--device", "cpu", "--m", "128", "--n", "128", "--k", "128", "--no-store", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status"] == "complete"
    assert stored(mleng_home) == []


def test_ctrl_c_keeps_the_best_so_far(mleng_home):
    env = dict(os.environ, MLENG_HOME=str(mleng_home))
    proc = subprocess.Popen([sys.executable, "-m", "mleng", "mamf", "--device", "cpu", "--max-dim", "1024",
                             "--max-seconds", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first_line = proc.stderr.readline()  # printed once measuring starts
        assert "adaptive search" in first_line, first_line
        time.sleep(2.0)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr
    assert "interrupted" in stdout and "best shape" in stdout
    (record,) = stored(mleng_home)
    assert record.status == "interrupted"
    assert record.rows and record.summary["value"] > 0
    assert record.summary["stop_reason"] == "interrupted"


def test_all_devices_combines_one_run_per_device_process(mleng_home):
    # --all-devices asks for GPUs; its engine measures any device list, here the CPU twice at once.
    from mleng.measure.matmul import MamfOptions, Shape, run_all_devices

    options = MamfOptions(shapes=[Shape(256, 256, 256), Shape(256, 256, 512)], iters=5, max_seconds=60, seeds=False)
    record = run_all_devices(options, ["cpu", "cpu"])
    assert record.status == "complete" and record.params["devices"] == 2, record.error
    assert record.params["options"]["shapes"] == 2 and record.params["options"]["device"] is None
    s = record.summary
    assert [d["device"] for d in s["per_device"]] == [0, 1]
    assert all(d["status"] == "complete" and d["tflops_median"] > 0 for d in s["per_device"])
    assert {r["device"] for r in record.rows} == {0, 1}
    slowest = min(s["per_device"], key=lambda d: d["tflops_median"])
    assert (s["slowest_device"], s["value"]) == (slowest["device"], slowest["tflops_median"])
    assert s["errors"] == [] and s["headline"] == "slowest GPU's best median" and s["spread_pct"] >= 0
    assert stored(mleng_home) == []  # the children store nothing; the CLI stores the combined record


def test_cpu_bf16_above_512_only_where_the_cpu_has_bf16_instructions(run_mleng):
    from mleng.measure.matmul import cpu_has_native

    proc = run_mleng("mamf", "--device", "cpu", "--dtype", "bf16", "--m", "1024", "--n", "1024", "--k", "1024",
                     "--iters", "3", "--no-store", "--json")
    if cpu_has_native("bfloat16"):
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["summary"]["dtype"] == "bfloat16"
    else:
        assert_clean_usage_error(proc, "no native bfloat16", "--dtype float32")


def test_cpu_bf16_at_small_shapes_runs(run_mleng):
    proc = run_mleng("mamf", "--device", "cpu", "--dtype", "bfloat16", "--m", "128", "--n", "128", "--k", "128",
                     "--iters", "3", "--no-store", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)["summary"]
    assert summary["dtype"] == "bfloat16" and summary["best_shape"] == "128x128x128"
