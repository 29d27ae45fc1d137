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


def test_all_devices_ctrl_c_keeps_each_gpus_best_shape(mleng_home, torch_cuda):
    """SIGINT to the parent mid-run: the fan-out stops every GPU's process, each hands back its best shape so
    far, the record is 'interrupted' and the exit code 130."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = dict(os.environ, MLENG_HOME=str(mleng_home))
    proc = subprocess.Popen([sys.executable, "-m", "mleng", "mamf", "--all-devices", "--max-seconds", "120", "--json",
                             "--no-store"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(25)  # past the children's start-up (spawn, torch import, CUDA context) into the shape search
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 130, stderr
    record = json.loads(stdout)
    assert record["status"] == "interrupted", record["error"]
    per_device = record["summary"]["per_device"]
    assert len(per_device) == torch_cuda.cuda.device_count()
    assert all(d["tflops_median"] and d["tflops_median"] > 0 for d in per_device), per_device
