"""One Measurement from a multi-node job: rows per node, the straggler named, a drain line for it."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import statistics
from typing import Any

from mleng.errors import UsageError
from mleng.results.record import SCHEMA_NAME, Measurement, current_kind

DEFAULT_STRAGGLER_RATIO = 0.9


def drain_line(node: str, reason: str) -> str:
    """The command an admin pastes to take a node out of scheduling; mleng prints it, never runs it."""
    reason = reason.replace('"', "'")
    return f'scontrol update nodename={node} state=drain reason="mleng: {reason}"'


def find_stragglers(per_node: list[dict], key: str, ratio: float) -> tuple[float | None, list[dict]]:
    """Nodes whose key is below ratio x the median of all nodes (higher is better); needs two or more values."""
    values = [row[key] for row in per_node if isinstance(row.get(key), (int, float))]
    if len(values) < 2 or ratio <= 0:
        return (statistics.median(values) if values else None), []
    median = statistics.median(values)
    slow = [row for row in per_node if isinstance(row.get(key), (int, float)) and row[key] < ratio * median]
    return median, slow


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _is_record(data: Any) -> bool:
    return isinstance(data, dict) and str(data.get("schema", "")).startswith(SCHEMA_NAME + "/")


def _record_in(path: str) -> dict | None:
    """The record a command printed with --json, even after lines it printed before it."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    decoder = json.JSONDecoder()
    for match in re.finditer(r"^\{", text, re.MULTILINE):
        try:
            data, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if _is_record(data):
            return data
    return None


def read_job_dir(path: str) -> dict:
    """Everything the job left in its results folder."""
    if not os.path.isdir(path):
        raise UsageError(f"{path} is not a folder", hint="give the job-<JOBID> folder the sbatch script wrote")
    job = _read_json(os.path.join(path, "job.json"))
    if not isinstance(job, dict):
        raise UsageError(f"{path} has no readable job.json, so it is not the results folder of an mleng sbatch job "
                         "(or the job never started)", hint="look at the job's slurm-<JOBID>.out")
    exit_code = None
    try:
        with open(os.path.join(path, "exit_code")) as f:
            exit_code = int(f.read().strip())
    except (OSError, ValueError):
        pass
    ranks = {}
    for rank_file in glob.glob(os.path.join(path, "ranks", "rank-*.json")):
        info = _read_json(rank_file)
        if isinstance(info, dict) and "rank" in info:
            ranks[int(info["rank"])] = info
    torchrun_record = None
    for log in sorted(glob.glob(os.path.join(path, "torchrun", "*", "*", "attempt_*", "*", "stdout.log"))):
        record = _record_in(log)
        if record is not None:
            torchrun_record = record
    nodes = {}
    for node_file in sorted(glob.glob(os.path.join(path, "nodes", "*.json"))):
        node = os.path.basename(node_file)[:-len(".json")]
        nodes[node] = _record_in(node_file)
    return {"path": os.path.abspath(path), "job": job, "exit_code": exit_code, "ranks": ranks,
            "record": torchrun_record, "node_records": nodes}


def merge_job_dir(path: str, ratio: float = DEFAULT_STRAGGLER_RATIO) -> Measurement:
    """The job's merged record: rank 0's own for check/comm, with the node of every rank; else one row per node."""
    found = read_job_dir(path)
    job = found["job"]
    slurm = {"job_id": str(job.get("job_id")), "nodelist": job.get("nodelist"), "nodes": job.get("nodes"),
             "mode": job.get("mode"), "ranks_per_node": job.get("ranks_per_node"),
             "gpus_per_node": job.get("gpus_per_node"), "rendezvous": job.get("rendezvous"),
             "results_dir": found["path"], "exit_code": found["exit_code"]}
    if job.get("mode") == "torchrun":
        record = _merge_world(found, slurm)
    else:
        record = _merge_independent(found, slurm, job.get("command") or "?")
    annotate(record, ratio)
    return record


