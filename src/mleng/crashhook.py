"""The crash hook: after an uncaught exception's own traceback, the handbook entries that explain it.

`mleng.install_crash_hook()` (or `with mleng.crash_hook():`, or `python -m mleng.run train.py ...` for a
script one cannot edit, also as torchrun's entry: `torchrun ... -m mleng.run train.py`) wraps sys.excepthook.
On a crash the original hook prints the original traceback first, unchanged; then, when the handbook has a
confident answer, a short note: the entry, why it happens, the fix, `mleng handbook show ID`. Nothing at
all when no entry is confident, when the lookup fails (a broken index) or for Ctrl-C and SystemExit. The
exit code is the interpreter's, as without the hook. It costs nothing until a crash: the handbook is only
opened then.

Under torchrun or srun every rank usually dies of the same error: the note is printed once per distinct
error per host (the first rank to get there claims it with a marker file). When the hooked process is
torchrun itself (`python -m mleng.run -m torch.distributed.run ...`), the ChildFailedError it ends with is
explained from the ranks' torchelastic error files (which `@record` on the ranks' main function writes).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import tempfile
import traceback
from types import TracebackType
from typing import Any, Callable, Iterator

MAX_SHOWN = 3
# Frames of the wrapper (python -m mleng.run) at the head of a traceback: stripped, so the traceback
# reads as it would have without the wrapper.
_WRAPPER_FILES = ("runpy.py", "<frozen runpy>", os.path.join("mleng", "run.py"))

_previous: Callable[..., Any] | None = None


def install_crash_hook() -> None:
    """Explain uncaught exceptions with the handbook, after their own traceback; idempotent.

    Example:
        >>> import mleng
        >>> mleng.install_crash_hook()   # first thing in train.py
    """
    global _previous
    if getattr(sys.excepthook, "_mleng_crash_hook", False):
        return
    _previous = sys.excepthook
    sys.excepthook = _hook


def uninstall_crash_hook() -> None:
    """Put back the excepthook that was there before install_crash_hook()."""
    global _previous
    if getattr(sys.excepthook, "_mleng_crash_hook", False):
        sys.excepthook = _previous or sys.__excepthook__
    _previous = None


@contextlib.contextmanager
def crash_hook() -> Iterator[None]:
    """The crash hook for a block: an exception that escapes it (and the program) is explained after its
    traceback; one caught later is not. Without an exception the previous excepthook is back afterwards.

    Example:
        >>> with mleng.crash_hook():
        ...     train()
    """
    installed_here = not getattr(sys.excepthook, "_mleng_crash_hook", False)
    install_crash_hook()
    try:
        yield
    except BaseException:
        raise  # the hook stays for the interpreter's report of this exception
    else:
        if installed_here:
            uninstall_crash_hook()


def _hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    previous = _previous or sys.__excepthook__
    shown = _without_wrapper(tb)
    if shown is not tb and isinstance(value, BaseException):
        value.__traceback__ = shown  # the default hook prints the exception's own traceback
    previous(kind, value, shown)
    restore = _exit_as_uncaught_on_sigterm()
    try:
        note = explain(value)
    except BaseException:  # noqa: BLE001 - the hook must never add a failure of its own
        note = None
    finally:
        restore()
    if note:
        try:
            sys.stderr.write(note + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass


_hook._mleng_crash_hook = True  # type: ignore[attr-defined]


def _exit_as_uncaught_on_sigterm() -> Callable[[], None]:
    """While the handbook is searched, a SIGTERM (torchrun stopping the other ranks once one has exited) ends
    the process with 1, the code of the uncaught exception it is reporting, not with the signal's: the note
    is given up, the exit code stays what it would have been without the hook."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        try:
            sys.stderr.flush()
        finally:
            os._exit(1)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):
        return lambda: None
    return lambda: signal.signal(signal.SIGTERM, previous)


def _without_wrapper(tb: TracebackType | None) -> TracebackType | None:
    head = tb
    while head is not None and head.tb_frame.f_code.co_filename.endswith(_WRAPPER_FILES):
        head = head.tb_next
    return head if head is not None else tb


