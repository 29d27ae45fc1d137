"""Inside salloc/sbatch but outside any srun step: re-run check/comm with srun on every node of the allocation."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Mapping

from mleng.errors import EXIT_INTERRUPTED

# Set to 0 to keep a command on the node it was started on (as before: local ranks only).
RELAUNCH_ENV = "MLENG_SLURM_RELAUNCH"


def allocation_nodes(env: Mapping[str, str] | None = None) -> int:
    """Nodes of the allocation this process is in but not yet spread over; 0 when that is not the case."""
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID") or "SLURM_STEP_ID" in env or env.get(RELAUNCH_ENV) == "0":
        return 0
    if "RANK" in env or "WORLD_SIZE" in env:  # torchrun (or a launcher) already placed this process
        return 0
    raw = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or ""
    return int(raw) if raw.isdigit() else 0


def node_addr(node: str) -> str:
    """The address other nodes reach node at: its NodeAddr (often the name itself)."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "node", node], capture_output=True, text=True,
                                 timeout=10).stdout
            for token in out.split():
                if token.startswith("NodeAddr="):
                    return token.split("=", 1)[1] or node
        except (OSError, subprocess.SubprocessError):
            pass
    return node


def srun_argv(command_argv: list[str], nodes: int, tasks_per_node: int) -> list[str]:
    return [shutil.which("srun") or "srun", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}",
            "--kill-on-bad-exit=1", sys.executable, "-m", "mleng", *command_argv]


def relaunch(command: str, command_argv: list[str], nproc: int | None) -> int | None:
    """When started inside a multi-node allocation, run the command as an srun step over all its nodes
    and return its exit code; None when this process should just go on as before."""
    from mleng.distributed.launch import slurm_hostnames, strip_nproc, visible_gpu_count

    nodes = allocation_nodes()
    if nodes < 2 or not shutil.which("srun"):
        return None
    tasks_per_node = nproc or visible_gpu_count() or 1
    first = slurm_hostnames(os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", ""))[0]
    env = dict(os.environ)
    env.setdefault("MASTER_ADDR", node_addr(first))
    argv = srun_argv(strip_nproc(command_argv), nodes, tasks_per_node)
    print(f"mleng {command}: inside SLURM job {os.environ['SLURM_JOB_ID']} with {nodes} nodes: running "
          f"{tasks_per_node} rank(s) on each with srun (set {RELAUNCH_ENV}=0 to stay on this node)",
          file=sys.stderr, flush=True)
    proc = subprocess.Popen(argv, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # srun took the terminal's SIGINT as a request for status; a second one within a second
        # makes it stop the step, whose ranks then keep what they measured.
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.kill()
            proc.wait()
        return EXIT_INTERRUPTED
