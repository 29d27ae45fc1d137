"""What one rank can say about where it runs: host, ranks, device, GPU UUID, NUMA node, CPU affinity."""

from __future__ import annotations

import glob
import os
import socket

from mleng.distributed.launch import Launch
from mleng.machine.system import format_cpulist, parse_cpulist


def numa_nodes_of(cpus: set[int]) -> list[int]:
    """NUMA nodes whose CPUs this process may run on (from /sys; empty where it is not exposed)."""
    nodes = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist")):
        node = int(path.split("/node")[-1].split("/")[0])
        try:
            with open(path) as f:
                if set(parse_cpulist(f.read())) & cpus:
                    nodes.append(node)
        except (OSError, ValueError):
            continue
    return nodes


def _gpu_fields(device: str) -> dict:
    import torch

    from mleng.machine.nvml import torch_gpu_uuid, torch_pci_bus_id

    index = int(device.split(":")[1])
    props = torch.cuda.get_device_properties(index)
    fields = {"gpu_name": props.name, "gpu_uuid": None, "gpu_pci_bus_id": None, "gpu_numa_node": None}
    fields["gpu_uuid"] = torch_gpu_uuid(index)
    bus_id = torch_pci_bus_id(index)
    if bus_id is not None:
        fields["gpu_pci_bus_id"] = bus_id
        try:
            with open(f"/sys/bus/pci/devices/{bus_id}/numa_node") as f:
                node = int(f.read().strip())
            fields["gpu_numa_node"] = node if node >= 0 else None
        except (OSError, ValueError):
            pass
    return fields


def describe_rank(launch: Launch, device: str) -> dict:
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cpus = set(range(os.cpu_count() or 1))
    info = {
        "rank": launch.rank, "local_rank": launch.local_rank, "host": socket.gethostname(),
        "pid": os.getpid(), "launch": launch.mode, "device": device,
        "cpu_affinity": format_cpulist(cpus), "numa_nodes": numa_nodes_of(cpus),
    }
    if os.environ.get("SLURMD_NODENAME"):  # the name scontrol knows the node by; can differ from the host name
        info["slurm_node"] = os.environ["SLURMD_NODENAME"]
    if device.startswith("cuda"):
        try:
            info.update(_gpu_fields(device))
        except Exception as exc:  # the row says why instead of the whole check failing
            info["gpu_error"] = str(exc).splitlines()[0]
    return info
