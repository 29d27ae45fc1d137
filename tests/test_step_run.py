"""mleng step on CPU: real training (the loss falls), one process, DDP and FSDP2 over gloo on loopback under
torchrun and an srun-style environment, the record against the schema, MAMFU from a stored or a fresh MAMF,
the breakdown, an OOM turned into one message, and Ctrl-C/SIGTERM keeping the measured steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mleng.step.config import PRESETS

SCHEMA = Path(__file__).parents[1] / "src" / "mleng" / "results" / "measurement.schema.json"
_SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
          "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_NTASKS", "MLENG_SPAWNED")
# Small and quick on a loaded 2-core machine; the same in every launch so the losses compare.
QUICK = ["--seq", "64", "--micro-batch", "2", "--steps", "3", "--warmup", "1", "--profile-steps", "2"]


def _env(home, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env.update({"MLENG_HOME": str(home), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _start(argv, home, **extra):
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(home, **extra))


def _mleng(*args) -> list[str]:
    return [sys.executable, "-m", "mleng", "step", *args]


def _torchrun(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "mleng",
            "step", *args]


def _record(proc, timeout=240) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err
    return json.loads(out)


def _in_process(**kw):
    """run_rank in this process, one rank (what `mleng step` does without a launcher)."""
    from mleng.distributed.launch import Launch, free_port
    from mleng.step.run import StepOptions, run_rank, validate

    options = StepOptions(cfg=kw.pop("cfg", PRESETS["tiny"]), **kw)
    validate(options)
    got: dict = {}
    run_rank(options, Launch("single", 0, 1, 0, 1, "127.0.0.1", free_port()),
             lambda record, extra: got.update(record=record, extra=extra))
    return got["record"]


def test_the_step_really_trains_the_loss_falls_clearly_over_50_steps():
    record = _in_process(seq=64, micro_batch=4, steps=50, warmup=0, lr=3e-3, profile_steps=0)
    losses = [s["loss"] for s in record.summary["steps"]]
    assert len(losses) == 50 and record.status == "complete"
    assert losses[-1] < 0.5 * losses[0], losses          # ln(512) = 6.24 at the start
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0


def test_ddp_and_fsdp_under_torchrun_give_the_single_process_losses(tmp_path):
    """Two real gloo ranks on loopback, each with half the global batch, against one process with all of it."""
    procs = {
        "ddp": _start(_torchrun(*QUICK, "--parallel", "ddp", "--json", "--no-store"), tmp_path / "b"),
        "fsdp": _start(_torchrun(*QUICK, "--parallel", "fsdp", "--json", "--no-store"), tmp_path / "c"),
    }
    alone = _in_process(seq=64, micro_batch=4, steps=3, warmup=1, profile_steps=2)  # meanwhile, here
    records = {name: _record(proc) for name, proc in procs.items()}
    single = [s["loss"] for s in alone.summary["steps"]]
    for name in ("ddp", "fsdp"):
        record = records[name]
        assert record["params"]["launch"] == "torchrun" and record["params"]["world_size"] == 2
        assert record["params"]["parallel"] == name and record["summary"]["global_batch"] == 4
        losses = [s["loss"] for s in record["summary"]["steps"]]
        assert len(losses) == len(single) == 4
        for a, b in zip(losses, single):
            assert abs(a - b) <= 1e-4 * abs(b), (name, losses, single)
        assert len(record["machine"]["ranks"]) == 2
        breakdown = record["summary"]["breakdown"]
        assert breakdown["seconds"]["communication_total"] > 0, breakdown  # gloo all-reduce / reduce-scatter
        assert len(record["summary"]["breakdown_by_rank"]) == 2
    assert alone.summary["breakdown"]["seconds"]["communication_total"] == 0


def test_under_an_srun_environment_each_task_is_a_rank(tmp_path):
    from mleng.distributed.launch import free_port

    port = free_port()
    procs = [_start(_mleng("--seq", "32", "--steps", "2", "--warmup", "0", "--profile-steps", "0",
                           "--parallel", "ddp", "--json", "--no-store", "--timeout", "60"), tmp_path,
                    SLURM_PROCID=rank, SLURM_LOCALID=rank, SLURM_NTASKS=2, SLURM_STEP_NUM_TASKS=2, SLURM_STEP_ID=0,
                    SLURM_JOB_ID=1, SLURM_STEP_NODELIST="127.0.0.[1]", MASTER_PORT=port) for rank in (0, 1)]
    record = _record(procs[0])
    out1, err1 = procs[1].communicate(timeout=120)
    assert procs[1].returncode == 0, err1
    assert out1 == ""  # rank 0 alone reports
    assert record["params"]["launch"] == "srun" and record["params"]["world_size"] == 2
    assert record["summary"]["steps_timed"] == 2


def test_one_process_record_validates_measures_a_mamf_and_uses_it(run_mleng, mleng_home):
    jsonschema = pytest.importorskip("jsonschema")
    done = run_mleng("step", *QUICK, "--mamf", "--mamf-seconds", "3", "--json", timeout=240)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    record = json.loads(done.stdout)
    jsonschema.validate(record, json.loads(SCHEMA.read_text()))
    s = record["summary"]
    assert record["kind"] == "step" and record["status"] == "complete"
    assert s["steps_timed"] == 3 and s["step_time_s"]["iters"] == 3
    assert s["tokens_per_step"] == 2 * 64 and s["tokens_per_s"] == pytest.approx(128 / s["step_time_s"]["median_s"],
                                                                                 rel=1e-3)
    # a CPU has no sourced peak: MFU is inconclusive with the reason, never a guessed number
    assert s["mfu"] is None and s["peak_tflops"] is None and "CPU" in s["mfu_inconclusive"]
    assert s["mamf"]["match"] == "measured now (--mamf)" and 0 < s["mamfu"]
    assert s["value"] == s["tokens_per_s_per_device"] and s["unit"] == "tokens/s per CPU host"
    assert s["flop_convention"] == "palm" and set(s["flops_per_token"]) == {"palm", "book"}
    assert record["rows"][0]["phase"] == "timed"
    assert {r["name"] for r in record["rows"][1:]} >= {"gemm", "attention", "elementwise_other", "idle"}
    shares = s["breakdown"]["shares"]
    assert sum(shares[k] for k in ("gemm", "attention", "elementwise_other", "communication_exposed", "idle")) \
        == pytest.approx(1.0, abs=1e-6)
    assert shares["gemm"] > 0 and shares["attention"] > 0
    # both records stored; the next run finds the MAMF by host and CPU model
    listed = json.loads(run_mleng("results", "list", "--json").stdout)["results"]
    assert sorted(r["kind"] for r in listed) == ["mamf", "step"]
    again = _in_process(seq=64, micro_batch=2, steps=2, warmup=0, profile_steps=0)
    assert again.summary["mamf"]["match"] == "host and CPU model"
    from mleng.cli.step import render

    text = render(again)
    assert "MFU          inconclusive: no theoretical peak is kept for CPUs" in text
    assert "MAMFU" in text and "host and CPU model" in text


def test_human_output_names_both_conventions_when_they_differ():
    """tiny at seq 512: attention is a third of the step, which the book's 6N leaves out."""
    from mleng.cli.step import render

    record = _in_process(seq=512, micro_batch=1, steps=1, warmup=0, profile_steps=2)
    assert record.summary["conventions_differ"] is True
    flops = record.summary["flops_per_token"]
    assert flops["book"]["model"] < 0.8 * flops["palm"]["model"]
    text = render(record)
    assert "book 6N:" in text and "where the time goes (2 profiled steps" in text and "GEMM" in text


