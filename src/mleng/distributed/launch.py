"""How this process was launched (plainly, by mleng itself, torchrun, plain env vars, srun) and its place in the job."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
from typing import Mapping

from mleng.errors import UsageError

# Set by mleng on the ranks it spawns itself, so a child knows it is one rank of a local job.
SPAWNED_ENV = "MLENG_SPAWNED"

# Under srun without MASTER_PORT every task must agree on a port without talking first:
# derive it from the job id inside a range clear of the usual ephemeral ports.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 10000


@dataclasses.dataclass(frozen=True)
class Launch:
    """One process's place in the job and where to find rank 0."""

    mode: str               # "spawned" (by mleng), "torchrun", "env" (RANK/WORLD_SIZE set by hand), "srun"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str
    master_port: int
    # Under torchrun the agent on node 0 already serves the TCPStore at master_addr:master_port,
    # so every rank (rank 0 included) connects to it as a client.
    agent_store: bool = False
    # Keys of one job run live under this prefix, so a restarted torchrun attempt never reads old keys.
    run_id: str = "0"
    # Under srun with block distribution, the host each rank should run on: lets rank 0 say where a
    # rank that never joined was supposed to be.
    expected_hosts: tuple[str, ...] | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def detect(environ: Mapping[str, str] | None = None) -> Launch | None:
    """The launch this process is part of, or None when nobody launched it (mleng must spawn ranks itself).

    Order matters: torch-style RANK/WORLD_SIZE win over SLURM variables, because `srun torchrun ...`
    leaves both, and torchrun's are the ones that describe this process.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torch_env(env)
    if _is_srun_step(env):
        return _from_slurm_env(env)
    return None


def _int_env(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise UsageError(f"environment variable {name} is not set",
                             hint="set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT together, "
                                  "or launch with torchrun or srun, or unset them all and let mleng spawn ranks")
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name}={raw!r} is not an integer") from None


def _from_torch_env(env: Mapping[str, str]) -> Launch:
    rank = _int_env(env, "RANK")
    world_size = _int_env(env, "WORLD_SIZE")
    local_world = env.get("LOCAL_WORLD_SIZE")
    # torch does not need LOCAL_RANK to start: without it, a rank started by hand is the only one on its
    # node (local rank 0), or its place among LOCAL_WORLD_SIZE ranks per node.
    derived = rank % int(local_world) if local_world and local_world.isdigit() and int(local_world) > 0 else 0
    local_rank = _int_env(env, "LOCAL_RANK", default=derived)
    if not 0 <= rank < world_size:
        raise UsageError(f"RANK={rank} is outside WORLD_SIZE={world_size}",
                         hint="ranks are numbered 0 .. WORLD_SIZE-1")
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise UsageError("RANK and WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not",
                         hint="export MASTER_ADDR (rank 0's host) and MASTER_PORT (a free port) on every rank")
    if env.get(SPAWNED_ENV):
        mode = "spawned"
    elif "TORCHELASTIC_RUN_ID" in env:
        mode = "torchrun"
    else:
        mode = "env"
    run_id = "0"
    if mode == "torchrun":
        run_id = f"{env.get('TORCHELASTIC_RUN_ID', '')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return Launch(
        mode=mode, rank=rank, world_size=world_size, local_rank=local_rank,
        local_world_size=int(local_world) if local_world and local_world.isdigit() else None,
        master_addr=env["MASTER_ADDR"], master_port=_int_env(env, "MASTER_PORT"),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", run_id=run_id,
    )


def _is_srun_step(env: Mapping[str, str]) -> bool:
    # A batch script also carries SLURM_PROCID=0 and SLURM_NTASKS; only a task started by srun is in a
    # step with a step id, and a step of one task is a plain run on its node.
    if "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return False
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    return tasks.isdigit() and int(tasks) > 1


def _from_slurm_env(env: Mapping[str, str]) -> Launch:
    world_size = _int_env(env, "SLURM_STEP_NUM_TASKS", default=_int_env(env, "SLURM_NTASKS", default=1))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if env.get("MASTER_ADDR"):
        master_addr = env["MASTER_ADDR"]
    elif nodelist:
        master_addr = slurm_hostnames(nodelist)[0]
    else:
        raise UsageError("running under srun but SLURM_NODELIST is not set, so rank 0's host is unknown",
                         hint="export MASTER_ADDR=<first node of the job> before srun")
    if env.get("MASTER_PORT"):
        master_port = _int_env(env, "MASTER_PORT")
    else:
        master_port = SLURM_PORT_BASE + _int_env(env, "SLURM_JOB_ID", default=0) % SLURM_PORT_SPAN
    local_tasks = env.get("SLURM_NTASKS_PER_NODE", "")
    expected = None
    tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if nodelist and tasks_per_node and env.get("SLURM_DISTRIBUTION", "block").startswith("block"):
        try:
            expected = block_layout(slurm_hostnames(nodelist), tasks_per_node)
        except UsageError:
            expected = None
        if expected is not None and len(expected) != world_size:
            expected = None
    return Launch(
        mode="srun", rank=_int_env(env, "SLURM_PROCID"), world_size=world_size,
        local_rank=_int_env(env, "SLURM_LOCALID", default=0),
        local_world_size=int(local_tasks) if local_tasks.isdigit() else None,
        master_addr=master_addr, master_port=master_port,
        run_id=f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}",
        expected_hosts=tuple(expected) if expected else None,
    )


def block_layout(hosts: list[str], tasks_per_node: str) -> list[str]:
    """Host of each rank under block distribution; tasks_per_node in SLURM's form "2(x3),1"."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.match(r"^(\d+)(?:\(x(\d+)\))?$", part.strip())
        if not match:
            raise UsageError(f"tasks per node {tasks_per_node!r} is not in SLURM's N(xM),... form")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    if len(counts) != len(hosts):
        raise UsageError(f"tasks per node {tasks_per_node!r} does not match {len(hosts)} hosts")
    return [host for host, count in zip(hosts, counts) for _ in range(count)]


