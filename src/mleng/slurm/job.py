"""Submitting an sbatch script and following the job: squeue polling, the log as it grows, the end state."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from typing import Callable

from mleng.errors import MlengError, NotAvailableError, UsageError

# `sbatch --wait` checks every ~10 s; squeue answers in milliseconds, so poll it instead.
DEFAULT_POLL_S = 0.5
# States after which a job never runs again (squeue may still list it while COMPLETING).
ENDED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}

# Pending reasons that no amount of waiting fixes: the request does not fit the partition or account.
HOPELESS_REASONS = {
    "PartitionNodeLimit": "it asks for more nodes than the partition has or allows",
    "PartitionTimeLimit": "its --time is above the partition's limit",
    "PartitionConfig": "it asks for more than the partition's nodes offer (CPUs, GPUs, memory)",
    "BadConstraints": "its constraints cannot be met by any node",
    "AccountNotAllowed": "the account may not use this partition",
    "InvalidAccount": "the account does not exist",
    "InvalidQOS": "the QOS does not exist",
    "QOSMaxNodePerJobLimit": "it asks for more nodes than the QOS allows",
}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        raise NotAvailableError(f"{name} is not on PATH: this is not a SLURM login node",
                                hint="run on a machine with the SLURM client tools, or write the script with "
                                     "`mleng slurm script` and submit it where SLURM is")
    return path


def _run(argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise MlengError(f"{os.path.basename(argv[0])} did not answer within {timeout:g} s",
                         hint="slurmctld is down or overloaded: try `scontrol ping`") from None


def submit(script_path: str, extra: list[str] | None = None) -> str:
    """sbatch the script; the job id."""
    result = _run([_tool("sbatch"), "--parsable", *(extra or []), script_path])
    if result.returncode != 0:
        message = (result.stderr.strip() or result.stdout.strip() or f"exit status {result.returncode}")
        message = message.splitlines()[-1].removeprefix("sbatch: error: ")
        raise UsageError(f"sbatch refused the job: {message}",
                         hint="check --nodes, --gpus-per-node, --partition, --time and --account "
                              "against `sinfo` and your site's limits")
    job_id = result.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise MlengError(f"sbatch printed {result.stdout.strip()!r}, not a job id")
    return job_id


@dataclasses.dataclass
class JobEnd:
    job_id: str
    state: str            # COMPLETED, FAILED, TIMEOUT, ... or UNKNOWN when slurmctld forgot the job
    exit_code: int | None
    signal: int | None
    nodes: str | None
    elapsed_s: float      # from submission to the end, as seen by this follower


def queue_state(job_id: str) -> tuple[str, str, str] | None:
    """(state, elapsed, nodes or reason) while squeue lists the job; None once it is gone."""
    result = _run([_tool("squeue"), "-h", "-j", job_id, "-o", "%T|%M|%R"], timeout=15.0)
    line = result.stdout.strip()
    if result.returncode != 0 or not line:
        return None
    state, _, rest = line.partition("|")
    elapsed, _, where = rest.partition("|")
    return state, elapsed, where


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict (until MinJobAge forgets the job); {} when unknown."""
    result = _run([_tool("scontrol"), "show", "job", "-o", job_id], timeout=15.0)
    if result.returncode != 0:
        return {}
    fields = {}
    for token in result.stdout.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


class LogTail:
    """New complete lines of a file that grows (the job's slurm-JOBID.out)."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.partial = ""

    def read(self) -> list[str]:
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except OSError:
            return []
        text = self.partial + chunk
        lines = text.split("\n")
        self.partial = lines.pop()
        return lines

    def rest(self) -> list[str]:
        lines = self.read()
        if self.partial:
            lines.append(self.partial)
            self.partial = ""
        return lines


def follow(job_id: str, log_path: str | None, poll_s: float = DEFAULT_POLL_S,
           on_line: Callable[[str], None] | None = None,
           on_state: Callable[[str, str, str, float], None] | None = None,
           started: float | None = None) -> JobEnd:
    """Poll squeue until the job leaves it, passing on each new log line and the state; then its end."""
    started = time.monotonic() if started is None else started
    tail = LogTail(log_path) if log_path else None
    while True:
        state = queue_state(job_id)
        if tail and on_line:
            for line in tail.read():
                on_line(line)
        if state is None or state[0] in ENDED_STATES:
            break
        reason = state[2].strip("()")
        if state[0] == "PENDING" and reason in HOPELESS_REASONS:
            raise UsageError(f"job {job_id} can never start: {reason} ({HOPELESS_REASONS[reason]})",
                             hint="compare --nodes, --gpus-per-node, --time and --partition with `sinfo -N -l`")
        if on_state:
            on_state(state[0], state[1], state[2], time.monotonic() - started)
        time.sleep(poll_s)
    fields = job_fields(job_id)
    # The batch shell can still be writing its last lines when squeue drops the job.
    for _ in range(10):
        if tail and on_line:
            lines = tail.read()
            for line in lines:
                on_line(line)
            if lines:
                continue
        break
    if tail and on_line:
        for line in tail.rest():
            on_line(line)
    code, sig = None, None
    if "ExitCode" in fields:
        first, _, second = fields["ExitCode"].partition(":")
        code = int(first) if first.isdigit() else None
        sig = int(second) if second.isdigit() else None
    return JobEnd(job_id, fields.get("JobState", "UNKNOWN"), code, sig, fields.get("NodeList"),
                  time.monotonic() - started)


def cancel(job_id: str, signal_name: str | None = None) -> None:
    """scancel the job (or only signal its steps); errors ignored, the job may be gone already."""
    argv = [_tool("scancel")]
    if signal_name:
        argv.append(f"--signal={signal_name}")
    try:
        _run([*argv, job_id], timeout=15.0)
    except MlengError:
        pass
