"""The Python API: each `mleng COMMAND` as a function that returns what `mleng COMMAND --json` prints.

Keyword arguments are the command's flags by their names (`--max-seconds` is `max_seconds`), with the same
defaults; they are turned into the command's own argument list and parsed by its own parser, so a value the
CLI refuses is refused here with the same message (a `UsageError`), and the same library code runs. What
the CLI stores, the API stores (unless `no_store=True`). Nothing here prints except the warnings the CLI
prints on stderr. `docs/api.md` is generated from this module (bench/gen_api_docs.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any, Sequence, TypedDict

from mleng.errors import CheckFailed, MlengError, UsageError

if TYPE_CHECKING:
    from mleng.results.record import Measurement

__all__ = ["ask", "triage", "mamf", "comm", "check", "membw", "io", "doctor", "step", "memory", "Answer", "Match",
           "TriageReport", "TriageFinding"]


class Match(TypedDict):
    """One handbook entry that answers a query (one item of `mleng ask --json`'s `results`)."""

    id: str
    title: str
    category: str
    score: float
    confident: bool
    cause: str
    confirm: list[str]
    fix: list[str]
    sources: list[str]
    matched: dict[str, Any]


class Answer(TypedDict):
    """What `mleng ask --json` prints: `confident` is true when the best match is a real answer."""

    query: str
    confident: bool
    results: list[Match]


class TriageFinding(TypedDict):
    """One known problem found in a log: where, how often, on which ranks/hosts, and the entries."""

    first_line: int
    last_line: int
    count: int
    example: str
    ranks: list[str]
    hosts: list[str]
    labels_truncated: bool
    entries: list[dict[str, Any]]


class TriageReport(TypedDict):
    """What `mleng triage --json` prints."""

    source: str
    lines: int
    bytes: int
    elapsed_s: float
    findings: list[TriageFinding]


class _Parser(argparse.ArgumentParser):
    """The command's own parser, raising UsageError (the CLI's message) instead of exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message, hint=f"see `{self.prog} --help`")


def _command_parser(command: str) -> argparse.ArgumentParser:
    from mleng.cli.main import COMMANDS

    module = importlib.import_module(COMMANDS[command][0])
    parser = _Parser(prog=f"mleng {command}", add_help=False)
    module.add_arguments(parser)
    return parser


def command_options(command: str) -> dict[str, argparse.Action]:
    """The flags and positionals of `mleng COMMAND`, by their Python name (dest)."""
    return {a.dest: a for a in _command_parser(command)._actions if a.help != argparse.SUPPRESS}  # not old aliases


def _text(value: Any) -> str:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def command_argv(command: str, values: dict[str, Any]) -> list[str]:
    """The argument list `mleng COMMAND` would be given for these keyword values (None: the flag's default)."""
    actions = command_options(command)
    flags: list[str] = []
    positionals: list[str] = []
    for name, value in values.items():
        action = actions.get(name)
        if action is None:
            raise TypeError(f"mleng.{command}() got an unexpected keyword argument {name!r}")
        if value is None:
            continue
        if not action.option_strings:
            positionals.extend(_text(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise TypeError(f"mleng.{command}(): {name} is a switch ({flag}); pass True or False")
            if value:
                flags.append(flag)
            continue
        if isinstance(value, bool) and action.choices is not None and set(action.choices) == {"on", "off"}:
            value = "on" if value else "off"
        if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            if isinstance(action, argparse._AppendAction):
                for item in items:
                    flags += [flag, _text(item)]
            else:
                flags += [flag, *(_text(v) for v in items)]
            continue
        flags += [flag, _text(value)]
    return flags + (["--", *positionals] if positionals else [])


def _parse(command: str, values: dict[str, Any]) -> argparse.Namespace:
    argv = command_argv(command, values)
    args = _command_parser(command).parse_args(argv)
    args.command, args.json, args._argv = command, False, [command, *argv]
    return args


def _store(measurement: "Measurement", args: argparse.Namespace) -> "Measurement":
    from mleng.cli.common import store_or_warn

    store_or_warn(measurement, args)
    return measurement


# ---------------------------------------------------------------------------------------------
# The handbook
# ---------------------------------------------------------------------------------------------

def ask(text: str, limit: int = 3) -> Answer:
    """The handbook entries that best explain an error line or a described symptom (`mleng ask TEXT --json`).

    `confident` (on the answer and on each match) says whether the entry is a real answer or only the least
    bad of unrelated ones; an unknown problem gives `confident=False`, never a made-up match.

    Example:
        >>> answer = mleng.ask("RuntimeError: Expected all tensors to be on the same device, but found at "
        ...                    "least two devices, cuda:0 and cpu!")
        >>> answer["confident"], answer["results"][0]["id"]
        (True, 'tensors-on-different-devices')
    """
    from mleng.cli.ask import result

    if not isinstance(text, str):
        raise TypeError(f"mleng.ask() takes the text as a str, got {type(text).__name__}")
    if text.strip() == "-":
        raise UsageError("'-' means stdin on the command line; pass the text itself")
    args = _parse("ask", {"limit": limit})
    args.text = [text]  # as typed: no splitting, no option parsing of a line that starts with '-'
    return result(args)  # type: ignore[return-value]


def triage(path: str | os.PathLike[str]) -> TriageReport:
    """Scan a log (plain, .gz, .xz, .bz2 or .zst; '-' for stdin) for known problems (`mleng triage PATH --json`).

    Example:
        >>> report = mleng.triage("train.log")   # a line "[rank1]:[E ProcessGroupNCCL.cpp:1684] ... Watchdog caught
        >>> # collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, ...) ran for 600012 milliseconds ..."
        >>> [(f["first_line"], f["ranks"], f["entries"][0]["id"]) for f in report["findings"]]
        [(2, ['1'], 'nccl-watchdog-timeout')]
    """
    from mleng.cli.triage import result

    return result(_parse("triage", {"logfile": path}))  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Measurements on this process's machine
# ---------------------------------------------------------------------------------------------

def mamf(*, device: str | int | None = None, all_devices: bool = False, dtype: str | None = None,
         tf32: bool | str = "off", fp8_fast_accum: bool = False, max_seconds: float = 60.0,
         grid: Sequence[str] | None = None, m: Sequence[int] | int | None = None, m_range: str | None = None,
         n: Sequence[int] | int | None = None, n_range: str | None = None, k: Sequence[int] | int | None = None,
         k_range: str | None = None, iters: int | None = None, min_dim: int | None = None,
         max_dim: int | None = None, step: int = 64, no_seeds: bool = False,
         no_store: bool = False) -> "Measurement":
    """Maximum achievable matmul TFLOPS (`mleng mamf --json`): a Measurement of kind 'mamf', stored unless
    `no_store`. `summary["tflops_median"]` is the headline, `summary["best_shape"]` where it was reached.

    Example:
        >>> record = mleng.mamf(device="cpu", m=512, n=512, k=512, max_seconds=10, no_store=True)
        >>> record.status, record.summary["best_shape"]
        ('complete', '512x512x512')
    """
    values = dict(locals())
    from mleng.cli.mamf import measure

    args = _parse("mamf", values)
    return _store(measure(args), args)


def membw(*, device: str | int | None = None, all_devices: bool = False, size: str | int | None = None,
          op: Sequence[str] | str | None = None, engine: str = "all", iters: int = 20, warmup: int = 5,
          threads: int | None = None, no_store: bool = False) -> "Measurement":
    """Device, host<->device and CPU memory bandwidth (`mleng membw --json`): a Measurement of kind 'membw'.

    Example:
        >>> record = mleng.membw(size="64MiB", op="copy", iters=5, no_store=True)
        >>> round(record.summary["value"]) > 0   # copy GB/s
        True
    """
    values = dict(locals())
    from mleng.cli.membw import measure

    args = _parse("membw", values)
    return _store(measure(args), args)


def io(path: str | os.PathLike[str], *, size: str | int = "1GiB", jobs: int = 4, duration: float = 10.0,
       op: Sequence[str] | str | None = None, engine: str = "auto", baseline: str | None = None, files: int = 2000,
       no_store: bool = False) -> "Measurement":
    """Checkpoint save/load, dataloader random reads and metadata rates of the file system holding `path`
    (`mleng io PATH --json`): a Measurement of kind 'io'.

    Example:
        >>> record = mleng.io("/tmp", size="64MiB", jobs=2, duration=1, op="ckpt-save", no_store=True)
        >>> [(r["workload"], r["bandwidth_gbps"] > 0) for r in record.rows]
        [('ckpt-save', True)]
    """
    values = dict(locals())
    from mleng.cli.io import measure

    args = _parse("io", values)
    return _store(measure(args), args)


def doctor(*, quick: bool = False, full: bool = False, expect_gpus: int | None = None,
           checkpoint_dir: str | os.PathLike[str] | None = None, no_measure: bool = False,
           fingerprint: str | os.PathLike[str] | None = None, cpus: str | None = None, since: str | None = None,
           kernel_log: str | os.PathLike[str] | None = None, burn: str | None = None,
           no_store: bool = False) -> "Measurement":
    """The health checks and quick measurements (`mleng doctor --json`): a Measurement of kind 'doctor' whose
    rows are findings (`check`, `severity` ok/warn/fail/inconclusive/skipped, `summary`, `handbook` ids);
    `summary["verdict"]` is the overall answer. A quick measurement's finding is named after the command it runs
    (`mamf`, `comm`, `membw`, `io`), and so is its record's id in `summary["measurements"]`; doctor runs stored
    before read under these names too. For the HTML report use `mleng doctor --report`.

    Example:
        >>> record = mleng.doctor(no_measure=True, no_store=True)
        >>> record.summary["verdict"], [r["check"] for r in record.rows if r["severity"] == "fail"]
        ('ok', [])
    """
    values = dict(locals())
    from mleng.cli.doctor import diagnose

    args = _parse("doctor", values)
    record, _stored, _report, _note = diagnose(args)
    return record


# ---------------------------------------------------------------------------------------------
# Measurements across ranks: a job of their own, started the way `mleng comm` starts one
# ---------------------------------------------------------------------------------------------

def comm(*, op: Sequence[str] | str | None = None, min_bytes: str | int = "1M", max_bytes: str | int | None = None,
         factor: float = 2.0, dtype: str = "float32", iters: int = 20, warmup: int = 5, repeats: int = 5,
         blocking: bool = False, check: bool = False, backend: str | None = None, nproc: int | None = None,
         timeout: float = 120.0, min_busbw: float | None = None, reference_gbps: float | None = None,
         plot: str | os.PathLike[str] | None = None, no_store: bool = False,
         no_cuda_graph: bool = False) -> "Measurement":
    """Collective bandwidth, busbw/algbw as nccl-tests (`mleng comm --json`): a Measurement of kind 'comm'.

    It runs as its own job of `nproc` local ranks (default: one per GPU, 2 on a CPU), or across the nodes of
    the SLURM allocation it is called in, exactly as `mleng comm` typed in a shell. Inside a torchrun or
    srun job use `mleng.preflight()`, which measures in the job's own process group. Raises CheckFailed
    (the CLI's exit 1; the record in its `.measurement`) for wrong results, impossible rates or a peak below
    `min_busbw`.

    Example:
        >>> record = mleng.comm(nproc=2, max_bytes="4M", iters=5, no_store=True)
        >>> record.summary["ops"]["all_reduce"]["peak_busbw_gbps"] > 0
        True
    """
    values = dict(locals())
    from mleng.cli.comm import settings_from

    args = _parse("comm", values)
    settings_from(args)  # bad input refused here, with the CLI's message, before any rank starts
    return _run_ranks("comm", args._argv)


def check(*, timeout: float = 60.0, alloc_gib: float = 0.0, pairs: str | None = None, pair_bytes: str | int = "16M",
          pair_iters: int = 5, outlier_ratio: float = 0.7, backend: str | None = None, no_store: bool = False,
          nproc: int | None = None) -> "Measurement":
    """Every rank can talk: joins in time, all-reduces correctly, passes a barrier, can allocate; with
    `pairs="ranks"` or `"nodes"` the point-to-point bandwidth matrix (`mleng check --json`): a Measurement of
    kind 'check'. A job of its own, as `comm`. Raises CheckFailed (the record in `.measurement`) when
    the CLI exits 1: a rank missing, a wrong all-reduce, a failed allocation, slow pairs.

    Example:
        >>> record = mleng.check(nproc=2, timeout=10, no_store=True)
        >>> record.summary["verdict"], record.summary["world_size"]
        ('ok', 2)
    """
    args = _parse("check", dict(locals()))
    return _run_ranks("check", args._argv)


def step(*, model: str | None = None, config: str | os.PathLike[str] | None = None, layers: int | None = None,
         seq: int | None = None, micro_batch: int = 1, grad_accum: int | None = None, global_batch: int | None = None,
         steps: int = 10, warmup: int = 3, profile_steps: int = 2, dtype: str | None = None,
         parallel: str | None = None, compile: str | bool | None = None, activation_checkpointing: bool = False,
         tokens: str | os.PathLike[str] | None = None, tokens_dtype: str = "uint16", lr: float = 0.0003,
         seed: int = 0, device: str | None = None, mamf: bool = False, mamf_seconds: float | None = None,
         nproc: int | None = None, timeout: float = 300.0, out: str | os.PathLike[str] | None = None,
         no_store: bool = False) -> "Measurement":
    """A real training step of a built-in Llama-style model, measured (`mleng step --json`): a Measurement of
    kind 'step' with tokens/s, MFU against the sourced peak, MAMFU against this GPU's stored MAMF, memory and
    where the time goes. A job of its own, as `comm` (`nproc` local ranks, or srun inside an allocation);
    bad input is a UsageError with the CLI's message before any rank starts.

    Example:
        >>> record = mleng.step(model="tiny", steps=3, warmup=1, profile_steps=1, no_store=True)
        >>> record.kind, record.summary["tokens_per_s"] > 0
        ('step', True)
    """
    args = _parse("step", dict(locals()))
    return _run_ranks("step", args._argv)


def memory(model: str | os.PathLike[str] | None = None, *, layers: int | None = None, seq: int = 2048,
           micro_batch: int = 1, grad_accum: int | None = None, dtype: str | None = None, optimizer: str = "adamw",
           zero: int = 0, fsdp: bool = False, gpus: int = 1, tp: int = 1, pp: int = 1, recompute: str | None = None,
           inference: bool = False, weights: str = "bf16", kv_dtype: str = "bf16", max_batched_tokens: int = 8192,
           gpu: str | None = None, usable_gib: float | None = None, context_gib: float | None = None,
           nccl_gib: float | None = None, fragmentation: float | None = None, measure: bool = False,
           device: str | None = None, coefficients: str | os.PathLike[str] | None = None, no_store: bool = False,
           step: str | None = None) -> dict[str, Any]:
    """Will a training (or, with `inference=True`, a serving) config fit: the per-GPU memory estimated from
    the architecture, as `mleng memory --json` prints it (`measure=True` adds a real step's peak; `step=ID`
    compares a stored `mleng step` run with the estimate of its own config). Calibrating the coefficients
    writes the data file and stays a command: `mleng memory --calibrate`.

    Example:
        >>> out = mleng.memory("8b", seq=8192, recompute="full", gpu="h200")
        >>> out["gpu"]["fits"], round(out["total_bytes"] / 2**30, 1), out["gpu"]["longest_seq"]
        (True, 126.3, 16806)
    """
    values = dict(locals())
    from mleng.cli.memory import result

    return result(_parse("memory", values))


# Variables that make a process one rank of someone else's job: the child must start its own.
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                     "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                     "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")


def _run_ranks(command: str, argv: list[str]) -> "Measurement":
    """`python -m mleng COMMAND --json ...` as a child: its ranks, its record on stdout, its error on stderr."""
    from mleng.distributed.launch import detect
    from mleng.results.record import Measurement

    launch = detect()
    if launch is not None:
        raise UsageError(f"mleng.{command}() starts a job of its own ranks, and this process is already rank "
                         f"{launch.rank} of {launch.world_size} ({launch.mode})",
                         hint="inside a torchrun/srun job call mleng.preflight(), which uses the job's own "
                              f"process group; or run `mleng {command}` from the launcher")
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    proc = subprocess.Popen([sys.executable, "-m", "mleng", argv[0], "--json", *argv[1:]], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    error_prefix = f"mleng {command}: error: "

    def pump() -> None:  # the ranks' warnings still reach the caller's stderr, as they come
        assert proc.stderr is not None
        held = False
        for line in proc.stderr:
            lines.append(line)
            # the error itself comes back as the exception, not twice
            held = line.startswith(error_prefix) or (held and line.startswith("  what to do: "))
            if not held:
                sys.stderr.write(line)
                sys.stderr.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        assert proc.stdout is not None
        out = proc.stdout.read()  # stderr is the pump's: communicate() would read it too
        proc.wait()
    except BaseException:
        proc.terminate()  # Ctrl-C in the caller stops the ranks too
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    reader.join(timeout=5)
    record = _record_from(out)
    if proc.returncode == 0 and record is not None:
        return record
    message, hint = _error_from(lines, command)
    if proc.returncode in (130, 143):
        if record is not None:
            return record  # interrupted: the rows measured so far, status 'interrupted'
        raise KeyboardInterrupt
    if proc.returncode == 1:
        error = CheckFailed(message or f"mleng {command} found a problem", hint=hint)
        error.measurement = record  # type: ignore[attr-defined]
        raise error
    error_type = UsageError if proc.returncode == 2 else MlengError
    raise error_type(message or f"mleng {command} ended with exit code {proc.returncode}", hint=hint)


def _record_from(out: str) -> "Measurement | None":
    from mleng.results.record import Measurement

    start = out.find("{")
    if start < 0:
        return None
    try:
        return Measurement.from_dict(json.loads(out[start:]))
    except (ValueError, MlengError):
        return None


def _error_from(lines: list[str], command: str) -> tuple[str | None, str | None]:
    """The CLI's own 'mleng COMMAND: error: MESSAGE' and its '  what to do: HINT' line, from the child's stderr."""
    prefix = f"mleng {command}: error: "
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(prefix):
            message = lines[i][len(prefix):].rstrip("\n")
            hint = None
            if i + 1 < len(lines) and lines[i + 1].startswith("  what to do: "):
                hint = lines[i + 1][len("  what to do: "):].rstrip("\n")
            return message, hint
    return None, None
