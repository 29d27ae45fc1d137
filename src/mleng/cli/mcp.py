"""`mleng mcp`: serve the handbook, the specs, the results and (if allowed) the measurements to AI agents over MCP."""

from __future__ import annotations

import argparse

from mleng.errors import NotAvailableError, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ('Register with an agent client as {"mcpServers": {"mleng": {"command": "mleng", "args": '
                     '["mcp"]}}}. It speaks MCP on stdin/stdout until the client closes them.')
    parser.add_argument("--allow-measure", action="store_true",
                        help="offer the measurements (mamf, membw, comm, check, doctor's) to the client; "
                             "off by default: a client can then only read")
    parser.add_argument("--measure-cap", type=float, default=300.0, metavar="SECONDS",
                        help="stop any one measurement after this long (SIGTERM: its rows are kept; default 300)")


def run(args: argparse.Namespace) -> int:
    if args.measure_cap <= 0:
        raise UsageError(f"--measure-cap {args.measure_cap:g}: give a positive number of seconds")
    try:
        import mcp.server.lowlevel  # noqa: F401
    except ImportError as exc:
        raise NotAvailableError(f"mleng mcp needs the MCP SDK, which cannot be imported ({exc})",
                                hint="pip install 'mleng[mcp]'") from None
    import sys

    if sys.stdin.isatty():
        print("mleng mcp: serving MCP on stdin/stdout; an agent client starts it (mleng mcp --help says how); "
              "Ctrl-D or Ctrl-C ends it", file=sys.stderr)
    from mleng.mcp.server import serve

    serve(allow_measure=args.allow_measure, measure_cap_s=args.measure_cap)
    return 0
