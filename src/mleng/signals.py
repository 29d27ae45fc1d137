"""SIGINT and SIGTERM end a long run the same way: KeyboardInterrupt, the signal named, exit 128+signal."""

from __future__ import annotations

import signal
import threading

# The signal that stopped this process's run, if any: what `scancel` and Kubernetes send first is SIGTERM.
received: int | None = None

_NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


def _handler(signum, frame):
    global received
    if received is not None:
        return  # one interruption is enough: repeats (a launcher forwarding the signal) must not cut cleanup short
    received = signum
    raise KeyboardInterrupt


def install() -> None:
    """Route SIGINT and SIGTERM to one KeyboardInterrupt; a no-op off the main thread."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _handler)


def describe(default: int = signal.SIGINT) -> str:
    """'Ctrl-C (SIGINT)' or 'SIGTERM': the name of what interrupted the run."""
    signum = received if received is not None else default
    return _NAMES.get(signum, signal.Signals(signum).name)


def exit_code(default: int = signal.SIGINT) -> int:
    """128 + the signal's number, as shells report a process ended by it."""
    return 128 + int(received if received is not None else default)
