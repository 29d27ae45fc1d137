"""Storage throughput for training: checkpoint save/load, dataloader random reads, metadata; fio or native."""

from __future__ import annotations

import mmap
import os
import random
import secrets
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from mleng.errors import MlengError, UsageError
from mleng.measure import fio_engine
from mleng.measure.sizes import format_bytes
from mleng.machine.fingerprint import collect_for_record

WORKLOADS = ("ckpt-save", "ckpt-load", "rand-read-4k", "rand-read-1m", "metadata")
ENGINES = ("auto", "fio", "native")
RANDOM_BLOCKS = {"rand-read-4k": 4096, "rand-read-1m": 2**20}
SEQ_BLOCK_BYTES = 8 * 2**20
METADATA_FILE_BYTES = 4096
DEFAULT_METADATA_FILES = 2000
# O_DIRECT wants buffers, offsets and lengths aligned to the logical block size; 4 KiB covers
# every common device.
ALIGN = 4096
WORKDIR_PREFIX = ".mleng-io-"
# Nothing makes reads from these cold: their files are memory (tmpfs takes O_DIRECT since Linux 6.6).
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


# --- where the run writes ---------------------------------------------------------------------

class Workspace:
    """A uniquely named directory of our own under PATH; only files we created are ever removed."""

    def __init__(self, parent: str | os.PathLike):
        self.parent = Path(parent)
        self.dir = self.parent / f"{WORKDIR_PREFIX}{secrets.token_hex(6)}"
        os.mkdir(self.dir, 0o700)  # fails rather than reuse an existing directory
        self.created: dict[Path, None] = {}  # ordered set of the files we made
        self.created_dirs: list[Path] = []

    def file(self, name: str) -> str:
        path = self.dir / name
        self.created[path] = None
        return str(path)

    def subdir(self, name: str) -> Path:
        path = self.dir / name
        os.mkdir(path)
        self.created_dirs.append(path)
        return path

    def cleanup(self) -> list[str]:
        """Remove what we created; return anything left behind (never someone else's file)."""
        for path in self.created:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        left = []
        for directory in list(reversed(self.created_dirs)) + [self.dir]:
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass
            except OSError:
                left.append(str(directory))
        return left


def check_target(path: str | os.PathLike) -> Path:
    target = Path(path)
    if not target.exists():
        raise UsageError(f"PATH {target} does not exist", hint="give an existing directory on the file system to measure")
    if not target.is_dir():
        raise UsageError(f"PATH {target} is not a directory",
                         hint="give a directory; mleng io writes its files into a new subdirectory of it")
    try:
        st = os.statvfs(target)
    except OSError as exc:
        raise UsageError(f"PATH {target} cannot be inspected: {exc.strerror or exc}") from None
    if st.f_blocks == 0:
        raise UsageError(f"PATH {target} is on {filesystem_type(target)}, a virtual file system with no storage "
                         "behind it", hint="give a directory on the disk or shared file system you want to measure")
    if not os.access(target, os.W_OK | os.X_OK):
        raise UsageError(f"PATH {target} is not writable by this user", hint="choose a directory you can write to")
    return target


