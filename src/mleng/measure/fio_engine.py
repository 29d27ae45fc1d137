"""The fio engine for `mleng io`: job files for each workload, and fio's JSON turned into our fields."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from typing import Any

from mleng.errors import MlengError, NotAvailableError


def fio_path() -> str | None:
    return shutil.which("fio")


def require_fio() -> str:
    path = fio_path()
    if path is None:
        raise NotAvailableError("--engine fio asks for fio, and it is not installed here",
                                hint="install it (apt-get install -y fio, dnf install fio) or use --engine native")
    return path


def fio_version() -> str | None:
    path = fio_path()
    if path is None:
        return None
    try:
        return subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def job_file(*, workload: str, directory: str, jobs: int, file_bytes: int, block_bytes: int,
             direct: bool, duration_s: float | None = None) -> str:
    """One fio job file; its files are the same shard.N names the native engine uses."""
    lines = [
        "[global]",
        f"directory={directory}",
        "filename_format=shard.$jobnum",
        # psync with one I/O in flight per job is what the native engine does: pread/pwrite
        # from one thread per job. Same pattern, so the two engines' numbers compare.
        "ioengine=psync",
        "iodepth=1",
        "thread=1",
        "group_reporting=1",
        f"numjobs={jobs}",
        f"size={file_bytes}",
        f"bs={block_bytes}",
        f"direct={1 if direct else 0}",
        # Drop the files' cached pages before reading (fio's posix_fadvise DONTNEED).
        "invalidate=1",
        "",
        f"[{workload}]",
    ]
    if workload == "ckpt-save":
        # Buffered writes then fsync, as a checkpoint save; fio's runtime includes the fsync.
        # No preallocation: the native engine and torch.save just write.
        lines += ["rw=write", "end_fsync=1", "fallocate=none"]
    elif workload == "ckpt-load":
        lines += ["rw=read"]
    elif workload.startswith("rand-read"):
        lines += ["rw=randread", "norandommap=1", "randrepeat=0", "time_based=1",
                  f"runtime={max(1, int(round(duration_s or 10)))}s"]
    else:
        raise ValueError(f"fio has no job for workload {workload!r}")
    return "\n".join(lines) + "\n"


def run_fio(job_text: str, workdir: str, name: str, timeout_s: float = 3600) -> dict[str, Any]:
    """Run fio on a job file inside our own directory and return its parsed JSON."""
    fio = require_fio()
    job_path = os.path.join(workdir, f"{name}.fio")
    out_path = os.path.join(workdir, f"{name}.json")
    with open(job_path, "w") as f:
        f.write(job_text)
    try:
        # Its own process group: a Ctrl-C at the terminal reaches us first, and we stop fio
        # ourselves before removing the files it writes.
        proc = subprocess.Popen([fio, job_path, "--output-format=json", f"--output={out_path}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except BaseException:
            _stop(proc)
            raise
        try:
            with open(out_path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = None
        if data is None or proc.returncode != 0:
            detail = _job_errors(data) or (stderr or "").strip().splitlines()[-3:]
            if proc.returncode < 0:
                how = f"killed by {signal.Signals(-proc.returncode).name} ({signal.strsignal(-proc.returncode)})"
            else:
                how = f"exit {proc.returncode}"
            raise MlengError(f"fio failed on {name} ({how}): {'; '.join(detail) or 'no output'}",
                             hint="see the message above; a full disk or a file system without O_DIRECT are common causes")
        return data
    finally:
        for path in (job_path, out_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def measure(*, workload: str, directory: str, jobs: int, file_bytes: int, block_bytes: int, direct: bool,
            duration_s: float | None = None) -> dict[str, Any]:
    """One workload run by fio over the shards in directory: its job file, run, and parsed result."""
    text = job_file(workload=workload, directory=directory, jobs=jobs, file_bytes=file_bytes,
                    block_bytes=block_bytes, direct=direct, duration_s=duration_s)
    return parse(run_fio(text, directory, workload), workload)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _job_errors(data: dict[str, Any] | None) -> list[str]:
    if not data:
        return []
    out = []
    for job in data.get("jobs", []):
        if job.get("error"):
            out.append(f"job {job.get('jobname')}: error {job['error']} ({os.strerror(job['error'])})")
    return out


def parse(data: dict[str, Any], workload: str) -> dict[str, Any]:
    """Our fields from fio's group-reported job: bandwidth, IOPS, p50/p99 completion latency."""
    jobs = data.get("jobs") or []
    if not jobs:
        raise MlengError("fio's JSON output has no jobs", hint="check the fio version (3.x expected)")
    job = jobs[0]
    direction = "write" if workload == "ckpt-save" else "read"
    side = job[direction]
    percentiles = (side.get("clat_ns") or {}).get("percentile") or {}
    runtime_s = (side.get("runtime") or 0) / 1e3
    return {
        "bytes": int(side.get("io_bytes", 0)),
        "ops": int(side.get("total_ios", 0)),
        "elapsed_s": runtime_s,
        "bandwidth_bytes_per_s": float(side.get("bw_bytes", 0)),
        "iops": float(side.get("iops", 0.0)),
        "latency_p50_us": _ns_to_us(percentiles.get("50.000000")),
        "latency_p99_us": _ns_to_us(percentiles.get("99.000000")),
    }


def _ns_to_us(value: Any) -> float | None:
    return None if value is None else float(value) / 1e3
