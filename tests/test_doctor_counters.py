"""Error counters and configuration: NVLink/PCIe counters and settings from NVML (the one NVML layer, on a
stand-in driver), InfiniBand ports from sysfs fixture trees (tests/fixtures/doctor/sysfs, modelled by its
generate.py), and the config checks on the modelled fingerprints; healthy gives OK with no WARN."""

import ctypes
import json
from pathlib import Path

import pynvml
import pytest

from mleng.doctor import config, counters
from mleng.machine import nvml, system

HERE = Path(__file__).parent
FINGERPRINTS = HERE / "fixtures" / "fingerprints"
SYSFS = HERE / "fixtures" / "doctor" / "sysfs"


def fingerprint(name: str) -> dict:
    return json.loads((FINGERPRINTS / f"{name}.json").read_text())


def severities(findings) -> set:
    return {f.severity for f in findings}


def with_ib_tree(tree: str) -> dict:
    fp = fingerprint("h200_healthy")
    fp["infiniband"] = system.infiniband_info(SYSFS / tree / "class" / "infiniband")
    fp["infiniband"]["gpudirect"] = {"nvidia_peermem": True, "module": "nvidia_peermem"}
    return fp


def test_every_counter_and_config_check_is_ok_on_the_healthy_node():
    fp = fingerprint("h200_healthy")
    for name, check in {**counters.COUNTER_CHECKS, **config.CONFIG_CHECKS}.items():
        assert severities(check(fp)) == {"ok"}, name


def test_on_a_cpu_machine_they_are_not_applicable_never_ok():
    fp = fingerprint("cpu_only")
    for name, check in {**counters.COUNTER_CHECKS, **config.CONFIG_CHECKS}.items():
        assert severities(check(fp)) == {"skipped"}, name


def test_a_fingerprint_recorded_before_these_fields_is_inconclusive_not_ok():
    fp = fingerprint("h200_vm_idle")  # recorded on a one-GPU H200 VM by an older mleng
    assert severities(counters.check_pcie_replay(fp)) == {"inconclusive"}
    assert severities(config.check_application_clocks(fp)) == {"inconclusive"}
    assert severities(config.check_fabric(fp)) == {"inconclusive"}
    assert severities(counters.check_nvlink_errors(fp)) == {"skipped"}  # no NVLink on that VM


def test_ib_tree_healthy_reads_ok():
    findings = counters.check_ib_ports(with_ib_tree("ib_healthy"))
    assert severities(findings) == {"ok"} and len(findings) == 9
    assert all(f.measured["counters"]["symbol_error"] == 0 for f in findings)


def test_ib_tree_faulty_names_each_port():
    findings = {f.subject: f for f in counters.check_ib_ports(with_ib_tree("ib_faulty"))}
    bad = {s: f.severity for s, f in findings.items() if f.severity != "ok"}
    assert bad == {"mlx5_2 port 1 (ibp2s0)": "fail", "mlx5_5 port 1 (ibp5s0)": "warn", "mlx5_6 port 1 (ibp6s0)": "warn"}
    assert "DOWN / Polling" in findings["mlx5_2 port 1 (ibp2s0)"].summary
    assert "200 Gb/sec (4X HDR), below the 400 Gb/s" in findings["mlx5_5 port 1 (ibp5s0)"].summary
    counted = findings["mlx5_6 port 1 (ibp6s0)"]
    assert "link_downed 3" in counted.summary and "symbol_error 4212" in counted.summary
    assert "port_rcv_errors 57" in counted.summary and counted.handbook
    # the 200 Gb/s RoCE storage port is compared with no InfiniBand port: its own kind
    assert findings["mlx5_8 port 1 (enp86s0f0np0)"].severity == "ok"


def test_a_down_roce_port_nccl_does_not_use_only_warns():
    fp = with_ib_tree("ib_healthy")
    storage = next(d for d in fp["infiniband"]["devices"] if d["name"] == "mlx5_8")
    storage["ports"][0].update(state="DOWN", phys_state="Disabled")
    finding = next(f for f in counters.check_ib_ports(fp) if f.subject.startswith("mlx5_8"))
    assert finding.severity == "warn"
    fp["env"]["NCCL_IB_HCA"] = "mlx5_8"
    finding = next(f for f in counters.check_ib_ports(fp) if f.subject.startswith("mlx5_8"))
    assert finding.severity == "fail"


