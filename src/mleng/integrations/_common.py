"""What the framework callbacks share: their options, the preflight run once per process, the crash hook.

Framework-free on purpose: the callbacks (hf.py, lightning.py) add only the framework's base class and the
hook names the framework calls, so both behave the same and docs/api.md is written without either installed.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any


def require(module: str, extra: str, what: str) -> Any:
    """Import a framework for its callback, or raise one ImportError that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = (exc.name or module).split(".")[0]
        raise ImportError(f"{what} needs {missing}, which is not installed: pip install 'mleng[{extra}]'",
                          name=missing) from None


class MlengCallbackOptions:
    """The options of mleng's training callbacks and the two things they do at train start."""

    def __init__(self, *, preflight: bool = True, install_crash_hook: bool = True, timeout: float | None = None,
                 max_seconds: float | None = None, **preflight_options: Any) -> None:
        import mleng

        options = dict(preflight_options)
        if timeout is not None:
            options["timeout"] = timeout
        if max_seconds is not None:
            options["max_seconds"] = max_seconds
        try:  # a misspelt option fails where the callback is made, not an hour later at train start
            inspect.signature(mleng.preflight).bind(**options)
        except TypeError as exc:
            raise TypeError(f"{type(self).__name__}: {exc} (the options are mleng.preflight()'s: "
                            "timeout, max_seconds, probe_bytes, straggler_ratio, backend, quiet, no_store)") from None
        self.run_preflight = bool(preflight)
        self.install_hook = bool(install_crash_hook)
        self.preflight_options = options
        #: rank 0's preflight record (kind 'preflight'); None on the other ranks and before the preflight ran
        self.record: Any = None
        #: True once this callback's preflight has passed on this process
        self.preflight_done = False

    def _install_hook(self) -> None:
        if self.install_hook:
            import mleng

            mleng.install_crash_hook()  # idempotent: once per process, however many times it is asked

    def _start(self) -> None:
        """At train start: the hook, then the preflight (once per callback: a second train() call does not
        repeat it). PreflightError goes through on every rank, so the job stops before training."""
        self._install_hook()
        if not self.run_preflight or self.preflight_done:
            return
        import mleng

        self.record = mleng.preflight(**self.preflight_options)  # in the job's process group when it has one
        self.preflight_done = True
