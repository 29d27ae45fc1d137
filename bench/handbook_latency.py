"""`mleng ask` latency: whole process (start-up, index open, ranking, output), median of N runs with a warm
index cache, and the time to rebuild the index from the entries. Prints a table; writes JSON."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUERIES = (
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "NCCL WARN NET/IB : Got completion from peer 10.0.0.2<52134> with error 12, opcode 0, len 0, vendor err 129",
    "training hangs at step 3000",
)


def _run(argv: list[str], env: dict) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, capture_output=True, check=False)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "handbook_ask_latency.json"))
    args = parser.parse_args()
    mleng = shutil.which("mleng") or str(Path(sys.executable).with_name("mleng"))
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, MLENG_HOME=tmp)
        rebuilds = []
        for _ in range(3):
            Path(tmp, "handbook-index.sqlite").unlink(missing_ok=True)
            rebuilds.append(_run([mleng, "ask", "x"], env))
        per_query = {}
        for query in QUERIES:
            times = sorted(_run([mleng, "ask", query], env) for _ in range(args.runs))
            per_query[query] = {"median_s": round(times[len(times) // 2], 4), "min_s": round(times[0], 4),
                                "max_s": round(times[-1], 4)}
    entries = len(list((ROOT / "src" / "mleng" / "handbook" / "entries").glob("*.md")))
    medians = sorted(v["median_s"] for v in per_query.values())
    result = {"command": " ".join(["python", "bench/handbook_latency.py", *sys.argv[1:]]), "entries": entries,
              "runs": args.runs, "load_avg_1m": round(os.getloadavg()[0], 2), "per_query": per_query,
              "ask_median_s": medians[len(medians) // 2],
              "rebuild_s": round(sorted(rebuilds)[1] - medians[0], 3),
              "rebuild_whole_process_s": round(sorted(rebuilds)[1], 3)}
    print(f"mleng ask, whole process, {entries} entries, median of {args.runs} runs (load {result['load_avg_1m']})")
    for query, row in per_query.items():
        print(f"  {row['median_s'] * 1000:6.0f} ms  (min {row['min_s'] * 1000:.0f}, max {row['max_s'] * 1000:.0f})  {query[:60]}")
    print(f"index rebuild: {result['rebuild_s']:.2f} s (whole process {result['rebuild_whole_process_s']:.2f} s)")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
