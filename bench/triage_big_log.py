"""`mleng triage` on a generated multi-rank training log of any size (default 1 GiB): wall time and peak RSS."""

from __future__ import annotations

import argparse
import json
import os
import random
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


def _timed(command: list[str], env: dict | None = None) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one run of the command, its own worker processes included."""
    # Output goes to a real file: GNU grep stops at the first match when its output is /dev/null.
    with tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.DEVNULL)
        _pid, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)   # reaped here: Popen must not wait for it again
    return elapsed, usage.ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--log", help="reuse this log instead of generating one")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each command; the median is reported")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "triage_big_log.json"))
    args = parser.parse_args()
    from mleng.handbook.index import open_index
    from mleng.handbook.triage import Matcher

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(args.log) if args.log else Path(tmp) / "big.log"
        gen = {}
        if not args.log:
            started = time.perf_counter()
            gen = generate(log, args.size_mib << 20)
            gen["generate_s"] = round(time.perf_counter() - started, 1)
        env = dict(os.environ, MLENG_HOME=str(Path(tmp) / "home"), LC_ALL="C")
        # Warm the index cache and the page cache first so every timing is the scan.
        subprocess.run([sys.executable, "-m", "mleng", "ask", "x"], env=env, capture_output=True)
        subprocess.run(["cat", str(log)], stdout=subprocess.DEVNULL)
        index = open_index(None, Path(tmp) / "home" / "handbook-index.sqlite")
        entries = [e.data for e in index.entries]
        matcher = Matcher(entries, [e.anchors for e in index.entries])
        index.close()
        # The peer: grep -E with the signatures of the entries mleng finds in this log, and
        # grep -F with every anchor mleng scans for (the same work as mleng's first pass).
        probe = subprocess.run([sys.executable, "-m", "mleng", "triage", str(log), "--json"], env=env,
                               capture_output=True, text=True)
        if probe.returncode not in (0, 1):
            print(probe.stderr, file=sys.stderr)
            return 2
        report = json.loads(probe.stdout)
        found_ids = {f["entries"][0]["id"] for f in report["findings"]}
        signatures = [s for e in entries if e["id"] in found_ids for s in e["signatures"]]
        (Path(tmp) / "signatures.txt").write_text("\n".join(signatures) + "\n")
        (Path(tmp) / "anchors.txt").write_bytes(b"\n".join(matcher.anchor_words) + b"\n")
        commands = {
            "mleng triage": [sys.executable, "-m", "mleng", "triage", str(log), "--json"],
            f"grep -E ({len(signatures)} signatures)": ["grep", "-a", "-c", "-E", "-f", str(Path(tmp) / "signatures.txt"),
                                                         str(log)],
            f"grep -F -i ({len(matcher.anchor_words)} anchors)": ["grep", "-a", "-c", "-F", "-i", "-f",
                                                                   str(Path(tmp) / "anchors.txt"), str(log)],
        }
        size = log.stat().st_size
        rows = {}
        for name, command in commands.items():
            runs = [_timed(command, env) for _ in range(args.repeat)]
            times = sorted(wall for wall, _rss in runs)
            rows[name] = {"wall_s": round(times[len(times) // 2], 3), "min_s": round(times[0], 3),
                          "max_s": round(times[-1], 3), "mb_s": round(size / 1e6 / times[len(times) // 2], 1),
                          "peak_rss_mib": round(max(rss for _wall, rss in runs), 1)}
    grep_e = next(v for k, v in rows.items() if k.startswith("grep -E"))
    result = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
              "engine": matcher.scan.name if matcher.scan else None, "bytes": size, "lines": report["lines"],
              "rows": rows, "ratio_to_grep_e": round(rows["mleng triage"]["wall_s"] / grep_e["wall_s"], 2),
              "peak_rss_mib": rows["mleng triage"]["peak_rss_mib"], "findings": len(report["findings"]),
              "finding_counts": [f["count"] for f in report["findings"]], **gen}
    print(f"log: {size / 2**20:.0f} MiB, {report['lines']:,} lines; scan engine {result['engine']}; "
          f"median of {args.repeat} runs, whole process, page cache warm")
    print(f"{'command':<34} {'wall s':>8} {'min':>7} {'max':>7} {'MB/s':>8}")
    for name, row in rows.items():
        print(f"{name:<34} {row['wall_s']:>8.3f} {row['min_s']:>7.3f} {row['max_s']:>7.3f} {row['mb_s']:>8.1f}")
    print(f"mleng triage / grep -E: {result['ratio_to_grep_e']:.2f}x; peak RSS of mleng triage "
          f"{result['peak_rss_mib']:.1f} MiB (workers included)")
    if gen:
        print(f"planted failure lines: {gen['planted']}, found: {sum(result['finding_counts'])}")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
