"""Benchmark: mleng mamf beside the book's mamf-finder, on the same GPU, one after another, in one sitting.

Runs, each as its own process: the peer's quick range (`--m_range 0 20480 256 --n 4096 --k 4096`, the
book's "quick run"), the peer's headline shape re-measured alone twice, the peer on mleng's best shape,
mleng's default search, and mleng with `--max-seconds 15` (with its seed list, and with --no-seeds).
The peer script is not part of mleng: fetch it from the book's public repository into an ignored
folder and pass its path; it is never committed.

    python3 bench/mamf_vs_peer.py --peer .peer/mamf-finder.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mamf_h200 import headline, run_mamf  # noqa: E402

PEER_QUICK = ["--m_range", "0", "20480", "256", "--n", "4096", "--k", "4096"]
# The peer's final report: "median: 798.6 TFLOPS @ 11776x4096x4096 (MxNxK)".
PEER_MEDIAN = re.compile(r"^median:\s+([0-9.]+) TFLOPS @ (\d+)x(\d+)x(\d+)", re.M)
PEER_TRIED = re.compile(r"^Tried (\d+) shapes", re.M)


def run_peer(label: str, peer: Path, argv: list[str], out_dir: Path, timeout_s: float) -> dict:
    output = out_dir / f"peer_{label}.txt"
    command = [sys.executable, str(peer), *argv, "--output_file", str(output), "--no-verbose"]
    print(f"[{label}] {' '.join(command[1:])}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        code, text = 124, ""
    wall_s = time.monotonic() - t0
    report = output.read_text() if output.exists() else text
    median = PEER_MEDIAN.search(report)
    tried = PEER_TRIED.search(report)
    return {"label": label, "tool": "mamf-finder", "argv": argv, "exit": code, "wall_s": round(wall_s, 1),
            "tflops_median": float(median.group(1)) if median else None,
            "best_shape": "x".join(median.group(2, 3, 4)) if median else None,
            "shapes_tried": int(tried.group(1)) if tried else None,
            "error": None if median else report.strip().splitlines()[-3:]}


def shape_argv(shape: str) -> list[str]:
    m, n, k = shape.split("x")
    return ["--m", m, "--n", n, "--k", k]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", required=True, help="path of the book's mamf-finder.py (fetched, never committed)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--short-seconds", type=float, default=15.0)
    args = parser.parse_args()
    peer = Path(args.peer)
    if not peer.is_file():
        parser.error(f"--peer {peer}: no such file")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # An empty results store: the short run gets the shipped seed list only, as on a fresh machine.
    os.environ["MLENG_HOME"] = tempfile.mkdtemp(prefix="mleng-home-")

    rows: list[dict] = []
    quick = run_peer("quick", peer, PEER_QUICK, out_dir, 600)
    rows.append(quick)
    if quick["best_shape"]:
        for i in (1, 2):
            rows.append(run_peer(f"headline_alone{i}", peer, shape_argv(quick["best_shape"]), out_dir, 300))
    default = run_mamf("mleng_default", [], out_dir, 300)
    short = run_mamf(f"mleng_{args.short_seconds:g}s", ["--max-seconds", str(args.short_seconds)], out_dir, 200)
    unseeded = run_mamf(f"mleng_{args.short_seconds:g}s_no_seeds",
                        ["--max-seconds", str(args.short_seconds), "--no-seeds"], out_dir, 200)
    mleng_rows = [headline(r) for r in (default, short, unseeded)]
    for row in mleng_rows:
        row["tool"] = "mleng"
    best = mleng_rows[0].get("best_shape")
    if best:
        rows.append(run_peer("on_mleng_best_shape", peer, shape_argv(best), out_dir, 300))
    rows.extend(mleng_rows)

    default_value = mleng_rows[0].get("tflops_median")
    print(f"\n{'run':<28} {'tool':<12} {'TFLOPS':>8} {'shape':<18} {'shapes':>7} {'wall s':>7} {'of default':>10}")
    for row in rows:
        value = row.get("tflops_median")
        share = f"{value / default_value * 100:.1f}%" if value and default_value else "-"
        wall = row.get("wall_s") if row.get("wall_s") is not None else row.get("wall_s_outside")
        print(f"{row['label']:<28} {row['tool']:<12} {value if value is not None else '-':>8} "
              f"{row.get('best_shape') or '-':<18} {row.get('shapes_tried') or '-':>7} {wall or '-':>7} {share:>10}")
    for run in (default, short, unseeded):
        if run["record"] is not None:
            (out_dir / f"mamf_vs_peer_{run['label']}.json").write_text(json.dumps(run["record"], indent=1))
    summary = {"command": "python3 bench/mamf_vs_peer.py --peer PATH", "peer": str(peer.name),
               "peer_quick_argv": PEER_QUICK, "rows": rows,
               "short_over_default": (round(mleng_rows[1]["tflops_median"] / default_value, 4)
                                      if default_value and mleng_rows[1].get("tflops_median") else None)}
    (out_dir / "mamf_vs_peer.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
