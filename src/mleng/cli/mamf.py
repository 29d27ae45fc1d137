"""`mleng mamf`: maximum achievable matmul TFLOPS, by an adaptive shape search or an exhaustive grid."""

from __future__ import annotations

import argparse
import sys
import time

from mleng.cli.common import exit_code_for, preflight_store, store_or_warn
from mleng.cli.render import Progress, print_json, table
from mleng.errors import NotAvailableError, UsageError

MAX_GRID_SHAPES = 200_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Default: an adaptive search over M, N, K in 1024..16384 (256..4096 on a CPU) that stops at "
        "--max-seconds or when refining stops finding faster shapes. --grid, --m/--n/--k and the "
        "--*-range flags measure exactly the shapes they describe instead; every range's STOP is included. "
        "Examples: mleng mamf;  mleng mamf --grid 1024:16384:1024 --max-seconds 300;  "
        "mleng mamf --m 4096 --n 4096 --k 4096 8192;  mleng mamf --device cpu --max-dim 512"
    )
    parser.add_argument("--device", help="GPU index N, or cpu, cuda:N, mps, xpu:N (default: first GPU, else CPU)")
    parser.add_argument("--all-devices", action="store_true",
                        help="measure every local GPU at the same time, one process each; report each, "
                             "the slowest and the spread")
    parser.add_argument("--dtype", help="bfloat16 (default on GPUs), float16, float32 (default on CPU), "
                                        "float8_e4m3fn, float8_e4m3fnuz (ROCm); aliases bf16, fp16, fp32, fp8")
    parser.add_argument("--tf32", choices=["on", "off"], default="off",
                        help="float32 matmuls on TF32 tensor cores (default off)")
    parser.add_argument("--fp8-fast-accum", action="store_true",
                        help="fp8: accumulate with the faster, less precise mode (use_fast_accum)")
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="time budget, wall clock from process start (default 60)")
    parser.add_argument("--grid", nargs="+", metavar="RANGE",
                        help="exhaustive grid: START:STOP:STEP for all three dims, three ranges M N K, "
                             "or nine integers M_START M_STOP M_STEP N_START N_STOP N_STEP K_START K_STOP K_STEP")
    for dim in ("m", "n", "k"):
        parser.add_argument(f"--{dim}", nargs="+", metavar="N",
                            help=f"exact {dim.upper()} values (a list; with the other dims gives their product)")
        parser.add_argument(f"--{dim}-range", metavar="START:STOP:STEP", help=f"a range of {dim.upper()} values")
    parser.add_argument("--iters", type=int, help="timed iterations per finalist / exact shape (default: adaptive)")
    parser.add_argument("--min-dim", type=int, help="adaptive search: smallest dimension (default 1024; CPU 256)")
    parser.add_argument("--max-dim", type=int, help="adaptive search: largest dimension (default 16384; CPU 4096)")
    parser.add_argument("--step", type=int, default=64,
                        help="adaptive search: finest step, every dimension a multiple of it (default 64)")
    parser.add_argument("--top", type=int, default=10, help="shapes listed in the output (default 10)")
    parser.add_argument("--no-seeds", action="store_true",
                        help="adaptive search: do not start from the best shapes of earlier runs on this device "
                             "model (stored runs, and the data file mleng/measure/data/mamf_seeds.toml)")
    parser.add_argument("--no-store", action="store_true", help="do not save the result in the results store")


def shapes_from_args(args: argparse.Namespace):
    """The exact shapes asked for, or None for the adaptive search."""
    from mleng.measure.matmul import parse_dims, parse_grid, parse_range, product_shapes

    values: dict[str, list[int] | None] = {"m": None, "n": None, "k": None}
    if args.grid:
        values["m"], values["n"], values["k"] = parse_grid(args.grid)
    for dim in values:
        listed, ranged = getattr(args, dim), getattr(args, f"{dim}_range")
        if listed and ranged:
            raise UsageError(f"give either --{dim} or --{dim}-range, not both")
        if listed:
            values[dim] = parse_dims(listed, dim)
        elif ranged:
            values[dim] = parse_range(ranged)
    given = [d for d, v in values.items() if v is not None]
    if not given:
        return None
    missing = [d for d, v in values.items() if v is None]
    if missing:
        raise UsageError(f"shape values for {', '.join(given).upper()} but not for {', '.join(missing).upper()}",
                         hint="give all three (--m/--n/--k or their -range forms), or --grid for the rest")
    count = len(values["m"]) * len(values["n"]) * len(values["k"])
    if count > MAX_GRID_SHAPES:
        raise UsageError(f"the grid has {count} shapes, more than {MAX_GRID_SHAPES}", hint="use a larger STEP")
    return product_shapes(values["m"], values["n"], values["k"])


