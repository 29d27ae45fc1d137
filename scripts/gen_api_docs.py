"""Write docs/api.md from the code: the public names of `import mleng`, their signatures and docstrings.

    python scripts/gen_api_docs.py          # rewrite docs/api.md
    python scripts/gen_api_docs.py --check  # exit 1 when docs/api.md is stale (tests/test_api.py runs this)
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path

from generated import write_or_check

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "api.md"

# Sections of the page: (title, [(the name users write, "module:attribute")])
SECTIONS = [
    ("The handbook", [("mleng.ask", "mleng.api:ask"), ("mleng.triage", "mleng.api:triage")]),
    ("Measurements (each returns the record `mleng COMMAND --json` prints)", [
        ("mleng.mamf", "mleng.api:mamf"), ("mleng.membw", "mleng.api:membw"), ("mleng.io", "mleng.api:io"),
        ("mleng.comm", "mleng.api:comm"), ("mleng.check", "mleng.api:check"), ("mleng.doctor", "mleng.api:doctor")]),
    ("Inside the training job", [
        ("mleng.preflight", "mleng.preflight:preflight"), ("mleng.PreflightError", "mleng.preflight:PreflightError"),
        ("mleng.install_crash_hook", "mleng.crashhook:install_crash_hook"),
        ("mleng.crash_hook", "mleng.crashhook:crash_hook"),
        ("python -m mleng.run", "mleng.run:main")]),
    ("Specs, records and the store", [
        ("mleng.specs.lookup", "mleng.specs.catalog:lookup"), ("mleng.Measurement", "mleng.results.record:Measurement"),
        ("mleng.results.Store", "mleng.results.store:Store")]),
    ("Errors", [("mleng.MlengError", "mleng.errors:MlengError"), ("mleng.UsageError", "mleng.errors:UsageError"),
                ("mleng.CheckFailed", "mleng.errors:CheckFailed"),
                ("mleng.NotAvailableError", "mleng.errors:NotAvailableError"),
                ("mleng.StoreError", "mleng.errors:StoreError")]),
    # Read from their source ("source:"), so the page is the same with or without the frameworks installed.
    ("Callbacks for training frameworks (optional extras)", [
        ("mleng.integrations.hf.MlengCallback", "source:mleng.integrations.hf:MlengCallback"),
        ("mleng.integrations.lightning.MlengCallback", "source:mleng.integrations.lightning:MlengCallback")]),
    ("Types of the handbook answers", [("mleng.api.Answer", "mleng.api:Answer"), ("mleng.api.Match", "mleng.api:Match"),
                                       ("mleng.api.TriageReport", "mleng.api:TriageReport"),
                                       ("mleng.api.TriageFinding", "mleng.api:TriageFinding")]),
]

# Examples for the names whose docstrings live in modules of their own (the specs, the record, the store).
EXAMPLES = {
    "mleng.specs.lookup": """>>> h100 = mleng.specs.lookup("h100")
>>> h100.name, h100.peak_tflops("bf16"), h100.intra_node_gbps
('NVIDIA H100 SXM 80GB', 989.0, 450)""",
    "mleng.Measurement": """>>> record = mleng.mamf(device="cpu", m=512, n=512, k=512, no_store=True)
>>> record.kind, sorted(record.to_dict())[:4]
('mamf', ['elapsed_s', 'error', 'id', 'kind'])""",
    "mleng.results.Store": """>>> with mleng.results.Store() as store:      # $MLENG_HOME/results.sqlite
...     last = store.list(kind="preflight", limit=1)[0]
...     record = store.get(last["id"])""",
}

HEADER = """# The mleng Python API

