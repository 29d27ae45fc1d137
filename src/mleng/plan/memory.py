"""Per-GPU memory of a training or inference config, estimated from the architecture: will it fit.

Training is modelled as the timeline of one steady step (the book's anatomy, `formulas-and-upgrade-framework.md`
section 5.6, made exact where it can be): the forward pass saves activations layer by layer, the head saves what its
loss needs, the head's backward adds the logits' gradients, each block's backward frees its saved tensors while its
weight gradients arrive, and the optimizer step holds weights, gradients and states together. The peak is the
largest of those moments. Weights, gradients and optimizer states are counted exactly (bytes per parameter, sharded
as ZeRO/FSDP/TP/PP shard them); what activations and the logits cost per token is a set of coefficients MEASURED by
`mleng memory --calibrate` with torch's own memory tracking (data/activation_coefficients.toml), never typed in.

Torch-free: every number here is arithmetic on the config and the data files.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mleng.measure.sizes import GIB
from mleng.plan.arch import Arch
from mleng.plan.memory_inputs import (
    COMPONENTS, DeviceMemory, LAYER_FEATURES, Phase, STATIC_FEATURES, TrainSetup, _apply, _dtype_bytes, _fit,
    _static_row, coefficient_set, device_memory, features, optimizer_bytes, overheads, validate,
)
# mleng.plan.memory stays the one entry point of the estimate: what its callers import from it
from mleng.plan.inference import InferSetup, estimate_inference  # noqa: F401
from mleng.plan.memory_inputs import COEFFICIENTS_FILE, DTYPES, RECOMPUTE, load_coefficients  # noqa: F401


def _stage_phases(arch: Arch, s: TrainSetup, coeffs: dict[str, Any], layers: int, first: bool, last: bool,
                  in_flight: int) -> tuple[list[Phase], dict[str, Any]]:
    """The moments of one step on one GPU of a pipeline stage holding `layers` blocks."""
    feats = features(arch, s.tp)
    tokens = s.micro_batch * s.seq
    p = arch.params()
    dp, stage = s.dp, s.stage
    layer_params = p.layers / arch.n_layers / s.tp
    here = layers * layer_params + (p.embedding / s.tp if first else 0) + p.final_norm * last \
        + ((0 if p.tied and first else p.output / s.tp) if last else 0)
    if p.tied and last and not first:
        here += p.output / s.tp  # the last stage holds its own copy of a tied output projection
    w_shard = dp if stage >= 3 else 1
    g_shard = dp if stage >= 2 else 1
    o_shard = dp if stage >= 1 else 1
    weights = 4.0 * here / w_shard
    opt_total, opt_note = optimizer_bytes(arch, s.optimizer, here)
    optimizer = opt_total / o_shard
    grads_full = 4.0 * here / g_shard
    grad_layer = 4.0 * layer_params / g_shard
    rope = 2 * 4.0 * s.seq * arch.head_dim  # the cos and sin tables, fp32 buffers
    compute_bytes = _dtype_bytes(s.dtype)

    C = coeffs["components"]
    notes = {"parameters_here": here, "optimizer_note": opt_note}
    base = Phase("start of the step", weights=weights + rope, optimizer=optimizer)
    fsdp_gathered = 0.0
    if stage >= 3 and dp > 1:
        # FSDP2 per block: this block's parameters gathered in the compute dtype plus the next one prefetched,
        # and the root (embeddings, head) while it runs; freed after each forward (reshard_after_forward).
        fsdp_gathered = 2 * compute_bytes * layer_params
        root = (p.embedding if first else 0) + (p.output if last and not p.tied else 0)
        fsdp_gathered += compute_bytes * root / s.tp
        notes["fsdp_gathered_bytes"] = fsdp_gathered

    fsdp = stage >= 3 and dp > 1
    feats = dict(feats, block_params=layers * layer_params)

    def comp(name: str) -> tuple[float, float, dict[str, float]]:
        """(activations, logits, static by feature) of one component for one micro-batch."""
        act, vocab, static = _apply(C[name], feats, tokens, COMPONENTS[name][1])
        if fsdp and name != "layer_backward":
            # Under FSDP the compute-dtype weights are the gathered ones (counted above), not autocast copies;
            # the gradients it keeps are counted from the sharding below.
            static = {}
        return act, vocab, static

    def add(ph: Phase, name: str, act: float, vocab: float, static: dict[str, float], times: float = 1.0) -> None:
        ph.add("activations", act * times)
        ph.add("logits", vocab * times)
        for feature, value in static.items():
            ph.add(_static_row(name, feature), value)

    fwd = base.copy("end of the forward pass")
    if first:
        a, v, st = comp("before_layers")
        add(fwd, "before_layers", a + sum(st.values()), v, {}, in_flight)
    sa, sv, sst = comp("saved_per_layer")
    # weight copies once per block, activations per block and micro-batch in flight
    add(fwd, "saved_per_layer", sa, sv, {k: x * layers for k, x in sst.items()}, layers * in_flight)
    fwd.add("weights", fsdp_gathered)
    phases = [fwd]
    top = fwd.copy("the last block's backward")
    if last:
        head_fw = fwd.copy("the head's forward (logits)")
        add(head_fw, "head_forward", *comp("head_forward"))
        phases.append(head_fw)
        a, v, st = comp("head_saved")
        add(fwd, "head_saved", a, v, st)
        add(top, "head_saved", a, v, st)
        head = fwd.copy("the head's backward (logits' gradients)")
        add(head, "head_backward", *comp("head_backward"))
        phases.append(head)
        add(top, "after_head", *comp("after_head"))
        if fsdp:
            top.add("gradients", 4.0 * (p.output / s.tp) / dp)
    add(top, "layer_backward", *comp("layer_backward"))
    phases.append(top)
    if layers > 1:
        # From the last block's backward to the first one's, each block frees what its forward saved (one
        # micro-batch's) and keeps its weight gradients: measured unsharded, then divided as ZeRO-2/3 shard them.
        bottom = top.copy("the first block's backward")
        a, v, st = comp("backward_per_layer")
        net = sum(st.values())
        if fsdp:
            net = grad_layer
        elif g_shard > 1:
            net -= 4.0 * layer_params * (1 - 1 / g_shard)
        add(bottom, "backward_per_layer", a, v, {"layer_params": net * (layers - 1)}, layers - 1)
        phases.append(bottom)
    end = base.copy("the optimizer step")
    end.add("gradients", grads_full)
    if stage >= 2 and dp > 1:
        end.add("gradients", 4.0 * layer_params * (dp - 1) / dp)  # one block's unsharded gradients in flight
    phases.append(end)
    for ph in phases:  # a few bytes below zero are the fit's rounding, not memory
        ph.activations, ph.logits = max(ph.activations, 0.0), max(ph.logits, 0.0)
    notes.update(layers=layers, first=first, last=last, in_flight=in_flight)
    return phases, notes


def estimate_training(arch: Arch, setup: TrainSetup, coeff_data: dict[str, Any] | None = None) -> dict[str, Any]:
    """The per-GPU estimate: the peak phase with its rows, every phase, the fit on a named GPU, the assumptions."""
    s = validate(arch, setup)
    coeffs, coeff_source = coefficient_set(s.dtype, s.recompute, coeff_data)
    L = arch.n_layers
    per_stage = math.ceil(L / s.pp)
    in_flight = min(s.pp, s.grad_accum or s.pp) if s.pp > 1 else 1
    stages = []
    if s.pp == 1:
        stages.append(("the only stage", *_stage_phases(arch, s, coeffs, L, True, True, 1)))
    else:
        last_layers = L - per_stage * (s.pp - 1)
        stages.append(("pipeline stage 0 (embeddings, most micro-batches in flight)",
                       *_stage_phases(arch, s, coeffs, per_stage, True, False, in_flight)))
        stages.append((f"pipeline stage {s.pp - 1} (output projection and loss)",
                       *_stage_phases(arch, s, coeffs, max(last_layers, 1), False, True, 1)))
    best = None
    for label, phases, notes in stages:
        peak = max(phases, key=lambda ph: ph.total)
        if best is None or peak.total > best[1].total:
            best = (label, peak, phases, notes)
    stage_label, peak, phases, notes = best
    ov = overheads()
    context = (s.context_gib if s.context_gib is not None else float(ov.get("cuda_context_gib", 0.5))) * GIB
    nccl = (s.nccl_gib if s.nccl_gib is not None else float(ov.get("nccl_gib", 1.5))) * GIB if s.gpus > 1 else 0.0
    frag = s.fragmentation if s.fragmentation is not None else float(ov.get("fragmentation", 0.05))
    allocated = peak.total
    fragmentation = frag * allocated
    total = allocated + context + nccl + fragmentation
    rows = [
        {"row": "weights", "bytes": peak.weights},
        {"row": "gradients", "bytes": peak.gradients},
        {"row": "optimizer states", "bytes": peak.optimizer},
        {"row": "activations", "bytes": peak.activations},
        {"row": "logits", "bytes": peak.logits},
        {"row": "allocated peak (the above)", "bytes": allocated},
        {"row": "CUDA context + NCCL buffers", "bytes": context + nccl},
        {"row": "fragmentation margin", "bytes": fragmentation},
        {"row": "total per GPU", "bytes": total},
    ]
    for r in rows:
        r["gib"] = round(r["bytes"] / GIB, 3)
        r["bytes"] = int(round(r["bytes"]))
    result: dict[str, Any] = {
        "mode": "training", "model": arch.name, "model_source": arch.source, "attention": arch.attention_kind,
        "parameters": arch.params().total,
        "setup": {**dataclasses.asdict(s), "dp": s.dp, "zero_stage": s.stage},
        "peak_phase": peak.name, "peak_stage": stage_label if s.pp > 1 else None,
        "rows": rows, "allocated_peak_bytes": int(allocated), "total_bytes": int(total),
        "phases": [{"phase": ph.name, "gib": round(ph.total / GIB, 3)} for ph in phases],
        "coefficients": coeff_source,
        "assumptions": _training_assumptions(arch, s, notes, context, nccl, frag, ov, coeff_source, in_flight),
    }
    if s.gpu:
        dev = device_memory(s.gpu, s.usable_gib)
        result["gpu"] = _fit(dev, total)
        result["gpu"]["longest_seq"] = longest(arch, s, coeff_data, "seq", dev)
        result["gpu"]["largest_micro_batch"] = longest(arch, s, coeff_data, "micro_batch", dev)
    return result


def _total_for(arch: Arch, s: TrainSetup, coeff_data) -> float:
    t = dataclasses.replace(s, gpu=None)
    return estimate_training(arch, t, coeff_data)["total_bytes"]


def longest(arch: Arch, s: TrainSetup, coeff_data, field: str, dev: DeviceMemory) -> int | None:
    """The largest --seq (or --micro-batch) with which the total still fits; None when even 1 does not."""
    limit = dev.usable_bytes

    def fits(n: int) -> bool:
        return _total_for(arch, dataclasses.replace(s, **{field: n}), coeff_data) <= limit

    if not fits(1):
        return None
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2**26:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _training_assumptions(arch: Arch, s: TrainSetup, notes: dict[str, Any], context: float, nccl: float,
                          frag: float, ov: dict[str, Any], coeff_source: str, in_flight: int) -> list[str]:
    out = []
    if s.dtype == "float32":
        out.append("float32 training: fp32 weights 4 B/param and fp32 gradients 4 B/param (--dtype)")
    else:
        out.append(f"{s.dtype} mixed precision as mleng step runs it: fp32 master weights 4 B/param, autocast's "
                   f"{s.dtype} weight copies held from forward to backward (measured: about 2 B/param), fp32 "
                   "gradients 4 B/param: the book's 18 B/param with AdamW (--dtype)")
    out.append(notes["optimizer_note"] + " (--optimizer)")
    if s.stage == 0:
        out.append(f"no sharding: every GPU holds all weights, gradients and states of its part (--zero, --fsdp)")
    else:
        what = {1: "optimizer states", 2: "optimizer states and gradients",
                3: "weights, gradients and optimizer states"}[s.stage]
        out.append(f"{'FSDP full sharding' if s.fsdp else f'ZeRO-{s.stage}'}: {what} divided over the {s.dp} "
                   "data-parallel ranks (--zero, --fsdp, --gpus)")
        if s.stage >= 3 and s.dp > 1:
            out.append("FSDP/ZeRO-3 gathers one block's parameters in the compute dtype and prefetches the next; "
                       "the embeddings and the head are gathered while they run")
        if s.stage >= 2 and s.dp > 1:
            out.append("one block's gradients are unsharded until their reduce-scatter")
    if s.tp > 1:
        out.append(f"tensor parallel {s.tp} as Megatron-LM lays it out (column/row-parallel projections, "
                   "vocab-parallel embedding, output and loss), without sequence parallelism: hidden-sized "
                   "activations replicated on every TP rank (--tp)")
    if s.pp > 1:
        out.append(f"pipeline parallel {s.pp} with a 1F1B schedule: the first stage holds {in_flight} micro-batches "
                   f"of activations in flight (min of --pp and --grad-accum); the busier of the first and last "
                   "stage is shown (--pp, --grad-accum)")
    out.append(coeff_source + " (`mleng memory --calibrate`)")
    out.append({"none": "no activation recompute (--recompute)",
                "full": "full recompute: every block's input saved, its activations recomputed in its backward "
                        "(torch.utils.checkpoint, as `mleng step --activation-checkpointing`) (--recompute)",
                "selective": "selective recompute: matmul and attention outputs saved, norms, rotary, SiLU and "
                             "products recomputed (torch's selective activation checkpointing) (--recompute)"}
               [s.recompute])
    out.append("attention through a fused kernel (SDPA flash/memory-efficient): no seq x seq score matrix kept")
    out.append("eager mode: torch.compile saves fewer activations (the estimate is then high)")
    if arch.moe:
        out.append(f"mixture of experts: activations counted as a dense MLP as wide as {arch.experts_per_token} "
                   "routed experts plus the shared ones (not calibrated on an MoE model: dispatch buffers and "
                   "router scores not counted)")
    if arch.mla:
        out.append("MLA attention counted as attention with queries and keys of qk_nope+qk_rope width "
                   "(not calibrated on an MLA model)")
    out.append(f"CUDA context {context / GIB:.2f} GiB ({ov.get('cuda_context_note', 'assumed')}) (--context-gib)")
    if s.gpus > 1:
        out.append(f"NCCL buffers and communicator {nccl / GIB:.2f} GiB ({ov.get('nccl_note', 'assumed')}) "
                   "(--nccl-gib)")
    out.append(f"fragmentation margin {frag * 100:.0f}% of the allocated peak ({ov.get('fragmentation_note', 'assumed')}; "
               "the table's allocated peak is what torch.cuda.max_memory_allocated reports) "
               "(--fragmentation)")
    out.extend(arch.notes)
    return out


# ------------------------------------------------------------------------------------------ fitting
def _lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares by modified Gram-Schmidt QR on column-scaled features (a handful of columns)."""
    n = len(rows[0])
    cols = [[r[j] for r in rows] for j in range(n)]
    scale = [math.sqrt(sum(v * v for v in c)) or 1.0 for c in cols]
    q = [[v / scale[j] for v in cols[j]] for j in range(n)]
    r = [[0.0] * n for _ in range(n)]
    keep = []
    for j in range(n):
        for i in keep:
            r[i][j] = sum(a * b for a, b in zip(q[i], q[j]))
            q[j] = [a - r[i][j] * b for a, b in zip(q[j], q[i])]
        norm = math.sqrt(sum(v * v for v in q[j]))
        if norm < 1e-9:  # a feature the runs cannot tell apart from the others: it gets 0
            r[j][j] = 0.0
            continue
        r[j][j] = norm
        q[j] = [v / norm for v in q[j]]
        keep.append(j)
    qty = [sum(a * b for a, b in zip(q[j], y)) if j in keep else 0.0 for j in range(n)]
    x = [0.0] * n
    for j in reversed(range(n)):
        if j not in keep:
            continue
        x[j] = (qty[j] - sum(r[j][k] * x[k] for k in range(j + 1, n))) / r[j][j]
    return [x[j] / scale[j] for j in range(n)]


