"""The native engine of `mleng io` (when fio is not installed, or --engine native): sequential checkpoint
writes and reads, random reads and metadata operations in threads, with their latencies."""

from __future__ import annotations

import mmap
import os
import random
import secrets
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from mleng.errors import MlengError
from mleng.measure.storage.target import METADATA_FILE_BYTES, Workspace


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


def _read_blocks(path: str, direct: bool, block_bytes: int, offsets: Iterable[int], stop: threading.Event,
                 whole: bool) -> list[float]:
    """preadv of one aligned block at each offset into an aligned buffer; the latency of each read.
    whole: a short read is an error (a shard read end to end)."""
    buf = mmap.mmap(-1, block_bytes)
    latencies = []
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        for offset in offsets:
            if stop.is_set():
                raise _Stopped()
            t = time.perf_counter()
            if os.preadv(fd, [buf], offset) != block_bytes and whole:
                raise OSError(5, "short read")
            latencies.append(time.perf_counter() - t)
    except OSError as exc:
        raise _io_error(exc, f"reading {path}") from exc
    finally:
        os.close(fd)
        buf.close()
    return latencies


def native_seq_read(paths: list[str], file_bytes: int, block_bytes: int, direct: bool) -> dict[str, Any]:
    """One reader per shard, sequential whole-block preadv into an aligned buffer."""

    def work(index: int, stop: threading.Event) -> list[float]:
        return _read_blocks(paths[index], direct, block_bytes, range(0, file_bytes, block_bytes), stop, whole=True)

    results, elapsed = _run_threads(len(paths), work)
    return _summarize(results, len(paths) * file_bytes, elapsed)


def native_random_read(paths: list[str], file_bytes: int, block_bytes: int, direct: bool,
                       duration_s: float) -> dict[str, Any]:
    """Dataloader-style: each job reads whole random aligned blocks of its shard for duration_s."""
    slots = file_bytes // block_bytes

    def work(index: int, stop: threading.Event) -> list[float]:
        rng = random.Random(secrets.randbits(64))

        def offsets() -> Iterator[int]:
            deadline = time.perf_counter() + duration_s
            while time.perf_counter() < deadline:
                yield rng.randrange(slots) * block_bytes

        return _read_blocks(paths[index], direct, block_bytes, offsets(), stop, whole=False)

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