def error_text(value: BaseException) -> str:
    """What is looked up: the exception's own lines ('RuntimeError: ...') and those of its causes. Not the
    source lines of the traceback: the script's own words ('step', 'model') make unrelated entries look
    confident."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = value
    while current is not None and id(current) not in seen and len(parts) < 4:
        seen.add(id(current))
        parts.append("".join(traceback.format_exception_only(type(current), current)).strip())
        current = current.__cause__ or current.__context__
    return "\n".join(reversed(parts))  # the root cause first, as a traceback prints them


def explain(value: BaseException) -> str | None:
    """The note for this exception, or None: not a crash (Ctrl-C, exit), no confident entry, or already
    printed by another rank of this job on this host."""
    if isinstance(value, (KeyboardInterrupt, SystemExit)):
        return None
    failed = _child_failure_texts(value)  # torchrun's own crash: what its ranks died of
    notes: dict[str, tuple[list[dict], list[str]]] = {}
    for text, ranks in (failed or {error_text(value): []}).items():
        matches = lookup(text)
        if not matches:
            continue
        # ranks fail with texts that differ (recv/send, their rank, a pid) but the same explanation
        key = " ".join(m["id"] for m in matches)
        notes.setdefault(key, (matches, []))[1].extend(ranks)
    shown = [render(matches, _ranks_label(ranks) if failed else _rank_label())
             for key, (matches, ranks) in notes.items() if _first_on_this_host(key)]
    return "\n".join(shown) or None


def _ranks_label(ranks: list[str]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}"


def lookup(text: str) -> list[dict]:
    """The confident handbook matches for an error text, best first (at most MAX_SHOWN)."""
    from mleng.handbook.search import MAX_QUERY_CHARS, ask

    answer, _skipped = ask(text[-MAX_QUERY_CHARS:], limit=MAX_SHOWN)
    return [r for r in answer["results"] if r["confident"]]


def _rank_label() -> str:
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID")
    world = os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS")
    return f"rank {rank} of {world}" if rank is not None and world else ""


def render(matches: list[dict], who: str = "") -> str:
    best = matches[0]
    lines = [f"mleng: the handbook knows this error{f' ({who})' if who else ''}: {best['id']}: {best['title']}",
             f"  why: {best['cause']}"]
    fixes = [str(f).strip().replace("\n", "\n         ") for f in best.get("fix") or []]
    if fixes:
        lines.append("  fix: - " + fixes[0])
        lines.extend(f"       - {f}" for f in fixes[1:3])
    lines.append(f"  more: mleng handbook show {best['id']}")
    for other in matches[1:]:
        lines.append(f"  also possible: {other['id']}: {other['title']}  (mleng handbook show {other['id']})")
    return "\n".join(lines)


def _job_key() -> str | None:
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', '')}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT") and env.get("WORLD_SIZE"):
        return f"env-{env['MASTER_ADDR']}-{env['MASTER_PORT']}"
    return None


def _first_on_this_host(explanation: str) -> bool:
    """True for the first rank of this job on this host to give this explanation; always True outside a job."""
    key = _job_key()
    if key is None:
        return True
    digest = hashlib.sha256(explanation.encode()).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"mleng-crash-{os.getuid()}", re.sub(r"[^\w.-]", "_", key))
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, digest), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    except FileExistsError:
        return False
    except OSError:
        return True  # no shared temp folder: say it rather than stay silent


def _child_failure_texts(value: BaseException) -> dict[str, list[str]]:
    """torchrun's ChildFailedError: each failed rank's message from its torchelastic error file -> its ranks."""
    failures = getattr(value, "failures", None)
    if type(value).__name__ != "ChildFailedError" or not isinstance(failures, dict):
        return {}
    texts: dict[str, list[str]] = {}
    for rank, failure in sorted(failures.items()):
        message = _error_file_message(getattr(failure, "error_file", None))
        if message:
            texts.setdefault(message, []).append(str(rank))
    return texts


def _error_file_message(path: str | None) -> str | None:
    """The exception text torchelastic's error handler wrote: {"message": {"message": ..., "extraInfo": ...}}."""
    if not path or not os.path.isfile(path):
        return None
    import json

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    message = data.get("message")
    if isinstance(message, dict):
        message = message.get("message")
    return message if isinstance(message, str) and message.strip() else None
