"""Benchmark: `mleng step` on one GPU, side by side with the peer users would otherwise use, on the same card in
one sitting.

The issue's side-by-side is parts a and c: an 8B-shaped model cut to 4 layers, seq 8192, bf16, micro-batch 1.
Part a: a `mleng mamf` run first (stored in $OUT/home, so every later run gets its MAMFU, matched by the GPU's
UUID), then mleng step plain and FSDP2 on one GPU, compile off and on. Part c: the peers, each compile off
and on: Hugging Face transformers' LlamaForCausalLM built from the same config (random init, no download),
and torchtitan's Llama3Model (0.3.0: its own model classes, config builders and init, flex attention as its
llama3 8B recipe uses, per-block torch.compile as its trainer applies). Every run is its own process, timed by
the same timer (mleng.measure.timing.time_fn, one CUDA-event pair per step) over the same number of steps after
warm-up, with the same optimizer (fused AdamW, clipping), the same synthetic tokens, the same fp32-weights +
bf16-autocast recipe and the same FLOP formula for MFU. Part b: the 1b preset (seq 4096, micro-batch 2) plain
and FSDP2, compile off and on, and the 8B-shaped model with activation checkpointing (HFU).

torchtitan's trainer itself cannot start on torch 2.11 (checked against torch 2.11.0's source): 0.3.0's llama3
parallelize module imports torch.distributed.fsdp.DataParallelMeshDims, which 2.11 lacks. Its model needs none
of that module (it applies FSDP/TP/compile), so where importing the llama3 package fails there, and only there,
the peer imports it without that module and says so in its record (import_note); likewise 2.11's
create_block_mask lacks the separate_full_blocks keyword torchtitan passes (the record's compat). Only the
model's imports are needed: torchtitan, spmd_types, tyro (typeguard, docstring_parser) besides torch and triton;
no datasets, torchdata, torch_checkpointing or wandb. They travel as wheels (a machine without a network):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:src python3 bench/step_h200.py --out $OUT --part c

Where torchtitan cannot be imported or built, the record and the table say why (the exception's text).

    PYTHONPATH=src python3 bench/step_h200.py --out $OUT --part a      # about 5 minutes on an H200
    PYTHONPATH=src python3 bench/step_h200.py --out $OUT --part c      # HF and torchtitan; prints a and c together
    PYTHONPATH=src python3 bench/step_h200.py --out $OUT --part c --peers torchtitan   # one peer; the other's
                                                                                      # runs in the file are kept
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


# peer -> (this script's flag that runs it in a child, the record's impl name)
PEERS = {"hf": ("--peer-hf", "HF LlamaForCausalLM"), "torchtitan": ("--peer-torchtitan", "torchtitan Llama3Model")}


def peer_run(peer: str, label: str, shape: dict, compile_on: bool, args, env: dict) -> dict:
    flag, impl = PEERS[peer]
    command = [sys.executable, str(HERE), flag, "--compile", "on" if compile_on else "off", *shape_args(shape)]
    if args.cpu_smoke:
        command.append("--cpu")
    run = run_child(label, command, args.out, args.part, args.timeout, env)
    run["impl"] = impl
    return run


PEER_IMPLS = {"HF LlamaForCausalLM": "HF", "torchtitan Llama3Model": "torchtitan"}


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
    return {"label": run["label"], "impl": PEER_IMPLS[run["impl"]], "parallel": "none", "compile": r.get("compile"),
            "ac": False, "exit": run["exit_code"], "tokens_per_s": r.get("tokens_per_s"),
            "step_s": step.get("median_s"), "p90_s": step.get("p90_s"), "mfu": r.get("mfu"),
            "mfu_book": r.get("mfu_book"), "mamfu": r.get("mamfu"), "hfu": None,
            "peak_gib": _gib(r.get("peak_allocated_bytes"))}


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
    parser.add_argument("--peers", default="hf,torchtitan",
                        help="part c and --cpu-smoke: which peers to run (default hf,torchtitan); in part c the "
                             "other peers' runs already in $OUT/step_h200_c.json are kept")
    # the peer's own process (internal)
    parser.add_argument("--peer-hf", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer-torchtitan", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--model", "--layers", "--seq", "--micro-batch", "--steps", "--warmup", "--compile"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_hf:
        return peer_hf_main(args)
    if args.peer_torchtitan:
        return peer_torchtitan_main(args)
    if args.out is None:
        parser.error("--out DIR is required")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if not peers or set(peers) - set(PEERS):
        parser.error(f"--peers {args.peers}: give hf, torchtitan or both, comma-separated")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        args.part = "cpu"
    home = args.out / "home"
    env = dict(os.environ, MLENG_HOME=str(home), PYTHONUNBUFFERED="1")
    runs: list[dict] = []
    out_file = args.out / f"step_h200_{args.part}.json"

    def save() -> None:  # after every run: a timeout or Ctrl-C keeps what was measured
        out_file.write_text(json.dumps({"part": args.part, "runs": runs, "torchtitan": torchtitan_status(runs),
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
            if "hf" in peers:
                runs.append(peer_run("hf", "tiny-hf-eager", shape, False, args, env))
            if "torchtitan" in peers:  # eager only: compile on a CPU is opt-in (MLENG_BENCH_CPU_COMPILE)
                runs.append(peer_run("torchtitan", "tiny-torchtitan-eager", shape, False, args, env))
                if os.environ.get("MLENG_BENCH_CPU_COMPILE"):
                    runs.append(peer_run("torchtitan", "tiny-torchtitan-compiled", shape, True, args, env))
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
            planned = [(f"8b-4l-{peer}-{'compiled' if compile_on else 'eager'}", peer, compile_on)
                       for peer in PEERS if peer in peers for compile_on in (False, True)]
            if out_file.exists():  # a run of some of the peers keeps the others' runs already measured
                labels = {label for label, _, _ in planned}
                runs.extend(r for r in json.loads(out_file.read_text())["runs"] if r["label"] not in labels)
            for label, peer, compile_on in planned:
                runs.append(peer_run(peer, label, PART_A, compile_on, args, env))
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
    shown = [r for r in every if r["impl"] == "mleng step" or r["impl"] in PEER_IMPLS]
    rows = [headline(r) for r in shown]
    print_table(rows)
    for run in shown:  # why a run has no numbers
        error = (run.get("result") or {}).get("error")
        if error or (run["exit_code"] and not run.get("result")):
            print(f"  {run['label']}: {error or ' | '.join(run.get('stderr_tail') or []) or 'no result'}")
    side_by_side = [r for r in rows if r["label"].startswith("8b-4l-") and not r["ac"]] or rows
    ours = [r["tokens_per_s"] for r in side_by_side if r["impl"] == "mleng" and r["tokens_per_s"]]
    best_peer = max((r for r in side_by_side if r["impl"] in PEER_IMPLS.values() and r["tokens_per_s"]),
                    key=lambda r: r["tokens_per_s"], default=None)
    if ours and best_peer:
        print(f"best mleng step / best peer ({best_peer['label']}), tokens/s per GPU: {max(ours):.0f} / "
              f"{best_peer['tokens_per_s']:.0f} = {max(ours) / best_peer['tokens_per_s']:.3f}x")
    print(f"torchtitan: {torchtitan_status(every)}")
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


def torchtitan_status(runs: list[dict]) -> dict:
    """Whether torchtitan is installed (metadata only: this process does not import it) and, from its peer runs,
    what they did: measured, or the exception that stopped them."""
    import importlib.metadata as md

    try:
        status = {"installed": True, "version": md.version("torchtitan")}
    except Exception:  # noqa: BLE001
        status = {"installed": False, "version": None}
    tt = [r for r in runs if r.get("impl") == "torchtitan Llama3Model"]
    results = [r.get("result") or {} for r in tt]
    status["runs"] = {r["label"]: ("measured" if res.get("tokens_per_s") else
                                   res.get("error") or f"exit {r['exit_code']}: "
                                                       f"{' | '.join(r.get('stderr_tail') or [])}")
                      for r, res in zip(tt, results)}
    notes = sorted({res["import_note"] for res in results if res.get("import_note")})
    if notes:
        status["import_note"] = notes[0]
    if not status["installed"] and not tt:
        status["why"] = ("not installed here: it travels as wheels (torchtitan, spmd_types, tyro, typeguard, "
                         "docstring_parser) in .whl/; nothing is downloaded on the device")
    return status


def peer_versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "torchtitan", "spmd_types", "triton"):
        try:
            out[name] = md.version(name)
        except Exception:  # noqa: BLE001
            out[name] = None
    return out


# ------------------------------------------------------------------------------------------ the peers

def peer_hf_main(args) -> int:
    """One HF LlamaForCausalLM training run, measured exactly as mleng step measures its own; JSON on stdout."""
    result = {"impl": "HF LlamaForCausalLM", "compile": args.compile == "on"}
    try:
        result.update(_peer_hf(args))
    except ImportError as exc:
        result["error"] = f"transformers is not importable here: {exc}"
    print(json.dumps(result, default=str))
    return 0 if "error" not in result else 1


def _peer_setup(args):
    """The shape, the device and the dtype every peer run takes from the command line, as mleng step would."""
    import torch

    from mleng.step.config import resolve

    cfg = resolve(args.model, None, int(args.layers) if args.layers else None)
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda:0")
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    return cfg, device, dtype


def _peer_measure(args, cfg, model, forward, device, dtype: str) -> dict:
    """The training loop and the record every peer shares: fused AdamW (mleng step's settings), clipping at 1.0,
    bf16 autocast over fp32 weights, mleng's synthetic tokens, one time_fn CUDA-event pair per step, the same
    FLOP formula, peak and stored MAMF. `forward(tokens)` returns the logits."""
    import torch
    import torch.nn.functional as F

    from mleng.measure.timing import TimingStats, time_fn
    from mleng.step.data import SyntheticTokens
    from mleng.step.efficiency import dense_peak, device_identity, find_stored_mamf, ratio
    from mleng.step.flops import both_conventions

    seq, micro, steps, warmup = int(args.seq), int(args.micro_batch), int(args.steps), int(args.warmup)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  **({"fused": True} if device.type == "cuda" else {}))
    data = SyntheticTokens(cfg.vocab_size, seq, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    losses: list[float] = []
    samples: list[float] = []
    holder: dict = {}

    def one_step(index: int) -> None:
        tokens, targets = data.batch(index, 0, micro, micro)
        with autocast:
            logits = forward(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        holder["loss"] = loss.detach()

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
    return {"torch": torch.__version__, "device": identity["name"], "seq": seq, "micro_batch": micro,
            "steps": steps, "warmup": warmup, "step_time_s": stats.to_dict(), "tokens_per_s": tokens_per_s,
            "tflops": achieved, "peak_tflops": peak, "theoretical_source": peak_note,
            "mfu": ratio(achieved["palm"], peak), "mfu_book": ratio(achieved["book"], peak),
            "mamf": mamf, "mamfu": ratio(achieved["palm"], mamf["tflops"] if mamf else None),
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
            "loss_first": losses[0], "loss_last": losses[-1]}


def _peer_hf(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mleng.step.config import param_count

    cfg, device, dtype = _peer_setup(args)
    seq = int(args.seq)
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
    measured = _peer_measure(args, cfg, model, lambda tokens: model(input_ids=tokens).logits, device, dtype)
    import transformers

    return {"transformers": transformers.__version__, "parameters_hf": n_params,
            "parameters_mleng": param_count(cfg).total, **measured}


def peer_torchtitan_main(args) -> int:
    """One training run of torchtitan's Llama3Model, measured exactly as the HF peer and mleng step are; JSON on
    stdout. Any failure (not installed, a torch too old for it, a build or run error) is the record's `error`,
    with the exception's text; the traceback goes to stderr (the log)."""
    import traceback

    result: dict = {"impl": "torchtitan Llama3Model", "compile": args.compile == "on"}
    stage = "import"
    try:
        llama3, note = _import_torchtitan_llama3()
        if note:
            result["import_note"] = note
        stage = "build or run"
        result.update(_peer_torchtitan(args, llama3))
    except Exception as exc:  # noqa: BLE001 - the record says why, whatever it is
        traceback.print_exc()
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]
        result["error"] = (f"torchtitan is not importable here: {text}" if stage == "import"
                           else f"torchtitan's model failed here: {text}")
    print(json.dumps(result, default=str))
    return 0 if "error" not in result else 1


