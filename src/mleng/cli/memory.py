"""`mleng memory`: will a training or inference config fit, per GPU, estimated from the architecture; --calibrate
measures the activation coefficients, --measure checks an estimate against a real step."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mleng.errors import UsageError
from mleng.measure.sizes import format_gib


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Weights, gradients and optimizer states are counted exactly; activations and logits with coefficients "
        "measured by --calibrate (real steps, torch's memory tracking). Sizes in GiB (2^30). Examples: "
        "mleng memory 8b --seq 8192 --gpu h200;  mleng memory 70b --gpus 16 --fsdp --recompute full --gpu h200;  "
        "mleng memory ./config.json --inference --weights fp8 --gpu h200;  mleng memory tiny --seq 256 --measure")
    parser.add_argument("model", nargs="?", help="a preset of mleng step (tiny, 1b, 8b, 70b) or a local config.json")
    parser.add_argument("--layers", type=int, help="cut (or grow) the model to N layers, keeping its width")
    train = parser.add_argument_group("training")
    train.add_argument("--seq", type=int, default=2048, help="sequence length in tokens (default 2048)")
    train.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per forward pass (default 1)")
    train.add_argument("--grad-accum", type=int, help="micro-batches per step (pipeline: micro-batches in flight)")
    train.add_argument("--dtype", help="bfloat16 (default: mixed precision, fp32 master weights), float16, float32; "
                                       "--calibrate: float32 on a CPU, bfloat16 on a GPU by default")
    train.add_argument("--optimizer", default="adamw", help="adamw (default), adamw8bit, sgd, adafactor")
    train.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3 (default 0)")
    train.add_argument("--fsdp", action="store_true", help="FSDP full sharding (ZeRO-3 semantics, FSDP2 per block)")
    train.add_argument("--gpus", type=int, default=1, help="GPUs in all: data parallel x --tp x --pp (default 1)")
    train.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    train.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    train.add_argument("--recompute", help="activation recompute: none (default), selective, full; --calibrate: "
                                           "all three unless given")
    infer = parser.add_argument_group("inference")
    infer.add_argument("--inference", action="store_true", help="serving memory: weights, KV cache, concurrent tokens")
    infer.add_argument("--weights", default="bf16", help="weight dtype when serving: bf16 (default), fp16, fp8, fp4")
    infer.add_argument("--kv-dtype", default="bf16", help="KV cache dtype: bf16 (default), fp16, fp8")
    infer.add_argument("--max-batched-tokens", type=int, default=8192,
                       help="tokens in one forward pass, for the working memory (default 8192)")
    gpu = parser.add_argument_group("the GPU")
    gpu.add_argument("--gpu", help="check the fit on this GPU (a mleng specs name: h200, h100, b200, ...)")
    gpu.add_argument("--usable-gib", type=float, help="memory a process can have, instead of the recorded total")
    gpu.add_argument("--context-gib", type=float, help="CUDA context and kernels (default from the data file)")
    gpu.add_argument("--nccl-gib", type=float, help="NCCL buffers with more than one GPU (default from the data file)")
    gpu.add_argument("--fragmentation", type=float, help="allocator margin, a fraction of the allocated peak")
    meas = parser.add_argument_group("measuring")
    meas.add_argument("--calibrate", action="store_true",
                      help="measure the activation coefficients with real steps and write them to the data file")
    meas.add_argument("--measure", action="store_true",
                      help="run the config through a real training step here and store estimate vs measured")
    meas.add_argument("--device", choices=["cpu", "cuda"], help="where --measure/--calibrate run (default: cuda "
                                                                 "when there is one)")
    meas.add_argument("--coefficients", metavar="FILE", help="read (and --calibrate writes) this coefficients "
                                                              "file instead of the packaged one")
    meas.add_argument("--no-store", action="store_true", help="--measure: do not save the record")
    meas.add_argument("--step", metavar="ID", help="compare with a stored `mleng step` run: its allocator peak beside "
                                                  "the estimate of its own config (model, seq, dtype, DDP/FSDP, ranks)")


def _coeff_data(args):
    if not args.coefficients:
        return None
    from mleng.plan.memory import load_coefficients

    path = Path(args.coefficients)
    if not path.exists() and not args.calibrate:
        raise UsageError(f"--coefficients {args.coefficients}: no such file")
    return load_coefficients(path)


def _setup(args):
    from mleng.plan.memory import TrainSetup

    return TrainSetup(seq=args.seq, micro_batch=args.micro_batch, dtype=(args.dtype or "bfloat16").lower(),
                      optimizer=args.optimizer, zero=args.zero, fsdp=args.fsdp, gpus=args.gpus, tp=args.tp, pp=args.pp,
                      recompute=args.recompute or "none", grad_accum=args.grad_accum, gpu=args.gpu,
                      usable_gib=args.usable_gib, context_gib=args.context_gib, nccl_gib=args.nccl_gib,
                      fragmentation=args.fragmentation)


def result(args: argparse.Namespace) -> dict:
    """What `mleng memory --json` prints (the estimate; --measure adds the measurement)."""
    from mleng.plan.arch import resolve
    from mleng.plan.memory import InferSetup, estimate_inference, estimate_training

    if args.step:
        from mleng.plan.check import compare_step_record
        from mleng.results.store import Store

        if args.model:
            raise UsageError("--step compares a stored run with the estimate of its own config; give no model")
        with Store(create=False) as store:
            if not store.exists:
                raise UsageError("no results stored yet", hint="run `mleng step` on a GPU first")
            record = store.get(args.step).to_dict()
        return {"mode": "step-comparison", **compare_step_record(record, _coeff_data(args))}
    if not args.model:
        raise UsageError("give a model: a preset (tiny, 1b, 8b, 70b) or a local config.json",
                         hint="or --calibrate to measure the activation coefficients")
    arch = resolve(args.model, args.layers)
    if args.inference:
        if args.measure:
            raise UsageError("--measure runs a training step; it does not combine with --inference")
        return estimate_inference(arch, InferSetup(weights=args.weights.lower(), kv_dtype=args.kv_dtype.lower(),
                                                   tp=args.tp, gpus=args.gpus if args.gpus != 1 else None,
                                                   max_batched_tokens=args.max_batched_tokens, gpu=args.gpu,
                                                   usable_gib=args.usable_gib, context_gib=args.context_gib,
                                                   nccl_gib=args.nccl_gib, fragmentation=args.fragmentation))
    setup = _setup(args)
    setup.optimizer = (setup.optimizer or "").lower()
    setup.recompute = (setup.recompute or "").lower()
    estimate = estimate_training(arch, setup, _coeff_data(args))
    if args.measure:
        from mleng.plan.check import measure_against

        estimate["measured"] = measure_against(arch, setup, estimate, args.device, store=not args.no_store,
                                               argv=getattr(args, "_argv", []))
    return estimate


def run(args: argparse.Namespace) -> int:
    from mleng.cli.render import print_json

    if args.calibrate:
        return _calibrate(args)
    out = result(args)
    if args.json:
        print_json(out)
    elif out["mode"] == "step-comparison":
        print(f"step run {out['id']} ({out['parallel']}, {out['world_size']} rank(s), compile {out['compile']}): "
              f"measured peak {format_gib(out['measured_peak_bytes'])} allocated, estimated "
              f"{format_gib(out['estimated_peak_bytes'])}: error {out['error_pct']:+.1f}%")
    else:
        print(render(out))
    return 0


def _calibrate(args) -> int:
    from mleng.cli.render import print_json
    from mleng.plan import coeffile, probe
    from mleng.plan.memory import COEFFICIENTS_FILE, DTYPES, RECOMPUTE

    if args.model:
        raise UsageError("--calibrate measures mleng's own calibration shapes; give no model")
    modes = [m.strip().lower() for m in args.recompute.split(",")] if args.recompute else list(RECOMPUTE)
    for m in modes:
        if m not in RECOMPUTE:
            raise UsageError(f"--recompute {m}: known: {', '.join(RECOMPUTE)}")
    if args.dtype is not None and DTYPES.get(args.dtype.lower()) not in ("float32", "bfloat16"):
        raise UsageError(f"--calibrate --dtype {args.dtype}: calibrate float32 or bfloat16 (float16 reads bfloat16)")
    device = args.device
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        from mleng.errors import NotAvailableError

        raise NotAvailableError("--device cuda: torch sees no CUDA GPU here")
    dtype = DTYPES[args.dtype.lower()] if args.dtype else ("bfloat16" if device == "cuda" else "float32")
    path = Path(args.coefficients) if args.coefficients else COEFFICIENTS_FILE
    command = "mleng memory --calibrate --dtype " + dtype + " --recompute " + ",".join(modes) + f" --device {device}"
    done = []
    for mode in modes:
        def progress(i, n, run, mode=mode):
            if not args.json:
                print(f"  {dtype}/{mode}: run {i}/{n} (dim {run['dim']}, {run['n_layers']} layers, "
                      f"{run['micro_batch']}x{run['seq']} tokens): peak {run['peak_bytes'] / 2**20:.2f} MiB",
                      file=sys.stderr, flush=True)

        fitted = probe.run_calibration(dtype, mode, device=device, progress=progress)
        coeffile.write_set(path, fitted, command, device)
        done.append({"set": f"{dtype}/{mode}", "fit": fitted["fit"], "book_copies_llama8b": fitted["book_copies_llama8b"]})
    if args.json:
        print_json({"file": str(path), "sets": done})
    else:
        for d in done:
            print(f"{d['set']}: {d['fit']['runs']} runs, predicted peak vs measured: median "
                  f"{d['fit']['median_abs_error_pct']}%, max {d['fit']['max_abs_error_pct']}%; one block saves "
                  f"{d['book_copies_llama8b']} x dtype x hidden bytes per token at the Llama-3.1-8B shape "
                  "(the book's 'copies')")
        print(f"written to {path}")
    return 0


def render(out: dict) -> str:
    from mleng.cli.render import table

    lines = []
    if out["mode"] == "training":
        s = out["setup"]
        layout = f"{s['gpus']} GPU{'s' if s['gpus'] > 1 else ''}"
        if s["tp"] > 1 or s["pp"] > 1:
            layout += f" (dp {s['dp']} x tp {s['tp']} x pp {s['pp']})"
        shard = "FSDP" if s["fsdp"] else f"ZeRO-{s['zero']}" if s["zero"] else "no sharding"
        lines.append(f"{out['model']}: {out['parameters'] / 1e9:.3g} B parameters, {out['attention']}; training "
                     f"seq {s['seq']} x micro-batch {s['micro_batch']}, {s['dtype']}, {s['optimizer']}, {shard}, "
                     f"recompute {s['recompute']}, {layout}")
        lines.append(f"per GPU at the peak ({out['peak_phase']}" + (f", {out['peak_stage']}" if out.get("peak_stage")
                                                                    else "") + "), GiB:")
    else:
        s = out["setup"]
        lines.append(f"{out['model']}: {out['parameters'] / 1e9:.3g} B parameters, {out['attention']}; inference, "
                     f"weights {s['weights']}, KV cache {s['kv_dtype']}, tp {s['tp']}")
        lines.append("per GPU, GiB:")
    lines.append(table([{"memory": r["row"], "GiB": r["gib"]} for r in out["rows"]], ["memory", "GiB"]))
    if out["mode"] == "inference":
        lines.append(f"KV cache: {out['kv_cache_bytes_per_token']:,.0f} bytes ({out['kv_cache_mb_per_token']} MB) "
                     "per token per GPU")
    gpu = out.get("gpu")
    if gpu:
        lines.append("")
        verdict = "FITS" if gpu["fits"] else "DOES NOT FIT"
        need = out.get("total_bytes", out.get("fixed_bytes"))
        lines.append(f"{gpu['name']}: {verdict}: needs {format_gib(need)} of {gpu['usable_gib']} GiB usable "
                     f"(headroom {gpu['headroom_gib']} GiB)")
        lines.append(f"  usable = device total {gpu['device_total_gib']} GiB - {gpu['driver_reserved_gib']} GiB the "
                     f"driver holds with no process; from: {gpu['usable_source']}")
        if out["mode"] == "training":
            ls, mb = gpu["longest_seq"], gpu["largest_micro_batch"]
            lines.append(f"  longest sequence that fits at micro-batch {out['setup']['micro_batch']}: "
                         + (f"{ls:,} tokens" if ls else "none (not even 1 token)"))
            lines.append(f"  largest micro-batch that fits at seq {out['setup']['seq']}: "
                         + (f"{mb}" if mb else "none (not even 1)"))
        else:
            lines.append(f"  KV cache room: {format_gib(gpu['kv_cache_bytes'])} = {gpu['max_concurrent_tokens']:,} "
                         "concurrent tokens")
    else:
        lines.append("")
        lines.append("(give --gpu NAME, e.g. --gpu h200, to check the fit and find the longest sequence)")
    m = out.get("measured")
    if m:
        lines.append("")
        lines.append(f"measured on {m['device']}: peak {format_gib(m['measured_peak_bytes'])} vs estimated "
                     f"{format_gib(m['estimated_peak_bytes'])} allocated: error {m['error_pct']:+.1f}% "
                     f"({m['tracking']})" + (f"; stored as {m['id']}" if m.get("id") else ""))
        if m.get("reserved_peak_bytes"):
            lines.append(f"  reserved peak {format_gib(m['reserved_peak_bytes'])} vs estimated allocated + "
                         f"fragmentation {format_gib(m['estimated_reserved_bytes'])}")
    lines.append("")
    lines.append("assumptions (each a flag):")
    lines.extend(f"  - {a}" for a in out["assumptions"])
    return "\n".join(lines)