def test_an_out_of_memory_is_one_message_with_the_memory_and_the_handbook_entry(monkeypatch):
    import torch

    from mleng.errors import UsageError
    from mleng.step import model

    def oom(self, tokens, targets):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                     "of 79.19 GiB of which 1.5 GiB is free. Of the allocated memory ...")

    monkeypatch.setattr(model.Transformer, "forward", oom)
    with pytest.raises(UsageError) as caught:
        _in_process(seq=32, steps=1, warmup=0, profile_steps=0)
    message = str(caught.value)
    assert "out of memory during the timed steps (step 0): CUDA out of memory. Tried to allocate 2.00 GiB" in message
    assert "of weights, gradients and AdamW states per rank" in message
    assert "mleng handbook show cuda-oom-tried-to-allocate" in message and "Of the allocated" not in message


def _wait_for(proc, needle: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if needle in line:
            return
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"never saw {needle!r}")


@pytest.mark.parametrize("how", ["sigterm-2-ranks", "ctrl-c-1-process"])
def test_a_signal_keeps_the_steps_measured(tmp_path, how):
    nproc = ["--nproc", "2", "--parallel", "ddp"] if how.startswith("sigterm") else []
    sig = signal.SIGTERM if how.startswith("sigterm") else signal.SIGINT
    proc = _start(_mleng("--seq", "64", "--steps", "100000", "--warmup", "0", "--profile-steps", "0", *nproc,
                         "--json"), tmp_path / "home")
    _wait_for(proc, "/100000 timed ")  # the log line of the first timed step
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and "did not end cleanly" not in err
    record = json.loads(out)
    assert record["status"] == "interrupted" and record["summary"]["steps_timed"] >= 1
    assert record["rows"][0]["tokens_per_s_per_device"] > 0
    messages = [line for line in err.splitlines() if line.startswith("mleng step:") and "interrupted" in line]
    assert len(messages) == 1, err


