"""Per-GPU memory of an inference config (`mleng memory --inference`): weights, the KV cache per token, and
how many tokens fit in what is left. Torch-free."""

from __future__ import annotations

import dataclasses
from typing import Any

from mleng.errors import UsageError
from mleng.measure.sizes import GIB
from mleng.plan.arch import Arch
from mleng.plan.memory_inputs import (
    INFERENCE_WEIGHTS, KV_DTYPES, _fit, _positive_int, device_memory, features, overheads,
)


# ------------------------------------------------------------------------------------------ inference
@dataclasses.dataclass
class InferSetup:
    weights: str = "bf16"
    kv_dtype: str = "bf16"
    tp: int = 1
    gpus: int | None = None
    max_batched_tokens: int = 8192
    gpu: str | None = None
    usable_gib: float | None = None
    context_gib: float | None = None
    nccl_gib: float | None = None
    fragmentation: float | None = None


def estimate_inference(arch: Arch, s: InferSetup) -> dict[str, Any]:
    """Weights at the serving dtype, the KV cache per token, a forward pass's working memory, and how many tokens
    of KV cache fit beside them."""
    if s.weights not in INFERENCE_WEIGHTS:
        raise UsageError(f"--weights {s.weights}: known: {', '.join(INFERENCE_WEIGHTS)}")
    if s.kv_dtype not in KV_DTYPES:
        raise UsageError(f"--kv-dtype {s.kv_dtype}: known: {', '.join(KV_DTYPES)}")
    _positive_int("--tp", s.tp)
    _positive_int("--max-batched-tokens", s.max_batched_tokens)
    if arch.n_heads % s.tp:
        raise UsageError(f"--tp {s.tp} does not divide the {arch.n_heads} attention heads of {arch.name}")
    gpus = s.gpus or s.tp
    if gpus != s.tp:
        raise UsageError(f"--gpus {gpus} with --tp {s.tp}: one replica serves on its tp GPUs here",
                         hint="give --tp N (or --gpus equal to it)")
    p = arch.params()
    wbytes = INFERENCE_WEIGHTS[s.weights]
    # Embeddings and the output projection stay at 16 bits in the serving engines' fp8/fp4 schemes.
    embed = p.embedding + (0 if p.tied else p.output)
    body = p.total - embed
    weights = (body * wbytes + embed * 2.0) / s.tp
    kv_bytes = KV_DTYPES[s.kv_dtype]
    if arch.mla:
        kv_heads_note = "MLA: the compressed latent (kv_lora_rank) and the rotary key (qk_rope_head_dim) per layer, " \
                        "the same on every TP rank"
        per_token = arch.n_layers * arch.kv_elements_per_token_per_layer() * kv_bytes
    else:
        heads_here = max(arch.n_kv_heads // s.tp, 1)
        per_token = arch.n_layers * 2 * heads_here * arch.head_dim * kv_bytes
        kv_heads_note = (f"{arch.attention_kind}: keys and values of {heads_here} key/value head(s) per GPU"
                         + (" (replicated: fewer key/value heads than TP ranks)" if arch.n_kv_heads < s.tp else ""))
    tokens = s.max_batched_tokens
    feats = features(arch, s.tp)
    # A forward pass keeps nothing for a backward: working memory is a few live hidden- and MLP-sized tensors of
    # the batch, and fp32 logits of the sequences being sampled (at most one per token).
    workspace = tokens * 2.0 * (4 * feats["dim"] + 3 * feats["ffn_dim"] + feats["q_dim"] + 2 * feats["kv_dim"])
    workspace += min(tokens, 1024) * 4.0 * feats["vocab"]
    ov = overheads()
    context = (s.context_gib if s.context_gib is not None else float(ov.get("cuda_context_gib", 0.5))) * GIB
    nccl = (s.nccl_gib if s.nccl_gib is not None else float(ov.get("nccl_gib", 1.5))) * GIB if s.tp > 1 else 0.0
    frag = s.fragmentation if s.fragmentation is not None else float(ov.get("fragmentation", 0.05))
    fixed = weights + workspace
    rows = [{"row": "weights", "bytes": weights}, {"row": "forward working memory", "bytes": workspace},
            {"row": "CUDA context + NCCL buffers", "bytes": context + nccl},
            {"row": "fragmentation margin", "bytes": frag * fixed}]
    for r in rows:
        r["gib"] = round(r["bytes"] / GIB, 3)
        r["bytes"] = int(round(r["bytes"]))
    result: dict[str, Any] = {
        "mode": "inference", "model": arch.name, "attention": arch.attention_kind, "parameters": p.total,
        "setup": dataclasses.asdict(s), "rows": rows,
        "kv_cache_bytes_per_token": per_token, "kv_cache_mb_per_token": round(per_token / 1e6, 4),
        "fixed_bytes": int(fixed + context + nccl + frag * fixed),
        "assumptions": [
            f"weights {s.weights} ({wbytes:g} B/param{', one fp8 scale per 16 values (NVFP4)' if s.weights == 'fp4' else ''}); "
            "embeddings and output projection at 16 bits (--weights)",
            f"KV cache {s.kv_dtype} ({kv_bytes:g} B/element): {kv_heads_note} (--kv-dtype)",
            f"forward working memory for {tokens} batched tokens (--max-batched-tokens), fp32 logits for up to 1024 "
            "sequences sampled at once",
            f"tensor parallel {s.tp}: weights split {s.tp} ways (--tp)",
            f"CUDA context {context / GIB:.2f} GiB" + (f", NCCL {nccl / GIB:.2f} GiB" if nccl else "")
            + f", fragmentation margin {frag * 100:.0f}% of weights and working memory (the KV cache is one "
              "preallocated block)",
            *arch.notes],
    }
    if s.gpu:
        dev = device_memory(s.gpu, s.usable_gib)
        left = dev.usable_bytes - result["fixed_bytes"]
        result["gpu"] = _fit(dev, result["fixed_bytes"])
        result["gpu"]["kv_cache_bytes"] = max(int(left), 0)
        result["gpu"]["max_concurrent_tokens"] = max(int(left // per_token), 0)
    return result
