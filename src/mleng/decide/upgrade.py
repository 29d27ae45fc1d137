"""Does a GPU generation upgrade pay for itself: capability gate, then throughput turned into cost.

The method follows the two-gate framework of the ML Engineering Open Book ("When Is It Worth
Upgrading GPUs?"): first ask whether the new GPU enables something the old cannot (a dtype, enough
memory for a context length); then turn measured or spec throughput into cost per unit of work.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mleng.errors import UsageError
from mleng.measure.sizes import GIB

# The book's measured memory model for Llama-3.1-8B with ZeRO-3, activation checkpointing, CPU
# AdamW offload and Liger-Kernel: peak ~= 12.6 GiB + 0.00043 GiB per token, the same on both GPUs.
REFERENCE_PARAMS = 8e9
REFERENCE_GPUS = 8  # the book's run: one node of 8 GPUs, ZeRO-3 sharding the model state over them
REFERENCE_FIXED_GIB = 12.6
REFERENCE_PER_TOKEN_GIB = 0.00043
# Llama-3.1-8B shape, used when the model is that size and no shape is given.
REFERENCE_HIDDEN = 4096
REFERENCE_LAYERS = 32
# hidden/layers of common decoder models (Llama-3.1-8B: 4096/32 = 128), for estimating a shape
# from a parameter count alone.
HIDDEN_PER_LAYER = 128
USABLE_MEMORY_FRACTION = 0.93
DTYPE_ORDER = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "fp6", "fp4")


@dataclasses.dataclass
class Workload:
    kind: str = "dense"  # dense: matmul-bound; attention: a transformer whose attention share grows with seq_len
    seq_len: int = 8192
    model_params: float = REFERENCE_PARAMS
    hidden: int | None = None
    layers: int | None = None
    dtype: str = "bf16"
    need_dtype: str | None = None
    mfu: float = 0.40  # on the old GPU; only used to express cost per million tokens
    mfu_source: str | None = None  # a stored `mleng step` run that measured it, else assumed
    memory_fixed_gib: float | None = None
    memory_per_token_gib: float | None = None
    gpus: int = REFERENCE_GPUS  # GPUs the model state is sharded over (ZeRO-3 / FSDP)
    # With a model (a mleng step preset or config.json), gate 1 is `mleng memory` at an explicit layout.
    model: str | None = None
    zero: int | None = None
    recompute: str = "full"
    micro_batch: int = 1

    def shape(self) -> tuple[int, int]:
        if self.hidden and self.layers:
            return self.hidden, self.layers
        if math.isclose(self.model_params, REFERENCE_PARAMS, rel_tol=0.05):
            return REFERENCE_HIDDEN, REFERENCE_LAYERS
        # params ~= 12 * layers * hidden^2 for a decoder stack, with hidden = HIDDEN_PER_LAYER * layers.
        hidden = (HIDDEN_PER_LAYER * self.model_params / 12) ** (1 / 3)
        return int(round(hidden)), max(1, int(round(hidden / HIDDEN_PER_LAYER)))


def flops_per_token(workload: Workload) -> tuple[float, float]:
    """(dense, attention) training FLOPs per token: 6*N and 6*s*hidden*layers (causal)."""
    hidden, layers = workload.shape()
    dense = 6.0 * workload.model_params
    attention = 6.0 * workload.seq_len * hidden * layers if workload.kind == "attention" else 0.0
    return dense, attention


def attention_share(workload: Workload) -> float:
    dense, attention = flops_per_token(workload)
    return attention / (dense + attention)


def memory_model(workload: Workload) -> tuple[float, float]:
    """(fixed GiB, GiB per token) per GPU: given, or the book's 8B measurement scaled, sharded state
    with the parameter count over the GPUs, activations with the parameter count."""
    scale = workload.model_params / REFERENCE_PARAMS
    fixed = (workload.memory_fixed_gib if workload.memory_fixed_gib is not None
             else REFERENCE_FIXED_GIB * scale * REFERENCE_GPUS / workload.gpus)
    per_token = (workload.memory_per_token_gib if workload.memory_per_token_gib is not None
                 else REFERENCE_PER_TOKEN_GIB * scale)
    return fixed, per_token


def memory_needed_gib(workload: Workload) -> float:
    fixed, per_token = memory_model(workload)
    return fixed + per_token * workload.seq_len


def max_seq_len(workload: Workload, usable_gib: float) -> int:
    fixed, per_token = memory_model(workload)
    return max(0, int((usable_gib - fixed) / per_token))


def assumptions(workload: Workload) -> list[str]:
    """Every assumption the numbers rest on, each with the flag that changes it."""
    fixed, per_token = memory_model(workload)
    out = []
    if workload.memory_fixed_gib is None or workload.memory_per_token_gib is None:
        out.append(f"memory per GPU = {fixed:.1f} GiB + {per_token:.5f} GiB per token: the book's Llama-3.1-8B "
                   f"run (ZeRO-3, activation checkpointing, CPU AdamW offload, Liger-Kernel) scaled to "
                   f"{workload.model_params:.3g} parameters sharded over {workload.gpus} GPUs "
                   "(--gpus, --memory-fixed-gib, --memory-per-token-gib)")
    else:
        out.append(f"memory per GPU = {fixed:.1f} GiB + {per_token:.5f} GiB per token, as given")
    hidden, layers = workload.shape()
    if not (workload.hidden and workload.layers):
        out.append(f"model shape hidden {hidden}, {layers} layers, estimated from the parameter count "
                   "(--hidden, --layers)")
    if workload.mfu_source:
        out.append(f"{workload.mfu * 100:.1f}% MFU on the old GPU, measured by {workload.mfu_source}, for $ per "
                   "million tokens only (--from-step)")
    else:
        out.append(f"{workload.mfu * 100:.0f}% MFU on the old GPU, assumed, for $ per million tokens only "
                   "(--mfu, or --from-step ID to use a measured one)")
    out.append(f"usable memory is {USABLE_MEMORY_FRACTION * 100:.0f}% of the datasheet's (CUDA context, NCCL "
               "buffers, allocator slack)")
    return out


def usable_memory_gib(accelerator: Any) -> float:
    """What a training job can allocate: the CUDA context, NCCL buffers and allocator slack take the
    rest (the book measures ~130 GiB usable of an H200's 141)."""
    return float(accelerator.memory_gib) * USABLE_MEMORY_FRACTION


def _rate(accelerator: Any, dtype: str) -> float | None:
    value = (accelerator.tflops or {}).get(dtype)
    return float(value) if value else None


def decide(old: Any, new: Any, price_old: float, price_new: float, workload: Workload,
           mamf_old_tflops: float | None = None, mamf_new_tflops: float | None = None) -> dict[str, Any]:
    """The whole decision as a plain dict (also the --json output)."""
    if price_old <= 0 or price_new <= 0:
        raise UsageError("prices must be positive (dollars per GPU-hour)",
                         hint="pass --price-from and --price-to, e.g. --price-from 3.5 --price-to 6.0")
    if workload.kind not in ("dense", "attention"):
        raise UsageError(f"unknown workload {workload.kind!r}", hint="use --workload dense or --workload attention")
    if workload.seq_len <= 0 or workload.model_params <= 0:
        raise UsageError("--seq-len and --model-params must be positive")
    if not 0 < workload.mfu <= 1:
        raise UsageError(f"--mfu {workload.mfu:g}: MFU is a fraction of the peak, above 0 and at most 1",
                         hint="e.g. --mfu 0.4 for 40%")
    if workload.gpus < 1:
        raise UsageError(f"--gpus {workload.gpus}: give at least 1")
    from mleng.specs.catalog import normalize_dtype

    for flag, field in (("--dtype", "dtype"), ("--need-dtype", "need_dtype")):
        if getattr(workload, field):
            try:
                setattr(workload, field, normalize_dtype(getattr(workload, field)))
            except UsageError as exc:
                raise UsageError(f"{flag}: {exc.message}") from None
    dtype = workload.dtype
    peak_old, peak_new = _rate(old, dtype), _rate(new, dtype)
    if not peak_old or not peak_new:
        missing = old.name if not peak_old else new.name
        raise UsageError(f"{missing} has no published dense {dtype} rate",
                         hint="choose a dtype both support, e.g. --dtype bf16")

    # Gate 1: capability.
    new_dtypes = [d for d in DTYPE_ORDER if _rate(new, d) and not _rate(old, d)]
    usable_old, usable_new = usable_memory_gib(old), usable_memory_gib(new)
    need_gib = memory_needed_gib(workload)
    gate = None
    if workload.model:
        from mleng.plan.gate import memory_gate

        gate = memory_gate(workload.model, workload.seq_len, workload.gpus, workload.zero, workload.recompute,
                           workload.micro_batch, dtype, old, new)
        usable_old, usable_new, need_gib = gate["usable_gib"]["from"], gate["usable_gib"]["to"], gate["need_gib"]
        workload.model_params, workload.hidden, workload.layers = gate["params"], gate["hidden"], gate["layers"]
    capability_reasons = []
    if workload.need_dtype:
        if not _rate(old, workload.need_dtype) and _rate(new, workload.need_dtype):
            capability_reasons.append(f"the recipe needs {workload.need_dtype}, which {new.name} has and "
                                      f"{old.name} does not: {old.name} is disqualified, not slower")
        elif not _rate(new, workload.need_dtype):
            capability_reasons.append(f"neither GPU lists {workload.need_dtype}")
    if need_gib > usable_old and need_gib <= usable_new:
        capability_reasons.append(f"seq_len {workload.seq_len} needs about {need_gib:.1f} GiB per GPU: it fits "
                                  f"{new.name} ({usable_new:.0f} GiB) but not {old.name} ({usable_old:.0f} GiB)")
    fits_old, fits_new = need_gib <= usable_old, need_gib <= usable_new
    if not fits_new:
        capability_reasons.append(f"seq_len {workload.seq_len} needs about {need_gib:.1f} GiB per GPU, more than "
                                  f"{new.name} ({usable_new:.0f} GiB)" + ("" if fits_old else
                                  f" or {old.name} ({usable_old:.0f} GiB) can hold"))
    gate1_passed = fits_new and bool(capability_reasons) and "neither" not in capability_reasons[0]
    neither_fits = not fits_old and not fits_new

    # Gate 2: throughput.
    spec_speedup = peak_new / peak_old
    mamf_speedup = (mamf_new_tflops / mamf_old_tflops) if mamf_old_tflops and mamf_new_tflops else None
    compute_speedup = mamf_speedup or spec_speedup
    bandwidth_speedup = float(new.memory_bandwidth_tbps) / float(old.memory_bandwidth_tbps)
    share = attention_share(workload)
    if workload.kind == "attention":
        # Per the book's step decomposition: attention kernels track compute, while the rest of a
        # training step at micro-batch 1 is bandwidth and overhead bound and tracks HBM bandwidth.
        dense_speedup = min(compute_speedup, bandwidth_speedup)
        workload_speedup = 1.0 / ((1 - share) / dense_speedup + share / compute_speedup)
    else:
        workload_speedup = compute_speedup
    speedup = workload_speedup

    dense_flops, attention_flops = flops_per_token(workload)
    tokens_per_s_old = workload.mfu * peak_old * 1e12 / (dense_flops + attention_flops)
    tokens_per_s_new = tokens_per_s_old * speedup
    cost_per_mtok_old = price_old / 3600 / tokens_per_s_old * 1e6
    cost_per_mtok_new = price_new / 3600 / tokens_per_s_new * 1e6
    achieved_old = mamf_old_tflops or peak_old
    achieved_new = achieved_old * compute_speedup
    cost_per_pflop_old = price_old / (achieved_old * 3600 / 1000)
    cost_per_pflop_new = price_new / (achieved_new * 3600 / 1000)
    price_ratio = price_new / price_old
    break_even_price = price_old * speedup
    cost_ratio = price_ratio / speedup  # new $/token over old $/token

    reasons = list(capability_reasons) if gate1_passed or not fits_new else []
    if neither_fits:
        verdict = "does not fit"
        reasons.append("the workload fits neither GPU under the memory assumptions below: shard over more GPUs "
                       "(--gpus), shorten --seq-len, or give the measured memory (--memory-fixed-gib)")
    elif not fits_new:
        verdict = "hold"
        reasons.append(f"the workload fits {old.name} but not {new.name}")
    elif gate1_passed:
        verdict = "upgrade"
    elif cost_ratio < 0.95:
        verdict = "upgrade"
        reasons.append(f"{speedup:.2f}x faster at {price_ratio:.2f}x the price: "
                       f"{(1 - cost_ratio) * 100:.0f}% less per token")
    elif cost_ratio <= 1.05:
        verdict = "tie: upgrade for time-to-result"
        reasons.append(f"{speedup:.2f}x faster at {price_ratio:.2f}x the price is break-even per token; "
                       f"the new GPU finishes {speedup:.2f}x sooner"
                       + (f" and has {usable_new - usable_old:.0f} GiB more memory" if usable_new > usable_old else ""))
    else:
        verdict = "hold"
        reasons.append(f"{speedup:.2f}x faster at {price_ratio:.2f}x the price: "
                       f"{(cost_ratio - 1) * 100:.0f}% more per token; it pays below ${break_even_price:.2f}/GPU-hour")
    if new_dtypes:
        reasons.append(f"{new.name} adds {', '.join(new_dtypes)}: only worth it once your recipe and kernels use them")
    if workload.kind == "attention":
        reasons.append(f"attention is about {share * 100:.0f}% of the step's FLOPs at seq_len {workload.seq_len}")

    hidden, layers = workload.shape()
    return {
        "from": old.name, "to": new.name, "dtype": dtype,
        "workload": {**dataclasses.asdict(workload), "hidden": hidden, "layers": layers},
        "assumptions": gate["assumptions"] + assumptions(workload)[1:] if gate else assumptions(workload),
        "gate1_capability": {
            "passed": gate1_passed, "fits": {"from": fits_old, "to": fits_new}, "reasons": capability_reasons, "new_dtypes": new_dtypes,
            "memory_needed_gib": round(need_gib, 1),
            "usable_memory_gib": {"from": round(usable_old, 1), "to": round(usable_new, 1)},
            "max_seq_len": gate["max_seq_len"] if gate else
            {"from": max_seq_len(workload, usable_old), "to": max_seq_len(workload, usable_new)},
            "memory_headroom_gib": {"from": round(usable_old - need_gib, 1), "to": round(usable_new - need_gib, 1)},
        },
        "gate2_throughput": {
            "spec_speedup": round(spec_speedup, 3),
            "mamf_speedup": round(mamf_speedup, 3) if mamf_speedup else None,
            "memory_bandwidth_speedup": round(bandwidth_speedup, 3),
            "attention_share": round(share, 3),
            "workload_speedup": round(workload_speedup, 3),
            "speedup": round(speedup, 3),
            "speedup_source": "stored MAMF runs" if mamf_speedup else "spec peak",
        },
        "cost": {
            "price_per_gpu_hour": {"from": price_old, "to": price_new},
            "price_ratio": round(price_ratio, 3),
            "cost_per_million_tokens": {"from": round(cost_per_mtok_old, 4), "to": round(cost_per_mtok_new, 4)},
            "cost_per_pflop": {"from": round(cost_per_pflop_old, 5), "to": round(cost_per_pflop_new, 5)},
            "cost_per_token_ratio": round(cost_ratio, 3),
            "break_even_price_to": round(break_even_price, 2),
            "assumed_mfu_from": workload.mfu,
            "mfu_source": workload.mfu_source or "assumed (--mfu)",
        },
        "verdict": verdict,
        "reasons": reasons,
    }
