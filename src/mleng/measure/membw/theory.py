"""What `mleng membw` compares with: the HBM rate from the specs, the PCIe link (NVML) and its rate per
direction, each row's share of it, and the record's headline."""

from __future__ import annotations

from typing import Any

from mleng.errors import MlengError
from mleng.measure.timing import cpu_model_name


# --- specs ------------------------------------------------------------------------------------
def hbm_theoretical_gbps(device_name: str) -> tuple[float | None, str | None]:
    """The datasheet memory bandwidth of a GPU in GB/s, or None and why not."""
    from mleng.specs import find_accelerator

    accelerator, why_not = find_accelerator(device_name)
    if accelerator is None:
        return None, why_not
    tbps = getattr(accelerator, "memory_bandwidth_tbps", None)
    if not tbps:
        return None, f"the spec entry {accelerator.key!r} has no memory bandwidth"
    return float(tbps) * 1000.0, f"mleng.specs {accelerator.key} ({accelerator.name})"


def pcie_theoretical_gbps(gen: int | None, width: int | None) -> tuple[float | None, str | None]:
    """One direction of a PCIe link in GB/s from mleng.specs, or None and why not."""
    if not gen or not width:
        return None, "the PCIe generation and width could not be read (NVML)"
    from mleng.specs import pcie_link_gbps

    try:
        return float(pcie_link_gbps(int(gen), int(width))), f"mleng.specs pcie_link_gbps(gen={gen}, width={width})"
    except MlengError as exc:
        return None, exc.message


def pcie_link(device_index: int) -> dict[str, Any]:
    """PCIe generation and width of a torch CUDA device, read from NVML by PCI bus id.

    The max values are what the GPU and slot negotiated as their best; the current ones drop
    at idle (power saving), so the theoretical rate uses the max.
    """
    link: dict[str, Any] = {"gen": None, "width": None, "gen_current": None, "width_current": None,
                            "source": None}
    from mleng.machine.nvml import nvml, torch_pci_bus_id

    pynvml, reason = nvml()
    if pynvml is None:  # NVML missing or not loadable: say so, measure anyway
        link["source"] = f"NVML unavailable: {reason}"
        return link
    try:
        bus_id = torch_pci_bus_id(device_index)
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        link["gen"] = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)
        link["width"] = pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)
        link["gen_current"] = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
        link["width_current"] = pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
        link["source"] = f"NVML {bus_id}"
    except Exception as exc:
        link["source"] = f"NVML could not read the PCIe link: {exc}"
    return link


def device_context(devices: list[str]) -> dict[str, dict[str, Any]]:
    """Name, spec bandwidth and PCIe link of each device, for the comparison with theory."""
    import torch

    context: dict[str, dict[str, Any]] = {}
    for device in devices:
        if device == "cpu":
            context[device] = {"name": cpu_model_name(), "hbm_gbps": None,
                               "hbm_source": "no reference bandwidth for CPU memory (DIMM population unknown)",
                               "pcie": None}
            continue
        index = torch.device(device).index or 0
        name = torch.cuda.get_device_name(index)
        hbm_gbps, hbm_source = hbm_theoretical_gbps(name)
        link = pcie_link(index)
        pcie_gbps, pcie_source = pcie_theoretical_gbps(link["gen"], link["width"])
        context[device] = {"name": name, "hbm_gbps": hbm_gbps, "hbm_source": hbm_source,
                           "pcie": {**link, "theoretical_gbps": pcie_gbps, "theoretical_source": pcie_source}}
    return context


def add_theory(rows: list[dict[str, Any]], context: dict[str, dict[str, Any]]) -> None:
    for row in rows:
        if "gbps" not in row:
            continue
        info = context.get(row["device"], {})
        if row["test"] in ("h2d", "d2h"):
            theoretical = (info.get("pcie") or {}).get("theoretical_gbps")
        else:
            theoretical = info.get("hbm_gbps")
        row["theoretical_gbps"] = theoretical
        row["ratio"] = row["gbps"] / theoretical if theoretical else None


def summarize(rows: list[dict[str, Any]], context: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Headline: the best copy bandwidth (the slowest device's, when several ran) against the spec."""
    measured = [r for r in rows if "gbps" in r]
    per_device: dict[str, dict[str, Any]] = {}
    random_writes = {r["device"] for r in measured if r["test"] == "write" and not r.get("constant_data")}
    for row in measured:
        if row.get("constant_data") and row["device"] in random_writes:
            continue  # a store of random data ran: the headline uses that, not the constant fill
        key = row["test"] if not row.get("host_memory") else f"{row['test']}_{row['host_memory']}"
        entry = per_device.setdefault(row["device"], {"name": context.get(row["device"], {}).get("name")})
        if key == "copy":
            entry.setdefault("copy_gbps_by_engine", {})[row["engine"]] = row["gbps"]
        best = entry.get(f"{key}_gbps")
        if best is None or row["gbps"] > best:
            entry[f"{key}_gbps"] = row["gbps"]
            entry[f"{key}_engine"] = row["engine"]
            entry[f"{key}_ratio"] = row.get("ratio")
    summary: dict[str, Any] = {"value": None, "unit": "GB/s", "theoretical": None, "ratio": None,
                               "metric": "copy bandwidth (bytes read + written) / time, median",
                               "per_device": per_device}
    copies = [(d, e["copy_gbps"]) for d, e in per_device.items() if e.get("copy_gbps") is not None]
    if copies:
        device, value = min(copies, key=lambda item: item[1])
        theoretical = context.get(device, {}).get("hbm_gbps")
        summary.update(value=value, device=device, theoretical=theoretical,
                       ratio=value / theoretical if theoretical else None,
                       theoretical_source=context.get(device, {}).get("hbm_source"))
    for key in ("read", "write", "h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"):
        values = [e[f"{key}_gbps"] for e in per_device.values() if e.get(f"{key}_gbps") is not None]
        if values:
            summary[f"{key}_gbps"] = min(values)
    return summary