def _import_torchtitan_llama3():
    """torchtitan.models.llama3 (the model classes, config builders and init of the 8B recipe), and a note when it
    had to be imported without its parallelize module.

    That module applies FSDP/TP/compile in torchtitan's trainer and is the one part of the package that needs a
    newer torch than 2.11 (torchtitan.distributed.fsdp imports torch.distributed.fsdp.DataParallelMeshDims). Only
    when the import fails inside it is the package imported again with that module left out; any other failure
    is raised as it is."""
    import importlib
    import traceback
    import types

    try:
        return importlib.import_module("torchtitan.models.llama3"), None
    except ImportError as exc:
        frames = [f.filename.replace(os.sep, "/") for f in traceback.extract_tb(exc.__traceback__)]
        if not any(f.endswith("torchtitan/models/llama3/parallelize.py") for f in frames):
            raise
        note = (f"torchtitan's trainer cannot run on this torch: torchtitan.models.llama3.parallelize fails to "
                f"import ({type(exc).__name__}: {exc}); the model was imported without that module (FSDP/TP/"
                f"compile wrappers this one-GPU run does not use)")
    for name in [n for n in sys.modules if n.startswith("torchtitan.models.llama3")]:
        del sys.modules[name]
    stub = types.ModuleType("torchtitan.models.llama3.parallelize")
    stub.parallelize_llama = None  # what the package's model registry refers to; never called here
    sys.modules[stub.__name__] = stub
    return importlib.import_module("torchtitan.models.llama3"), note


