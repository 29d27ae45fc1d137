"""Hang forensics on real hung gloo jobs: py-spy dumps while hung, flight-recorder dumps analyzed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


JOBS = Path(__file__).parent / "jobs"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _torchrun(nproc: int, script: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", str(script), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True)


def _wait_ready(proc: subprocess.Popen, nranks: int, timeout: float = 180) -> None:
    ready, deadline = 0, time.monotonic() + timeout
    while ready < nranks and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        ready += line.count("ready")
    assert ready == nranks, "the job did not start all ranks"
    time.sleep(1.0)  # let the ranks enter the all-reduce


def _ranks(job: subprocess.Popen) -> list[int]:
    """The pids of torchrun's rank processes (its children)."""
    return [int(c) for c in Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()]


def _kill_job(job: subprocess.Popen) -> None:
    """SIGKILL torchrun and its ranks: torchrun starts each rank in a session of its own, out of its process
    group, and a rank that skipped the collective would otherwise sleep on after the test."""
    try:
        ranks = _ranks(job)
    except OSError:
        ranks = []
    os.killpg(job.pid, signal.SIGKILL)
    for pid in ranks:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait(10)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()], "a rank outlived the test"


def _line_of(script: Path, marker: str) -> int:
    return next(i for i, line in enumerate(script.read_text().splitlines(), 1) if marker in line)


def test_dump_names_the_rank_that_skipped_the_collective(run_mleng):
    sleep_line = _line_of(JOBS / "hung_rank_skips_allreduce.py", "SKIPS_THE_ALL_REDUCE")
    job = _torchrun(3, JOBS / "hung_rank_skips_allreduce.py")
    try:
        _wait_ready(job, 3)
        result = run_mleng("hang", "dump", "--pid", str(job.pid), "--json", timeout=180)
        human = run_mleng("hang", "dump", "--pid", str(job.pid), timeout=180)
        from_one_rank = run_mleng("hang", "dump", "--pid", str(_ranks(job)[0]), timeout=180)
    finally:
        _kill_job(job)
    assert result.returncode == 1, result.stderr
    dump = json.loads(result.stdout)
    assert [r["rank"] for r in dump["ranks"]] == [0, 1, 2]
    odd = dump["groups"][0]
    assert odd["outlier"] and odd["ranks"] == [1]
    assert odd["sits_on"].endswith(f"hung_rank_skips_allreduce.py:{sleep_line} in <module>")
    assert not dump["groups"][1]["outlier"] and dump["groups"][1]["ranks"] == [0, 2]
    assert "all_reduce" in dump["groups"][1]["stack"][0]
    assert "ODD ONE OUT: rank(s) 1" in human.stdout
    assert f"hung_rank_skips_allreduce.py:{sleep_line}" in from_one_rank.stdout and "3 rank(s)" in from_one_rank.stdout
    assert f"hung_rank_skips_allreduce.py:{sleep_line}" in human.stdout


def test_dump_without_ranks_says_what_to_do(run_mleng):
    result = run_mleng("hang", "dump", "--pid", str(os.getpid()))
    assert result.returncode == 2
    assert "no rank processes found" in result.stderr and "Traceback" not in result.stderr


def _flight_recorder_job(tmp_path: Path, mode: str) -> Path:
    out = tmp_path / f"fr-{mode}"
    out.mkdir()
    job = _torchrun(3, JOBS / "flight_recorder_desync.py", str(out), mode, env={"TORCH_FR_BUFFER_SIZE": "200"})
    output, _ = job.communicate(timeout=90)
    assert sorted(p.name for p in out.iterdir()) == ["rank_0", "rank_1", "rank_2"], output
    return out


def test_analyze_finds_the_rank_that_never_reached_the_collective(tmp_path, run_mleng):
    dumps = _flight_recorder_job(tmp_path, "skip")
    result = run_mleng("hang", "analyze", str(dumps), "--json")
    assert result.returncode == 1, result.stderr
    analysis = json.loads(result.stdout)
    finding = analysis["findings"][0]
    assert finding["collective_seq_id"] == 6 and finding["kind"] == "missing"
    assert finding["missing_ranks"] == [1]
    assert finding["variants"][0]["op"] == "all_reduce" and finding["variants"][0]["ranks"] == [0, 2]
    human = run_mleng("hang", "analyze", str(dumps))
    assert "ranks [1] never reached it" in human.stdout


def test_analyze_finds_mismatched_ops(tmp_path, run_mleng):
    dumps = _flight_recorder_job(tmp_path, "mismatch")
    analysis = json.loads(run_mleng("hang", "analyze", str(dumps), "--json").stdout)
    finding = analysis["findings"][0]
    assert finding["kind"] == "mismatch" and finding["collective_seq_id"] == 6
    ops = {v["op"]: v["ranks"] for v in finding["variants"]}
    assert ops["all_reduce"] == [0, 2] and 1 in next(r for op, r in ops.items() if op != "all_reduce")


def test_analyze_agreeing_ranks_exit_0(tmp_path, run_mleng):
    dumps = _flight_recorder_job(tmp_path, "agree")
    result = run_mleng("hang", "analyze", str(dumps), "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["agree"]


def test_analyze_rejects_a_file_that_is_not_a_dump(tmp_path, run_mleng):
    (tmp_path / "rank_0").write_bytes(b"\x80\x04\x95garbage")
    result = run_mleng("hang", "analyze", str(tmp_path))
    assert result.returncode == 2 and "not a flight-recorder dump" in result.stderr
    missing = run_mleng("hang", "analyze", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "not a directory" in missing.stderr
