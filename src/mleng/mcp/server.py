"""The stdio MCP server behind `mleng mcp`: tools from mleng.mcp.tools, handbook entries as resources."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

from mleng import __version__
from mleng.errors import MlengError
from mleng.mcp.tools import BY_NAME, TOOLS, CommandError, ToolSpec, cli_error, parse, schema_of, to_argv

RESOURCE_PREFIX = "mleng://handbook/"
DEFAULT_MEASURE_CAP_S = 300.0
MACHINE_CAP_S = 120.0            # env and doctor --no-measure: reading this machine takes seconds
STOP_GRACE_S = 30.0              # after SIGTERM at the cap, before SIGKILL: what a measurement needs to keep its rows
# A cancelled call (or a client gone): SIGTERM, then this long at most before the server moves on. The child, in
# its own session, still ends as after Ctrl-C and stores its rows; the SDK's client kills the server 2 s after
# closing its stdin, so the server must not wait longer than that.
CANCEL_GRACE_S = 1.5
PROGRESS_EVERY_S = 1.0
# What would make a child `mleng comm`/`check` a rank of the server's own launch, or spread it over an allocation.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_LOCALID")

INSTRUCTIONS = (
    "mleng: a handbook of GPU-cluster training problems and measurements of the machine this server runs on. "
    "For an error, call `ask` with the exact error line (results[0] is the answer when `confident` is true); "
    "for a whole log, `triage` with its path. `handbook_show` or the resource mleng://handbook/<id> gives an "
    "entry in full. `doctor` says what is wrong with this node (or a recorded fingerprint); measurements "
    "(mamf, membw, comm, check) run only when the server was started with --allow-measure. Every tool returns "
    "the JSON that `mleng <command> --json` prints; an error result carries the CLI's own message."
)


class IndexCache:
    """The handbook index kept open between calls, reopened when an entry file (or mleng) changes."""

    def __init__(self):
        self._index = None
        self._key: tuple[str, str] | None = None

    def get(self):
        from mleng.handbook.index import fingerprint, open_index
        from mleng.handbook import default_entries_dir

        directory = default_entries_dir()
        key = (str(directory), fingerprint(directory))
        if self._index is None or key != self._key:
            index = open_index(directory)
            if self._index is not None:
                self._index.close()
            self._index, self._key = index, key
        return self._index


class MlengServer:
    def __init__(self, allow_measure: bool = False, measure_cap_s: float = DEFAULT_MEASURE_CAP_S):
        self.allow_measure = allow_measure
        self.measure_cap_s = measure_cap_s
        self.index = IndexCache()
        # One thread runs every in-process call: the open index's sqlite connection belongs to one thread,
        # and the calls are quick (the CLI runs them one at a time too).
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mleng-mcp")
        self.measuring: tuple[str, float] | None = None
        self._tools: list[types.Tool] | None = None

    # --- tools ----------------------------------------------------------------------------------------

    def tool_list(self) -> list[types.Tool]:
        if self._tools is None:
            self._tools = [types.Tool(
                name=tool.name, description=tool.description, input_schema=schema_of(tool),
                annotations=types.ToolAnnotations(read_only_hint=tool.read_only, destructive_hint=False,
                                                  idempotent_hint=tool.read_only, open_world_hint=False))
                for tool in TOOLS]
        return self._tools

    def warm(self) -> None:
        try:
            self.tool_list()
            self.index.get()
        except Exception:  # noqa: BLE001 - the call that needs it says what is wrong
            pass

    async def on_list_tools(self, ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=await self._in_worker(self.tool_list))

    async def on_call_tool(self, ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        tool = BY_NAME.get(params.name)
        if tool is None:
            raise MCPError(code=types.INVALID_PARAMS, message=f"unknown tool {params.name!r}",
                           data={"tools": [t.name for t in TOOLS]})
        try:
            return await self._call(ctx, tool, dict(params.arguments or {}))
        except CommandError as exc:
            return error_result(exc.text, exc.exit_code)
        except MlengError as exc:
            error = cli_error(tool, exc)
            return error_result(error.text, error.exit_code)
        except Exception as exc:  # a bug must cost this call, never the server
            traceback.print_exc(file=sys.stderr)
            return error_result(f"mleng {tool.command[0]}: internal error: {type(exc).__name__}: {exc}", 70)

    async def _call(self, ctx, tool: ToolSpec, arguments: dict) -> types.CallToolResult:
        args, data = await self._in_worker(self._run_here, tool, arguments)
        if data is None:
            return await self._run_child(ctx, tool, args._argv, measure=tool.measures(args))
        return json_result(data)

    def _run_here(self, tool: ToolSpec, arguments: dict):
        """(args, what --json prints) for a call this process answers; (args, None) for one a child must."""
        args = parse(tool, to_argv(tool, arguments))
        if tool.measures(args) and not self.allow_measure:
            raise CommandError(
                f"mleng {tool.command[0]}: error: {tool.name} measures this machine, and this server was started "
                "without --allow-measure\n  what to do: register the server as `mleng mcp --allow-measure` "
                '(args ["mcp", "--allow-measure"]) to allow measurements'
                + ("; or pass no_measure: true for the checks alone" if tool.name == "doctor" else ""), 2)
        if tool.child(args):
            return args, None
        return args, tool.call(args, self.index.get() if tool.uses_index else None)

    async def _in_worker(self, fn, *args):
        import asyncio

        return await asyncio.wrap_future(self.worker.submit(fn, *args))

    # --- child processes: what reads this machine, and the measurements ---------------------------------

    async def _run_child(self, ctx, tool: ToolSpec, argv: list[str], measure: bool) -> types.CallToolResult:
        if measure:
            if self.measuring is not None:
                name, since = self.measuring
                raise CommandError(f"mleng {tool.command[0]}: error: {name} is measuring (for "
                                   f"{time.monotonic() - since:.0f} s); measurements run one at a time, so they "
                                   "do not disturb each other\n  what to do: call again when it has returned", 2)
            self.measuring = (tool.name, time.monotonic())
        try:
            cap = self.measure_cap_s if measure else MACHINE_CAP_S
            return await run_child(ctx, tool, argv, cap, single_node=tool.name in ("comm", "check"))
        finally:
            if measure:
                self.measuring = None

    # --- resources: one per handbook entry -----------------------------------------------------------

    def _entries(self) -> list[dict]:
        return [e.data for e in self.index.get().entries]

    async def on_list_resources(self, ctx, params) -> types.ListResourcesResult:
        entries = await self._in_worker(self._entries)
        return types.ListResourcesResult(resources=[
            types.Resource(uri=RESOURCE_PREFIX + e["id"], name=e["id"], title=e["title"],
                           description=f"handbook entry ({e['category']}): {e['title']}", mime_type="text/markdown")
            for e in entries])

    async def on_list_resource_templates(self, ctx, params) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(resource_templates=[types.ResourceTemplate(
            uri_template=RESOURCE_PREFIX + "{id}", name="handbook entry", mime_type="text/markdown",
            description="a handbook entry as its Markdown file (YAML front matter, then the sections); ids "
                        "from handbook_list or ask")])

    async def on_read_resource(self, ctx, params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        uri = str(params.uri)
        entry_id = uri[len(RESOURCE_PREFIX):] if uri.startswith(RESOURCE_PREFIX) else None

        def read() -> str | None:
            entry = next((e for e in self._entries() if e["id"] == entry_id), None)
            if entry is None:
                return None
            with open(entry["path"], encoding="utf-8") as f:
                return f.read()

        text = await self._in_worker(read) if entry_id else None
        if text is None:
            raise MCPError(code=types.INVALID_PARAMS, message=f"no such resource: {uri}",
                           data={"uri": uri, "hint": f"handbook entries are {RESOURCE_PREFIX}<id>, ids from "
                                                     "handbook_list"})
        return types.ReadResourceResult(contents=[types.TextResourceContents(uri=uri, mime_type="text/markdown",
                                                                             text=text)])


def json_result(data: Any, note: str | None = None) -> types.CallToolResult:
    """The CLI's --json output as the text (byte for byte, as print_json writes it) and as structured content."""
    text = json.dumps(data, indent=2, default=str)
    content = [types.TextContent(type="text", text=text)]
    if note:
        content.append(types.TextContent(type="text", text=note))
    return types.CallToolResult(content=content, structured_content=json.loads(text))


