"""mleng step's model shapes: presets, --layers, HF config.json files, and the analytic parameter count
against the built model and against a published count."""

from __future__ import annotations

import json

import pytest

from mleng.errors import UsageError
from mleng.step.config import PRESETS, PUBLISHED_PARAMS, config_from_hf, load_config_file, param_count, resolve


@pytest.mark.parametrize("name", ["tiny", "1b", "8b", "70b"])
def test_each_presets_analytic_count_equals_the_built_models(name):
    import torch

    from mleng.step.model import Transformer, count_parameters

    cfg = PRESETS[name].with_layers(2) if name != "tiny" else PRESETS[name]
    with torch.device("meta"):  # the real shapes, no memory: 70b's two layers and embeddings are 3.8 G params
        model = Transformer(cfg, max_seq_len=16)
    assert count_parameters(model) == param_count(cfg).total
    # and the full-depth count follows from the per-layer one (what --layers changes)
    full = PRESETS[name]
    per_layer = (param_count(full).attention + param_count(full).mlp) // full.n_layers + 2 * full.dim
    assert param_count(full).total == param_count(cfg).total + (full.n_layers - cfg.n_layers) * per_layer


def test_the_8b_shape_has_llama_3_8b_published_parameter_count():
    published, source = PUBLISHED_PARAMS["8b"]
    assert "Meta-Llama-3-8B" in source
    assert param_count(PRESETS["8b"]).total == 8_030_261_248
    assert abs(param_count(PRESETS["8b"]).total - published) / published < 0.001


def test_tied_embeddings_count_once_and_the_1b_shape_is_llama_3_2_1b():
    count = param_count(PRESETS["1b"])
    assert count.tied and count.total == 1_235_814_400  # Llama-3.2-1B: 1.24 B on its model page
    assert count.matmul == count.total - count.norms  # the tied table still does the output matmul


def test_layers_keeps_the_width():
    cfg = resolve("8b", None, 4)
    assert (cfg.n_layers, cfg.dim, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads) == (4, 4096, 14336, 32, 8)
    assert "4 layers" in cfg.name
    with pytest.raises(UsageError, match="--layers 0"):
        resolve("8b", None, 0)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(UsageError, match="unknown model preset 'gpt5'; known: tiny, 1b, 8b, 70b"):
        resolve("gpt5", None, None)


def _write(tmp_path, data) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


LLAMA_32_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
               "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "rope_theta": 500000.0,
               "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
               "rope_scaling": {"factor": 32.0, "rope_type": "llama3"}}


def test_an_hf_config_json_gives_the_same_shape_as_the_preset(tmp_path):
    cfg = load_config_file(_write(tmp_path, LLAMA_32_1B))
    preset = PRESETS["1b"]
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim", "rope_theta",
                  "norm_eps", "tie_embeddings"):
        assert getattr(cfg, field) == getattr(preset, field), field
    assert any("rope_scaling ignored" in n for n in cfg.notes)
    # a folder holding config.json works too
    assert load_config_file(str(tmp_path)).dim == 2048


@pytest.mark.parametrize("drop", ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                  "vocab_size"])
def test_a_config_missing_a_field_names_it(tmp_path, drop):
    data = {k: v for k, v in LLAMA_32_1B.items() if k != drop}
    with pytest.raises(UsageError, match=f"missing field {drop}"):
        load_config_file(_write(tmp_path, data))


def test_bad_config_files_are_refused_with_the_reason(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        load_config_file(str(tmp_path / "absent.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsageError, match="is not JSON"):
        load_config_file(str(tmp_path / "bad.json"))
    with pytest.raises(UsageError, match="model_type 'gpt2'"):
        config_from_hf({**LLAMA_32_1B, "model_type": "gpt2"})
    with pytest.raises(UsageError, match="not a multiple"):
        config_from_hf({**LLAMA_32_1B, "num_key_value_heads": 5})
    with pytest.raises(UsageError, match="hidden_size must be an integer"):
        config_from_hf({**LLAMA_32_1B, "hidden_size": "2048"})
    with pytest.raises(UsageError, match="attention_bias"):
        config_from_hf({**LLAMA_32_1B, "attention_bias": True})
