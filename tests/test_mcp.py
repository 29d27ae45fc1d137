"""`mleng mcp` through the MCP SDK's own stdio client, with the server as a real subprocess: the tools give
what the CLI's --json gives (every third dev-set query, every fixture fingerprint), bad calls are tool errors with the
CLI's message and the server answers the next call, memory stays flat over 200 calls, torch stays out of the
server, and a measurement reports progress and stops at the cap."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import yaml

pytest.importorskip("mcp")

import anyio  # noqa: E402
from anyio.from_thread import start_blocking_portal  # noqa: E402
from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
FINGERPRINTS = sorted((TESTS / "fixtures" / "fingerprints").glob("*.json"))
# The sets that guided ranking work (dev set 2 was once named handbook_heldout.yaml); the frozen sets are not
# read here. Abstentions (`confident` false) are among them, and in the subprocess checks below.
DEV_SETS = sorted({*TESTS.glob("handbook_devset*.yaml"), *TESTS.glob("handbook_heldout*.yaml")})
CALL_TIMEOUT_S = 120


def _queries() -> list[str]:
    queries = []
    for path in DEV_SETS:
        if path.exists():
            queries += [case["query"] for case in yaml.safe_load(path.read_text())]
    return queries


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def _mleng_children() -> set[int]:
    """Our child processes that run `mleng mcp`."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"mleng" in cmdline and b"mcp" in cmdline:
            found.add(int(stat.parent.name))
    return found


class Client:
    """A synchronous face on an SDK ClientSession that runs in a portal thread."""

    def __init__(self, portal, session, pid: int):
        self.portal, self.session, self.pid = portal, session, pid

    def _run(self, fn, *args, **kwargs):
        async def bounded():
            with anyio.fail_after(CALL_TIMEOUT_S):
                return await fn(*args, **kwargs)
        return self.portal.call(bounded)

    def call(self, name: str, arguments: dict | None = None, progress=None):
        return self._run(self.session.call_tool, name, arguments or {}, progress_callback=progress)

    def start(self, name: str, arguments: dict, progress=None):
        """The call sent now; a concurrent.futures.Future of its result."""
        return self.portal.start_task_soon(partial(self.session.call_tool, progress_callback=progress), name,
                                           arguments)

    def ok(self, name: str, arguments: dict | None = None) -> dict:
        result = self.call(name, arguments)
        assert not result.is_error, result.content[0].text
        return result.structured_content

    def __getattr__(self, name):  # list_tools, list_resources, read_resource, ...
        method = getattr(self.session, name)
        return lambda *args, **kwargs: self._run(method, *args, **kwargs)


@contextlib.asynccontextmanager
async def _session(args: list[str], env: dict[str, str]):
    params = StdioServerParameters(command=sys.executable, args=["-m", "mleng", "mcp", *args], env=env)
    before = _mleng_children()
    async with stdio_client(params, errlog=sys.stderr) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            pids = _mleng_children() - before
            assert len(pids) == 1, pids
            yield session, pids.pop()


@contextlib.contextmanager
def connect(home: Path, entries: Path, *args: str):
    env = {"MLENG_HOME": str(home), "MLENG_HANDBOOK_DIR": str(entries)}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(_session(list(args), env)) as (session, pid):
            yield Client(portal, session, pid)


@pytest.fixture(scope="module")
def world(tmp_path_factory, entries_snapshot):
    """One home and the session's snapshot of the entries (other work may edit the checkout's meanwhile),
    shared by the server, the in-process CLI and the dev-set answers, so all read the same entries."""
    return {"home": tmp_path_factory.mktemp("mcp") / "home", "entries": entries_snapshot}


@pytest.fixture(scope="module")
def server(world):
    with connect(world["home"], world["entries"]) as client:
        yield client


@pytest.fixture
def cli_env(world, monkeypatch):
    monkeypatch.setenv("MLENG_HOME", str(world["home"]))
    monkeypatch.setenv("MLENG_HANDBOOK_DIR", str(world["entries"]))
    return world


