"""How close is `mleng memory` to the measured peak? A grid of real training steps (mleng step's model, AdamW,
bf16 autocast with fp32 master weights, eager) against the estimate, with accelerate's `estimate-memory` beside it.

On an H200 (the issue-16 grid): seq 2k-32k, micro-batch 1-4, recompute none/full, three architectures cut to
--layers blocks so that a whole step fits one GPU: a dense MHA Llama (Llama-2-7B shape), a GQA variant (Llama-3-8B
shape) and a wide-FFN variant. Each point is measured by torch.cuda.max_memory_allocated over a steady step; a
point that runs out of memory is recorded as such, beside whether the estimate said it would not fit.

    python bench/memory_accuracy.py --out docs/results/memory_accuracy_h200.json          # on the GPU
    python bench/memory_accuracy.py --dry-run                                              # CPU, tiny, MemTracker

With --gpu-calibrate it first measures the activation coefficients on the GPU (mleng memory --calibrate's runs)
and reports the grid's error with them too, and writes them to --coefficients-out for the data file.
accelerate is used when it imports (a benchmark-only dependency: the H200 image has it); its number is the
"Training using Adam" peak its estimate-memory prints for float32 (4 x the fp32 model size, no activations).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# HF config.json shapes (random weights: nothing is downloaded).
ARCHS = {
    "dense": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
              "num_key_value_heads": 32, "vocab_size": 32000, "note": "Llama-2-7B shape: MHA"},
    "gqa": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "note": "Llama-3-8B shape: GQA 32/8, 128K vocabulary"},
    "wide": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 28672, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 32000, "note": "wide FFN: 7 x hidden"},
}
TINY = {
    "dense": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_attention_heads": 4,
              "num_key_value_heads": 4, "vocab_size": 500, "note": "tiny MHA"},
    "gqa": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 448, "num_attention_heads": 8,
            "num_key_value_heads": 2, "vocab_size": 2000, "note": "tiny GQA 8/2, large vocabulary"},
    "wide": {"model_type": "llama", "hidden_size": 96, "intermediate_size": 672, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 500, "note": "tiny wide FFN"},
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def accelerate_estimate(config: dict, layers: int, workdir: Path) -> dict:
    """accelerate estimate-memory on a local config.json (its CLI, as users run it); the float32 row's
    'Training using Adam' column, in bytes."""
    folder = workdir / f"cfg-{config['hidden_size']}-{config['intermediate_size']}-{config['vocab_size']}-{layers}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**{k: v for k, v in config.items() if k != "note"},
                                                    "num_hidden_layers": layers, "architectures": ["LlamaForCausalLM"],
                                                    "tie_word_embeddings": False}))
    argv = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "estimate-memory", str(folder),
            "--library_name", "transformers", "--dtypes", "float32"]
    cli = _accelerate_cli(argv)
    if cli.get("available"):
        return cli
    # Its CLI asks the Hub about the model first (verify_on_hub), which fails offline; the same numbers from the
    # functions the CLI calls: an empty model, calculate_maximum_sizes, estimate_training_usage.
    try:
        import accelerate
        import transformers
        from accelerate import init_empty_weights
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes

        conf = transformers.AutoConfig.from_pretrained(str(folder))
        with init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(conf)
        total, _largest = calculate_maximum_sizes(model)
        try:
            usage = estimate_training_usage(total, "float32")
        except TypeError:
            usage = estimate_training_usage(total)
        peak = max(v for v in usage.values() if isinstance(v, (int, float))) if isinstance(usage, dict) else usage
        return {"available": True, "training_bytes": int(peak), "usage": usage, "total_bytes": int(total),
                "how": f"accelerate {accelerate.__version__}'s estimate functions (its CLI failed: "
                       f"{cli.get('reason', '?')[:200]})"}
    except Exception as exc:  # noqa: BLE001 - a benchmark-only comparison: say why it is missing
        return {"available": False, "reason": f"CLI: {cli.get('reason')}; functions: {type(exc).__name__}: {exc}"[:500]}


def _accelerate_cli(argv: list[str]) -> dict:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"available": False, "reason": str(exc)}
    if done.returncode != 0:
        return {"available": False, "reason": (done.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    units = {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
    for line in done.stdout.splitlines():
        if "float32" not in line:
            continue
        cells = [c.strip() for c in line.replace("│", "|").replace("┃", "|").split("|") if c.strip()]
        sizes = []
        for cell in cells[1:]:
            parts = cell.split()
            if len(parts) == 2 and parts[1] in units:
                sizes.append(float(parts[0]) * units[parts[1]])
        if sizes:
            return {"available": True, "training_bytes": int(sizes[-1]), "row": line.strip(),
                    "how": "accelerate estimate-memory (its CLI), float32 row, 'Training using Adam'"}
    return {"available": False, "reason": "no float32 row in its output", "stdout": done.stdout[-500:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, float32, MemTracker")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--seqs", help="comma-separated (default 2048,4096,8192,16384,32768; dry run 128,256)")
    p.add_argument("--micro-batches", default="1,2,4")
    p.add_argument("--recompute", default="none,full")
    p.add_argument("--archs", default="dense,gqa,wide")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", help="bfloat16 (default on GPUs) or float32 (CPU)")
    p.add_argument("--gpu", default="h200", help="mleng specs name for the fit column (default h200)")
    p.add_argument("--max-seconds", type=float, default=540, help="start no point after this (default 540)")
    p.add_argument("--gpu-calibrate", action="store_true", help="measure GPU coefficients first and compare")
    p.add_argument("--coefficients-out", help="with --gpu-calibrate: write the GPU coefficients to this TOML file")
    p.add_argument("--no-accelerate", action="store_true")
    p.add_argument("--out", help="write the JSON here")
    args = p.parse_args()

    import torch

    from mleng.errors import MlengError
    from mleng.plan import probe
    from mleng.plan.arch import from_hf
    from mleng.plan.memory import TrainSetup, estimate_training, load_coefficients

    t0 = time.monotonic()
    device = args.device or ("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    shapes = TINY if args.dry_run or device == "cpu" else ARCHS
    seqs = _ints(args.seqs) if args.seqs else ([128, 256] if shapes is TINY else [2048, 4096, 8192, 16384, 32768])
    mbs = _ints(args.micro_batches) if not (args.dry_run and args.micro_batches == "1,2,4") else [1, 2]
    modes = [m.strip() for m in args.recompute.split(",")]
    archs = [a.strip() for a in args.archs.split(",")]
    layers = args.layers if shapes is ARCHS else min(args.layers, 3)
    out = {"benchmark": "memory_accuracy", "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
           "device": device, "dtype": dtype, "torch": torch.__version__, "layers": layers,
           "gpu_name": torch.cuda.get_device_name(0) if device == "cuda" else None,
           "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "archs": {a: shapes[a] for a in archs}, "rows": []}
    gpu_coeffs = None
    if args.gpu_calibrate:
        from mleng.plan import coeffile

        sets = {}
        for mode in modes:
            fitted = probe.run_calibration(dtype, mode, device=device)
            sets[f"{dtype}/{mode}"] = {**fitted, "device": device, "machine": coeffile.machine_line(device),
                                       "command": "python bench/memory_accuracy.py --gpu-calibrate",
                                       "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            print(f"GPU calibration {dtype}/{mode}: fit {fitted['fit']}", flush=True)
            if args.coefficients_out:
                coeffile.write_set(Path(args.coefficients_out), fitted,
                                   f"python bench/memory_accuracy.py --gpu-calibrate ({device})", device)
        gpu_coeffs = {"sets": sets}
        out["gpu_calibration"] = {k: {"fit": v["fit"], "book_copies_llama8b": v["book_copies_llama8b"],
                                      "components": v["components"]} for k, v in sets.items()}
    cpu_coeffs = load_coefficients()
    work = Path(tempfile.mkdtemp(prefix="mleng-memacc-"))
    accel = {}
    for name in archs:
        cfg = {**shapes[name], "num_hidden_layers": layers}
        arch = from_hf({k: v for k, v in cfg.items() if k != "note"}, name=name, where=f"{name} shape")
        if not args.no_accelerate:
            accel[name] = accelerate_estimate(shapes[name], layers, work)
            print(f"{name}: accelerate {accel[name]}", flush=True)
        for recompute in modes:
            for mb in mbs:
                for seq in seqs:
                    if time.monotonic() - t0 > args.max_seconds:
                        out["stopped"] = f"--max-seconds {args.max_seconds:g} reached"
                        break
                    setup = TrainSetup(seq=seq, micro_batch=mb, dtype=dtype, recompute=recompute,
                                       gpu=args.gpu if device == "cuda" else None)
                    est = estimate_training(arch, setup, cpu_coeffs)
                    row = {"arch": name, "seq": seq, "micro_batch": mb, "recompute": recompute,
                           "estimate_bytes": est["allocated_peak_bytes"], "estimate_total_bytes": est["total_bytes"],
                           "estimate_phase": est["peak_phase"],
                           "estimate_fits": est.get("gpu", {}).get("fits")}
                    if gpu_coeffs and f"{dtype}/{recompute}" in gpu_coeffs["sets"]:
                        row["estimate_gpu_coeff_bytes"] = estimate_training(arch, setup, gpu_coeffs)["allocated_peak_bytes"]
                    t = time.monotonic()
                    try:
                        got = probe.measure_step(arch.step_config(), seq, mb, dtype=dtype, recompute=recompute,
                                                 device=device)
                        row.update(measured_bytes=got.peak_bytes, reserved_bytes=got.reserved_peak_bytes,
                                   tracking=got.tracking)
                        row["error_pct"] = round(100 * (row["estimate_bytes"] - got.peak_bytes) / got.peak_bytes, 2)
                        if "estimate_gpu_coeff_bytes" in row:
                            row["error_gpu_coeff_pct"] = round(
                                100 * (row["estimate_gpu_coeff_bytes"] - got.peak_bytes) / got.peak_bytes, 2)
                        if accel.get(name, {}).get("available"):
                            row["accelerate_error_pct"] = round(
                                100 * (accel[name]["training_bytes"] - got.peak_bytes) / got.peak_bytes, 2)
                    except MlengError as exc:  # out of memory: one message from the probe
                        row["oom"] = str(exc)
                    finally:
                        import gc

                        gc.collect()
                        if device == "cuda":
                            torch.cuda.empty_cache()
                    row["seconds"] = round(time.monotonic() - t, 2)
                    out["rows"].append(row)
                    print(json.dumps(row), flush=True)
                    if args.out:  # partial results survive a timeout
                        Path(args.out).write_text(json.dumps(out, indent=1))
    out["accelerate"] = accel
    measured = [r for r in out["rows"] if "error_pct" in r]

    def stats(key):
        vals = [abs(r[key]) for r in measured if key in r]
        return {"points": len(vals), "median_abs_pct": round(statistics.median(vals), 2) if vals else None,
                "max_abs_pct": round(max(vals), 2) if vals else None}

    ooms = [r for r in out["rows"] if "oom" in r]
    out["summary"] = {
        "mleng": stats("error_pct"), "mleng_gpu_coefficients": stats("error_gpu_coeff_pct"),
        "accelerate": stats("accelerate_error_pct"),
        "bound": {"median_abs_pct": 10, "max_abs_pct": 20},
        "oom_points": len(ooms),
        "oom_predicted": sum(1 for r in ooms if r.get("estimate_fits") is False),
        "fit_predicted_but_measured_fine": sum(1 for r in measured if r.get("estimate_fits") is False),
        "reserved_over_allocated": (round(statistics.median(r["reserved_bytes"] / r["measured_bytes"]
                                                            for r in measured if r.get("reserved_bytes")), 4)
                                    if any(r.get("reserved_bytes") for r in measured) else None),
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(out["summary"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
