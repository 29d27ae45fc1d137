"""mleng step given bad input: one clear message, exit 2, no traceback, nothing on stdout under --json,
nothing stored, and (for what needs no torch) refused before torch is even imported. The pattern of
tests/test_bad_input.py, in its own file so that the shared matrix stays the other commands'."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

_SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
          "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_NTASKS", "MLENG_SPAWNED")

HF = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
      "num_attention_heads": 4, "vocab_size": 100}

# (id, argv, message, max seconds). {tmp} is the case's folder. The fast ones never import torch.
CASES = [
    ("unknown-preset", ["--model", "gpt5"], "unknown model preset 'gpt5'; known: tiny, 1b, 8b, 70b", 10),
    ("seq-0", ["--seq", "0"], "--seq 0: must be at least 1 token", 10),
    ("steps-0", ["--steps", "0"], "--steps 0: must be at least 1", 10),
    ("micro-batch-0", ["--micro-batch", "0"], "--micro-batch 0: must be at least 1", 10),
    ("layers-0", ["--layers", "0"], "--layers 0: give at least 1 layer", 10),
    ("nproc-0", ["--nproc", "0"], "--nproc 0: give at least 1 rank", 10),
    ("warmup-negative", ["--warmup", "-1"], "--warmup -1: must be at least 0", 10),
    ("fp16", ["--dtype", "fp16"], "fp16 needs loss scaling", 10),
    ("dtype-unknown", ["--dtype", "int8"], "--dtype int8: mleng step trains in bfloat16 or float32", 10),
    ("config-missing-file", ["--config", "{tmp}/absent.json"], "no such file", 10),
    ("config-missing-field", ["--config", "{tmp}/nohidden.json"], "missing field hidden_size", 10),
    ("config-and-model", ["--config", "{tmp}/good.json", "--model", "8b"], "not both", 10),
    ("config-not-json", ["--config", "{tmp}/notjson.json"], "is not JSON", 10),
    ("global-batch-not-divisible", ["--nproc", "2", "--parallel", "ddp", "--global-batch", "3"],
     "--global-batch 3 is not a multiple of --micro-batch 1 x 2 ranks = 2", 10),
    ("parallel-none-two-ranks", ["--nproc", "2", "--parallel", "none"], "--parallel none runs one process", 10),
    ("tokens-missing-file", ["--tokens", "{tmp}/absent.bin"], "--tokens {tmp}/absent.bin: no such file", 10),
    ("out-missing-folder", ["--out", "{tmp}/nowhere"], "the folder does not exist", 10),
    # read or estimated before any rank starts, still without torch: the file's first step, the states' size
    ("tokens-too-short", ["--tokens", "{tmp}/short.bin", "--seq", "64", "--micro-batch", "2"],
     "is too short: 100 tokens make 1 sequence of 65 (--seq 64 + 1), and one step needs 2", 10),
    ("tokens-outside-vocab", ["--tokens", "{tmp}/big_ids.npy", "--seq", "16", "--micro-batch", "1"],
     "token id 1000 is outside the model's vocabulary (0..511)", 10),
    ("model-cannot-fit", ["--model", "70b"], "cannot fit: weights, gradients and AdamW states need", 10),
]


def _env(home) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env.update({"MLENG_HOME": str(home), "PYTHONUNBUFFERED": "1"})
    return env


def _prepare(tmp_path) -> None:
    (tmp_path / "nohidden.json").write_text(json.dumps({k: v for k, v in HF.items() if k != "hidden_size"}))
    (tmp_path / "good.json").write_text(json.dumps(HF))
    (tmp_path / "notjson.json").write_text("{hidden_size: 64")
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "short.bin")
    np.save(tmp_path / "big_ids.npy", np.full(1000, 1000, dtype=np.int32))


@pytest.mark.parametrize("json_flag", [False, True], ids=["human", "json"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_message_and_exit_2(case, json_flag, tmp_path):
    name, argv, message, max_s = case
    _prepare(tmp_path)
    home = tmp_path / "home"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + (["--json"] if json_flag else [])
    message = message.replace("{tmp}", str(tmp_path))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mleng", "step", *argv], capture_output=True, text=True,
                          timeout=max_s + 120, env=_env(home), cwd=tmp_path)
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, done.stderr
    errors = [line for line in done.stderr.splitlines() if re.match(r"^mleng[\w -]*: ", line) and ": error: " in line]
    assert len(errors) == 1, done.stderr
    assert message in done.stderr, done.stderr
    if json_flag:
        assert done.stdout == ""
    assert not home.exists() or not any(home.iterdir()), "a refused run stored something"
    # generous for a loaded 2-core machine; the point is "before any step", not a tight bound
    assert elapsed < max_s + 60, f"refused only after {elapsed:.1f} s"


SCRIPT = """
import argparse, sys
from mleng.cli import step
from mleng.errors import UsageError
from mleng.step.run import precheck
parser = argparse.ArgumentParser()
step.add_arguments(parser)
for argv in (["--model", "gpt5"], ["--seq", "0"], ["--global-batch", "3", "--micro-batch", "2"], ["--model", "70b"]):
    try:
        precheck(step.options_from(parser.parse_args(argv), world_size=1), 1, 1)
    except UsageError:
        pass
    else:
        raise SystemExit(f"not refused: {argv}")
assert "torch" not in sys.modules, "torch was imported"
print("ok")
"""


def test_the_refusals_before_any_rank_do_not_import_torch(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                          env=_env(tmp_path / "home"))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