def _merge_world(found: dict, slurm: dict) -> Measurement:
    raw = found["record"]
    if raw is None:
        record = Measurement.start(_kind_of(found["job"].get("command")), {})
        record.finish("failed", "no rank wrote a result: the job failed before rank 0 finished "
                                f"(exit code {found['exit_code']}); see the job's slurm-{slurm['job_id']}.out")
        record.id = _job_record_id(record.kind, slurm)
    else:
        record = Measurement.from_dict(raw)
    ranks = found["ranks"]
    for row in record.rows:
        if "rank" in row and int(row["rank"]) in ranks:
            row["node"] = ranks[int(row["rank"])]["node"]
    for info in (record.machine.get("ranks") or []):
        if int(info.get("rank", -1)) in ranks:
            info["node"] = ranks[int(info["rank"])]["node"]
    slurm["rank_nodes"] = {str(r): ranks[r]["node"] for r in sorted(ranks)}
    record.params["slurm"] = slurm
    # comm --per-node: every node's own busbw, beside the whole-world record
    per_node = {node: rec for node, rec in found["node_records"].items() if rec is not None}
    if per_node:
        record.summary["node_records"] = {node: _node_summary(rec) for node, rec in per_node.items()}
    missing = sorted(node for node, rec in found["node_records"].items() if rec is None)
    if missing:
        record.summary["nodes_without_result"] = missing
    return record


def _job_record_id(kind: str, slurm: dict) -> str:
    """One id per job folder: merging the same job again replaces its record instead of adding one."""
    digest = hashlib.sha256(slurm["results_dir"].encode()).hexdigest()[:6]
    return f"{kind}-slurmjob{slurm['job_id']}-{digest}"


def _kind_of(command: str | None) -> str:
    return command or "slurm"  # a record's kind is its command's name


def _node_summary(rec: dict) -> dict:
    summary = rec.get("summary") or {}
    out = {"id": rec.get("id"), "kind": current_kind(rec.get("kind") or ""), "status": rec.get("status"),
           "error": rec.get("error"), "value": summary.get("value"), "unit": summary.get("unit")}
    if out["kind"] == "comm":
        ops = summary.get("ops") or {}
        if ops:
            op, best = next(iter(ops.items()))
            out.update(op=op, peak_busbw_gbps=best.get("peak_busbw_gbps"))
    if summary.get("per_device"):
        out["per_device"] = summary["per_device"]
    if rec.get("kind") == "doctor":
        counts = summary.get("counts") or {}
        out.update(verdict=summary.get("verdict"), fail=counts.get("fail"), warn=counts.get("warn"),
                   problems=[r.get("summary") for r in rec.get("rows") or [] if r.get("severity") == "fail"][:3])
    return out


