"""One process per device, all at once: how a benchmark runs on every local GPU (`--all-devices`)."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from typing import Any, Callable

from mleng.errors import MlengError

# How long the children get to hand back what they measured after a stop signal, before they are killed.
STOP_GRACE_S = 30.0
# The longest a child waits at sync() for the others; past it the barrier breaks and the run fails.
SYNC_TIMEOUT_S = 600.0
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
# A child's report when a peer broke the barrier: the parent, which knows whether it sent a stop, settles it.
_PEER_STOPPED = "peer-stopped"

# target(device, args, sync, send) -> result, run in the child; sync() waits for every device,
# send(payload) streams one message to the parent.
Target = Callable[[str, Any, Callable[[], None], Callable[[Any], None]], Any]


@dataclasses.dataclass
class DeviceOutcome:
    """How one device's process ended, with everything it streamed before that."""

    index: int
    device: str
    status: str | None = None   # complete | interrupted | failed
    result: Any = None          # the target's return value (None unless it returned)
    error: str | None = None
    messages: list[Any] = dataclasses.field(default_factory=list)


class SyncBroken(MlengError):
    """sync() cannot bring the devices together any more: another one failed, or the wait timed out."""


class PeerStopped(SyncBroken):
    """sync() found the barrier broken by another device that stopped or failed."""


def run_per_device(target: Target, devices: list[str], *, args: Any = None,
                   on_message: Callable[[int, Any], None] | None = None, grace_s: float = STOP_GRACE_S,
                   sync_timeout_s: float = SYNC_TIMEOUT_S) -> list[DeviceOutcome]:
    """Run target once per device, each in its own spawned process, all at the same time; the outcomes
    in device order.

    on_message(index, payload) is called, in arrival order, from a reader thread of this process.
    SIGINT or SIGTERM here (named for the CLI as mleng.signals does) sends the same signal once to every
    child still running; each gets grace_s to return what it has ("interrupted") before it is killed.
    A child that fails ("failed", its message or its exit code) or stops breaks the barrier, so no other waits.
    """
    import multiprocessing as mp

    from mleng.distributed.runner import StopSignals

    context = mp.get_context("spawn")
    barrier = context.Barrier(len(devices))
    # One pipe per child, written synchronously: a row sent before a crash has reached us.
    pipes = [context.Pipe(duplex=False) for _ in devices]
    processes = [context.Process(target=_child, args=(i, d, target, args, barrier, pipes[i][1], sync_timeout_s),
                                 daemon=True, name=f"mleng-{d}-{i}") for i, d in enumerate(devices)]
    state = _Collection(devices, processes, [reader for reader, _ in pipes], barrier, on_message, grace_s)
    collector = threading.Thread(target=state.collect, name="mleng-fanout-reader", daemon=True)
    collector.start()
    with StopSignals():
        try:
            # Children start with the stop signals blocked (the mask is inherited) and unblock them once
            # their handler is in place: a Ctrl-C while one is still importing waits for it, not kills it.
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
            try:
                for process in processes:
                    process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
                for _, writer in pipes:
                    writer.close()  # the child holds its own end; its exit is our end of file
            # An Event, not collector.join(): a Ctrl-C inside Thread.join marks the thread stopped (CPython 3.11).
            while not state.done.wait(0.25):
                pass
        except KeyboardInterrupt:
            state.stop()
            state.done.wait(grace_s)
        finally:
            state.kill_stragglers()
            state.done.wait(5.0)
            state.finish()
    if state.callback_error is not None:
        raise state.callback_error
    return state.outcomes