def slurm_hostnames(nodelist: str) -> list[str]:
    """Expand a SLURM node list ("gpu[01-03,07],login1"); `scontrol show hostnames` when present, else our parser."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=10, check=True).stdout.split()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_nodelist(nodelist)


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compact host list syntax: "n[1-3,5]" -> n1 n2 n3 n5, zero padding kept ("n[01-02]")."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        if item:
            hosts.extend(_expand_item(item, nodelist))
    if not hosts:
        raise UsageError(f"empty SLURM node list {nodelist!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    items.append("".join(current))
    return items


def _expand_item(item: str, whole: str) -> list[str]:
    start = item.find("[")
    if start < 0:
        return [item]
    end = item.find("]", start)
    if end < 0:
        raise UsageError(f"SLURM node list {whole!r} has an unclosed '['")
    prefix, ranges, rest = item[:start], item[start + 1:end], item[end + 1:]
    tails = _expand_item(rest, whole) if rest else [""]
    names = []
    for part in ranges.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise UsageError(f"SLURM node list {whole!r} has a range {part!r} that is not N or N-M")
        low, high = match.group(1), match.group(2) or match.group(1)
        width = len(low) if low.startswith("0") else 0
        for number in range(int(low), int(high) + 1):
            names.extend(f"{prefix}{number:0{width}d}{tail}" for tail in tails)
    return names


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on host (the kernel picks it); the usual small race is accepted."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def visible_gpu_count() -> int:
    """GPUs this process may use, without importing torch: CUDA_VISIBLE_DEVICES, else NVML's count."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e for e in visible.split(",") if e.strip()]
        # CUDA stops at the first invalid entry; "-1" is the usual way to hide every GPU.
        count = 0
        for entry in entries:
            if entry.strip().startswith("-"):
                break
            count += 1
        return count
    from mleng.machine.nvml import nvml

    pynvml, _ = nvml()
    if pynvml is None:  # no driver, no library: a CPU machine
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0


def default_nproc() -> int:
    """Local ranks to spawn when nobody said: one per visible GPU, else 2 on a CPU machine."""
    return visible_gpu_count() or 2

def strip_nproc(argv: list[str]) -> list[str]:
    """The children must not spawn again; --nproc is only the plain launcher's business."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        out.append(arg)
    return out