def _peer_torchtitan(args, llama3) -> dict:
    import importlib.metadata as md

    import torch
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock

    from mleng.step.config import param_count

    cfg, device, dtype = _peer_setup(args)
    seq, micro = int(args.seq), int(args.micro_batch)
    # Attention: flex, as torchtitan's llama3 recipes (model_registry's default; language models there take a
    # block-causal mask built from positions), through its class-level torch.compile(flex_attention) even in
    # eager mode. FlexAttention has no backward on a CPU, so there (the smoke test only) torchtitan's own SDPA
    # module, causal.
    on_cpu = device.type == "cpu"
    attention = ScaledDotProductAttention.Config() if on_cpu else get_attention_config("flex")
    # The shape of mleng's config through torchtitan's own builders and init (llama3/__init__.py's _8b and
    # _build_llama3_layers, with our dimensions, eps, head_dim and theta; no rope scaling, as in mleng step).
    rope = ComplexRoPE.Config(dim=cfg.head_dim, max_seq_len=seq, theta=cfg.rope_theta, scaling="none")
    dim = cfg.dim
    layers = []
    for layer_id in range(cfg.n_layers):
        layers.append(Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, eps=cfg.norm_eps, param_init=llama3._NORM_INIT),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=cfg.norm_eps, param_init=llama3._NORM_INIT),
            attention=make_gqa_config(dim=dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                                      wqkv_param_init=llama3._LINEAR_INIT, wo_param_init=llama3._depth_init(layer_id),
                                      inner_attention=attention, fuse_qkv=True, rope=rope),
            feed_forward=make_ffn_config(dim=dim, hidden_dim=cfg.ffn_dim, w1_param_init=llama3._LINEAR_INIT,
                                         w2w3_param_init=llama3._depth_init(layer_id))))
    config = Llama3Model.Config(
        dim=dim, vocab_size=cfg.vocab_size, enable_weight_tying=cfg.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=dim,
                                        param_init=(llama3._EMBEDDING_SKIP_INIT if cfg.tie_embeddings
                                                    else llama3._EMBEDDING_INIT)),
        norm=RMSNorm.Config(normalized_shape=dim, eps=cfg.norm_eps, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=cfg.vocab_size,
                              param_init=llama3._output_linear_init(dim)),
        layers=layers)
    # As torchtitan's trainer builds it: on the meta device, then to_empty and its own init_weights.
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.verify_module_protocol()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()  # fp32 weights, bf16 autocast: the recipe of every other run here
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if args.compile == "on":
        # Per TransformerBlock, fullgraph, as torchtitan.distributed.compile.apply_compile does (with its two
        # dynamo settings); its trainer does not compile the embedding, the final norm or the output layer.
        torch._dynamo.config.capture_scalar_outputs = True
        if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        for block in model.layers.values():
            block.compile(fullgraph=True)
    # One document per sequence: positions 0..seq-1, the mask built from them every step as its trainer does.
    positions = torch.arange(seq, device=device).expand(micro, seq)
    compat = [] if on_cpu else _flex_mask_compat()

    def forward(tokens):
        masks = None if on_cpu else model.get_attention_masks(positions=positions)
        return model(tokens, positions=positions, attention_masks=masks)

    measured = _peer_measure(args, cfg, model, forward, device, dtype)
    mleng_params = param_count(cfg).total
    return {"torchtitan": md.version("torchtitan"), "spmd_types": md.version("spmd_types"),
            "attention": "sdpa (CPU: FlexAttention has no backward there)" if on_cpu else
                         "flex (torchtitan's compiled flex_attention, block-causal mask from positions)",
            "parameters_torchtitan": n_params, "parameters_mleng": mleng_params,
            "parameters_agree": n_params == mleng_params, "compat": compat, **measured}


def _flex_mask_compat() -> list[str]:
    """torchtitan 0.3.0 builds its flex BlockMask with create_block_mask(..., separate_full_blocks=...), a keyword
    torch 2.11 lacks (there the full blocks are always separated: the value torchtitan passes outside its batch-
    invariant mode). On such a torch its compiled create_block_mask is called without that keyword; the mask is
    the same. Returns what was changed, for the record."""
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention as tt_attention

    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return []
    compiled = tt_attention._compiled_create_block_mask

    def create(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise NotImplementedError("this torch's create_block_mask always separates full blocks")
        return compiled(*args, **kwargs)

    tt_attention._compiled_create_block_mask = create
    return ["create_block_mask has no separate_full_blocks keyword on this torch: torchtitan's mask is built "
            "without it (full blocks separated, as it asks)"]


if __name__ == "__main__":
    sys.exit(main())