Generated from the code by `python scripts/gen_api_docs.py`; do not edit by hand (`tests/test_api.py` fails
when this page is stale). `import mleng` imports neither torch nor anything heavy: every name below is loaded
when it is first used. The measuring functions take the flags of their command by name (`--max-seconds` is
`max_seconds`, `--no-store` is `no_store`), with the same defaults, and are parsed by the command's own parser:
what the CLI refuses raises `mleng.UsageError` with the CLI's message. They return the record the CLI stores
and prints with `--json` (`record.to_dict()`), and store it as the CLI does.
"""


def _resolve(target: str):
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _doc(obj) -> str:
    return textwrap.dedent(inspect.getdoc(obj) or "").strip()


def _annotation(value) -> str:
    if isinstance(value, str):
        return value.strip("'\"")
    return getattr(value, "__forward_arg__", None) or getattr(value, "__name__", None) or str(value)


def _parameters(signature: inspect.Signature, skip_first: bool = False) -> str:
    parts, star = [], False
    params = list(signature.parameters.values())[1 if skip_first else 0:]
    for p in params:
        if p.name.startswith("_"):
            continue  # private fields (a dataclass's internal clock)
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        text = ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            default = "<factory>" if repr(p.default) == "<factory>" else repr(p.default)
            text += f" = {default}"
        parts.append(text)
    result = f"({', '.join(parts)})"
    if signature.return_annotation is not signature.empty and signature.return_annotation != "None" or \
            (signature.return_annotation == "None" and not skip_first):
        result += f" -> {_annotation(signature.return_annotation)}"
    return result


def _signature(name: str, obj, skip_first: bool = False) -> str:
    try:
        return f"{name}{_parameters(inspect.signature(obj), skip_first)}"
    except (TypeError, ValueError):
        return name


def _typed_dict(name: str, obj) -> list[str]:
    fields = ", ".join(f"{k}: {_annotation(v)}" for k, v in obj.__annotations__.items())
    return [f"### `{name}`", "", f"TypedDict `{{{fields}}}`", "", _doc(obj), ""]


def _class(name: str, obj) -> list[str]:
    import dataclasses

    if dataclasses.is_dataclass(obj):  # its fields, without the defaults (those belong to the record's code)
        fields = ", ".join(f"{f.name}: {_annotation(f.type)}" for f in dataclasses.fields(obj)
                           if not f.name.startswith("_"))
        lines = [f"### `{name}`", "", f"A dataclass: `{fields}`.", ""]
    elif issubclass(obj, BaseException):
        lines = [f"### `{name}`", ""]
    else:
        lines = [f"### `{name}{_parameters(inspect.signature(obj)).split(' -> ')[0]}`", ""]
    base = obj.__mro__[1].__name__
    if issubclass(obj, BaseException):
        lines += [f"Subclass of `{base}`; exit code {getattr(obj, 'exit_code', '-')} on the command line.", ""]
    lines += [_doc(obj), ""]
    for attr, member in sorted(vars(obj).items()):
        if attr.startswith("_") or not (inspect.isfunction(member) or isinstance(member, (classmethod, property))):
            continue
        function = member.__func__ if isinstance(member, classmethod) else member
        if isinstance(member, property):
            lines += [f"- `{name}.{attr}` (property)" + (f": {_doc(member).splitlines()[0]}" if _doc(member) else "")]
            continue
        first = _doc(function).split("\n\n")[0].replace("\n", " ") if _doc(function) else ""
        lines.append(f"- `{_signature(f'{name}.{attr}', function, skip_first=True)}`" + (f": {first}" if first else ""))
    return lines + [""]


def _from_source(name: str, target: str) -> list[str]:
    """A class of a module that imports an optional framework: its docstring and hooks from the source, its
    constructor from the framework-free base it names first (`from mleng... import Base`)."""
    module, _, attribute = target.partition(":")
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())  # the module is not run
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == attribute)
    imported = {a.asname or a.name: f"{n.module}:{a.name}" for n in tree.body if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith("mleng") for a in n.names}
    base = next(imported[b.id] for b in node.bases if isinstance(b, ast.Name) and b.id in imported)
    heading = _parameters(inspect.signature(_resolve(base).__init__), skip_first=True).split(" -> ")[0]
    lines = [f"### `{name}{heading}`", "", textwrap.dedent(ast.get_docstring(node) or "").strip(), ""]
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
            args = ast.unparse(item.args).split(", ", 1)[1:]  # without self
            lines.append(f"- `{name}.{item.name}({args[0] if args else ''})`")
    return lines + [""]


def render() -> str:
    out = [HEADER]
    for title, names in SECTIONS:
        out += [f"## {title}", ""]
        for name, target in names:
            if target.startswith("source:"):
                out += _from_source(name, target.removeprefix("source:"))
                continue
            obj = _resolve(target)
            if name.startswith("python -m"):
                out += [f"### `{name} SCRIPT [ARGS...]`", "", _doc(importlib.import_module("mleng.run")), ""]
            elif inspect.isclass(obj) and hasattr(obj, "__annotations__") and getattr(obj, "__total__", None) is not None:
                out += _typed_dict(name, obj)
            elif inspect.isclass(obj):
                out += _class(name, obj)
            else:
                out += [f"### `{_signature(name, obj)}`", "", _doc(obj), ""]
            if name in EXAMPLES:
                out += ["Example:", *("    " + line for line in EXAMPLES[name].splitlines()), ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/api.md differs from the code")
    args = parser.parse_args(argv)
    return write_or_check(OUTPUT, render(), ROOT, "python scripts/gen_api_docs.py", args.check)


if __name__ == "__main__":
    sys.exit(main())
