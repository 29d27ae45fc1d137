"""Kernel-log checks on fixtures (tests/fixtures/doctor/README.md says which are recorded and which modelled):
Xid/SXid lines with their GPU, PCIe AER, limited links, machine checks, OOM kills, hung tasks; sources and
windows; an unreadable log is inconclusive, never ok."""

import json
from pathlib import Path

import pytest

from mleng.doctor import kernel_log as kl
from mleng.machine import kernel_log as reader

HERE = Path(__file__).parent
DOCTOR = HERE / "fixtures" / "doctor"
FINGERPRINTS = HERE / "fixtures" / "fingerprints"
ENTRIES = HERE.parent / "src" / "mleng" / "handbook" / "entries"


def fingerprint(name: str) -> dict:
    return json.loads((FINGERPRINTS / f"{name}.json").read_text())


def judge(name: str, fp: str = "h200_healthy", since=None):
    return kl.check_kernel_log(reader.read_saved_log(str(DOCTOR / f"{name}.txt")), fingerprint(fp), since)


def rows(findings):
    return sorted((f.check, f.severity, f.subject) for f in findings)


@pytest.mark.parametrize("name", ["kmsg_cpu_vm_recorded", "dmesg_h200_healthy"])
def test_healthy_logs_give_ok_with_no_warn(name):
    findings = judge(name, "cpu_only" if "cpu" in name else "h200_healthy")
    assert {f.severity for f in findings} == {"ok"}
    assert findings[0].check == "kernel_log" and "none of Xid" in findings[0].summary
    assert findings[0].measured["lines"] > 10


def test_application_xids_are_allow_listed_and_named_per_gpu():
    findings = judge("dmesg_h200_app_xids")
    assert {f.severity for f in findings} == {"ok"}
    xids = {f.subject: f for f in findings if f.check == "xid"}
    assert set(xids) == {"gpu 0 (NVIDIA H200)", "gpu 1 (NVIDIA H200)"}
    gpu0 = xids["gpu 0 (NVIDIA H200)"]
    assert gpu0.measured["xids"] == {"13": 2, "43": 1} and "allow-listed" in gpu0.summary
    assert gpu0.measured["uuid"] == "GPU-ef612c2c-fb96-14cb-ebbf-9b494cffceab"
    assert xids["gpu 1 (NVIDIA H200)"].measured["xids"] == {"31": 1, "45": 1}  # 45 after 31: not alone


def test_faulty_node_log_names_each_fault_its_device_and_entry():
    findings = judge("journal_h200_faults")
    got = rows(findings)
    assert got == sorted([
        ("kernel_log", "ok", None),
        ("xid", "ok", "gpu 4 (NVIDIA H200)"),
        ("xid", "fail", "gpu 6 (NVIDIA H200)"),
        ("xid", "fail", "gpu 3 (NVIDIA H200)"),
        ("sxid", "fail", "nvswitch 0 (PCI 0000:c3:00.0)"),
        ("sxid", "warn", "nvswitch 3 (PCI 0000:05:00.0)"),
        ("pcie_aer", "warn", "gpu 1 (NVIDIA H200)"),
        ("pcie_limited", "warn", "PCI 0000:9c:00.0 (mlx5_core)"),  # the x1 non-GPU device is left out
        ("machine_check", "warn", None),
        ("oom_killer", "warn", None),
        ("hung_task", "warn", None),
        ("cpu_stall", "warn", None),
    ])
    by = {(f.check, f.subject): f for f in findings}
    gpu6 = by[("xid", "gpu 6 (NVIDIA H200)")]
    assert gpu6.measured["xids"] == {"48": 1, "63": 1, "94": 1, "154": 1}
    assert {"xid-48-double-bit-ecc", "xid-154-recovery-action"} <= set(gpu6.handbook)
    assert "GPU Reset Required" in gpu6.summary and gpu6.measured["uuid"].startswith("GPU-176713e9")
    gpu3 = by[("xid", "gpu 3 (NVIDIA H200)")]
    assert gpu3.handbook == ["xid-79-fallen-off-bus"] and gpu3.measured["fallen_off_bus"] == 0  # told once
    assert "RESTART_BM" in gpu3.summary
    sxid0 = by[("sxid", "nvswitch 0 (PCI 0000:c3:00.0)")]
    assert sxid0.measured["sxids"] == {"24007": 1} and sxid0.measured["links"] == [30]
    assert "12028" in by[("sxid", "nvswitch 3 (PCI 0000:05:00.0)")].summary
    aer = by[("pcie_aer", "gpu 1 (NVIDIA H200)")]
    assert aer.measured["counts"] == {"corrected": 12} and aer.handbook[0] == "pcie-aer-errors"
    oom = by[("oom_killer", None)]
    assert oom.measured["kills"] == 2 and oom.measured["cgroup_kills"] == 1 and oom.handbook == ["cpu-oom-killed"]