def run(args: argparse.Namespace) -> int:
    return _finish(measure(args, progress=True), args)


def measure(args: argparse.Namespace, progress: bool = False):
    """What `mleng mamf` does before it stores and prints: the flags checked (before torch), the store checked,
    the run; returns the Measurement. `mleng.mamf()` calls it without progress on stderr."""
    from mleng.measure.matmul import MamfOptions, canonical_dtype, run_mamf

    if args.dtype:
        canonical_dtype(args.dtype)  # an unknown dtype is refused before torch is imported
    if args.iters is not None and args.iters < 1:
        raise UsageError(f"--iters must be at least 1 (got {args.iters})")
    if args.max_seconds <= 0:
        raise UsageError(f"--max-seconds must be positive (got {args.max_seconds})")
    for flag in ("min_dim", "max_dim", "step"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be positive (got {value})")
    shapes = shapes_from_args(args)
    preflight_store(args)  # an unusable store stops us now, not after the whole search
    options = MamfOptions(device=args.device, dtype=args.dtype, tf32=args.tf32 == "on",
                          fp8_fast_accum=args.fp8_fast_accum, max_seconds=args.max_seconds, shapes=shapes,
                          min_dim=args.min_dim, max_dim=args.max_dim, granule=args.step, iters=args.iters,
                          seeds=not args.no_seeds)
    if args.all_devices:
        return _measure_all_devices(options, progress and not args.json)
    if not progress:
        return run_mamf(options)
    return _run_one(options, quiet=args.json)


def _run_one(options, quiet: bool):
    from mleng.measure.matmul import run_mamf

    progress = Progress(options.max_seconds, label="mamf")
    started = time.monotonic()
    count = [0]

    def on_start(info: dict) -> None:
        search = info["params"]["search"]
        what = ("adaptive search" if search == "adaptive"
                else f"{info['params']['shapes']} shapes")
        print(f"mleng mamf: {info['name']} ({info['device']}), {info['dtype']}, {what}, "
              f"budget {options.max_seconds:g} s from process start", file=sys.stderr, flush=True)

    def on_result(result, best) -> None:
        count[0] += 1
        note = f"{count[0]} measured, {result.phase}"
        if best is not None:
            note += f", best {best.tflops_median:.1f} TFLOPS at {best.shape}"
        progress.update(time.monotonic() - started, note)

    try:
        return run_mamf(options, on_result=on_result, on_start=on_start)
    finally:
        progress.close()


def _finish(measurement, args: argparse.Namespace) -> int:
    stored_id = store_or_warn(measurement, args)
    if args.json:
        print_json(measurement.to_dict())
    else:
        print(render(measurement, top=args.top))
        if stored_id:
            print(f"stored as {stored_id} (mleng results show {stored_id})")
    return exit_code_for(measurement)


def render(measurement, top: int = 10) -> str:
    s = measurement.summary
    if s.get("per_device") is not None:
        return _render_all_devices(measurement)
    lines = []
    if measurement.status == "interrupted":
        lines.append("interrupted: the best shape measured so far is kept")
    if s.get("best_shape") is None:
        lines.append("no shape was measured")
        return "\n".join(lines)
    iters_note = f"{s['iters']} iterations"
    if s.get("best_phase") != "final":
        iters_note += f", {s['best_phase']} phase only"
    elif s.get("final_warmup_s"):
        iters_note += f" after {s['final_warmup_s']:g} s of warm-up on the shape"
    fields = [
        ("device", f"{s['device_name']} ({s['device']}), {s['dtype']}"
                   + (" (TF32 on)" if measurement.params.get("tf32") and s.get("dtype") == "float32"
                      and not str(s.get("device", "")).startswith("cpu") else "")),
        ("best shape", f"{s['best_shape']} (M x N x K)"),
        ("median", f"{_tf(s['tflops_median'])} TFLOPS  (mean {_tf(s['tflops_mean'])}, "
                   f"max {_tf(s['tflops_max'])}; {iters_note})"),
    ]
    burst = s.get("burst")
    if burst:
        fields.append(("burst median", f"{_tf(burst['tflops_median'])} TFLOPS at {burst['best_shape']}  "
                                       f"(max {_tf(burst['tflops_max'])}; {burst['iters']} iterations"
                                       + (f" after {burst['idle_before_s']:g} s idle and "
                                          f"{burst['warmup_calls']} warm-up calls)" if burst["idle_before_s"]
                                          else ")")))
    if s.get("theoretical"):
        fields.append(("theoretical", f"{s['theoretical']:.1f} TFLOPS ({s['theoretical_source']})"))
        fields.append(("efficiency", f"{s['ratio'] * 100:.1f}% of theoretical"))
    else:
        fields.append(("theoretical", f"unknown: {s.get('theoretical_source')}"))
    phases = ", ".join(f"{name} {count}" for name, count in s.get("phases", {}).items())
    stop = s["stop_reason"]
    if stop == "time budget":
        stop += " (the search did not finish: the median is a lower bound on this device's MAMF)"
    fields.append(("shapes tried", f"{s['shapes_tried']} ({phases}); stop: {stop}"))
    seeds = s.get("seeds")
    if seeds and seeds.get("shapes"):
        fields.append(("seeds", f"{len(seeds['shapes'])} shapes first ({seeds['store']} from stored runs, "
                                f"{seeds['data']} from the seed list)"))
    fields.append(("elapsed", f"{s['wall_s_from_process_start']:.1f} s from process start"))
    gpu = s.get("gpu_monitor_measuring") or s.get("gpu_monitor") or {}
    if gpu.get("available") and gpu.get("sm_clock_mhz"):
        clock = gpu["sm_clock_mhz"]
        power = gpu.get("power_w") or {}
        temp = gpu.get("temperature_c") or {}
        text = (f"SM clock mean {clock['mean']:.0f} MHz (min {clock['min']:.0f}, card max "
                f"{gpu['sm_clock_max_mhz']:.0f})")
        if power:
            text += f"; power mean {power['mean']:.0f} W, max {power['max']:.0f} W"
        if temp:
            text += f"; temperature max {temp['max']:.0f} C"
        fields.append(("while measuring", text))
    elif gpu and not gpu.get("available", True):
        fields.append(("telemetry", f"none: {gpu.get('reason')}"))
    width = max(len(k) for k, _ in fields)
    lines.extend(f"{k.ljust(width)}  {v}" for k, v in fields)
    from mleng.measure.gpu_monitor import clock_note

    note = clock_note(gpu) if gpu else None
    if note:
        lines.append(f"note: {note}; the rate above is what the card reached at that clock")
    rows = sorted((r for r in measurement.rows if r["phase"] == "final"),
                  key=lambda r: r["tflops_median"], reverse=True)
    if not rows:
        rows = sorted(measurement.rows, key=lambda r: r["tflops_median"], reverse=True)
    if rows:
        lines.append("")
        lines.append(f"top shapes ({'finalists' if rows[0]['phase'] == 'final' else 'screened'}; TFLOPS):")
        bursts = {(r["m"], r["n"], r["k"]): r["tflops_median"] for r in measurement.rows if r["phase"] == "burst"}
        shown = [{**r, "burst_tflops": bursts.get((r["m"], r["n"], r["k"]))} for r in rows[:top]]
        columns = [("m", "M"), ("n", "N"), ("k", "K"), ("tflops_median", "median"), ("tflops_mean", "mean"),
                   ("tflops_max", "max"), ("burst_tflops", "burst"), ("time_us_median", "time_us"),
                   ("iters", "iters"), ("sm_clock_mhz_mean", "SM MHz"), ("power_w_mean", "power W")]
        optional = {"burst_tflops", "sm_clock_mhz_mean", "power_w_mean"}
        columns = [(key, header) for key, header in columns
                   if key not in optional or any(r.get(key) is not None for r in shown)]
        lines.append(table(shown, [key for key, _ in columns], [header for _, header in columns]))
    return "\n".join(lines)


def _tf(value: float) -> str:
    """TFLOPS with one decimal on accelerators, three significant digits for a CPU's small rates."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def _render_all_devices(measurement) -> str:
    s = measurement.summary
    lines = []
    if measurement.status == "interrupted":
        lines.append("interrupted: each GPU's best shape so far is kept")
    lines.append(table(s["per_device"], ["device", "device_name", "best_shape", "tflops_median", "tflops_mean",
                                         "ratio", "sm_clock_mhz_mean", "power_w_mean", "below_max_clock", "status"],
                       ["GPU", "name", "best shape", "median", "mean", "of peak", "SM MHz", "power W",
                        "below max clock", "status"]))
    if s.get("value") is not None:
        lines.append("")
        lines.append(f"slowest GPU {s['slowest_device']}: {s['value']:.1f} TFLOPS; spread slowest to fastest "
                     f"{s['spread_pct']:.1f}%")
    for error in s.get("errors") or []:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def _measure_all_devices(options, progress: bool):
    import torch

    from mleng.measure.matmul import run_all_devices

    if options.device is not None:
        raise UsageError("--all-devices measures every GPU; leave out --device")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise NotAvailableError("--all-devices needs GPUs, and torch sees none on this machine",
                                hint="run mleng mamf --device cpu to measure the CPU")
    count = torch.cuda.device_count()
    if progress:
        print(f"mleng mamf: {count} GPUs, one process each, budget {options.max_seconds:g} s", file=sys.stderr)
    return run_all_devices(options, [f"cuda:{index}" for index in range(count)])
