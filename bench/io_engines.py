"""The native I/O engine against fio on the same files and sizes, in one run: is native within 15%?

    python bench/io_engines.py /tmp --size 1GiB --jobs 4 --repeats 3 --out io_engines.json

Both engines run each workload on the same shard files, alternating (native, fio, native, ...),
so drift of the disk over the run hits both alike; the median of the repeats is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from mleng.cli.render import table  # noqa: E402
from mleng.measure import fio_engine, storage  # noqa: E402
from mleng.measure.sizes import format_bytes, parse_size  # noqa: E402

TARGET = 0.15


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", default="/tmp")
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default="ckpt-save,ckpt-load,rand-read-1m,rand-read-4k")
    parser.add_argument("--out", default="io_engines.json")
    args = parser.parse_args()

    fio_engine.require_fio()
    target = storage.check_target(args.path)
    plan = storage.Plan(parse_size(args.size), args.jobs, args.duration, 1)
    storage.check_space(target, plan.size_bytes, 0)
    workloads = args.workloads.split(",")
    fstype = storage.filesystem_type(target)
    workspace = storage.Workspace(target)
    samples: dict[tuple[str, str], list[dict]] = {}
    try:
        direct_ok = storage.direct_io_supported(workspace)
        shards = [workspace.file(f"shard.{i}") for i in range(plan.jobs)]
        storage.native_seq_write(shards, plan.shard_bytes, plan.block_bytes)
        for repeat in range(args.repeats):
            for workload in workloads:
                # Alternate which engine goes first, so neither always gets the fresher disk.
                order = ("native", "fio") if repeat % 2 == 0 else ("fio", "native")
                for engine in order:
                    row = storage.run_workload(workload, engine, plan, workspace, shards, direct_ok, fstype)[0]
                    samples.setdefault((workload, engine), []).append(row)
                    print(f"repeat {repeat} {workload:13s} {engine:6s} {row['bandwidth_gbps']:.3f} GB/s "
                          f"{row['iops']:.0f} IOPS", flush=True)
    finally:
        workspace.cleanup()

    results = []
    for workload in workloads:
        native = [r["bandwidth_gbps"] for r in samples[(workload, "native")]]
        fio = [r["bandwidth_gbps"] for r in samples[(workload, "fio")]]
        ratio = statistics.median(native) / statistics.median(fio)
        example = samples[(workload, "native")][0]
        results.append({
            "workload": workload, "block_bytes": example.get("block_bytes"), "direct": example.get("direct"),
            "cold_method": example.get("cold_method"),
            "native_gbps": statistics.median(native), "fio_gbps": statistics.median(fio),
            "native_samples_gbps": native, "fio_samples_gbps": fio,
            "native_p99_us": statistics.median(r["latency_p99_us"] for r in samples[(workload, "native")]),
            "fio_p99_us": statistics.median(r["latency_p99_us"] for r in samples[(workload, "fio")]),
            "ratio_native_to_fio": ratio,
            "within_target": abs(ratio - 1) <= TARGET if workload.startswith("ckpt") else None,
        })
    print()
    print(f"{target} ({fstype}), {format_bytes(plan.size_bytes)} in {plan.jobs} shards, "
          f"direct I/O {'yes' if direct_ok else 'no'}, {args.repeats} repeats, {fio_engine.fio_version()}")
    print(table(results, ["workload", "native_gbps", "fio_gbps", "ratio_native_to_fio", "within_target",
                          "native_p99_us", "fio_p99_us"],
                ["workload", "native GB/s", "fio GB/s", "native/fio", "within 15%", "native p99 us", "fio p99 us"]))
    with open(args.out, "w") as f:
        json.dump({"path": str(target), "fs_type": fstype, "plan": plan.to_dict(), "direct_io": direct_ok,
                   "repeats": args.repeats, "fio_version": fio_engine.fio_version(), "results": results,
                   "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=2)
    return 0 if all(r["within_target"] in (True, None) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
