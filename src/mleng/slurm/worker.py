"""Entry point of each torchrun rank in an mleng sbatch job: note which node this rank is on, then run mleng.

Rows of check/comm carry the host name, and emulated or renamed nodes share one; the SLURM node
name is what `scontrol update nodename=...` needs, so every rank writes it down before it starts.
"""

from __future__ import annotations

import json
import os
import socket
import sys


def note_rank(results_dir: str) -> None:
    rank = os.environ.get("RANK")
    if rank is None:
        return
    info = {"rank": int(rank), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "group_rank": int(os.environ.get("GROUP_RANK", "0")),
            "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0],
            "host": socket.gethostname(), "pid": os.getpid()}
    folder = os.path.join(results_dir, "ranks")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank-{rank}.json"), "w") as f:
            json.dump(info, f)
    except OSError as exc:  # the run matters more than its label
        print(f"mleng slurm: warning: could not note rank {rank}'s node in {folder}: {exc}", file=sys.stderr)


def main() -> int:
    results_dir = os.environ.get("MLENG_SLURM_RESULTS")
    if results_dir:
        note_rank(results_dir)
    from mleng.cli.main import main as mleng_main

    return mleng_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
