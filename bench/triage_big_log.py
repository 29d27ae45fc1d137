"""`mleng triage` on a generated multi-rank training log of any size (default 1 GiB): wall time and peak RSS."""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Ordinary lines of a multi-node run, and a few real failure lines planted among them.
NORMAL = [
    "[rank{r}]:[I1202 13:{m:02d}:{s:02d}.{us:06d} {pid} train.py:412] step {step} | loss {loss:.4f} | lr 3.0e-04 | "
    "grad_norm {gn:.3f} | tokens/s {tps} | mfu 0.41",
    "{host}:{pid}:{tid} [{gpu}] NCCL INFO Channel {ch:02d}/0 : {r} -> {r2} via P2P/CUMEM/read",
    "[default{gpu}]:[W1202 13:{m:02d}:{s:02d}.{us:06d} {pid} ProcessGroupNCCL.cpp:1250] Warning: TORCH_NCCL_AVOID_RECORD_STREAMS=1 has no effect",
    "{r}: Epoch 3:  41%|####      | {step}/50000 [1:23:45<2:01:10,  4.12it/s, loss={loss:.3f}]",
    "[rank{r}]: INFO dataloader: prefetched shard {step} from /lustre/datasets/tokens/part-{tid}.bin in 12.{us} ms",
]
FAILURES = [
    "[rank{r}]:[E1202 14:00:00.000000 {pid} ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum={step}, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran "
    "for 600021 milliseconds before timing out.",
    "{host}:{pid}:{tid} [{gpu}] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer 10.0.0.{gpu}<52134> "
    "with error 12, opcode 0, len 0, vendor err 129 (Recv)",
    "{r}: RuntimeError: DataLoader worker (pid {pid}) is killed by signal: Killed.",
]


def generate(path: Path, size_bytes: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    planted = 0
    lines = 0
    with path.open("w") as f:
        batch = []
        while f.tell() < size_bytes:
            for _ in range(5000):
                fields = dict(r=rng.randrange(64), r2=rng.randrange(64), m=rng.randrange(60), s=rng.randrange(60),
                              us=rng.randrange(10 ** 6), pid=rng.randrange(1000, 99999), tid=rng.randrange(99999),
                              step=rng.randrange(10 ** 6), loss=rng.uniform(1, 4), gn=rng.uniform(0, 2),
                              tps=rng.randrange(10 ** 5, 10 ** 6), host=f"gpu-node-{rng.randrange(8):03d}",
                              gpu=rng.randrange(8), ch=rng.randrange(32))
                template = FAILURES[planted % 3] if rng.random() < 2e-5 else rng.choice(NORMAL)
                planted += template in FAILURES
                batch.append(template.format(**fields))
            f.write("\n".join(batch) + "\n")
            lines += len(batch)
            batch = []
    return {"lines": lines, "planted": planted}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--log", help="reuse this log instead of generating one")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "triage_big_log.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(args.log) if args.log else Path(tmp) / "big.log"
        gen = {}
        if not args.log:
            started = time.perf_counter()
            gen = generate(log, args.size_mib << 20)
            gen["generate_s"] = round(time.perf_counter() - started, 1)
        env = dict(os.environ, MLENG_HOME=str(Path(tmp) / "home"))
        # Warm the index cache first so the timing is the scan.
        subprocess.run([sys.executable, "-m", "mleng", "ask", "x"], env=env, capture_output=True)
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "mleng", "triage", str(log), "--json"], env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - started
        peak_rss_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        if proc.returncode not in (0, 1):
            print(proc.stderr, file=sys.stderr)
            return 2
        report = json.loads(proc.stdout)
        size = log.stat().st_size
    result = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
              "bytes": size, "lines": report["lines"], "wall_s": round(wall, 2),
              "scan_s": report["elapsed_s"], "throughput_mb_s": round(size / 1e6 / report["elapsed_s"], 1),
              "peak_rss_mib": round(peak_rss_mib, 1), "findings": len(report["findings"]),
              "finding_counts": [f["count"] for f in report["findings"]], **gen}
    print(f"{'log size':>12} {'lines':>12} {'wall s':>8} {'scan s':>8} {'MB/s':>8} {'peak RSS MiB':>13} {'findings':>9}")
    print(f"{size / 2**30:>10.2f} GiB {result['lines']:>12,} {result['wall_s']:>8.2f} {result['scan_s']:>8.2f} "
          f"{result['throughput_mb_s']:>8.1f} {result['peak_rss_mib']:>13.1f} {result['findings']:>9}")
    if gen:
        print(f"planted failure lines: {gen['planted']}, found: {sum(result['finding_counts'])}")
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