def error_result(text: str, exit_code: int) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True,
                                structured_content={"error": text, "exit_code": exit_code})


def child_environment(single_node: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if single_node:
        for name in LAUNCH_VARIABLES:
            env.pop(name, None)
        env["MLENG_SLURM_RELAUNCH"] = "0"  # stay on this node inside an allocation
    return env


async def run_child(ctx, tool: ToolSpec, argv: list[str], cap_s: float, single_node: bool) -> types.CallToolResult:
    """`mleng ARGV` (which has --json) in its own process group, stopped at cap_s like Ctrl-C would (SIGTERM: the command
    keeps its rows and prints its record), killed STOP_GRACE_S later; a progress notification every second."""
    started = time.monotonic()
    process = await anyio.open_process([sys.executable, "-m", "mleng", *argv], stdin=subprocess.DEVNULL,
                                       env=child_environment(single_node), start_new_session=True)
    stdout = bytearray()
    stderr_lines: list[str] = []
    stopped_at_cap = False

    async def read_stdout() -> None:
        async for chunk in process.stdout:
            stdout.extend(chunk)

    async def read_stderr() -> None:
        buffer = b""
        async for chunk in process.stderr:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            stderr_lines.extend(line.decode("utf-8", "replace").rstrip("\r") for line in lines)
            del stderr_lines[:-200]
        if buffer:
            stderr_lines.append(buffer.decode("utf-8", "replace"))

    async def report() -> None:
        while True:
            await anyio.sleep(PROGRESS_EVERY_S)
            elapsed = time.monotonic() - started
            last = next((line for line in reversed(stderr_lines) if line.strip() and not line[0].isspace()), "")
            message = f"mleng {' '.join(tool.command)}: {elapsed:.0f} s of at most {cap_s:.0f} s"
            await ctx.session.report_progress(round(elapsed, 1), cap_s, message + (f"; {last[:200]}" if last else ""))

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(read_stdout)
            group.start_soon(read_stderr)
            group.start_soon(report)
            with anyio.move_on_after(cap_s):
                await process.wait()
            if process.returncode is None:
                stopped_at_cap = True
                await _stop(process)
            group.cancel_scope.cancel()
        # the pipes may hold the last bytes after the exit
        with anyio.move_on_after(5):
            async for chunk in process.stdout:
                stdout.extend(chunk)
    finally:
        if process.returncode is None:  # the call was cancelled: stop the measurement as Ctrl-C would
            with anyio.CancelScope(shield=True):
                await _stop(process, CANCEL_GRACE_S, kill=False)
    text = stdout.decode("utf-8", "replace")
    notes = []
    if stopped_at_cap:
        notes.append(f"stopped at this server's cap of {cap_s:.0f} s (mleng mcp --measure-cap): what was measured "
                     "so far is kept")
    errors = [line for line in stderr_lines if ": error:" in line or "warning:" in line]
    if process.returncode:
        notes.append(f"mleng {tool.command[0]} exited {process.returncode}"
                     + (": " + "; ".join(errors[-3:]) if errors else ""))
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        return json_result(data, "\n".join(notes) or None)
    said = [line for line in stderr_lines if line.strip()]
    message = "\n".join(said[-4:]) if said else f"mleng {tool.command[0]}: exited {process.returncode} with no output"
    if stopped_at_cap:
        message += "\n" + notes[0]
    return error_result(message, process.returncode or 1)


async def _stop(process, grace_s: float = STOP_GRACE_S, kill: bool = True) -> None:
    """SIGTERM (the CLI's Ctrl-C path: rows kept, record printed), then SIGKILL to the whole process group."""
    try:
        process.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        return
    with anyio.move_on_after(grace_s):
        await process.wait()
    if process.returncode is None and kill:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await process.wait()


def serve(allow_measure: bool = False, measure_cap_s: float = DEFAULT_MEASURE_CAP_S) -> None:
    """Serve MCP on stdin/stdout until the client closes the connection."""
    mleng = MlengServer(allow_measure=allow_measure, measure_cap_s=measure_cap_s)
    server = Server("mleng", version=__version__, title="mleng", instructions=INSTRUCTIONS,
                    on_list_tools=mleng.on_list_tools, on_call_tool=mleng.on_call_tool,
                    on_list_resources=mleng.on_list_resources,
                    on_list_resource_templates=mleng.on_list_resource_templates,
                    on_read_resource=mleng.on_read_resource)

    async def main() -> None:
        # While the client does its handshake: the tool list, the parsers and the handbook index, which the
        # first calls need (a failure here is the first call's to report).
        mleng.worker.submit(mleng.warm)
        async with stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())

    try:
        anyio.run(main)
    finally:
        # The client is gone. A signal from now on (the SDK's client sends SIGTERM 2 s after closing stdin) ends
        # the process as by default, not as a KeyboardInterrupt in the middle of the interpreter's exit.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        mleng.worker.shutdown(wait=False, cancel_futures=True)
