"""`mleng check`: every rank joins in time, all-reduces correctly, passes a barrier, can allocate; --pairs bandwidth."""

from __future__ import annotations

import argparse

from mleng.errors import CheckFailed, UsageError

DEFAULT_TIMEOUT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds for joining and for every collective (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--alloc-gib", type=float, default=0.0, metavar="GIB",
                        help="allocate and touch this many GiB on every rank's device (default: skip)")
    parser.add_argument("--pairs", nargs="?", const="ranks", choices=["ranks", "nodes"],
                        help="point-to-point bandwidth between every pair of ranks (or of nodes, one rank each)")
    parser.add_argument("--pair-bytes", default="16M", help="bytes per send in --pairs (16M)")
    parser.add_argument("--pair-iters", type=int, default=5, help="timed sends per pair (5)")
    parser.add_argument("--outlier-ratio", type=float, default=0.7,
                        help="--pairs: flag pairs below this fraction of the median (0.7; 0 flags none)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on GPUs, gloo on CPU")
    parser.add_argument("--no-store", action="store_true", help="do not save the result in the results store")
    parser.add_argument("--nproc", type=int, help="local ranks to spawn when not under torchrun/srun "
                                                   "(default: one per GPU, 2 on CPU)")


def run(args: argparse.Namespace) -> int:
    from mleng.distributed.runner import run_as_ranks
    from mleng.measure.sizes import parse_size

    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    if args.alloc_gib < 0:
        raise UsageError("--alloc-gib cannot be negative")
    if args.pair_iters < 1:
        raise UsageError("--pair-iters must be at least 1")
    if args.nproc is not None and args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc}: give at least 1 rank")
    if not 0 <= args.outlier_ratio < 1:
        raise UsageError(f"--outlier-ratio {args.outlier_ratio:g}: give a fraction of the median from 0 up to "
                         "(not including) 1", hint="0.7 flags pairs below 70% of the median; 0 flags none")
    pair_bytes = parse_size(args.pair_bytes, "--pair-bytes")
    return run_as_ranks("check", args._argv, args.nproc, args.timeout,
                        lambda launch: run_rank(args, launch, pair_bytes))


def run_rank(args: argparse.Namespace, launch, pair_bytes: int) -> int:
    from mleng.distributed.group import gather_to_rank0
    from mleng.distributed.runner import RankSession
    from mleng.measure import connectivity

    params = {"timeout_s": args.timeout, "alloc_gib": args.alloc_gib, "pairs": args.pairs,
              "pair_bytes": pair_bytes, "pair_iters": args.pair_iters, "backend": args.backend,
              "outlier_ratio": args.outlier_ratio}
    session = RankSession(launch, "check", params, backend=args.backend, timeout_s=args.timeout,
                          no_store=args.no_store)
    rows: list[dict] = []
    pairs: dict | None = None

    def complete(record, job, status, error):
        connectivity.complete_record(record, job, rows, pairs, args.outlier_ratio, status, error)

    with session.running(complete, lambda s: report(s, args, pairs)):
        job = session.join()
        mine = {}
        mine.update(connectivity.verify_all_reduce(job))
        mine.update(connectivity.barrier(job))
        mine.update(connectivity.allocation(job, args.alloc_gib))
        if args.pairs:
            pairs = connectivity.pairs_matrix(job, args.pairs, pair_bytes, args.pair_iters, args.outlier_ratio)
        reports = gather_to_rank0(job, "report", mine)
        if session.is_root:
            ranks = job.public_ranks()
            rows = [{**ranks[r], **reports[r]} for r in range(job.world_size)]
    if not session.is_root:
        return 0
    record = session.record
    problems = record.summary["problems"]
    if problems:
        message = "; ".join(problems) if args.json else f"{len(problems)} problem(s) found, listed above"
        raise CheckFailed(message, hint=_hint(record))
    return 0


def report(session, args: argparse.Namespace, pairs: dict | None) -> None:
    from mleng.cli.common import print_rank_record

    print_rank_record(session, args, lambda: _render(session.record, session.job, session.record.rows, pairs,
                                                     session.stored))


def _hint(record) -> str:
    if (record.summary.get("pairs") or {}).get("slow"):
        return "re-run --pairs on the suspect nodes alone to bisect; check their NIC and cable"
    return "look at the ranks and hosts named above"


def _render(record, job, rows, pairs, stored) -> str:
    from mleng.cli.render import table

    lines = []
    if job is not None:
        hosts = job.hosts
        lines.append(f"mleng check: {job.world_size} rank{'s' if job.world_size != 1 else ''} on {len(hosts)} host(s) ({', '.join(hosts[:6])}), "
                     f"backend {job.backend}, launch {job.launch.mode}, timeout {job.timeout_s:g} s")
    if rows:
        shown = []
        for row in rows:
            shown.append({**row, "numa": ",".join(str(n) for n in (row.get("gpu_numa_node"),) if n is not None)
                          or ",".join(str(n) for n in row.get("numa_nodes") or []) or None,
                          "all_reduce": "ok" if row.get("all_reduce_ok") else f"WRONG {row.get('all_reduce_values')}",
                          "alloc": {True: f"ok {row['alloc_gib']:g} GiB", False: "FAILED", None: "skipped"}[row.get("alloc_ok")]})
        columns = ["rank", "local_rank", "host", "pid", "device", "gpu_uuid", "numa", "cpu_affinity",
                   "all_reduce", "barrier_ms", "alloc"]
        if not any(r.get("gpu_uuid") for r in rows):
            columns.remove("gpu_uuid")
        lines.append(table(shown, columns))
    if pairs is not None:
        lines.append("")
        lines.append(f"pairs: skipped: {pairs['skipped']}" if "skipped" in pairs else _matrix(pairs, job))
    problems = record.summary["problems"]
    if record.status == "complete" and not problems:
        lines.append(f"ok: all {job.world_size} ranks joined, all-reduce of ones = {job.world_size} on every rank, "
                     f"barrier passed" + (f", {record.params['alloc_gib']:g} GiB allocated on every rank"
                                          if record.params.get("alloc_gib") else ""))
    elif record.status == "complete":
        lines.append("problems:")
        lines.extend(f"  - {p}" for p in problems)
    else:  # the error itself is printed once, on stderr
        lines.append(f"status: {record.status}" + (" (see the error below)" if record.status == "failed" else ""))
    if stored:
        lines.append(f"stored as {stored}")
    return "\n".join(lines)


def _matrix(pairs: dict, job) -> str:
    members = pairs["members"]
    slow = {tuple(p) for p in pairs["slow"]}
    label = "node (rank)" if pairs["mode"] == "nodes" else "rank"
    names = [f"{job.ranks[r]['host']} ({r})" if pairs["mode"] == "nodes" else str(r) for r in members]
    width = max(9, *(len(n) for n in names)) + 1
    out = [f"send bandwidth GB/s (base 10), row = sender, column = receiver, {pairs['size_bytes']} bytes per send; "
           f"* = below {pairs['ratio']:g} x median ({pairs['median_gbps'] or 0:.3g} GB/s)",
           label.rjust(width) + "".join(n.rjust(width) for n in names)]
    for i, src in enumerate(members):
        cells = []
        for j, dst in enumerate(members):
            value = pairs["matrix_gbps"][i][j]
            text = "-" if value is None else f"{value:.3g}" + ("*" if (src, dst) in slow else " ")
            cells.append(text.rjust(width))
        out.append(names[i].rjust(width) + "".join(cells))
    return "\n".join(out)
