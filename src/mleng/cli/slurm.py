"""`mleng slurm`: write an sbatch script that runs an mleng command on every node, submit and follow it, merge."""

from __future__ import annotations

import argparse
import os
import sys

from mleng.cli.main import json_parent
from mleng.cli.render import Progress, print_json, table
from mleng.errors import EXIT_INTERRUPTED, MlengError, UsageError

DEFAULT_OUTPUT = "mleng-slurm"


def _job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mleng_command", metavar="COMMAND",
                        help="check or comm (one torch world across the nodes), or mamf, doctor, membw, io, env "
                             "(run on every node, merged per node)")
    parser.add_argument("--nodes", type=int, required=True, help="nodes to run on")
    parser.add_argument("--gpus-per-node", type=int, required=True, metavar="G",
                        help="GPUs per node; 0 runs on CPU with gloo")
    parser.add_argument("--nproc-per-node", type=int, metavar="N",
                        help="ranks per node (default: G, or 1 on CPU)")
    parser.add_argument("--cpus-per-task", type=int, help="CPUs for each node's task (default: the site's, "
                                                          "or N on CPU)")
    parser.add_argument("--partition", help="sbatch --partition")
    parser.add_argument("--time", help="sbatch --time (MINUTES, HH:MM:SS, DAYS-HH:MM:SS)")
    parser.add_argument("--account", help="sbatch --account")
    parser.add_argument("--job-name", help="sbatch --job-name (default mleng-COMMAND)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, metavar="DIR",
                        help=f"folder for the script, the log and the results (default ./{DEFAULT_OUTPUT}); "
                             "must be visible from every node")
    parser.add_argument("--join-timeout", type=float, default=120.0, metavar="S",
                        help="seconds torchrun waits for every node to join the rendezvous (120)")
    parser.add_argument("--env", action="append", metavar="NAME=VALUE",
                        help="export this in the job (repeat), e.g. NCCL_DEBUG=INFO")
    parser.add_argument("--no-nvls", action="store_true",
                        help="export NCCL_NVLS_ENABLE=0 (NVLink SHARP / multicast off)")
    parser.add_argument("--per-node", action="store_true",
                        help="comm: afterwards run comm inside every node alone, to compare nodes")


class _DashDashParser(argparse.ArgumentParser):
    """Everything after the first `--` belongs to the mleng command being run, not to us.

    (A trailing nargs='*' positional cannot take it: argparse fills that positional, empty, together
    with COMMAND, and then calls the rest unrecognized.)
    """

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        tail: list[str] = []
        if "--" in args:
            cut = args.index("--")
            args, tail = args[:cut], args[cut + 1:]
        namespace, extras = super().parse_known_args(args, namespace)
        namespace.mleng_args = tail
        return namespace, extras


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=_DashDashParser)
    script = sub.add_parser("script", parents=[json_parent()], help="write the sbatch script",
                            usage="mleng slurm script COMMAND --nodes N --gpus-per-node G [options] [-- MLENG_ARGS]",
                            description="Write an sbatch script that runs COMMAND on every node of the job.")
    _job_arguments(script)
    script.add_argument("--script", metavar="FILE", help="where to write it (default DIR/mleng-COMMAND.sbatch)")
    script.add_argument("--stdout", action="store_true", help="print the script instead of writing a file")
    run = sub.add_parser("run", parents=[json_parent()], help="write the script, submit it, follow it, merge",
                         usage="mleng slurm run COMMAND --nodes N --gpus-per-node G [options] [-- MLENG_ARGS]",
                         description="Submit the script with sbatch, follow the job and print the merged result.")
    _job_arguments(run)
    run.add_argument("--poll", type=float, default=0.5, metavar="S", help="seconds between squeue polls (0.5)")
    run.add_argument("--quiet", action="store_true", help="do not echo the job's log while it runs")
    run.add_argument("--straggler-ratio", type=float, default=0.9, metavar="R",
                     help="a node below R x the median of the nodes is a straggler (0.9; 0 flags none)")
    merge = sub.add_parser("merge", parents=[json_parent()],
                           help="merge a finished job's results folder (or show a stored record per node)")
    merge.add_argument("target", help="a job-JOBID results folder, or a stored record id ('last')")
    merge.add_argument("--straggler-ratio", type=float, default=0.9, metavar="R")
    merge.add_argument("--no-store", action="store_true", help="do not save the merged record")


