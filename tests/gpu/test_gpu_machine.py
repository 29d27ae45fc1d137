"""The GPU fields of rank info, NVML's device record and PCIe link, the NVML monitor, and `mleng env` / `mleng check`."""

import json
import re
import threading
import time

import pytest

pytestmark = pytest.mark.gpu


def _launch():
    from mleng.distributed.launch import detect

    return detect({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "29500"})


def test_rank_info_names_the_gpu_torch_uses(torch_cuda, nvml_gpu0, uuid0):
    from mleng.distributed.rankinfo import describe_rank
    from mleng.machine.nvml import sysfs_pci_address

    info = describe_rank(_launch(), "cuda:0")
    assert "gpu_error" not in info, info.get("gpu_error")
    assert info["gpu_name"] == torch_cuda.cuda.get_device_name(0)
    assert info["gpu_uuid"] == uuid0 == nvml_gpu0["uuid"]
    assert info["gpu_pci_bus_id"] == sysfs_pci_address(nvml_gpu0["pci_bus_id"])
    if info["gpu_numa_node"] is not None:
        assert info["gpu_numa_node"] >= 0
    assert info["device"] == "cuda:0" and info["cpu_affinity"]


def test_nvml_device_record_is_sane(torch_cuda, nvml_gpu0):
    from mleng.machine import nvml

    torch = torch_cuda
    d = nvml_gpu0
    props = torch.cuda.get_device_properties(0)
    assert d["name"] == torch.cuda.get_device_name(0)
    assert d["compute_capability"] == f"{props.major}.{props.minor}"
    assert d["memory_total_bytes"] >= props.total_memory * 0.95
    assert 0 <= d["memory_used_bytes"] <= d["memory_total_bytes"]
    assert 300 <= d["sm_clock_max_mhz"] <= 4000 and 0 < d["sm_clock_mhz"] <= d["sm_clock_max_mhz"] * 1.05
    assert 0 < d["mem_clock_mhz"] <= d["mem_clock_max_mhz"] * 1.05
    assert 5 <= d["temperature_c"] <= 100
    assert 0 < d["power_draw_w"] and 0 < d["power_limit_w"] <= 1500
    assert isinstance(d["throttle_reasons"], list) and d["throttle_reasons_mask"] is not None
    assert 0 <= d["utilization_gpu_pct"] <= 100
    assert d["driver"] and d["persistence_mode"] is not None
    # PCIe: the link's max and current generation and width, and the check that reads them.
    assert 1 <= d["pcie_gen_max"] <= 6 and d["pcie_width_max"] in (1, 2, 4, 8, 16, 32)
    assert 1 <= d["pcie_gen"] <= d["pcie_gen_max"] and 1 <= d["pcie_width"] <= d["pcie_width_max"]
    check = nvml.pcie_link_check(d["pcie_gen"], d["pcie_gen_max"], d["pcie_width"], d["pcie_width_max"])
    assert check["link_max"] == f"Gen{d['pcie_gen_max']} x{d['pcie_width_max']}"
    assert check["width_ok"] is (d["pcie_width"] >= d["pcie_width_max"])
    assert nvml.sysfs_pci_address(d["pci_bus_id"]) is not None


def _busy(torch, seconds):
    """bf16 matmuls back to back for `seconds`, so the clocks and the power draw move."""
    a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for _ in range(10):
            torch.mm(a, a, out=c)
        torch.cuda.synchronize()