def _run_features(run: dict[str, Any]) -> tuple[dict[str, float], float]:
    arch = Arch(name="calibration", vocab_size=run["vocab_size"], dim=run["dim"], n_layers=run["n_layers"],
                n_heads=run["n_heads"], n_kv_heads=run["n_kv_heads"], head_dim=run["head_dim"],
                ffn_dim=run["ffn_dim"])
    return features(arch), float(run["micro_batch"] * run["seq"])


def _design(name: str, feats: dict[str, float], tokens: float) -> list[float]:
    return [feats[f] if f in STATIC_FEATURES else feats[f] * tokens for f in COMPONENTS[name][1]]


def components_of(run: dict[str, Any]) -> dict[str, float]:
    """The measured components of one calibration run, from its MemTracker phase totals (bytes)."""
    ph = run["phases"]
    L = run["n_layers"]
    post = ph["layer_post_fw"]
    saved = (post[-1] - post[0]) / (L - 1)
    pre_bw, peak_bw = ph["layer_pre_bw"], ph["layer_peak_bw"]
    return {
        "saved_per_layer": saved,
        "before_layers": post[0] - saved - ph["before"],
        "head_forward": ph["head_peak_fw"] - post[-1],
        "head_saved": ph["forward_end"] - post[-1],
        "head_backward": ph["head_peak_bw"] - ph["forward_end"],
        "after_head": pre_bw[-1] - ph["forward_end"],
        "layer_backward": sum(p - q for p, q in zip(peak_bw, pre_bw)) / L,
        "backward_per_layer": (pre_bw[0] - pre_bw[-1]) / (L - 1),
    }