def _merge_independent(found: dict, slurm: dict, command: str) -> Measurement:
    records = found["node_records"]
    first = next((r for r in records.values() if r is not None), None)
    kind = current_kind(first.get("kind") or command) if first else command
    record = Measurement.start(kind, {"command": command, "node_params": first.get("params") if first else {},
                                      "slurm": slurm}, machine=(first or {}).get("machine") or {})
    record.id = _job_record_id(kind, slurm)
    rows = []
    for node, rec in records.items():
        if rec is None:
            rows.append({"node": node, "status": "failed", "error": "no JSON result from this node (see the log)"})
            continue
        rows.append({"node": node, "host": ((rec.get("machine") or {}).get("host") or {}).get("hostname"),
                     **_node_summary(rec), "record_id": rec.get("id")})
        rows[-1].pop("id", None)
    record.rows = rows
    values = [r for r in rows if isinstance(r.get("value"), (int, float))]
    slowest = min(values, key=lambda r: r["value"], default=None)
    record.summary = {"value": slowest["value"] if slowest else None,
                      "unit": slowest.get("unit") if slowest else None,
                      "theoretical": ((first or {}).get("summary") or {}).get("theoretical"),
                      "ratio": None, "headline": "slowest node's value", "slowest_node": slowest["node"] if slowest else None,
                      "nodes": len(rows), "nodes_ok": sum(1 for r in rows if r.get("status") == "complete")}
    theoretical = record.summary["theoretical"]
    if slowest and isinstance(theoretical, (int, float)) and theoretical:
        record.summary["ratio"] = round(slowest["value"] / theoretical, 4)
    if kind == "doctor":
        # The same stack on every node: versions and firmware compared, the odd node named.
        from mleng.doctor.consistency import compare_nodes

        machines = {node: rec.get("machine") or {} for node, rec in records.items() if rec is not None}
        record.summary["consistency"] = [f.to_row() for f in compare_nodes(machines)] if len(machines) > 1 else []
    bad = [r["node"] for r in rows if r.get("status") != "complete"]
    expected = slurm.get("nodes")
    if isinstance(expected, int) and len(rows) < expected:
        bad.append(f"{expected - len(rows)} node(s) wrote nothing")
    status = "complete" if not bad else ("interrupted" if any(r.get("status") == "interrupted" for r in rows)
                                         else "failed")
    record.finish(status, None if not bad else f"no complete result from: {', '.join(bad)}")
    return record


def per_node_table(record: Measurement) -> list[dict]:
    """A row per node for any multi-node record: what ran there and the number to compare nodes by."""
    if record.kind == "check" and record.rows and "rank" in record.rows[0]:
        return _check_nodes(record)
    if record.kind == "comm":
        return _comm_nodes(record)
    if record.rows and all("node" in r for r in record.rows):  # merged per-node commands
        table = []
        for row in record.rows:
            entry = {k: row.get(k) for k in ("node", "host", "status", "value", "unit", "record_id")}
            for k in ("verdict", "fail", "warn", "problems"):
                if k in row:
                    entry[k] = row[k]
            if row.get("per_device"):
                rates = [d.get("tflops_median") for d in row["per_device"] if d.get("tflops_median") is not None]
                entry["devices"] = len(row["per_device"])
                entry["slowest_device"] = min(row["per_device"], key=lambda d: d.get("tflops_median") or 0,
                                              default={}).get("device")
                entry["value"] = min(rates) if rates else entry["value"]
            table.append(entry)
        return table
    return []


def _node_of(row: dict) -> str:
    return row.get("node") or row.get("slurm_node") or row.get("host") or "?"


def _check_nodes(record: Measurement) -> list[dict]:
    nodes: dict[str, dict] = {}
    for row in record.rows:
        entry = nodes.setdefault(_node_of(row), {"node": _node_of(row), "host": row.get("host"), "ranks": [],
                                                 "all_reduce_ok": True, "barrier_ms": None})
        entry["ranks"].append(row["rank"])
        entry["all_reduce_ok"] = entry["all_reduce_ok"] and bool(row.get("all_reduce_ok"))
        if isinstance(row.get("barrier_ms"), (int, float)):
            entry["barrier_ms"] = max(entry["barrier_ms"] or 0.0, row["barrier_ms"])
        if row.get("alloc_ok") is False:
            entry["alloc_ok"] = False
    pairs = record.summary.get("pairs")
    if pairs and pairs.get("matrix_gbps"):
        node_of_rank = {row["rank"]: _node_of(row) for row in record.rows}
        members = pairs["members"]
        for name, entry in nodes.items():
            rates, local = [], []
            for i, src in enumerate(members):
                for j, dst in enumerate(members):
                    value = pairs["matrix_gbps"][i][j]
                    if value is None or name not in (node_of_rank.get(src), node_of_rank.get(dst)):
                        continue
                    (local if node_of_rank.get(src) == node_of_rank.get(dst) else rates).append(value)
            # The pairs that leave the node say most about its NIC; a one-node job has only local ones.
            chosen = rates or local
            entry["pair_gbps"] = statistics.median(chosen) if chosen else None
            entry["pairs"] = len(chosen)
    for entry in nodes.values():
        entry["ranks"] = ",".join(str(r) for r in sorted(entry["ranks"]))
    return list(nodes.values())


