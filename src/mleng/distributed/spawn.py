"""Run a command as N local ranks (the plain launch): one subprocess per rank, watched until all end."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

from mleng.distributed.launch import SPAWNED_ENV, free_port


@dataclasses.dataclass
class RankExit:
    rank: int
    pid: int
    returncode: int          # negative: killed by that signal (subprocess convention)
    stopped_by_us: bool = False

    def describe(self) -> str:
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            how = f"was killed by {name}"
            if self.stopped_by_us:
                how += " (stopped by mleng after another rank failed)"
            return f"rank {self.rank} (pid {self.pid}) {how}"
        return f"rank {self.rank} (pid {self.pid}) exited with code {self.returncode}"


@dataclasses.dataclass
class SpawnResult:
    exits: list[RankExit]
    first_failure: RankExit | None
    interrupted: bool = False

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            from mleng import signals

            return signals.exit_code()
        if self.first_failure is None:
            return 0
        rank0 = self.exits[0].returncode
        # Rank 0 has already said what went wrong and chosen the code (1 problem, 2 usage);
        # a rank killed by a signal is always a problem found.
        return rank0 if rank0 in (1, 2) else 1

    def failures(self) -> list[str]:
        """One line per rank that did not end cleanly, the first failure first."""
        bad = [e for e in self.exits if e.returncode != 0]
        bad.sort(key=lambda e: (e is not self.first_failure, e.rank))
        return [e.describe() for e in bad]


def spawn_local(argv: list[str], nproc: int, grace_s: float = 15.0,
                extra_env: dict[str, str] | None = None) -> SpawnResult:
    """Start `python -m mleng ARGV` as ranks 0..nproc-1 on this host and wait for all of them.

    Rank 0 keeps this terminal's stdout and stderr; the other ranks' stderr is prefixed with their rank.
    When one rank fails, the others get grace_s to notice and report (their own timeouts fire well
    inside it), then SIGTERM, then SIGKILL: the job never outlives its first failure by much.
    """
    port = free_port()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    base_env = dict(os.environ)
    base_env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N ranks must not each take every core
    base_env.update(extra_env or {})
    for rank in range(nproc):
        env = dict(base_env, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   **{SPAWNED_ENV: "1"})
        proc = subprocess.Popen([sys.executable, "-m", "mleng", *argv], env=env,
                                stderr=None if rank == 0 else subprocess.PIPE)
        procs.append(proc)
        if rank:
            pump = threading.Thread(target=_prefix_lines, args=(proc.stderr, f"[rank {rank}] "), daemon=True)
            pump.start()
            pumps.append(pump)
    return _watch(procs, pumps, grace_s)


def _prefix_lines(stream, prefix: str) -> None:
    for raw in iter(stream.readline, b""):
        sys.stderr.write(prefix + raw.decode(errors="replace"))
        sys.stderr.flush()
    stream.close()


def _watch(procs: list[subprocess.Popen], pumps: list[threading.Thread], grace_s: float) -> SpawnResult:
    first_failure: RankExit | None = None
    exits: dict[int, RankExit] = {}
    stop_at: float | None = None
    killed_at: float | None = None
    stopped: set[int] = set()
    interrupted = False
    previous_term = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):  # a scheduler stopping us stops the ranks too
        from mleng import signals

        if signals.received is None:
            signals.received = signum
            raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    try:
        while len(exits) < len(procs):
            try:
                for rank, proc in enumerate(procs):
                    if rank in exits or proc.poll() is None:
                        continue
                    exits[rank] = RankExit(rank, proc.pid, proc.returncode, stopped_by_us=rank in stopped)
                    if proc.returncode != 0 and first_failure is None and rank not in stopped:
                        first_failure = exits[rank]
                        stop_at = time.monotonic() + grace_s
                now = time.monotonic()
                if stop_at is not None and now >= stop_at and killed_at is None:
                    for rank, proc in enumerate(procs):
                        if rank not in exits:
                            stopped.add(rank)
                            proc.terminate()
                    killed_at = now
                if killed_at is not None and now >= killed_at + 5:
                    for rank, proc in enumerate(procs):
                        if rank not in exits:
                            proc.kill()
                time.sleep(0.05)
            except KeyboardInterrupt:
                # Ranks started from a terminal got the same SIGINT; forward it for those that did not,
                # then give them the grace period to save what they measured.
                from mleng import signals

                interrupted = True
                for rank, proc in enumerate(procs):
                    if rank not in exits and proc.poll() is None:
                        proc.send_signal(signals.received or signal.SIGINT)  # the signal we got, named right
                if stop_at is None or stop_at > time.monotonic() + grace_s:
                    stop_at = time.monotonic() + grace_s
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous_term)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for pump in pumps:
            pump.join(timeout=2)
    ordered = [exits[r] for r in range(len(procs))]
    if first_failure is None and not interrupted:
        first_failure = next((e for e in ordered if e.returncode != 0), None)
    return SpawnResult(ordered, first_failure, interrupted)
