"""What multi-rank commands (comm, check, step) share: spawn local ranks when launched plainly, else be one
rank; and the rank session: join, signals, the record finished and stored by rank 0, teardown."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable

from mleng import signals
from mleng.distributed.launch import Launch, default_nproc, detect, strip_nproc
from mleng.distributed.spawn import spawn_local
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
        if launch.rank == 0:  # rank 0 speaks for the job: one message, not one per rank
            print(f"mleng {command}: interrupted by {signals.describe()}", file=sys.stderr)
        _end_now(signals.exit_code())


def _end_now(code: int) -> None:
    """End an interrupted rank here, as the signal's default action would, once its record is stored and its
    group torn down. A collective cut short leaves gloo or NCCL work in flight whose tensors the interpreter's
    own exit then frees from a worker thread, which can abort the rank with SIGABRT ('terminate called without
    an active exception'; pytorch/pytorch PR 179291 describes it)."""
    import os

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


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


class RankSession:
    """One rank of a multi-rank command. Ctrl-C and SIGTERM become the record's status (StopSignals), the job is
    joined with short timeouts, and on rank 0 the record is fingerprinted, completed by the command's library
    function, stored (unless no_store) and reported, all before teardown, which can hang when a peer is gone.
    comm, check and step run in one.

        session = RankSession(launch, "check", params, backend=None, timeout_s=60)
        with session.running(complete, report):   # complete(record, job, status, error); report(session)
            job = session.join()
            ...
    """

    def __init__(self, launch: Launch, kind: str, params: dict[str, Any], *, backend: str | None,
                 timeout_s: float, no_store: bool = False, interrupted: str = "interrupted (Ctrl-C)",
                 gpus: bool | None = None):
        from mleng.results.record import Measurement

        self.launch, self.params, self.backend, self.timeout_s = launch, params, backend, timeout_s
        self.no_store, self.interrupted = no_store, interrupted
        self.gpus = gpus  # fingerprint the GPUs; None: when the backend is NCCL
        self.is_root = launch.rank == 0
        self.record = Measurement.start(kind, params) if self.is_root else None
        self.job = None
        self.stored: str | None = None
        self.store_problem: str | None = None
        self.stop = StopSignals()

    def join(self):
        """Choose the backend and this rank's device, and join every rank within the timeout: the Job."""
        from mleng.distributed.group import choose_backend, join, pick_device
        from mleng.distributed.rankinfo import describe_rank

        backend, kind = choose_backend(self.backend)
        device = pick_device(self.launch, kind)
        self.job = join(self.launch, backend, device, self.timeout_s, info=describe_rank(self.launch, device),
                        params=self.params)
        return self.job

    @contextlib.contextmanager
    def running(self, complete: Callable[[Any, Any, str, str | None], None],
                report: Callable[["RankSession"], None]):
        from mleng.distributed.group import leave

        self.stop.__enter__()
        try:
            with self.stop.outcome(self.interrupted):
                yield self
        finally:
            if self.is_root:  # stored before teardown, which can hang when a peer is gone
                self._finish(complete, report)
            leave(self.job, self.launch.rank)
            self.stop.__exit__()

    def _finish(self, complete, report) -> None:
        from mleng.machine.fingerprint import collect_for_record

        record, status, error = self.record, self.stop.status, self.stop.error
        backend = self.job.backend if self.job else (self.backend or "")
        record.machine = collect_for_record(gpus=backend == "nccl" if self.gpus is None else self.gpus)
        record.finish(status, error)
        complete(record, self.job, status, error)  # may finish it again with another status (step: none timed)
        if not self.no_store:
            from mleng.results.store import save_or_reason

            self.stored, self.store_problem = save_or_reason(record)
        report(self)
