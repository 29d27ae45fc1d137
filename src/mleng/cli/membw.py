"""`mleng membw`: device, host<->device and CPU memory bandwidth against the specs."""

from __future__ import annotations

import argparse
import sys

from mleng.cli.common import preflight_store, selected, store_print_exit
from mleng.cli.render import table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--device", help="GPU index N, cuda:N, or cpu (default: GPU 0, else the CPU)")
    target.add_argument("--all-devices", action="store_true",
                        help="every GPU at once, one process per GPU, tests in step")
    parser.add_argument("--size", default=None,
                        help="buffer size, e.g. 4GiB (default 4GiB on a GPU, 1GiB on the CPU; "
                             "far beyond L2/LLC is the point)")
    parser.add_argument("--op", action="append", metavar="OP",
                        help="copy, read, write, h2d, d2h; repeat or comma-separate for several (default: all that apply)")
    parser.add_argument("--tests", action="append", dest="op", help=argparse.SUPPRESS)  # the old name, kept
    parser.add_argument("--engine", choices=["torch", "triton", "driver", "all"], default="all",
                        help="kernels to time on a GPU (default all: torch, Triton when installed, and the "
                             "CUDA driver's own device-to-device copy, cuMemcpyDtoDAsync, for the copy ceiling)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per test (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for CPU memory (default: all usable cores)")
    parser.add_argument("--no-store", action="store_true", help="do not save the result in the results store")


def run(args: argparse.Namespace) -> int:
    from mleng.measure.sizes import format_bytes

    shown: list[dict] = []

    def on_row(row: dict) -> None:
        shown.append(row)
        if not args.json and "gbps" in row:
            print(f"  {row['device']} {_label(row)}: {row['gbps']:.1f} GB/s", file=sys.stderr, flush=True)

    m = measure(args, on_row=on_row)
    return store_print_exit(m, args, lambda record: render(record, format_bytes))


def measure(args: argparse.Namespace, on_row=None):
    """What `mleng membw` does before it stores and prints: the flags checked, the store checked, the run;
    returns the Measurement. `mleng.membw()` calls it."""
    from mleng.measure import membw
    from mleng.measure.sizes import parse_size

    size = parse_size(args.size, "--size") if args.size else None
    tests = selected(args.op, membw.TESTS)
    engines = None if args.engine == "all" else [args.engine]
    if args.iters < 1 or args.warmup < 0:
        from mleng.errors import UsageError

        raise UsageError("--iters must be at least 1 and --warmup at least 0")
    if args.threads is not None and args.threads < 1:
        from mleng.errors import UsageError

        raise UsageError(f"--threads must be at least 1 (got {args.threads})")
    preflight_store(args)
    return membw.run_membw(device=args.device, all_devices=args.all_devices, size_bytes=size, tests=tests,
                           engines=engines, iters=args.iters, warmup=args.warmup, threads=args.threads,
                           on_row=on_row)


def _label(row: dict) -> str:
    return row["test"] if not row.get("host_memory") else f"{row['test']} ({row['host_memory']})"


def render(m, format_bytes) -> str:
    rows = []
    for r in m.rows:
        if "gbps" not in r:
            continue
        rows.append({**r, "test": _label(r), "size": format_bytes(r["size_bytes"]),
                     "spread": f"{r['gbps_min']:.1f}-{r['gbps_max']:.1f}",
                     "ratio": f"{r['ratio'] * 100:.1f}%" if r.get("ratio") else None})
    lines = [f"membw {m.id} ({m.status}), {m.params['iters']} timed iterations after {m.params['warmup']} warm-up",
             table(rows, ["device", "test", "engine", "size", "gbps", "spread", "time_us", "theoretical_gbps", "ratio"],
                   ["device", "test", "engine", "size", "GB/s", "GB/s min-max", "median us", "spec GB/s", "of spec"])]
    for r in m.rows:
        if "skipped" in r:
            lines.append(f"skipped {r['engine']} on {r['device']}: {r['skipped']}")
    s = m.summary
    if s.get("value") is not None:
        head = f"copy: {s['value']:.1f} GB/s"
        if s.get("ratio"):
            head += f" = {s['ratio'] * 100:.1f}% of {s['theoretical']:.0f} GB/s ({s.get('theoretical_source')})"
        else:
            head += f" (no reference: {s.get('theoretical_source') or 'none'})"
        lines.append(head)
    for device, info in (s.get("devices") or {}).items():
        link = info.get("pcie")
        if link:
            lines.append(f"{device} PCIe: gen {link.get('gen')} x{link.get('width')} (now gen {link.get('gen_current')} "
                         f"x{link.get('width_current')}), reference {link.get('theoretical_gbps') or '-'} GB/s per direction"
                         + ("" if link.get("theoretical_gbps") else f" ({link.get('theoretical_source')})"))
    if m.error:
        lines.append(f"error: {m.error}")
    lines.append("GB/s = 10^9 bytes/s; sizes in binary units; copy counts bytes read + written.")
    return "\n".join(lines)