def test_gpu_monitor_samples_the_same_card_under_load(torch_cuda, device, nvml_gpu0, uuid0):
    from mleng.measure.gpu_monitor import GpuMonitor

    torch = torch_cuda
    uuid = uuid0
    monitor = GpuMonitor(uuid=uuid, index=99, interval_s=0.05)  # the UUID wins; a wrong index is not used
    assert monitor.available, monitor.reason
    assert monitor.name == torch.cuda.get_device_name(0)
    assert monitor._nvml.nvmlDeviceGetUUID(monitor._handle) == uuid
    with monitor:
        _busy(torch, 1.5)
        assert isinstance(monitor.sm_clock_settled(window_s=0.5), bool)
    assert not any(t.name == "mleng-gpu-monitor" for t in threading.enumerate())
    s = monitor.summary()
    assert s["available"] and s["samples"] >= 10 and s["name"] == monitor.name
    assert s["sm_clock_max_mhz"] == nvml_gpu0["sm_clock_max_mhz"]
    clocks = s["sm_clock_mhz"]
    assert 0 < clocks["min"] <= clocks["mean"] <= clocks["max"] <= 1.05 * s["sm_clock_max_mhz"]
    assert clocks["max"] > 0.3 * s["sm_clock_max_mhz"], "a GPU busy with matmuls ran below a third of its max clock"
    assert 0 < s["power_w"]["max"] <= 1.2 * nvml_gpu0["power_limit_w"]
    assert 5 <= s["temperature_c"]["max"] <= 100 and s["mem_clock_mhz"]["mean"] > 0
    assert 0 < s["sm_clock_mean_fraction_of_max"] <= 1.05 and isinstance(s["below_max_clock"], bool)
    assert all(isinstance(m, int) for m in (x["throttle_mask"] for x in monitor.samples) if m is not None)
    times = [x["t_s"] for x in monitor.samples]
    assert times == sorted(times) and monitor.window(since_s=times[-1]) == monitor.samples[-1:]


def test_gpu_monitor_refuses_an_unknown_uuid_instead_of_sampling_another_gpu(torch_cuda, uuid0):
    from mleng.machine.nvml import torch_gpu_uuid
    from mleng.measure.gpu_monitor import GpuMonitor

    monitor = GpuMonitor(uuid="GPU-00000000-0000-0000-0000-000000000000", index=0)
    assert not monitor.available and "uuid GPU-00000000" in monitor.reason
    assert torch_gpu_uuid(0) == uuid0 and GpuMonitor(uuid=uuid0).available


def test_env_cli_reports_the_gpu(run_mleng, torch_cuda, nvml_gpu0):
    torch = torch_cuda
    result = run_mleng("env", "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    fp = json.loads(result.stdout)
    gpus, software = fp["gpus"], fp["software"]
    assert gpus["available"] and gpus["count"] >= torch.cuda.device_count() and gpus["reason"] is None
    assert gpus["driver"] and gpus["cuda_driver"] and gpus["nvml_version"]
    (device,) = [d for d in gpus["devices"] if d.get("uuid") == nvml_gpu0["uuid"]]
    assert device["name"] == torch.cuda.get_device_name(0) and device["compute_capability"] == nvml_gpu0["compute_capability"]
    assert device["memory_total_bytes"] == nvml_gpu0["memory_total_bytes"] and device["pcie_width_max"]
    assert 5 <= device["temperature_c"] <= 100 and device["sm_clock_max_mhz"] > 300
    assert software["torch"] == torch.__version__ and software["cuda"] == torch.version.cuda
    assert software["nccl"] and "nccl" in software["distributed_backends"]
    assert software["driver"] == gpus["driver"] and software["cuda_driver"] == gpus["cuda_driver"]
    assert re.fullmatch(r"\d+\.\d+", gpus["cuda_driver"]), gpus["cuda_driver"]

    human = run_mleng("env", timeout=120)
    assert human.returncode == 0 and torch.cuda.get_device_name(0) in human.stdout


def test_check_cli_on_one_gpu(run_mleng, torch_cuda, nvml_gpu0):
    result = run_mleng("check", "--nproc", "1", "--alloc-gib", "1", "--pairs", "--json", timeout=180)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    s = record["summary"]
    assert record["status"] == "complete" and s["verdict"] == "ok" and s["problems"] == []
    assert s["world_size"] == 1 and s["pairs"]["skipped"]
    (row,) = record["rows"]
    assert row["all_reduce_ok"] and row["all_reduce_values"] == [1.0]
    assert row["alloc_ok"] is True and row["alloc_gib"] == 1 and row["barrier_ms"] >= 0
    assert row["device"] == "cuda:0" and row["gpu_uuid"] == nvml_gpu0["uuid"]
    assert row["gpu_name"] == torch_cuda.cuda.get_device_name(0)
    assert record["machine"]["gpus"]["available"]
