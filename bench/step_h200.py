"""Benchmark: `mleng step` on one GPU, side by side with the peer users would otherwise use, on the same card in
one sitting.

The issue's side-by-side is parts a and c: an 8B-shaped model cut to 4 layers, seq 8192, bf16, micro-batch 1.
Part a: a `mleng mamf` run first (stored in $OUT/home, so every later run gets its MAMFU, matched by the GPU's
UUID), then mleng step plain and FSDP2 on one GPU, compile off and on. Part c: Hugging Face transformers'
LlamaForCausalLM built from the same config (random init, no download), compile off and on. Every run is its
own process, timed by the same timer (mleng.measure.timing.time_fn, one CUDA-event pair per step) over the
same number of steps after warm-up, with the same optimizer (fused AdamW, clipping), the same synthetic
tokens and the same FLOP formula for MFU. Part b: the 1b preset (seq 4096, micro-batch 2) plain and FSDP2,
compile off and on, and the 8B-shaped model with activation checkpointing (HFU).
torchtitan is reported where it is installed; 0.3.0 needs torchdata, torch_checkpointing, spmd_types and
datasets besides torch, so where it is absent the output says so and it is not run.

    PYTHONPATH=src python3 bench/step_h200.py --out $OUT --part a      # about 5 minutes on an H200
    PYTHONPATH=src python3 bench/step_h200.py --out $OUT --part c      # about 4 minutes; prints a and c together
    PYTHONPATH=src python3 bench/step_h200.py --out $OUT --part b      # about 6 minutes
    PYTHONPATH=src python3 bench/step_h200.py --out /tmp/x --cpu-smoke # the same code path on a CPU, tiny preset

Each part writes $OUT/step_h200_<part>.json (every run's full record or peer result, saved after each run)
and step_h200_<part>_log.txt, and prints one table of every part found in $OUT. Peers are benchmark-only
dependencies, never mleng's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()

PART_A = {"model": "8b", "layers": 4, "seq": 8192, "micro_batch": 1, "steps": 20, "warmup": 5}
PART_B_1B = {"model": "1b", "layers": None, "seq": 4096, "micro_batch": 2, "steps": 20, "warmup": 5}
CPU_SMOKE = {"model": "tiny", "layers": None, "seq": 128, "micro_batch": 2, "steps": 3, "warmup": 1}


def shape_args(shape: dict) -> list[str]:
    out = ["--model", shape["model"], "--seq", str(shape["seq"]), "--micro-batch", str(shape["micro_batch"]),
           "--steps", str(shape["steps"]), "--warmup", str(shape["warmup"])]
    if shape.get("layers"):
        out += ["--layers", str(shape["layers"])]
    return out


def run_child(label: str, command: list[str], out_dir: Path, part: str, timeout_s: float, env: dict) -> dict:
    print(f"[{label}] {' '.join(command[1:])}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code = 124
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = (exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")) + "\n(timed out)"
    wall_s = time.monotonic() - t0
    with open(out_dir / f"step_h200_{part}_log.txt", "a") as log:
        log.write(f"===== {label}: exit {code}, {wall_s:.1f} s: {' '.join(command[1:])}\n{stderr}\n")
    try:
        result = json.loads(stdout)
    except json.JSONDecodeError:
        result = None
    print(f"[{label}] exit {code} in {wall_s:.0f} s", file=sys.stderr, flush=True)
    return {"label": label, "command": command[1:], "exit_code": code, "wall_s_outside": round(wall_s, 1),
            "result": result, "stderr_tail": stderr.strip().splitlines()[-4:]}


def mleng_step(label: str, shape: dict, extra: list[str], args, env: dict) -> dict:
    command = [sys.executable, "-m", "mleng", "step", *shape_args(shape), *extra, "--json"]
    run = run_child(label, command, args.out, args.part, args.timeout, env)
    run["impl"] = "mleng step"
    return run


def hf_peer(label: str, shape: dict, compile_on: bool, args, env: dict) -> dict:
    command = [sys.executable, str(HERE), "--peer-hf", "--compile", "on" if compile_on else "off",
               *shape_args(shape)]
    if args.cpu_smoke:
        command.append("--cpu")
    run = run_child(label, command, args.out, args.part, args.timeout, env)
    run["impl"] = "HF LlamaForCausalLM"
    return run


def headline(run: dict) -> dict:
    r = run.get("result") or {}
    if run["impl"] == "mleng step":
        s = r.get("summary") or {}
        p = r.get("params") or {}
        step = s.get("step_time_s") or {}
        memory = s.get("memory") or {}
        breakdown = (s.get("breakdown") or {}).get("shares") or {}
        return {"label": run["label"], "impl": "mleng", "parallel": p.get("parallel"),
                "compile": p.get("compile"), "ac": p.get("activation_checkpointing"), "exit": run["exit_code"],
                "tokens_per_s": s.get("tokens_per_s_per_device"), "step_s": step.get("median_s"),
                "p90_s": step.get("p90_s"), "mfu": s.get("mfu"), "mfu_book": s.get("mfu_book"),
                "mamfu": s.get("mamfu"), "hfu": s.get("hfu"), "peak_gib": _gib(memory.get("peak_allocated_bytes")),
                "gemm": breakdown.get("gemm"), "attn": breakdown.get("attention"),
                "other": breakdown.get("elementwise_other"), "idle": breakdown.get("idle")}
    step = r.get("step_time_s") or {}
    return {"label": run["label"], "impl": "HF", "parallel": "none", "compile": r.get("compile"), "ac": False,
            "exit": run["exit_code"], "tokens_per_s": r.get("tokens_per_s"), "step_s": step.get("median_s"),
            "p90_s": step.get("p90_s"), "mfu": r.get("mfu"), "mfu_book": r.get("mfu_book"), "mamfu": r.get("mamfu"),
            "hfu": None, "peak_gib": _gib(r.get("peak_allocated_bytes"))}


def _gib(value) -> float | None:
    return round(value / 2**30, 2) if value else None


def print_table(rows: list[dict]) -> None:
    columns = ["label", "impl", "parallel", "compile", "ac", "exit", "tokens_per_s", "step_s", "p90_s", "mfu",
               "mfu_book", "mamfu", "hfu", "peak_gib", "gemm", "attn", "other", "idle"]

    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    print("tokens_per_s is per GPU; mfu/mamfu/hfu use 6*N_matmul + 12*L*H*Q*T (PaLM/torchtitan), mfu_book the "
          "book's 6N; gemm/attn/other/idle are shares of a profiled two-step window (mleng runs)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for the JSON and the log (created)")
    parser.add_argument("--part", choices=["a", "b", "c"], default="a")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny preset on the CPU: checks this script")
    parser.add_argument("--timeout", type=float, default=300.0, help="per run (default 300 s)")
    parser.add_argument("--mamf-seconds", type=float, default=60.0)
    # the peer's own process (internal)
    parser.add_argument("--peer-hf", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--model", "--layers", "--seq", "--micro-batch", "--steps", "--warmup", "--compile"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_hf:
        return peer_hf_main(args)
    if args.out is None:
        parser.error("--out DIR is required")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        args.part = "cpu"
    home = args.out / "home"
    env = dict(os.environ, MLENG_HOME=str(home), PYTHONUNBUFFERED="1")
    runs: list[dict] = []
    out_file = args.out / f"step_h200_{args.part}.json"

    def save() -> None:  # after every run: a timeout or Ctrl-C keeps what was measured
        out_file.write_text(json.dumps({"part": args.part, "runs": runs, "torchtitan": torchtitan_status(),
                                        "peers": peer_versions()}, indent=2, default=str))

    try:
        if args.cpu_smoke:
            shape = CPU_SMOKE
            base = ["--device", "cpu", "--profile-steps", "2"]
            runs.append(mleng_step("tiny-plain-eager", shape, base + ["--compile", "off", "--mamf",
                                                                       "--mamf-seconds", "3"], args, env))
            runs.append(mleng_step("tiny-fsdp-eager", shape, base + ["--parallel", "fsdp", "--compile", "off"],
                                   args, env))
            runs.append(mleng_step("tiny-fsdp-ac", shape, base + ["--parallel", "fsdp",
                                                                  "--activation-checkpointing"], args, env))
            if os.environ.get("MLENG_BENCH_CPU_COMPILE"):
                runs.append(mleng_step("tiny-plain-compiled", shape, base + ["--compile", "on"], args, env))
            runs.append(hf_peer("tiny-hf-eager", shape, False, args, env))
        elif args.part == "a":
            if not _has_mamf(home):
                runs.append(run_child("mamf", [sys.executable, "-m", "mleng", "mamf", "--max-seconds",
                                               str(args.mamf_seconds), "--json"], args.out, args.part,
                                      args.timeout, env) | {"impl": "mleng mamf"})
                save()
            for parallel in ("none", "fsdp"):
                for compile_on in (False, True):
                    label = f"8b-4l-{parallel}-{'compiled' if compile_on else 'eager'}"
                    runs.append(mleng_step(label, PART_A, ["--parallel", parallel, "--compile",
                                                           "on" if compile_on else "off"], args, env))
                    save()
        elif args.part == "c":
            for compile_on in (False, True):
                runs.append(hf_peer(f"8b-4l-hf-{'compiled' if compile_on else 'eager'}", PART_A, compile_on,
                                    args, env))
                save()
        else:
            shape = PART_B_1B
            for parallel in ("none", "fsdp"):
                for compile_on in (False, True):
                    label = f"1b-{parallel}-{'compiled' if compile_on else 'eager'}"
                    runs.append(mleng_step(label, shape, ["--parallel", parallel, "--compile",
                                                          "on" if compile_on else "off"], args, env))
                    save()
            runs.append(mleng_step("8b-4l-fsdp-compiled-ac", PART_A, ["--parallel", "fsdp", "--compile", "on",
                                                                      "--activation-checkpointing"], args, env))
            save()
    except KeyboardInterrupt:
        print("interrupted: the runs so far are kept", file=sys.stderr)
    save()
    every = runs if args.cpu_smoke else _all_parts(args.out)
    rows = [headline(r) for r in every if r["impl"] in ("mleng step", "HF LlamaForCausalLM")]
    print_table(rows)
    side_by_side = [r for r in rows if r["label"].startswith("8b-4l-") and not r["ac"]] or rows
    ours = [r["tokens_per_s"] for r in side_by_side if r["impl"] == "mleng" and r["tokens_per_s"]]
    peers = [r["tokens_per_s"] for r in side_by_side if r["impl"] == "HF" and r["tokens_per_s"]]
    if ours and peers:
        print(f"best mleng step / best peer, tokens/s per GPU: {max(ours):.0f} / {max(peers):.0f} = "
              f"{max(ours) / max(peers):.3f}x")
    print(f"torchtitan: {torchtitan_status()}")
    print(f"written: {out_file}")
    return 0


def _all_parts(out_dir: Path) -> list[dict]:
    runs = []
    for part in ("a", "c", "b"):
        path = out_dir / f"step_h200_{part}.json"
        if path.exists():
            runs.extend(json.loads(path.read_text())["runs"])
    return runs


def _has_mamf(home: Path) -> bool:
    if not (home / "results.sqlite").exists():
        return False
    os.environ["MLENG_HOME"] = str(home)
    from mleng.results.store import Store

    with Store(home / "results.sqlite", create=False) as store:
        return any(r["status"] == "complete" and r["summary"].get("dtype") == "bfloat16"
                   for r in store.list(kind="mamf"))


def torchtitan_status() -> dict:
    try:
        import importlib.metadata as md

        return {"installed": True, "version": md.version("torchtitan"),
                "run": False, "why": "installed, but this script does not drive its trainer yet"}
    except Exception:  # noqa: BLE001
        return {"installed": False, "why": "not installed here (0.3.0 also needs torchdata, torch_checkpointing, "
                                           "spmd_types, datasets); nothing is downloaded on the device"}


def peer_versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers"):
        try:
            out[name] = md.version(name)
        except Exception:  # noqa: BLE001
            out[name] = None
    return out


# ------------------------------------------------------------------------------------------ the HF peer

def peer_hf_main(args) -> int:
    """One HF LlamaForCausalLM training run, measured exactly as mleng step measures its own; JSON on stdout."""
    result = {"impl": "HF LlamaForCausalLM", "compile": args.compile == "on"}
    try:
        result.update(_peer_hf(args))
    except ImportError as exc:
        result["error"] = f"transformers is not importable here: {exc}"
    print(json.dumps(result, default=str))
    return 0 if "error" not in result else 1


def _peer_hf(args) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mleng.measure.timing import TimingStats, time_fn
    from mleng.step.config import param_count, resolve
    from mleng.step.data import SyntheticTokens
    from mleng.step.efficiency import dense_peak, device_identity, find_stored_mamf, ratio
    from mleng.step.flops import both_conventions

    cfg = resolve(args.model, None, int(args.layers) if args.layers else None)
    seq, micro, steps, warmup = int(args.seq), int(args.micro_batch), int(args.steps), int(args.warmup)
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda:0")
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    fields = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
                  max_position_embeddings=max(seq, 8192), use_cache=False, rope_theta=cfg.rope_theta)
    try:
        config = LlamaConfig(**fields)
    except TypeError:  # a transformers that takes rope settings elsewhere: theta does not change the speed
        fields.pop("rope_theta")
        config = LlamaConfig(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.float().train()  # fp32 master weights, bf16 autocast: the same recipe as mleng step's plain run
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if args.compile == "on":
        model = torch.compile(model)  # the whole model: how HF users compile
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  **({"fused": True} if device.type == "cuda" else {}))
    data = SyntheticTokens(cfg.vocab_size, seq, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    losses: list[float] = []
    samples: list[float] = []

    def one_step(index: int) -> None:
        tokens, targets = data.batch(index, 0, micro, micro)
        with autocast:
            logits = model(input_ids=tokens).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        holder["loss"] = loss.detach()

    holder: dict = {}
    for i in range(warmup + steps):
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        stats = time_fn(lambda: one_step(i), device=device, warmup=0, iters=1, flush_l2=False)
        losses.append(float(holder["loss"]))
        if i >= warmup:
            samples.append(stats.median_s)
    stats = TimingStats.from_samples(samples)
    tokens_per_s = micro * seq / stats.median_s
    flops = both_conventions(cfg, seq)
    identity = device_identity(device)
    peak, peak_note = dense_peak(device, identity, dtype)
    mamf, _ = find_stored_mamf(identity, dtype)
    achieved = {k: f.model * tokens_per_s / 1e12 for k, f in flops.items()}
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__, "device": identity["name"],
            "parameters_hf": n_params, "parameters_mleng": param_count(cfg).total, "seq": seq, "micro_batch": micro,
            "steps": steps, "warmup": warmup, "step_time_s": stats.to_dict(), "tokens_per_s": tokens_per_s,
            "tflops": achieved, "peak_tflops": peak, "theoretical_source": peak_note,
            "mfu": ratio(achieved["palm"], peak), "mfu_book": ratio(achieved["book"], peak),
            "mamf": mamf, "mamfu": ratio(achieved["palm"], mamf["tflops"] if mamf else None),
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
            "loss_first": losses[0], "loss_last": losses[-1]}


if __name__ == "__main__":
    sys.exit(main())
