"""`mleng comm`: collective bandwidth (busbw/algbw as nccl-tests), on every rank of a plain, torchrun or srun launch."""

from __future__ import annotations

import argparse
import sys

from mleng.errors import CheckFailed, MlengError, UsageError

DEFAULT_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", metavar="OP",
                        help="all_reduce (default), all_gather, reduce_scatter, all_to_all, broadcast, reduce, "
                             "send_recv; repeat or comma-separate for several, or 'all'")
    parser.add_argument("-b", "--min-bytes", default="1M", help="smallest size per rank (32K, 1M, 4G: bare K/M/G and KiB/MiB/GiB are binary, KB/MB/GB decimal)")
    parser.add_argument("-e", "--max-bytes", default=None,
                        help="largest size per rank (default 1G on GPUs, 64M on CPU)")
    parser.add_argument("-f", "--factor", type=float, default=2.0, help="size multiplier between steps (2)")
    parser.add_argument("--dtype", default="float32", help="float32, float16, bfloat16, float64, int32, int64, int8")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per loop (20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations before timing (5)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="non-blocking mode: times the timed loop runs; the stats are over these loops (5)")
    parser.add_argument("--blocking", action="store_true",
                        help="synchronize after every op and time each alone (stats over iterations)")
    parser.add_argument("--check", action="store_true",
                        help="verify each op's result on known inputs and count the wrong elements")
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on GPUs, gloo on CPU")
    parser.add_argument("--nproc", type=int, help="local ranks to spawn when not under torchrun/srun "
                                                   "(default: one per GPU, 2 on CPU)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds for joining and for any one collective (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--min-busbw", type=float, metavar="GBPS",
                        help="exit 1 when an op's peak busbw is below this (acceptance tests)")
    parser.add_argument("--reference-gbps", type=float, metavar="GBPS",
                        help="link rate to compare the peak with, instead of the one from the specs")
    parser.add_argument("--plot", metavar="FILE.png", help="draw busbw against size")
    parser.add_argument("--no-store", action="store_true", help="do not save the result in the results store")
    parser.add_argument("--no-cuda-graph", action="store_true",
                        help="on NCCL, issue the timed ops eagerly instead of replaying a CUDA graph")


def settings_from(args: argparse.Namespace):
    from mleng.distributed.launch import visible_gpu_count
    from mleng.measure.collectives import Settings, dtype_name, op_names
    from mleng.measure.sizes import parse_size, size_sweep

    max_text = args.max_bytes or ("1G" if visible_gpu_count() and args.backend != "gloo" else "64M")
    for name in ("iters", "repeats"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1")
    if args.warmup < 0:
        raise UsageError("--warmup cannot be negative")
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    if args.nproc is not None and args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc}: give at least 1 rank")
    for flag, value in (("--min-busbw", args.min_busbw), ("--reference-gbps", args.reference_gbps)):
        if value is not None and value <= 0:
            raise UsageError(f"{flag} {value:g}: a bandwidth must be positive (GB/s)")
    if args.factor <= 1:
        raise UsageError(f"-f/--factor {args.factor:g}: sizes must grow, give a factor above 1 (2 doubles)")
    if args.plot is not None:
        from mleng.cli.common import check_output_path
        from mleng.report.plots import pyplot

        check_output_path(args.plot, "--plot", (".png",))
        pyplot()  # a missing matplotlib is said now, not after the sweep
    sizes = size_sweep(parse_size(args.min_bytes, "-b/--min-bytes"), parse_size(max_text, "-e/--max-bytes"),
                       args.factor)
    check_memory(max(sizes), max_text, args.backend, args.nproc)
    return Settings(ops=op_names(args.op or ["all_reduce"]),
                    sizes=sizes,
                    dtype=dtype_name(args.dtype), iters=args.iters, warmup=args.warmup, repeats=args.repeats,
                    blocking=args.blocking, check=args.check, cuda_graph=not args.no_cuda_graph)


def ranks_on_this_host(nproc: int | None) -> int:
    from mleng.distributed.launch import default_nproc, detect

    launch = detect()
    if launch is None:
        return nproc or default_nproc()
    return launch.local_world_size or 1


