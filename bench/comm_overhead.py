"""Overhead of mleng comm's timing loop against a bare torch.distributed loop, same op, size and ranks, one run.

    python bench/comm_overhead.py [--nproc 2] [--sizes 16M,64M,256M] [--rounds 7] [--iters 10]
                                  [--out docs/results/comm_overhead.json]

Each round times the same all_reduce both ways, alternating which goes first, on gloo
(CPU, loopback); the table shows the median over rounds of each way's per-op time
(slowest rank) and their difference ("diff": of the medians; "paired": median of the per-round ratios). This machine is noisy: look at the medians and the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def bare_loop(tensor, iters: int, warmup: int) -> float:
    """What a user would write: back-to-back all_reduce calls around a host clock; slowest rank's time per op."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        dist.all_reduce(tensor)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def rank_main(args) -> None:
    import torch

    from mleng.distributed.group import join, leave
    from mleng.distributed.launch import detect
    from mleng.measure.collectives import OPS, Settings, measure_size
    from mleng.measure.sizes import parse_size

    launch = detect()
    job = join(launch, "gloo", "cpu", 120.0)
    results = []
    for text in args.sizes.split(","):
        size = parse_size(text)
        tensor = torch.randn(size // 4)
        settings = Settings(ops=["all_reduce"], sizes=[size], iters=args.iters, warmup=args.warmup, repeats=1)
        mleng_s, bare_s = [], []
        for round_ in range(args.rounds):
            order = ("mleng", "bare") if round_ % 2 == 0 else ("bare", "mleng")
            for way in order:
                if way == "mleng":
                    mleng_s.append(measure_size(job, OPS["all_reduce"], size, settings)["time_us"] / 1e6)
                else:
                    bare_s.append(bare_loop(tensor, args.iters, args.warmup))
        results.append({"size_bytes": size, "mleng_s": mleng_s, "bare_s": bare_s})
    if launch.rank == 0:
        print(json.dumps(results))
    leave(job)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", default="16M,64M,256M")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="docs/results/comm_overhead.json")
    args = parser.parse_args()
    if os.environ.get("RANK") is not None:
        rank_main(args)
        return 0

    from mleng.distributed.launch import free_port
    from mleng.measure.sizes import format_bytes

    port = free_port()
    procs = []
    for rank in range(args.nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env,
                                      stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL))
    started = time.time()
    out, _ = procs[0].communicate()
    for proc in procs[1:]:
        proc.wait()
    if any(p.returncode for p in procs):
        print("a rank failed; see above", file=sys.stderr)
        return 1
    results = json.loads(out.decode().strip().splitlines()[-1])
    rows = []
    for r in results:
        mleng_med, bare_med = statistics.median(r["mleng_s"]), statistics.median(r["bare_s"])
        rows.append({
            "size_bytes": r["size_bytes"], "mleng_median_ms": mleng_med * 1e3, "bare_median_ms": bare_med * 1e3,
            "mleng_min_ms": min(r["mleng_s"]) * 1e3, "mleng_max_ms": max(r["mleng_s"]) * 1e3,
            "bare_min_ms": min(r["bare_s"]) * 1e3, "bare_max_ms": max(r["bare_s"]) * 1e3,
            "difference_pct": (mleng_med - bare_med) / bare_med * 100,
            # rounds are paired (same minute of machine noise), so the median of per-round ratios is steadier
            "paired_difference_pct": (statistics.median(m / b for m, b in zip(r["mleng_s"], r["bare_s"])) - 1) * 100,
            "rounds": len(r["mleng_s"]),
        })
    print(f"all_reduce float32, gloo, {args.nproc} ranks on {platform.node()}, {args.iters} iters + "
          f"{args.warmup} warm-up per timing, {args.rounds} interleaved rounds; per-op time of the slowest rank")
    print(f"{'size':>8} {'mleng ms (min..max)':>26} {'bare ms (min..max)':>26} {'diff':>8} {'paired':>8}")
    for row in rows:
        print(f"{format_bytes(row['size_bytes']):>8} "
              f"{row['mleng_median_ms']:9.2f} ({row['mleng_min_ms']:6.2f}..{row['mleng_max_ms']:6.2f}) "
              f"{row['bare_median_ms']:9.2f} ({row['bare_min_ms']:6.2f}..{row['bare_max_ms']:6.2f}) "
              f"{row['difference_pct']:+7.1f}% {row['paired_difference_pct']:+7.1f}%")
    record = {"benchmark": "comm_overhead", "op": "all_reduce", "dtype": "float32", "backend": "gloo",
              "nproc": args.nproc, "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
              "host": platform.node(), "cpus": os.cpu_count(), "elapsed_s": round(time.time() - started, 1),
              "command": " ".join([os.path.basename(sys.executable), "bench/comm_overhead.py", *sys.argv[1:]]),
              "rows": rows, "raw": results}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
