"""What every measuring command shares: the store checked before the run, stored/printed/exit at the end,
and output paths checked before any work."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

from mleng.cli.render import print_json
from mleng.errors import MlengError, UsageError


def preflight_store(args: argparse.Namespace) -> None:
    """Unless --no-store: open and lock the store now, so an unusable one stops the run before it starts."""
    if getattr(args, "no_store", False):
        return
    from mleng.results.store import check_store_writable

    try:
        check_store_writable()
    except MlengError as exc:
        if "--no-store" not in (exc.hint or ""):
            exc.hint = (exc.hint + "; " if exc.hint else "") + "or pass --no-store to measure without storing"
        raise


def store_or_warn(measurement, args: argparse.Namespace, what: str = "result") -> str | None:
    """Save unless --no-store; a store that fails now is a warning on stderr, never a lost measurement."""
    if getattr(args, "no_store", False):
        return None
    from mleng.results.store import save_or_reason

    stored, problem = save_or_reason(measurement)
    warn_not_stored(problem, args, what)
    return stored


def warn_not_stored(problem: str | None, args: argparse.Namespace, what: str = "result") -> None:
    if problem:
        print(f"mleng {args.command}: warning: the {what} was not stored: {problem}", file=sys.stderr)


def print_rank_record(session, args: argparse.Namespace, render: Callable[[], str], what: str = "result") -> None:
    """Rank 0 of comm and check, once its session stored the record: the record under --json, else the
    command's rendering; a store problem as one warning."""
    if args.json:
        print_json(session.record.to_dict())
    else:
        print(render())
    warn_not_stored(session.store_problem, args, what)


def exit_code_for(measurement) -> int:
    """0 complete, 1 failed, 128+signal interrupted."""
    if measurement.status == "interrupted":
        from mleng import signals

        return signals.exit_code()
    return 0 if measurement.status == "complete" else 1


def store_print_exit(measurement, args: argparse.Namespace, render: Callable[[object], str]) -> int:
    """Store unless --no-store, print (--json: the record), and return the exit code."""
    stored = store_or_warn(measurement, args)
    if args.json:
        print_json(measurement.to_dict())
    else:
        print(render(measurement))
        if stored:
            print(f"stored as {stored} (mleng results show {stored})")
    return exit_code_for(measurement)


def selected(values: list[str] | None, default) -> list[str]:
    """--op values, repeated or comma-separated (the one selector flag of comm, membw and io); the default
    when the flag is absent, and an empty list (refused by the measurement) when it names nothing."""
    if values is None:
        return list(default)
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def check_output_path(path: str | None, flag: str, suffixes: tuple[str, ...] = ()) -> Path | None:
    """An output file the command will write, refused before any work when it cannot be written.
    A missing parent folder is an error (as with cp): mleng creates no folder the user did not name."""
    if path is None:
        return None
    if not path.strip():
        raise UsageError(f"{flag} is empty", hint=f"give a file name, e.g. {flag} out{suffixes[0] if suffixes else ''}")
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a folder", hint=f"give a file name inside it, e.g. {target / 'out'}"
                         + (suffixes[0] if suffixes else ""))
    if suffixes and not target.name.lower().endswith(suffixes):
        raise UsageError(f"{flag} {path!r}: give a {' or '.join(suffixes)} file name")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.exists():
        raise UsageError(f"{flag} {path}: the folder {parent} does not exist",
                         hint="create it first or choose an existing folder (mleng does not create folders)")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is not a folder", hint="choose a path inside an existing folder")
    # A real probe, not os.access: root passes access() on read-only mounts and on /proc.
    try:
        fd, probe = tempfile.mkstemp(prefix=".mleng-write-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write in the folder {parent} ({exc.strerror or exc})",
                         hint="choose a folder you can write to") from None
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{flag} {path} exists and is not writable by this user", hint="choose another file")
    return target


def replacing_note(target: Path | None) -> str:
    """' (replaced the existing file)' when the output was there before: overwriting is never silent."""
    return " (replaced the existing file)" if target is not None and target.exists() else ""
