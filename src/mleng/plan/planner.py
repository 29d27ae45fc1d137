"""`mleng plan`: for a training config on N GPUs, each data-parallel strategy's memory (mleng memory), its
collectives at measured busbw (comm_model) and the step's compute time; which are communication-bound, by how
many seconds per step, what changes that, and how many GPUs each needs to fit."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mleng.errors import UsageError
from mleng.plan import comm_model
from mleng.plan.arch import Arch

# Bucket / unit sizes tried to say what changes a communication-bound config.
DDP_BUCKETS_MIB = (25, 100, 500)
ZERO_BUCKETS_MIB = (50, 200, 1000)
FSDP_UNITS = (1, 2, 4)
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclasses.dataclass
class Compute:
    """Achieved hardware TFLOPS per GPU without communication, and where the number comes from."""

    tflops: float
    source: str


@dataclasses.dataclass
class PlanSetup:
    gpus: int
    seq: int = 2048
    micro_batch: int = 1
    grad_accum: int = 1
    dtype: str = "bfloat16"
    recompute: str = "none"
    optimizer: str = "adamw"
    gpu: str | None = None
    gpus_per_node: int = 8
    param_bytes: int | None = None   # bytes per parameter in the all-gathers (default: the compute dtype's)
    grad_bytes: int | None = None    # bytes per gradient in the reductions (default 4: fp32, as mleng step)
    strategies: tuple[str, ...] = comm_model.STRATEGIES


def grad_accum_for(global_batch: int | None, grad_accum: int | None, micro_batch: int, gpus: int) -> int:
    if global_batch is None:
        return grad_accum or 1
    per_step = micro_batch * gpus
    if global_batch < 1 or global_batch % per_step:
        raise UsageError(f"--global-batch {global_batch} is not a multiple of --micro-batch {micro_batch} x "
                         f"{gpus} GPUs = {per_step}")
    implied = global_batch // per_step
    if grad_accum is not None and grad_accum != implied:
        raise UsageError(f"--global-batch {global_batch} implies --grad-accum {implied}, not {grad_accum}")
    return implied


def compute_time_s(arch: Arch, s: PlanSetup, compute: Compute) -> tuple[float, dict[str, Any]]:
    """Seconds of compute per optimizer step per GPU: hardware FLOPs (recomputation included) / achieved rate."""
    from mleng.step.flops import flops_per_token

    cfg = arch.step_config() if not (arch.moe or arch.mla) else None
    tokens = s.micro_batch * s.seq * s.grad_accum
    if cfg is not None:
        f = flops_per_token(cfg, s.seq, recompute=s.recompute == "full")
        per_token, convention = f.hardware, "6*N_matmul + 12*L*H*Q*T per token (PaLM), plus recomputation"
    else:
        # MoE / MLA: 6 x activated parameters per token (the book's convention), recomputation as 8 x
        p = arch.params()
        active = p.total - arch.moe_layers * (arch.moe_mlp_params() - 3 * arch.dim * arch.active_ffn_dim(True))
        per_token = (8.0 if s.recompute == "full" else 6.0) * active
        convention = "6 x activated parameters per token (8 x with full recompute), attention not counted"
    flops = per_token * tokens
    return flops / (compute.tflops * 1e12), {"flops_per_token": per_token, "tokens_per_gpu": tokens,
                                             "convention": convention, "tflops": compute.tflops,
                                             "tflops_source": compute.source}


def _units(arch: Arch) -> list[int]:
    """FSDP units in order: every block, then the root (embeddings, final norm, head)."""
    p = arch.params()
    per_block = p.layers // arch.n_layers
    root = p.embedding + (0 if p.tied else p.output) + p.final_norm
    return [per_block] * arch.n_layers + [root]


def _strategy_memory(arch: Arch, s: PlanSetup, strategy: str, gpus: int, coeff_data) -> dict[str, Any]:
    from mleng.plan.memory import TrainSetup, estimate_training

    zero = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 0}[strategy]
    setup = TrainSetup(seq=s.seq, micro_batch=s.micro_batch, dtype=s.dtype, optimizer=s.optimizer, zero=zero,
                       fsdp=strategy == "fsdp", gpus=gpus, recompute=s.recompute, gpu=s.gpu)
    est = estimate_training(arch, setup, coeff_data)
    return est


def _fits(est: dict[str, Any]) -> bool | None:
    return est["gpu"]["fits"] if est.get("gpu") else None


def gpus_needed(arch: Arch, s: PlanSetup, strategy: str, coeff_data) -> int | None:
    """The fewest GPUs (1, 2, 4, then multiples of a node) with which the strategy fits --gpu."""
    from mleng.plan.memory import TrainSetup, device_memory, estimate_training

    if not s.gpu:
        return None
    dev = device_memory(s.gpu)
    zero = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 0}[strategy]
    for n in GPU_COUNTS:
        setup = TrainSetup(seq=s.seq, micro_batch=s.micro_batch, dtype=s.dtype, optimizer=s.optimizer, zero=zero,
                           fsdp=strategy == "fsdp", gpus=n, recompute=s.recompute)
        if estimate_training(arch, setup, coeff_data)["total_bytes"] <= dev.usable_bytes:
            return n
    return None


def plan(arch: Arch, s: PlanSetup, curves: dict[str, comm_model.BusbwCurve], compute: Compute,
         coeff_data=None) -> dict[str, Any]:
    if s.gpus < 2:
        raise UsageError(f"--gpus {s.gpus}: data parallelism needs at least 2 GPUs to communicate")
    compute_s, compute_info = compute_time_s(arch, s, compute)
    param_bytes = s.param_bytes or (4 if s.dtype == "float32" else 2)
    grad_bytes = s.grad_bytes or 4
    units = _units(arch)
    out_rows = []
    for strategy in s.strategies:
        est = _strategy_memory(arch, s, strategy, s.gpus, coeff_data)
        colls = comm_model.collectives(strategy, units, s.grad_accum, param_bytes, grad_bytes)
        comm_s, rows = comm_model.time_collectives(colls, s.gpus, curves)
        # What changes it: bucket sizes (DDP, ZeRO-1/2) or blocks per FSDP unit (ZeRO-3/FSDP).
        alternatives = []
        if strategy == "ddp":
            for mib in DDP_BUCKETS_MIB:
                t, _ = comm_model.time_collectives(comm_model.collectives(
                    strategy, units, s.grad_accum, param_bytes, grad_bytes, bucket_bytes=mib * 2**20), s.gpus, curves)
                alternatives.append({"bucket_mib": mib, "comm_s": round(t, 4)})
        elif strategy in ("zero1", "zero2"):
            for mib in ZERO_BUCKETS_MIB:
                t, _ = comm_model.time_collectives(comm_model.collectives(
                    strategy, units, s.grad_accum, param_bytes, grad_bytes, bucket_bytes=mib * 2**20), s.gpus, curves)
                alternatives.append({"bucket_mib": mib, "comm_s": round(t, 4)})
        else:
            for k in FSDP_UNITS:
                t, _ = comm_model.time_collectives(comm_model.collectives(
                    strategy, units, s.grad_accum, param_bytes, grad_bytes, units_per_gather=k), s.gpus, curves)
                alternatives.append({"blocks_per_unit": k, "comm_s": round(t, 4)})
        out_rows.append({
            "strategy": strategy, "comm_s": round(comm_s, 4), "compute_s": round(compute_s, 4),
            "comm_bound": comm_s > compute_s, "exposed_s": round(max(0.0, comm_s - compute_s), 4),
            "step_s_overlapped": round(max(comm_s, compute_s), 4), "step_s_serial": round(comm_s + compute_s, 4),
            "bytes_per_step": sum(r["bytes_per_step"] for r in rows),
            "memory_gib": round(est["total_bytes"] / 2**30, 2), "fits": _fits(est),
            "gpus_needed": gpus_needed(arch, s, strategy, coeff_data),
            "collectives": [{**r, "time_s": round(r["time_s"], 5)} for r in rows], "alternatives": alternatives,
        })
    fitting = [r for r in out_rows if r["fits"] is not False]
    order = {name: i for i, name in enumerate(comm_model.STRATEGIES)}
    best = min(fitting, key=lambda r: (r["step_s_overlapped"], order[r["strategy"]])) if fitting else None
    verdict = _verdict(best, out_rows, s)
    nodes = math.ceil(s.gpus / s.gpus_per_node)
    sources = sorted({c.source for c in curves.values()})
    assumptions = [
        f"compute {compute_s:.3f} s per step per GPU: {compute_info['tokens_per_gpu']:,} tokens x "
        f"{compute_info['flops_per_token']:.4g} FLOPs ({compute_info['convention']}) at "
        f"{compute.tflops:g} TFLOPS ({compute.source}) (--step, --tflops, --mfu)",
        "busbw: " + "; ".join(sources) + " (--comm, --busbw, --run-comm)",
        f"all-gathers carry {param_bytes} B/param, reductions {grad_bytes} B/param (mleng step: bf16 parameters "
        "gathered, fp32 gradients reduced) (--param-bytes, --grad-bytes)",
        "communication fully overlapped with compute: a config is communication-bound when its collectives take "
        "longer than its compute; the serial step time (no overlap) is shown beside it",
        f"DDP buckets {comm_model.DDP_BUCKET_BYTES // 2**20} MiB (torch's bucket_cap_mb), ZeRO-1/2 buckets of 5e8 "
        "elements (DeepSpeed's reduce/allgather_bucket_size), ZeRO-3/FSDP one unit per block plus the root",
        f"grad accumulation {s.grad_accum}: DDP and ZeRO-1/2 reduce once per step; ZeRO-3/FSDP gather every "
        "micro-batch and reduce-scatter on the last (mleng step's no_sync / set_requires_gradient_sync)",
    ]
    hosts = {c.hosts for c in curves.values() if c.hosts}
    if nodes > 1 and hosts and max(hosts) < 2:
        assumptions.append(f"{s.gpus} GPUs span {nodes} nodes but the busbw was measured on one host: across nodes "
                           "the NIC rate bounds it; run `mleng comm` across nodes (`mleng slurm`) for this plan")
    worlds = {c.world_size for c in curves.values() if c.world_size}
    if worlds and s.gpus not in worlds:
        assumptions.append(f"the busbw was measured at {', '.join(map(str, sorted(worlds)))} ranks, the plan has "
                           f"{s.gpus}: busbw carries over between rank counts on one fabric, to a first order")
    return {"model": arch.name, "parameters": arch.params().total, "gpus": s.gpus, "nodes": nodes,
            "setup": dataclasses.asdict(s) | {"strategies": list(s.strategies)}, "compute": compute_info,
            "strategies": out_rows, "best": best["strategy"] if best else None, "verdict": verdict,
            "assumptions": assumptions}


def _verdict(best, rows, s: PlanSetup) -> list[str]:
    if best is None:
        need = [f"{r['strategy']} {r['gpus_needed']}" for r in rows if r["gpus_needed"]]
        return [f"nothing fits {s.gpu} at {s.gpus} GPUs" + (f"; GPUs needed: {', '.join(need)}" if need else
                                                             ": not even at 4096 GPUs")]
    out = []
    name = best["strategy"]
    if best["comm_bound"]:
        out.append(f"{name} is the fastest that fits, and it is communication-bound: {best['comm_s']:.3f} s of "
                   f"collectives vs {best['compute_s']:.3f} s of compute, {best['exposed_s']:.3f} s per step exposed")
        alt = min(best["alternatives"], key=lambda a: a["comm_s"])
        key = "bucket_mib" if "bucket_mib" in alt else "blocks_per_unit"
        if alt["comm_s"] < best["comm_s"] * 0.95:
            what = f"{alt[key]} MiB buckets" if key == "bucket_mib" else f"{alt[key]} blocks per FSDP unit"
            out.append(f"{what} bring its collectives to {alt['comm_s']:.3f} s"
                       + (" (no longer communication-bound)" if alt["comm_s"] <= best["compute_s"] else ""))
        out.append("a larger micro-batch or sequence (more compute per byte sent) or fewer, faster-linked GPUs "
                   "change it too")
    else:
        out.append(f"{name}: not communication-bound: {best['comm_s']:.3f} s of collectives hide under "
                   f"{best['compute_s']:.3f} s of compute ({best['compute_s'] - best['comm_s']:.3f} s to spare)")
    for r in rows:
        if r["fits"] is False:
            out.append(f"{r['strategy']} does not fit {s.gpu} at {s.gpus} GPUs ({r['memory_gib']} GiB)"
                       + (f"; it needs {r['gpus_needed']}" if r["gpus_needed"] else ""))
    return out