def space_needed(size_bytes: int, metadata_files: int) -> tuple[int, int]:
    """Bytes the run writes, and the margin kept free on top (so we never fill a disk)."""
    data = size_bytes + metadata_files * 2 * METADATA_FILE_BYTES
    margin = max(64 * 2**20, data // 10)
    return data, margin


def check_space(target: Path, size_bytes: int, metadata_files: int) -> dict[str, int]:
    st = os.statvfs(target)
    free = st.f_bavail * st.f_frsize
    data, margin = space_needed(size_bytes, metadata_files)
    if free < data + margin:
        raise UsageError(
            f"not enough free space on {target}: {format_bytes(free)} free, this run needs "
            f"{format_bytes(data + margin)} ({format_bytes(data)} of files + {format_bytes(margin)} margin)",
            hint="pass a smaller --size (or fewer --files), or free space first",
        )
    inodes_needed = metadata_files + 64
    if st.f_files > 0 and st.f_favail < inodes_needed:
        raise UsageError(
            f"not enough free inodes on {target}: {st.f_favail} free, this run creates up to {inodes_needed} files",
            hint="pass fewer --files, or free inodes first",
        )
    return {"free_bytes": free, "needed_bytes": data, "margin_bytes": margin, "free_inodes": st.f_favail}


def filesystem_type(path: Path) -> str:
    """The type of the mount holding path (ext4, xfs, nfs, lustre, tmpfs...), from /proc/mounts."""
    best, fstype = "", "unknown"
    resolved = str(path.resolve())
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                    best, fstype = mount, parts[2]
    except OSError:
        pass
    return fstype


def direct_io_supported(workspace: Workspace) -> bool:
    """Whether this file system takes O_DIRECT (tmpfs and some FUSE mounts refuse it)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = workspace.file("direct-probe")
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, buf, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()


def make_cold(paths: list[str], direct_ok: bool, fstype: str) -> str:
    """Make the next reads of paths come from storage; return how (recorded with the numbers)."""
    if fstype in MEMORY_FILESYSTEMS:
        return "none: the file system lives in memory"
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass  # not root, or a container with a read-only /proc/sys: fall back
    if direct_ok:
        return "o_direct"
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed (advisory; some pages may stay cached)"


# --- the native engine: threads doing pwrite/preadv with aligned buffers ----------------------

def _aligned_random_buffer(size: int) -> mmap.mmap:
    # Anonymous mmap is page aligned, as O_DIRECT needs; random bytes so nothing compresses.
    buf = mmap.mmap(-1, size)
    chunk = os.urandom(min(size, 2**20))
    for offset in range(0, size, len(chunk)):
        buf[offset:offset + len(chunk)] = chunk[:size - offset]
    return buf


class _Stopped(Exception):
    pass


def _run_threads(count: int, work: Callable[[int, threading.Event], Any]) -> tuple[list[Any], float]:
    """Start count threads together; return their results and the wall time from start to last end."""
    stop = threading.Event()
    start = threading.Barrier(count + 1)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def body(index: int) -> None:
        try:
            start.wait()
            results[index] = work(index, stop)
        except _Stopped:
            pass
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    try:
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.2)
        elapsed = time.perf_counter() - t0
    except BaseException:
        # Ctrl-C: let each thread finish its current I/O, then report the interrupt.
        stop.set()
        for t in threads:
            t.join()
        raise
    if errors:
        raise errors[0]
    return results, elapsed


def _io_error(exc: OSError, what: str) -> MlengError:
    return MlengError(f"{what} failed: {exc.strerror or exc} (errno {exc.errno})",
                      hint="a full file system, a quota or a file-size limit are the usual causes")


def native_seq_write(paths: list[str], file_bytes: int, block_bytes: int) -> dict[str, Any]:
    """One writer per shard: buffered pwrite of whole blocks, then fsync, as a checkpoint save."""
    buf = _aligned_random_buffer(block_bytes)

    def work(index: int, stop: threading.Event) -> list[float]:
        latencies = []
        fd = os.open(paths[index], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for offset in range(0, file_bytes, block_bytes):
                if stop.is_set():
                    raise _Stopped()
                t = time.perf_counter()
                if os.pwrite(fd, buf, offset) != block_bytes:
                    raise OSError(28, "short write (file system full?)")
                latencies.append(time.perf_counter() - t)
            os.fsync(fd)
        except OSError as exc:
            raise _io_error(exc, f"writing {paths[index]}") from exc
        finally:
            os.close(fd)
        return latencies

    try:
        results, elapsed = _run_threads(len(paths), work)
    finally:
        buf.close()
    return _summarize(results, len(paths) * file_bytes, elapsed)


def native_seq_read(paths: list[str], file_bytes: int, block_bytes: int, direct: bool) -> dict[str, Any]:
    """One reader per shard, sequential whole-block preadv into an aligned buffer."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def work(index: int, stop: threading.Event) -> list[float]:
        buf = mmap.mmap(-1, block_bytes)
        latencies = []
        fd = os.open(paths[index], flags)
        try:
            for offset in range(0, file_bytes, block_bytes):
                if stop.is_set():
                    raise _Stopped()
                t = time.perf_counter()
                if os.preadv(fd, [buf], offset) != block_bytes:
                    raise OSError(5, "short read")
                latencies.append(time.perf_counter() - t)
        except OSError as exc:
            raise _io_error(exc, f"reading {paths[index]}") from exc
        finally:
            os.close(fd)
            buf.close()
        return latencies

    results, elapsed = _run_threads(len(paths), work)
    return _summarize(results, len(paths) * file_bytes, elapsed)


def native_random_read(paths: list[str], file_bytes: int, block_bytes: int, direct: bool,
                       duration_s: float) -> dict[str, Any]:
    """Dataloader-style: each job reads whole random aligned blocks of its shard for duration_s."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    slots = file_bytes // block_bytes

    def work(index: int, stop: threading.Event) -> list[float]:
        rng = random.Random(secrets.randbits(64))
        buf = mmap.mmap(-1, block_bytes)
        latencies = []
        fd = os.open(paths[index], flags)
        deadline = time.perf_counter() + duration_s
        try:
            while time.perf_counter() < deadline:
                if stop.is_set():
                    raise _Stopped()
                offset = rng.randrange(slots) * block_bytes
                t = time.perf_counter()
                os.preadv(fd, [buf], offset)
                latencies.append(time.perf_counter() - t)
        except OSError as exc:
            raise _io_error(exc, f"reading {paths[index]}") from exc
        finally:
            os.close(fd)
            buf.close()
        return latencies

    results, elapsed = _run_threads(len(paths), work)
    ops = sum(len(r) for r in results)
    return _summarize(results, ops * block_bytes, elapsed)


def native_metadata(workspace: Workspace, files: int, jobs: int, duration_s: float) -> dict[str, dict[str, Any]]:
    """Create (write 4 KiB, close), stat, then delete many small files; ops/s of each phase."""
    workspace.subdir("meta")
    payload = os.urandom(METADATA_FILE_BYTES)
    names = [[workspace.file(f"meta/f{j}-{i}") for i in range(j, files, jobs)] for j in range(jobs)]
    created: list[list[str]] = [[] for _ in range(jobs)]

    def create(index: int, stop: threading.Event) -> list[float]:
        latencies = []
        deadline = time.perf_counter() + duration_s
        for path in names[index]:
            if stop.is_set():
                raise _Stopped()
            if time.perf_counter() > deadline:
                break
            t = time.perf_counter()
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.write(fd, payload)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise _io_error(exc, f"creating {path}") from exc
            latencies.append(time.perf_counter() - t)
            created[index].append(path)
        return latencies

    def over_created(operation: Callable[[str], Any]) -> Callable[[int, threading.Event], list[float]]:
        def each(index: int, stop: threading.Event) -> list[float]:
            latencies = []
            for path in created[index]:
                if stop.is_set():
                    raise _Stopped()
                t = time.perf_counter()
                operation(path)
                latencies.append(time.perf_counter() - t)
            return latencies
        return each

    stat, delete = over_created(os.stat), over_created(os.unlink)

    out = {}
    for phase, fn in (("create", create), ("stat", stat), ("delete", delete)):
        results, elapsed = _run_threads(jobs, fn)
        count = sum(len(r) for r in results)
        out[phase] = _summarize(results, count * METADATA_FILE_BYTES if phase == "create" else 0, elapsed)
    return out


def _summarize(latency_lists: Iterable[list[float] | None], total_bytes: int, elapsed: float) -> dict[str, Any]:
    from mleng.measure.timing import quantile

    latencies = sorted(x for lst in latency_lists if lst for x in lst)
    ops = len(latencies)
    return {
        "bytes": total_bytes,
        "ops": ops,
        "elapsed_s": elapsed,
        "bandwidth_bytes_per_s": total_bytes / elapsed if elapsed > 0 else 0.0,
        "iops": ops / elapsed if elapsed > 0 else 0.0,
        "latency_p50_us": quantile(latencies, 0.5) * 1e6 if latencies else None,
        "latency_p99_us": quantile(latencies, 0.99) * 1e6 if latencies else None,
    }


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
            text = fio_engine.job_file(workload=workload, directory=str(workspace.dir), jobs=plan.jobs,
                                       file_bytes=plan.shard_bytes, block_bytes=plan.block_bytes, direct=False)
            result = fio_engine.parse(fio_engine.run_fio(text, str(workspace.dir), workload), workload)
        else:
            result = native_seq_write(shards, plan.shard_bytes, plan.block_bytes)
        return [make_row(workload, engine, result, **common)]
    if workload == "ckpt-load":
        cold = make_cold(shards, direct_ok, fstype)
        direct = cold == "o_direct"
        common.update(block_bytes=plan.block_bytes, shard_bytes=plan.shard_bytes, direct=direct, cold_method=cold)
        if engine == "fio":
            text = fio_engine.job_file(workload=workload, directory=str(workspace.dir), jobs=plan.jobs,
                                       file_bytes=plan.shard_bytes, block_bytes=plan.block_bytes, direct=direct)
            result = fio_engine.parse(fio_engine.run_fio(text, str(workspace.dir), workload), workload)
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
            text = fio_engine.job_file(workload=workload, directory=str(workspace.dir), jobs=plan.jobs,
                                       file_bytes=plan.shard_bytes, block_bytes=block, direct=direct_ok,
                                       duration_s=plan.duration_s)
            result = fio_engine.parse(fio_engine.run_fio(text, str(workspace.dir), workload), workload)
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
    """Measure PATH (and a local baseline if asked) and return a Measurement of kind 'storage'."""
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
    m = Measurement.start("storage", params, machine=collect_for_record(gpus=False))
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