def cli_json(argv: list[str]) -> tuple[dict, int]:
    """`mleng ARGV --json` run in this process by the real entry point: (what it printed, exit code)."""
    from mleng.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*argv, "--json"])
    return json.loads(out.getvalue()), code


# --- the tools ----------------------------------------------------------------------------------------

def test_tools_are_the_commands_with_their_flags(server):
    from mleng.mcp.tools import BY_NAME, leaf_parser, property_name
    from jsonschema import Draft202012Validator

    tools = {t.name: t for t in server.list_tools().tools}
    assert set(tools) >= {"ask", "triage", "handbook_show", "handbook_list", "env", "doctor", "specs_show",
                          "specs_compare", "results_list", "results_show", "results_compare", "upgrade",
                          "memory", "plan", "mamf", "membw", "comm", "check"}
    for name, tool in tools.items():
        Draft202012Validator.check_schema(tool.input_schema)
        assert tool.input_schema["additionalProperties"] is False
        flags = {property_name(a) for a in leaf_parser(BY_NAME[name].command)._actions}
        assert set(tool.input_schema["properties"]) <= flags, name   # one name per concept: the flag's
    assert "confident" in tools["ask"].description
    assert tools["upgrade"].input_schema["required"] == ["from", "to", "price_from", "price_to"]


def test_ask_equals_the_cli_on_every_third_dev_set_query(server, cli_env, dev_search):
    from mleng.cli.ask import result
    from mleng.handbook.index import open_index

    # Every third query of every dev set (~1000): the server answers ~3000 in about 150 s on a 2-core VM, and
    # its `ask` is the CLI's result() behind the MCP framing; the site's test keeps every query.
    queries = _queries()[::3]
    assert len(queries) >= 130, DEV_SETS
    # All the calls go out at once; `mleng ask --json`'s answer is what result() builds around search() of the
    # same entries, searched once per session (the site's parity test compares the same answers). result()
    # itself is checked against them on a few queries here, and the subprocess checks below compare the server
    # with the real `mleng ask --json` byte for byte.
    pending = [server.start("ask", {"text": query}) for query in queries]
    expected = [json.loads(json.dumps({"query": q, **dev_search(q)}, default=str)) for q in queries]
    index = open_index()
    try:
        for q, want in list(zip(queries, expected))[::200]:
            assert json.loads(json.dumps(result(argparse.Namespace(text=[q], limit=5), index), default=str)) == want
    finally:
        index.close()
    same_top1 = same_json = 0
    # One worker thread answers the calls in turn (a few tens of ms each), and under this burst the SDK writes
    # the answers out in a rush at the end: the wait is bounded for the whole batch, not per call.
    deadline = time.monotonic() + CALL_TIMEOUT_S + 0.2 * len(queries)
    for query, future, cli in zip(queries, pending, expected):
        answer = future.result(timeout=max(1.0, deadline - time.monotonic()))
        assert not answer.is_error, answer.content[0].text
        tool = answer.structured_content
        same_top1 += [r["id"] for r in tool["results"][:1]] == [r["id"] for r in cli["results"][:1]]
        same_json += tool == cli   # the whole answer, scores and `confident` included
    print(f"\nask parity: {same_top1}/{len(queries)} dev-set queries (every third) with the same top-1, "
          f"{same_json}/{len(queries)} with the same JSON")
    assert same_top1 == same_json == len(queries)


@pytest.mark.parametrize("query", ["RuntimeError: CUDA error: an illegal memory access was encountered",
                                   "Xid 79", "what is the weather in Paris"])
