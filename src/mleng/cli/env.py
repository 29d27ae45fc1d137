"""`mleng env`: print the environment fingerprint of this machine (or of a recorded one)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from mleng.cli.render import emit, table
from mleng.errors import UsageError
from mleng.measure.sizes import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-gpus", action="store_true", help="skip NVML (GPU) queries")
    parser.add_argument("--no-torch", action="store_true",
                        help="do not import torch (faster; CUDA/cuDNN/NCCL versions are then not read)")
    parser.add_argument("--from", dest="from_path", metavar="FILE",
                        help="show a recorded fingerprint (JSON from `mleng env --json`, or a record "
                             "with a 'machine' field) instead of this machine")


def run(args: argparse.Namespace) -> int:
    if args.from_path:
        fingerprint = load_fingerprint(args.from_path)
    else:
        from mleng.machine.fingerprint import collect

        fingerprint = collect(gpus=not args.no_gpus, torch_versions=not args.no_torch)
    emit(args, fingerprint, render)
    return 0


def load_fingerprint(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}", "give the path of a JSON file")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is not valid JSON ({exc})", "write one with `mleng env --json > FILE`")
    if isinstance(data, dict) and isinstance(data.get("machine"), dict):
        data = data["machine"]  # a Measurement record embeds its fingerprint as 'machine'
    if not isinstance(data, dict) or "host" not in data or "gpus" not in data:
        raise UsageError(f"{path} is not an mleng fingerprint (no 'host' and 'gpus' keys)",
                         "write one with `mleng env --json > FILE`")
    from mleng.machine.fingerprint import without_annotations

    return without_annotations(data)




def _dash(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _unavailable(section: dict[str, Any]) -> str | None:
    if isinstance(section, dict) and section.get("available") is False:
        return f"not available: {section.get('reason')}"
    return None


def render(fp: dict[str, Any]) -> str:
    out: list[str] = []
    host, os_, cpu = fp.get("host", {}), fp.get("os", {}), fp.get("cpu", {})
    memory, python, process = fp.get("memory", {}), fp.get("python", {}), fp.get("process", {})
    out.append("host")
    out.append(f"  hostname  {_dash(host.get('hostname'))} (fqdn {_dash(host.get('fqdn'))})")
    out.append(f"  os        {_dash(os_.get('name'))}, kernel {_dash(os_.get('kernel'))}, {_dash(os_.get('arch'))}")
    flags = " ".join(cpu.get("flags_of_interest") or []) or "-"
    out.append(f"  cpu       {_dash(cpu.get('model'))}: {_dash(cpu.get('logical_cores'))} logical / "
               f"{_dash(cpu.get('physical_cores'))} physical cores, {_dash(cpu.get('sockets'))} socket(s); "
               f"flags {flags}")
    out.append(f"  memory    {format_bytes(memory.get('total_bytes'))} total, "
               f"{format_bytes(memory.get('available_bytes'))} available")
    out.append(f"  python    {_dash(python.get('version'))} {_dash(python.get('executable'))}")
    out.append(f"  process   pid {_dash(process.get('pid'))}, CPU affinity {_dash(process.get('cpu_affinity'))} "
               f"({_dash(process.get('cpu_affinity_count'))} CPUs)")
    out.append(f"  collected {_dash(fp.get('collected_at'))}")

    software = fp.get("software", {})
    reasons = software.get("unavailable") or {}
    out.append("")
    out.append("software")
    for name in ("torch", "cuda", "cudnn", "nccl", "nvidia_ml_py", "driver", "cuda_driver"):
        value = software.get(name)
        note = f"  ({reasons[name]})" if value is None and name in reasons else ""
        if name == "cuda_driver" and value is None and reasons.get(name) == reasons.get("driver"):
            note = "  (see driver)"
        out.append(f"  {name:<13}{_dash(value)}{note}")
    backends = software.get("distributed_backends")
    if backends:
        out.append(f"  {'distributed':<13}{', '.join(backends)}")

    out.append("")
    out.extend(_render_gpus(fp.get("gpus", {})))
    out.append("")
    out.extend(_render_numa(fp.get("numa", {})))
    out.append("")
    out.extend(_render_network(fp.get("network", {})))
    out.append("")
    out.extend(_render_infiniband(fp.get("infiniband", {})))
    out.append("")
    out.extend(_render_limits(fp.get("limits", {})))
    out.append("")
    env = fp.get("env") or {}
    out.append(f"env ({len(env)} captured, secret-looking values redacted)")
    if isinstance(env, dict) and env.get("available") is False:
        out.append(f"  {_unavailable(env)}")
    else:
        out.extend(f"  {name}={value}" for name, value in env.items())
    return "\n".join(out)


def _render_gpus(gpus: dict[str, Any]) -> list[str]:
    if not gpus.get("available"):
        return [f"gpus: not available: {gpus.get('reason')}"]
    devices = gpus.get("devices") or []
    names = sorted({d.get("name") for d in devices if d.get("name")})
    lines = [f"gpus: {gpus.get('count')} x {', '.join(names) or '?'}, driver {_dash(gpus.get('driver'))}, "
             f"CUDA driver {_dash(gpus.get('cuda_driver'))}"]
    from mleng.machine.nvml import nvlink_summary

    rows = []
    for d in devices:
        if "error" in d:
            rows.append({"idx": d.get("index"), "name": f"ERROR: {d['error']}"})
            continue
        ecc = d.get("ecc_errors") or {}
        links = nvlink_summary(d.get("nvlinks"))
        rows.append({
            "idx": d.get("index"),
            "name": d.get("name"),
            "mem_used/total": f"{format_bytes(d.get('memory_used_bytes'))}/{format_bytes(d.get('memory_total_bytes'))}",
            "util%": d.get("utilization_gpu_pct"),
            "sm_mhz": f"{_dash(d.get('sm_clock_mhz'))}/{_dash(d.get('sm_clock_max_mhz'))}",
            "mem_mhz": f"{_dash(d.get('mem_clock_mhz'))}/{_dash(d.get('mem_clock_max_mhz'))}",
            "power_w": f"{_dash(d.get('power_draw_w'))}/{_dash(d.get('power_limit_w'))}",
            "temp_c": d.get("temperature_c"),
            "throttle": ",".join(r for r in (d.get("throttle_reasons") or []) if r != "gpu_idle") or "-",
            "ecc_unc": ecc.get("volatile_uncorrected"),
            "pcie": f"Gen{_dash(d.get('pcie_gen'))}x{_dash(d.get('pcie_width'))}"
                    f"/Gen{_dash(d.get('pcie_gen_max'))}x{_dash(d.get('pcie_width_max'))}",
            "nvlink": f"{links['active']}/{links['total']}" if links["total"] else "-",
            "numa": d.get("numa_node"),
            "cpus": d.get("cpu_affinity"),
        })
    # the name is in the heading already when every GPU is the same model
    columns = ["idx"] + (["name"] if len(names) > 1 else []) + ["mem_used/total", "util%", "sm_mhz", "mem_mhz", "power_w", "temp_c", "throttle",
               "ecc_unc", "pcie", "nvlink", "numa", "cpus"]
    lines.extend("  " + line for line in table(rows, columns).splitlines())
    lines.append("  (sm_mhz, mem_mhz: current/max; power_w: draw/limit; pcie: current/max; "
                 "ecc_unc: volatile uncorrected; nvlink: active/total)")
    return lines


def _render_numa(numa: dict[str, Any]) -> list[str]:
    reason = _unavailable(numa)
    if reason:
        return [f"numa: {reason}"]
    rows = [{"node": n.get("node"), "cpus": n.get("cpulist"), "memory": format_bytes(n.get("memory_total_bytes"))}
            for n in numa.get("nodes") or []]
    return ["numa"] + ["  " + line for line in table(rows, ["node", "cpus", "memory"]).splitlines()]


def _render_network(network: dict[str, Any]) -> list[str]:
    reason = _unavailable(network)
    if reason:
        return [f"network: {reason}"]
    rows = [{"name": i.get("name"), "state": i.get("state"), "kind": i.get("kind"),
             "speed_mbps": i.get("speed_mbps"), "mtu": i.get("mtu"), "virtual": i.get("virtual")}
            for i in network.get("interfaces") or []]
    return ["network interfaces"] + ["  " + line for line in
                                     table(rows, ["name", "state", "kind", "speed_mbps", "mtu", "virtual"]).splitlines()]


def _render_infiniband(ib: dict[str, Any]) -> list[str]:
    reason = _unavailable(ib)
    if reason:
        return [f"infiniband: {reason}"]
    rows = []
    for dev in ib.get("devices") or []:
        for port in dev.get("ports") or []:
            rows.append({"device": dev.get("name"), "port": port.get("port"), "state": port.get("state"),
                         "phys_state": port.get("phys_state"), "rate_gbps": port.get("rate_gbps"),
                         "link_layer": port.get("link_layer"), "netdevs": ",".join(dev.get("netdevs") or []) or None})
    columns = ["device", "port", "state", "phys_state", "rate_gbps", "link_layer", "netdevs"]
    return ["infiniband / RoCE"] + ["  " + line for line in table(rows, columns).splitlines()]


def _render_limits(limits: dict[str, Any]) -> list[str]:
    reason = _unavailable(limits)
    if reason:
        return [f"limits: {reason}"]

    def size(value: Any) -> str:
        return value if isinstance(value, str) else format_bytes(value)

    shm = limits.get("shm") or {}
    shm_text = _unavailable(shm) or (f"{format_bytes(shm.get('total_bytes'))} total, "
                                      f"{format_bytes(shm.get('free_bytes'))} free")
    return [
        "limits",
        f"  memlock (ulimit -l)  soft {size(limits.get('memlock_soft_bytes'))}, "
        f"hard {size(limits.get('memlock_hard_bytes'))}",
        f"  nofile (ulimit -n)   soft {_dash(limits.get('nofile_soft'))}, hard {_dash(limits.get('nofile_hard'))}",
        f"  nproc (ulimit -u)    soft {_dash(limits.get('nproc_soft'))}, hard {_dash(limits.get('nproc_hard'))}",
        f"  {shm.get('path') or '/dev/shm':<21}{shm_text}",
    ]