def fit_coefficients(runs: list[dict[str, Any]], dtype: str, recompute: str) -> dict[str, Any]:
    """Least-squares coefficients of every component over the calibration runs, and how well the whole model
    then predicts each run's measured peak."""
    measured = [components_of(r) for r in runs]
    design = [_run_features(r) for r in runs]
    out: dict[str, Any] = {"dtype": dtype, "recompute": recompute, "components": {}}
    for name, (what, names) in COMPONENTS.items():
        X = [_design(name, f, t) for f, t in design]
        y = [m[name] for m in measured]
        coef = _lstsq(X, y)
        out["components"][name] = {n: round(c, 6) for n, c in zip(names, coef)}
    errors = []
    for run in runs:
        arch = Arch(name="calibration", vocab_size=run["vocab_size"], dim=run["dim"], n_layers=run["n_layers"],
                    n_heads=run["n_heads"], n_kv_heads=run["n_kv_heads"], head_dim=run["head_dim"],
                    ffn_dim=run["ffn_dim"])
        setup = TrainSetup(seq=run["seq"], micro_batch=run["micro_batch"], dtype=dtype, recompute=recompute,
                           optimizer=run.get("optimizer", "adamw"))
        est = estimate_training(arch, setup, {"sets": {f"{dtype}/{recompute}": out}})["allocated_peak_bytes"]
        errors.append(100.0 * (est - run["peak_bytes"]) / run["peak_bytes"])
    abs_err = sorted(abs(e) for e in errors)
    out["fit"] = {"runs": len(runs), "median_abs_error_pct": round(abs_err[len(abs_err) // 2], 2),
                  "max_abs_error_pct": round(abs_err[-1], 2)}
    out["runs"] = [{k: r[k] for k in ("dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size",
                                      "n_layers", "micro_batch", "seq", "peak_bytes")} | {"error_pct": round(e, 2)}
                   for r, e in zip(runs, errors)]
    # The book's "copies": one block's saved bytes per token over (dtype bytes x hidden), at the Llama-3.1-8B shape.
    from mleng.plan.arch import resolve

    llama8b = features(resolve("8b"))
    per_layer = sum(out["components"]["saved_per_layer"][n] * llama8b[n] for n in LAYER_FEATURES if n != "layer_params")
    out["book_copies_llama8b"] = round(per_layer / (_dtype_bytes(dtype) * llama8b["dim"]), 2)
    return out