def test_breakdown_gives_each_instant_to_one_thing_and_finds_exposed_communication():
    from mleng.step.breakdown import attribute, classify

    assert classify("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert classify("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTT") == "gemm"
    assert classify("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert classify("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "communication"
    assert classify("triton_poi_fused_add_mul_silu_0") == "elementwise_other"
    assert classify("aten::mm") == "gemm" and classify("aten::broadcast_tensors") == "elementwise_other"
    # 0-10 GEMM, 5-12 NCCL (5-10 hidden under the GEMM), 14-16 elementwise, window 0-20
    seconds = attribute([(0, 10, "gemm"), (5, 12, "communication"), (14, 16, "elementwise_other")], 0, 20)
    assert seconds["gemm"] == 10 and seconds["communication_exposed"] == 2 and seconds["elementwise_other"] == 2
    assert seconds["idle"] == 6 and seconds["communication_total"] == 7
    assert sum(seconds[k] for k in ("gemm", "attention", "elementwise_other", "communication_exposed", "idle")) == 20


def test_the_gpu_breakdown_reads_kernel_events_inside_the_step_window():
    """from_profile's CUDA branch on events shaped as torch.profiler's (FunctionEvent) are."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from mleng.step.breakdown import from_profile

    def event(name, start, end, device=DeviceType.CPU, thread=1):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               thread=thread, self_cpu_time_total=end - start)

    cuda = DeviceType.CUDA
    events = [event("mleng.step", 0, 1000), event("mleng.step", 1000, 2000), event("mleng.data", 0, 50),
              event("aten::mm", 10, 20), event("cudaLaunchKernel", 20, 25),
              event("sm90_xmma_gemm_bf16bf16", 100, 700, cuda), event("flash_fwd_kernel", 700, 900, cuda),
              event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 600, 1100, cuda),
              event("vectorized_elementwise_kernel", 1200, 1500, cuda),
              event("sm90_xmma_gemm_late", 2500, 2600, cuda)]  # after the window: not counted
    b = from_profile(events, "cuda")
    us = {k: round(v * 1e6) for k, v in b["seconds"].items()}
    assert us == {"gemm": 600, "attention": 200, "elementwise_other": 300, "communication_exposed": 200,
                  "idle": 700, "communication_total": 500}
    assert b["steps"] == 2 and b["window_s"] == pytest.approx(0.002) and b["data_host_s"] == pytest.approx(5e-5)
    assert b["source"] == "4 GPU kernels"
