"""The `mleng` command: a registry of subcommands, each imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from mleng import __version__
from mleng.errors import EXIT_OK, EXIT_USAGE, MlengError

# name -> (module, one-line help). Modules are imported only for the command that runs,
# so `mleng --help` and the light commands never pay for torch or matplotlib.
COMMANDS: dict[str, tuple[str, str]] = {
    "env": ("mleng.cli.env", "fingerprint this machine: versions, GPUs, links, NUMA, NICs, env vars"),
    "specs": ("mleng.cli.specs", "reference specs of accelerators and links (list, show, compare)"),
    "results": ("mleng.cli.results", "stored measurements (list, show, export, delete, compare)"),
    "mamf": ("mleng.cli.mamf", "maximum achievable matmul TFLOPS, found by an adaptive shape search"),
    "comm": ("mleng.cli.comm", "collective bandwidth (all-reduce and friends), busbw/algbw as nccl-tests"),
    "check": ("mleng.cli.check", "every rank can talk: init, all-reduce, barrier, allocation, --pairs"),
    "membw": ("mleng.cli.membw", "device, host<->device and CPU memory bandwidth"),
    "io": ("mleng.cli.io", "storage throughput for checkpoints and dataloaders"),
    "ask": ("mleng.cli.ask", "look up a pasted error line or a symptom in the handbook"),
    "triage": ("mleng.cli.triage", "scan a log for known problems and explain them"),
    "handbook": ("mleng.cli.handbook", "handbook tools: lint, site, skill, list, show"),
    "doctor": ("mleng.cli.doctor", "run the health checks and quick measurements; say what is wrong"),
    "report": ("mleng.cli.report", "a self-contained HTML report of stored runs"),
    "upgrade": ("mleng.cli.upgrade", "does a GPU generation upgrade pay for itself"),
    "slurm": ("mleng.cli.slurm", "write and run sbatch scripts that run mleng across nodes"),
    "hang": ("mleng.cli.hang", "hang forensics: py-spy dumps of every rank, flight-recorder analysis"),
    "step": ("mleng.cli.step", "a real training step measured: tokens/s, MFU vs peak and MAMF, memory, breakdown"),
    "mcp": ("mleng.cli.mcp", "serve the handbook and the measurements to AI agents over MCP (stdio)"),
    "memory": ("mleng.cli.memory", "will it fit: per-GPU memory of a training or inference config, from the architecture"),
    "plan": ("mleng.cli.plan", "is it communication-bound: DDP/ZeRO/FSDP traffic at measured busbw vs compute time"),
}


def json_parent() -> argparse.ArgumentParser:
    """A parent parser holding --json, for leaf subparsers of nested commands."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print machine-readable JSON instead of tables")
    return parent


def _load(name: str):
    module_name = COMMANDS[name][0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mleng",
        description="Measure the real machine, compare it with theory, look up the pitfall, decide.",
        epilog="Exit codes: 0 ok, 1 a check found a problem, 2 bad usage or input.",
    )
    parser.add_argument("--version", action="version", version=f"mleng {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        module = _load(name)
        command_parser = sub.add_parser(name, help=help_text, description=help_text,
                                        parents=[json_parent()])
        if module is not None:
            module.add_arguments(command_parser)
            command_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    module = getattr(args, "_module", None)
    if module is None:
        print(f"mleng {args.command}: not available in this version of mleng", file=sys.stderr)
        return EXIT_USAGE
    if not hasattr(args, "json"):
        args.json = False
    args._argv = list(argv)  # commands that re-run themselves as N local ranks (comm, check) need it
    from mleng import signals

    signals.install()
    # torch warns at import when numpy is absent; mleng never hands torch a numpy array, so it is noise.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        code = int(module.run(args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe is reported here, not at interpreter exit
        return code
    except MlengError as exc:
        print(f"mleng {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"mleng {args.command}: interrupted by {signals.describe()}", file=sys.stderr)
        return signals.exit_code()
    except BrokenPipeError:
        # `mleng specs list | head -1`: the reader had enough. Not a problem found; say nothing more.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_OK
