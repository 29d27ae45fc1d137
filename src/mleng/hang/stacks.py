"""Find the rank processes of a job on this node, dump their stacks with py-spy, group identical ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from mleng.errors import NotAvailableError, UsageError

PROC = Path("/proc")
# Frames from these path fragments are library plumbing; the line a rank "sits on" is the innermost
# frame outside them.
LIBRARY_PATH_MARKERS = ("site-packages/", "dist-packages/", "/lib/python3", "<frozen ")


def read_environ(pid: int) -> dict[str, str]:
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def children(pid: int) -> list[int]:
    found = []
    for task in (PROC / str(pid) / "task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return sorted(set(found))


def descendants(pid: int) -> list[int]:
    out, stack = [], [pid]
    while stack:
        for child in children(stack.pop()):
            out.append(child)
            stack.append(child)
    return out


def command_line(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def _is_rank(env: dict[str, str]) -> bool:
    return "RANK" in env and "WORLD_SIZE" in env or "SLURM_PROCID" in env and "SLURM_STEP_ID" in env


def _rank_of(env: dict[str, str]) -> int | None:
    for name in ("RANK", "SLURM_PROCID"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def find_rank_processes(pid: int | None = None, slurm_job: str | None = None) -> list[dict[str, Any]]:
    """Rank processes: descendants of `pid` (a torchrun agent) or `pid` itself; or every process of a
    SLURM job on this node; or, given neither, every process on this node that carries RANK/WORLD_SIZE."""
    if pid is not None:
        if not (PROC / str(pid)).exists():
            raise UsageError(f"no process with pid {pid}", hint="give the pid of torchrun or of one rank")
        root = pid
        if _is_rank(read_environ(pid)):
            # Given one rank of a torchrun job, look at all of its agent's ranks.
            parent = _parent(pid)
            if parent and "TORCHELASTIC_RUN_ID" in read_environ(pid):
                root = parent
        candidates = [root] + descendants(root)
    else:
        candidates = [int(p.name) for p in PROC.iterdir() if p.name.isdigit() and int(p.name) != os.getpid()]
    ranks: dict[int, dict[str, Any]] = {}
    for candidate in candidates:
        env = read_environ(candidate)
        if not _is_rank(env):
            continue
        if slurm_job is not None and env.get("SLURM_JOB_ID") != slurm_job:
            continue
        cmd = command_line(candidate)
        if "python" not in cmd and not cmd.split(" ")[0].endswith(("mleng", "torchrun")):
            continue
        rank = _rank_of(env)
        if rank is None:
            continue
        # A rank's own worker subprocesses (DataLoader workers) inherit RANK: keep the outermost.
        if rank in ranks and ranks[rank]["pid"] in _ancestors(candidate):
            continue
        ranks[rank] = {"rank": rank, "pid": candidate, "local_rank": env.get("LOCAL_RANK"),
                       "world_size": env.get("WORLD_SIZE") or env.get("SLURM_NTASKS"),
                       "host": os.uname().nodename, "command": cmd}
    return [ranks[r] for r in sorted(ranks)]


def _parent(pid: int) -> int | None:
    try:
        return int((PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None


def _ancestors(pid: int) -> set[int]:
    seen: set[int] = set()
    current: int | None = pid
    while current and current > 1 and current not in seen:
        seen.add(current)
        current = _parent(current)
    seen.discard(pid)
    return seen


def py_spy_path() -> str:
    # py-spy installed into the same environment as mleng is found even when it is not on PATH.
    beside_python = Path(sys.executable).parent / "py-spy"
    path = shutil.which("py-spy") or (str(beside_python) if beside_python.exists() else None)
    if path is None:
        raise NotAvailableError("py-spy is not installed", hint="pip install py-spy (it needs ptrace: run as the "
                                "job's user or root; in containers add --cap-add SYS_PTRACE)")
    return path


def dump_stack(pid: int, native: bool = False, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """py-spy's JSON dump of one process: a list of threads with frames (innermost first)."""
    cmd = [py_spy_path(), "dump", "--pid", str(pid), "--json"] + (["--native"] if native else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [{"error": f"py-spy did not answer within {timeout_s:.0f} s"}]
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip().splitlines()
        return [{"error": message[-1] if message else f"py-spy exited {done.returncode}"}]
    return json.loads(done.stdout)


def _frame_text(frame: dict[str, Any]) -> str:
    return f"{frame.get('name')} ({frame.get('short_filename') or frame.get('filename')}:{frame.get('line')})"


def main_thread(threads: list[dict[str, Any]]) -> dict[str, Any] | None:
    for thread in threads:
        if thread.get("thread_name") == "MainThread":
            return thread
    return threads[0] if threads else None


def user_frame(frames: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost frame in the user's own code (not torch, not the standard library)."""
    for frame in frames:
        filename = frame.get("filename") or ""
        if not any(marker in filename for marker in LIBRARY_PATH_MARKERS):
            return frame
    return None


def summarize_rank(process: dict[str, Any], threads: list[dict[str, Any]]) -> dict[str, Any]:
    if threads and "error" in threads[0]:
        return {**process, "error": threads[0]["error"], "stack": [], "signature": f"error: {threads[0]['error']}"}
    thread = main_thread(threads) or {"frames": []}
    frames = thread.get("frames") or []
    stack = [_frame_text(f) for f in frames]
    where = user_frame(frames)
    return {**process, "stack": stack, "signature": "\n".join(stack),
            "sits_on": f"{where.get('filename')}:{where.get('line')} in {where.get('name')}" if where else None,
            "innermost": stack[0] if stack else None, "threads": len(threads)}


def _in_collective(stack: list[str]) -> bool:
    return any("torch/distributed" in frame for frame in stack)


def group_stacks(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Identical main-thread stacks grouped, odd ones out first.

    The usual culprit of a hang is the rank that is not in the collective the others wait in, so a
    group is an outlier when it is smaller than the largest, or, on a tie, when it is outside
    torch.distributed while another group is inside it.
    """
    by_signature: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rank in ranks:
        by_signature[rank["signature"]].append(rank)
    groups = []
    for members in by_signature.values():
        first = members[0]
        groups.append({"ranks": [m["rank"] for m in members], "hosts": sorted({m["host"] for m in members}),
                       "count": len(members), "stack": first["stack"], "sits_on": first.get("sits_on"),
                       "in_collective": _in_collective(first["stack"]), "error": first.get("error")})
    largest = max((g["count"] for g in groups), default=0)
    any_in_collective = any(g["in_collective"] for g in groups)
    for g in groups:
        g["outlier"] = len(groups) > 1 and (
            g["count"] < largest or (any_in_collective and not g["in_collective"]) or bool(g["error"]))
    groups.sort(key=lambda g: (not g["outlier"], g["in_collective"], g["count"], g["ranks"]))
    return groups


def dump_job(pid: int | None = None, slurm_job: str | None = None, native: bool = False) -> dict[str, Any]:
    processes = find_rank_processes(pid=pid, slurm_job=slurm_job)
    if not processes:
        where = f"under pid {pid}" if pid else (f"of SLURM job {slurm_job}" if slurm_job else "on this node")
        raise UsageError(f"no rank processes found {where} (looked for processes with RANK and WORLD_SIZE set)",
                         hint="give --pid of torchrun or of a rank; inside SLURM use --job")
    py_spy_path()
    ranks = [summarize_rank(p, dump_stack(p["pid"], native=native)) for p in processes]
    return {"host": os.uname().nodename, "ranks": ranks, "groups": group_stacks(ranks)}


def merge_dumps(dumps: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge per-node dumps (from `--all-nodes`) into one grouping over the whole job."""
    ranks = sorted((r for d in dumps for r in d["ranks"]), key=lambda r: r["rank"])
    return {"host": ",".join(sorted({d["host"] for d in dumps})), "ranks": ranks, "groups": group_stacks(ranks)}
