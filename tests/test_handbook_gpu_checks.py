"""scripts/handbook_gpu_checks.py, the handbook claims only a CUDA GPU can settle: what runs without one.
Its results on GPUs are in docs/results/handbook_gpu_checks_h200.json and handbook_gpu_checks_h100.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "handbook_gpu_checks.py"
ENTRIES = ROOT / "src" / "mleng" / "handbook" / "entries"


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env)


def test_every_check_is_about_an_existing_entry():
    proc = run("--list")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    ids = [line.split(":", 1)[0] for line in lines[:-1]]
    assert lines[-1] == f"{len(ids)} checks" and len(ids) >= 40
    assert len(set(ids)) == len(ids)
    assert [i for i in ids if not (ENTRIES / f"{i}.md").exists()] == []


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    import os
    out = tmp_path / "gpu.json"
    proc = run("--out", str(out), env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 2
    assert "no CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_an_unknown_check_is_a_usage_error():
    proc = run("--only", "no-such-entry", "--list")
    assert proc.returncode == 2 and "no check for: no-such-entry" in proc.stderr


@pytest.mark.parametrize("name", ["handbook_gpu_checks_h200.json", "handbook_gpu_checks_h100.json"])
def test_the_recorded_gpu_run_names_its_machine_and_judges_every_check(name):
    recorded = json.loads((ROOT / "docs" / "results" / name).read_text())
    assert recorded["header"]["device_name"].startswith("NVIDIA")
    assert recorded["header"]["versions"]["torch"]
    statuses = {r["status"] for r in recorded["results"]}
    assert statuses <= {"held", "failed", "inconclusive"}
    assert all((ENTRIES / f"{r['id']}.md").exists() for r in recorded["results"])