def test_ask_is_byte_for_byte_what_mleng_ask_json_prints(server, world, query):
    env = {**os.environ, "MLENG_HOME": str(world["home"]), "MLENG_HANDBOOK_DIR": str(world["entries"])}
    proc = subprocess.run([sys.executable, "-m", "mleng", "ask", "--json", query], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode in (0, 1), proc.stderr
    result = server.call("ask", {"text": query})
    assert not result.is_error
    assert result.content[0].text == proc.stdout.rstrip("\n")
    assert result.structured_content == json.loads(proc.stdout)
    assert result.structured_content["confident"] is (proc.returncode == 0)


def test_doctor_on_each_fixture_fingerprint_gives_the_cli_findings(server, cli_env):
    assert len(FINGERPRINTS) >= 5
    for path in FINGERPRINTS:
        tool = server.ok("doctor", {"fingerprint": str(path), "no_store": True})
        cli, _ = cli_json(["doctor", "--quick", "--fingerprint", str(path), "--no-store"])
        assert tool["rows"] == cli["rows"], path.name
        assert tool["summary"] == cli["summary"], path.name
        assert tool["params"] == cli["params"], path.name
    print(f"\ndoctor parity: {len(FINGERPRINTS)}/{len(FINGERPRINTS)} fixture fingerprints, same findings")


def test_the_other_tools_return_the_cli_json(server, cli_env, tmp_path):
    log = tmp_path / "train.log"
    log.write_text("step 10\n[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered\n")
    stored = server.ok("doctor", {"fingerprint": str(FINGERPRINTS[0])})["id"]   # stored: something to list
    cases = [
        ("triage", {"logfile": str(log)}, ["triage", str(log)]),
        ("handbook_list", {"category": "slurm"}, ["handbook", "list", "--category", "slurm"]),
        ("handbook_show", {"id": "xid-79-fallen-off-bus"}, ["handbook", "show", "xid-79-fallen-off-bus"]),
        ("env", {"from": str(FINGERPRINTS[0])}, ["env", "--from", str(FINGERPRINTS[0])]),
        ("specs_list", {"kind": "links", "family": "nvlink"}, ["specs", "list", "--kind", "links", "--family", "nvlink"]),
        ("specs_show", {"name": "NVIDIA H200"}, ["specs", "show", "NVIDIA", "H200"]),
        ("specs_compare", {"names": ["h100", "h200", "b200"]}, ["specs", "compare", "h100", "h200", "b200"]),
        ("results_list", {"kind": "doctor"}, ["results", "list", "--kind", "doctor"]),
        ("results_show", {"id": stored}, ["results", "show", stored]),
        ("results_compare", {"a": stored, "b": stored}, ["results", "compare", stored, stored]),
        ("upgrade", {"from": "h100", "to": "b200", "price_from": 2.5, "price_to": 5, "workload": "attention",
                     "model_params": "70B", "seq_len": 32768},
         ["upgrade", "--from", "h100", "--to", "b200", "--price-from", "2.5", "--price-to", "5", "--workload",
          "attention", "--model-params", "70B", "--seq-len", "32768"]),
        ("memory", {"model": "70b", "gpus": 16, "fsdp": True, "recompute": "full", "gpu": "h200"},
         ["memory", "70b", "--gpus", "16", "--fsdp", "--recompute", "full", "--gpu", "h200"]),
        ("memory", {"model": "8b", "inference": True, "weights": "fp8", "gpu": "h200"},
         ["memory", "8b", "--inference", "--weights", "fp8", "--gpu", "h200"]),
        ("plan", {"model": "8b", "gpus": 16, "busbw": 100, "tflops": 400},
         ["plan", "8b", "--gpus", "16", "--busbw", "100", "--tflops", "400"]),
    ]
    for name, arguments, argv in cases:
        tool = server.ok(name, arguments)
        cli, _ = cli_json(argv)
        if name == "triage":
            tool.pop("elapsed_s"), cli.pop("elapsed_s")
        assert tool == cli, name


def test_env_of_this_machine_runs_in_a_child_and_torch_stays_out_of_the_server(server):
    fingerprint = server.ok("env", {"no_torch": True, "no_gpus": True})
    assert fingerprint["host"]["hostname"] and fingerprint["gpus"]["available"] is False
    maps = Path(f"/proc/{server.pid}/maps").read_text()
    assert "libtorch" not in maps and "torch/_C" not in maps


# --- errors -------------------------------------------------------------------------------------------

BAD_CALLS = [
    ("ask", {}, "missing required argument: text"),
    ("ask", {"text": 5}, "argument 'text' must be string, got 5"),
    ("ask", {"text": "x", "limit": "five"}, "argument 'limit' must be integer"),
    ("ask", {"text": "x", "limit": 0}, "mleng ask: error: --limit must be at least 1, got 0"),
    ("ask", {"text": "x", "colour": "red"}, "unknown argument 'colour'"),
    ("triage", {"logfile": "/nonexistent/train.log"}, "mleng triage: error: cannot read /nonexistent/train.log"),
    ("triage", {"logfile": "/"}, "mleng triage: error: / is a directory"),
    ("triage", {"logfile": "-"}, "reads a file on the server's machine, not stdin"),
    ("doctor", {"fingerprint": "/nonexistent.json"}, "mleng doctor: error: cannot read fingerprint /nonexistent.json"),
    ("env", {"from": "/nonexistent.json"}, "mleng env: error: cannot read /nonexistent.json"),
    ("handbook_show", {"id": "xid-79"}, "no handbook entry 'xid-79'\n  what to do: did you mean: xid-79-fallen-off-bus"),
    ("handbook_list", {"category": "bogus"}, "unknown category 'bogus'"),
    ("specs_show", {"name": "h300"}, "mleng specs: error: unknown accelerator or link 'h300'"),
    ("specs_compare", {"names": ["h100"]}, "compare needs at least two"),
    ("results_show", {"id": "nope"}, "mleng results: error:"),
    ("upgrade", {"from": "h100"}, "missing required arguments: to, price_from, price_to"),
    ("upgrade", {"from": "h100", "to": "h200", "price_from": 2, "price_to": 3, "model_params": "7x"},
     "mleng upgrade: error: argument --model-params: '7x' is not a parameter count"),
    ("upgrade", {"from": "h100", "to": "h200", "price_from": 2, "price_to": 3, "workload": "moe"},
     "argument --workload: invalid choice: 'moe'"),
    ("memory", {"model": "8b", "calibrate": True}, "unknown argument 'calibrate'"),
    ("plan", {"model": "8b"}, "missing required argument: gpus"),
    ("mamf", {}, "without --allow-measure"),
    ("membw", {"size": "1GiB"}, "without --allow-measure"),
    ("comm", {"op": ["all_reduce"]}, "without --allow-measure"),
    ("check", {}, "without --allow-measure"),
    ("doctor", {}, "no_measure: true"),
]


def test_bad_calls_are_tool_errors_with_the_cli_message_and_the_next_call_works(server):
    for name, arguments, message in BAD_CALLS:
        result = server.call(name, arguments)
        assert result.is_error, (name, arguments)
        assert message in result.content[0].text, (name, arguments, result.content[0].text)
        assert result.structured_content["exit_code"] == 2
        assert server.ok("ask", {"text": "Xid 79"})["results"][0]["id"] == "xid-79-fallen-off-bus"
    with pytest.raises(MCPError, match="unknown tool 'nope'"):
        server.call("nope", {})
    with pytest.raises(MCPError, match="no such resource"):
        server.read_resource("mleng://handbook/nope")
    assert server.ok("specs_show", {"name": "h200"})["key"] == "h200-sxm"


def test_an_error_is_the_line_the_cli_prints(server, world):
    env = {**os.environ, "MLENG_HOME": str(world["home"]), "MLENG_HANDBOOK_DIR": str(world["entries"])}
    for name, arguments, argv in [("specs_show", {"name": "h300"}, ["specs", "show", "h300"]),
                                  ("handbook_show", {"id": "xid-79"}, ["handbook", "show", "xid-79"])]:
        proc = subprocess.run([sys.executable, "-m", "mleng", *argv, "--json"], capture_output=True, text=True,
                              env=env, timeout=60)
        assert proc.returncode == 2 and proc.stdout == ""
        assert server.call(name, arguments).content[0].text == proc.stderr.rstrip("\n")


def test_doctor_checks_alone_need_no_allow_measure(server):
    no_measure = server.call("doctor", {"no_measure": True, "no_store": True})
    assert not no_measure.is_error, no_measure.content[0].text
    assert no_measure.structured_content["params"]["measure"] is False


# --- resources, memory ----------------------------------------------------------------------------------

def test_every_entry_is_a_resource(server):
    listed = server.list_resources().resources
    ids = [e["id"] for e in server.ok("handbook_list")["entries"]]
    assert sorted(str(r.uri) for r in listed) == sorted(f"mleng://handbook/{i}" for i in ids)
    text = server.read_resource("mleng://handbook/xid-79-fallen-off-bus").contents[0].text
    assert text.startswith("---\n") and "id: xid-79-fallen-off-bus" in text
    templates = server.list_resource_templates().resource_templates
    assert templates[0].uri_template == "mleng://handbook/{id}"


def test_200_calls_keep_memory_flat(server, tmp_path):
    log = tmp_path / "a.log"
    log.write_text("NCCL WARN NET/IB : Got completion from peer 10.0.0.2<52134> with error 12, opcode 0\n" * 50)
    calls = [("ask", {"text": "NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)"}),
             ("ask", {"text": "hello there"}), ("triage", {"logfile": str(log)}),
             ("handbook_show", {"id": "nccl-watchdog-timeout"}), ("specs_compare", {"names": ["h100", "h200"]}),
             ("ask", {"text": 7}), ("upgrade", {"from": "h100"}), ("results_list", {})]
    for name, arguments in calls * 3:   # warm: caches filled, allocator settled
        server.call(name, arguments)
    before = _rss_kib(server.pid)
    started = time.monotonic()
    for i in range(200):
        name, arguments = calls[i % len(calls)]
        server.call(name, arguments)
    growth_mib = (_rss_kib(server.pid) - before) / 1024
    print(f"\n200 calls in {time.monotonic() - started:.1f} s; server RSS {before / 1024:.1f} MiB, "
          f"growth {growth_mib:+.1f} MiB")
    assert growth_mib <= 20


# --- a measurement ------------------------------------------------------------------------------------

def test_a_measurement_reports_progress_and_stops_at_the_cap(world):
    progress = []

    async def on_progress(value, total, message):
        progress.append((value, total, message))

    with connect(world["home"], world["entries"], "--allow-measure", "--measure-cap", "10") as client:
        started = time.monotonic()
        # an exact grid of 512 CPU shapes up to 4096: minutes of work, so the cap, not the search, ends it
        pending = client.start("mamf", {"device": "cpu", "max_seconds": 120, "grid": ["512:4096:512"], "iters": 3,
                                        "no_store": True}, progress=on_progress)
        time.sleep(1)
        second = client.call("membw", {"size": "16MiB"})   # one measurement at a time; the server stays up
        assert second.is_error and "measurements run one at a time" in second.content[0].text
        result = pending.result(timeout=CALL_TIMEOUT_S)
        elapsed = time.monotonic() - started
        assert not result.is_error, result.content[0].text
        record = result.structured_content
        assert record["kind"] == "mamf" and record["status"] == "interrupted"
        assert "stopped at this server's cap of 10 s" in result.content[1].text
        assert elapsed < 10 + 35
        assert len(progress) >= 4 and all(total == 10 for _, total, _ in progress)
        assert progress[-1][0] >= 4 and "mleng mamf" in progress[-1][2]
        # the server answers while and after it measured, and never imported torch itself
        assert client.ok("ask", {"text": "Xid 79"})["confident"] is True
        assert "libtorch" not in Path(f"/proc/{client.pid}/maps").read_text()
