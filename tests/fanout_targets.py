"""Targets for mleng.measure.fanout's tests: top-level (spawn imports them) and free of torch (fast to start).

Run as a script it is a parent that tests/test_fanout.py interrupts: `python fanout_targets.py DEVICE...`
prints "ready" once every device has streamed a row, then, after the stop signal, the outcomes as JSON,
and exits as the CLI does (128+signal when interrupted).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from mleng.errors import MlengError


def echo(device, args, sync, send):
    for step in range(3):
        send({"device": device, "step": step})
    return {"device": device, "args": args}


def arrive_sync_pass(device, args, sync, send):
    """Device cpu:N sleeps N * args seconds, then meets the others at the barrier."""
    time.sleep(int(device.split(":")[1]) * args)
    arrived = time.time()
    sync()
    return {"arrived": arrived, "passed": time.time()}


def fail_or_wait(device, args, sync, send):
    """cpu:1 fails at once (raising, or dying when args says so); the others wait for it at the barrier."""
    if device == "cpu:1":
        send({"row": 1})
        if args == "exit":
            os._exit(3)
        raise MlengError("cpu:1 found a problem")
    sync()
    return "passed"


def stream_until_stopped(device, args, sync, send):
    """Rows in step until stopped. 'cpu:keeps' returns what it has on the interrupt (as mamf does);
    'cpu:stubborn' ignores it and is killed after the grace time; 'cpu:deaf' blocks the stop signals, as a
    child does whose signal arrives late, so only the broken barrier stops it; the others let the
    KeyboardInterrupt end them."""
    if device == "cpu:deaf":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    sent = []
    try:
        for step in range(100_000):
            sync()
            send({"device": device, "step": step})
            sent.append(step)
            time.sleep(0.02)
    except KeyboardInterrupt:
        if device == "cpu:stubborn":
            time.sleep(60)
        if device == "cpu:keeps":
            return {"rows": len(sent)}
        raise
    return None


def main(devices: list[str]) -> int:
    from mleng import signals
    from mleng.measure.fanout import run_per_device

    signals.install()  # as mleng's CLI does
    streamed: set[int] = set()

    def ready(index, payload):
        if index not in streamed:
            streamed.add(index)
            if len(streamed) == len(devices):
                print("ready", flush=True)

    outcomes = run_per_device(stream_until_stopped, devices, on_message=ready, grace_s=2.0)
    print(json.dumps([o.__dict__ for o in outcomes]), flush=True)
    if any(o.status == "interrupted" for o in outcomes):
        return signals.exit_code()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
