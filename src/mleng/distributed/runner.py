"""The part comm and check share: spawn local ranks when launched plainly, else be one rank, with rank 0 recording."""

from __future__ import annotations

import contextlib

import sys
from typing import Callable

from mleng.distributed.launch import Launch, default_nproc, detect, strip_nproc
from mleng.distributed.spawn import spawn_local
from mleng import signals
from mleng.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, MlengError, UsageError




def run_as_ranks(command: str, argv: list[str], nproc: int | None, timeout_s: float,
                 rank_body: Callable[[Launch], int]) -> int:
    """Plain launch: spawn nproc ranks of this same command and report the ones that failed.
    Under torchrun, srun or RANK/WORLD_SIZE: run rank_body as this one rank."""
    launch = detect()
    if launch is None:
        from mleng.slurm.allocation import relaunch  # inside salloc/sbatch: srun over every node instead

        code = relaunch(command, argv, nproc)
        if code is not None:
            return code
        nproc = default_nproc() if nproc is None else nproc
        if nproc < 1:
            raise UsageError(f"--nproc {nproc} must be at least 1")
        result = spawn_local(strip_nproc(argv), nproc, grace_s=min(timeout_s, 30.0) + 5.0)
        failures = result.failures()
        # Rank 0 explains its own exit; the launcher speaks only of ranks that died or failed besides it.
        # After Ctrl-C or SIGTERM, a rank that ended with 128+signal ended cleanly: it kept its rows.
        clean = {0} | ({signals.exit_code(), EXIT_INTERRUPTED, EXIT_TERMINATED} if result.interrupted else set())
        others = [e for e in result.exits if e.returncode not in clean and (e.rank != 0 or e.returncode < 0)]
        if others:
            print(f"mleng {command}: {len(failures)} of {nproc} ranks did not end cleanly: "
                  + "; ".join(failures), file=sys.stderr)
        return result.exit_code
    if nproc and launch.rank == 0 and nproc != launch.world_size:
        print(f"mleng {command}: note: --nproc {nproc} ignored; the {launch.mode} launch has "
              f"{launch.world_size} ranks", file=sys.stderr)
    try:
        return rank_body(launch)
    except KeyboardInterrupt:
        if launch.rank != 0:
            return signals.exit_code()  # rank 0 speaks for the job: one message, not one per rank
        raise


def fingerprint(gpus: bool) -> dict:
    """Rank 0's machine fingerprint, never fatal: a record without one beats no record."""
    from mleng.machine.fingerprint import collect_for_record

    return collect_for_record(gpus=gpus)


def store_record(measurement, no_store: bool = False) -> tuple[str | None, str | None]:
    """Save on rank 0 unless --no-store; (id, None) or (None, why not): a store problem never hides the measurement."""
    if no_store:
        return None, None
    try:
        from mleng.results.store import save_measurement

        return save_measurement(measurement), None
    except MlengError as exc:
        return None, str(exc)


class StopSignals:
    """Ctrl-C or SIGTERM on a rank: raise KeyboardInterrupt once, then ignore repeats, so rank 0 can
    store what it measured ("interrupted") even though a launcher forwards the signal again."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}
        self.status, self.error = "complete", None

    @contextlib.contextmanager
    def outcome(self, interrupted_message: str):
        """Set status/error from how the body ends; the exception goes on to the caller."""
        try:
            yield self
        except KeyboardInterrupt:
            self.status, self.error = "interrupted", interrupted_message
            raise
        except MlengError as exc:
            # a peer that went down on the same Ctrl-C makes our collective fail: still an interruption
            if self.received:
                self.status, self.error = "interrupted", f"interrupted ({self.received}): {exc.message}"
                raise KeyboardInterrupt from None
            self.status, self.error = "failed", exc.message
            raise

    def _handler(self, signum, frame):
        import signal

        from mleng import signals

        self.received = signal.Signals(signum).name
        if signals.received is None:
            signals.received = signum  # so the CLI names the signal and exits 128+signal
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    def __enter__(self) -> "StopSignals":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
