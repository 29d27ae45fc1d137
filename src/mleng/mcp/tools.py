"""The MCP tools: each one a mleng command, its input schema read from that command's own parser.

A tool's arguments are the command's flags (`price_from` is `--price-from`, `from` is `--from`), turned into
an argv and parsed by the CLI's parser, so defaults, types, choices and error messages are the CLI's; the
tool then calls the same function that builds what `mleng COMMAND --json` prints. No SDK import here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from mleng.errors import MlengError, UsageError


def _always(args: argparse.Namespace) -> bool:
    return True


def _never(args: argparse.Namespace) -> bool:
    return False


@dataclass(frozen=True)
class ToolSpec:
    name: str
    command: tuple[str, ...]
    description: str
    # In this process: (args, handbook index or None) -> what `--json` prints. None: always a child process.
    call: Callable[[argparse.Namespace, Any], dict] | None = None
    # True: run `mleng COMMAND --json` in a child process instead. What reads this machine does (torch and NVML
    # stay out of the server, and a driver call that hangs takes the child down, not the server).
    child: Callable[[argparse.Namespace], bool] = _never
    # True: a measurement, refused unless the server was started with --allow-measure; one at a time.
    measures: Callable[[argparse.Namespace], bool] = _never
    fixed: tuple[str, ...] = ()              # argv always given (doctor's tier)
    exclude: frozenset[str] = frozenset()    # flags not offered: files written on the server, other tiers
    overrides: dict[str, dict] = field(default_factory=dict)  # a property's schema where the CLI's differs
    uses_index: bool = False
    read_only: bool = True


# --- the calls (imports inside: building the tool list must not import what a call needs) -------------

def _ask(args, index):
    from mleng.cli.ask import result

    return result(args, index)


def _triage(args, index):
    if args.logfile == "-":
        raise UsageError("triage over MCP reads a file on the server's machine, not stdin",
                         hint="give the log's path, e.g. /var/log/job-1234.out")
    from mleng.cli.triage import result

    return result(args, index)


def _handbook_list(args, index):
    from mleng.cli.handbook import list_result

    return list_result(args, index)


def _handbook_show(args, index):
    from mleng.cli.handbook import show_result

    return show_result(args, index)


def _env(args, index):
    from mleng.cli.env import load_fingerprint

    return load_fingerprint(args.from_path)


def _doctor(args, index):
    from mleng.cli.doctor import diagnose

    return diagnose(args)[0].to_dict()


def _specs_list(args, index):
    from mleng.cli.specs import list_result

    return list_result(args)


def _specs_show(args, index):
    from mleng.cli.specs import show_result

    return show_result(args)


def _specs_compare(args, index):
    from mleng.cli.specs import compare_result

    return compare_result(args)


def _results(args, index):
    from mleng.cli.results import result

    return result(args)


def _upgrade(args, index):
    from mleng.cli.upgrade import result

    return result(args)


def _memory(args, index):
    from mleng.cli.memory import result

    return result(args)


def _plan(args, index):
    from mleng.cli.plan import result

    return result(args)


def _categories() -> list[str]:
    from mleng.handbook.model import CATEGORIES

    return list(CATEGORIES)


MEASURE_NOTE = ("A measurement: only when the server runs as `mleng mcp --allow-measure`; one at a time, stopped "
                "(SIGTERM, rows kept, status 'interrupted') at the server's --measure-cap; progress notifications "
                "while it runs. Stored in the results store unless no_store. ")

TOOLS: list[ToolSpec] = [
    ToolSpec("ask", ("ask",),
             "Look up an error line, a traceback or a described symptom in mleng's handbook of GPU-cluster "
             "training problems. Returns {query, confident, results}: results best first, each with id, title, "
             "category, score, symptoms, cause, confirm (commands), fix, applies_to, sources, matched (which "
             "signatures, codes, words), confident. `confident` false means the handbook does not seem to know "
             "the problem: the results are only possibly related. Paste the exact error line for the best answer.",
             call=_ask, uses_index=True, overrides={"text": {"type": "string", "description":
                 "the error line, traceback or symptom to look up (up to 200,000 characters are used)"}}),
    ToolSpec("triage", ("triage",),
             "Scan a whole log file on the server's machine (plain, .gz, .xz, .bz2, .zst; any size) for known "
             "problems. Returns {source, lines, bytes, elapsed_s, findings}: each finding with first_line, "
             "last_line, count, ranks, hosts, example (a log line) and the handbook entries that explain it.",
             call=_triage, uses_index=True, overrides={"logfile": {"type": "string", "description":
                 "path of the log on the server's machine"}}),
    ToolSpec("handbook_list", ("handbook", "list"),
             "The handbook's entries, by category. Returns {entries: [{id, title, category}]}. Each entry is "
             "also a resource, mleng://handbook/<id>.",
             call=_handbook_list, uses_index=True, overrides={"category": {"type": "string", "enum": _categories()}}),
    ToolSpec("handbook_show", ("handbook", "show"),
             "One handbook entry in full: id, title, category, symptoms, signatures, applies_to, cause, "
             "confirm, fix, sections (what you see, why, confirm, fix), sources, related, reproduction.",
             call=_handbook_show, uses_index=True),
    ToolSpec("env", ("env",),
             "The environment fingerprint of the server's machine (or of a recorded one with `from`): host, "
             "OS, CPU, memory, software versions (torch, CUDA, cuDNN, NCCL, driver), GPUs through NVML "
             "(clocks, power, ECC, PCIe, NVLink, NUMA), NICs, InfiniBand, limits, env vars (secrets redacted).",
             call=_env, child=lambda args: args.from_path is None),
    ToolSpec("doctor", ("doctor",),
             "mleng doctor's quick tier: health checks (GPU count, clocks, ECC, PCIe, NVLink, NUMA binding, "
             "NCCL env, /dev/shm, memlock, checkpoint disk) and, unless no_measure, the quick measurements "
             "(those need --allow-measure), each finding named after the command it runs: mamf (matmul TFLOPS), comm "
             "(all-reduce busbw), membw (memory bandwidth). With `fingerprint` it "
             "diagnoses a recorded `mleng env --json` file instead (no measurement). Returns the doctor "
             "record: rows are the findings (check, severity fail/warn/ok/inconclusive/skipped, summary, "
             "measured, expected, cause, handbook ids); summary has the verdict, counts and the ids of the "
             "measurements' own records by command (measurements).",
             call=_doctor, child=lambda args: args.fingerprint is None,
             measures=lambda args: args.fingerprint is None and not args.no_measure,
             fixed=("--quick",), exclude=frozenset({"quick", "full", "report"}), read_only=False),
    ToolSpec("specs_list", ("specs", "list"),
             "Every accelerator (or link, with kind=links) in mleng's reference data, with its units.",
             call=_specs_list),
    ToolSpec("specs_show", ("specs", "show"),
             "One accelerator or link from the reference data (dense TFLOPS by dtype, memory, bandwidth, "
             "power, links, compute units), with sources and the choices made where sources disagree.",
             call=_specs_show, overrides={"name": {"type": "string", "description":
                 "a key, product name, alias or NVML name ('h200', 'NVIDIA H200', 'ndr')"}}),
    ToolSpec("specs_compare", ("specs", "compare"),
             "Accelerators (or links) side by side: rows of {spec, unit, field, values, ratio_to_first}.",
             call=_specs_compare, overrides={"names": {"type": "array", "items": {"type": "string"}, "minItems": 2}}),
    ToolSpec("results_list", ("results", "list"),
             "Stored measurements, newest first: {store, results: [{id, kind, status, started_at, host, "
             "summary}]}.", call=_results),
    ToolSpec("results_show", ("results", "show"),
             "One stored measurement record (schema mleng.measurement/N): params, rows, summary, machine.",
             call=_results),
    ToolSpec("results_compare", ("results", "compare"),
             "Two stored runs side by side, with the ratio per row and of the headline.", call=_results),
    ToolSpec("upgrade", ("upgrade",),
             "Does moving from one GPU to another pay for itself: gate 1 capability (memory, dtypes), gate 2 "
             "throughput and cost per million tokens, the break-even price, the verdict and every assumption.",
             call=_upgrade),
    ToolSpec("memory", ("memory",),
             "Will a training (or, with inference, a serving) config fit: per-GPU memory estimated from the "
             "architecture (weights, gradients and optimizer states exactly; activations and logits from measured "
             "coefficients; or weights, KV cache and working memory), and the headroom on `gpu`. No measurement "
             "(the CLI's --measure and --calibrate are not offered).",
             call=_memory, exclude=frozenset({"calibrate", "measure", "device", "no_store"}),
             overrides={"model": {"type": "string", "description":
                 "a preset of mleng step (tiny, 1b, 8b, 70b) or a config.json on the server's machine"}}),
    ToolSpec("plan", ("plan",),
             "Is a data-parallel config communication-bound: DDP/ZeRO/FSDP traffic per step at the busbw of a stored "
             "`mleng comm` run (or `busbw`) against the compute time (a stored `mleng step` run, `tflops`, or `mfu`), "
             "per strategy, with each one's memory on `gpu`. No measurement (--run-comm is not offered).",
             call=_plan, exclude=frozenset({"run_comm", "nproc"})),
    ToolSpec("mamf", ("mamf",), MEASURE_NOTE + "Maximum achievable matmul TFLOPS by an adaptive shape search "
             "(or the shapes given); returns the measurement record (summary: best shape, median TFLOPS, "
             "theoretical, ratio, clocks).", child=_always, measures=_always, read_only=False),
    ToolSpec("membw", ("membw",), MEASURE_NOTE + "Device, host<->device and CPU memory bandwidth against the "
             "spec; returns the measurement record.", child=_always, measures=_always, read_only=False),
    ToolSpec("comm", ("comm",), MEASURE_NOTE + "Collective bandwidth (busbw/algbw as nccl-tests) between the "
             "local ranks of this node (single node; the server's launcher variables are not passed on); "
             "returns the measurement record.", child=_always, measures=_always,
             exclude=frozenset({"plot"}), read_only=False),
    ToolSpec("check", ("check",), MEASURE_NOTE + "Every local rank joins, all-reduces correctly, passes a "
             "barrier, can allocate; pairs: point-to-point bandwidth matrix. Single node; returns the record.",
             child=_always, measures=_always, read_only=False),
]

BY_NAME = {tool.name: tool for tool in TOOLS}


# --- schemas from the parsers ---------------------------------------------------------------------------

_PARSERS: dict[tuple[str, ...], argparse.ArgumentParser] = {}


def top_parser(command: str) -> argparse.ArgumentParser:
    """The `mleng` parser as the CLI builds it to run COMMAND."""
    if (command,) not in _PARSERS:
        from mleng.cli.main import build_parser

        _PARSERS[(command,)] = build_parser(command)
    return _PARSERS[(command,)]


def leaf_parser(command: tuple[str, ...]) -> argparse.ArgumentParser:
    """The parser of `mleng COMMAND [ACTION]`, whose actions are the tool's arguments."""
    parser = top_parser(command[0])
    for word in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def property_name(action: argparse.Action) -> str:
    """--price-from -> price_from, --from -> from; a positional keeps its name."""
    longs = [o for o in action.option_strings if o.startswith("--")]
    return longs[0][2:].replace("-", "_") if longs else action.dest


