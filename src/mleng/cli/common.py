"""What every measuring command does with its record at the end: store, print, exit code."""

from __future__ import annotations

import argparse
from typing import Callable

from mleng.cli.render import print_json

EXIT_INTERRUPTED = 130


def store_print_exit(measurement, args: argparse.Namespace, render: Callable[[object], str]) -> int:
    """Store unless --no-store, print (--json: the record), and return 0, 1 (failed) or 130 (Ctrl-C)."""
    if not getattr(args, "no_store", False):
        from mleng.results.store import save_measurement

        save_measurement(measurement)
    if args.json:
        print_json(measurement.to_dict())
    else:
        print(render(measurement))
    if measurement.status == "interrupted":
        return EXIT_INTERRUPTED
    return 0 if measurement.status == "complete" else 1