def _spec(args: argparse.Namespace):
    from mleng.slurm.script import ScriptSpec, parse_env

    _check_inner_args(args.mleng_command, args.mleng_args)
    env = parse_env(args.env)
    if args.no_nvls:
        env.setdefault("NCCL_NVLS_ENABLE", "0")
    return ScriptSpec(command=args.mleng_command, mleng_args=list(args.mleng_args), nodes=args.nodes,
                      gpus_per_node=args.gpus_per_node, nproc_per_node=args.nproc_per_node,
                      cpus_per_task=args.cpus_per_task, partition=args.partition, time=args.time,
                      account=args.account, output_dir=args.output, job_name=args.job_name,
                      join_timeout_s=args.join_timeout, env=env, per_node=args.per_node).validate()


def _check_inner_args(command: str, mleng_args: list[str]) -> None:
    """Refuse arguments the command would refuse, here, instead of in a queued job minutes later."""
    from mleng.cli.main import COMMANDS, build_parser

    if command not in COMMANDS:
        return  # ScriptSpec.validate names the commands that can run
    try:
        build_parser(command).parse_args([command, *mleng_args])
    except SystemExit as exc:  # argparse has printed what is wrong
        if exc.code:
            raise UsageError(f"the arguments after -- are not valid for `mleng {command}` (see above)",
                             hint=f"try `mleng {command} --help`") from None


def _write_script(spec, args, path: str | None) -> str:
    from mleng.slurm.script import render

    text = render(spec, written_by=["mleng", "slurm", *args._argv[1:]])
    path = path or os.path.join(spec.output_dir, f"mleng-{spec.command}.sbatch")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        os.makedirs(spec.output_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)
    except OSError as exc:
        raise UsageError(f"cannot write the script to {path}: {exc.strerror}",
                         hint="pick a writable folder with --output or --script") from None
    return os.path.abspath(path)


def run(args: argparse.Namespace) -> int:
    if args.action == "script":
        return _script(args)
    if args.action == "run":
        return _run(args)
    return _merge(args)


def _script(args: argparse.Namespace) -> int:
    from mleng.slurm.script import render

    spec = _spec(args)
    if args.stdout:
        sys.stdout.write(render(spec, written_by=["mleng", "slurm", *args._argv[1:]]))
        return 0
    path = _write_script(spec, args, args.script)
    if args.json:
        print_json({"script": path, "results": os.path.abspath(spec.output_dir), "command": spec.command,
                    "nodes": spec.nodes, "gpus_per_node": spec.gpus_per_node,
                    "ranks_per_node": spec.ranks_per_node, "mode": "torchrun" if spec.distributed else "per_node"})
    else:
        print(f"wrote {path}")
        print(f"submit: sbatch {path}")
        print(f"then:   mleng slurm merge {os.path.abspath(spec.output_dir)}/job-<JOBID>")
    return 0


