"""mleng membw on the CPU: real torch kernels, real subprocesses, the real results store."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mleng.measure import membw

SMALL = "64MiB"


def test_cpu_membw_measures_copy_read_write_and_stores_it(run_mleng):
    result = run_mleng("membw", "--size", SMALL, "--iters", "3", "--warmup", "1", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["kind"] == "membw" and record["status"] == "complete"
    rows = {r["test"]: r for r in record["rows"]}
    assert set(rows) == {"copy", "read", "write"}
    size = 64 * 2**20
    assert rows["copy"]["bytes_moved"] == 2 * size  # read + written
    assert rows["read"]["bytes_moved"] == size
    for row in rows.values():
        assert row["device"] == "cpu" and row["iters"] == 3
        assert row["gbps_min"] <= row["gbps"] <= row["gbps_max"]
        assert row["gbps"] > 0.1
        assert abs(row["bytes_moved"] / (row["time_us"] / 1e6) / 1e9 - row["gbps"]) < 1e-6 * row["gbps"]
    assert record["params"]["threads"] >= 1
    assert record["summary"]["value"] == pytest.approx(rows["copy"]["gbps"])
    assert record["summary"]["theoretical"] is None  # no datasheet for a CPU's DIMMs: no made-up ratio
    listed = json.loads(run_mleng("results", "list", "--kind", "membw", "--json").stdout)
    assert [r["id"] for r in listed["results"]] == [record["id"]]


def test_human_output_names_units(run_mleng):
    result = run_mleng("membw", "--size", SMALL, "--iters", "2", "--warmup", "0", "--op", "copy", "--no-store",
                       "--device", "cpu")  # --device as mamf reads it: N, cuda:N or cpu
    assert result.returncode == 0, result.stderr
    assert "GB/s" in result.stdout and "copy" in result.stdout
    assert "bytes read + written" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--size", "0"], "more than 0 bytes"),
    (["--size", "12XB"], "is not a size"),
    (["--size", "100KiB"], "too small"),
    (["--size", SMALL, "--tests", "copy,bogus"], "unknown test"),
    (["--size", SMALL, "--op", "h2d"], "need a CUDA GPU"),
    (["--size", SMALL, "--device", "0"], "no CUDA GPU"),
    (["--size", SMALL, "--all-devices"], "needs CUDA GPUs"),
    (["--size", SMALL, "--iters", "0"], "--iters"),
])
def test_bad_input_is_one_clear_message(run_mleng, args, message):
    result = run_mleng("membw", *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2
    assert "no results" in run_mleng("results", "list").stdout


def test_concurrent_workers_run_in_separate_processes():
    streamed = []
    rows, status, error = membw.measure_devices(["cpu", "cpu"], on_row=streamed.append, size_bytes=16 * 2**20,
                                                tests=["copy", "write"], engines=["torch"], iters=2, warmup=0,
                                                threads=1)
    assert (status, error) == ("complete", None) and streamed == rows
    by_worker = {}
    for row in rows:
        by_worker.setdefault(row["worker"], []).append(row["test"])
    assert sorted(by_worker) == [0, 1]
    assert all(sorted(tests) == ["copy", "write"] for tests in by_worker.values())


def test_theory_ratios_and_headline_prefer_random_data():
    rows = [
        {"device": "cuda:0", "test": "copy", "engine": "torch", "gbps": 4300.0},
        {"device": "cuda:0", "test": "copy", "engine": "triton", "gbps": 4200.0},
        {"device": "cuda:0", "test": "write", "engine": "torch", "gbps": 4680.0, "constant_data": True},
        {"device": "cuda:0", "test": "write", "engine": "triton", "gbps": 4500.0, "constant_data": False},
        {"device": "cuda:0", "test": "h2d", "engine": "torch", "host_memory": "pinned", "gbps": 55.0},
    ]
    context = {"cuda:0": {"name": "NVIDIA H200", "hbm_gbps": 4800.0, "hbm_source": "test",
                          "pcie": {"theoretical_gbps": 63.0}}}
    membw.add_theory(rows, context)
    assert rows[0]["ratio"] == pytest.approx(4300 / 4800)
    assert rows[4]["ratio"] == pytest.approx(55 / 63)
    summary = membw.summarize(rows, context)
    assert summary["value"] == 4300.0 and summary["ratio"] == pytest.approx(4300 / 4800)
    assert summary["write_gbps"] == 4500.0  # the constant fill is not the headline
    assert summary["per_device"]["cuda:0"]["copy_engine"] == "torch"
    assert summary["h2d_pinned_gbps"] == 55.0


def test_pcie_reference_without_link_data_says_why():
    value, reason = membw.pcie_theoretical_gbps(None, 16)
    assert value is None and "NVML" in reason


def test_ctrl_c_keeps_rows_measured_so_far(mleng_home):
    env = dict(os.environ, MLENG_HOME=str(mleng_home))
    proc = subprocess.Popen([sys.executable, "-m", "mleng", "membw", "--size", "256MiB", "--iters", "400",
                             "--warmup", "0", "--op", "write", "--op", "copy"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()  # printed when the first test (write) is done
        assert "write" in line, line
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stdout
    listed = subprocess.run([sys.executable, "-m", "mleng", "results", "list", "--json"], env=env,
                            capture_output=True, text=True)
    results = json.loads(listed.stdout)["results"]
    assert len(results) == 1 and results[0]["status"] == "interrupted"
    shown = json.loads(subprocess.run([sys.executable, "-m", "mleng", "results", "show", results[0]["id"], "--json"],
                                      env=env, capture_output=True, text=True).stdout)
    assert [r["test"] for r in shown["rows"]] == ["write"]
