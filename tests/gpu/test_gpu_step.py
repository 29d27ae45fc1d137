"""mleng step on CUDA: the FLOP formula against FlopCounterMode with the real kernels, MFU under the sourced
peak, the breakdown from GPU kernels, memory from the allocator and NVML, FSDP2 on one GPU with recomputation
(HFU above MFU), and torch.compile on. Small shapes: the folder stays a few minutes."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu


def test_flop_counter_with_the_gpu_kernels_agrees_once_its_attention_backward_is_accounted_for(torch_cuda, device):
    """FlopCounterMode counts the flash/efficient attention backward as 5 matmuls (QK^T recomputed) in recent
    torch, 4 in older: 14/12 or 12/12 of our attention term; the dense part must agree exactly either way."""
    from torch.utils.flop_counter import FlopCounterMode

    from mleng.step.config import PRESETS
    from mleng.step.flops import flops_per_token
    from mleng.step.model import build

    import dataclasses

    torch = torch_cuda
    # As many KV heads as query heads: FlopCounterMode's SDPA formula refuses grouped-query shapes
    # ("sdpa_flop_count: query/key/value shapes are incompatible", torch 2.11 on the H200).
    cfg = dataclasses.replace(PRESETS["tiny"], n_kv_heads=PRESETS["tiny"].n_heads)
    batch, seq = 2, 1024
    model = build(cfg, seq, device, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    for _ in range(2):  # count the second step
        with torch.autocast("cuda", dtype=torch.bfloat16), FlopCounterMode(display=False) as counter:
            model(tokens, tokens.roll(-1, 1)).backward()
    counted = counter.get_total_flops()
    f = flops_per_token(cfg, seq)
    candidates = {r: (f.dense + f.attention * r) * batch * seq for r in (1.0, 14 / 12)}
    best = min(candidates, key=lambda r: abs(counted - candidates[r]))
    assert abs(counted - candidates[best]) / candidates[best] < 0.01, (counted, candidates)


def _step(run_mleng, *args, timeout=300) -> dict:
    result = run_mleng("step", "--model", "tiny", "--seq", "1024", "--micro-batch", "8", *args, "--json",
                       "--no-store", timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout)


def test_one_gpu_step_reports_mfu_under_the_peak_memory_and_a_kernel_breakdown(run_mleng, torch_cuda, spec):
    record = _step(run_mleng, "--steps", "5", "--warmup", "3", "--compile", "off")
    s = record["summary"]
    assert record["status"] == "complete" and s["device_kind"] == "cuda" and s["dtype"] == "bfloat16"
    assert s["tokens_per_s"] > 0 and s["steps_timed"] == 5
    if spec is not None and spec.peak_tflops("bf16"):
        assert s["peak_tflops"] == spec.peak_tflops("bf16") and 0 < s["mfu"] < 1
    else:
        assert s["mfu"] is None and s["mfu_inconclusive"]
    b = s["breakdown"]
    assert "GPU kernels" in b["source"] and b["seconds"]["gemm"] > 0 and b["seconds"]["attention"] > 0
    assert sum(b["shares"][k] for k in ("gemm", "attention", "elementwise_other", "communication_exposed",
                                        "idle")) == pytest.approx(1.0, abs=1e-6)
    memory = s["memory"]
    assert 0 < memory["peak_allocated_bytes"] <= memory["peak_reserved_bytes"] <= memory["device_total_bytes"]
    assert memory.get("nvml_used_bytes", 0) >= memory["peak_reserved_bytes"] or "nvml_error" in memory
    assert (s["gpu_monitor"] or {}).get("available") in (True, False)


def test_fsdp2_on_one_gpu_with_recomputation_reports_hfu_above_mfu(run_mleng, torch_cuda, spec):
    record = _step(run_mleng, "--steps", "3", "--warmup", "2", "--compile", "off", "--parallel", "fsdp",
                   "--activation-checkpointing")
    s = record["summary"]
    assert record["params"]["parallel"] == "fsdp" and record["params"]["world_size"] == 1
    flops = s["flops_per_token"]["palm"]
    assert flops["hardware"] > flops["model"]
    if s["mfu"] is not None:
        assert s["hfu"] > s["mfu"]


def test_compiled_blocks_train_and_match_eager_losses_closely(run_mleng, torch_cuda):
    eager = _step(run_mleng, "--steps", "3", "--warmup", "2", "--compile", "off", "--profile-steps", "0")
    compiled = _step(run_mleng, "--steps", "3", "--warmup", "2", "--compile", "on", "--profile-steps", "0",
                     timeout=600)
    a = [x["loss"] for x in eager["summary"]["steps"]]
    b = [x["loss"] for x in compiled["summary"]["steps"]]
    assert compiled["params"]["compile"] is True
    for x, y in zip(a, b):
        assert abs(x - y) < 0.05 * abs(x), (a, b)  # bf16: fused kernels round differently


def test_two_gpus_ddp_when_there_are_two(run_mleng, torch_cuda):
    if torch_cuda.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    record = _step(run_mleng, "--steps", "3", "--warmup", "2", "--compile", "off", "--nproc", "2",
                   "--parallel", "ddp")
    s = record["summary"]
    assert s["world_size"] == 2 and s["devices"] == 2
    assert s["breakdown"]["seconds"]["communication_total"] > 0