def options(tool: ToolSpec) -> dict[str, argparse.Action]:
    """property name -> the parser's action, for every flag and positional the tool offers."""
    out = {}
    for action in leaf_parser(tool.command)._actions:
        if (isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.dest == "json"
                or action.help == argparse.SUPPRESS):  # an old spelling kept for scripts, not offered
            continue
        name = property_name(action)
        if name not in tool.exclude:
            out[name] = action
    return out


def _value_schema(action: argparse.Action) -> dict:
    if action.type is int:
        schema: dict[str, Any] = {"type": "integer"}
    elif action.type is float:
        schema = {"type": "number"}
    elif action.type is None:
        schema = {"type": "string"}
    else:  # a parsing function of the CLI's (70B -> 7e10): it gets the text
        schema = {"type": ["string", "number"]}
    if action.choices:
        schema["enum"] = list(action.choices)
    return schema


def _is_list(action: argparse.Action) -> bool:
    return isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")


def property_schema(action: argparse.Action) -> dict:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        schema: dict[str, Any] = {"type": "boolean", "default": isinstance(action, argparse._StoreFalseAction)}
    elif _is_list(action):
        schema = {"type": "array", "items": _value_schema(action)}
        if action.nargs == "+":
            schema["minItems"] = 1
    else:
        schema = _value_schema(action)
        if action.default not in (None, argparse.SUPPRESS):
            schema["default"] = action.default
    if action.help:
        schema["description"] = action.help.replace("%%", "%")
    return schema


