"""`mleng mcp` latency through the MCP SDK's stdio client: server start to first answer, and `ask` (and a few
other tools) through a warm server. Prints a table and writes docs/results/mcp_latency.json.

    python bench/mcp_latency.py [--starts 5] [--calls 100] [--measure SECONDS] [--out docs/results/mcp_latency.json]

--measure also runs `mamf` (the first GPU, else the CPU) through a server started with --allow-measure, with a
budget of SECONDS, and records its progress notifications and headline.

Targets (issue 19): start to first answer <= 1 s; `ask` through a warm server <= 50 ms median.
The handbook index is built before the clock starts, as it is on any machine where mleng ran once, from a
copy of the entries (MLENG_HANDBOOK_DIR), so an entry edited meanwhile in this checkout cannot force a rebuild
into the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import yaml
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

ROOT = Path(__file__).resolve().parents[1]
FIRST_QUERY = "NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)"


def queries() -> list[str]:
    out = []
    for path in sorted((ROOT / "tests").glob("handbook_devset*.yaml")):
        out += [case["query"] for case in yaml.safe_load(path.read_text())]
    return out


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary_ms(values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 2), "p90_ms": round(quantile(ms, 0.9), 2),
            "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2)}


def params(home: str, *args: str, full_env: bool = False) -> StdioServerParameters:
    # A client passes the server a reduced environment (the SDK: HOME, PATH, ...), plus what its config names.
    env = dict(os.environ) if full_env else {"MLENG_HOME": home}
    env["MLENG_HOME"] = home
    for name in ("PYTHONPATH", "MLENG_HANDBOOK_DIR"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return StdioServerParameters(command=sys.executable, args=["-m", "mleng", "mcp", *args], env=env)


async def measure(home: str, seconds: float) -> dict:
    """mamf through the server: the progress notifications it sent and what it measured."""
    notes: list[tuple[float, float, str]] = []

    async def on_progress(progress, total, message):
        notes.append((round(time.perf_counter() - started, 2), progress, message))

    # measurements need the machine's own environment (CUDA_VISIBLE_DEVICES, NCCL_*): the config's "env" passes it
    async with stdio_client(params(home, "--allow-measure", full_env=True)) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            started = time.perf_counter()
            result = await session.call_tool("mamf", {"max_seconds": seconds, "no_store": True},
                                             read_timeout_seconds=seconds + 400, progress_callback=on_progress)
            elapsed = time.perf_counter() - started
    record = result.structured_content or {}
    summary = record.get("summary") or {}
    return {"tool": "mamf", "arguments": {"max_seconds": seconds}, "elapsed_s": round(elapsed, 2),
            "is_error": result.is_error, "status": record.get("status"),
            "device": f"{summary.get('device_name')} ({summary.get('device')})", "dtype": summary.get("dtype"),
            "best_shape": summary.get("best_shape"), "tflops_median": summary.get("tflops_median"),
            "theoretical": summary.get("theoretical"), "progress_notifications": len(notes),
            "first_progress": notes[0] if notes else None, "last_progress": notes[-1] if notes else None,
            "error": result.content[0].text if result.is_error else None}


async def one_start(home: str) -> dict:
    """Seconds from spawning the server to the initialize answer, and to the first `ask` answer."""
    started = time.perf_counter()
    async with stdio_client(params(home)) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            initialized = time.perf_counter() - started
            result = await session.call_tool("ask", {"text": FIRST_QUERY})
            answered = time.perf_counter() - started
            assert not result.is_error, result.content[0].text
    return {"initialize_s": initialized, "first_answer_s": answered}


async def warm(home: str, calls: int) -> dict:
    texts = queries()
    others = [("handbook_show", {"id": "nccl-watchdog-timeout"}), ("specs_show", {"name": "h200"}),
              ("specs_compare", {"names": ["h100", "h200"]}), ("handbook_list", {}),
              ("upgrade", {"from": "h100", "to": "b200", "price_from": 2.5, "price_to": 5}),
              ("doctor", {"fingerprint": str(ROOT / "tests/fixtures/fingerprints/h200_throttled.json"),
                          "no_store": True})]
    async with stdio_client(params(home)) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            for text in texts[:10]:  # warm-up, excluded
                await session.call_tool("ask", {"text": text})
            times = []
            for i in range(calls):
                started = time.perf_counter()
                result = await session.call_tool("ask", {"text": texts[i % len(texts)]})
                times.append(time.perf_counter() - started)
                assert not result.is_error
            per_tool = {"ask": summary_ms(times)}
            for name, arguments in others:
                samples = []
                for _ in range(10):
                    started = time.perf_counter()
                    result = await session.call_tool(name, arguments)
                    samples.append(time.perf_counter() - started)
                    assert not result.is_error, result.content[0].text
                per_tool[name] = summary_ms(samples)
    return per_tool


def in_process_ask(calls: int) -> dict:
    """The library floor: the same function the tool calls, over one open index, no MCP in between."""
    from mleng.cli.ask import result
    from mleng.handbook.index import open_index

    texts, index, times = queries(), open_index(), []
    try:
        for i in range(calls):
            started = time.perf_counter()
            result(argparse.Namespace(text=[texts[i % len(texts)]], limit=5), index)
            times.append(time.perf_counter() - started)
    finally:
        index.close()
    return summary_ms(times)


def sdk_import_s() -> float:
    """A bare interpreter importing the SDK's server side: the floor under start-up."""
    code = "import time; t = time.perf_counter(); import mcp.server.lowlevel, mcp.server.stdio; print(time.perf_counter() - t)"
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
            for _ in range(3)]
    return statistics.median(runs)


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"host": platform.node(), "cpu": cpu, "logical_cores": os.cpu_count(), "python": platform.python_version(),
            "load_average_1m_before": round(os.getloadavg()[0], 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=5, help="server starts to time (default 5)")
    parser.add_argument("--calls", type=int, default=100, help="ask calls through the warm server (default 100)")
    parser.add_argument("--measure", type=float, metavar="SECONDS",
                        help="also run mamf through the server with this budget (needs torch)")
    parser.add_argument("--out", default=str(ROOT / "docs/results/mcp_latency.json"))
    args = parser.parse_args()
    if args.calls < 50:
        parser.error("--calls: at least 50")
    from importlib.metadata import version

    host = machine()
    with tempfile.TemporaryDirectory(prefix="mleng-mcp-bench-") as home:
        os.environ["MLENG_HOME"] = home
        if not os.environ.get("MLENG_HANDBOOK_DIR"):
            shutil.copytree(ROOT / "src/mleng/handbook/entries", Path(home) / "entries")
            os.environ["MLENG_HANDBOOK_DIR"] = str(Path(home) / "entries")
        subprocess.run([sys.executable, "-m", "mleng", "ask", "--json", "warm"], capture_output=True,
                       env=dict(os.environ), check=False)  # builds the index, as any earlier mleng ask has
        starts = [anyio.run(one_start, home) for _ in range(args.starts)]
        tools = anyio.run(warm, home, args.calls)
        library = in_process_ask(args.calls)
        measured = anyio.run(measure, home, args.measure) if args.measure else None
    host["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    first = [s["first_answer_s"] for s in starts]
    init = [s["initialize_s"] for s in starts]
    report = {
        "command": " ".join(["python", "bench/mcp_latency.py", *sys.argv[1:]]),
        "machine": host,
        "mcp_sdk": version("mcp"),
        "start_to_first_answer_s": {"n": len(first), "median": round(statistics.median(first), 3),
                                    "min": round(min(first), 3), "max": round(max(first), 3)},
        "start_to_initialize_s": {"median": round(statistics.median(init), 3), "min": round(min(init), 3)},
        "sdk_import_s": round(sdk_import_s(), 3),
        "warm_server": tools,
        "ask_in_process": library,
        "targets": {"start_to_first_answer_s": 1.0, "ask_median_ms": 50.0},
    }
    if measured:
        report["measurement"] = measured
    report["meets"] = {"start_to_first_answer": report["start_to_first_answer_s"]["median"] <= 1.0,
                       "ask_median": tools["ask"]["median_ms"] <= 50.0}
    print(f"mleng mcp latency on {host['host']} ({host['cpu']}, {host['logical_cores']} cores, load "
          f"{host['load_average_1m_before']} -> {host['load_average_1m_after']}), MCP SDK {report['mcp_sdk']}")
    print(f"start to first answer: median {report['start_to_first_answer_s']['median']:.3f} s "
          f"(min {report['start_to_first_answer_s']['min']:.3f}, max {report['start_to_first_answer_s']['max']:.3f}, "
          f"{len(first)} starts); to initialize {report['start_to_initialize_s']['median']:.3f} s; "
          f"importing the SDK alone {report['sdk_import_s']:.3f} s   [target <= 1 s]")
    print(f"{'tool (warm server)':<22}{'n':>5}{'median ms':>11}{'p90 ms':>9}{'min ms':>9}{'max ms':>9}")
    for name, row in [*tools.items(), ("ask, in process", library)]:
        print(f"{name:<22}{row['n']:>5}{row['median_ms']:>11.1f}{row['p90_ms']:>9.1f}{row['min_ms']:>9.1f}"
              f"{row['max_ms']:>9.1f}")
    if measured:
        print(f"mamf through MCP: {measured['status']} in {measured['elapsed_s']:.1f} s on {measured['device']}, "
              f"{measured['tflops_median']} TFLOPS at {measured['best_shape']}; "
              f"{measured['progress_notifications']} progress notifications, last {measured['last_progress']}")
    print(f"ask median target <= 50 ms: {'met' if report['meets']['ask_median'] else 'NOT met'}; "
          f"start target <= 1 s: {'met' if report['meets']['start_to_first_answer'] else 'NOT met'}")
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
