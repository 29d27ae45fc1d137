"""Write the measured activation coefficients back to their TOML data file (tomllib reads; nothing in the standard
library writes TOML, and the file is small and flat enough for this)."""

from __future__ import annotations

import datetime as _dt
import json
import platform
from pathlib import Path
from typing import Any

HEADER = """# Activation coefficients of mleng's Llama-style step, MEASURED by `mleng memory --calibrate`: never edit by
# hand. Each set (dtype/recompute) is a least-squares fit over real training steps of shrunk shapes, peaks read
# with torch's own memory tracking; every set says the command, the machine and the date that produced it.
# Token features are bytes per token per element of the feature, static ones bytes per parameter.
# See src/mleng/plan/memory.py (COMPONENTS) for what each component measures.
"""


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else json.dumps(k)


def _table(lines: list[str], path: list[str], table: dict[str, Any]) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict) and not _is_table_list(v)}
    subtables = {k: v for k, v in table.items() if isinstance(v, dict)}
    lists = {k: v for k, v in table.items() if _is_table_list(v)}
    if path:
        lines.append("")
        lines.append("[" + ".".join(_key(p) for p in path) + "]")
    for k, v in scalars.items():
        lines.append(f"{_key(k)} = {_value(v)}")
    for k, v in lists.items():
        lines.append(f"{_key(k)} = [")
        lines.extend(f"    {_value(x)}," for x in v)
        lines.append("]")
    for k, v in subtables.items():
        _table(lines, path + [k], v)


def _is_table_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def dumps(data: dict[str, Any]) -> str:
    lines: list[str] = [HEADER.rstrip("\n")]
    _table(lines, [], data)
    return "\n".join(lines) + "\n"


def machine_line(device: str) -> str:
    import os

    import torch

    where = platform.node() or "unknown host"
    if device.startswith("cuda"):
        where += f", {torch.cuda.get_device_name(0)}"
    else:
        where += f", {os.cpu_count()} CPU cores ({platform.machine()})"
    return f"{where}; torch {torch.__version__}; Python {platform.python_version()}"


def write_set(path: Path, fitted: dict[str, Any], command: str, device: str) -> None:
    from mleng.plan.memory import load_coefficients

    data = load_coefficients(path)
    sets = data.setdefault("sets", {})
    entry = {"command": command, "machine": machine_line(device), "device": device,
             "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **fitted}
    sets[f"{fitted['dtype']}/{fitted['recompute']}"] = entry
    data["sets"] = dict(sorted(sets.items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(dumps(data))
    tmp.replace(path)
