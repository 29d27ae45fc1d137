"""The fingerprint on this machine, and the /proc and /sys parsers on trees built in tmp_path."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from mleng.machine import system
from mleng.machine.fingerprint import SCHEMA, TOP_LEVEL_KEYS, collect


@pytest.fixture(scope="module")
def fingerprint():
    return collect()


def test_collect_on_this_machine_reports_the_missing_gpu_with_nvmls_reason(fingerprint):
    assert tuple(fingerprint) == TOP_LEVEL_KEYS
    assert fingerprint["schema"] == SCHEMA
    gpus = fingerprint["gpus"]
    assert gpus["available"] is False
    assert gpus["devices"] == []
    assert gpus["reason"].startswith("NVML Shared Library Not Found")
    assert "no NVIDIA driver" in gpus["reason"]
    assert fingerprint["software"]["unavailable"]["driver"] == gpus["reason"]
    json.dumps(fingerprint)  # every value is JSON-able


def test_collect_reads_host_os_cpu_memory_python(fingerprint):
    import platform
    import socket

    assert fingerprint["host"]["hostname"] == socket.gethostname()
    assert fingerprint["os"]["kernel"] == platform.release()
    os_release = system.parse_os_release(Path("/etc/os-release").read_text())
    assert fingerprint["os"]["version"] == os_release.get("VERSION_ID")
    cpu = fingerprint["cpu"]
    assert cpu["logical_cores"] == os.cpu_count()
    assert 1 <= cpu["physical_cores"] <= cpu["logical_cores"]
    assert cpu["sockets"] >= 1
    assert cpu["model"]
    physical_ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert abs(fingerprint["memory"]["total_bytes"] - physical_ram) <= 0.01 * physical_ram
    assert fingerprint["python"]["version"] == platform.python_version()
    assert fingerprint["python"]["executable"] == sys.executable


def test_collect_software_versions_on_the_cpu_build_of_torch(fingerprint):
    import torch

    software = fingerprint["software"]
    assert software["torch"] == torch.__version__
    assert software["cuda"] == torch.version.cuda
    if torch.version.cuda is None:
        assert "built without CUDA" in software["unavailable"]["cuda"]
        assert software["nccl"] is None and "nccl" in software["unavailable"]
    assert "gloo" in software["distributed_backends"]
    from importlib.metadata import version

    assert software["nvidia_ml_py"] == version("nvidia-ml-py")


def test_collect_process_affinity_numa_and_ib(fingerprint):
    own = sorted(os.sched_getaffinity(0))
    assert system.parse_cpulist(fingerprint["process"]["cpu_affinity"]) == own
    assert fingerprint["process"]["cpu_affinity_count"] == len(own)
    numa = fingerprint["numa"]
    assert numa["available"] is True
    all_node_cpus = sorted(c for n in numa["nodes"] for c in system.parse_cpulist(n["cpulist"]))
    assert set(own) <= set(all_node_cpus)
    if not Path("/sys/class/infiniband").exists():
        assert fingerprint["infiniband"] == {
            "available": False, "reason": "/sys/class/infiniband absent: no InfiniBand/RoCE devices"}
    names = [i["name"] for i in fingerprint["network"]["interfaces"]]
    assert "lo" in names
    assert sorted(names) == sorted(p.name for p in Path("/sys/class/net").iterdir()
                                   if (p / "operstate").exists())


def test_limits_match_the_shells_ulimit(fingerprint):
    limits = fingerprint["limits"]
    shell = subprocess.run(["bash", "-c", "ulimit -l; ulimit -n"], capture_output=True, text=True, check=True)
    memlock_kib, nofile = shell.stdout.split()
    if memlock_kib == "unlimited":
        assert limits["memlock_soft_bytes"] == "unlimited"
    else:
        assert limits["memlock_soft_bytes"] == int(memlock_kib) * 1024
    assert str(limits["nofile_soft"]) == nofile
    assert limits["nofile_hard"] == (
        "unlimited" if resource.getrlimit(resource.RLIMIT_NOFILE)[1] == resource.RLIM_INFINITY
        else resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    shm = limits["shm"]
    assert shm["available"] is True and shm["total_bytes"] > 0
    assert 0 <= shm["free_bytes"] <= shm["total_bytes"]


def test_collect_can_skip_gpus():
    fp = collect(gpus=False, torch_versions=False)
    assert fp["gpus"]["available"] is False
    assert "gpus=False" in fp["gpus"]["reason"]
    assert fp["software"]["cuda"] is None and "torch_versions=False" in fp["software"]["unavailable"]["cuda"]


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_the_fingerprint_module_loads_neither_torch_nor_pynvml():
    result = _run_python("import sys, mleng.machine.fingerprint, mleng.machine.nvml, mleng.cli.env\n"
                         "print(sorted(m for m in ('torch', 'pynvml') if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_collect_without_torch_versions_does_not_import_torch():
    result = _run_python("import sys\nfrom mleng.machine.fingerprint import collect\n"
                         "fp = collect(torch_versions=False)\nprint('torch' in sys.modules, fp['software']['torch'])")
    assert result.returncode == 0, result.stderr
    imported, version = result.stdout.split()
    assert imported == "False"
    import torch

    assert version == torch.__version__  # still known, from package metadata


def test_cpulist_round_trip():
    assert system.parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert system.format_cpulist([11, 10, 0, 1, 2, 3, 8]) == "0-3,8,10-11"
    assert system.format_cpulist(range(0, 224)) == "0-223"
    assert system.parse_cpulist(system.format_cpulist([5])) == [5]
    assert system.parse_cpulist("") == []


def test_meminfo_and_os_release_and_cpuinfo_parsing():
    meminfo = system.parse_meminfo("MemTotal:       24683584 kB\nHugePages_Total:       0\n")
    assert meminfo == {"MemTotal": 24683584 * 1024, "HugePages_Total": 0}
    node = system.parse_meminfo("Node 1 MemTotal:        5203704 kB\nNode 1 MemFree: 100 kB\n")
    assert node["MemTotal"] == 5203704 * 1024 and node["MemFree"] == 102400
    release = system.parse_os_release('PRETTY_NAME="Ubuntu 22.04.5 LTS"\nVERSION_ID="22.04"\n# c\nID=ubuntu\n')
    assert release == {"PRETTY_NAME": "Ubuntu 22.04.5 LTS", "VERSION_ID": "22.04", "ID": "ubuntu"}
    parsed = system.parse_cpuinfo("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480C\n"
                                  "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n")
    assert parsed == {"model": "Intel(R) Xeon(R) Platinum 8480C", "flags": ["amx_bf16", "amx_tile", "avx2", "avx512f"]}
    arm = system.parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd sve sve2\nCPU part\t: 0xd4f\n")
    assert arm == {"model": None, "flags": ["sve", "sve2"]}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_cpu_topology_counts_cores_and_sockets(tmp_path):
    # 2 sockets x 2 cores x 2 threads = 8 logical CPUs
    for cpu in range(8):
        package, core = (cpu // 2) % 2, cpu % 2
        _write(tmp_path / f"cpu{cpu}" / "topology" / "physical_package_id", str(package))
        _write(tmp_path / f"cpu{cpu}" / "topology" / "core_id", str(core))
    (tmp_path / "cpufreq").mkdir()
    assert system.cpu_topology(tmp_path) == (4, 2)
    assert system.cpu_topology(tmp_path / "missing") == (None, None)


def _ib_port(port_dir: Path, state: str, phys_state: str, rate: str, link_layer: str) -> None:
    _write(port_dir / "state", state)
    _write(port_dir / "phys_state", phys_state)
    _write(port_dir / "rate", rate)
    _write(port_dir / "link_layer", link_layer)


def test_infiniband_sysfs_parsing(tmp_path):
    # Same layout as the kernel: /sys/class/infiniband/<dev> is a link into the PCI device tree.
    pci = tmp_path / "devices" / "pci0000:00" / "0000:18:00.0" / "infiniband" / "mlx5_0"
    _ib_port(pci / "ports" / "1", "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand")
    _write(pci / "fw_ver", "28.39.1002")
    _write(pci / "hca_type", "MT4129")
    (pci / "device" / "net" / "ib0").mkdir(parents=True)
    ib_root = tmp_path / "class" / "infiniband"
    ib_root.mkdir(parents=True)
    (ib_root / "mlx5_0").symlink_to(pci)
    roce = ib_root / "mlx5_1"
    _ib_port(roce / "ports" / "1", "1: DOWN", "3: Disabled", "100 Gb/sec (4X EDR)", "Ethernet")
    _ib_port(roce / "ports" / "2", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)", "Ethernet")

    ib = system.infiniband_info(ib_root)
    assert ib["available"] is True
    first, second = ib["devices"]
    assert first["name"] == "mlx5_0" and first["fw_ver"] == "28.39.1002" and first["hca_type"] == "MT4129"
    assert first["netdevs"] == ["ib0"]
    assert first["ports"] == [{"port": 1, "state": "ACTIVE", "state_code": 4, "phys_state": "LinkUp",
                               "phys_state_code": 5, "rate": "400 Gb/sec (4X NDR)", "rate_gbps": 400.0,
                               "link_layer": "InfiniBand", "counters": None}]  # no counters/ folder here
    assert second["board_id"] is None and second["netdevs"] == []
    assert [(p["port"], p["state"], p["phys_state"], p["rate_gbps"], p["link_layer"]) for p in second["ports"]] == [
        (1, "DOWN", "Disabled", 100.0, "Ethernet"), (2, "ACTIVE", "LinkUp", 200.0, "Ethernet")]


def test_infiniband_absent_or_empty_is_unavailable_with_reason(tmp_path):
    missing = system.infiniband_info(tmp_path / "infiniband")
    assert missing == {"available": False,
                       "reason": f"{tmp_path / 'infiniband'} absent: no InfiniBand/RoCE devices"}
    (tmp_path / "empty").mkdir()
    assert system.infiniband_info(tmp_path / "empty")["available"] is False


def test_sysfs_enum_and_rate_parsing():
    assert system.parse_sysfs_enum("4: ACTIVE") == (4, "ACTIVE")
    assert system.parse_sysfs_enum("5: LinkUp") == (5, "LinkUp")
    assert system.parse_sysfs_enum("ACTIVE") == (None, "ACTIVE")
    assert system.parse_sysfs_enum(None) == (None, None)
    assert system.parse_ib_rate("25 Gb/sec (1X EDR)") == 25.0
    assert system.parse_ib_rate("garbage") is None


def test_network_sysfs_parsing(tmp_path):
    virtual = tmp_path / "devices" / "virtual" / "net" / "lo"
    for name, value in (("operstate", "unknown"), ("mtu", "65536"), ("type", "772")):
        _write(virtual / name, value)
    physical = tmp_path / "devices" / "pci0000:00" / "0000:56:00.0" / "net" / "enp86s0f0np0"
    for name, value in (("operstate", "up"), ("mtu", "9000"), ("type", "1"), ("speed", "200000")):
        _write(physical / name, value)
    ipoib = tmp_path / "devices" / "pci0000:00" / "0000:18:00.0" / "net" / "ib0"
    for name, value in (("operstate", "down"), ("mtu", "4092"), ("type", "32"), ("speed", "-1")):
        _write(ipoib / name, value)
    net = tmp_path / "class" / "net"
    net.mkdir(parents=True)
    for target in (virtual, physical, ipoib):
        (net / target.name).symlink_to(target)
    _write(net / "bonding_masters", "")  # a plain file in /sys/class/net, not an interface

    interfaces = {i["name"]: i for i in system.network_info(net)["interfaces"]}
    assert sorted(interfaces) == ["enp86s0f0np0", "ib0", "lo"]
    assert interfaces["enp86s0f0np0"] == {"name": "enp86s0f0np0", "state": "up", "speed_mbps": 200000,
                                          "mtu": 9000, "kind": "ethernet", "virtual": False}
    assert interfaces["ib0"]["speed_mbps"] is None and interfaces["ib0"]["kind"] == "infiniband"
    assert interfaces["lo"]["virtual"] is True and interfaces["lo"]["kind"] == "loopback"
    assert system.network_info(tmp_path / "nope")["available"] is False


def test_numa_sysfs_parsing(tmp_path):
    _write(tmp_path / "node0" / "cpulist", "0-55,112-167")
    _write(tmp_path / "node0" / "meminfo", "Node 0 MemTotal:       1056543848 kB\nNode 0 MemFree: 1 kB")
    _write(tmp_path / "node1" / "cpulist", "56-111,168-223")
    _write(tmp_path / "node10" / "cpulist", "")
    _write(tmp_path / "online", "0-1")
    numa = system.numa_info(tmp_path)
    assert [n["node"] for n in numa["nodes"]] == [0, 1, 10]
    assert numa["nodes"][0] == {"node": 0, "cpulist": "0-55,112-167", "memory_total_bytes": 1056543848 * 1024}
    assert numa["nodes"][1]["memory_total_bytes"] is None
    assert system.numa_info(tmp_path / "missing")["available"] is False


def test_pci_sysfs_numa_node_and_local_cpus(tmp_path):
    dev = tmp_path / "0000:18:00.0"
    _write(dev / "numa_node", "1")
    _write(dev / "local_cpulist", "56-111,168-223")
    assert system.pci_sysfs_info("0000:18:00.0", tmp_path) == {"numa_node": 1, "local_cpulist": "56-111,168-223"}
    _write(tmp_path / "0000:00:06.0" / "numa_node", "-1")
    assert system.pci_sysfs_info("0000:00:06.0", tmp_path) == {"numa_node": None, "local_cpulist": None}


def test_shm_unreadable_is_reported_not_raised(tmp_path):
    shm = system.shm_info(str(tmp_path / "no-such-shm"))
    assert shm["available"] is False and "No such file" in shm["reason"]


def test_a_section_that_raises_becomes_unavailable(monkeypatch):
    # a kernel exposing something unexpected must not cost the whole fingerprint
    def broken() -> dict:
        raise PermissionError(13, "Permission denied", "/sys/devices/system/node")

    monkeypatch.setattr(system, "numa_info", broken)
    fp = collect(gpus=False, torch_versions=False)
    assert fp["numa"]["available"] is False
    assert "Permission denied" in fp["numa"]["reason"]
    assert fp["cpu"]["logical_cores"] == os.cpu_count()
