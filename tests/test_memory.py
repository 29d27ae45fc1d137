"""mleng memory's arithmetic (torch-free): shapes and parameter counts, the book's anatomy, sharding, usable memory,
inference KV cache, the fit. The accuracy against real steps is tests/test_memory_accuracy.py."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest

from mleng.errors import UsageError
from mleng.plan import memory
from mleng.plan.arch import from_hf, resolve
from mleng.plan.memory import GIB, InferSetup, TrainSetup, estimate_inference, estimate_training

FIXTURES = Path(__file__).parent / "fixtures" / "fingerprints"

# DeepSeek-V3's config.json fields (deepseek-ai/DeepSeek-V3 on Hugging Face).
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
               "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048,
               "first_k_dense_replace": 3, "num_experts_per_tok": 8, "num_nextn_predict_layers": 1}


def test_presets_count_as_mleng_step_does():
    from mleng.step.config import PRESETS, param_count

    for key, cfg in PRESETS.items():
        assert resolve(key).params().total == param_count(cfg).total
    assert resolve("8b").params().total == 8_030_261_248  # HF safetensors metadata of Meta-Llama-3-8B


def test_deepseek_v3_counts_671b_and_its_mla_cache():
    arch = from_hf(DEEPSEEK_V3)
    # DeepSeek's README_WEIGHTS.md: "Total parameters: 671B" for the main model (the MTP module not counted)
    assert arch.params().total / 1e9 == pytest.approx(671, rel=0.002)
    assert arch.attention_kind == "MLA" and arch.moe
    assert arch.kv_elements_per_token_per_layer() == 512 + 64
    out = estimate_inference(arch, InferSetup(weights="bf16", kv_dtype="bf16", tp=8))
    assert out["kv_cache_bytes_per_token"] == 61 * 576 * 2
    assert any("multi-token prediction" in a for a in out["assumptions"])


def test_book_kv_cache_per_token_llama_8b():
    """The book: Llama-3.1-8B bf16 0.131 MB per token; 128 x 1024 tokens ~17.2 GB."""
    out = estimate_inference(resolve("8b"), InferSetup())
    assert out["kv_cache_mb_per_token"] == pytest.approx(0.131, abs=0.001)
    assert out["kv_cache_bytes_per_token"] * 128 * 1024 / 1e9 == pytest.approx(17.2, abs=0.05)


def test_mqa_and_tp_split_the_kv_heads():
    mqa = from_hf({"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 1, "vocab_size": 1000})
    assert mqa.attention_kind == "MQA"
    one = estimate_inference(mqa, InferSetup())["kv_cache_bytes_per_token"]
    assert one == 2 * 2 * 1 * 64 * 2
    llama = resolve("8b")
    tp1 = estimate_inference(llama, InferSetup())["kv_cache_bytes_per_token"]
    tp8 = estimate_inference(llama, InferSetup(tp=8))["kv_cache_bytes_per_token"]
    assert tp8 * 8 == tp1
    fp8 = estimate_inference(llama, InferSetup(kv_dtype="fp8"))["kv_cache_bytes_per_token"]
    assert fp8 * 2 == tp1


def test_inference_concurrent_tokens_fill_the_rest():
    out = estimate_inference(resolve("8b"), InferSetup(weights="fp8", gpu="h200"))
    gpu = out["gpu"]
    assert gpu["max_concurrent_tokens"] == (gpu["usable_bytes"] - out["fixed_bytes"]) // out["kv_cache_bytes_per_token"]
    bf16 = estimate_inference(resolve("8b"), InferSetup(weights="bf16", gpu="h200"))
    assert bf16["gpu"]["max_concurrent_tokens"] < gpu["max_concurrent_tokens"]


def _row(est, name):
    return next(r["bytes"] for r in est["rows"] if r["row"] == name)


def _phase(est, name):
    return next(p["gib"] for p in est["phases"] if p["phase"] == name) * GIB


def test_book_18_bytes_per_param_mixed_adamw():
    """The book's 18 B/param: fp32 weights 4 + bf16 copies 2, AdamW 8, fp32 gradients 4. The copies (measured,
    about 2 B per matmul weight: the embedding lookup casts nothing) live from forward to backward, the gradients
    from backward to the optimizer step, which holds 16."""
    arch = resolve("8b")
    p = arch.params()
    matmul = p.total - p.embedding
    est = estimate_training(arch, TrainSetup(seq=1, micro_batch=1, dtype="bfloat16"))
    assert _phase(est, "the optimizer step") / p.total == pytest.approx(16, abs=0.01)
    assert _phase(est, "end of the forward pass") == pytest.approx(12 * p.total + 2 * matmul, rel=0.01)


@pytest.mark.parametrize("optimizer,per_param", [("adamw", 8), ("adamw8bit", 2), ("sgd", 4)])
def test_optimizer_bytes_as_the_book(optimizer, per_param):
    arch = resolve("1b")
    est = estimate_training(arch, TrainSetup(seq=128, optimizer=optimizer))
    assert _row(est, "optimizer states") == pytest.approx(per_param * arch.params().total, rel=1e-6)


def test_adafactor_is_factored():
    arch = resolve("8b")
    est = estimate_training(arch, TrainSetup(seq=128, optimizer="adafactor"))
    assert _row(est, "optimizer states") < 0.01 * arch.params().total
    assert any("factored" in a for a in est["assumptions"])


def test_zero_stages_divide_what_they_shard():
    arch = resolve("70b")
    p = arch.params().total
    rows = {}
    for zero in range(4):
        est = estimate_training(arch, TrainSetup(seq=2048, gpus=8, zero=zero, recompute="full"))
        rows[zero] = {r["row"]: r["bytes"] for r in est["rows"]}
    assert rows[0]["optimizer states"] == pytest.approx(8 * p, rel=1e-6)
    assert rows[1]["optimizer states"] == pytest.approx(8 * p / 8, rel=1e-6)
    assert rows[3]["weights"] < rows[2]["weights"] / 4
    assert rows[3]["total per GPU"] < rows[2]["total per GPU"] < rows[1]["total per GPU"] < rows[0]["total per GPU"]
    fsdp = estimate_training(arch, TrainSetup(seq=2048, gpus=8, fsdp=True, recompute="full"))
    assert fsdp["total_bytes"] == pytest.approx(rows[3]["total per GPU"], rel=1e-9)


def test_tp_and_pp_split_the_model():
    arch = resolve("70b")
    base = estimate_training(arch, TrainSetup(seq=4096, gpus=8, tp=8, recompute="full"))
    one = estimate_training(arch, TrainSetup(seq=4096, gpus=1, recompute="full"))
    assert _row(base, "weights") < _row(one, "weights") / 6
    pp = estimate_training(arch, TrainSetup(seq=4096, gpus=8, pp=8, recompute="full"))
    per_stage = 10 * arch.params().layers / 80 + arch.params().embedding  # 80 layers / 8 stages, plus embeddings
    assert _row(pp, "optimizer states") == pytest.approx(8 * per_stage, rel=1e-6)
    assert pp["peak_stage"].startswith("pipeline stage")
    assert any("1F1B" in a for a in pp["assumptions"])


def test_recompute_orders_the_activations():
    arch = resolve("8b")
    acts = {rc: estimate_training(arch, TrainSetup(seq=8192, recompute=rc))["allocated_peak_bytes"]
            for rc in ("none", "selective", "full")}
    assert acts["full"] < acts["selective"] < acts["none"]


def test_book_llama_8b_32k_without_checkpointing_about_240_gib():
    """The book: Llama-3.1-8B at bs 1, 32K needs ~240 GiB of activations without checkpointing."""
    est = estimate_training(resolve("8b"), TrainSetup(seq=32768, recompute="none"))
    assert _row(est, "activations") / GIB == pytest.approx(240, rel=0.1)


def test_h200_usable_memory_is_the_recorded_nvml_total():
    fixture = json.loads((FIXTURES / "h200_vm_idle.json").read_text())
    dev = fixture["gpus"]["devices"][0]
    got = memory.device_memory("h200")
    assert got.total_bytes == dev["memory_total_bytes"]
    assert got.driver_reserved_bytes == dev["memory_used_bytes"]
    assert "NVML" in got.source and "141" in got.source
    h100 = memory.device_memory("h100")
    assert h100.total_bytes == 81559 * 2**20
    b200 = memory.device_memory("b200")
    assert "label" in b200.source


def test_longest_sequence_is_the_edge_of_fitting():
    arch = resolve("8b")
    est = estimate_training(arch, TrainSetup(seq=4096, recompute="full", gpu="h200"))
    longest = est["gpu"]["longest_seq"]
    usable = est["gpu"]["usable_bytes"]

    def total(seq):
        return estimate_training(arch, TrainSetup(seq=seq, recompute="full"))["total_bytes"]

    assert total(longest) <= usable < total(longest + 1)
    mb = est["gpu"]["largest_micro_batch"]
    assert estimate_training(arch, TrainSetup(seq=4096, micro_batch=mb, recompute="full"))["total_bytes"] <= usable
    assert estimate_training(arch, TrainSetup(seq=4096, micro_batch=mb + 1, recompute="full"))["total_bytes"] > usable


def test_a_model_that_cannot_fit_says_none():
    est = estimate_training(resolve("70b"), TrainSetup(seq=1024, gpu="h100"))
    assert est["gpu"]["fits"] is False
    assert est["gpu"]["longest_seq"] is None and est["gpu"]["largest_micro_batch"] is None


def test_every_assumption_names_its_flag():
    est = estimate_training(resolve("8b"), TrainSetup(seq=2048, gpus=16, zero=3, tp=2, pp=2, recompute="full",
                                                      gpu="h200"))
    flags = ("--dtype", "--optimizer", "--zero", "--tp", "--pp", "--recompute", "--context-gib", "--nccl-gib",
             "--fragmentation", "--calibrate")
    text = " ".join(est["assumptions"])
    for flag in flags:
        assert flag in text, flag


def test_coefficients_file_is_measured_with_command_machine_date():
    data = tomllib.loads(memory.COEFFICIENTS_FILE.read_text())
    assert set(data["sets"]) >= {f"{d}/{r}" for d in ("float32", "bfloat16") for r in ("none", "selective", "full")}
    for key, entry in data["sets"].items():
        assert entry["command"].startswith("mleng memory --calibrate"), key
        assert entry["machine"] and entry["measured_at"][:4].isdigit(), key
        assert entry["fit"]["runs"] >= 14 and entry["fit"]["max_abs_error_pct"] < 5, key
        for run in entry["runs"]:
            assert run["peak_bytes"] > 0
    # The book's coefficient for Llama-3.1-8B is 28 copies of bf16 x hidden per layer; ours is measured.
    assert data["sets"]["bfloat16/none"]["book_copies_llama8b"] == pytest.approx(28, rel=0.15)
    assert data["sets"]["bfloat16/full"]["book_copies_llama8b"] == pytest.approx(2, abs=0.01)


def test_lstsq_recovers_known_coefficients():
    rows = [[1.0, x, x * x] for x in range(1, 8)]
    y = [2.0 + 3.0 * r[1] - 0.5 * r[2] for r in rows]
    got = memory._lstsq(rows, y)
    assert got == pytest.approx([2.0, 3.0, -0.5], abs=1e-9)


def test_missing_coefficient_set_names_the_command():
    with pytest.raises(UsageError, match="--calibrate --dtype float32 --recompute full"):
        memory.coefficient_set("float32", "full", {"sets": {}})


@pytest.mark.parametrize("setup,message", [
    (dict(tp=3), "does not divide the 4 attention heads"),
    (dict(pp=3), "more pipeline stages than the 2 layers"),
    (dict(seq=0), "--seq 0"),
    (dict(micro_batch=-1), "--micro-batch -1"),
    (dict(gpus=3, tp=2), "not a multiple of --tp 2"),
    (dict(zero=4), "ZeRO stages"),
    (dict(fsdp=True, zero=1), "does not combine"),
    (dict(optimizer="lion"), "--optimizer lion"),
    (dict(recompute="some"), "--recompute some"),
    (dict(dtype="int8"), "--dtype int8"),
    (dict(fragmentation=1.5), "--fragmentation"),
])
def test_impossible_layouts_are_refused(setup, message):
    with pytest.raises(UsageError, match=message):
        estimate_training(resolve("tiny"), TrainSetup(**setup))


def test_config_fields_are_checked():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 100}
    with pytest.raises(UsageError, match="model_type 'mamba'"):
        from_hf({**base, "model_type": "mamba"})
    with pytest.raises(UsageError, match="missing field vocab_size"):
        from_hf({k: v for k, v in base.items() if k != "vocab_size"})
    with pytest.raises(UsageError, match="num_hidden_layers must be an integer"):
        from_hf({**base, "num_hidden_layers": "two"})
    with pytest.raises(UsageError, match="hidden_size must be an integer of at least 1"):
        from_hf({**base, "hidden_size": 0})
    assert math.isclose(from_hf(base).params().total,
                        100 * 64 * 2 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64)
