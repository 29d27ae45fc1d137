"""`mleng triage`: scan a log (file or stdin) for known problems and name the entries that explain them."""

from __future__ import annotations

import argparse
import os
import sys

from mleng.errors import UsageError
from mleng.measure.sizes import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logfile", help="the log to scan, or '-' for stdin (any size; read as a stream)")


def run(args: argparse.Namespace) -> int:
    report = result(args)
    from mleng.cli.render import emit

    emit(args, report, render)
    return 1 if report["findings"] else 0


def result(args: argparse.Namespace, index=None) -> dict:
    """What `mleng triage --json` prints: {"source", "lines", "bytes", "elapsed_s", "findings"};
    `index`: an open handbook index to use instead of opening one (kept open by `mleng mcp`)."""
    from mleng.handbook.triage import NotText
    from mleng.cli.ask import warn_skipped
    from mleng.handbook.index import open_index
    from mleng.handbook.triage import Matcher, finding_to_dict, open_log, triage_compressed, triage_file

    # Bad input is refused before the index is opened (and perhaps built).
    if args.logfile == "-":
        _refuse_unless_text(sys.stdin.buffer.peek(8192)[:8192], "<stdin>")
    else:
        _check_log(args.logfile)
    opened = open_index() if index is None else index
    try:
        entries = [e.data for e in opened.entries]
        matcher = Matcher(entries, [e.anchors for e in opened.entries])
        skipped = opened.skipped
    finally:
        if index is None:
            opened.close()
    warn_skipped(skipped, "triage")
    source = "<stdin>" if args.logfile == "-" else args.logfile
    try:
        if args.logfile == "-":
            stream, kind = open_log(sys.stdin.buffer)
            scanned = triage_compressed(stream, matcher, kind)
        else:
            scanned = triage_file(args.logfile, matcher)
    except NotText as exc:
        raise UsageError(f"{source} is not a text log: {exc}",
                         hint="pass the job's text log (plain, .gz, .xz, .bz2 or .zst)") from None
    except OSError as exc:
        if os.path.isdir(args.logfile):
            raise UsageError(f"{args.logfile} is a directory", hint="pass a log file inside it") from None
        raise UsageError(f"cannot read {args.logfile}: {exc.strerror or exc}",
                         hint="pass a readable log file, or '-' to read stdin") from None
    entries_by_id = {e["id"]: e for e in entries}
    findings = [finding_to_dict(f, entries_by_id) for f in scanned.findings]
    return {"source": source, "lines": scanned.lines, "bytes": scanned.bytes,
            "elapsed_s": round(scanned.elapsed_s, 3), "findings": findings}


def _check_log(path: str) -> None:
    if os.path.isdir(path):
        raise UsageError(f"{path} is a directory", hint="pass a log file inside it")
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}",
                         hint="pass a readable log file, or '-' to read stdin") from None
    _refuse_unless_text(head, path)


def _refuse_unless_text(head: bytes, name: str) -> None:
    """A compressed log is read through its decompressor; anything else must look like text."""
    from mleng.handbook.triage import NotText, check_text, compression

    if compression(head) is None:
        try:
            check_text(head)
        except NotText as exc:
            raise UsageError(f"{name} is not a text log: {exc}",
                             hint="pass the job's text log (plain, .gz, .xz, .bz2 or .zst)") from None


def render(report: dict) -> str:
    source, findings = report["source"], report["findings"]
    head = (f"{source}: {report['lines']:,} lines ({format_bytes(report['bytes'])}) scanned in "
            f"{report['elapsed_s']:.2f} s: "
            + (f"{len(findings)} known problem{'s' if len(findings) != 1 else ''} found"
               if findings else "no known problem found"))
    out = [head]
    for n, f in enumerate(findings, start=1):
        where = f"line {f['first_line']}" if f["count"] == 1 else \
            f"lines {f['first_line']}..{f['last_line']} ({f['count']} times)"
        who = []
        if f["ranks"]:
            who.append("ranks " + ",".join(f["ranks"]))
        if f["hosts"]:
            who.append("hosts " + ",".join(f["hosts"]))
        out.append("")
        out.append(f"{n}. {where}" + (f"; {'; '.join(who)}" if who else "") +
                   (" (more not listed)" if f["labels_truncated"] else ""))
        out.append(f"   {f['example']}")
        for rank, e in enumerate(f["entries"]):
            label = "   explained by: " if rank == 0 else "                 "
            out.append(f"{label}{e['id']}: {e['title']}")
        first = f["entries"][0]
        out.append(f"   why: {first['cause']}")
        out.append(f"   first check: {first['confirm'][0]}")
        out.append(f"   more: mleng handbook show {first['id']}")
    return "\n".join(out)