def test_nvlink_and_pcie_counters_warn_above_their_levels():
    fp = fingerprint("h200_healthy")
    gpu = fp["gpus"]["devices"][4]
    gpu["nvlink_errors"]["per_link"]["11"].update(replay=41, crc_flit=7)
    gpu["nvlink_errors"]["total"].update(replay=41, crc_flit=7)
    fp["gpus"]["devices"][2]["pcie_replay_count"] = 5123
    nvlink = [f for f in counters.check_nvlink_errors(fp) if f.severity != "ok"]
    assert [f.subject for f in nvlink] == ["gpu 4 (NVIDIA H200)"] and "link 11: 48" in nvlink[0].summary
    replay = [f for f in counters.check_pcie_replay(fp) if f.severity != "ok"]
    assert [(f.subject, f.measured) for f in replay] == [("gpu 2 (NVIDIA H200)", 5123)]


@pytest.mark.parametrize("field,value,check,severity,needle", [
    ("persistence_mode", False, config.check_persistence_mode, "warn", "persistence mode off"),
    ("ecc_mode_pending", False, config.check_ecc_mode, "warn", "after the next reboot"),
    ("ecc_mode_enabled", False, config.check_ecc_mode, "warn", "off now, on after the next reboot"),
    ("mig_mode", True, config.check_mig_mode, "warn", "MIG is on"),
    ("applications_clocks", {"sm_mhz": 1410, "sm_default_mhz": 1980, "mem_mhz": 3201, "mem_default_mhz": 3201},
     config.check_application_clocks, "warn", "SM 1410 MHz, default 1980 MHz"),
    ("fabric", {"state": "in_progress", "status": 0, "status_ok": True}, config.check_fabric, "fail", "in_progress"),
    ("fabric", {"state": "completed", "status": 2, "status_ok": False}, config.check_fabric, "fail", "status 2"),
])
def test_config_findings(field, value, check, severity, needle):
    fp = fingerprint("h200_healthy")
    fp["gpus"]["devices"][3][field] = value
    bad = [f for f in check(fp) if f.severity != "ok"]
    assert [(f.subject, f.severity) for f in bad] == [("gpu 3 (NVIDIA H200)", severity)]
    assert needle in bad[0].summary


def test_ecc_off_is_the_ecc_mode_checks_warning_and_the_error_check_says_it_cannot_count():
    from mleng.doctor import checks

    fp = fingerprint("h200_healthy")
    fp["gpus"]["devices"][1].update(ecc_mode_enabled=False, ecc_mode_pending=False)
    assert [f.severity for f in config.check_ecc_mode(fp) if f.subject.startswith("gpu 1")] == ["warn"]
    assert [f.severity for f in checks.check_ecc(fp) if f.subject.startswith("gpu 1")] == ["inconclusive"]


def test_mig_selected_on_purpose_is_ok():
    fp = fingerprint("h200_healthy")
    fp["gpus"]["devices"][0]["mig_mode"] = True
    fp["env"]["CUDA_VISIBLE_DEVICES"] = "MIG-2a3c1e2b-9a7d-5b6e-8f11-0c4d3e2f1a00"
    assert severities(config.check_mig_mode(fp)) == {"ok"}


def test_no_nvswitch_means_no_fabric_manager_needed_and_peermem_missing_warns():
    fp = fingerprint("h200_healthy")
    fp["gpus"]["nvswitches"] = {"count": 0, "pci": []}
    for device in fp["gpus"]["devices"]:
        device["fabric"] = {"state": "not_supported", "status": 0, "status_ok": True}
    assert severities(config.check_fabric(fp)) == {"skipped"}
    fp["infiniband"]["gpudirect"] = {"nvidia_peermem": False, "module": None}
    found = config.check_gpudirect_rdma(fp)
    assert [f.severity for f in found] == ["warn"] and found[0].handbook == ["nccl-gdr-nvidia-peermem-missing"]


def test_system_readers_on_fixture_trees(tmp_path):
    modules = tmp_path / "modules"
    modules.write_text("nvidia_peermem 16384 0 - Live 0x0000000000000000 (OE)\n"
                       "nvidia 11022336 230 nvidia_uvm,nvidia_peermem,nvidia_modeset, Live 0x0 (POE)\n")
    assert system.gpudirect_info(modules, tmp_path / "nothing") == {"nvidia_peermem": True, "module": "nvidia_peermem"}
    assert system.gpudirect_info(tmp_path / "none", tmp_path / "nothing")["nvidia_peermem"] is None
    pci = tmp_path / "pci"
    for name, vendor, cls in (("0000:05:00.0", "0x10de", "0x068000"), ("0000:18:00.0", "0x10de", "0x030200"),
                              ("0000:1a:00.0", "0x15b3", "0x020700")):
        (pci / name).mkdir(parents=True)
        (pci / name / "vendor").write_text(vendor + "\n")
        (pci / name / "class").write_text(cls + "\n")
    assert system.nvswitch_info(pci) == {"count": 1, "pci": ["0000:05:00.0"]}
    proc = tmp_path / "proc"
    (proc / "3121").mkdir(parents=True)
    (proc / "3121" / "comm").write_text("nv-fabricmanager\n")
    (proc / "1").mkdir()
    (proc / "1" / "comm").write_text("systemd\n")
    assert system.fabric_manager_info(proc) == {"running": True, "pid": 3121}


