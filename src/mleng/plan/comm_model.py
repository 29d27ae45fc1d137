"""Is a data-parallel config communication-bound: DDP / ZeRO-1/2/3 / FSDP collectives per step at the payload each
sends (per bucket or per block, not one big buffer), timed with MEASURED busbw from stored `mleng comm` runs, against
the compute time of the step from a stored `mleng step` run (or a given achieved TFLOPS, or MAMF/peak x an MFU).

The volumes are the book's (formulas section 5.5): DDP one all-reduce of the gradients (2x the bytes), ZeRO-1/2 a
reduce-scatter plus an all-gather (2x), ZeRO-3/FSDP two all-gathers plus a reduce-scatter (3x). A collective of
`size` bytes (nccl-tests' size: the larger buffer) on n ranks moves size x factor(op, n) bytes through each rank's
link, so it takes size x factor / busbw.

Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mleng.errors import UsageError

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
DDP_BUCKET_BYTES = 25 * 2**20   # torch DDP bucket_cap_mb=25
ZERO_BUCKET_ELEMENTS = 5 * 10**8  # DeepSpeed reduce_bucket_size / allgather_bucket_size


def book_feasibility(comms_multiplier: float, n_bytes: float, model_size_b: float, throughput_gbps: float,
                     n_passes: float, seqlen: int, global_batch: int, total_gpus: int,
                     tflops_wo_comms: float) -> dict[str, float]:
    """The book's ZeRO feasibility check (section 5.5), exactly as written:
    comms_time = comms_multiplier * n_bytes * model_size_in_B / inter_node_throughput_GBps;
    compute_time = n_passes * n_bytes * model_size_in_B * seqlen * global_batch_size
                   / (total_gpus * 1e3 * tflops_wo_comms)."""
    for name, v in (("throughput", throughput_gbps), ("tflops", tflops_wo_comms), ("gpus", total_gpus)):
        if not v > 0:
            raise UsageError(f"{name} must be positive, got {v!r}")
    comms = comms_multiplier * n_bytes * model_size_b / throughput_gbps
    compute = n_passes * n_bytes * model_size_b * seqlen * global_batch / (total_gpus * 1e3 * tflops_wo_comms)
    return {"comms_s": comms, "compute_s": compute, "comm_bound": comms > compute,
            "exposed_s": max(0.0, comms - compute)}


# ------------------------------------------------------------------------------------------ busbw curves

@dataclasses.dataclass
class BusbwCurve:
    """busbw (GB/s) against size for one collective, from one stored run (or a given constant)."""

    op: str
    points: list[tuple[int, float]]      # (size_bytes, busbw_gbps), sorted
    world_size: int | None
    source: str
    hosts: int | None = None

    def at(self, size: float) -> tuple[float, str]:
        """busbw at `size`: log-log interpolation between the nearest stored sizes; the end values beyond them."""
        pts = self.points
        if len(pts) == 1:
            return pts[0][1], "one value for every size"
        if size <= pts[0][0]:
            return pts[0][1], f"below the smallest stored size ({pts[0][0]:,} B): its busbw"
        if size >= pts[-1][0]:
            return pts[-1][1], f"above the largest stored size ({pts[-1][0]:,} B): its busbw"
        for (s0, b0), (s1, b1) in zip(pts, pts[1:]):
            if s0 <= size <= s1:
                if s0 == s1 or b0 <= 0 or b1 <= 0:
                    return b0, "stored"
                t = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
                return math.exp(math.log(b0) + t * (math.log(b1) - math.log(b0))), \
                    f"interpolated between {s0:,} and {s1:,} B"
        return pts[-1][1], "stored"


def curves_from_record(record: dict[str, Any]) -> dict[str, BusbwCurve]:
    """Per-op busbw curves of a stored `mleng comm` record (kind `collective`); impossible rows are skipped."""
    params = record.get("params") or {}
    world = params.get("world_size")
    ranks = (record.get("machine") or {}).get("ranks") or []
    hosts = len({r.get("host") for r in ranks}) or None
    out: dict[str, list[tuple[int, float]]] = {}
    for row in record.get("rows") or []:
        if row.get("error") or not row.get("busbw_gbps") or row.get("one_rank_in_place"):
            continue
        out.setdefault(row["op"], []).append((int(row["size_bytes"]), float(row["busbw_gbps"])))
    src = f"stored mleng comm run {record.get('id')} ({world} ranks" + (f" on {hosts} host(s)" if hosts else "") \
          + f", {params.get('backend', '?')})"
    return {op: BusbwCurve(op, sorted(pts), world, src, hosts) for op, pts in out.items()}


def constant_curves(busbw_gbps: float, note: str) -> dict[str, BusbwCurve]:
    if not busbw_gbps > 0:
        raise UsageError(f"--busbw {busbw_gbps:g}: must be positive (GB/s)")
    return {op: BusbwCurve(op, [(1, busbw_gbps)], None, note) for op in ("all_reduce", "all_gather", "reduce_scatter")}


def find_comm_record(store, world_size: int | None, run_id: str | None = None) -> dict[str, Any] | None:
    """A stored collective run: the given one, else the newest with the plan's world size, else the newest
    multi-rank one."""
    if run_id:
        m = store.get(run_id)
        if m.kind != "comm":
            raise UsageError(f"run {m.id} is a {m.kind} run, not `mleng comm`",
                             hint="`mleng results list --kind comm`")
        return m.to_dict()
    best = None
    for m in store.iter_records("comm"):
        rec = m.to_dict()
        n = (rec.get("params") or {}).get("world_size") or 0
        if rec.get("status") != "complete" or n < 2:
            continue
        key = (n == world_size, rec.get("started_at") or "")
        if best is None or key > best[0]:
            best = (key, rec)
    return best[1] if best else None


# ------------------------------------------------------------------------------------------ the plan

@dataclasses.dataclass
class Collective:
    op: str
    size_bytes: float      # nccl-tests' size: the larger buffer per rank
    count: float           # how many per step
    what: str

    def time_s(self, n: int, curves: dict[str, BusbwCurve]) -> tuple[float, float, str]:
        from mleng.specs.formulas import busbw_factor

        curve = curves.get(self.op) or curves.get("all_reduce")
        if curve is None:
            raise UsageError(f"no measured busbw for {self.op}",
                             hint=f"run `mleng comm --op {self.op}` or give --busbw")
        bw, how = curve.at(self.size_bytes)
        if curve.op != self.op:
            how += f"; {self.op} not stored: {curve.op}'s busbw used"
        return self.size_bytes * busbw_factor(self.op, n) / (bw * 1e9), bw, how


def collectives(strategy: str, params_by_unit: list[int], grad_accum: int, param_bytes: int, grad_bytes: int,
                bucket_bytes: int | None = None, units_per_gather: int = 1) -> list[Collective]:
    """What one optimizer step sends per GPU. params_by_unit: parameters of each FSDP unit in order (the
    blocks, then the root: embeddings and head)."""
    total = sum(params_by_unit)
    if strategy == "ddp":
        bucket = bucket_bytes or DDP_BUCKET_BYTES
        nbytes = total * grad_bytes
        count = nbytes / bucket
        return [Collective("all_reduce", min(bucket, nbytes), max(count, 1.0),
                           f"gradients in {min(bucket, nbytes) / 2**20:.0f} MiB buckets, once per step (no_sync in "
                           "accumulation)")]
    if strategy in ("zero1", "zero2"):
        out = []
        for op, b, what in (("reduce_scatter", grad_bytes, "gradients, once per step"),
                            ("all_gather", param_bytes, "updated parameters after the step")):
            bucket = bucket_bytes or ZERO_BUCKET_ELEMENTS * b
            nbytes = total * b
            out.append(Collective(op, min(bucket, nbytes), max(nbytes / bucket, 1.0),
                                  what + f", in {min(bucket, nbytes) / 2**20:.0f} MiB buckets"))
        return out
    if strategy in ("zero3", "fsdp"):
        blocks, root = params_by_unit[:-1], params_by_unit[-1]
        group = max(1, units_per_gather)
        units = [sum(blocks[i:i + group]) for i in range(0, len(blocks), group)]
        out = []
        unit_size = max(units) if units else 0
        n_units = len(units)
        if unit_size:
            out.append(Collective("all_gather", unit_size * param_bytes, 2 * n_units * grad_accum,
                                  f"{group} block(s) per unit gathered for forward and again for backward, every "
                                  "micro-batch"))
            out.append(Collective("reduce_scatter", unit_size * grad_bytes, n_units,
                                  "each unit's gradients, on the last micro-batch"))
        if root:
            out.append(Collective("all_gather", root * param_bytes, grad_accum,
                                  "the root (embeddings, head), kept through the backward"))
            out.append(Collective("reduce_scatter", root * grad_bytes, 1, "the root's gradients"))
        return out
    raise UsageError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")


def time_collectives(colls: list[Collective], n: int, curves: dict[str, BusbwCurve]) -> tuple[float, list[dict]]:
    rows, total = [], 0.0
    for c in colls:
        t, bw, how = c.time_s(n, curves)
        rows.append({"op": c.op, "size_bytes": int(c.size_bytes), "count": round(c.count, 2),
                     "busbw_gbps": round(bw, 3), "busbw_how": how, "time_s": c.count * t,
                     "bytes_per_step": int(c.count * c.size_bytes), "what": c.what})
        total += c.count * t
    return total, rows
