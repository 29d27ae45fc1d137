"""Rank 0 of `mleng step` assembles the `step` record from every rank's RankState: tokens/s, MFU, MAMFU, HFU,
memory, where the time goes."""

from __future__ import annotations

import dataclasses
from typing import Any

from mleng.step.config import param_count
from mleng.step.options import StepOptions


@dataclasses.dataclass
class RankState:
    """What this rank measured; rank 0 builds the record from its own and the gathered ones."""

    steps: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # {step, phase, time_s, loss}
    memory: dict[str, Any] = dataclasses.field(default_factory=dict)
    breakdown: dict[str, Any] | None = None
    breakdown_error: str | None = None
    identity: dict[str, Any] = dataclasses.field(default_factory=dict)
    mamf_records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    gpu_monitor: dict[str, Any] | None = None
    phase: str = "start"
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def portable(self) -> dict[str, Any]:
        return {"steps": self.steps, "memory": self.memory, "breakdown": self.breakdown,
                "breakdown_error": self.breakdown_error, "identity": self.identity,
                "mamf_records": self.mamf_records}


# ------------------------------------------------------------------------------------------ the record
def _summarize(record, opts: StepOptions, state: RankState, job, launch, device, status: str,
               error: str | None) -> None:
    from mleng.measure.timing import TimingStats, process_elapsed_s
    from mleng.step import breakdown as bd
    from mleng.step.efficiency import dense_peak, find_stored_mamf, ratio
    from mleng.step.flops import DEFAULT_CONVENTION, both_conventions, conventions_differ

    world = launch.world_size  # record.machine: the session's fingerprint of rank 0
    if job is not None:
        record.machine["ranks"] = job.public_ranks()
    ranks = state.info.get("ranks") or [state.portable()]
    timed = _slowest_per_step(ranks, "timed")
    warm = _slowest_per_step(ranks, "warmup")
    cfg = opts.cfg
    tokens_per_step = opts.global_batch(world) * opts.seq
    hosts = sorted({r["host"] for r in record.machine.get("ranks", [])}) or [state.identity.get("host")]
    devices = world if device.type == "cuda" else len(hosts)
    flops = both_conventions(cfg, opts.seq, recompute=opts.checkpointing)
    main = flops[DEFAULT_CONVENTION]
    summary: dict[str, Any] = {
        "value": None, "unit": "tokens/s per " + ("GPU" if device.type == "cuda" else "CPU host"),
        "theoretical": None, "ratio": None,
        "model": cfg.name, "parameters": param_count(cfg).to_dict(), "seq": opts.seq,
        "global_batch": opts.global_batch(world), "tokens_per_step": tokens_per_step,
        "world_size": world, "devices": devices, "device_kind": device.type,
        "device_name": state.identity.get("name"), "dtype": opts.dtype, "parallel": opts.parallel,
        "compile": opts.compile, "activation_checkpointing": opts.checkpointing,
        "steps_timed": len(timed), "steps_warmup": len(warm),
        "flop_convention": DEFAULT_CONVENTION,
        "flops_per_token": {name: f.to_dict() for name, f in flops.items()},
        "conventions_differ": conventions_differ(flops),
        "data": state.info.get("data"),
        "wall_s_from_process_start": round(process_elapsed_s(), 2),
    }
    rows: list[dict[str, Any]] = []
    if timed:
        stats = TimingStats.from_samples([s["time_s"] for s in timed])
        tokens_per_s = tokens_per_step / stats.median_s
        per_device = tokens_per_s / devices
        achieved = {name: f.model * per_device / 1e12 for name, f in flops.items()}
        hardware = {name: f.hardware * per_device / 1e12 for name, f in flops.items()}
        peak, peak_note = dense_peak(device, state.identity, opts.dtype)
        mamf, mamf_note = _mamf_ceiling(ranks, opts.dtype, state)
        summary.update({
            "value": round(per_device, 2), "ratio": ratio(achieved[DEFAULT_CONVENTION], peak),
            "theoretical": round(peak * 1e12 / main.model, 2) if peak else None,
            "step_time_s": stats.to_dict(), "tokens_per_s": round(tokens_per_s, 2),
            "tokens_per_s_per_device": round(per_device, 2),
            "tokens_per_s_per_rank": round(tokens_per_s / world, 2),
            "tflops_per_device": {k: _sig(v) for k, v in achieved.items()},
            "peak_tflops": peak, "theoretical_source": peak_note,
            "mfu": ratio(achieved[DEFAULT_CONVENTION], peak), "mfu_book": ratio(achieved["book"], peak),
            "mfu_inconclusive": None if peak else f"no sourced dense peak: {peak_note}",
            "mamf": mamf, "mamf_note": mamf_note,
            "mamfu": ratio(achieved[DEFAULT_CONVENTION], mamf["tflops"] if mamf else None),
            "mamfu_book": ratio(achieved["book"], mamf["tflops"] if mamf else None),
            "hfu": ratio(hardware[DEFAULT_CONVENTION], peak) if opts.checkpointing else None,
            "hfu_book": ratio(hardware["book"], peak) if opts.checkpointing else None,
        })
        if summary["mamfu"] is not None and summary["mamfu"] > 1.0:
            # Not a ceiling then: the MAMF search was cut short or disturbed. Said, not hidden or clipped.
            summary["mamf_note"] = ((summary["mamf_note"] + "; ") if summary["mamf_note"] else "") + (
                f"MAMFU above 100%: this step's matmuls ran faster than that MAMF run found (stop: "
                f"{mamf.get('stop_reason')}), so it is no ceiling; measure again with `mleng mamf --max-seconds 120`")
        rows.append({"phase": "timed", "tokens_per_s_per_device": summary["tokens_per_s_per_device"],
                     "mfu": summary["mfu"], "mamfu": summary["mamfu"],
                     "tflops_per_device": summary["tflops_per_device"][DEFAULT_CONVENTION],
                     "tokens_per_s": summary["tokens_per_s"], "step_time_s_median": stats.median_s,
                     "step_time_s_p90": stats.p90_s, "step_time_s_min": stats.min_s,
                     "step_time_s_max": stats.max_s, "steps": stats.iters, "hfu": summary["hfu"],
                     "peak_allocated_bytes": state.memory.get("peak_allocated_bytes")})
    losses = [s["loss"] for s in state.steps]
    summary["loss"] = {"first": losses[0] if losses else None, "last": losses[-1] if losses else None}
    summary["steps"] = state.steps
    summary["memory"] = state.memory
    if len(ranks) > 1:
        summary["memory_by_rank"] = [r.get("memory") for r in ranks]
    summary["breakdown"] = state.breakdown
    if state.breakdown:
        rows.extend(bd.rows(state.breakdown))
        if len(ranks) > 1:
            summary["breakdown_by_rank"] = [r.get("breakdown") for r in ranks]
    elif state.breakdown_error:
        summary["breakdown_error"] = state.breakdown_error
    summary["gpu_monitor"] = state.gpu_monitor
    if state.info.get("trace"):
        summary["trace"] = state.info["trace"]
    if state.mamf_records or any(r.get("mamf_records") for r in ranks[1:]):
        summary["mamf_measured"] = [m["id"] for r in ranks for m in (r.get("mamf_records") or [])]
    record.rows = rows
    record.summary = summary
    if status == "complete" and not timed:
        status, error = "failed", error or "no step was timed"
    record.finish(status, error)


