"""`mleng upgrade`'s memory gate from `mleng memory`: the model's per-GPU memory at an explicit layout (--gpus,
--zero, --recompute) on each GPU's usable memory, instead of one Llama-8B measurement scaled by parameter count."""

from __future__ import annotations

from typing import Any

from mleng.plan.memory import GIB, TrainSetup, device_memory, estimate_training, longest


def memory_gate(model: str, seq: int, gpus: int, zero: int | None, recompute: str, micro_batch: int,
                dtype: str, old: Any, new: Any) -> dict[str, Any]:
    from mleng.plan.arch import resolve

    arch = resolve(model)
    setup = TrainSetup(seq=seq, micro_batch=micro_batch, dtype=_dtype(dtype), zero=zero or 0, gpus=gpus,
                       recompute=recompute)
    est = estimate_training(arch, setup)
    devices = {"from": device_memory(old.key), "to": device_memory(new.key)}
    need = est["total_bytes"]
    return {
        "need_gib": need / GIB,
        "usable_gib": {k: d.usable_bytes / GIB for k, d in devices.items()},
        "max_seq_len": {k: longest(arch, setup, None, "seq", d) or 0 for k, d in devices.items()},
        "params": arch.params().total, "hidden": arch.dim, "layers": arch.n_layers,
        "assumptions": [f"memory per GPU from `mleng memory {model} --seq {seq} --gpus {gpus} --zero {zero or 0} "
                        f"--recompute {recompute} --micro-batch {micro_batch}`: {need / GIB:.1f} GiB at its peak "
                        f"({est['peak_phase']}); usable: {devices['from'].source} / {devices['to'].source}",
                        *est["assumptions"]],
    }


def _dtype(dtype: str) -> str:
    return "float32" if dtype in ("fp32", "float32", "tf32") else "bfloat16"
