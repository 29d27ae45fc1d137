"""Bad input to `mleng memory` and `mleng plan` (the pattern of tests/test_bad_input.py): one message naming what is
wrong, exit 2, no traceback, nothing on stdout under --json."""

from __future__ import annotations

import json

import pytest

CONFIG_MAMBA = {"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100}
CONFIG_NO_VOCAB = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
CONFIG_GQA12 = {"hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 12,
                "num_key_value_heads": 4, "vocab_size": 100}
CONFIG_TEXT_LAYERS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": "2", "num_attention_heads": 4,
                      "vocab_size": 100}

CASES = [
    # memory: impossible layouts and sizes
    (["memory", "tiny", "--tp", "3"], "--tp 3 does not divide the 4 attention heads"),
    (["memory", "{cfg:gqa12}", "--tp", "6", "--gpus", "6"], "--tp 6 and the 4 key/value heads"),
    (["memory", "tiny", "--pp", "3"], "--pp 3 is more pipeline stages than the 2 layers"),
    (["memory", "tiny", "--seq", "0"], "--seq 0"),
    (["memory", "tiny", "--micro-batch", "-2"], "--micro-batch -2"),
    (["memory", "tiny", "--gpus", "0"], "--gpus 0"),
    (["memory", "tiny", "--gpus", "6", "--tp", "4"], "--gpus 6 is not a multiple of --tp 4"),
    (["memory", "tiny", "--layers", "0"], "--layers 0"),
    (["memory", "tiny", "--zero", "5"], "--zero 5"),
    (["memory", "tiny", "--fsdp", "--zero", "1"], "does not combine with --zero 1"),
    (["memory", "tiny", "--optimizer", "lion"], "--optimizer lion"),
    (["memory", "tiny", "--recompute", "half"], "--recompute half"),
    (["memory", "tiny", "--dtype", "int4"], "--dtype int4"),
    (["memory", "tiny", "--fragmentation", "2"], "--fragmentation 2"),
    (["memory", "tiny", "--gpu", "h300"], "unknown accelerator 'h300'"),
    (["memory", "tiny", "--gpu", "h200", "--usable-gib", "-1"], "--usable-gib -1"),
    (["memory", "tiny", "--inference", "--weights", "fp2"], "--weights fp2"),
    (["memory", "tiny", "--inference", "--kv-dtype", "int3"], "--kv-dtype int3"),
    (["memory", "tiny", "--inference", "--tp", "3"], "--tp 3 does not divide"),
    (["memory", "tiny", "--inference", "--measure"], "does not combine with --inference"),
    (["memory", "tiny", "--measure", "--gpus", "2"], "--measure runs one process"),
    (["memory", "tiny", "--measure", "--optimizer", "adamw8bit"], "bitsandbytes"),
    (["memory", "llama-9000"], "neither a preset"),
    (["memory"], "give a model"),
    (["memory", "tiny", "--calibrate"], "give no model"),
    (["memory", "--calibrate", "--recompute", "most"], "--recompute most"),
    (["memory", "{cfg:mamba}"], "model_type 'mamba' is not modelled"),
    (["memory", "{cfg:novocab}"], "missing field vocab_size"),
    (["memory", "{cfg:text}"], "num_hidden_layers must be an integer"),
    (["memory", "{cfg:notjson}"], "is not JSON"),
    (["memory", "tiny", "--coefficients", "{tmp}/none.toml"], "no such file"),
    # plan
    (["plan", "tiny", "--gpus", "1", "--busbw", "10", "--tflops", "1"], "needs at least 2 GPUs"),
    (["plan", "tiny", "--gpus", "2", "--busbw", "10", "--mfu", "1.5"], "--mfu 1.5"),
    (["plan", "tiny", "--gpus", "2", "--busbw", "10", "--mfu", "0"], "--mfu 0"),
    (["plan", "tiny", "--gpus", "2", "--busbw", "-1", "--tflops", "1"], "--busbw -1"),
    (["plan", "tiny", "--gpus", "2", "--busbw", "10", "--tflops", "1", "--strategy", "zero4"], "--strategy zero4"),
    (["plan", "tiny", "--gpus", "4", "--busbw", "10", "--tflops", "1", "--global-batch", "6"],
     "--global-batch 6 is not a multiple"),
    (["plan", "tiny", "--gpus", "2", "--tflops", "1"], "no measured busbw"),
    (["plan", "tiny", "--gpus", "2", "--busbw", "10"], "no compute rate"),
    (["plan", "tiny", "--gpus", "2", "--busbw", "10", "--mfu", "0.5"], "--mfu needs --mamf ID or --gpu"),
    (["plan", "--gpus", "8", "--busbw", "10"], "give a model"),
    (["plan", "tiny", "--params", "8B", "--gpus", "8"], "not both"),
    (["plan", "--params", "lots", "--gpus", "8", "--busbw", "10", "--tflops", "1", "--global-batch", "8"],
     "not a parameter count"),
    (["plan", "--params", "8B", "--gpus", "8", "--tflops", "1", "--global-batch", "8"], "give --busbw"),
    (["plan", "tiny", "--gpus", "2", "--busbw", "10", "--tflops", "1", "--gpu", "h300"], "unknown accelerator"),
    (["plan", "tiny", "--gpus", "2", "--busbw", "10", "--tflops", "1", "--recompute", "all"], "--recompute all"),
]


def _argv(argv, tmp_path):
    files = {"mamba": json.dumps(CONFIG_MAMBA), "novocab": json.dumps(CONFIG_NO_VOCAB),
             "text": json.dumps(CONFIG_TEXT_LAYERS), "gqa12": json.dumps(CONFIG_GQA12), "notjson": "{hidden_size: 64"}
    out = []
    for a in argv:
        if a.startswith("{cfg:"):
            name = a[5:-1]
            path = tmp_path / name / "config.json"
            path.parent.mkdir(exist_ok=True)
            path.write_text(files[name])
            a = str(path)
        out.append(a.replace("{tmp}", str(tmp_path)))
    return out


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_exit_2_one_message(argv, message, run_mleng, tmp_path):
    argv = _argv(argv, tmp_path)
    done = run_mleng(*argv[:1], "--json", *argv[1:], timeout=60)
    assert done.returncode == 2, (done.returncode, done.stdout[-500:], done.stderr[-1500:])
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
