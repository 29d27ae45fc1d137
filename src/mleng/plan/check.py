"""An estimate checked against a real step: `mleng memory --measure` runs the config here and stores the record
kind `memory` (estimate, measured peak, error); comparisons against stored `mleng step` records."""

from __future__ import annotations

from typing import Any

from mleng.errors import UsageError
from mleng.machine.system import host_available_bytes
from mleng.measure.sizes import GIB





def measure_against(arch, setup, estimate: dict[str, Any], device: str | None, store: bool = True,
                    argv: list[str] | None = None) -> dict[str, Any]:
    """Run one steady step of this config on this machine's one device; the measured peak beside the estimate."""
    if setup.gpus != 1 or setup.tp != 1 or setup.pp != 1 or setup.stage:
        raise UsageError("--measure runs one process on one device: it needs --gpus 1, no --tp/--pp/--zero/--fsdp",
                         hint="cut the model with --layers to fit one device, or compare a stored multi-GPU run: "
                              "`mleng step --parallel fsdp` records its allocator peak per rank")
    if setup.optimizer == "adamw8bit":
        raise UsageError("--measure --optimizer adamw8bit needs bitsandbytes, which mleng does not use",
                         hint="measure adamw, sgd or adafactor")
    import torch

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda" and not torch.cuda.is_available():
        from mleng.errors import NotAvailableError

        raise NotAvailableError("--device cuda: torch sees no CUDA GPU here")
    if dev == "cpu":
        have = host_available_bytes()
        need = estimate["allocated_peak_bytes"]
        if have is not None and need > have // 2:
            raise UsageError(f"--measure on this CPU: the estimate is {need / GIB:.2f} GiB and the host has "
                             f"{have / GIB:.2f} GiB available (measuring needs it twice over, with the tracking)",
                             hint="a smaller --seq or --layers, or measure on a GPU")
    from mleng.plan.probe import measure_step
    from mleng.results.record import Measurement

    params = {"model": arch.to_dict(), "setup": estimate["setup"], "argv": argv or []}
    record = Measurement.start("memory", params)
    cfg = arch.step_config()
    dtype = "bfloat16" if setup.dtype in ("bfloat16", "float16") else "float32"
    result = measure_step(cfg, setup.seq, setup.micro_batch, dtype=dtype, recompute=setup.recompute,
                          optimizer=setup.optimizer, device=dev)
    est = estimate["allocated_peak_bytes"]
    frag = next(r["bytes"] for r in estimate["rows"] if r["row"] == "fragmentation margin")
    error = 100.0 * (est - result.peak_bytes) / result.peak_bytes
    out = {"device": result.device, "tracking": result.tracking, "measured_peak_bytes": result.peak_bytes,
           "measured_before_step_bytes": result.before_step_bytes, "estimated_peak_bytes": est,
           "error_pct": round(error, 2), "reserved_peak_bytes": result.reserved_peak_bytes,
           "estimated_reserved_bytes": est + frag}
    from mleng.machine.fingerprint import collect_for_record

    record.machine = collect_for_record(gpus=dev == "cuda")
    record.rows = [{"row": r["row"], "estimated_bytes": r["bytes"]} for r in estimate["rows"]]
    record.rows.append({"row": "measured peak", "measured_bytes": result.peak_bytes,
                        "reserved_bytes": result.reserved_peak_bytes})
    record.summary = {"value": round(result.peak_bytes / GIB, 6), "unit": "GiB", "theoretical": round(est / GIB, 6),
                      "ratio": round(result.peak_bytes / est, 4) if est else None, "metric": "peak allocated",
                      "theoretical_source": "mleng memory estimate (allocated peak, before context and margin)",
                      "error_pct": out["error_pct"], "tracking": result.tracking, "model": arch.name,
                      "peak_phase": estimate["peak_phase"], "coefficients": estimate["coefficients"]}
    record.finish("complete")
    if store:
        from mleng.results.store import save_or_reason

        out["id"], out["store_error"] = save_or_reason(record)
    return out


def compare_step_record(record: dict[str, Any], coeff_data=None) -> dict[str, Any]:
    """A stored `mleng step` record's allocator peak beside the estimate of its own config (its params)."""
    from mleng.plan.arch import from_step
    from mleng.plan.memory import TrainSetup, estimate_training
    from mleng.step.config import ModelConfig

    params = record.get("params") or {}
    mem = ((record.get("summary") or {}).get("memory") or {})
    peak = mem.get("peak_allocated_bytes")
    if record.get("kind") != "step" or not peak:
        raise UsageError(f"record {record.get('id')} is not a `mleng step` run with an allocator peak",
                         hint="GPU runs of mleng step record peak_allocated_bytes; CPU runs do not")
    m = dict(params["model"])
    m.pop("notes", None)
    cfg = ModelConfig(**{k: v for k, v in m.items() if k in ModelConfig.__dataclass_fields__})
    world = int(params.get("world_size") or 1)
    parallel = params.get("parallel") or "none"
    setup = TrainSetup(seq=int(params["seq"]), micro_batch=int(params["micro_batch"]),
                       dtype=params.get("dtype") or "bfloat16", gpus=world, fsdp=parallel == "fsdp",
                       recompute="full" if params.get("activation_checkpointing") else "none")
    est = estimate_training(from_step(cfg), setup, coeff_data)
    value = est["allocated_peak_bytes"]
    return {"id": record.get("id"), "measured_peak_bytes": int(peak), "estimated_peak_bytes": value,
            "error_pct": round(100.0 * (value - peak) / peak, 2), "compile": params.get("compile"),
            "parallel": parallel, "world_size": world}
