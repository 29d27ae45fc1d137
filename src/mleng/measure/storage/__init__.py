"""Storage throughput for training: checkpoint save/load, dataloader random reads, metadata; fio or native."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

from mleng.errors import MlengError, UsageError
from mleng.machine.fingerprint import collect_for_record
from mleng.measure import fio_engine
from mleng.measure.sizes import format_bytes
from mleng.measure.storage.native import (
    native_metadata, native_random_read, native_seq_read, native_seq_write,
)
from mleng.measure.storage.target import (
    MEMORY_FILESYSTEMS, METADATA_FILE_BYTES, Workspace, check_space, check_target, direct_io_supported,
    filesystem_type, make_cold,
)
from mleng.measure.storage.target import space_needed  # noqa: F401 - part of mleng.measure.storage's interface


WORKLOADS = ("ckpt-save", "ckpt-load", "rand-read-4k", "rand-read-1m", "metadata")
ENGINES = ("auto", "fio", "native")
RANDOM_BLOCKS = {"rand-read-4k": 4096, "rand-read-1m": 2**20}
SEQ_BLOCK_BYTES = 8 * 2**20


DEFAULT_METADATA_FILES = 2000


# --- one workload on one engine ---------------------------------------------------------------
def make_row(workload: str, engine: str, result: dict[str, Any], **context: Any) -> dict[str, Any]:
    # stat and delete move no file data: no bandwidth rather than a misleading 0.
    bandwidth = result["bandwidth_bytes_per_s"] if result["bytes"] or not workload.startswith("metadata") else None
    return {
        "workload": workload,
        "engine": engine,
        **context,
        "bytes": result["bytes"],
        "ops": result["ops"],
        "elapsed_s": round(result["elapsed_s"], 4),
        "bandwidth_gbps": None if bandwidth is None else bandwidth / 1e9,
        "bandwidth_mibps": None if bandwidth is None else bandwidth / 2**20,
        "iops": result["iops"],
        "latency_p50_us": result["latency_p50_us"],
        "latency_p99_us": result["latency_p99_us"],
    }


class Plan:
    """What one run does: sizes derived once, so both engines and the baseline do the same."""

    def __init__(self, size_bytes: int, jobs: int, duration_s: float, metadata_files: int):
        if jobs < 1:
            raise UsageError("--jobs must be at least 1")
        if duration_s <= 0:
            raise UsageError("--duration must be more than 0 seconds")
        if metadata_files < 1:
            raise UsageError("--files must be at least 1")
        self.jobs = jobs
        self.duration_s = duration_s
        self.metadata_files = metadata_files
        # Each writer/reader has its own shard, as each rank of a sharded checkpoint does.
        self.shard_bytes = (size_bytes // jobs) // 2**20 * 2**20
        if self.shard_bytes < 2**20:
            raise UsageError(f"--size {format_bytes(size_bytes)} over {jobs} jobs leaves shards under 1 MiB",
                             hint="pass a larger --size or fewer --jobs")
        self.block_bytes = min(SEQ_BLOCK_BYTES, self.shard_bytes)
        self.shard_bytes -= self.shard_bytes % self.block_bytes
        self.size_bytes = self.shard_bytes * jobs

    def to_dict(self) -> dict[str, Any]:
        return {"size_bytes": self.size_bytes, "jobs": self.jobs, "shard_bytes": self.shard_bytes,
                "block_bytes": self.block_bytes, "duration_s": self.duration_s,
                "metadata_files": self.metadata_files}


def run_workload(workload: str, engine: str, plan: Plan, workspace: Workspace, shards: list[str],
                 direct_ok: bool, fstype: str) -> list[dict[str, Any]]:
    """Measure one workload; returns rows (metadata gives one per phase)."""
    common = {"jobs": plan.jobs}
    if workload == "ckpt-save":
        # Each save writes new files (as a checkpoint step does), after earlier dirty pages are
        # on disk: neither engine inherits the other's allocation or writeback.
        for shard in shards:
            try:
                os.unlink(shard)
            except FileNotFoundError:
                pass
        os.sync()
        common.update(block_bytes=plan.block_bytes, shard_bytes=plan.shard_bytes, direct=False, fsync=True)
        if engine == "fio":
            result = fio_engine.measure(workload=workload, directory=str(workspace.dir), jobs=plan.jobs,
                                        file_bytes=plan.shard_bytes, block_bytes=plan.block_bytes, direct=False)
        else:
            result = native_seq_write(shards, plan.shard_bytes, plan.block_bytes)
        return [make_row(workload, engine, result, **common)]
    if workload == "ckpt-load":
        cold = make_cold(shards, direct_ok, fstype)
        direct = cold == "o_direct"
        common.update(block_bytes=plan.block_bytes, shard_bytes=plan.shard_bytes, direct=direct, cold_method=cold)
        if engine == "fio":
            result = fio_engine.measure(workload=workload, directory=str(workspace.dir), jobs=plan.jobs,
                                        file_bytes=plan.shard_bytes, block_bytes=plan.block_bytes, direct=direct)
        else:
            result = native_seq_read(shards, plan.shard_bytes, plan.block_bytes, direct)
        return [make_row(workload, engine, result, **common)]
    if workload in RANDOM_BLOCKS:
        block = min(RANDOM_BLOCKS[workload], plan.shard_bytes)
        # A dataset far larger than RAM never hits the page cache: direct I/O says the same here.
        if fstype in MEMORY_FILESYSTEMS:
            cold = make_cold(shards, direct_ok, fstype)
        elif direct_ok:
            cold = "o_direct"
        else:
            cold = make_cold(shards, direct_ok, fstype) + " (repeat reads may hit the cache)"
        common.update(block_bytes=block, direct=direct_ok, cold_method=cold, duration_s=plan.duration_s)
        if engine == "fio":
            result = fio_engine.measure(workload=workload, directory=str(workspace.dir), jobs=plan.jobs,
                                        file_bytes=plan.shard_bytes, block_bytes=block, direct=direct_ok,
                                        duration_s=plan.duration_s)
        else:
            result = native_random_read(shards, plan.shard_bytes, block, direct_ok, plan.duration_s)
        return [make_row(workload, engine, result, **common)]
    if workload == "metadata":
        # fio has no good create/stat/delete mix of this kind: always the native engine.
        phases = native_metadata(workspace, plan.metadata_files, plan.jobs, plan.duration_s)
        return [make_row(f"metadata-{phase}", "native", result, jobs=plan.jobs, file_bytes=METADATA_FILE_BYTES)
                for phase, result in phases.items()]
    raise UsageError(f"unknown workload {workload!r}", hint=f"choose from {', '.join(WORKLOADS)}")


def resolve_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise UsageError(f"unknown engine {engine!r}", hint=f"choose from {', '.join(ENGINES)}")
    if engine == "auto":
        return "fio" if fio_engine.fio_path() else "native"
    if engine == "fio":
        fio_engine.require_fio()
    return engine


def measure_target(target: Path, role: str, plan: Plan, workloads: list[str], engines: list[str],
                   rows: list[dict[str, Any]], on_row: Callable[[dict[str, Any]], None] | None = None,
                   on_workspace: Callable[[Workspace], None] | None = None) -> dict[str, Any]:
    """Every workload on one directory, in a workspace that is removed however the run ends."""
    check_space(target, plan.size_bytes, plan.metadata_files if "metadata" in workloads else 0)
    fstype = filesystem_type(target)
    workspace = Workspace(target)
    info: dict[str, Any] = {"path": str(target), "fs_type": fstype, "workdir": str(workspace.dir)}
    if on_workspace is not None:
        on_workspace(workspace)
    try:
        direct_ok = direct_io_supported(workspace)
        info["direct_io"] = direct_ok
        shards = [workspace.file(f"shard.{i}") for i in range(plan.jobs)]
        needs_files = any(w != "metadata" for w in workloads)
        if needs_files and "ckpt-save" not in workloads:
            native_seq_write(shards, plan.shard_bytes, plan.block_bytes)  # untimed: files to read
        for workload in workloads:
            for engine in engines:
                for row in run_workload(workload, engine, plan, workspace, shards, direct_ok, fstype):
                    row = {"target": role, **row}
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
                if workload == "metadata":
                    break  # one engine only
    finally:
        left = workspace.cleanup()
        info["left_behind"] = left
    return info


def baseline_ratios(rows: list[dict[str, Any]]) -> None:
    """target / baseline per workload and engine: bandwidth for data, ops/s for metadata."""
    base = {(r["workload"], r["engine"]): r for r in rows if r.get("target") == "baseline"}
    for row in rows:
        if row.get("target") != "path":
            continue
        other = base.get((row["workload"], row["engine"]))
        if not other:
            continue
        field = "iops" if row["workload"].startswith("metadata") else "bandwidth_gbps"
        row["baseline_ratio"] = row[field] / other[field] if other[field] else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Headline: checkpoint save bandwidth on PATH (the stall every save pays)."""
    def best(workload: str, field: str, target: str = "path") -> float | None:
        values = [r[field] for r in rows if r["workload"] == workload and r.get("target") == target]
        return max(values) if values else None

    summary: dict[str, Any] = {"value": best("ckpt-save", "bandwidth_gbps"), "unit": "GB/s",
                               "metric": "checkpoint save bandwidth (buffered writes + fsync)",
                               "theoretical": None, "ratio": None,
                               "ckpt_save_gbps": best("ckpt-save", "bandwidth_gbps"),
                               "ckpt_load_gbps": best("ckpt-load", "bandwidth_gbps"),
                               "rand_read_4k_iops": best("rand-read-4k", "iops"),
                               "rand_read_1m_gbps": best("rand-read-1m", "bandwidth_gbps"),
                               "metadata_create_per_s": best("metadata-create", "iops"),
                               "metadata_stat_per_s": best("metadata-stat", "iops"),
                               "metadata_delete_per_s": best("metadata-delete", "iops")}
    if summary["value"] is None:
        summary["value"] = summary["ckpt_load_gbps"] or summary["rand_read_1m_gbps"]
        summary["metric"] = "checkpoint load bandwidth" if summary["ckpt_load_gbps"] else "random 1 MiB read bandwidth"
    ratios = {r["workload"] + "/" + r["engine"]: r["baseline_ratio"] for r in rows if r.get("baseline_ratio")}
    if ratios:
        summary["baseline_ratios"] = ratios
    return summary