class _Collection:
    """The parent's side: the reader thread files every message under its device; the main thread stops
    and kills. Only the reader reads the pipes, so a Ctrl-C never lands in the middle of a message."""

    def __init__(self, devices, processes, readers, barrier, on_message, grace_s):
        self.outcomes = [DeviceOutcome(i, d) for i, d in enumerate(devices)]
        self.processes, self.readers, self.barrier = processes, readers, barrier
        self.on_message, self.grace_s = on_message, grace_s
        self.done = threading.Event()
        self.stopping = False
        self.killed: set[int] = set()
        self.callback_error: BaseException | None = None

    def cut_short(self) -> str:
        """The status of a device that ended without finishing: ours to stop, or its own failure."""
        return "interrupted" if self.stopping else "failed"

    def pending(self) -> list[int]:
        return [o.index for o in self.outcomes if o.status is None]

    def collect(self) -> None:
        from multiprocessing.connection import wait

        open_readers = dict(zip(self.readers, range(len(self.readers))))
        try:
            while open_readers and self.pending():
                for reader in wait(list(open_readers), timeout=0.2):
                    index = open_readers[reader]
                    try:
                        self._file(index, *reader.recv())
                    except EOFError:
                        del open_readers[reader]
                        reader.close()
                        if self.outcomes[index].status is None:
                            self._ended_silently(index)
        finally:
            self.done.set()

    def _file(self, index: int, kind: str, payload: Any) -> None:
        outcome = self.outcomes[index]
        if kind == "done":
            outcome.status, outcome.result, outcome.error = payload
            if outcome.status == _PEER_STOPPED:
                # A stop signal of ours can reach a child after the barrier it waits at broke.
                outcome.status = self.cut_short()
            return
        outcome.messages.append(payload)
        if self.on_message is not None and self.callback_error is None:
            try:
                self.on_message(index, payload)
            except Exception as exc:  # noqa: BLE001 - raised again in the caller's thread
                self.callback_error = exc

    def _ended_silently(self, index: int) -> None:
        outcome, process = self.outcomes[index], self.processes[index]
        if process.pid is None:
            outcome.status = self.cut_short()
            outcome.error = "its process did not start"
            return
        process.join(5.0)  # its pipe closed as it exited
        code = process.exitcode
        how = (f"exited with code {code}" if code is not None and code >= 0
               else f"was killed by {_signal_name(-code)}" if code is not None else "closed its pipe")
        if index in self.killed:
            outcome.status = "interrupted"
            outcome.error = f"did not stop within {self.grace_s:g} s of the stop signal, so it was killed"
        elif self.stopping:
            outcome.status, outcome.error = "interrupted", f"{how} after the stop signal"
        else:
            outcome.status, outcome.error = "failed", f"its process {how} without reporting"
            self.barrier.abort()  # it could not: the others must not wait for it

    def stop(self) -> None:
        """Ask every child still running to stop, with the signal this process received."""
        from mleng import signals

        self.stopping = True
        signum = signals.received or signal.SIGINT
        for index in self.pending():
            pid = self.processes[index].pid
            if pid is not None:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

    def kill_stragglers(self) -> None:
        for index in self.pending():
            process = self.processes[index]
            if process.pid is not None and process.exitcode is None:
                self.killed.add(index)
                process.kill()

    def finish(self) -> None:
        """Every process ended; an outcome the reader could not settle gets its reason here."""
        for process in self.processes:
            if process.pid is not None:
                process.join(5.0)
                if process.exitcode is None:  # reported, then hung on its way out
                    process.kill()
                    process.join(5.0)
        for index in self.pending():
            self.outcomes[index].status = self.cut_short()
            self.outcomes[index].error = "no report"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# --- the child ------------------------------------------------------------------------------------
def _child(index: int, device: str, target: Target, args: Any, barrier, pipe, sync_timeout_s: float) -> None:
    from mleng import signals

    def sync() -> None:
        started = time.monotonic()
        try:
            barrier.wait(timeout=sync_timeout_s)
        except threading.BrokenBarrierError:
            if time.monotonic() - started >= sync_timeout_s:
                raise SyncBroken(f"waited {sync_timeout_s:g} s for the other devices to reach the same point")
            # A peer stopped by Ctrl-C breaks the barrier; our own stop signal is then on its way and
            # makes this run "interrupted" rather than "failed".
            time.sleep(1.0)
            raise PeerStopped("stopped: another device stopped, so the devices can no longer run in step") from None

    def send(payload: Any) -> None:
        pipe.send(("message", payload))

    signals.install()  # SIGINT or SIGTERM: KeyboardInterrupt once, the signal named in the record
    status, result, error = "failed", None, None
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        result = target(device, args, sync, send)
        # A target that catches the interrupt itself (mamf keeps its best shape) returns what it has.
        status = "interrupted" if signals.received is not None else "complete"
    except KeyboardInterrupt:
        status = "interrupted"
    except PeerStopped as exc:
        status, error = _PEER_STOPPED, exc.message
    except MlengError as exc:
        error = exc.message
    except BaseException as exc:  # noqa: BLE001 - the parent reports it; a traceback here says less
        error = f"{type(exc).__name__}: {exc}"
    finally:
        # Nothing may interrupt the report on its way out.
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    if status != "complete":
        barrier.abort()  # no device waits for this one any more
    pipe.send(("done", (status, result, error)))
