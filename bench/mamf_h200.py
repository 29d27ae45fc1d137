"""Benchmark: mleng mamf's default adaptive search against its exhaustive 1024-step grid, on one GPU.

Runs each as its own `mleng mamf` process (so each budget counts from a fresh process start,
CUDA initialization included), prints both results side by side and writes the full records
as JSON. Made for the lent H200; runs on any CUDA GPU. The comparison with a peer tool (the book's
mamf-finder, run in the same sitting) is bench/mamf_vs_peer.py.

    PYTHONPATH=src python3 bench/mamf_h200.py --out $OUT
    PYTHONPATH=src python3 bench/mamf_h200.py --out $OUT --adaptive-runs 3 --grid-seconds 300 --extra
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

def run_mamf(label: str, argv: list[str], out_dir: Path, timeout_s: float) -> dict:
    command = [sys.executable, "-m", "mleng", "mamf", "--json", "--no-store", *argv]
    print(f"[{label}] {' '.join(command[1:])}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code, stdout, stderr = 124, exc.stdout or "", (exc.stderr or "") + "\n(timed out)"
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
    wall_s = time.monotonic() - t0
    with open(out_dir / "mamf_h200_log.txt", "a") as log:
        log.write(f"===== {label}: exit {code}, {wall_s:.1f} s: {' '.join(command[1:])}\n{stderr}\n")
    try:
        record = json.loads(stdout)
    except json.JSONDecodeError:
        record = None
    return {"label": label, "argv": argv, "exit_code": code, "wall_s_outside": round(wall_s, 2),
            "record": record, "stderr_tail": stderr.strip().splitlines()[-3:]}


def headline(run: dict) -> dict:
    record = run["record"] or {}
    s = record.get("summary") or {}
    gpu = s.get("gpu_monitor_measuring") or {}
    return {
        "label": run["label"], "exit": run["exit_code"], "status": record.get("status"),
        "best_shape": s.get("best_shape"), "tflops_median": s.get("tflops_median", s.get("value")),
        "tflops_mean": s.get("tflops_mean"), "tflops_max": s.get("tflops_max"), "iters": s.get("iters"),
        "burst_shape": (s.get("burst") or {}).get("best_shape"),
        "burst_tflops_median": (s.get("burst") or {}).get("tflops_median"),
        "shapes_tried": s.get("shapes_tried"), "stop_reason": s.get("stop_reason"),
        "wall_s": s.get("wall_s_from_process_start"), "wall_s_outside": run["wall_s_outside"],
        "sm_clock_mhz_mean": (gpu.get("sm_clock_mhz") or {}).get("mean"),
        "sm_clock_max_mhz": gpu.get("sm_clock_max_mhz"),
        "power_w_mean": (gpu.get("power_w") or {}).get("mean"),
        "theoretical": s.get("theoretical"), "ratio": s.get("ratio"),
        "error": None if run["exit_code"] in (0, 130) else " | ".join(run["stderr_tail"]),
    }


def print_table(rows: list[dict]) -> None:
    columns = ["label", "exit", "best_shape", "tflops_median", "tflops_mean", "tflops_max", "iters",
               "burst_shape", "burst_tflops_median", "shapes_tried", "wall_s", "stop_reason",
               "sm_clock_mhz_mean", "power_w_mean"]
    cells = [[("-" if r.get(c) is None else f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r[c]))
              for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    for r in rows:
        if r.get("error"):
            print(f"{r['label']}: {r['error']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--adaptive-seconds", type=float, default=60.0)
    parser.add_argument("--adaptive-runs", type=int, default=1)
    parser.add_argument("--grid", default="1024:16384:1024")
    parser.add_argument("--grid-seconds", type=float, default=300.0)
    parser.add_argument("--skip-grid", action="store_true")
    parser.add_argument("--extra", action="store_true",
                        help="also short runs of fp16, fp32 (TF32 off/on), fp8, an exact shape, and refusals")
    parser.add_argument("--all-devices-run", action="store_true",
                        help="also a 30 s `mleng mamf --all-devices` (one process per GPU)")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    runs = []
    for i in range(args.adaptive_runs):
        runs.append(run_mamf(f"adaptive{i + 1}", ["--max-seconds", str(args.adaptive_seconds)], out_dir,
                             args.adaptive_seconds + 120))
    if not args.skip_grid:
        runs.append(run_mamf("grid", ["--grid", args.grid, "--max-seconds", str(args.grid_seconds)], out_dir,
                             args.grid_seconds + 120))
    extras = []
    if args.extra:
        for label, argv in [
            ("fp16", ["--dtype", "float16", "--max-seconds", "20"]),
            ("fp32", ["--dtype", "float32", "--max-seconds", "20"]),
            ("tf32", ["--dtype", "float32", "--tf32", "on", "--max-seconds", "20"]),
            ("fp8", ["--dtype", "float8_e4m3fn", "--max-seconds", "25"]),
            ("exact", ["--m", "8192", "--n", "8192", "--k", "8192", "4096"]),
            ("fnuz-refused", ["--dtype", "float8_e4m3fnuz"]),
            ("too-large", ["--m", "400000", "--n", "400000", "--k", "400000"]),
        ]:
            extras.append(run_mamf(label, argv, out_dir, 150))

    if args.all_devices_run:
        extras.append(run_mamf("all-devices", ["--all-devices", "--max-seconds", "30"], out_dir, 150))
    rows = [headline(r) for r in runs + extras]
    print()
    print_table(rows)
    for run in runs:
        if run["record"] is not None:
            (out_dir / f"mamf_h200_{run['label']}.json").write_text(json.dumps(run["record"], indent=1))
    extra_records = {r["label"]: r["record"] for r in extras if r["record"] is not None}
    if extra_records:
        (out_dir / "mamf_h200_extra.json").write_text(json.dumps(extra_records, indent=1))
    summary = {"runs": rows}
    (out_dir / "mamf_h200_summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