def run_io(path: str | os.PathLike, *, size_bytes: int, jobs: int = 4, duration_s: float = 10.0,
           workloads: Iterable[str] = WORKLOADS, engine: str = "auto", baseline: str | None = None,
           metadata_files: int = DEFAULT_METADATA_FILES,
           on_row: Callable[[dict[str, Any]], None] | None = None,
           on_workspace: Callable[[Workspace], None] | None = None):
    """Measure PATH (and a local baseline if asked) and return a Measurement of kind 'io'."""
    from mleng.results.record import Measurement

    target = check_target(path)
    workloads = list(workloads)
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        raise UsageError(f"unknown workload(s) {', '.join(unknown) or '(none given)'}",
                         hint=f"choose from {', '.join(WORKLOADS)}")
    if baseline not in (None, "local"):
        raise UsageError(f"unknown baseline {baseline!r}", hint="the only baseline is 'local' (a local temp directory)")
    plan = Plan(size_bytes, jobs, duration_s, metadata_files)
    engine = resolve_engine(engine)
    baseline_dir = Path(tempfile.gettempdir()) if baseline == "local" else None
    check_space(target, plan.size_bytes, plan.metadata_files if "metadata" in workloads else 0)
    if baseline_dir is not None:
        check_space(baseline_dir, plan.size_bytes, plan.metadata_files if "metadata" in workloads else 0)
    params = {"path": str(target.resolve()), **plan.to_dict(), "workloads": workloads, "engine": engine,
              "fio_version": fio_engine.fio_version() if engine == "fio" else None,
              "baseline": str(baseline_dir) if baseline_dir else None}
    m = Measurement.start("io", params, machine=collect_for_record(gpus=False))
    rows: list[dict[str, Any]] = []
    targets: dict[str, Any] = {}
    try:
        targets["path"] = measure_target(target, "path", plan, workloads, [engine], rows, on_row, on_workspace)
        if baseline_dir is not None:
            same = os.stat(baseline_dir).st_dev == os.stat(target).st_dev
            targets["baseline"] = measure_target(baseline_dir, "baseline", plan, workloads, [engine], rows,
                                                 on_row, on_workspace)
            targets["baseline"]["same_filesystem_as_path"] = same
    except KeyboardInterrupt:
        from mleng import signals

        return _finish(m, rows, targets, "interrupted", f"interrupted by {signals.describe()}; files removed")
    except UsageError:
        raise  # preflight problems (space, path) are the user's to fix: exit 2
    except MlengError as exc:
        # A failure mid-run (disk full, write error): keep what was measured, files are gone.
        return _finish(m, rows, targets, "failed", str(exc))
    return _finish(m, rows, targets, "complete", None)


def _finish(m, rows, targets, status, error):
    m.rows = rows
    baseline_ratios(rows)
    m.summary = summarize(rows) if rows else {"value": None, "unit": "GB/s", "theoretical": None, "ratio": None}
    m.summary["targets"] = targets
    return m.finish(status, error)
