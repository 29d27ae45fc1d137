"""`mleng io PATH`: checkpoint save/load, dataloader random reads and metadata on a file system."""

from __future__ import annotations

import argparse
import sys

from mleng.cli.common import preflight_store, selected, store_print_exit
from mleng.cli.render import table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="a directory on the file system to measure")
    parser.add_argument("--size", default="1GiB",
                        help="bytes of checkpoint written and read, split in one shard per job (default 1GiB)")
    parser.add_argument("--jobs", type=int, default=4, help="writers/readers at once, one shard each (default 4)")
    parser.add_argument("--duration", type=float, default=10.0,
                        help="seconds for each random-read workload and the metadata create phase (default 10)")
    parser.add_argument("--op", action="append", metavar="OP",
                        help="ckpt-save, ckpt-load, rand-read-4k, rand-read-1m, metadata; repeat or comma-separate "
                             "for several (default: all)")
    parser.add_argument("--workloads", action="append", dest="op", help=argparse.SUPPRESS)  # the old name, kept
    parser.add_argument("--engine", choices=["auto", "fio", "native"], default="auto",
                        help="fio (parsing its JSON) or the native Python engine; auto: fio when installed")
    parser.add_argument("--baseline", choices=["local"], default=None,
                        help="also measure a local temporary directory and report PATH / local ratios")
    parser.add_argument("--files", type=int, default=2000, help="small files for the metadata workload (default 2000)")
    parser.add_argument("--no-store", action="store_true", help="do not save the result in the results store")


def run(args: argparse.Namespace) -> int:
    from mleng.measure.sizes import format_bytes

    # SIGTERM (a batch system's stop) ends the run like Ctrl-C: files removed, results kept (mleng.signals).

    def on_row(row: dict) -> None:
        if not args.json:
            bandwidth = f"{row['bandwidth_gbps']:.3f} GB/s, " if row["bandwidth_gbps"] is not None else ""
            print(f"  {row['target']} {row['workload']} ({row['engine']}): {bandwidth}{row['iops']:.0f} IOPS",
                  file=sys.stderr, flush=True)

    def on_workspace(workspace) -> None:
        if not args.json:
            print(f"  working in {workspace.dir} (removed at the end)", file=sys.stderr, flush=True)

    m = measure(args, on_row=on_row, on_workspace=on_workspace)
    return store_print_exit(m, args, lambda record: render(record, format_bytes))


def measure(args: argparse.Namespace, on_row=None, on_workspace=None):
    """What `mleng io` does before it stores and prints: the flags and PATH checked, the store checked, the
    run; returns the Measurement. `mleng.io()` calls it."""
    from mleng.measure import storage
    from mleng.measure.sizes import parse_size

    from mleng.errors import UsageError

    if not args.path.strip():
        raise UsageError("PATH is empty", hint="give the directory to measure, e.g. `mleng io /scratch` or `mleng io .`")
    size = parse_size(args.size, "--size")
    for flag, value in (("--jobs", args.jobs), ("--files", args.files)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1 (got {value})")
    if args.duration <= 0:
        raise UsageError(f"--duration must be positive (got {args.duration:g})")
    workloads = selected(args.op, storage.WORKLOADS)
    storage.check_target(args.path)
    preflight_store(args)
    return storage.run_io(args.path, size_bytes=size, jobs=args.jobs, duration_s=args.duration,
                          workloads=workloads, engine=args.engine, baseline=args.baseline,
                          metadata_files=args.files, on_row=on_row, on_workspace=on_workspace)


def render(m, format_bytes) -> str:
    p = m.params
    lines = [f"io {m.id} ({m.status}) on {p['path']}: {format_bytes(p['size_bytes'])} in {p['jobs']} shards of "
             f"{format_bytes(p['shard_bytes'])}, engine {p['engine']}"]
    rows = []
    for r in m.rows:
        rows.append({**r, "block": format_bytes(r["block_bytes"]) if r.get("block_bytes") else None,
                     "ratio": f"{r['baseline_ratio']:.2f}" if r.get("baseline_ratio") else None,
                     "cold": r.get("cold_method")})
    columns = ["target", "workload", "engine", "block", "bandwidth_gbps", "bandwidth_mibps", "iops",
               "latency_p50_us", "latency_p99_us"]
    headers = ["target", "workload", "engine", "block", "GB/s", "MiB/s", "IOPS", "p50 us", "p99 us"]
    if any(r.get("baseline_ratio") for r in m.rows):
        columns.append("ratio")
        headers.append("vs local")
    lines.append(table(rows, columns, headers))
    for role, info in (m.summary.get("targets") or {}).items():
        note = f"{role}: {info.get('path')} ({info.get('fs_type')}), direct I/O {'yes' if info.get('direct_io') else 'no'}"
        if info.get("same_filesystem_as_path"):
            note += ", same file system as PATH"
        if info.get("left_behind"):
            note += f", could not remove {', '.join(info['left_behind'])} (files not ours inside?)"
        lines.append(note)
    colds = sorted({r["cold_method"] for r in m.rows if r.get("cold_method")})
    if colds:
        lines.append("cold reads: " + "; ".join(colds))
    if m.error:
        lines.append(f"error: {m.error}")
    lines.append("GB/s = 10^9 bytes/s, MiB/s = 2^20 bytes/s; ckpt-save includes the fsync; latency per I/O call.")
    return "\n".join(lines)
