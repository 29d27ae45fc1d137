"""mleng.preflight() on a real GPU: NCCL in the job's own group, CUDA tensors, the NVML sample judged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch, torch.distributed as dist
    import mleng
    if os.environ.get("RANK") is not None:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")        # the job's own group, as a training script makes it
    a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()                       # the job's first matmul: torch keeps cuBLAS's workspace from here on
    del a
    before = torch.cuda.memory_allocated()
    record = mleng.preflight(max_seconds=10)
    after = torch.cuda.memory_allocated()
    still = dist.is_initialized()
    if still:
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)                     # training goes on in the same group
        dist.destroy_process_group()
    print("RESULT " + json.dumps({"rows": record.rows if record else None, "leaked_bytes": after - before,
                                  "group_kept": still}))
''')


def _run(argv, tmp_path, mleng_home):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    src = str(Path(__file__).resolve().parents[2] / "src")   # mleng as the tests see it, installed or not
    env = dict(os.environ, MLENG_HOME=str(mleng_home), PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([*argv, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), proc.stderr


@pytest.mark.parametrize("launch", ["plain", "torchrun"])
def test_preflight_on_one_gpu_checks_cuda_and_the_gpus_state(launch, torch_cuda, tmp_path, mleng_home):
    argv = [sys.executable] if launch == "plain" else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                         "--nproc_per_node=1"]
    result, summary = _run(argv, tmp_path, mleng_home)
    findings = {row["check"]: row for row in result["rows"]}
    assert findings["all_reduce"]["severity"] in ("ok", "skipped"), findings["all_reduce"]   # one rank: nothing to sum
    assert findings["straggler"]["severity"] == "ok" and "bfloat16" in findings["straggler"]["summary"]
    for check in ("sm_clock", "ecc"):                          # the GPU's own state, judged from NVML as the doctor does
        assert findings[check]["severity"] in ("ok", "warn"), findings[check]
        assert str(findings[check]["gpu_uuid"]).startswith("GPU-"), findings[check]
    assert "gpu" not in findings                               # the CPU-only "no GPU visible" finding
    assert result["leaked_bytes"] == 0                         # training starts as if preflight had not run
    if launch == "torchrun":
        assert "job's group" in summary and "backend nccl" in summary, summary
        assert result["group_kept"]
