"""`mleng doctor`: run the checks and quick measurements and say what is wrong, with the numbers."""

from __future__ import annotations

import argparse
import json
import sys

from mleng.cli.render import print_json
from mleng.errors import EXIT_OK, EXIT_PROBLEM, UsageError

MARK = {"fail": "FAIL", "warn": "WARN", "ok": "ok", "inconclusive": "??", "skipped": "--"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    tier = parser.add_mutually_exclusive_group()
    tier.add_argument("--quick", action="store_true", help="preflight: about 30 s, the smallest measurements")
    tier.add_argument("--full", action="store_true", help="deep run: larger sweeps, every collective, more storage")
    parser.add_argument("--expect-gpus", type=int, help="GPUs this node must have (default: from SLURM/torchrun env)")
    parser.add_argument("--checkpoint-dir", help="where checkpoints go: free space, inodes, write speed (default: .)")
    parser.add_argument("--no-measure", action="store_true", help="checks only, no measurements")
    parser.add_argument("--fingerprint", metavar="FILE.json",
                        help="diagnose a recorded fingerprint (`mleng env --json` from another node) instead of "
                             "this machine; implies --no-measure")
    parser.add_argument("--cpus", metavar="LIST",
                        help="the CPUs the job's rank will be bound to (e.g. 0-55,112-167), for the NUMA check; "
                             "default: SLURM's --cpu-bind, else the binding this process inherited")
    parser.add_argument("--since", metavar="WHEN",
                        help="kernel-log window: 'boot' (default), a duration back from now (30m, 2h, 1d) or a "
                             "date-time (2026-12-01T10:00)")
    parser.add_argument("--kernel-log", metavar="FILE",
                        help="judge a saved kernel log (dmesg, dmesg -T, journalctl -k, syslog) instead of this "
                             "machine's: the log of a node diagnosed with --fingerprint")
    parser.add_argument("--burn", metavar="DURATION",
                        help="also burn in: sustained bf16 matmuls on every GPU for DURATION (90s, 10m, 1h), results "
                             "checked bitwise and against a float64 tile, TFLOPS drift, clocks and temperature")
    parser.add_argument("--report", metavar="FILE.html", help="also write a self-contained HTML report")
    parser.add_argument("--no-store", action="store_true", help="do not save the doctor run in the results store")


def _load_fingerprint(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read fingerprint {path}: {exc}", hint="pass the output of `mleng env --json`")
    if not isinstance(data, dict) or "gpus" not in data:
        raise UsageError(f"{path} is not an mleng fingerprint (no 'gpus' section)",
                         hint="pass the output of `mleng env --json`")
    from mleng.machine.fingerprint import without_annotations

    return without_annotations(data.get("machine", data) if "schema" in data
                               and str(data["schema"]).startswith("mleng.measurement") else data)


def _linked_measurements(record) -> list:
    """The stored records of the measurements this doctor run made, for the report's plots."""
    from mleng.errors import MlengError
    from mleng.results.store import Store

    linked = []
    with Store(create=False) as store:
        if not store.exists:
            return linked
        for measurement_id in (record.summary.get("measurements") or {}).values():
            try:
                linked.append(store.get(measurement_id))
            except MlengError:
                continue  # a measurement that was not stored (it failed before saving) has no plot
    return linked


def run(args: argparse.Namespace) -> int:
    from mleng.cli.common import exit_code_for
    from mleng.errors import MlengError

    progress = None if args.json else (lambda text: print(f"... {text}", file=sys.stderr, flush=True))
    record, stored, report, report_note = diagnose(args, progress)
    if report is not None:
        from mleng.report.html import write_report

        try:
            write_report([record] + _linked_measurements(record), str(report), title="mleng doctor report")
        except (OSError, MlengError) as exc:  # the folder vanished meanwhile: the findings still print
            report_note = None
            print(f"mleng doctor: warning: no report written: {exc}", file=sys.stderr)
    if args.json:
        print_json(record.to_dict())
    else:
        print(render(record, stored))
        if report is not None and report_note is not None:
            print(f"report: {report}{report_note}")
    if record.status == "interrupted":
        return exit_code_for(record)
    return EXIT_PROBLEM if record.summary["verdict"] == "fail" else EXIT_OK


def diagnose(args: argparse.Namespace, progress=None):
    """The doctor run without the report and the printing: the inputs checked before it, the record stored
    unless --no-store. Returns (record, stored id or None, report path or None, its replacing note);
    `record.to_dict()` is what `mleng doctor --json` prints."""
    from mleng.doctor.runner import run_doctor

    import os

    from mleng.cli.common import check_output_path, preflight_store, replacing_note, store_or_warn

    tier = "quick" if args.quick else ("full" if args.full else "default")
    # Everything the user typed is checked before the run, which takes minutes.
    if args.expect_gpus is not None and args.expect_gpus < 0:
        raise UsageError(f"--expect-gpus {args.expect_gpus}: a GPU count cannot be negative")
    if args.checkpoint_dir is not None:
        if not args.checkpoint_dir.strip():
            raise UsageError("--checkpoint-dir is empty", hint="give the folder where checkpoints go")
        if not os.path.exists(args.checkpoint_dir):
            raise UsageError(f"--checkpoint-dir {args.checkpoint_dir} does not exist",
                             hint="check the spelling; give the folder the job writes its checkpoints to")
        if not os.path.isdir(args.checkpoint_dir):
            raise UsageError(f"--checkpoint-dir {args.checkpoint_dir} is not a folder")
        if args.fingerprint:
            raise UsageError("--checkpoint-dir checks this machine's disk; --fingerprint diagnoses another node",
                             hint="run the doctor on that node for its checkpoint disk")
    if args.cpus is not None:
        from mleng.machine.system import parse_cpulist

        try:
            if not parse_cpulist(args.cpus):
                raise ValueError
        except ValueError:
            raise UsageError(f"--cpus {args.cpus!r} is not a CPU list", hint="write it as the kernel does: 0-55,112-167") from None
    if args.since is not None:
        from mleng.machine.kernel_log import parse_since

        try:
            parse_since(args.since)
        except ValueError as exc:
            raise UsageError(f"--since {exc}", hint="e.g. --since 2h, --since 1d, --since 2026-12-01T10:00") from None
    if args.kernel_log is not None:
        if not os.path.exists(args.kernel_log):
            raise UsageError(f"--kernel-log {args.kernel_log} does not exist",
                             hint="save a node's log with `sudo dmesg > FILE` or `journalctl -k -b > FILE`")
        if not os.path.isfile(args.kernel_log) or not os.access(args.kernel_log, os.R_OK):
            raise UsageError(f"--kernel-log {args.kernel_log} is not a readable file")
    burn_s = None
    if args.burn is not None:
        from mleng.doctor.burn import parse_duration

        try:
            burn_s = parse_duration(args.burn)
        except ValueError as exc:
            raise UsageError(f"--burn {exc}", hint="e.g. --burn 10m") from None
        if args.fingerprint:
            raise UsageError("--burn runs on this machine's GPUs; --fingerprint diagnoses another node",
                             hint="run the doctor with --burn on that node")
    report = check_output_path(args.report, "--report", (".html", ".htm"))
    report_note = replacing_note(report)
    fingerprint = _load_fingerprint(args.fingerprint) if args.fingerprint else None
    preflight_store(args)
    record = run_doctor(tier=tier, expect_gpus=args.expect_gpus, checkpoint_dir=args.checkpoint_dir,
                        measure=not (args.no_measure or args.fingerprint), fingerprint=fingerprint,
                        on_step=progress, local=fingerprint is None, cpus=args.cpus, since=args.since,
                        kernel_log_path=args.kernel_log, burn_s=burn_s)
    return record, store_or_warn(record, args), report, report_note


def _collapse_per_gpu(rows: list[dict]) -> list[dict]:
    """One line for a check that is ok (or not applicable) on every GPU, instead of one per GPU."""
    out, folded = [], {}
    rows = _collapse_same_detail(rows)
    for row in rows:
        per_gpu = str(row.get("subject") or "").startswith("gpu ")
        if per_gpu and row["severity"] in ("ok", "skipped"):
            key = (row["check"], row["severity"])
            if key not in folded:
                folded[key] = {**row, "members": []}
                out.append(folded[key])
            folded[key]["members"].append(row)
            continue
        out.append(row)
    for row in folded.values():
        members = row.pop("members")
        if len(members) == 1:
            continue
        gpus = ", ".join(m["subject"].split(" ")[1] for m in members)
        details = {m["summary"].split(": ", 1)[-1] for m in members}
        if len(details) == 1:
            row["summary"] = f"{len(members)} GPUs ({gpus}): {details.pop()}"
        else:
            measured = [m["measured"] for m in members if isinstance(m.get("measured"), (int, float))]
            spread = f"; measured {min(measured):.4g}-{max(measured):.4g}" if measured else ""
            expected = f" (expected {members[0]['expected']})" if members[0].get("expected") is not None else ""
            row["summary"] = f"{len(members)} GPUs ({gpus}) {row['severity']}{spread}{expected}"
    return out


def _collapse_same_detail(rows: list[dict]) -> list[dict]:
    """One line for ok InfiniBand ports that read the same ('8 ports (mlx5_0 port 1, ...) (InfiniBand): ACTIVE at ...')."""
    out, folded = [], {}
    for row in rows:
        subject = str(row.get("subject") or "")
        prefix = f"{subject} ("
        if row["check"] == "ib_port" and row["severity"] == "ok" and row["summary"].startswith(prefix):
            layer_and_detail = row["summary"][len(subject):]
            key = (row["check"], layer_and_detail)
            if key not in folded:
                folded[key] = {**row, "members": []}
                out.append(folded[key])
            folded[key]["members"].append(subject.split(" (")[0])
            continue
        out.append(row)
    for (_check, detail), row in folded.items():
        members = row.pop("members")
        if len(members) > 1:
            row["summary"] = f"{len(members)} ports ({', '.join(members)}){detail}"
    return out


def render(record, stored: str | None = None) -> str:
    machine = record.machine
    gpus = machine.get("gpus") or {}
    host = (machine.get("host") or {}).get("hostname", "?")
    gpu_text = (f"{gpus.get('count', len(gpus.get('devices') or []))} GPU(s)" if gpus.get("available")
                else f"no GPU ({gpus.get('reason', 'unknown')})")
    lines = [f"mleng doctor ({record.params['tier']}) on {host}: {gpu_text}", ""]
    for row in _collapse_per_gpu(record.rows):
        lines.append(f"[{MARK[row['severity']]:>4}] {row['check']:<16} {row['summary']}")
        if row["severity"] in ("fail", "warn"):
            if row.get("cause"):
                lines.append(f"{'':23}likely cause: {row['cause']}")
            if row.get("handbook"):
                lines.append(f"{'':23}read: " + ", ".join(f"mleng handbook show {h}" for h in row["handbook"][:3]))
    counts = record.summary["counts"]
    if record.status == "interrupted":
        lines += ["", f"{record.error}"]
    lines += ["", f"verdict: {record.summary['verdict'].upper()}  ({counts['fail']} fail, {counts['warn']} warn, "
              f"{counts['ok']} ok, {counts['inconclusive']} inconclusive, {counts['skipped']} not applicable)",
              f"stored as {stored} (mleng results show {stored})" if stored else "not stored"]
    return "\n".join(lines)