def _run(args: argparse.Namespace) -> int:
    import time

    from mleng.slurm import job as slurm_job

    if args.poll <= 0:
        raise UsageError("--poll must be positive")
    spec = _spec(args)
    path = _write_script(spec, args, None)
    submitted = time.monotonic()
    job_id = slurm_job.submit(path)
    results_dir = os.path.join(os.path.abspath(spec.output_dir), f"job-{job_id}")
    log_path = os.path.join(os.path.abspath(spec.output_dir), f"slurm-{job_id}.out")
    progress = Progress(None, label=f"job {job_id}")
    print(f"mleng slurm: submitted job {job_id} ({spec.command} on {spec.nodes} node(s)); log {log_path}",
          file=sys.stderr, flush=True)

    def on_line(line: str) -> None:
        if not args.quiet:
            progress.close()
            print(line, file=sys.stderr, flush=True)

    def on_state(state: str, elapsed: str, where: str, waited: float) -> None:
        progress.update(waited, f"{state} {where}")

    interrupted = False
    try:
        end = slurm_job.follow(job_id, log_path, args.poll, on_line, on_state, started=submitted)
    except UsageError:
        progress.close()
        slurm_job.cancel(job_id)
        print(f"mleng slurm: cancelled job {job_id}", file=sys.stderr)
        raise
    except KeyboardInterrupt:
        # Ranks get SIGINT and keep what they measured; then follow the job to its end once more.
        interrupted = True
        progress.close()
        print(f"mleng slurm: interrupting job {job_id} (Ctrl-C again cancels it outright)", file=sys.stderr)
        slurm_job.cancel(job_id, "INT")
        try:
            end = slurm_job.follow(job_id, log_path, args.poll, on_line, None, started=submitted)
        except KeyboardInterrupt:
            slurm_job.cancel(job_id)
            print(f"mleng slurm: cancelled job {job_id}", file=sys.stderr)
            return EXIT_INTERRUPTED
    progress.close()
    record = _merged_or_failed(results_dir, job_id, end, args.straggler_ratio)
    record.params.setdefault("slurm", {}).update({"state": end.state, "script": path,
                                                  "submit_to_result_s": round(time.monotonic() - submitted, 3)})
    stored, problem = _store(record)
    code = _exit_code(end, record)
    if interrupted:
        code = EXIT_INTERRUPTED
    if args.json:
        print_json({"job": {"job_id": job_id, "state": end.state, "exit_code": code, "log": log_path,
                            "results": results_dir, "submit_to_result_s": record.params["slurm"]["submit_to_result_s"]},
                    "stored_as": stored, "record": record.to_dict()})
    else:
        job_code = record.params["slurm"].get("exit_code", end.exit_code)
        print(f"job {job_id} {end.state} (job exit code {job_code}) on {end.nodes or '?'}, "
              f"{record.params['slurm']['submit_to_result_s']:.1f} s from submission to result; "
              f"results in {results_dir}")
        print(render_merged(record, stored))
        if code != job_code:
            print(f"exit code {code}: " + ("interrupted" if code == EXIT_INTERRUPTED else "a straggler or a node without "
                                           "a complete result"))
    if problem:
        print(f"mleng slurm: warning: the merged record was not stored: {problem}", file=sys.stderr)
    return code


def _merged_or_failed(results_dir: str, job_id: str, end, ratio: float):
    from mleng.results.record import Measurement
    from mleng.slurm.merge import merge_job_dir

    try:
        return merge_job_dir(results_dir, ratio)
    except UsageError:
        record = Measurement.start("slurm", {"slurm": {"job_id": job_id, "results_dir": results_dir}})
        return record.finish("failed", f"job {job_id} ended {end.state} before writing any result "
                                       f"(exit code {end.exit_code}); see its log")


def _exit_code(end, record) -> int:
    job_code = (record.params.get("slurm") or {}).get("exit_code")
    if job_code is None:
        job_code = end.exit_code if end.exit_code is not None else (0 if end.state == "COMPLETED" else 1)
        if end.state not in ("COMPLETED", "UNKNOWN") and job_code == 0:
            job_code = 1  # TIMEOUT, CANCELLED, NODE_FAIL: the command never said it was done
    inconsistent = any(c.get("severity") == "fail" for c in record.summary.get("consistency") or [])
    if job_code == 0 and (record.summary.get("stragglers") or inconsistent or record.status != "complete"):
        return 1
    return job_code


def _store(record) -> tuple[str | None, str | None]:
    try:
        from mleng.results.store import save_measurement

        return save_measurement(record), None
    except MlengError as exc:
        return None, str(exc)


