"""Read every rank's PyTorch flight-recorder dump and find the first collective where ranks disagree.

Dumps are what torch writes with TORCH_FR_BUFFER_SIZE set (TORCH_NCCL_DUMP_ON_TIMEOUT=1 writes one
file per rank named TORCH_FR_DUMP_TEMP_FILE + rank, default /tmp/nccl_trace_rank_<rank>), or what
torch._C._distributed_c10d._dump_fr_trace() / _dump_fr_trace_json() return. The pickle form is read
with an unpickler that builds only plain containers, so a dump cannot run code.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from mleng.errors import UsageError

RANK_IN_NAME = re.compile(r"(\d+)(?:\.json|\.pkl|\.pickle)?$")


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D102 - refuses every class
        raise pickle.UnpicklingError(f"flight-recorder dump refers to {module}.{name}: not a plain dump")


def load_dump(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    if raw[:1] in (b"{", b"["):
        return json.loads(raw)
    try:
        return _PlainUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same message
        raise UsageError(f"{path} is not a flight-recorder dump ({type(exc).__name__}: {exc})",
                         hint="point at the directory of files written with TORCH_FR_BUFFER_SIZE set") from exc


def load_dir(directory: str | Path) -> dict[int, dict[str, Any]]:
    root = Path(directory)
    if not root.is_dir():
        raise UsageError(f"{root} is not a directory", hint="give the directory holding one dump file per rank")
    dumps: dict[int, dict[str, Any]] = {}
    for path in sorted(root.iterdir()):
        if not path.is_file():
            continue
        match = RANK_IN_NAME.search(path.name)
        if not match:
            continue
        dump = load_dump(path)
        if not isinstance(dump, dict) or "entries" not in dump:
            raise UsageError(f"{path} has no 'entries': not a flight-recorder dump")
        dumps[int(match.group(1))] = dump
    if not dumps:
        raise UsageError(f"no flight-recorder dumps (files ending in the rank number) in {root}",
                         hint="run with TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
                              "TORCH_FR_DUMP_TEMP_FILE=<dir>/rank_")
    return dumps


def _pg_key(entry: dict[str, Any]) -> str:
    group = entry.get("process_group")
    if isinstance(group, (list, tuple)) and group:
        return str(group[0])
    return str(entry.get("pg_id", "0"))


def _op(entry: dict[str, Any]) -> str:
    name = str(entry.get("profiling_name") or "")
    return name.split(":", 1)[-1] if ":" in name else name


def _collectives(dump: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """pg -> collective_seq_id -> entry (p2p entries are left out: their ids count separately)."""
    out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for entry in dump["entries"]:
        if entry.get("is_p2p") or not entry.get("collective_seq_id"):
            continue
        out[_pg_key(entry)][int(entry["collective_seq_id"])] = entry
    return out


def _pg_ranks(dumps: dict[int, dict[str, Any]], pg: str) -> list[int]:
    for dump in dumps.values():
        config = (dump.get("pg_config") or {}).get(pg) or {}
        ranks = config.get("ranks")
        if isinstance(ranks, str):
            try:
                ranks = json.loads(ranks)
            except ValueError:
                ranks = None
        if isinstance(ranks, list) and ranks:
            return [int(r) for r in ranks]
    return sorted(dumps)


def analyze(dumps: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """For each process group, the first collective sequence number where the ranks disagree."""
    per_rank = {rank: _collectives(dump) for rank, dump in dumps.items()}
    groups = sorted({pg for c in per_rank.values() for pg in c})
    findings = []
    for pg in groups:
        members = [r for r in _pg_ranks(dumps, pg) if r in per_rank]
        absent_dumps = [r for r in _pg_ranks(dumps, pg) if r not in per_rank]
        last_seq = {r: max(per_rank[r].get(pg, {}) or [0]) for r in members}
        for seq in range(1, max(last_seq.values() or [0]) + 1):
            entries = {r: per_rank[r].get(pg, {}).get(seq) for r in members}
            missing = [r for r, e in entries.items() if e is None]
            present = {r: e for r, e in entries.items() if e is not None}
            signatures = defaultdict(list)
            for r, e in present.items():
                signatures[(_op(e), json.dumps(e.get("input_sizes")), json.dumps(e.get("input_dtypes")))].append(r)
            if not missing and len(signatures) == 1:
                continue
            variants = [{"op": op, "input_sizes": json.loads(sizes), "input_dtypes": json.loads(dtypes),
                         "ranks": ranks} for (op, sizes, dtypes), ranks in
                        sorted(signatures.items(), key=lambda kv: -len(kv[1]))]
            kind = "mismatch" if len(signatures) > 1 else "missing"
            findings.append({"process_group": pg, "collective_seq_id": seq, "kind": kind,
                             "variants": variants, "missing_ranks": missing,
                             "last_seq_by_rank": last_seq, "ranks_without_dump": absent_dumps})
            break
    return {"ranks": sorted(dumps), "process_groups": groups, "findings": findings,
            "agree": not findings}


def describe(finding: dict[str, Any]) -> str:
    seq, pg = finding["collective_seq_id"], finding["process_group"]
    majority = finding["variants"][0] if finding["variants"] else None
    if finding["kind"] == "missing" and majority:
        return (f"process group {pg}, collective #{seq}: ranks {majority['ranks']} entered {majority['op']} "
                f"(sizes {majority['input_sizes']}); ranks {finding['missing_ranks']} never reached it "
                f"(their last collective is #{min(finding['last_seq_by_rank'][r] for r in finding['missing_ranks'])})")
    parts = [f"ranks {v['ranks']}: {v['op']} sizes {v['input_sizes']} {v['input_dtypes']}" for v in finding["variants"]]
    text = f"process group {pg}, collective #{seq}: ranks disagree: " + "; ".join(parts)
    if finding["missing_ranks"]:
        text += f"; ranks {finding['missing_ranks']} never reached it"
    return text
