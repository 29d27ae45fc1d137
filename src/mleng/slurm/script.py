"""The sbatch script that runs one mleng command across every node of an allocation."""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import shlex
import sys

from mleng.errors import UsageError
from mleng.slurm.allocation import RELAUNCH_ENV

# One torch world across the allocation: every node's torchrun joins one c10d rendezvous.
DISTRIBUTED_COMMANDS = ("check", "comm")
# Run once on every node, independently; the per-node JSON records are merged afterwards.
PER_NODE_COMMANDS = ("mamf", "doctor", "membw", "io", "env")

# Commands whose own results store is skipped on the nodes: N nodes writing one SQLite file on a
# shared file system is what SQLite warns against; the merged record is stored once instead.
NO_STORE_FLAG = {"mamf": "--no-store", "doctor": "--no-store"}

_TIME = re.compile(r"^(\d+-)?\d+(:\d+){0,2}$")
_NAME = re.compile(r"^[A-Za-z0-9_.,\-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass
class ScriptSpec:
    """What the user asked for; validate() refuses bad input before anything is written."""

    command: str
    mleng_args: list[str]
    nodes: int
    gpus_per_node: int = 0
    nproc_per_node: int | None = None     # ranks per node (torchrun --nproc-per-node); default G, or 1 on CPU
    cpus_per_task: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    output_dir: str = "mleng-slurm"
    job_name: str | None = None
    join_timeout_s: float = 120.0
    signal_lead_s: int = 120              # USR1 this long before the time limit: the ranks stop and keep their rows
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    per_node: bool = False                # comm: also run it inside every node on its own, for a per-node busbw
    python: str = sys.executable

    @property
    def distributed(self) -> bool:
        return self.command in DISTRIBUTED_COMMANDS

    @property
    def ranks_per_node(self) -> int:
        return self.nproc_per_node or self.gpus_per_node or 1

    def validate(self) -> "ScriptSpec":
        known = DISTRIBUTED_COMMANDS + PER_NODE_COMMANDS
        if self.command not in known:
            raise UsageError(f"mleng slurm cannot run {self.command!r} across nodes",
                             hint=f"one of: {', '.join(known)}")
        if self.nodes < 1:
            raise UsageError(f"--nodes {self.nodes} must be at least 1")
        if self.gpus_per_node < 0:
            raise UsageError(f"--gpus-per-node {self.gpus_per_node} cannot be negative (0 runs on CPU with gloo)")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node {self.nproc_per_node} must be at least 1")
        if self.gpus_per_node and self.nproc_per_node and self.nproc_per_node > self.gpus_per_node:
            raise UsageError(f"--nproc-per-node {self.nproc_per_node} is more than --gpus-per-node "
                             f"{self.gpus_per_node}: two ranks would share a GPU",
                             hint="leave --nproc-per-node out to get one rank per GPU")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise UsageError(f"--cpus-per-task {self.cpus_per_task} must be at least 1")
        if self.time is not None and not _TIME.match(self.time):
            raise UsageError(f"--time {self.time!r} is not a SLURM time",
                             hint="use MINUTES, HH:MM:SS or DAYS-HH:MM:SS, e.g. 00:30:00")
        for flag, value in (("--partition", self.partition), ("--account", self.account),
                            ("--job-name", self.job_name)):
            if value is not None and not _NAME.match(value):
                raise UsageError(f"{flag} {value!r} has characters SLURM names do not use")
        if any(ch.isspace() for ch in self.output_dir):
            raise UsageError(f"--output {self.output_dir!r} has white space, which #SBATCH --output cannot take",
                             hint="pick a folder without spaces")
        if self.join_timeout_s <= 0:
            raise UsageError("--join-timeout must be positive")
        for name in self.env:
            if not _ENV_NAME.match(name):
                raise UsageError(f"--env {name!r}: not an environment variable name", hint="use --env NAME=VALUE")
        if self.per_node and self.command != "comm":
            raise UsageError("--per-node is for comm (check and per-node commands already report per node)")
        if self.per_node and self.ranks_per_node < 2:
            raise UsageError("--per-node needs at least 2 ranks per node: a collective of one rank moves nothing",
                             hint="add --nproc-per-node 2 (CPU) or run on nodes with 2 or more GPUs")
        if self.command in DISTRIBUTED_COMMANDS and any(a == "--nproc" or a.startswith("--nproc=")
                                                        for a in self.mleng_args):
            raise UsageError("--nproc after -- would make every rank spawn ranks of its own",
                             hint="give the ranks per node as --nproc-per-node before the --")
        return self


def parse_env(items: list[str] | None) -> dict[str, str]:
    """--env NAME=VALUE, repeated."""
    env: dict[str, str] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--env {item!r}: expected NAME=VALUE")
        env[name] = value
    return env


def inner_args(spec: ScriptSpec) -> list[str]:
    """The mleng command line every node (or rank) runs: the user's arguments plus --json."""
    args = [spec.command, *spec.mleng_args]
    if "--json" not in args:
        args.append("--json")
    flag = NO_STORE_FLAG.get(spec.command)
    if flag and flag not in args:
        args.append(flag)
    if spec.distributed and spec.gpus_per_node == 0 and not any(a.startswith("--backend") for a in args):
        args += ["--backend", "gloo"]  # no GPUs asked for: CPU ranks, whatever the node has
    if spec.command == "mamf" and spec.gpus_per_node and not any(
            a in ("--device", "--all-devices") or a.startswith("--device=") for a in args):
        args.append("--all-devices")
    return args


def default_job_name(spec: ScriptSpec) -> str:
    return spec.job_name or f"mleng-{spec.command}"


def render(spec: ScriptSpec, written_by: list[str] | None = None) -> str:
    """The whole sbatch script as text."""
    spec.validate()
    out_dir = os.path.abspath(spec.output_dir)
    q = shlex.quote
    cpus = spec.cpus_per_task or (spec.ranks_per_node if not spec.gpus_per_node else None)
    lines = ["#!/bin/bash",
             f"# Written by mleng on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}"
             + (f": {' '.join(q(a) for a in written_by)}" if written_by else ""),
             f"# Runs `mleng {' '.join(q(a) for a in inner_args(spec))}` on {spec.nodes} node(s); "
             f"results in {out_dir}/job-<JOBID>/,",
             f"# merged into one record by `mleng slurm merge {out_dir}/job-<JOBID>`.",
             f"#SBATCH --job-name={default_job_name(spec)}",
             f"#SBATCH --nodes={spec.nodes}",
             "#SBATCH --ntasks-per-node=1"]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    if cpus:
        lines.append(f"#SBATCH --cpus-per-task={cpus}")
    for flag, value in (("partition", spec.partition), ("time", spec.time), ("account", spec.account)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines += [f"#SBATCH --output={out_dir}/slurm-%j.out",
              f"#SBATCH --signal=B:USR1@{spec.signal_lead_s}",
              "",
              "set -u",
              f"export MLENG_PYTHON=${{MLENG_PYTHON:-{q(spec.python)}}}",
              f"export MLENG_SLURM_RESULTS={q(out_dir)}/job-$SLURM_JOB_ID",
              'mkdir -p "$MLENG_SLURM_RESULTS/nodes"',
              "# This script places the ranks itself: mleng inside it must not spread over the job again.",
              f"export {RELAUNCH_ENV}=0",
              "# srun does not inherit --cpus-per-task from sbatch since SLURM 22.05 unless told so.",
              '[ -n "${SLURM_CPUS_PER_TASK:-}" ] && export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK',
              "# The first node hosts the rendezvous; its NodeAddr is what the other nodes can reach.",
              'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
              "head_addr=$(scontrol show node \"$head_node\" 2>/dev/null | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
              'export MASTER_ADDR=${head_addr:-$head_node}',
              'export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))']
    for name, value in sorted(spec.env.items()):
        lines.append(f"export {name}={q(value)}")
    lines += [
        "",
        "# What merge needs to know, written before anything can fail.",
        'cat > "$MLENG_SLURM_RESULTS/job.json" <<JOB',
        '{"job_id": "$SLURM_JOB_ID", "nodelist": "$SLURM_JOB_NODELIST", "nodes": $SLURM_JOB_NUM_NODES,',
        f' "command": "{spec.command}", "mode": "{"torchrun" if spec.distributed else "per_node"}",'
        f' "ranks_per_node": {spec.ranks_per_node}, "gpus_per_node": {spec.gpus_per_node},',
        ' "rendezvous": "$MASTER_ADDR:$MASTER_PORT", "started_at": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"}',
        "JOB",
        'echo "mleng: job $SLURM_JOB_ID: ' + spec.command + ' on $SLURM_JOB_NUM_NODES node(s) '
        '($SLURM_JOB_NODELIST), rendezvous $MASTER_ADDR:$MASTER_PORT"',
        "",
        "# Near the time limit SLURM sends USR1 to this shell: pass SIGINT on to the step, so every",
        "# rank stops, rank 0 keeps what was measured (status interrupted), and the job still ends cleanly.",
        "step_pid=",
        "on_time_limit() {",
        '  echo "mleng: time limit near: interrupting the step" >&2',
        '  scancel --signal=INT "$SLURM_JOB_ID" 2>/dev/null || { [ -n "$step_pid" ] && kill -INT "$step_pid"; }',
        "}",
        "trap on_time_limit USR1",
        "",
    ]
    lines += _step_lines(spec, "main", _node_command(spec))
    if spec.per_node:
        lines += ["",
                  "# Then every node alone, all at once: a node whose own busbw is low is the straggler.",
                  'if [ "$rc" = 0 ]; then'] + ["  " + line for line in _step_lines(spec, "per_node",
                                                                                      _per_node_comm_command(spec))] \
                 + ["fi"]
    lines += ['echo "$rc" > "$MLENG_SLURM_RESULTS/exit_code"',
              'echo "mleng: job $SLURM_JOB_ID finished with exit code $rc"',
              "exit $rc", ""]
    return "\n".join(lines)


def _step_lines(spec: ScriptSpec, name: str, node_command: str) -> list[str]:
    # Backgrounded and waited for, so the USR1 trap runs while the step is still going.
    return [f"srun --nodes={spec.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 --job-name={name} \\",
            f"  bash -c {shlex.quote(node_command)} &",
            "step_pid=$!",
            'while :; do wait "$step_pid"; rc=$?; kill -0 "$step_pid" 2>/dev/null || break; done']


def _node_command(spec: ScriptSpec) -> str:
    """What the one task on each node runs (bash, inside srun: $SLURMD_NODENAME is this node)."""
    q = shlex.quote
    args = " ".join(q(a) for a in inner_args(spec))
    head = ['node=${SLURMD_NODENAME:-$(hostname -s)}', "set -o pipefail"]
    if spec.distributed:
        # Labels as "[n1:0]:" in the log: --role NODE: with torchrun's local rank after it.
        # stdout (rank 0's JSON record) only into torchrun's per-rank log files; stderr also to the log.
        return "\n".join(head + [
            '"$MLENG_PYTHON" -m torch.distributed.run'
            f" --nnodes={spec.nodes} --nproc-per-node={spec.ranks_per_node}"
            ' --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"'
            f" --rdzv-conf join_timeout={spec.join_timeout_s:g} --max-restarts=0"
            ' --log-dir="$MLENG_SLURM_RESULTS/torchrun/$node" --redirects=1 --tee=2 --role="$node:"'
            f" -m mleng.slurm.worker {args}",
        ])
    # stderr labelled with the node name, stdout (the JSON record) kept per node.
    return "\n".join(head + [
        f'"$MLENG_PYTHON" -m mleng {args} 2>&1 >"$MLENG_SLURM_RESULTS/nodes/$node.json" | sed "s/^/[$node] /" >&2',
    ])


def _per_node_comm_command(spec: ScriptSpec) -> str:
    q = shlex.quote
    args = " ".join(q(a) for a in ["comm", *spec.mleng_args, "--nproc", str(spec.ranks_per_node), "--json"])
    return "\n".join([
        'node=${SLURMD_NODENAME:-$(hostname -s)}', "set -o pipefail",
        # A plain launch (mleng spawns its ranks); without these the ranks would think they are the srun step.
        "unset SLURM_PROCID SLURM_STEP_ID MASTER_ADDR MASTER_PORT",
        f'"$MLENG_PYTHON" -m mleng {args} 2>&1 >"$MLENG_SLURM_RESULTS/nodes/$node.json" | sed "s/^/[$node] /" >&2',
    ])
