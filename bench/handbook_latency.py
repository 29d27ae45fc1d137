"""`mleng ask` latency: whole process (start-up, index open, ranking, output), median of N runs with a warm
index cache, and the time to rebuild the index from the entries: from nothing, and (with --upgrade-from) after an
upgrade, over the cache an older release's entries left. Prints a table; writes JSON.

    python bench/handbook_latency.py                        # the installed `mleng`
    python bench/handbook_latency.py --upgrade-from 319a32d # also the rebuild after an upgrade from that
                                                            # commit's entries to this tree's (this tree's code)
    python bench/handbook_latency.py --compare f8373a7      # also older commits' code, side by side, runs
                                                            # interleaved, all on this tree's entries
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
QUERIES = (
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "NCCL WARN NET/IB : Got completion from peer 10.0.0.2<52134> with error 12, opcode 0, len 0, vendor err 129",
    "training hangs at step 3000",
)


def _byte_compile(src: Path) -> None:
    """Write the bytecode of every module under src first, as pip does at install: with PYTHONDONTWRITEBYTECODE set
    (this VM sets it) an import never writes it, and a tree without it would pay the compile on every run."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(src)], check=True, capture_output=True)


def _run(argv: list[str], env: dict) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, capture_output=True, check=False)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON output (default docs/results/handbook_ask_latency.json, "
                        "with --compare handbook_ask_latency_compare.json)")
    parser.add_argument("--compare", nargs="+", metavar="REV", help="git revisions whose code to time beside this tree's")
    parser.add_argument("--upgrade-from", metavar="REV", help="git revision whose entries the cache was built from "
                        "before the upgrade to this tree's entries")
    args = parser.parse_args()
    if args.compare:
        return compare(args)
    mleng = shutil.which("mleng") or str(Path(sys.executable).with_name("mleng"))
    _byte_compile(ROOT / "src")
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, MLENG_HOME=tmp)
        rebuilds = []
        for _ in range(3):
            Path(tmp, "handbook-index.sqlite").unlink(missing_ok=True)
            rebuilds.append(_run([mleng, "ask", "x"], env))
        per_query = {}
        for query in QUERIES:
            times = sorted(_run([mleng, "ask", query], env) for _ in range(args.runs))
            per_query[query] = {"median_s": round(times[len(times) // 2], 4), "min_s": round(times[0], 4),
                                "max_s": round(times[-1], 4)}
        upgrade = _upgrade_rebuilds(args.upgrade_from, mleng, Path(tmp)) if args.upgrade_from else None
    entries = len(list((ROOT / "src" / "mleng" / "handbook" / "entries").glob("*.md")))
    medians = sorted(v["median_s"] for v in per_query.values())
    result = {"command": " ".join(["python", "bench/handbook_latency.py", *sys.argv[1:]]), "entries": entries,
              "runs": args.runs, "load_avg_1m": round(os.getloadavg()[0], 2), "per_query": per_query,
              "ask_median_s": medians[len(medians) // 2],
              "rebuild_s": round(sorted(rebuilds)[1] - medians[0], 3),
              "rebuild_whole_process_s": round(sorted(rebuilds)[1], 3)}
    if upgrade is not None:
        result["upgrade"] = upgrade
    print(f"mleng ask, whole process, {entries} entries, median of {args.runs} runs (load {result['load_avg_1m']})")
    for query, row in per_query.items():
        print(f"  {row['median_s'] * 1000:6.0f} ms  (min {row['min_s'] * 1000:.0f}, max {row['max_s'] * 1000:.0f})  {query[:60]}")
    print(f"index rebuild: {result['rebuild_s']:.2f} s (whole process {result['rebuild_whole_process_s']:.2f} s)")
    if upgrade is not None:
        print(f"index rebuild after an upgrade from {upgrade['from']}'s entries ({upgrade['files_new_or_changed']} of "
              f"{entries} files new or changed): whole process {upgrade['rebuild_whole_process_s']:.2f} s")
    out = Path(args.out or RESULTS / "handbook_ask_latency.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _export(flag: str, rev: str, path: str, target: Path) -> Path:
    """`path` as it is at git revision `rev`, extracted under `target`; a revision git cannot export ends the bench."""
    target.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, path], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"{flag} {rev}: not a revision git can export here "
                         f"({archive.stderr.decode().strip().splitlines()[-1]})")
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target / path


def _upgrade_rebuilds(rev: str, mleng: str, tmp: Path) -> dict:
    """`mleng ask` (this tree's code) over an index cache built from `rev`'s entries, after the entries directory
    was written anew with this tree's entries, as an upgrade does (every file new, changed or not): median of 3."""
    before = _export("--upgrade-from", rev, "src/mleng/handbook/entries", tmp / "old")
    after = ROOT / "src" / "mleng" / "handbook" / "entries"
    was = {p.name: p.read_bytes() for p in before.glob("*.md")}
    changed = sum(1 for p in after.glob("*.md") if was.get(p.name) != p.read_bytes())
    live = tmp / "upgrade-entries"
    env = dict(os.environ, MLENG_HOME=str(tmp / "upgrade-home"), MLENG_HANDBOOK_DIR=str(live))
    times = []
    for _ in range(3):
        shutil.rmtree(live, ignore_errors=True)
        shutil.copytree(before, live)
        Path(env["MLENG_HOME"], "handbook-index.sqlite").unlink(missing_ok=True)
        _run([mleng, "ask", "x"], env)
        shutil.rmtree(live)
        shutil.copytree(after, live)
        times.append(_run([mleng, "ask", "x"], env))
    return {"from": rev, "files_new_or_changed": changed, "rebuild_whole_process_s": round(sorted(times)[1], 3)}


def compare(args: argparse.Namespace) -> int:
    """`python -m mleng ask` and the rebuild for each revision's src/ (git archive) and this tree's, on the same
    entries (MLENG_HANDBOOK_DIR), runs interleaved so a change of machine load hits every variant alike."""
    entries = ROOT / "src" / "mleng" / "handbook" / "entries"
    with tempfile.TemporaryDirectory() as tmp:
        sources = {}
        for rev in args.compare:
            sources[rev] = _export("--compare", rev, "src", Path(tmp, rev))
        sources["this tree"] = ROOT / "src"
        for src in sources.values():
            _byte_compile(src)
        envs = {name: dict(os.environ, PYTHONPATH=str(src), MLENG_HANDBOOK_DIR=str(entries),
                           MLENG_HOME=str(Path(tmp, f"home-{i}"))) for i, (name, src) in enumerate(sources.items())}
        command = [sys.executable, "-m", "mleng", "ask"]
        rebuilds: dict[str, list[float]] = {name: [] for name in envs}
        for _ in range(3):
            for name, env in envs.items():
                Path(env["MLENG_HOME"], "handbook-index.sqlite").unlink(missing_ok=True)
                rebuilds[name].append(_run(command + ["x"], env))
        times = {name: {q: [] for q in QUERIES} for name in envs}
        for _ in range(args.runs):
            for query in QUERIES:
                for name, env in envs.items():
                    times[name][query].append(_run(command + [query], env))
    result = {"command": " ".join(["python", "bench/handbook_latency.py", *sys.argv[1:]]),
              "entries": len(list(entries.glob("*.md"))), "runs": args.runs,
              "load_avg_1m": round(os.getloadavg()[0], 2), "variants": {}}
    print(f"python -m mleng ask, whole process, {result['entries']} entries, median of {args.runs} interleaved runs"
          f" (load {result['load_avg_1m']})")
    for name in envs:
        medians = {q: round(sorted(v)[len(v) // 2], 4) for q, v in times[name].items()}
        rebuild = round(sorted(rebuilds[name])[1], 3)
        result["variants"][name] = {"ask_median_s": medians, "rebuild_whole_process_s": rebuild}
        print(f"  {name:<12} " + "  ".join(f"{m * 1000:5.0f} ms" for m in medians.values())
              + f"   rebuild {rebuild:.2f} s")
    out = Path(args.out or RESULTS / "handbook_ask_latency_compare.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
