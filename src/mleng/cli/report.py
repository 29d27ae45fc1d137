"""`mleng report`: a self-contained HTML page of stored runs."""

from __future__ import annotations

import argparse

from mleng.cli.render import print_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ids", nargs="+", metavar="RUN_ID", help="stored run ids (or unique prefixes, or 'last')")
    parser.add_argument("-o", "--output", default="mleng-report.html", help="HTML file to write")
    parser.add_argument("--title", default="mleng report")


def run(args: argparse.Namespace) -> int:
    from mleng.cli.common import check_output_path, replacing_note
    from mleng.report.html import write_report
    from mleng.results.store import Store

    target = check_output_path(args.output, "-o/--output", (".html", ".htm"))
    note = replacing_note(target)
    with Store(create=False) as store:
        measurements = [store.get(i) for i in args.ids]
    path = write_report(measurements, target, args.title)
    if args.json:
        print_json({"report": str(path), "runs": [m.id for m in measurements], "replaced": bool(note)})
    else:
        print(f"wrote {path}{note} ({len(measurements)} run(s), {path.stat().st_size / 1024:.0f} KiB)")
    return 0
