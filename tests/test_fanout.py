"""mleng.measure.fanout: one real spawned process per device (here "cpu"), the barrier, failures and signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fanout_targets
from mleng.measure.fanout import run_per_device


def test_results_come_back_in_device_order_with_the_streamed_messages():
    received = []
    outcomes = run_per_device(fanout_targets.echo, ["cpu", "cpu", "cpu"], args={"size": 7},
                              on_message=lambda index, payload: received.append((index, payload["step"])))
    assert [(o.index, o.device, o.status, o.error) for o in outcomes] == [
        (0, "cpu", "complete", None), (1, "cpu", "complete", None), (2, "cpu", "complete", None)]
    assert all(o.result == {"device": "cpu", "args": {"size": 7}} for o in outcomes)
    assert all([m["step"] for m in o.messages] == [0, 1, 2] for o in outcomes)
    for index in range(3):  # every message reached on_message, each device's in the order it sent them
        assert [step for i, step in received if i == index] == [0, 1, 2]


def test_sync_lets_no_device_pass_before_the_slowest_arrives():
    outcomes = run_per_device(fanout_targets.arrive_sync_pass, ["cpu:0", "cpu:1", "cpu:2"], args=1.0)
    assert [o.status for o in outcomes] == ["complete"] * 3
    arrived = [o.result["arrived"] for o in outcomes]
    passed = [o.result["passed"] for o in outcomes]
    assert max(arrived) - min(arrived) > 1.0  # the sleeps really differed
    assert min(passed) >= max(arrived)


@pytest.mark.parametrize("how, error", [("raise", "cpu:1 found a problem"),
                                        ("exit", "its process exited with code 3 without reporting")])
def test_a_failing_device_is_named_and_the_others_are_not_left_waiting(how, error):
    started = time.monotonic()
    outcomes = run_per_device(fanout_targets.fail_or_wait, ["cpu:0", "cpu:1", "cpu:2"], args=how,
                              sync_timeout_s=60)
    assert time.monotonic() - started < 20  # the barrier was broken, not timed out
    failed = outcomes[1]
    assert (failed.status, failed.error, failed.messages) == ("failed", error, [{"row": 1}])
    for waiting in (outcomes[0], outcomes[2]):
        assert waiting.status == "failed" and "another device stopped" in waiting.error


def interrupted_parent(devices: list[str], signum: int, settle_s: float = 0.0) -> tuple[int, list[dict], str]:
    """Start fanout_targets.py as a parent over devices, send it signum once every device has streamed a row
    (and settle_s more), and return its exit code, the outcomes it printed and its stderr."""
    script = Path(fanout_targets.__file__)
    process = subprocess.Popen([sys.executable, str(script), *devices],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert process.stdout.readline().strip() == "ready"
        time.sleep(settle_s)
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=20)
    finally:
        process.kill()
    assert process.returncode is not None and stdout, stderr
    return process.returncode, json.loads(stdout), stderr


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_keeps_every_devices_rows(signum, code):
    returncode, (plain, keeps, stubborn), stderr = interrupted_parent(
        ["cpu", "cpu:keeps", "cpu:stubborn"], signum, settle_s=0.3)
    assert returncode == code, stderr
    assert [o["status"] for o in (plain, keeps, stubborn)] == ["interrupted"] * 3
    assert plain["error"] is None and plain["result"] is None and len(plain["messages"]) >= 1
    assert keeps["error"] is None and keeps["result"]["rows"] == len(keeps["messages"]) >= 1
    assert "did not stop within 2 s" in stubborn["error"] and len(stubborn["messages"]) >= 1
    assert "Traceback" not in stderr


def test_a_device_stopped_only_by_its_broken_barrier_is_interrupted_not_failed():
    """Under load a child's own stop signal can land after a peer's interrupt broke the barrier it waits at."""
    returncode, (plain, deaf), stderr = interrupted_parent(["cpu", "cpu:deaf"], signal.SIGINT)
    assert returncode == 130, stderr
    assert [plain["status"], deaf["status"]] == ["interrupted", "interrupted"]
    assert "another device stopped" in deaf["error"] and len(deaf["messages"]) >= 1