def _comm_nodes(record: Measurement) -> list[dict]:
    nodes: dict[str, dict] = {}
    for info in record.machine.get("ranks") or []:
        entry = nodes.setdefault(_node_of(info), {"node": _node_of(info), "host": info.get("host"), "ranks": [],
                                                  "devices": []})
        entry["ranks"].append(info.get("rank"))
        entry["devices"].append(info.get("device"))
    for name, summary in (record.summary.get("node_records") or {}).items():
        entry = nodes.setdefault(name, {"node": name, "host": None, "ranks": [], "devices": []})
        entry["busbw_gbps"] = summary.get("peak_busbw_gbps")
        entry["op"] = summary.get("op")
        entry["node_status"] = summary.get("status")
    for entry in nodes.values():
        entry["ranks"] = ",".join(str(r) for r in sorted(r for r in entry["ranks"] if r is not None))
        entry["devices"] = ",".join(sorted(set(d for d in entry["devices"] if d)))
    return list(nodes.values())


# What each kind compares nodes by (higher is better), and how a reason for draining reads.
_KEYS = {"check": ("pair_gbps", "GB/s point-to-point"), "comm": ("busbw_gbps", "GB/s busbw inside the node")}


def annotate(record: Measurement, ratio: float = DEFAULT_STRAGGLER_RATIO) -> None:
    """Add per_node, stragglers and drain lines to the record's summary."""
    table = per_node_table(record)
    key, what = _KEYS.get(record.kind, ("value", record.summary.get("unit") or ""))
    median, slow = find_stragglers(table, key, ratio)
    job_id = (record.params.get("slurm") or {}).get("job_id")
    tag = f" (job {job_id})" if job_id else ""
    drains, stragglers = [], []
    for row in table:
        row["straggler"] = any(row is other for other in slow)
        if isinstance(row.get(key), (int, float)) and median:
            row["of_median"] = round(row[key] / median, 3)
    for row in slow:
        detail = f"{record.kind} {row[key]:.3g} {what} < {ratio:g} x median {median:.3g}{tag}"
        stragglers.append({"node": row["node"], key: row[key], "median": median, "reason": detail})
        drains.append(drain_line(row["node"], detail))
    for row in table:  # doctor found something that fails on this node
        if row.get("verdict") == "fail" and row.get("problems"):
            detail = f"doctor: {row['problems'][0]}{tag}"
            stragglers.append({"node": row["node"], "reason": detail})
            drains.append(drain_line(row["node"], detail))
    for item in record.summary.get("consistency") or []:  # a node on another driver/NCCL/torch than the rest
        if item.get("severity") == "fail":
            for node in (item.get("measured") or {}).get("odd_nodes") or []:
                detail = f"doctor: {item['summary']}{tag}"
                stragglers.append({"node": node, "reason": detail})
                drains.append(drain_line(node, detail))
    for row in table:  # a wrong all-reduce is worse than slow: that node computes or moves wrong data
        if row.get("all_reduce_ok") is False:
            detail = f"check: all-reduce of ones wrong on ranks {row['ranks']}{tag}"
            stragglers.append({"node": row["node"], "reason": detail})
            drains.append(drain_line(row["node"], detail))
    record.summary["per_node"] = table
    record.summary["per_node_key"] = key if any(isinstance(r.get(key), (int, float)) for r in table) else None
    record.summary["per_node_median"] = median
    record.summary["straggler_ratio"] = ratio
    record.summary["stragglers"] = stragglers
    record.summary["drain"] = drains
    if len(table) == 2 and record.kind == "check" and slow == [] and record.summary.get("pairs"):
        record.summary["per_node_note"] = "with two nodes every pair has both of them at its ends: " \
                                          "a slow link cannot be pinned on one node"
