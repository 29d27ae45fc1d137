"""--all-devices on CUDA: `mleng mamf` and `mleng membw` run one process per GPU (mleng.measure.fanout)."""

import json

import pytest

pytestmark = pytest.mark.gpu


def test_all_devices_measures_every_gpu_once(run_mleng, torch_cuda):
    count = torch_cuda.cuda.device_count()
    result = run_mleng("mamf", "--all-devices", "--max-seconds", "5", "--json", "--no-store", timeout=180)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    s = record["summary"]
    assert record["status"] == "complete" and s["errors"] == [], record["error"]
    assert [d["device"] for d in s["per_device"]] == list(range(count))
    assert all(d["status"] == "complete" and d["tflops_median"] > 0 for d in s["per_device"]), s["per_device"]
    assert {r["device"] for r in record["rows"]} == set(range(count))
    assert s["value"] == min(d["tflops_median"] for d in s["per_device"])
    assert s["per_device"][s["slowest_device"]]["tflops_median"] == s["value"]

    result = run_mleng("membw", "--all-devices", "--size", "256MiB", "--op", "copy", "--iters", "5", "--warmup", "2",
                       "--json", "--no-store", timeout=180)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    s = record["summary"]
    devices = {f"cuda:{i}" for i in range(count)}
    assert record["status"] == "complete", record["error"]
    assert set(s["per_device"]) == devices and all(e["copy_gbps"] > 50 for e in s["per_device"].values())
    timed = [r for r in record["rows"] if "gbps" in r]
    assert {r["device"] for r in timed} == devices
    if count > 1:  # one process per GPU; a single GPU is measured in this process
        assert {r["worker"] for r in timed} == set(range(count))