def _sig(value: float, digits: int = 6) -> float:
    """Six significant digits: a CPU's 0.0019 TFLOPS keeps its precision, an H200's 612.345 too."""
    return float(f"{value:.{digits}g}")


def _slowest_per_step(ranks: list[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    """A step of the job lasts as long as its slowest rank; steps that some rank did not finish are dropped."""
    per_rank = [[s for s in r.get("steps") or [] if s["phase"] == phase] for r in ranks]
    count = min((len(p) for p in per_rank), default=0)
    return [max((p[i] for p in per_rank), key=lambda s: s["time_s"]) for i in range(count)]


def _mamf_ceiling(ranks: list[dict[str, Any]], dtype: str, state: RankState):
    """The slowest of the ranks' MAMFs: a run measured just now (--mamf) first, else the stored match."""
    from mleng.step.efficiency import find_stored_mamf

    found, notes = [], []
    seen: set[str] = set()
    for r in ranks:
        identity = r.get("identity") or state.identity
        key = identity.get("uuid") or f"{identity.get('host')}/{identity.get('name')}"
        if key in seen:
            continue  # ranks sharing one device (CPU ranks of a host) share its ceiling
        seen.add(key)
        fresh = [m for m in r.get("mamf_records") or [] if m["status"] == "complete" and m["summary"].get("value")]
        if fresh:
            m = fresh[0]
            found.append({"id": m["id"], "tflops": float(m["summary"]["value"]), "match": "measured now (--mamf)",
                          "started_at": m["started_at"], "best_shape": m["summary"].get("best_shape"),
                          "stop_reason": m["summary"].get("stop_reason")})
            continue
        match, note = find_stored_mamf(identity, dtype)
        if match is None:
            notes.append(note)
        else:
            found.append(match)
    if notes:
        return None, "; ".join(dict.fromkeys(notes)) + " (`mleng step --mamf` measures one first)"
    if not found:
        return None, "no MAMF"
    slowest = min(found, key=lambda m: m["tflops"])
    return slowest, (f"the slowest of {len(found)} devices" if len(found) > 1 else None)