def check_memory(max_bytes: int, max_text: str, backend: str | None, nproc: int | None) -> None:
    """Each rank holds an input and an output buffer of the largest size: checked against free memory
    before any rank starts, instead of an allocator error on every rank."""
    from mleng.distributed.launch import visible_gpu_count
    from mleng.measure.sizes import format_bytes
    from mleng.machine.system import host_available_bytes
    from mleng.measure.membw import HOST_MARGIN_BYTES

    per_rank = 2 * max_bytes
    on_gpu = visible_gpu_count() and backend != "gloo"
    if on_gpu:
        free = _gpu_free_bytes()
        if free is not None and per_rank > free:
            raise UsageError(f"-e {max_text}: each rank needs {format_bytes(per_rank)} (input + output buffers), "
                             f"and a GPU here has {format_bytes(free)} free",
                             hint=f"pass -e {max(free // 2 // 2**20, 1)}M or less")
        return
    ranks = ranks_on_this_host(nproc)
    available = host_available_bytes()
    needed = ranks * per_rank + HOST_MARGIN_BYTES
    if available is not None and needed > available:
        fits = max((available - HOST_MARGIN_BYTES) // (2 * ranks), 0)
        raise UsageError(f"-e {max_text}: {ranks} rank(s) x {format_bytes(per_rank)} (input + output buffers) need "
                         f"{format_bytes(needed)}, the host has {format_bytes(available)} available",
                         hint=f"pass -e {fits // 2**20}M or less, or fewer ranks (--nproc)"
                         if fits >= 2**20 else "free host memory first")


def _gpu_free_bytes() -> int | None:
    """The least free memory of this host's GPUs, through NVML (no CUDA context in the launcher)."""
    from mleng.machine.nvml import nvml

    pynvml, _ = nvml()
    if pynvml is None:
        return None
    try:
        return min(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free
                   for i in range(pynvml.nvmlDeviceGetCount()))
    except Exception:  # no NVML here: the ranks' own allocation errors remain
        return None


def run(args: argparse.Namespace) -> int:
    from mleng.distributed.runner import run_as_ranks

    settings = settings_from(args)  # bad input is refused once, before any rank starts
    return run_as_ranks("comm", args._argv, args.nproc, args.timeout,
                        lambda launch: run_rank(args, launch, settings))


def run_rank(args: argparse.Namespace, launch, settings) -> int:
    import dataclasses

    from mleng.distributed.group import choose_backend
    from mleng.distributed.runner import RankSession
    from mleng.measure import collectives

    backend, _ = choose_backend(args.backend)
    params = {**dataclasses.asdict(settings), "backend": backend, "timeout_s": args.timeout,
              "min_busbw_gbps": args.min_busbw, "reference_gbps": args.reference_gbps}
    session = RankSession(launch, "comm", params, backend=backend, timeout_s=args.timeout,
                          no_store=args.no_store, interrupted="interrupted (Ctrl-C); rows measured so far are kept")
    is_root = session.is_root
    record = session.record
    rows: list[dict] = []

    def complete(record, job, status, error):
        ranks = job.public_ranks() if job else []
        collectives.complete_record(record, rows, ranks, settings, args.reference_gbps, args.min_busbw)

    with session.running(complete, lambda s: report(s, args)):
        job = session.join()
        asked_all = any("all" in [o.strip().lower() for o in item.split(",")] for item in (args.op or []))
        if asked_all and job.world_size < 2 and "send_recv" in settings.ops:
            # `--op all` on one rank means the ops one rank can run; naming send_recv alone is still an error
            settings = dataclasses.replace(settings, ops=[o for o in settings.ops if o != "send_recv"])
            if is_root:
                record.params["ops"] = settings.ops
                record.params["skipped_ops"] = {"send_recv": "needs at least 2 ranks"}
        if is_root:
            record.params["world_size"] = launch.world_size
            record.params["launch"] = launch.mode
            if not args.json:
                print(_header(job, settings), flush=True)
        printer = _RowPrinter(job.world_size) if is_root and not args.json else None
        if is_root:  # rates physics does not allow are errors as soon as they are measured
            early_reference, _ = collectives.reference_rate(backend, job.ranks, None, args.reference_gbps)
            ceiling = collectives.fastest_link_gbps()
        for row in collectives.sweep(job, settings):
            if is_root:
                collectives.reject_impossible([row], early_reference, ceiling)
            rows.append(row)  # kept before it is shown: a row on screen is a row in the record
            if printer:
                printer.row(row)
    if not is_root:
        return 0
    return _verdict(record, args)


def report(session, args: argparse.Namespace) -> None:
    """Rank 0, the record stored: printed (or --json), then the plot when asked."""
    from mleng.cli.common import print_rank_record

    record = session.record
    print_rank_record(session, args, lambda: _footer(record, session.stored), what="measurement")
    if args.plot and record.rows:
        from mleng.report.plots import plot_busbw

        try:
            plot_busbw(record.rows, args.plot, record.summary.get("theoretical"),
                       record.summary.get("theoretical_source"))
            if not args.json:
                print(f"plot written to {args.plot}")
        except MlengError as exc:
            print(f"mleng comm: warning: no plot: {exc}", file=sys.stderr)


def _verdict(record, args) -> int:
    summary = record.summary
    if summary.get("row_errors"):
        errors = summary["row_errors"]
        if record.params.get("world_size") == 1:
            hint = ("one rank crosses no link: run one rank per GPU on a machine with 2 or more GPUs (or under "
                    "torchrun/srun across nodes); all_gather, reduce_scatter and all_to_all at one rank time a local copy")
        else:
            hint = ("the timing is wrong, not the link: run with --no-cuda-graph, more ranks, or "
                    "--blocking, and report it if it persists")
        raise CheckFailed(f"{len(errors)} row(s) measured a rate physics does not allow: {'; '.join(errors[:3])}",
                          hint=hint)
    if summary.get("wrong"):
        bad = [f"{r['op']} at {r['size_bytes']} B: {r['wrong']}" for r in record.rows if r.get("wrong")]
        raise CheckFailed(f"--check found {summary['wrong']} wrong elements ({'; '.join(bad[:5])})",
                          hint="a rank computed or received wrong data: run `mleng check` and look at that link")
    below = summary.get("below_min_busbw") or []
    if below:
        peaks = ", ".join(f"{op} {summary['ops'][op]['peak_busbw_gbps']:.3g} GB/s" for op in below)
        raise CheckFailed(f"peak busbw below --min-busbw {args.min_busbw:g} GB/s: {peaks}",
                          hint="compare with `mleng check --pairs` to find the slow link")
    return 0


def _header(job, settings) -> str:
    from mleng.measure.collectives import timing_note

    hosts = job.hosts
    on = f"{len(hosts)} host{'s' if len(hosts) != 1 else ''} ({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''})"
    return "\n".join([
        f"# mleng comm: {job.world_size} rank{'s' if job.world_size != 1 else ''} on {on}, backend {job.backend}, device {job.device.split(':')[0]}, "
        f"launch {job.launch.mode}, dtype {settings.dtype}",
        f"# timing: {timing_note(settings, uses_graph=job.device.startswith('cuda') and settings.cuda_graph and not settings.blocking)}",
        "# size in bytes per rank (binary prefixes in the plot), time in us (median), bandwidth in GB/s (base 10); "
        "busbw = algbw x the op's factor",
    ])


class _RowPrinter:
    """Rows as they are measured, nccl-tests style, so a long sweep shows progress and a failure keeps its rows."""

    COLUMNS = [("size", 12, "size_bytes"), ("count", 12, "count"), ("type", 9, "dtype"),
               ("time_us", 11, "time_us"), ("algbw_gbps", 11, "algbw_gbps"), ("busbw_gbps", 11, "busbw_gbps"),
               ("min_us", 11, "time_min_us"), ("max_us", 11, "time_max_us"), ("p99_us", 11, "time_p99_us"),
               ("cv", 7, "time_cv")]

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.op = None

    def row(self, row: dict) -> None:
        from mleng.measure.collectives import OPS

        columns = self.COLUMNS + ([("wrong", 8, "wrong")] if "wrong" in row else [])
        if row["op"] != self.op:
            self.op = row["op"]
            factor = OPS[self.op].factor(self.world_size)
            print(f"\n# {self.op}: busbw factor {factor:.4g} at {self.world_size} ranks", flush=True)
            print("".join(name.rjust(width) for name, width, _ in columns), flush=True)
        if row.get("error"):
            print(f"{row['size_bytes']:>12}{row.get('count'):>12}{row.get('dtype'):>9}  ERROR: {row['error']}", flush=True)
            return
        cells = []
        for _, width, key in columns:
            value = row.get(key)
            if isinstance(value, float):
                text = f"{value:.4f}" if key == "time_cv" else (f"{value:.2f}" if value >= 0.01 or value == 0
                                                                 else f"{value:.3g}")
            else:
                text = str(value)
            cells.append(text.rjust(width))
        print("".join(cells), flush=True)


def _footer(record, stored) -> str:
    from mleng.measure.sizes import format_bytes

    s = record.summary
    lines = [""]
    if record.status != "complete":  # the error itself is printed once, on stderr
        lines.append(f"status: {record.status}" + (" (see the error below)" if record.status == "failed" else
                                                   ": rows measured so far are kept"))
    for op, best in (s.get("ops") or {}).items():
        share = f" = {best['ratio'] * 100:.1f}% of {s['theoretical']:g} GB/s" if best.get("ratio") is not None else ""
        lines.append(f"peak busbw {op}: {best['peak_busbw_gbps']:.3g} GB/s at {format_bytes(best['at_size_bytes'])}{share}")
    verdict = "" if s.get("theoretical") else " (inconclusive)"
    lines.append(f"reference: {s.get('theoretical_source')}{verdict}")
    if "wrong" in s:
        lines.append(f"check: {s['wrong']} wrong elements" + (" (all results correct)" if not s["wrong"] else ""))
    if stored:
        lines.append(f"stored as {stored}")
    return "\n".join(lines)