def test_fatal_aer_then_xid_79_in_syslog_form():
    findings = judge("syslog_uncorrected_aer")
    assert rows(findings) == sorted([("kernel_log", "ok", None), ("xid", "fail", "gpu 2 (NVIDIA H200)"),
                                     ("pcie_aer", "fail", "gpu 2 (NVIDIA H200)")])


def test_a_gpu_nvml_no_longer_sees_is_named_by_the_uuid_the_driver_logged():
    findings = judge("syslog_uncorrected_aer", fp="cpu_only")
    xid = next(f for f in findings if f.check == "xid")
    assert xid.subject == "GPU at PCI 0000:3a:00" and xid.measured["uuid"].startswith("GPU-884a5813")


def test_since_window_counts_back_from_the_end_of_a_saved_log():
    log = reader.read_saved_log(str(DOCTOR / "journal_h200_faults.txt"))
    end = max(t for t, _ in log["lines"] if t is not None)
    window = reader.parse_since("3h", uptime=end)
    findings = kl.check_kernel_log(log, fingerprint("h200_healthy"), window)
    checks = {(f.check, f.subject) for f in findings}
    assert ("xid", "gpu 4 (NVIDIA H200)") not in checks  # Xid 13 at 101 s: before the window
    assert ("hung_task", None) not in checks and ("xid", "gpu 3 (NVIDIA H200)") in checks
    assert "the last 3h" in findings[0].summary


@pytest.mark.parametrize("code,others,severity", [
    (13, set(), "ok"), (43, {13}, "ok"), (63, set(), "ok"),
    (45, {13}, "ok"), (45, set(), "warn"),   # solo Xid 45 points at Fabric Manager
    (79, set(), "fail"), (48, set(), "fail"), (95, set(), "fail"), (119, set(), "fail"), (74, set(), "fail"),
    (94, set(), "warn"), (39, set(), "warn"), (92, set(), "warn"),  # RESTART_APP / IGNORE, then support
    (171, set(), "fail"),   # no action in the catalog, but an uncorrectable DRAM error
    (999, set(), "warn"),   # not in the catalog: unknown, not ok
])
def test_xid_classification_follows_the_catalog_and_the_allow_list(code, others, severity):
    assert kl.classify_xid(code, others | {code})[0] == severity


def test_xid_154_back_to_none_is_not_a_fault():
    assert kl.classify_xid(154, {154}, "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)")[0] \
        == "ok"
    assert kl.classify_xid(154, {154}, "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)")[0] \
        == "fail"


def test_unknown_xid_on_a_line_is_reported_not_dropped():
    events, _ = kl.parse_events([(5.0, "NVRM: Xid (PCI:0000:18:00): 999, pid=1, name=x, something new")])
    findings = kl.xid_findings(events, {}, fingerprint("h200_healthy"))
    assert findings[0].severity == "warn" and "not in the catalog" in findings[0].summary


