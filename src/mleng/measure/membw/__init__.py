"""Memory bandwidth: device copy/read/write, host<->device over PCIe, and CPU memory, against the specs."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable

from mleng.errors import MlengError, NotAvailableError, UsageError
from mleng.machine.fingerprint import collect_for_record
from mleng.machine.system import host_available_bytes
from mleng.measure.membw.kernels import (
    TRITON_READ, driver_copy, triton_available, triton_copy, triton_read, triton_write,
)
from mleng.measure.membw.kernels import TRITON_COPY, TRITON_WRITE  # noqa: F401 - the benches read them here
from mleng.measure.membw.theory import add_theory, device_context, summarize
from mleng.measure.membw.theory import hbm_theoretical_gbps, pcie_link, pcie_theoretical_gbps  # noqa: F401
from mleng.measure.sizes import format_bytes


TESTS = ("copy", "read", "write", "h2d", "d2h")
CPU_TESTS = ("copy", "read", "write")
ENGINES = ("torch", "triton", "driver")
# The driver engine is the CUDA driver's own device-to-device copy (cuMemcpyDtoDAsync): the
# ceiling a copy kernel of ours is compared with. It has no read or write test.
DRIVER_TESTS = ("copy",)
DEFAULT_GPU_SIZE = 4 * 2**30
DEFAULT_CPU_SIZE = 1 * 2**30
# Host transfers need no more than this to be far past any cache, and pinning more host
# memory costs seconds per GiB.
MAX_HOST_SIZE = 1 * 2**30
# Sizes are rounded down to this so the Triton kernels need no masks (whole blocks only).
_ALIGN_BYTES = 4 * 65536
# The write kernels broadcast a random row of this many float32 values (16 KiB): it stays in
# L1/L2, so DRAM sees (almost) only the writes.
_PATTERN_ELEMENTS = 4096


def round_size(size_bytes: int) -> int:
    rounded = size_bytes - size_bytes % _ALIGN_BYTES
    if rounded <= 0:
        raise UsageError(f"size {format_bytes(size_bytes)} is too small for a bandwidth test",
                         hint=f"use at least {format_bytes(_ALIGN_BYTES)}; far more than the cache is the point")
    return rounded


# --- one device -------------------------------------------------------------------------------
def _row(device: str, test: str, engine: str, size_bytes: int, bytes_moved: int, stats,
         host_memory: str | None = None) -> dict[str, Any]:
    return {
        "device": device,
        "test": test,
        "engine": engine,
        "host_memory": host_memory,
        "size_bytes": size_bytes,
        "bytes_moved": bytes_moved,
        "gbps": bytes_moved / stats.median_s / 1e9,
        # The fastest iteration gives the highest bandwidth, the slowest the lowest.
        "gbps_min": bytes_moved / stats.max_s / 1e9,
        "gbps_max": bytes_moved / stats.min_s / 1e9,
        "time_us": stats.median_s * 1e6,
        "time_us_min": stats.min_s * 1e6,
        "time_us_max": stats.max_s * 1e6,
        "time_us_iqr": stats.iqr_s * 1e6,
        "iters": stats.iters,
    }


HOST_MARGIN_BYTES = 512 * 2**20  # the process, torch and the cache-flush buffer besides the test buffers


def check_host_memory(size_bytes: int, what: str) -> None:
    """Two buffers of size_bytes (source and destination) must fit in the host's available memory."""
    available = host_available_bytes()
    needed = 2 * size_bytes + HOST_MARGIN_BYTES
    if available is None or needed <= available:
        return
    fits = max((available - HOST_MARGIN_BYTES) // 2, 0)
    fits_text = format_bytes(fits - fits % 2**30 if fits >= 2**30 else fits - fits % 2**20) if fits >= 2**20 else None
    raise UsageError(
        f"--size {format_bytes(size_bytes)} does not fit: {what} need {format_bytes(needed)} "
        f"(source + destination + {format_bytes(HOST_MARGIN_BYTES)}), the host has {format_bytes(available)} available",
        hint=f"pass --size {fits_text} or less" if fits_text else "free host memory first",
    )


def check_device_memory(device_index: int, needed_bytes: int) -> None:
    import torch

    free, total = torch.cuda.mem_get_info(device_index)
    if needed_bytes > free:
        raise UsageError(
            f"cuda:{device_index} has {format_bytes(free)} free of {format_bytes(total)}; "
            f"this run needs {format_bytes(needed_bytes)} (source, destination and cache-flush buffers)",
            hint="pass a smaller --size, or free the GPU's memory",
        )


def measure_device(device: str, *, size_bytes: int, tests: Iterable[str] = TESTS,
                   engines: Iterable[str] = ("torch",), host_size_bytes: int | None = None,
                   iters: int = 20, warmup: int = 5, threads: int | None = None,
                   before_test: Callable[[str], None] | None = None,
                   on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """All requested tests on one device ('cpu' or 'cuda:N'); rows are returned and passed to on_row."""
    import torch

    from mleng.measure.timing import time_fn

    dev = torch.device(device)
    is_cuda = dev.type == "cuda"
    size_bytes = round_size(size_bytes)
    n = size_bytes // 4
    tests = [t for t in tests if is_cuda or t in CPU_TESTS]
    engines = [e for e in engines if e == "torch" or is_cuda]
    if dev.type == "cpu" and threads:
        torch.set_num_threads(threads)
    if is_cuda:
        torch.cuda.set_device(dev)
        check_device_memory(dev.index or 0, 2 * size_bytes + 64 * 2**20)
    rows: list[dict[str, Any]] = []
    monitor = _gpu_monitor(dev) if is_cuda else None

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    def timed(fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
        """time_fn, plus the clocks, power and temperature NVML saw meanwhile (a throttled run explains itself)."""
        since = monitor.now_s() if monitor is not None else None
        stats = time_fn(fn, device=dev, warmup=warmup, iters=iters)
        return stats, _telemetry(monitor, since)

    # Random normal data, never zeros: some paths (compression, zero-page tricks) are faster on
    # constants than on real tensors.
    generator = torch.Generator(device=dev).manual_seed(1234)
    src = torch.randn(n, device=dev, generator=generator, dtype=torch.float32)
    dst = torch.randn(n, device=dev, generator=generator, dtype=torch.float32)
    pattern = torch.randn(_PATTERN_ELEMENTS, device=dev, generator=generator, dtype=torch.float32)
    partial = torch.empty(max(n // TRITON_READ[0], 1), device=dev, dtype=torch.float32)
    partial_bytes = partial.numel() * 4

    def torch_read() -> None:
        # A full reduction reads every byte and writes one scalar: reads dominate.
        torch.sum(src)

    fill_value = float(torch.randn(1, generator=torch.Generator().manual_seed(99)))

    def torch_write() -> None:
        # Store-only in torch means fill_: broadcasting a random row (dst.copy_(row.expand()))
        # goes through torch's generic strided kernel and ran at 35% of an H200's bandwidth, and
        # normal_() spends its time in the RNG (38%). fill_ stores one value everywhere; plain
        # cudaMalloc memory is not compressible, so DRAM sees full-size writes all the same (on
        # the H200 one Triton store kernel ran at 4526 GB/s with a constant pattern and 4524
        # with a random one: docs/results/membw_h200_bench.json). The row is still marked
        # constant_data, and the Triton kernel's random-data number is the headline when it ran.
        dst.fill_(fill_value)

    kernels: dict[tuple[str, str], tuple[Callable[[], Any], int]] = {
        ("copy", "torch"): (lambda: dst.copy_(src), 2 * size_bytes),
        ("read", "torch"): (torch_read, size_bytes),
        ("write", "torch"): (torch_write, size_bytes),
    }
    if "triton" in engines:
        available, reason = triton_available()
        if not available:
            engines = [e for e in engines if e != "triton"]
            emit({"device": device, "test": "triton", "engine": "triton", "skipped": reason})
        else:
            kernels[("copy", "triton")] = (lambda: triton_copy(src, dst), 2 * size_bytes)
            kernels[("read", "triton")] = (lambda: triton_read(src, partial), size_bytes + partial_bytes)
            kernels[("write", "triton")] = (lambda: triton_write(pattern, dst), size_bytes)
    if "driver" in engines:
        call, reason = driver_copy(src, dst)
        if call is None:
            engines = [e for e in engines if e != "driver"]
            emit({"device": device, "test": "driver", "engine": "driver", "skipped": reason})
        else:
            kernels[("copy", "driver")] = (call, 2 * size_bytes)

    for test in tests:
        if test in ("h2d", "d2h"):
            continue
        for engine in engines:
            if (test, engine) not in kernels:
                continue
            fn, bytes_moved = kernels[(test, engine)]
            if before_test is not None:
                before_test(f"{test}/{engine}")
            stats, telemetry = timed(fn)
            row = {**_row(device, test, engine, size_bytes, bytes_moved, stats), **telemetry}
            if test == "write":
                row["constant_data"] = engine == "torch"
            emit(row)
    if engines and "copy" in tests:
        # Check the copy really copied: a kernel that writes nothing would look infinitely fast.
        for engine in engines:
            dst.normal_(generator=generator)
            kernels[("copy", engine)][0]()
            if not torch.equal(dst, src):
                raise MlengError(f"the {engine} copy kernel on {device} produced wrong data",
                                 hint="report this as a bug in mleng membw")

    host_tests = [t for t in tests if t in ("h2d", "d2h")]
    if is_cuda and host_tests:
        host_bytes = round_size(min(host_size_bytes or MAX_HOST_SIZE, size_bytes))
        host_n = host_bytes // 4
        device_buffer = src[:host_n]
        for memory in ("pinned", "pageable"):
            host = torch.empty(host_n, dtype=torch.float32, pin_memory=(memory == "pinned"))
            host.copy_(dst[:host_n])  # random data, filled fast from the GPU
            for test in host_tests:
                if test == "h2d":
                    fn = lambda: device_buffer.copy_(host, non_blocking=True)  # noqa: E731
                else:
                    fn = lambda: host.copy_(device_buffer, non_blocking=True)  # noqa: E731
                if before_test is not None:
                    before_test(f"{test}/{memory}")
                stats, telemetry = timed(fn)
                emit({**_row(device, test, "torch", host_bytes, host_bytes, stats, host_memory=memory), **telemetry})
            del host
    del src, dst, pattern, partial
    if monitor is not None:
        monitor.stop()
    if is_cuda:
        torch.cuda.empty_cache()
    return rows


def _gpu_monitor(dev):
    """An NVML sampler on the same card torch uses (matched by UUID), or None without NVML."""
    import torch

    from mleng.measure.gpu_monitor import GpuMonitor

    from mleng.machine.nvml import torch_gpu_uuid

    monitor = GpuMonitor(uuid=torch_gpu_uuid(dev), index=dev.index)
    return monitor.start() if monitor.available else None


def _telemetry(monitor, since: float | None) -> dict[str, Any]:
    if monitor is None or since is None:
        return {}
    window = monitor.summary(since, monitor.now_s())
    if not window.get("samples"):
        return {}
    return {"sm_clock_mhz_mean": (window.get("sm_clock_mhz") or {}).get("mean"),
            "mem_clock_mhz_mean": (window.get("mem_clock_mhz") or {}).get("mean"),
            "power_w_max": (window.get("power_w") or {}).get("max"),
            "temperature_c_max": (window.get("temperature_c") or {}).get("max"),
            "limiting_reasons": window.get("limiting_reasons")}


# --- several GPUs at once: one process per GPU (measure/fanout.py) ---------------------------
def _on_device(device: str, kwargs: dict[str, Any], sync, send) -> None:
    # Every GPU starts each test together, so the numbers are concurrent ones.
    measure_device(device, before_test=lambda _name: sync(), on_row=send, **kwargs)


def measure_devices(devices: list[str], *, on_row: Callable[[dict[str, Any]], None] | None = None,
                    **kwargs: Any) -> tuple[list[dict[str, Any]], str, str | None]:
    """measure_device on each device in its own process, all tests in step: the rows in arrival order (each
    with its `worker`), the status and the error. Interrupted or failed devices keep the rows they measured."""
    from mleng.measure.fanout import run_per_device

    rows: list[dict[str, Any]] = []

    def keep(index: int, row: dict[str, Any]) -> None:
        row = {**row, "worker": index}
        rows.append(row)
        if on_row is not None:
            on_row(row)

    outcomes = run_per_device(_on_device, devices, args=kwargs, on_message=keep)
    errors = [f"{o.device}: {o.error}" for o in outcomes if o.status == "failed"]
    if any(o.status == "interrupted" for o in outcomes):
        return rows, "interrupted", None
    if errors:
        return rows, "failed", "; ".join(errors)
    return rows, "complete", None


# --- the whole run ----------------------------------------------------------------------------
def cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_devices(device: int | str | None, all_devices: bool) -> list[str]:
    """--device as every command reads it (N, cuda:N or cpu; None: GPU 0, else the CPU), or --all-devices."""
    count = cuda_device_count()
    if all_devices:
        if count == 0:
            raise NotAvailableError("--all-devices needs CUDA GPUs, and torch sees none here",
                                    hint="drop --all-devices to measure CPU memory bandwidth")
        return [f"cuda:{i}" for i in range(count)]
    if device is not None and str(device).strip().lower() == "cpu":
        return ["cpu"]
    if device is not None:
        index = str(device).strip().lower().removeprefix("cuda:")
        if not index.isdigit():
            raise UsageError(f"--device {device!r} is not a device membw measures", hint="use N, cuda:N or cpu")
        device = int(index)
        if count == 0:
            raise NotAvailableError(f"--device {device} asks for a GPU, and torch sees no CUDA GPU here",
                                    hint="drop --device to measure CPU memory bandwidth")
        if not 0 <= device < count:
            raise UsageError(f"--device {device} does not exist: torch sees {count} GPU(s), 0..{count - 1}")
        return [f"cuda:{device}"]
    return ["cuda:0"] if count else ["cpu"]


def run_membw(*, device: int | str | None = None, all_devices: bool = False, size_bytes: int | None = None,
              tests: Iterable[str] = TESTS, engines: Iterable[str] | None = None, iters: int = 20,
              warmup: int = 5, threads: int | None = None,
              on_row: Callable[[dict[str, Any]], None] | None = None):
    """Measure and return a Measurement (kind 'membw'); interrupted or failed runs keep their rows."""
    from mleng.results.record import Measurement

    tests = list(tests)
    unknown = [t for t in tests if t not in TESTS]
    if unknown or not tests:
        raise UsageError(f"unknown test(s) {', '.join(unknown) or '(none given)'}", hint=f"choose from {', '.join(TESTS)}")
    if iters < 1 or warmup < 0:
        raise UsageError("--iters must be at least 1 and --warmup at least 0")
    devices = resolve_devices(device, all_devices)
    on_gpu = devices[0] != "cpu"
    if engines is None:
        engines = ["torch"] if not on_gpu else (["torch", "triton", "driver"] if triton_available()[0]
                                                  else ["torch", "driver"])
    engines = list(engines)
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise UsageError(f"unknown engine(s) {', '.join(bad)}", hint=f"choose from {', '.join(ENGINES)}")
    if not on_gpu and ("triton" in engines or "driver" in engines):
        raise NotAvailableError(f"--engine {'triton' if 'triton' in engines else 'driver'} runs on CUDA GPUs, "
                                "and this run measures the CPU",
                                hint="drop --engine (the CPU is measured with torch)")
    if not on_gpu:
        tests = [t for t in tests if t in CPU_TESTS]
        if not tests:
            raise NotAvailableError("h2d/d2h need a CUDA GPU, and this run measures the CPU"
                                    + ("" if cuda_device_count() else " (torch sees no CUDA GPU here)"),
                                    hint="ask for copy, read or write to measure CPU memory")
        engines = ["torch"]
        threads = threads or len(os.sched_getaffinity(0))
    size_bytes = round_size(size_bytes or (DEFAULT_GPU_SIZE if on_gpu else DEFAULT_CPU_SIZE))
    # Checked before any allocation: an allocator failure mid-run is a traceback, not an answer.
    check_host_memory(size_bytes if not on_gpu else min(MAX_HOST_SIZE, size_bytes) // 2, "the CPU test buffers"
                      if not on_gpu else "the pinned and pageable host buffers")
    if on_gpu:
        for dev in devices:
            check_device_memory(int(dev.rsplit(":", 1)[-1]), 2 * size_bytes + 64 * 2**20)
    params = {"devices": devices, "size_bytes": size_bytes, "tests": tests, "engines": engines,
              "iters": iters, "warmup": warmup, "threads": threads,
              "host_size_bytes": min(MAX_HOST_SIZE, size_bytes) if on_gpu else None,
              "dtype": "float32", "inputs": "random normal",
              "timing": "CUDA events per iteration, L2 flushed between iterations" if on_gpu
              else "host clock per iteration, last-level cache flushed between iterations"}
    m = Measurement.start("membw", params, machine=collect_for_record(gpus=on_gpu))
    t0 = time.monotonic()
    kwargs = dict(size_bytes=size_bytes, tests=tests, engines=engines, iters=iters, warmup=warmup,
                  threads=threads)
    context = device_context(devices)
    m.params["device_names"] = {d: c["name"] for d, c in context.items()}
    if len(devices) > 1:
        return _finish(m, *measure_devices(devices, on_row=on_row, **kwargs), context, t0)
    rows: list[dict[str, Any]] = []

    def keep(row: dict[str, Any]) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    try:
        measure_device(devices[0], on_row=keep, **kwargs)
    except KeyboardInterrupt:
        return _finish(m, rows, "interrupted", None, context, t0)
    except MlengError as exc:
        if not rows:
            raise
        # keep the rows, and say what stopped the run (a wrong copy, a lost device), not just that it did
        return _finish(m, rows, "failed", exc.message, context, t0)
    return _finish(m, rows, "complete", None, context, t0)


def _finish(m, rows, status, error, context, t0):
    m.rows = rows
    add_theory(m.rows, context)
    m.summary = summarize(m.rows, context)
    m.summary["wall_s"] = round(time.monotonic() - t0, 2)
    m.summary["devices"] = context
    return m.finish(status, error)