def test_nvml_layer_reads_the_new_counters_from_the_driver():
    from tests.test_machine_nvml import _stand_in_pynvml

    fake = _stand_in_pynvml({})
    fake.nvmlDeviceGetPcieReplayCounter = lambda handle: 17
    fake.nvmlDeviceGetApplicationsClock = lambda handle, clock: 1410 if clock == pynvml.NVML_CLOCK_SM else 3201
    counts = {pynvml.NVML_NVLINK_ERROR_DL_REPLAY: 3, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: 0,
              pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: 2}

    def error_counter(handle, link, counter):
        if counter not in counts:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return counts[counter] * (link + 1)

    fake.nvmlDeviceGetNvLinkErrorCounter = error_counter
    fake.c_nvmlGpuFabricInfo_t = pynvml.c_nvmlGpuFabricInfo_t

    def fabric(handle, ref):
        info = ctypes.cast(ref, ctypes.POINTER(pynvml.c_nvmlGpuFabricInfo_t)).contents
        info.state, info.status = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, 0

    fake.nvmlDeviceGetGpuFabricInfo = fabric
    device = nvml.device_from_raw(nvml.read_device_raw(fake, 0, cpu_count=2))
    assert device["pcie_replay_count"] == 17
    assert device["applications_clocks"] == {"sm_mhz": 1410, "sm_default_mhz": 1980, "mem_mhz": 3201,
                                             "mem_default_mhz": 1980}
    assert device["nvlink_errors"]["per_link"]["1"] == {"replay": 6, "recovery": 0, "crc_flit": 4, "crc_data": None}
    assert device["nvlink_errors"]["total"] == {"replay": 9, "recovery": 0, "crc_flit": 6, "crc_data": None}
    assert device["fabric"] == {"state": "completed", "status": 0, "status_ok": True}
    assert device["ecc_mode_pending"] is True and device["unreadable"] == {}


def test_counter_and_config_checks_run_in_the_doctor(run_mleng):
    path = HERE / "fixtures" / "fingerprints" / "h200_healthy.json"
    result = run_mleng("doctor", "--fingerprint", str(path), "--json", "--no-store")
    record = json.loads(result.stdout)
    checks = {r["check"] for r in record["rows"]}
    assert {"nvlink_errors", "pcie_replay", "ib_port", "persistence_mode", "ecc_mode", "mig_mode", "app_clocks",
            "fabric", "gpudirect_rdma"} <= checks
    assert result.returncode == 0 and record["summary"]["counts"]["warn"] == 0


def test_host_swap_and_disk_space_on_recorded_and_modelled_proc_files(tmp_path):
    from mleng.doctor import host

    doctor = HERE / "fixtures" / "doctor"
    assert [f.severity for f in host.check_swap(str(doctor / "proc_swaps_off_recorded.txt"))] == ["ok"]
    on = host.check_swap(str(doctor / "proc_swaps_on.txt"))
    assert on[0].severity == "warn" and "8.0 GiB, 1.0 GiB used" in on[0].summary
    assert host.check_swap(str(tmp_path / "missing"))[0].severity == "inconclusive"
    mounts = host.real_mounts(str(doctor / "proc_mounts_gpu_node.txt"))
    # pseudo, memory-backed, overlay and network file systems (a hung NFS statfs blocks) are left out
    assert [(m[1], m[2]) for m in mounts] == [("/", "ext4"), ("/boot/efi", "vfat"), ("/raid", "xfs")]
    full = tmp_path / "mounts"
    full.write_text(f"/dev/nvme0n1p1 {tmp_path} ext4 rw,relatime 0 0\n")
    import os

    real = os.statvfs(str(tmp_path))
    fake = type("S", (), {"f_blocks": 1000, "f_bavail": 20, "f_frsize": real.f_frsize})()
    original = host.os.statvfs
    host.os.statvfs = lambda path: fake
    try:
        found = host.check_disk_space(str(full))
    finally:
        host.os.statvfs = original
    assert found[0].severity == "fail" and "98% full" in found[0].summary