@pytest.mark.parametrize("line,kind", [
    ("NVRM: Xid (0000:01:00): 3, C 00000005 SC 00000007 M 00001ffc Data ffffffff", "xid"),  # old form, no 'PCI:'
    ("NVRM: Xid (PCI:0000:17:00.0): 94, GPU has fallen off t", "xid"),
    ("NVRM: GPU at PCI:0000:17:00.0 has fallen off the bus.", "gpu_lost"),
    ("NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:26b5) installed in this system has fallen off the bus and is "
     "not responding to commands.", "gpu_lost"),
    ("NVRM: RmInitAdapter failed! (0x62:0xffffffff:1089)", "gpu_init_failed"),
    ("pcieport 0000:00:1c.5: AER: Multiple Corrected error received: 0000:00:1c.5", "aer_received"),
    ("EDAC MC1: 1 UE memory read error on CPU_SrcID#1_MC#0_Chan#0_DIMM#0", "mce"),
    ("Memory cgroup out of memory: Killed process 4321 (python) total-vm:51234567kB", "oom"),
    ("rcu: INFO: rcu_preempt detected stalls on CPUs/tasks:", "rcu_stall"),
    ("nvidia-nvlink: Failed to register the nvlink link on GPU 3", "nvlink"),
])
def test_line_formats(line, kind):
    events, _ = kl.parse_events([(1.0, line)])
    assert [e["kind"] for e in events] == [kind]


def test_uncorrected_machine_check_fails():
    events, _ = kl.parse_events([(1.0, "EDAC MC1: 1 UE memory read error on CPU_SrcID#1_MC#0_Chan#0_DIMM#0")])
    assert kl.host_findings(events)[0].severity == "fail"


def test_pci_addresses_in_every_spelling_meet():
    assert kl.pci_key("0000:3b:00") == kl.pci_key("PCI:0000:3B:00.0") == kl.pci_key("00000000:3B:00.0") \
        == kl.pci_key("3b:00.0") == (0, 0x3B, 0)
    assert kl.pci_key("nonsense") is None and kl.pci_key(None) is None


def test_reader_line_forms():
    assert reader.parse_kmsg_record("6,1234,5678901,-;NVRM: hello\n SUBSYSTEM=pci") == (5.678901, "NVRM: hello", 1234)
    assert reader.parse_text_line("4,2,1500000,-;x") == (1.5, "x")
    assert reader.parse_text_line("[   12.345678] hello") == (12.345678, "hello")
    assert reader.parse_text_line("Oct 30 09:49:35 n1 kernel: [  888.321877] x") == (888.321877, "x")
    assert reader.parse_text_line("Oct 30 09:49:35 n1 kernel: y") == (None, "y")
    import datetime as dt

    boot = dt.datetime(2026, 7, 30, 14, 0, 0).timestamp()
    assert reader.parse_text_line("[Wed Jul 30 14:25:12 2026] z", boot) == (1512.0, "z")


def test_since_parsing():
    assert reader.parse_since(None)["since_boot_s"] is None and reader.parse_since("boot")["kind"] == "boot"
    assert reader.parse_since("2h", uptime=10000.0)["since_boot_s"] == 2800.0
    assert reader.parse_since("30m", uptime=100.0)["since_boot_s"] == 0.0
    now = 1_800_000_000.0
    window = reader.parse_since("2027-01-15T08:00:00+00:00", now_epoch=now, uptime=86400.0)
    assert window["kind"] == "datetime" and window["since_boot_s"] > 0
    for bad in ("yesterday", "2h ago", "2099-01-01T00:00:00+00:00"):
        with pytest.raises(ValueError):
            reader.parse_since(bad, now_epoch=now, uptime=100.0)


def test_no_readable_source_is_inconclusive_with_every_reason(monkeypatch):
    monkeypatch.setattr(reader, "read_kmsg", lambda path=reader.KMSG: reader.unavailable("/dev/kmsg: Permission denied"))
    monkeypatch.setattr(reader, "read_journal", lambda: reader.unavailable("journalctl -k: exit 1: No access"))
    monkeypatch.setattr(reader, "read_dmesg", lambda: reader.unavailable(
        "dmesg: exit 1: dmesg: read kernel buffer failed: Operation not permitted (kernel.dmesg_restrict=1: needs "
        "root or CAP_SYSLOG)"))
    log = reader.read_kernel_log()
    assert not log["available"] and len(log["tried"]) == 3
    findings = kl.check_kernel_log(log, fingerprint("h200_healthy"))
    assert [f.severity for f in findings] == ["inconclusive"]
    assert "Permission denied" in findings[0].summary and "dmesg_restrict" in findings[0].summary