def _required(action: argparse.Action) -> bool:
    return action.required or (not action.option_strings and action.nargs not in ("?", "*"))


def input_schema(tool: ToolSpec) -> dict:
    props, required = {}, []
    for name, action in options(tool).items():
        schema = property_schema(action)
        if name in tool.overrides:
            schema = {**({"description": schema["description"]} if "description" in schema else {}),
                      **tool.overrides[name]}
        props[name] = schema
        if _required(action) or (name in tool.overrides and not action.option_strings):
            required.append(name)
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schema_of(tool: ToolSpec) -> dict:
    cached = _SCHEMAS.get(tool.name)
    if cached is None:
        cached = _SCHEMAS[tool.name] = input_schema(tool)
    return cached


_SCHEMAS: dict[str, dict] = {}


# --- arguments -> argv -> Namespace ---------------------------------------------------------------------

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list}


def _type_ok(value: Any, kind: str | list) -> bool:
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        if isinstance(value, bool) and k != "boolean":
            continue
        if isinstance(value, _JSON_TYPES[k]):
            return True
    return False


def _type_name(kind: str | list) -> str:
    return " or ".join(kind) if isinstance(kind, list) else kind


def check_types(tool: ToolSpec, arguments: dict) -> None:
    """Unknown names and JSON values of the wrong type; the rest (required, choices, ranges) is the CLI's to say."""
    full = schema_of(tool)
    schema = full["properties"]
    for name, value in arguments.items():
        if name not in schema:
            raise UsageError(f"unknown argument {name!r} for the tool {tool.name}",
                             hint="its arguments are: " + (", ".join(schema) or "none"))
        prop = schema[name]
        if value is None:
            continue  # an explicit null is the CLI's default
        if not _type_ok(value, prop["type"]):
            raise UsageError(f"argument {name!r} must be {_type_name(prop['type'])}, got {json.dumps(value)[:80]}")
        if prop["type"] == "array":
            kind = prop["items"]["type"]
            for item in value:
                if not _type_ok(item, kind):
                    raise UsageError(f"every item of {name!r} must be {_type_name(kind)}, got {json.dumps(item)[:80]}")
    missing = [name for name in full["required"] if arguments.get(name) is None]
    if missing:
        raise UsageError(f"missing required argument{'s' if len(missing) > 1 else ''}: {', '.join(missing)}",
                         hint=f"the tool {tool.name} takes: " + ", ".join(schema))


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def to_argv(tool: ToolSpec, arguments: dict) -> list[str]:
    """The argv of `mleng ...` these arguments stand for (without --json)."""
    check_types(tool, arguments)
    actions = options(tool)
    argv, positionals = [*tool.command, *tool.fixed], []
    for name, action in actions.items():  # the parser's order, so the argv reads as a user would type it
        value = arguments.get(name)
        if value is None:
            continue
        if not action.option_strings:
            positionals.extend(_text(v) for v in value) if isinstance(value, list) else positionals.append(_text(value))
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if value is not isinstance(action, argparse._StoreFalseAction):
                argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            argv.extend(f"{flag}={_text(v)}" for v in value)
        elif _is_list(action):
            argv.extend([flag, *(_text(v) for v in value)])
        else:
            argv.append(f"{flag}={_text(value)}")
    if positionals:
        argv += ["--", *positionals]
    return argv


def parse(tool: ToolSpec, argv: list[str]) -> argparse.Namespace:
    """argv parsed by the CLI's own parser; its refusal becomes a UsageError with the CLI's message."""
    parser = top_parser(argv[0])
    # --json right after the command words, before any positional given after "--"
    words = len(tool.command)
    full = [*argv[:words], "--json", *argv[words:]]
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = parser.parse_args(full)
    except SystemExit:
        lines = [line for line in captured.getvalue().splitlines() if line.strip()]
        message = lines[-1] if lines else f"mleng {' '.join(tool.command)}: bad arguments"
        raise CommandError(message, 2) from None
    args._argv = full
    return args


class CommandError(Exception):
    """A refusal with the CLI's own text ("mleng ask: error: ...") and exit code."""

    def __init__(self, text: str, exit_code: int):
        super().__init__(text)
        self.text = text
        self.exit_code = exit_code


def cli_error(tool: ToolSpec, exc: MlengError) -> CommandError:
    """The line the CLI prints for this error: `mleng COMMAND: error: MESSAGE` and its hint."""
    return CommandError(f"mleng {tool.command[0]}: error: {exc}", exc.exit_code)
