"""`mleng hang`: py-spy stacks of every rank of a hung job, and flight-recorder dumps compared."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from mleng.cli.main import json_parent
from mleng.cli.render import emit, print_json
from mleng.errors import EXIT_OK, EXIT_PROBLEM, NotAvailableError, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    dump = sub.add_parser("dump", parents=[json_parent()],
                          help="py-spy stacks of every rank on this node, identical ones grouped, odd ones first")
    target = dump.add_mutually_exclusive_group()
    target.add_argument("--pid", type=int, help="pid of torchrun (its ranks are found) or of one rank")
    target.add_argument("--job", action="store_true", help="the ranks of this SLURM job ($SLURM_JOB_ID) on this node")
    dump.add_argument("--native", action="store_true", help="include C/C++ frames (py-spy --native)")
    dump.add_argument("--all-nodes", action="store_true",
                      help="inside a SLURM allocation: dump on every node through srun and merge")
    dump.add_argument("--jsonl", action="store_true", help=argparse.SUPPRESS)
    analyze = sub.add_parser("analyze", parents=[json_parent()],
                             help="flight-recorder dumps of every rank: the first collective where ranks disagree")
    analyze.add_argument("directory", help="directory with one dump per rank (TORCH_FR_DUMP_TEMP_FILE=<dir>/rank_)")


def run(args: argparse.Namespace) -> int:
    if args.action == "analyze":
        return _analyze(args)
    return _dump(args)


def _dump(args: argparse.Namespace) -> int:
    from mleng.hang.stacks import dump_job, merge_dumps

    if args.all_nodes:
        result = merge_dumps(_dump_all_nodes(args.native))
    else:
        job = os.environ.get("SLURM_JOB_ID") if args.job else None
        if args.job and not job:
            raise UsageError("--job needs SLURM_JOB_ID (run it inside the allocation, e.g. srun --overlap "
                             "--jobid=JOBID mleng hang dump --job)")
        result = dump_job(pid=args.pid, slurm_job=job, native=args.native)
    if args.jsonl:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        emit(args, result, render_dump)
    return EXIT_PROBLEM if any(g["outlier"] for g in result["groups"]) else EXIT_OK


def _dump_all_nodes(native: bool) -> list[dict]:
    job = os.environ.get("SLURM_JOB_ID")
    if not job or not shutil.which("srun"):
        raise NotAvailableError("--all-nodes works inside a SLURM allocation (SLURM_JOB_ID and srun needed)",
                                hint="run it from the batch script or an salloc shell, or use --pid on each node")
    nodes = os.environ.get("SLURM_JOB_NUM_NODES", "1")
    command = ["srun", "--overlap", f"--jobid={job}", f"--nodes={nodes}", "--ntasks-per-node=1",
               sys.executable, "-m", "mleng", "hang", "dump", "--job", "--jsonl"] + (["--native"] if native else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    dumps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not dumps:
        raise NotAvailableError(f"srun returned no dumps: {done.stderr.strip()[-500:]}")
    return dumps


def render_dump(result: dict) -> str:
    lines = [f"{len(result['ranks'])} rank(s) on {result['host']}, {len(result['groups'])} distinct stack(s)"]
    for group in result["groups"]:
        label = "ODD ONE OUT" if group["outlier"] else "same stack"
        lines.append("")
        lines.append(f"{label}: rank(s) {', '.join(map(str, group['ranks']))} on {', '.join(group['hosts'])}"
                     + (f" - sits on {group['sits_on']}" if group.get("sits_on") else ""))
        if group.get("error"):
            lines.append(f"  py-spy: {group['error']}")
        lines.extend(f"    {frame}" for frame in group["stack"])
    outliers = [r for g in result["groups"] if g["outlier"] for r in g["ranks"]]
    if outliers:
        lines.append("")
        lines.append(f"look first at rank(s) {', '.join(map(str, outliers))}: their stack differs from the others "
                     "(see handbook: mleng ask 'collective mismatch hang')")
    return "\n".join(lines)


def _analyze(args: argparse.Namespace) -> int:
    from mleng.hang.flight_recorder import analyze, describe, load_dir

    result = analyze(load_dir(args.directory))
    result["descriptions"] = [describe(f) for f in result["findings"]]
    if args.json:
        print_json(result)
    else:
        print(f"flight-recorder dumps of ranks {result['ranks']}, process groups {result['process_groups']}")
        if result["agree"]:
            print("every rank recorded the same collectives in the same order: no desync in the recorded window")
        for text in result["descriptions"]:
            print(text)
    return EXIT_OK if result["agree"] else EXIT_PROBLEM
