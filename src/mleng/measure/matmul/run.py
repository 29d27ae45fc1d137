"""MAMF: one whole run (seeds, warm-up, search, record), the datasheet peak, every GPU at once."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

from mleng.errors import MlengError, UsageError
from mleng.machine.fingerprint import collect_for_record
from mleng.measure.matmul.bench import (
    MatmulBench,
    check_dtype_supported,
    check_fits,
    device_name,
    resolve_device,
)
from mleng.measure.matmul.search import (
    BURST_IDLE_S,
    BURST_WARMUP,
    FINAL_WARMUP_S,
    adaptive_search,
    exhaustive_search,
)
from mleng.measure.matmul.shapes import (
    FP8_DTYPES,
    SPEC_KEYS,
    OnResult,
    SearchResult,
    SearchSpace,
    Shape,
    ShapeResult,
    canonical_dtype,
    rate,
)
from mleng.measure.timing import process_elapsed_s

# ---------------------------------------------------------------- seeds: where to look first

SEEDS_FILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "mamf_seeds.toml")
# Stored runs consulted for seeds: the newest few of the same device model and dtype.
STORE_SEED_RUNS = 5


def _shape_from_text(text: Any) -> Shape | None:
    try:
        m, n, k = (int(v) for v in str(text).lower().split("x"))
    except (TypeError, ValueError):
        return None
    return Shape(m, n, k) if min(m, n, k) > 0 else None


def seed_shapes(name: str, dtype: str, space: SearchSpace, store_path: str | os.PathLike | None = None,
                seeds_file: str | os.PathLike = SEEDS_FILE) -> tuple[list[Shape], dict[str, Any]]:
    """Shapes that were fastest on this device model before: from stored runs, then the data file.

    Seeds only decide where the search looks first; every seed is measured like any other shape, so
    a wrong or stale seed costs a few milliseconds and cannot raise the result. An unreadable store
    or data file gives no seeds (and says why in the returned provenance), never an error.
    """
    import tomllib

    seeds: list[Shape] = []
    provenance: dict[str, Any] = {"store": 0, "data": 0}

    def add(shape: Shape | None, source: str) -> None:
        if shape is not None and space.contains(shape) and shape not in seeds:
            seeds.append(shape)
            provenance[source] += 1

    try:
        from mleng.results.store import Store

        with Store(store_path, create=False) as store:
            runs = [r for r in store.list(kind="mamf", limit=200)
                    if r["status"] == "complete" and r["summary"].get("device_name") == name
                    and r["summary"].get("dtype") == dtype][:STORE_SEED_RUNS]
        for run in runs:
            add(_shape_from_text(run["summary"].get("best_shape")), "store")
            add(_shape_from_text((run["summary"].get("burst") or {}).get("best_shape")), "store")
    except (MlengError, OSError, ValueError) as exc:
        provenance["store_unread"] = str(exc).splitlines()[0]
    try:
        with open(seeds_file, "rb") as f:
            data = tomllib.load(f)
        for entry in data.get("seed", []):
            if entry.get("device_name") == name and entry.get("dtype") == dtype:
                for text in entry.get("shapes", []):
                    add(_shape_from_text(text), "data")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        provenance["data_unread"] = str(exc).splitlines()[0]
    provenance["shapes"] = [str(s) for s in seeds]
    return seeds, provenance


# ---------------------------------------------------------------- one whole run

@dataclasses.dataclass
class MamfOptions:
    device: str | int | None = None
    dtype: str | None = None          # None: bfloat16 on accelerators, float32 on CPU
    tf32: bool = False
    fp8_fast_accum: bool = False
    max_seconds: float = 60.0         # wall clock from process start
    shapes: list[Shape] | None = None  # exhaustive/exact mode when given
    min_dim: int | None = None
    max_dim: int | None = None
    granule: int = 64
    iters: int | None = None          # finalist/exact iteration count; None: adaptive
    seeds: bool = True                # start from the best shapes of earlier runs on this device model
    store_path: str | None = None     # where earlier runs are read from (None: the default store)


def _signal_name() -> str:
    from mleng import signals

    return signals.describe()


def run_mamf(options: MamfOptions, on_result: OnResult | None = None,
             on_start: Callable[[dict[str, Any]], None] | None = None):
    """Resolve device and dtype, warm up, search, and return the finished Measurement.

    Ctrl-C at any point after start-up returns the record with status 'interrupted' and the best
    shape so far. Usage problems raise before anything is measured.
    """
    import torch

    from mleng.measure.gpu_monitor import GpuMonitor, compact_samples
    from mleng.results.record import Measurement

    device = resolve_device(options.device)
    dtype = canonical_dtype(options.dtype) if options.dtype else ("float32" if device.type == "cpu" else "bfloat16")
    if options.tf32 and (device.type != "cuda" or dtype != "float32"):
        raise UsageError(f"--tf32 on changes float32 matmuls on NVIDIA GPUs only; this run is {dtype} on {device}",
                         hint="drop --tf32 (or measure --dtype float32 on a CUDA GPU)")
    if options.shapes is not None:
        shapes = list(options.shapes)
        if not shapes:
            raise UsageError("no shapes to measure")
        for shape in shapes:
            if min(shape.m, shape.n, shape.k) <= 0:
                raise UsageError(f"shape {shape}: matrix dimensions must be positive")
        space = None
        max_dim = max(max(s.m, s.n, s.k) for s in shapes)
        fit_shapes = shapes
    else:
        default_hi = 16384 if device.type != "cpu" else 4096
        hi = options.max_dim or default_hi
        lo = options.min_dim or min(1024 if device.type != "cpu" else 256, hi)
        granule = options.granule if dtype not in FP8_DTYPES else max(16, options.granule)
        space = SearchSpace(lo=_round_up(lo, granule), hi=hi - hi % granule or granule, granule=granule)
        max_dim = space.hi
        fit_shapes = [space.max_shape]
    if options.max_seconds <= 0:
        raise UsageError(f"--max-seconds must be positive (got {options.max_seconds})")
    check_dtype_supported(device, dtype, max_dim)
    check_fits(device, dtype, fit_shapes)

    name = device_name(device)
    theoretical, theoretical_source = theoretical_tflops(device, name, dtype, options.tf32)
    params = {"device": str(device), "dtype": dtype, "tf32": options.tf32, "max_seconds": options.max_seconds,
              "search": "adaptive" if space else "exhaustive",
              "space": dataclasses.asdict(space) if space else None,
              "shapes": len(shapes) if space is None else None, "iters": options.iters,
              "seeds": options.seeds if space else None}
    if dtype in FP8_DTYPES:
        params["fp8_fast_accum"] = options.fp8_fast_accum
    measurement = Measurement.start("mamf", params, machine=collect_for_record())
    deadline = time.monotonic() + options.max_seconds - process_elapsed_s()

    monitor = None
    if device.type == "cuda" and not getattr(torch.version, "hip", None):
        monitor = GpuMonitor(uuid=nvml_uuid(device), index=device.index)
    elif device.type == "cuda":
        monitor = GpuMonitor(index=device.index)
    if monitor is not None:
        monitor.start()
    phase_windows: dict[str, list[float]] = {}
    row_telemetry: dict[int, dict[str, Any]] = {}

    def record(result: ShapeResult, best: ShapeResult | None) -> None:
        if monitor is not None:
            now = monitor.now_s()
            window = phase_windows.setdefault(result.phase, [now - result.wall_s, now])
            window[1] = now
            if result.phase in ("final", "burst"):
                row_telemetry[id(result)] = _row_telemetry(monitor.summary(now - result.wall_s, now))
        if on_result is not None:
            on_result(result, best)

    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    warm: dict[str, Any] | None = None
    seed_info: dict[str, Any] | None = None
    search: SearchResult | None = None
    interrupted = False
    try:
        if space is not None:
            bench = MatmulBench(device, dtype, space.hi * space.hi, space.hi * space.hi, space.hi * space.hi,
                                tf32=options.tf32, fp8_fast_accum=options.fp8_fast_accum)
        else:
            bench = MatmulBench(device, dtype, max(s.m * s.k for s in shapes), max(s.n * s.k for s in shapes),
                                max(s.m * s.n for s in shapes), tf32=options.tf32,
                                fp8_fast_accum=options.fp8_fast_accum)
        bench.probe()
        if on_start is not None:
            on_start({"device": str(device), "name": name, "dtype": dtype, "params": params})
        if device.type != "cpu":
            warm_shape = Shape(8192, 8192, 8192) if space is None or space.hi >= 8192 else space.max_shape
            if space is None:
                warm_shape = max(shapes, key=lambda s: s.flops)
            # A short budget (a doctor's quick tier) must not go to warming up.
            left = max(deadline - time.monotonic(), 0.0)
            warm = bench.warm_up(warm_shape, monitor, min_s=min(1.0, 0.1 * left), max_s=min(3.0, 0.2 * left))
            if monitor is not None:
                phase_windows["warmup"] = [monitor.now_s() - warm["seconds"], monitor.now_s()]
        if space is not None:
            seeds: list[Shape] = []
            if options.seeds:
                seeds, seed_info = seed_shapes(name, dtype, space, options.store_path)
            search = adaptive_search(bench, space, deadline=deadline, on_result=record, sm_count=sm_count,
                                     final_fixed_s=bench.final_fixed_s, bursts=bench.has_boost_clock,
                                     seeds=seeds)
        else:
            search = exhaustive_search(bench, shapes, deadline=deadline, on_result=record, iters=options.iters,
                                       final_fixed_s=bench.final_fixed_s, bursts=bench.has_boost_clock)
        interrupted = search.interrupted
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if monitor is not None:
            monitor.stop()

    results = search.results if search else []
    best = search.best if search else None
    measurement.rows = [{**r.row(dtype), **row_telemetry.get(id(r), {})} for r in results]
    burst = search.burst if search else None
    summary: dict[str, Any] = {
        "value": rate(best.tflops_median) if best else None,
        "unit": "TFLOPS",
        "theoretical": theoretical,
        "ratio": round(best.tflops_median / theoretical, 4) if best and theoretical else None,
        "device": str(device),
        "device_name": name,
        "dtype": dtype,
        "spec_key": spec_key(dtype, options.tf32),
        "theoretical_source": theoretical_source,
        "best_shape": str(best.shape) if best else None,
        "m": best.shape.m if best else None, "n": best.shape.n if best else None,
        "k": best.shape.k if best else None,
        "tflops_median": rate(best.tflops_median) if best else None,
        "tflops_mean": rate(best.tflops_mean) if best else None,
        "tflops_max": rate(best.tflops_max) if best else None,
        "iters": best.stats.iters if best else None,
        "best_phase": best.phase if best else None,
        "burst": ({"best_shape": str(burst.shape), "tflops_median": rate(burst.tflops_median),
                   "tflops_mean": rate(burst.tflops_mean), "tflops_max": rate(burst.tflops_max),
                   "iters": burst.stats.iters, "idle_before_s": BURST_IDLE_S, "warmup_calls": BURST_WARMUP}
                  if burst else None),
        "final_warmup_s": FINAL_WARMUP_S if device.type != "cpu" else 0.0,
        "shapes_tried": search.shapes_tried if search else 0,
        "measurements": len(results),
        "phases": search.phase_counts() if search else {},
        "stop_reason": "interrupted" if interrupted else (search.stop_reason if search else None),
        "search": params["search"],
        "wall_s_from_process_start": round(process_elapsed_s(), 2),
        "warmup": warm,
        "seeds": seed_info,
    }
    if monitor is not None:
        overall = monitor.summary()
        overall["timeline"] = compact_samples(monitor.window())
        summary["gpu_monitor"] = overall
        summary["gpu_monitor_by_phase"] = {phase: monitor.summary(w[0], w[1]) for phase, w in phase_windows.items()}
        measuring = [w for p, w in phase_windows.items() if p != "warmup"]
        if measuring:
            summary["gpu_monitor_measuring"] = monitor.summary(min(w[0] for w in measuring),
                                                               max(w[1] for w in measuring))
    else:
        summary["gpu_monitor"] = {"available": False,
                                  "reason": "no NVML telemetry for this device type" if device.type != "cuda"
                                  else "NVML telemetry is NVIDIA-only"}
    measurement.summary = summary
    if interrupted:
        measurement.finish("interrupted", f"stopped by {_signal_name()}; the best shape so far is kept")
    else:
        measurement.finish("complete")
    return measurement


def _row_telemetry(window: dict[str, Any]) -> dict[str, Any]:
    """The SM clock and power while one finalist was measured, for its row."""
    out: dict[str, Any] = {}
    if window.get("samples"):
        out["sm_clock_mhz_mean"] = (window.get("sm_clock_mhz") or {}).get("mean")
        out["power_w_mean"] = (window.get("power_w") or {}).get("mean")
    return out


def _round_up(value: int, granule: int) -> int:
    return -(-value // granule) * granule


def spec_key(dtype: str, tf32: bool) -> str:
    return "tf32" if dtype == "float32" and tf32 else SPEC_KEYS[dtype]


def theoretical_tflops(device, name: str, dtype: str, tf32: bool) -> tuple[float | None, str | None]:
    """The datasheet dense rate for this card and dtype from mleng.specs, or None with the reason."""
    if device.type == "cpu":
        return None, "no theoretical peak is kept for CPUs"
    from mleng.specs import find_accelerator

    accelerator, why_not = find_accelerator(name)
    if accelerator is None:
        return None, why_not
    value = (accelerator.tflops or {}).get(spec_key(dtype, tf32))
    if value is None:
        return None, f"spec entry {accelerator.key} has no {spec_key(dtype, tf32)} rate"
    return float(value), f"{accelerator.key} ({accelerator.name}), dense {spec_key(dtype, tf32)}"


def nvml_uuid(device) -> str | None:
    """The GPU's UUID in NVML's spelling, so that the monitor samples the same card torch uses."""
    from mleng.machine.nvml import torch_gpu_uuid

    return torch_gpu_uuid(device)


def run_all_devices(options: MamfOptions, devices: list[str]):
    """run_mamf on every device at once, one process each (measure/fanout.py); the children store nothing.

    Returns a Measurement whose rows are every GPU's shapes (with a `device` field) and whose
    summary names each GPU's best, the slowest GPU and the spread between slowest and fastest.
    """
    from mleng.measure.fanout import run_per_device
    from mleng.results.record import Measurement

    options_params = dataclasses.asdict(dataclasses.replace(options, device=None, shapes=None, store_path=None))
    options_params["shapes"] = len(options.shapes) if options.shapes is not None else None
    measurement = Measurement.start("mamf", {"all_devices": True, "devices": len(devices), "options": options_params})
    outcomes = run_per_device(_mamf_on_device, devices, args=options)
    measurement.machine = collect_for_record()

    per_device, errors, interrupted = [], [], False
    for index, outcome in enumerate(outcomes):
        record = outcome.result
        if record is None and outcome.status == "failed":
            errors.append(f"GPU {index}: {outcome.error}")
            continue
        record = record or {"status": outcome.status}  # stopped before its run had begun: nothing measured
        interrupted |= record.get("status") == "interrupted"
        summary = record.get("summary", {})
        for row in record.get("rows", []):
            measurement.rows.append({"device": index, **row})
        per_device.append({
            "device": index, "device_name": summary.get("device_name"), "best_shape": summary.get("best_shape"),
            "tflops_median": summary.get("tflops_median"), "tflops_mean": summary.get("tflops_mean"),
            "tflops_max": summary.get("tflops_max"), "ratio": summary.get("ratio"),
            "shapes_tried": summary.get("shapes_tried"), "status": record.get("status"),
            "sm_clock_mhz_mean": ((summary.get("gpu_monitor_measuring") or {}).get("sm_clock_mhz") or {}).get("mean"),
            "below_max_clock": (summary.get("gpu_monitor_measuring") or {}).get("below_max_clock"),
            "power_w_mean": ((summary.get("gpu_monitor_measuring") or {}).get("power_w") or {}).get("mean"),
            "record_id": record.get("id"),
        })
        measurement.summary.setdefault("theoretical", summary.get("theoretical"))
        measurement.summary.setdefault("dtype", summary.get("dtype"))
    rates = [d["tflops_median"] for d in per_device if d["tflops_median"] is not None]
    slowest = min((d for d in per_device if d["tflops_median"] is not None),
                  key=lambda d: d["tflops_median"], default=None)
    fastest = max(rates, default=None)
    theoretical = measurement.summary.get("theoretical")
    measurement.summary.update({
        "value": slowest["tflops_median"] if slowest else None,
        "unit": "TFLOPS",
        "ratio": round(slowest["tflops_median"] / theoretical, 4) if slowest and theoretical else None,
        "headline": "slowest GPU's best median",
        "per_device": per_device,
        "slowest_device": slowest["device"] if slowest else None,
        "fastest_tflops": fastest,
        "spread_pct": round((fastest - slowest["tflops_median"]) / fastest * 100, 2) if slowest and fastest else None,
        "errors": errors,
    })
    if errors:
        measurement.finish("failed", "; ".join(errors))
    elif interrupted:
        measurement.finish("interrupted", f"stopped by {_signal_name()}; each GPU's best shape so far is kept")
    else:
        measurement.finish("complete")
    return measurement


def _mamf_on_device(device: str, options: MamfOptions, sync, send) -> dict[str, Any]:
    """One GPU's run in its fan-out process: the whole run, on this device, as a dict."""
    return run_mamf(dataclasses.replace(options, device=device)).to_dict()
