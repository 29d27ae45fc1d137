"""Burn-in: sustained bf16 matmuls on every GPU with the results checked, to catch silent data corruption, and
TFLOPS, clocks and temperature over time, to catch a card that slows down when hot.

Checks, each with its evidence:
  * repeats: every iteration's output is compared bitwise with the device's first output (the same inputs,
    the same kernel: cuBLAS is deterministic for one shape on one GPU model, CUBLAS_WORKSPACE_CONFIG set);
  * peers: the first and last outputs are hashed and compared across the devices of the same model;
  * reference: a sampled 64x64 tile of the output against a float64 product of the same bf16 inputs on the host.
`run_burn` does the work (torch imported inside); `burn_findings` turns its result into findings; `main` is the
subprocess entry the doctor runs (python -m mleng.doctor.burn), so a GPU that hangs cannot hang the doctor.
A fault hook (a function, or MLENG_BURN_FAULT=DEVICE:ITERATION for the subprocess) corrupts one output, so the
tests can show that a wrong result fails the burn-in and names the device.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import sys
import time
from typing import Any, Callable

from mleng.doctor.findings import Finding, fail, inconclusive, ok, warn

TILE = 64
# max |tile - float64 reference| / sqrt(K): bf16 output rounding of values up to ~4 sqrt(K) is 4 * 2^-9 ~ 0.008
TILE_TOLERANCE = 0.03
# TFLOPS of the last third of the rounds against the first third (warm-up round excluded)
DRIFT_WARN = 0.05
ROUND_TARGET_S = 1.0
MIN_ROUND_S = 0.25
MIN_DRIFT_ROUNDS = 9  # three rounds in each third at least: fewer is noise, not drift
FAULT_ENV = "MLENG_BURN_FAULT"

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|sec|m|min|h)?$", re.I)


def parse_duration(text: str) -> float:
    """'90s', '10m', '1h', '45' (seconds) -> seconds; ValueError otherwise."""
    match = _DURATION.match(str(text).strip())
    if not match:
        raise ValueError(f"{text!r} is not a duration (90s, 10m, 1h)")
    seconds = float(match.group(1)) * {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, None: 1}[
        (match.group(2) or "").lower() or None]
    if seconds <= 0:
        raise ValueError(f"{text!r}: a burn-in needs a positive duration")
    return seconds


def _label(device: str, position: int, devices: list[str]) -> str:
    return device if devices.count(device) == 1 else f"{device}#{position}"


def _digest(tensor) -> str:
    import torch

    bits = tensor.detach().contiguous().cpu().view(-1).view(torch.int16)
    return hashlib.sha256(bits.numpy().tobytes()).hexdigest()[:16]


def run_burn(duration_s: float, devices: list[str] | None = None, size: int | None = None,
             fault: Callable[[str, int, Any], None] | None = None, seed: int = 20261203,
             on_round: Callable[[float], None] | None = None) -> dict[str, Any]:
    """Run the burn-in for about duration_s on each device (default: every CUDA device, else the CPU)."""
    import torch

    from mleng.measure.timing import Stopwatch

    if devices is None:
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    on_gpu = all(d.startswith("cuda") for d in devices)
    size = size or (8192 if on_gpu else 256)
    dtype = torch.bfloat16
    generator = torch.Generator().manual_seed(seed)
    # normal inputs, never constants: real data has no shortcut
    a_host = torch.randn(size, size, generator=generator).to(dtype)
    b_host = torch.randn(size, size, generator=generator).to(dtype)
    rows = torch.randint(0, size - TILE + 1, (1,), generator=generator).item()
    cols = torch.randint(0, size - TILE + 1, (1,), generator=generator).item()
    reference = (a_host[rows:rows + TILE].double() @ b_host[:, cols:cols + TILE].double())
    flops = 2.0 * size ** 3

    state = []
    for position, device in enumerate(devices):
        label = _label(device, position, devices)
        info: dict[str, Any] = {"device": label, "name": None, "uuid": None, "index": None}
        if device.startswith("cuda"):
            props = torch.cuda.get_device_properties(device)
            uuid = str(getattr(props, "uuid", "") or "")
            info.update(name=props.name, index=torch.device(device).index,
                        uuid=uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}")
        else:
            info["name"] = "cpu"
        a, b = a_host.to(device), b_host.to(device)
        out = torch.empty(size, size, dtype=dtype, device=device)
        torch.matmul(a, b, out=out)
        if fault:
            fault(label, 0, out)
        first = out.clone()
        state.append({**info, "a": a, "b": b, "out": out, "first": first, "iterations": 1, "rounds": [],
                      "bad": torch.zeros((), dtype=torch.int64, device=device), "bad_rounds": [],
                      "first_hash": _digest(first), "monitor": _monitor(info)})
    for s in state:
        s["tile_first"] = _tile_error(s["first"], reference, rows, cols, size)

    iterations = 2
    started = time.monotonic()
    while time.monotonic() - started < duration_s:
        round_start = time.perf_counter()
        timings = []
        for s in state:
            timer = Stopwatch(s["out"].device)
            if timer.cuda:
                torch.cuda.set_device(s["out"].device)  # events and kernels on this device's current stream
            timer.start()
            for _ in range(iterations):
                torch.matmul(s["a"], s["b"], out=s["out"])
                if fault:
                    fault(s["device"], s["iterations"], s["out"])
                s["bad"] += torch.ne(s["out"], s["first"]).any().to(torch.int64)
                s["iterations"] += 1
            timer.mark_end()
            timings.append(timer)
        for s, timer in zip(state, timings):
            seconds = timer.elapsed()
            bad = int(s["bad"].item())
            if bad and (not s["bad_rounds"] or s["bad_rounds"][-1]["mismatches"] != bad):
                s["bad_rounds"].append({"round": len(s["rounds"]), "mismatches": bad,
                                        "t_s": round(time.monotonic() - started, 2)})
            s["rounds"].append({"t_s": round(time.monotonic() - started, 2), "iterations": iterations,
                                "seconds": round(seconds, 4),
                                "tflops": float(f"{flops * iterations / seconds / 1e12:.5g}") if seconds > 0 else None})
        elapsed = time.perf_counter() - round_start
        # aim each round at about a second, so drift has many points and a check comes often, and never
        # far past the end of the burn
        per_iteration = max(elapsed / iterations, 1e-9)
        remaining = duration_s - (time.monotonic() - started)
        target = min(ROUND_TARGET_S, max(remaining, per_iteration))
        iterations = max(1, min(iterations * 4, int(target / per_iteration)))
        if on_round:
            on_round(time.monotonic() - started)
    total_s = time.monotonic() - started
    result_devices = []
    for s in state:
        monitor = s.pop("monitor")
        telemetry = _telemetry(monitor, total_s)
        last_hash = _digest(s["out"])
        result_devices.append({
            "device": s["device"], "name": s["name"], "uuid": s["uuid"], "index": s["index"],
            "iterations": s["iterations"], "rounds": s["rounds"],
            "repeat_mismatches": int(s["bad"].item()), "mismatch_rounds": s["bad_rounds"],
            "first_hash": s["first_hash"], "last_hash": last_hash,
            "tile_error_first": s["tile_first"], "tile_error_last": _tile_error(s["out"], reference, rows, cols, size),
            "telemetry": telemetry,
        })
    return {"duration_s": round(total_s, 2), "size": size, "dtype": "bfloat16", "tile": [rows, cols, TILE],
            "tile_tolerance": TILE_TOLERANCE, "devices": result_devices, "torch": torch.__version__,
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


def _tile_error(out, reference, rows: int, cols: int, size: int) -> float:
    tile = out[rows:rows + TILE, cols:cols + TILE].double().cpu()
    return round(float((tile - reference).abs().max()) / size ** 0.5, 6)


def _monitor(info: dict[str, Any]):
    if info.get("index") is None:
        return None
    from mleng.measure.gpu_monitor import GpuMonitor

    monitor = GpuMonitor(uuid=info.get("uuid"), index=info.get("index"), interval_s=0.5)
    return monitor.start() if monitor.available else None


def _telemetry(monitor, total_s: float) -> dict[str, Any] | None:
    if monitor is None:
        return None
    monitor.stop()
    third = total_s / 3

    def window(since, until):
        summary = monitor.summary(since, until)
        return {"sm_clock_mhz_mean": (summary.get("sm_clock_mhz") or {}).get("mean"),
                "sm_clock_mhz_min": (summary.get("sm_clock_mhz") or {}).get("min"),
                "temperature_c_max": (summary.get("temperature_c") or {}).get("max"),
                "power_w_mean": (summary.get("power_w") or {}).get("mean"),
                "limiting_reasons": summary.get("limiting_reasons")}

    return {"whole": window(None, None), "first_third": window(0, third), "last_third": window(2 * third, None),
            "sm_clock_max_mhz": monitor.sm_clock_max_mhz}


def _subject(d: dict[str, Any]) -> str:
    return f"gpu {d['index']} ({d['name']})" if d.get("index") is not None else d["device"]


def tflops_drift(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    # round 0 warms up; the first, short rounds calibrate how many iterations fill a second
    timed = [r for r in rounds[1:] if r.get("tflops")]
    long_enough = [r for r in timed if r.get("seconds", ROUND_TARGET_S) >= MIN_ROUND_S]
    values = [r["tflops"] for r in (long_enough if len(long_enough) >= MIN_DRIFT_ROUNDS else timed)]
    if len(values) < MIN_DRIFT_ROUNDS:
        return {"first": None, "last": None, "drift": None, "median": statistics.median(values) if values else None,
                "rounds": len(values)}
    third = max(1, len(values) // 3)
    first, last = statistics.median(values[:third]), statistics.median(values[-third:])
    return {"first": float(f"{first:.5g}"), "last": float(f"{last:.5g}"), "drift": round(last / first - 1, 4),
            "median": float(f"{statistics.median(values):.5g}"), "min": min(values), "max": max(values),
            "rounds": len(values)}


def burn_findings(result: dict[str, Any]) -> list[Finding]:
    devices = result.get("devices") or []
    if not devices:
        return [inconclusive("burn_correctness", "the burn-in ran on no device")]
    findings: list[Finding] = []
    groups: dict[str, list[dict[str, Any]]] = {}
    for d in devices:
        groups.setdefault(d.get("name") or "?", []).append(d)
    odd: dict[str, str] = {}
    for name, members in groups.items():
        for key in ("first_hash", "last_hash"):
            hashes = [m[key] for m in members]
            majority = max(set(hashes), key=hashes.count)
            if len(members) > 2 or (len(members) == 2 and len(set(hashes)) == 1):
                for m in members:
                    if m[key] != majority:
                        odd[m["device"]] = f"its output differs bitwise from the other {len(members) - 1} {name}(s)"
            elif len(members) == 2 and len(set(hashes)) == 2:
                for m in members:  # two that disagree: either may be wrong; the reference tile says which
                    odd.setdefault(m["device"], f"its output differs bitwise from the other {name}; see the "
                                                "reference tile")
    for d in devices:
        subject = _subject(d)
        problems = []
        if d["repeat_mismatches"]:
            first_bad = d["mismatch_rounds"][0] if d["mismatch_rounds"] else {}
            problems.append(f"{d['repeat_mismatches']} of {d['iterations']} iterations differed bitwise from its "
                            f"first result (first at {first_bad.get('t_s', '?')} s)")
        worst_tile = max(d["tile_error_first"], d["tile_error_last"])
        if worst_tile > TILE_TOLERANCE:
            problems.append(f"a sampled {TILE}x{TILE} tile is off the float64 reference by {worst_tile:.3g} "
                            f"(x sqrt(K); allowed {TILE_TOLERANCE})")
        if d["device"] in odd:
            problems.append(odd[d["device"]])
        peers = len(groups.get(d.get("name") or "?", []))
        evidence = {k: d[k] for k in ("iterations", "repeat_mismatches", "mismatch_rounds", "first_hash", "last_hash",
                                      "tile_error_first", "tile_error_last")}
        if problems:
            findings.append(fail("burn_correctness", f"{subject}: WRONG RESULTS: " + "; ".join(problems),
                                 subject=subject, measured=evidence, gpu_uuid=d.get("uuid"),
                                 cause="silent data corruption: the device computes wrong numbers without an error; "
                                       "drain it and run dcgmi diag -r 3 (or 4), then RMA",
                                 handbook=["dcgm-diag-failures", "cuda-silent-corruption-compute-sanitizer"]))
        else:
            findings.append(ok("burn_correctness", f"{subject}: {d['iterations']} bf16 {result['size']}^3 matmuls "
                               f"bitwise identical to its first; tile within {worst_tile:.3g} of float64"
                               + (f"; same bits as its {peers - 1} peer(s)" if peers > 1 else
                                  "; no peer of its model to compare with"),
                               subject=subject, measured=evidence, gpu_uuid=d.get("uuid")))
        drift = tflops_drift(d["rounds"])
        telemetry = d.get("telemetry") or {}
        first_t, last_t = telemetry.get("first_third") or {}, telemetry.get("last_third") or {}
        clocks = ""
        if first_t.get("sm_clock_mhz_mean") and last_t.get("sm_clock_mhz_mean"):
            clocks = (f"; SM clock {first_t['sm_clock_mhz_mean']:.0f} -> {last_t['sm_clock_mhz_mean']:.0f} MHz, "
                      f"up to {(telemetry.get('whole') or {}).get('temperature_c_max')} C"
                      + (f" ({', '.join(last_t['limiting_reasons'])})" if last_t.get("limiting_reasons") else ""))
        measured = {"tflops": drift, "telemetry": telemetry, "duration_s": result.get("duration_s")}
        if drift["drift"] is None:
            median = f" (median {drift['median']:.4g} TFLOPS)" if drift.get("median") else ""
            findings.append(inconclusive("burn_tflops", f"{subject}: {drift['rounds']} timed round(s){median}, "
                                         f"fewer than the {MIN_DRIFT_ROUNDS} a drift needs; burn longer",
                                         subject=subject, measured=measured, gpu_uuid=d.get("uuid")))
            continue
        text = (f"{subject}: {drift['first']:.4g} -> {drift['last']:.4g} TFLOPS over {result['duration_s']:.0f} s "
                f"({drift['drift'] * 100:+.1f}%, {drift['rounds']} rounds, min {drift['min']:.4g}){clocks}")
        if d.get("index") is None:
            # a CPU shares its cores with everything else running here: its rate says nothing about heat
            findings.append(inconclusive("burn_tflops", text + "; drift not judged on a CPU", subject=subject,
                                         measured=measured))
        elif drift["drift"] < -DRIFT_WARN:
            findings.append(warn("burn_tflops", text + ": slows down as it heats", subject=subject, measured=measured,
                                 gpu_uuid=d.get("uuid"), handbook=["gpu-clock-throttling"]))
        else:
            findings.append(ok("burn_tflops", text, subject=subject, measured=measured, gpu_uuid=d.get("uuid")))
    return findings


def fault_from_env(spec: str | None) -> Callable[[str, int, Any], None] | None:
    """MLENG_BURN_FAULT='DEVICE:ITERATION' (e.g. 'cuda:1:40', 'cpu:3'): add 1 to one output element there."""
    if not spec:
        return None
    device, _, iteration = spec.rpartition(":")
    target = int(iteration)

    def corrupt(label: str, at: int, out) -> None:
        if label == device and at == target:
            out.view(-1)[out.numel() // 2] += 1

    return corrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mleng.doctor.burn")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--size", type=int)
    parser.add_argument("--devices", help="comma-separated torch devices (default: every GPU, else the CPU)")
    args = parser.parse_args(argv)
    # deterministic cuBLAS (set before CUDA starts): the same inputs give the same bits, so a change is a fault
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    result = run_burn(args.seconds, devices=args.devices.split(",") if args.devices else None, size=args.size,
                      fault=fault_from_env(os.environ.get(FAULT_ENV)),
                      on_round=lambda t: print(f"burn {t:.0f}/{args.seconds:.0f} s", file=sys.stderr, flush=True))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
