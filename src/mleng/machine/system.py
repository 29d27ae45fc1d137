"""Host facts read from /proc, /sys and the C library: OS, CPU, memory, NUMA, NICs, InfiniBand, limits."""

from __future__ import annotations

import os
import platform
import resource
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Iterable

# CPU features that decide whether low-precision math on the host is usable.
CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "sve", "sve2")


def unavailable(reason: str) -> dict[str, Any]:
    return {"available": False, "reason": reason}


def read_text(path: str | Path) -> str | None:
    """The stripped contents of a small file, or None when it cannot be read (sysfs returns EINVAL often)."""
    try:
        return Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_int(path: str | Path) -> int | None:
    text = read_text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            first, last = part.split("-", 1)
            cpus.extend(range(int(first), int(last) + 1))
        else:
            cpus.append(int(part))
    return cpus


def format_cpulist(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8': compact, and the same text the kernel writes in sysfs."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    start = previous = None
    for cpu in ordered:
        if start is None:
            start = previous = cpu
        elif cpu == previous + 1:
            previous = cpu
        else:
            ranges.append(f"{start}-{previous}" if previous != start else f"{start}")
            start = previous = cpu
    if start is not None:
        ranges.append(f"{start}-{previous}" if previous != start else f"{start}")
    return ",".join(ranges)


def _fqdn(hostname: str, timeout_s: float = 2.0) -> str | None:
    # getfqdn may ask DNS; on a node with broken DNS that can take many seconds, so bound it.
    result: list[str] = []
    worker = threading.Thread(target=lambda: result.append(socket.getfqdn(hostname)), daemon=True)
    worker.start()
    worker.join(timeout_s)
    return result[0] if result else None


def host_info() -> dict[str, Any]:
    hostname = socket.gethostname()
    return {"hostname": hostname, "fqdn": _fqdn(hostname)}


def parse_os_release(text: str) -> dict[str, str]:
    """KEY=value lines of /etc/os-release, quotes removed."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        values[key] = value.strip().strip('"').strip("'")
    return values


def os_info(os_release_path: str = "/etc/os-release") -> dict[str, Any]:
    text = read_text(os_release_path)
    release = parse_os_release(text) if text else {}
    return {
        "name": release.get("PRETTY_NAME") or release.get("NAME") or platform.system(),
        "id": release.get("ID"),
        "version": release.get("VERSION_ID"),
        "kernel": platform.release(),
        "arch": platform.machine(),
    }


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """CPU model and flags from /proc/cpuinfo text (x86 'model name', Arm 'CPU part' has no name)."""
    model = None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return {"model": model, "flags": sorted(f for f in CPU_FLAGS_OF_INTEREST if f in flags)}


def cpu_topology(cpu_root: str | Path = "/sys/devices/system/cpu") -> tuple[int | None, int | None]:
    """(physical cores, sockets) from sysfs topology; works on x86 and Arm alike."""
    cores: set[tuple[int, int]] = set()
    packages: set[int] = set()
    for topo in Path(cpu_root).glob("cpu[0-9]*/topology"):
        package = read_int(topo / "physical_package_id")
        core = read_int(topo / "core_id")
        if package is None or core is None:
            continue
        packages.add(package)
        cores.add((package, core))
    return (len(cores) or None, len(packages) or None)


def cpu_info(cpuinfo_path: str = "/proc/cpuinfo", cpu_root: str = "/sys/devices/system/cpu") -> dict[str, Any]:
    text = read_text(cpuinfo_path) or ""
    parsed = parse_cpuinfo(text)
    physical, sockets = cpu_topology(cpu_root)
    return {
        "model": parsed["model"] or platform.processor() or None,
        "logical_cores": os.cpu_count(),
        "physical_cores": physical,
        "sockets": sockets,
        "flags_of_interest": parsed["flags"],
    }


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo (or a NUMA node's meminfo) as name -> bytes."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        if ":" not in line:
            continue
        key, rest = line.split(":", 1)
        # node meminfo lines read "Node 0 MemTotal:  5203704 kB"
        key = key.split()[-1]
        fields = rest.split()
        if not fields:
            continue
        try:
            number = int(fields[0])
        except ValueError:
            continue
        values[key] = number * 1024 if len(fields) > 1 and fields[1] == "kB" else number
    return values


def memory_info(meminfo_path: str = "/proc/meminfo") -> dict[str, Any]:
    text = read_text(meminfo_path)
    if text is None:
        return unavailable(f"{meminfo_path} unreadable")
    values = parse_meminfo(text)
    return {
        "total_bytes": values.get("MemTotal"),
        "available_bytes": values.get("MemAvailable"),
        "hugepages_total": values.get("HugePages_Total"),
    }


def python_info() -> dict[str, Any]:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "in_virtualenv": sys.prefix != sys.base_prefix,
    }


def process_info() -> dict[str, Any]:
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = []
    return {
        "pid": os.getpid(),
        "cpu_affinity": format_cpulist(affinity) if affinity else None,
        "cpu_affinity_count": len(affinity) if affinity else None,
    }


def numa_info(node_root: str | Path = "/sys/devices/system/node") -> dict[str, Any]:
    root = Path(node_root)
    if not root.is_dir():
        return unavailable(f"{root} absent: kernel without NUMA support")
    nodes = []
    for node_dir in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        meminfo = read_text(node_dir / "meminfo")
        nodes.append({
            "node": int(node_dir.name[4:]),
            "cpulist": read_text(node_dir / "cpulist") or "",
            "memory_total_bytes": parse_meminfo(meminfo).get("MemTotal") if meminfo else None,
        })
    if not nodes:
        return unavailable(f"no node* directories in {root}")
    return {"available": True, "nodes": nodes}


def parse_sysfs_enum(text: str | None) -> tuple[int | None, str | None]:
    """'4: ACTIVE' -> (4, 'ACTIVE'); the form of IB port state and phys_state files."""
    if not text:
        return None, None
    code, sep, name = text.partition(":")
    if not sep:
        return None, text.strip()
    try:
        return int(code), name.strip()
    except ValueError:
        return None, text.strip()


def parse_ib_rate(text: str | None) -> float | None:
    """'400 Gb/sec (4X NDR)' -> 400.0 (Gb/s, the port's signalling rate)."""
    if not text:
        return None
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return None


def infiniband_info(ib_root: str | Path = "/sys/class/infiniband") -> dict[str, Any]:
    root = Path(ib_root)
    if not root.is_dir():
        return unavailable(f"{root} absent: no InfiniBand/RoCE devices")
    devices = []
    for dev in sorted(p for p in root.iterdir() if p.is_dir()):
        ports = []
        ports_dir = dev / "ports"
        port_dirs = sorted((p for p in ports_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)) \
            if ports_dir.is_dir() else []
        for port in port_dirs:
            state_code, state = parse_sysfs_enum(read_text(port / "state"))
            phys_code, phys_state = parse_sysfs_enum(read_text(port / "phys_state"))
            rate = read_text(port / "rate")
            ports.append({
                "port": int(port.name),
                "state": state,
                "state_code": state_code,
                "phys_state": phys_state,
                "phys_state_code": phys_code,
                "rate": rate,
                "rate_gbps": parse_ib_rate(rate),
                "link_layer": read_text(port / "link_layer"),
                "counters": ib_port_counters(port),
            })
        net_dir = dev / "device" / "net"
        netdevs = sorted(p.name for p in net_dir.iterdir()) if net_dir.is_dir() else []
        devices.append({
            "name": dev.name,
            "hca_type": read_text(dev / "hca_type"),
            "fw_ver": read_text(dev / "fw_ver"),
            "board_id": read_text(dev / "board_id"),
            "netdevs": netdevs,
            "ports": ports,
        })
    if not devices:
        return unavailable(f"{root} is empty: no InfiniBand/RoCE devices")
    return {"available": True, "devices": devices, "gpudirect": gpudirect_info()}


# Port error counters (IBA PortCounters, as the kernel exposes them under ports/N/counters/): each counts
# since the HCA came up or the counters were last reset.
IB_ERROR_COUNTERS = ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors",
                     "port_rcv_remote_physical_errors", "local_link_integrity_errors",
                     "excessive_buffer_overrun_errors", "port_xmit_discards")


def ib_port_counters(port_dir: str | Path) -> dict[str, int | None] | None:
    """The error counters of one IB/RoCE port; None where the port has no counters folder."""
    counters = Path(port_dir) / "counters"
    if not counters.is_dir():
        return None
    return {name: read_int(counters / name) for name in IB_ERROR_COUNTERS}


def loaded_modules(proc_modules: str | Path = "/proc/modules", sys_module: str | Path = "/sys/module") -> set[str] | None:
    """Names of the loaded kernel modules (/proc/modules, else /sys/module/*/initstate); None if neither is readable."""
    text = read_text(proc_modules)
    if text is not None:
        return {line.split()[0] for line in text.splitlines() if line.strip()}
    root = Path(sys_module)
    if not root.is_dir():
        return None
    return {p.name for p in root.iterdir() if (p / "initstate").exists()}


def gpudirect_info(proc_modules: str | Path = "/proc/modules", sys_module: str | Path = "/sys/module") -> dict[str, Any]:
    """Whether GPUDirect RDMA's kernel module (nvidia_peermem, or the older nv_peer_mem) is loaded."""
    modules = loaded_modules(proc_modules, sys_module)
    if modules is None:
        return {"nvidia_peermem": None, "reason": f"{proc_modules} and {sys_module} unreadable"}
    return {"nvidia_peermem": "nvidia_peermem" in modules or "nv_peer_mem" in modules,
            "module": "nvidia_peermem" if "nvidia_peermem" in modules else
            ("nv_peer_mem" if "nv_peer_mem" in modules else None)}


NVIDIA_PCI_VENDOR = "0x10de"
PCI_CLASS_BRIDGE_OTHER = "0x0680"  # NVSwitches enumerate as "bridge, other" (class 0x068000)


def nvswitch_info(pci_root: str | Path = "/sys/bus/pci/devices") -> dict[str, Any]:
    """The NVSwitches this host sees on PCI (HGX baseboards; none on PCIe cards or NVL72 compute trays)."""
    root = Path(pci_root)
    if not root.is_dir():
        return {"count": None, "pci": [], "reason": f"{root} absent"}
    found = []
    for dev in sorted(root.iterdir()):
        if read_text(dev / "vendor") == NVIDIA_PCI_VENDOR and (read_text(dev / "class") or "").startswith(
                PCI_CLASS_BRIDGE_OTHER):
            found.append(dev.name)
    return {"count": len(found), "pci": found}


def fabric_manager_info(proc_root: str | Path = "/proc") -> dict[str, Any]:
    """Whether the Fabric Manager daemon (nv-fabricmanager) runs where this process can see it.

    In a container the host's daemon is invisible: then `running` is False and `visible_only` says so;
    NVML's per-GPU fabric state is what tells whether the fabric came up.
    """
    root = Path(proc_root)
    try:
        entries = [p for p in root.iterdir() if p.name.isdigit()]
    except OSError as exc:
        return {"running": None, "reason": f"{root}: {exc.strerror or exc}"}
    for entry in entries:
        if read_text(entry / "comm") == "nv-fabricmanager":
            return {"running": True, "pid": int(entry.name)}
    return {"running": False, "pid": None, "visible_only": True}


# /sys/class/net/<if>/type values (include/uapi/linux/if_arp.h) that NCCL users meet.
_ARPHRD_KIND = {1: "ethernet", 32: "infiniband", 772: "loopback", 65534: "none"}


def network_info(net_root: str | Path = "/sys/class/net") -> dict[str, Any]:
    root = Path(net_root)
    if not root.is_dir():
        return unavailable(f"{root} absent")
    interfaces = []
    for iface in sorted(root.iterdir(), key=lambda p: p.name):
        if not (iface / "operstate").exists():
            continue  # bonding_masters and other plain files
        speed = read_int(iface / "speed")
        arp_type = read_int(iface / "type")
        try:
            virtual = "/devices/virtual/" in os.path.realpath(iface)
        except OSError:
            virtual = None
        interfaces.append({
            "name": iface.name,
            "state": read_text(iface / "operstate"),
            # the kernel reports -1 (or EINVAL) when a link is down or has no notion of speed
            "speed_mbps": speed if speed is not None and speed > 0 else None,
            "mtu": read_int(iface / "mtu"),
            "kind": _ARPHRD_KIND.get(arp_type, f"arphrd_{arp_type}") if arp_type is not None else None,
            "virtual": virtual,
        })
    return {"available": True, "interfaces": interfaces}


def _limit(value: int) -> int | str:
    return "unlimited" if value == resource.RLIM_INFINITY else int(value)


def shm_info(path: str = "/dev/shm") -> dict[str, Any]:
    try:
        stat = os.statvfs(path)
    except OSError as exc:
        return unavailable(f"{path}: {exc.strerror or exc}")
    return {
        "available": True,
        "path": path,
        "total_bytes": stat.f_blocks * stat.f_frsize,
        "free_bytes": stat.f_bavail * stat.f_frsize,
    }


def limits_info(shm_path: str = "/dev/shm") -> dict[str, Any]:
    """Resource limits that break NCCL/IB and dataloaders when too small ('unlimited' for RLIM_INFINITY)."""
    memlock_soft, memlock_hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    nofile_soft, nofile_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc_soft, nproc_hard = resource.getrlimit(resource.RLIMIT_NPROC)
    return {
        "memlock_soft_bytes": _limit(memlock_soft),
        "memlock_hard_bytes": _limit(memlock_hard),
        "nofile_soft": _limit(nofile_soft),
        "nofile_hard": _limit(nofile_hard),
        "nproc_soft": _limit(nproc_soft),
        "nproc_hard": _limit(nproc_hard),
        "shm": shm_info(shm_path),
    }


def pci_sysfs_info(sysfs_address: str, pci_root: str | Path = "/sys/bus/pci/devices") -> dict[str, Any]:
    """NUMA node and local CPUs of one PCI device as the kernel sees them."""
    dev = Path(pci_root) / sysfs_address
    numa = read_int(dev / "numa_node")
    return {
        # -1 means the firmware did not say (single-node machines, many VMs)
        "numa_node": numa if numa is not None and numa >= 0 else None,
        "local_cpulist": read_text(dev / "local_cpulist"),
    }
