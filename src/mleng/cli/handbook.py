"""`mleng handbook`: lint the entries, list and show them, export the static site and the agent skill."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mleng.cli.main import json_parent
from mleng.cli.render import emit, print_json, table
from mleng.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub.add_parser("lint", parents=[json_parent()],
                   help="check every entry against the format; exit 1 on problems")
    listing = sub.add_parser("list", parents=[json_parent()], help="entry ids and titles, by category")
    listing.add_argument("--category", help="only this category")
    show = sub.add_parser("show", parents=[json_parent()], help="one entry in full")
    show.add_argument("id")
    site = sub.add_parser("site", parents=[json_parent()],
                          help="a static, self-contained HTML site with search (works from file://)")
    site.add_argument("out", help="output directory (created; existing pages are overwritten)")
    skill = sub.add_parser("skill", parents=[json_parent()],
                           help="a SKILL.md teaching an AI agent to use mleng and the handbook")
    skill.add_argument("out", help="output directory or .md file path")


def run(args: argparse.Namespace) -> int:
    return {"lint": _lint, "list": _list, "show": _show, "site": _site, "skill": _skill}[args.action](args)


def _lint(args) -> int:
    from mleng.handbook.lint import lint
    from mleng.handbook import default_entries_dir

    directory = default_entries_dir()
    count, problems = lint(directory)
    if args.json:
        print_json({"directory": str(directory), "entries": count, "ok": not problems,
                    "problems": [p.to_dict() for p in problems]})
    else:
        for problem in problems:
            print(problem)
        files_with_problems = len({p.file for p in problems})
        verdict = "ok" if not problems else \
            f"{_plural(len(problems), 'problem')} in {_plural(files_with_problems, 'file')}"
        print(f"mleng handbook lint: {_plural(count, 'entry', 'entries')} in {directory}: {verdict}",
              file=sys.stderr if problems else sys.stdout)
    return 1 if problems else 0


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _entries(command: str, index=None):
    from mleng.cli.ask import warn_skipped
    from mleng.handbook.index import open_index

    opened = open_index() if index is None else index
    try:
        warn_skipped(opened.skipped, command)
        return [e.data for e in opened.entries]
    finally:
        if index is None:
            opened.close()


def _list(args) -> int:
    listing = list_result(args)
    if args.json:
        print_json(listing)
    else:
        print(table(listing["entries"], ["category", "id", "title"]))
        print(f"{len(listing['entries'])} entries")
    return 0


def list_result(args, index=None) -> dict:
    """What `mleng handbook list --json` prints: {"entries": [{"id", "title", "category"}]}, by category."""
    from mleng.handbook.model import CATEGORIES

    if args.category and args.category not in CATEGORIES:
        raise UsageError(f"unknown category {args.category!r}", hint="use one of: " + ", ".join(CATEGORIES))
    entries = [e for e in _entries("handbook list", index) if not args.category or e["category"] == args.category]
    order = {c: i for i, c in enumerate(CATEGORIES)}
    entries.sort(key=lambda e: (order.get(e["category"], 99), e["id"]))
    return {"entries": [{k: e[k] for k in ("id", "title", "category")} for e in entries]}


def _show(args) -> int:
    entry = show_result(args)
    emit(args, entry, render_entry)
    return 0


def show_result(args, index=None) -> dict:
    """What `mleng handbook show ID --json` prints: the whole entry."""
    entries = {e["id"]: e for e in _entries("handbook show", index)}
    entry = entries.get(args.id)
    if entry is None:
        import difflib

        close = difflib.get_close_matches(args.id, list(entries), n=3, cutoff=0.4)
        raise UsageError(f"no handbook entry {args.id!r}",
                         hint=("did you mean: " + ", ".join(close)) if close else "see `mleng handbook list`")
    # The index leaves out each entry's `verified` list (search never reads it); the file has it.
    from mleng.handbook.model import EntryError, parse_entry

    try:
        entry = parse_entry(Path(entry["path"])).to_dict()
    except EntryError as exc:
        print(f"mleng handbook show: warning: {exc.file}: {exc.field}: {exc.message}; shown as indexed, without "
              "its verified list (run `mleng handbook lint`)", file=sys.stderr)
    return {k: v for k, v in entry.items() if k != "path"}


def render_entry(entry: dict) -> str:
    lines = [entry["title"], f"id: {entry['id']}   category: {entry['category']}", ""]
    lines.append(f"applies to: {entry['applies_to'].get('software', '-')}; {entry['applies_to'].get('hardware', '-')}")
    lines.append("")
    lines.append("symptoms:")
    lines.extend(f"  - {s}" for s in entry["symptoms"])
    lines.append("")
    lines.append(f"cause: {entry['cause']}")
    for name, items in (("confirm", entry["confirm"]), ("fix", entry["fix"])):
        lines.append("")
        lines.append(f"{name}:")
        lines.extend(f"  - {i}" for i in items)
    for heading, text in entry["sections"].items():
        lines.extend(["", f"## {heading}", text])
    lines.append("")
    lines.append("sources:")
    lines.extend(f"  - {s}" for s in entry["sources"])
    if entry.get("related"):
        lines.append("related: " + ", ".join(entry["related"]))
    if entry.get("reproduction"):
        lines.append(f"reproduction: {entry['reproduction']}")
    return "\n".join(lines)


def output_folder(path: str, what: str) -> Path:
    """A folder the command writes into: it may exist, or be created inside an existing folder;
    mleng creates no parent folders the user did not name (as with mkdir without -p)."""
    if not path.strip():
        raise UsageError(f"the {what} folder is empty", hint="give a folder, e.g. ./site")
    target = Path(path).expanduser()
    if target.exists():
        if not target.is_dir():
            raise UsageError(f"{path} exists and is not a folder", hint=f"give a folder for the {what}")
        return target
    parent = target.parent
    if not parent.is_dir():
        raise UsageError(f"{path}: the folder {parent} does not exist",
                         hint="create it first or choose an existing folder (mleng creates only the last folder)")
    return target


def _site(args) -> int:
    from mleng.handbook.site import write_site

    output_folder(args.out, "site")
    entries = _entries("handbook site")
    index_path = write_site(entries, Path(args.out))
    if args.json:
        print_json({"out": str(Path(args.out)), "index": str(index_path), "entries": len(entries)})
    else:
        print(f"wrote {len(entries)} entry pages and {index_path}")
    return 0


def _skill(args) -> int:
    from mleng.handbook.skill import write_skill

    if args.out.lower().endswith(".md"):
        from mleng.cli.common import check_output_path

        check_output_path(args.out, "OUT", (".md",))
    else:
        output_folder(args.out, "skill")
    entries = _entries("handbook skill")
    path = write_skill(entries, Path(args.out))
    if args.json:
        print_json({"out": str(path), "entries": len(entries)})
    else:
        print(f"wrote {path} ({len(entries)} entries)")
    return 0
