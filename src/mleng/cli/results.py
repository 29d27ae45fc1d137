"""`mleng results`: list, show, export and delete stored measurements."""

from __future__ import annotations

import argparse
import sys

from mleng.cli.main import json_parent
from mleng.cli.render import print_json, table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = sub.add_parser("list", parents=[json_parent()], help="stored runs, newest first")
    listing.add_argument("--kind", help="only this kind: the command that made it (mamf, comm, check, membw, io, step, doctor, ...)")
    listing.add_argument("--limit", type=int, default=50)
    show = sub.add_parser("show", parents=[json_parent()], help="one run: summary and rows")
    show.add_argument("id", help="a run id, a unique prefix of one, or 'last'")
    export = sub.add_parser("export", parents=[json_parent()], help="one run as JSON or CSV")
    export.add_argument("id")
    export.add_argument("--format", choices=["json", "csv"], default="json")
    export.add_argument("-o", "--output", help="write to this file instead of stdout")
    delete = sub.add_parser("delete", parents=[json_parent()], help="remove one run")
    delete.add_argument("id", help="the full run id (a prefix or 'last' needs --yes)")
    delete.add_argument("--yes", action="store_true", help="delete what a prefix or 'last' resolves to")
    compare = sub.add_parser("compare", parents=[json_parent()],
                             help="two runs side by side with the ratio per row")
    compare.add_argument("a")
    compare.add_argument("b")


JSON_ACTIONS = ("list", "show", "compare")


def _check(args: argparse.Namespace) -> None:
    from mleng.errors import UsageError

    if args.action == "list" and args.limit < 1:
        raise UsageError(f"--limit {args.limit}: give at least 1", hint="the default is 50")
    if args.action == "export" and args.output is not None:
        from mleng.cli.common import check_output_path

        check_output_path(args.output, "--output")


def result(args: argparse.Namespace) -> dict:
    """What `mleng results list|show|compare --json` prints."""
    from mleng.results.store import Store

    _check(args)
    with Store(create=False) as store:
        if args.action == "list":
            return {"store": str(store.path), "results": store.list(kind=args.kind, limit=args.limit)}
        if args.action == "show":
            return store.get(args.id).to_dict()
        if args.action == "compare":
            from mleng.results.compare import compare_measurements

            return compare_measurements(store.get(args.a), store.get(args.b))
    raise ValueError(f"no JSON result for results {args.action}")


def run(args: argparse.Namespace) -> int:
    from mleng.errors import UsageError
    from mleng.results.store import Store, kinds_stored

    if args.json and args.action in JSON_ACTIONS:
        print_json(result(args))
        return 0
    _check(args)
    # No action creates a store: reading (or deleting from) one that is not there yet leaves nothing behind.
    with Store(create=False) as store:
        if args.action == "delete" and not store.exists:
            raise UsageError(f"no results stored yet in {store.path}", hint="nothing to delete")
        if args.action == "list":
            rows = store.list(kind=args.kind, limit=args.limit)
            if not rows and args.kind:
                kinds = kinds_stored(store)
                stored = (f"{sum(kinds.values())} stored, of kinds {', '.join(sorted(kinds))}" if kinds
                          else "none stored yet")
                print(f"no results of kind {args.kind!r} in {store.path} ({stored})")
            elif not rows:
                print(f"no results stored yet in {store.path}")
            else:
                print(table([_list_row(r) for r in rows],
                            ["id", "kind", "status", "started_at", "host", "headline"]))
            return 0
        if args.action == "show":
            print(render_measurement(store.get(args.id)))
            return 0
        if args.action == "export":
            from mleng.results.export import export_text

            text = export_text(store.get(args.id), args.format)
            if args.output:
                with open(args.output, "w") as f:
                    f.write(text)
            else:
                sys.stdout.write(text)
            return 0
        if args.action == "delete":
            full_id = store.resolve_id(args.id)
            if full_id != args.id and not args.yes:
                raise UsageError(f"{args.id!r} is not a full id: it resolves to {full_id}",
                                 hint=f"to delete it, give the full id (mleng results delete {full_id}) or add --yes")
            store.delete(full_id)
            if args.json:
                print_json({"deleted": full_id})
            else:
                print(f"deleted {full_id}")
            return 0
        if args.action == "compare":
            from mleng.results.compare import compare_measurements, render_comparison

            print(render_comparison(compare_measurements(store.get(args.a), store.get(args.b))))
            return 0
    return 2


def headline(summary: dict) -> str:
    value = summary.get("value")
    if value is None:
        return summary.get("verdict", "") or ""
    text = f"{value:.4g} {summary.get('unit', '')}".strip() if isinstance(value, (int, float)) else str(value)
    if summary.get("ratio") is not None:
        text += f" ({summary['ratio'] * 100:.1f}% of {summary.get('theoretical')})"
    return text


def _list_row(row: dict) -> dict:
    return {**row, "headline": headline(row["summary"])}


def render_measurement(m) -> str:
    lines = [f"{m.id}  kind={m.kind}  status={m.status}  started={m.started_at}  elapsed={m.elapsed_s:.1f}s",
             f"host: {m.host}"]
    if m.summary:
        lines.append("summary: " + ", ".join(f"{k}={v}" for k, v in m.summary.items()
                                             if not isinstance(v, (dict, list))))
    if m.error:
        lines.append(f"error: {m.error}")
    if m.rows:
        columns: list[str] = []
        for row in m.rows:
            columns.extend(k for k, v in row.items() if k not in columns and not isinstance(v, (dict, list)))
        lines.append(table(m.rows, columns))
    return "\n".join(lines)