def _merge(args: argparse.Namespace) -> int:
    from mleng.slurm.merge import annotate, merge_job_dir

    if os.path.isdir(args.target):
        record = merge_job_dir(args.target, args.straggler_ratio)
        stored, problem = (None, None) if args.no_store else _store(record)
    else:
        from mleng.results.store import Store

        with Store() as store:
            record = store.get(store.resolve_id(args.target))
        annotate(record, args.straggler_ratio)
        stored, problem = None, None
    if args.json:
        print_json({"stored_as": stored, "record": record.to_dict()})
    else:
        print(render_merged(record, stored))
    if problem:
        print(f"mleng slurm: warning: the merged record was not stored: {problem}", file=sys.stderr)
    inconsistent = any(c.get("severity") == "fail" for c in record.summary.get("consistency") or [])
    return 1 if record.summary.get("stragglers") or inconsistent or record.status != "complete" else 0


_COLUMNS = {
    "check": (["node", "host", "ranks", "all_reduce_ok", "barrier_ms", "pair_gbps", "of_median", "straggler"],
                     ["node", "host", "ranks", "all-reduce ok", "barrier ms", "pair GB/s", "x median", "straggler"]),
    "comm": (["node", "host", "ranks", "devices", "busbw_gbps", "of_median", "straggler"],
                   ["node", "host", "ranks", "devices", "own busbw GB/s", "x median", "straggler"]),
}


def render_merged(record, stored: str | None = None) -> str:
    s = record.summary
    slurm = record.params.get("slurm") or {}
    lines = [f"{record.kind} {record.id}: {record.status}" + (f": {record.error}" if record.error else "")
             + (f" (job {slurm['job_id']}, {slurm.get('nodes')} node(s) {slurm.get('nodelist')})"
                if slurm.get("job_id") else "")]
    if record.kind == "check" and s.get("verdict"):
        lines.append(f"check: {s['verdict']}, {s.get('world_size')} ranks"
                     + (f"; problems: {'; '.join(s['problems'])}" if s.get("problems") else ""))
    for op, best in (s.get("ops") or {}).items() if record.kind == "comm" else []:
        lines.append(f"peak busbw {op} across all nodes: {best['peak_busbw_gbps']:.3g} GB/s "
                     f"at {best['at_size_bytes']} bytes per rank")
    per_node = s.get("per_node") or []
    if per_node:
        columns, headers = _COLUMNS.get(record.kind, (["node", "host", "status", "verdict", "fail", "warn", "value",
                                                       "unit", "of_median", "devices", "slowest_device", "straggler"],
                                                      ["node", "host", "status", "verdict", "fail", "warn", "value",
                                                       "unit", "x median", "GPUs", "slowest GPU", "straggler"]))
        keep = [(c, h) for c, h in zip(columns, headers) if any(r.get(c) not in (None, "") for r in per_node)]
        lines.append("")
        lines.append(table(per_node, [c for c, _ in keep], [h for _, h in keep]))
    key = s.get("per_node_key")
    if s.get("per_node_note"):
        lines.append(f"note: {s['per_node_note']}")
    consistency = s.get("consistency") or []
    if consistency:
        lines.append("")
        lines.append("same stack on every node:")
        for item in consistency:
            mark = {"fail": "FAIL", "warn": "WARN", "ok": "ok", "inconclusive": "??"}.get(item["severity"], "--")
            lines.append(f"[{mark:>4}] {item['summary']}")
    if s.get("stragglers"):
        lines.append("")
        for item in s["stragglers"]:
            lines.append(f"straggler {item['node']}: {item['reason']}")
        lines.append("to drain (printed only; paste it if you agree):")
        lines.extend(f"  {line}" for line in s["drain"])
    elif key and s.get("per_node_median") is not None:
        lines.append(f"no straggler: every node at or above {s['straggler_ratio']:g} x the median "
                     f"{s['per_node_median']:.3g} ({key})")
    elif per_node and record.kind == "comm":
        lines.append("per-node busbw not measured (add --per-node to compare nodes)")
    if s.get("nodes_without_result"):
        lines.append(f"no result from: {', '.join(s['nodes_without_result'])}")
    if stored:
        lines.append(f"stored as {stored}")
    return "\n".join(lines)