def test_a_wrapped_ring_buffer_falls_back_to_the_journal(monkeypatch):
    monkeypatch.setattr(reader, "read_kmsg", lambda path=reader.KMSG: {
        "available": True, "source": "/dev/kmsg", "lines": [(9.0, "late")], "wrapped": True, "first_seq": 500})
    monkeypatch.setattr(reader, "read_journal", lambda: {
        "available": True, "source": "journalctl -k -b", "lines": [(0.0, "n1 kernel: early"), (9.0, "n1 kernel: late")],
        "wrapped": False})
    log = reader.read_kernel_log()
    assert log["source"] == "journalctl -k -b" and log["lines"][0] == (0.0, "early")


def test_missing_kmsg_path_says_why():
    result = reader.read_kmsg("/nonexistent/kmsg")
    assert not result["available"] and "No such file" in result["reason"]


def test_this_machines_log_is_read_or_inconclusive_never_silently_ok():
    from mleng.doctor.runner import kernel_log_findings

    findings = kernel_log_findings({}, local=True, since=None, kernel_log_path=None)
    head = findings[0]
    assert head.check == "kernel_log"
    assert (head.severity == "ok" and head.measured["lines"] > 0) or head.severity == "inconclusive"


def test_allow_list_and_catalog_are_data_with_sources_and_real_handbook_ids():
    allow = kl.allowlist()
    catalog = kl.xid_catalog()
    assert len(catalog) > 100 and catalog[79]["immediate"] == "RESTART_BM" and catalog[63]["immediate"] == "IGNORE"
    for code, entry in allow["xid"].items():
        assert code in catalog and entry["why"] and entry["source"], code
    for code, ids in allow["handbook"].items():
        for entry_id in ids:
            assert (ENTRIES / f"{entry_id}.md").exists(), (code, entry_id)
    assert allow["sxid"]["source"] and 19049 in allow["sxid"]["allow"]
    for finding_ids in (["pcie-aer-errors", "pcie-link-downtrained", "cpu-oom-killed", "nvswitch-sxid-errors",
                         "fabric-manager-not-running", "shared-fs-server-not-responding", "gpu-rminitadapter-no-devices",
                         "xid-74-nvlink-error", "nvlink-link-down"]):
        assert (ENTRIES / f"{finding_ids}.md").exists(), finding_ids


def test_doctor_cli_judges_a_saved_log_with_a_recorded_fingerprint(run_mleng):
    result = run_mleng("doctor", "--fingerprint", str(FINGERPRINTS / "h200_healthy.json"), "--kernel-log",
                       str(DOCTOR / "syslog_uncorrected_aer.txt"), "--json", "--no-store")
    assert result.returncode == 1, result.stderr
    record = json.loads(result.stdout)
    assert "xid-79-fallen-off-bus" in record["summary"]["handbook"]
    assert record["params"]["kernel_log"].endswith("syslog_uncorrected_aer.txt")
    healthy = run_mleng("doctor", "--fingerprint", str(FINGERPRINTS / "h200_healthy.json"), "--kernel-log",
                        str(DOCTOR / "dmesg_h200_healthy.txt"), "--no-store")
    assert healthy.returncode == 0 and "[  ok] kernel_log" in healthy.stdout


@pytest.mark.parametrize("args,message", [
    (["--since", "yesterday"], "--since"),
    (["--kernel-log", "/nonexistent/dmesg.txt"], "does not exist"),
    (["--kernel-log", "/"], "not a readable file"),
])
def test_doctor_cli_refuses_bad_kernel_log_arguments_before_running(run_mleng, args, message):
    result = run_mleng("doctor", "--no-measure", "--no-store", *args)
    assert result.returncode == 2 and message in result.stderr
