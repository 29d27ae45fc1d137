"""The fingerprint fixtures have exactly the shape collect() returns, and each says where it comes from.

h200_* (8 GPUs) are modelled by generate.py; cpu_only is recorded on this project's CPU VM; h200_vm_* are
recorded on a lent one-GPU H200 VM. Each file carries that in "_provenance", which the loaders drop.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from mleng.machine import nvml, software, system
from mleng.machine.fingerprint import TOP_LEVEL_KEYS, collect, without_annotations

FIXTURES = Path(__file__).parent / "fixtures" / "fingerprints"
NAMES = ["h200_healthy", "h200_throttled", "h200_pcie_downtrained", "h200_nvlink_down", "h200_ecc_errors",
         "h200_bad_ifname", "cpu_only"]
H200 = [n for n in NAMES if n.startswith("h200")]
# collect() run for real on a one-GPU H200 VM (driver 580.159.04), idle and under a bf16 matmul loop
RECORDED = ["h200_vm_idle", "h200_vm_load"]


def load(name: str) -> dict:
    return without_annotations(json.loads((FIXTURES / f"{name}.json").read_text()))


@pytest.mark.parametrize("name", NAMES + RECORDED)
def test_every_fixture_says_whether_it_is_recorded_or_modelled(name):
    provenance = json.loads((FIXTURES / f"{name}.json").read_text())["_provenance"]
    if name in RECORDED or name == "cpu_only":
        assert provenance.startswith("recorded: ") and "VM" in provenance
    else:
        assert provenance.startswith("modelled, not recorded: written by tests/fixtures/fingerprints/generate.py")


@pytest.fixture(scope="module")
def real():
    return collect(torch_versions=False)


@pytest.mark.parametrize("name", NAMES + RECORDED)
def test_fixture_has_the_top_level_keys_of_a_real_collect(name, real):
    fp = load(name)
    assert tuple(fp) == tuple(real) == TOP_LEVEL_KEYS
    for section in ("host", "os", "cpu", "memory", "python", "process", "limits"):
        assert set(fp[section]) == set(real[section]), section
    assert set(fp["software"]) == set(software.software_info(torch=False))
    assert set(fp["limits"]["shm"]) == set(real["limits"]["shm"])
    assert set(fp["network"]["interfaces"][0]) == set(real["network"]["interfaces"][0])
    assert set(fp["numa"]["nodes"][0]) == set(real["numa"]["nodes"][0])


@pytest.mark.parametrize("name", H200)
def test_h200_fixture_devices_have_the_record_shape(name):
    fp = load(name)
    gpus = fp["gpus"]
    assert gpus["available"] is True and gpus["count"] == len(gpus["devices"]) == 8
    device_keys = set(nvml.device_from_raw({}))
    for device in gpus["devices"]:
        assert set(device) == device_keys
        assert device["name"] == "NVIDIA H200" and len(device["nvlinks"]) == 18
        assert set(device["nvlinks"][0]) == {"link", "state", "version", "version_name"}
        assert system.parse_cpulist(device["cpu_affinity"])
    assert len({d["uuid"] for d in gpus["devices"]}) == 8
    port_keys = {"port", "state", "state_code", "phys_state", "phys_state_code", "rate", "rate_gbps", "link_layer",
                 "counters"}
    for dev in fp["infiniband"]["devices"]:
        assert set(dev) == {"name", "hca_type", "fw_ver", "board_id", "netdevs", "ports"}
        assert all(set(p) == port_keys for p in dev["ports"])


def _faults(fp: dict) -> dict:
    devices = fp["gpus"]["devices"]
    return {
        "fault_throttled": [d["index"] for d in devices if set(d["throttle_reasons"]) & nvml.FAULT_REASONS],
        "pcie_degraded": [d["index"] for d in devices
                          if nvml.pcie_link_check(d["pcie_gen"], d["pcie_gen_max"], d["pcie_width"],
                                                  d["pcie_width_max"])["degraded"]],
        "nvlink_inactive": [d["index"] for d in devices if nvml.nvlink_summary(d["nvlinks"])["inactive"]],
        "ecc_uncorrected": [d["index"] for d in devices if d["ecc_errors"]["volatile_uncorrected"]],
    }


def test_healthy_fixture_has_no_fault():
    fp = load("h200_healthy")
    assert _faults(fp) == {"fault_throttled": [], "pcie_degraded": [], "nvlink_inactive": [], "ecc_uncorrected": []}
    interfaces = {i["name"] for i in fp["network"]["interfaces"]}
    assert fp["env"]["NCCL_SOCKET_IFNAME"] in interfaces


def test_each_h200_fixture_carries_exactly_its_fault():
    assert _faults(load("h200_throttled"))["fault_throttled"] == [5]
    gpu = load("h200_throttled")["gpus"]["devices"][5]
    assert gpu["sm_clock_mhz"] == 1100 and gpu["temperature_c"] == 88 and gpu["utilization_gpu_pct"] == 100
    assert gpu["throttle_reasons"] == ["hw_slowdown", "sw_thermal_slowdown"]
    assert nvml.decode_clock_event_reasons(gpu["throttle_reasons_mask"]) == gpu["throttle_reasons"]

    assert _faults(load("h200_pcie_downtrained"))["pcie_degraded"] == [2]
    gpu = load("h200_pcie_downtrained")["gpus"]["devices"][2]
    assert (gpu["pcie_gen"], gpu["pcie_width"], gpu["pcie_gen_max"], gpu["pcie_width_max"]) == (4, 8, 5, 16)

    down = load("h200_nvlink_down")["gpus"]["devices"]
    assert [(d["index"], nvml.nvlink_summary(d["nvlinks"])["inactive"]) for d in down
            if nvml.nvlink_summary(d["nvlinks"])["inactive"]] == [(3, [7])]

    ecc = load("h200_ecc_errors")
    assert _faults(ecc)["ecc_uncorrected"] == [6]
    assert ecc["gpus"]["devices"][6]["remapped_rows"]["pending"] is True

    bad = load("h200_bad_ifname")
    interfaces = {i["name"] for i in bad["network"]["interfaces"]}
    assert bad["env"]["NCCL_SOCKET_IFNAME"] == "ib9" and "ib9" not in interfaces
    assert bad["env"]["NCCL_P2P_DISABLE"] == "1" and bad["env"]["NCCL_DEBUG"] == "INFO"
    for name in ("h200_throttled", "h200_pcie_downtrained", "h200_nvlink_down", "h200_ecc_errors"):
        assert load(name)["env"] == load("h200_healthy")["env"]


def test_cpu_only_fixture_is_a_machine_without_nvidia_driver():
    fp = load("cpu_only")
    assert fp["gpus"]["available"] is False
    assert fp["gpus"]["reason"] == "NVML Shared Library Not Found (no NVIDIA driver on this machine)"
    assert fp["infiniband"]["available"] is False


def test_fixtures_are_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("generate_fixtures", FIXTURES / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, fingerprint in module.variants().items():
        assert load(name) == json.loads(json.dumps(fingerprint)), name


@pytest.mark.parametrize("name", RECORDED)
def test_recorded_h200_devices_have_the_record_shape(name):
    devices = load(name)["gpus"]["devices"]
    # recorded by an older mleng: the fields added since (NVLink/PCIe error counters, application clocks,
    # fabric state) are absent, as in users' stores; the doctor reads them as not recorded
    assert len(devices) == 1 and set(devices[0]) <= set(nvml.device_from_raw({}))
    assert {"uuid", "pci_bus_id", "ecc_errors", "remapped_rows", "nvlinks"} <= set(devices[0])
    assert devices[0]["name"] == "NVIDIA H200" and devices[0]["memory_total_bytes"] == 150754820096


def test_recorded_h200_under_load_is_power_capped_not_faulty():
    # what a healthy H200 looks like mid-matmul: well below its max clock, at its power limit
    gpu = load("h200_vm_load")["gpus"]["devices"][0]
    assert gpu["utilization_gpu_pct"] == 100 and gpu["throttle_reasons"] == ["sw_power_cap"]
    assert gpu["sm_clock_mhz"] < 0.8 * gpu["sm_clock_max_mhz"]
    assert gpu["power_draw_w"] > 0.95 * gpu["power_limit_w"]
    assert load("h200_vm_idle")["gpus"]["devices"][0]["throttle_reasons"] == ["gpu_idle"]
