"""Memory bandwidth: device copy/read/write, host<->device over PCIe, and CPU memory, against the specs."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable

from mleng.errors import MlengError, NotAvailableError, UsageError
from mleng.measure.sizes import format_bytes
from mleng.machine.fingerprint import collect_for_record
from mleng.machine.system import host_available_bytes
from mleng.measure.timing import cpu_model_name

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
# One Triton launch configuration per kernel (elements per program, warps), chosen on an H200
# with bench/membw_h200.py (docs/results/membw_h200_bench*.json): for the copy, 4 float32 per
# thread and 16 warps beat bigger blocks, and streaming (.cs) stores cost 5%; reads liked
# big blocks; stores of the write kernel, 4096 with .cs. The copy tops out at ~4.28-4.30 TB/s
# whatever does it (torch copy_, Triton, a hand-written 16-byte CUDA kernel): that is the
# card's read+write ceiling, while read-only and write-only kernels reach 93% and 94-97%.
TRITON_COPY = (2048, 16)
TRITON_READ = (16384, 8)
TRITON_WRITE = (4096, 8)


def driver_copy(src, dst) -> tuple[Callable[[], None] | None, str | None]:
    """A call of cuMemcpyDtoDAsync (libcuda) from src to dst on torch's current stream, or None and why not."""
    import ctypes

    import torch

    if getattr(torch.version, "hip", None):
        return None, "the CUDA driver copy is NVIDIA-only (this is a ROCm build)"
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        memcpy = lib.cuMemcpyDtoDAsync_v2
    except (OSError, AttributeError) as exc:
        return None, f"libcuda.so.1 has no cuMemcpyDtoDAsync_v2 here ({exc})"
    memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    memcpy.restype = ctypes.c_int
    nbytes = src.numel() * src.element_size()

    def call() -> None:
        code = memcpy(dst.data_ptr(), src.data_ptr(), nbytes, torch.cuda.current_stream().cuda_stream)
        if code != 0:
            raise MlengError(f"cuMemcpyDtoDAsync failed with CUDA driver error {code}",
                             hint="run `mleng membw --engine torch` and report the error code")

    return call, None


def round_size(size_bytes: int) -> int:
    rounded = size_bytes - size_bytes % _ALIGN_BYTES
    if rounded <= 0:
        raise UsageError(f"size {format_bytes(size_bytes)} is too small for a bandwidth test",
                         hint=f"use at least {format_bytes(_ALIGN_BYTES)}; far more than the cache is the point")
    return rounded


# --- specs ------------------------------------------------------------------------------------

def hbm_theoretical_gbps(device_name: str) -> tuple[float | None, str | None]:
    """The datasheet memory bandwidth of a GPU in GB/s, or None and why not."""
    from mleng.specs import lookup_accelerator

    try:
        accelerator = lookup_accelerator(device_name)
    except MlengError as exc:
        return None, f"no spec entry for {device_name!r}: {exc.message}"
    tbps = getattr(accelerator, "memory_bandwidth_tbps", None)
    if not tbps:
        return None, f"the spec entry {accelerator.key!r} has no memory bandwidth"
    return float(tbps) * 1000.0, f"mleng.specs {accelerator.key} ({accelerator.name})"


def pcie_theoretical_gbps(gen: int | None, width: int | None) -> tuple[float | None, str | None]:
    """One direction of a PCIe link in GB/s from mleng.specs, or None and why not."""
    if not gen or not width:
        return None, "the PCIe generation and width could not be read (NVML)"
    from mleng.specs import pcie_link_gbps

    try:
        return float(pcie_link_gbps(int(gen), int(width))), f"mleng.specs pcie_link_gbps(gen={gen}, width={width})"
    except MlengError as exc:
        return None, exc.message


def pcie_link(device_index: int) -> dict[str, Any]:
    """PCIe generation and width of a torch CUDA device, read from NVML by PCI bus id.

    The max values are what the GPU and slot negotiated as their best; the current ones drop
    at idle (power saving), so the theoretical rate uses the max.
    """
    link: dict[str, Any] = {"gen": None, "width": None, "gen_current": None, "width_current": None,
                            "source": None}
    from mleng.machine.nvml import nvml, torch_pci_bus_id

    pynvml, reason = nvml()
    if pynvml is None:  # NVML missing or not loadable: say so, measure anyway
        link["source"] = f"NVML unavailable: {reason}"
        return link
    try:
        bus_id = torch_pci_bus_id(device_index)
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        link["gen"] = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)
        link["width"] = pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)
        link["gen_current"] = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
        link["width_current"] = pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
        link["source"] = f"NVML {bus_id}"
    except Exception as exc:
        link["source"] = f"NVML could not read the PCIe link: {exc}"
    return link


# --- Triton kernels (optional; imported only when used) ----------------------------------------

_triton_kernels: dict[str, Any] | None = None


def triton_available() -> tuple[bool, str | None]:
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return False, f"triton cannot be imported: {exc}"
    return True, None


def triton_kernels() -> dict[str, Any]:
    """Copy, read and write kernels with 16-byte loads and stores, compiled on first use."""
    global _triton_kernels
    if _triton_kernels is not None:
        return _triton_kernels
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr, STREAMING: tl.constexpr):
        # int64 offsets: tensors past 8 GiB of float32 overflow int32 indices.
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if STREAMING:
            # Each byte is touched once: keep it from displacing anything in L2.
            values = tl.load(src_ptr + offsets, eviction_policy="evict_first")
            tl.store(dst_ptr + offsets, values, cache_modifier=".cs")
        else:
            tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets))

    @triton.jit
    def read_kernel(src_ptr, partial_ptr, BLOCK: tl.constexpr):
        # One partial sum per block: 4 bytes written per BLOCK*4 read, counted in bytes_moved.
        pid = tl.program_id(0)
        offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        values = tl.load(src_ptr + offsets, eviction_policy="evict_first")
        tl.store(partial_ptr + pid, tl.sum(values, axis=0))

    @triton.jit
    def write_kernel(pattern_ptr, dst_ptr, BLOCK: tl.constexpr, PATTERN: tl.constexpr):
        # The same random PATTERN values (cached after the first block) stored into every
        # block: non-constant data, and DRAM sees only the stores.
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        values = tl.load(pattern_ptr + (tl.arange(0, BLOCK) % PATTERN))
        tl.store(dst_ptr + offsets, values, cache_modifier=".cs")

    _triton_kernels = {"copy": copy_kernel, "read": read_kernel, "write": write_kernel}
    return _triton_kernels


def triton_copy(src, dst, block: int = TRITON_COPY[0], num_warps: int = TRITON_COPY[1],
                streaming: bool = False) -> None:
    grid = (src.numel() // block,)
    triton_kernels()["copy"][grid](src, dst, BLOCK=block, STREAMING=streaming, num_warps=num_warps)


def triton_read(src, partial, block: int = TRITON_READ[0], num_warps: int = TRITON_READ[1]) -> None:
    grid = (src.numel() // block,)
    triton_kernels()["read"][grid](src, partial, BLOCK=block, num_warps=num_warps)


def triton_write(pattern, dst, block: int = TRITON_WRITE[0], num_warps: int = TRITON_WRITE[1]) -> None:
    grid = (dst.numel() // block,)
    triton_kernels()["write"][grid](pattern, dst, BLOCK=block, PATTERN=min(block, pattern.numel()),
                                    num_warps=num_warps)


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


# --- several GPUs at once: one process per GPU -------------------------------------------------

def _worker(worker_index: int, device: str, kwargs: dict[str, Any], barrier, queue) -> None:
    import signal

    # The parent handles Ctrl-C and ends the workers; a worker must not die mid-kernel on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def before_test(_name: str) -> None:
        # Every GPU starts each test together, so the numbers are concurrent ones.
        barrier.wait(timeout=600)

    try:
        measure_device(device, before_test=before_test,
                       on_row=lambda row: queue.put(("row", worker_index, {**row, "worker": worker_index})),
                       **kwargs)
        queue.put(("done", worker_index, None))
    except BaseException as exc:  # report any failure to the parent, which decides
        barrier.abort()
        message = exc.message if isinstance(exc, MlengError) else f"{type(exc).__name__}: {exc}"
        queue.put(("error", worker_index, message))


def measure_concurrently(devices: list[str], *, on_row: Callable[[dict[str, Any]], None] | None = None,
                         **kwargs: Any) -> list[dict[str, Any]]:
    """Run measure_device on each device in its own process, all tests in step."""
    import multiprocessing as mp
    import queue as queue_module

    context = mp.get_context("spawn")
    barrier = context.Barrier(len(devices))
    results = context.Queue()
    processes = [context.Process(target=_worker, args=(i, d, kwargs, barrier, results), daemon=True)
                 for i, d in enumerate(devices)]
    for p in processes:
        p.start()
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    pending = set(range(len(devices)))
    try:
        while pending:
            try:
                kind, index, payload = results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [i for i in pending if not processes[i].is_alive()]
                if dead and results.empty():
                    for i in dead:
                        errors.append(f"{devices[i]}: worker exited with code {processes[i].exitcode}")
                        pending.discard(i)
                continue
            if kind == "row":
                rows.append(payload)
                if on_row is not None:
                    on_row(payload)
            else:
                pending.discard(index)
                if kind == "error":
                    errors.append(f"{devices[index]}: {payload}")
    except KeyboardInterrupt:
        for p in processes:
            p.terminate()
        raise PartialResult(rows, "interrupted")
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise PartialResult(rows, "failed", "; ".join(errors))
    return rows


class PartialResult(Exception):
    """Carries the rows measured before an interrupt or a failure, so none are lost."""

    def __init__(self, rows: list[dict[str, Any]], status: str, error: str | None = None):
        super().__init__(error or status)
        self.rows = rows
        self.status = status
        self.error = error


# --- the whole run ----------------------------------------------------------------------------

def cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_devices(device: int | None, all_devices: bool) -> list[str]:
    count = cuda_device_count()
    if all_devices:
        if count == 0:
            raise NotAvailableError("--all-devices needs CUDA GPUs, and torch sees none here",
                                    hint="drop --all-devices to measure CPU memory bandwidth")
        return [f"cuda:{i}" for i in range(count)]
    if device is not None:
        if count == 0:
            raise NotAvailableError(f"--device {device} asks for a GPU, and torch sees no CUDA GPU here",
                                    hint="drop --device to measure CPU memory bandwidth")
        if not 0 <= device < count:
            raise UsageError(f"--device {device} does not exist: torch sees {count} GPU(s), 0..{count - 1}")
        return [f"cuda:{device}"]
    return ["cuda:0"] if count else ["cpu"]


def device_context(devices: list[str]) -> dict[str, dict[str, Any]]:
    """Name, spec bandwidth and PCIe link of each device, for the comparison with theory."""
    import torch

    context: dict[str, dict[str, Any]] = {}
    for device in devices:
        if device == "cpu":
            context[device] = {"name": cpu_model_name(), "hbm_gbps": None,
                               "hbm_source": "no reference bandwidth for CPU memory (DIMM population unknown)",
                               "pcie": None}
            continue
        index = torch.device(device).index or 0
        name = torch.cuda.get_device_name(index)
        hbm_gbps, hbm_source = hbm_theoretical_gbps(name)
        link = pcie_link(index)
        pcie_gbps, pcie_source = pcie_theoretical_gbps(link["gen"], link["width"])
        context[device] = {"name": name, "hbm_gbps": hbm_gbps, "hbm_source": hbm_source,
                           "pcie": {**link, "theoretical_gbps": pcie_gbps, "theoretical_source": pcie_source}}
    return context


def add_theory(rows: list[dict[str, Any]], context: dict[str, dict[str, Any]]) -> None:
    for row in rows:
        if "gbps" not in row:
            continue
        info = context.get(row["device"], {})
        if row["test"] in ("h2d", "d2h"):
            theoretical = (info.get("pcie") or {}).get("theoretical_gbps")
        else:
            theoretical = info.get("hbm_gbps")
        row["theoretical_gbps"] = theoretical
        row["ratio"] = row["gbps"] / theoretical if theoretical else None


def summarize(rows: list[dict[str, Any]], context: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Headline: the best copy bandwidth (the slowest device's, when several ran) against the spec."""
    measured = [r for r in rows if "gbps" in r]
    per_device: dict[str, dict[str, Any]] = {}
    random_writes = {r["device"] for r in measured if r["test"] == "write" and not r.get("constant_data")}
    for row in measured:
        if row.get("constant_data") and row["device"] in random_writes:
            continue  # a store of random data ran: the headline uses that, not the constant fill
        key = row["test"] if not row.get("host_memory") else f"{row['test']}_{row['host_memory']}"
        entry = per_device.setdefault(row["device"], {"name": context.get(row["device"], {}).get("name")})
        if key == "copy":
            entry.setdefault("copy_gbps_by_engine", {})[row["engine"]] = row["gbps"]
        best = entry.get(f"{key}_gbps")
        if best is None or row["gbps"] > best:
            entry[f"{key}_gbps"] = row["gbps"]
            entry[f"{key}_engine"] = row["engine"]
            entry[f"{key}_ratio"] = row.get("ratio")
    summary: dict[str, Any] = {"value": None, "unit": "GB/s", "theoretical": None, "ratio": None,
                               "metric": "copy bandwidth (bytes read + written) / time, median",
                               "per_device": per_device}
    copies = [(d, e["copy_gbps"]) for d, e in per_device.items() if e.get("copy_gbps") is not None]
    if copies:
        device, value = min(copies, key=lambda item: item[1])
        theoretical = context.get(device, {}).get("hbm_gbps")
        summary.update(value=value, device=device, theoretical=theoretical,
                       ratio=value / theoretical if theoretical else None,
                       theoretical_source=context.get(device, {}).get("hbm_source"))
    for key in ("read", "write", "h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"):
        values = [e[f"{key}_gbps"] for e in per_device.values() if e.get(f"{key}_gbps") is not None]
        if values:
            summary[f"{key}_gbps"] = min(values)
    return summary


def run_membw(*, device: int | None = None, all_devices: bool = False, size_bytes: int | None = None,
              tests: Iterable[str] = TESTS, engines: Iterable[str] | None = None, iters: int = 20,
              warmup: int = 5, threads: int | None = None,
              on_row: Callable[[dict[str, Any]], None] | None = None):
    """Measure and return a Measurement (kind 'membw'); interrupted or failed runs keep their rows."""
    from mleng.results.record import Measurement

    tests = list(tests)
    unknown = [t for t in tests if t not in TESTS]
    if unknown:
        raise UsageError(f"unknown test(s) {', '.join(unknown)}", hint=f"choose from {', '.join(TESTS)}")
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
            raise NotAvailableError("h2d/d2h need a CUDA GPU, and torch sees none here",
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
    try:
        context = device_context(devices)
        m.params["device_names"] = {d: c["name"] for d, c in context.items()}
        if len(devices) == 1:
            rows: list[dict[str, Any]] = []

            def keep(row: dict[str, Any]) -> None:
                rows.append(row)
                if on_row is not None:
                    on_row(row)

            try:
                measure_device(devices[0], on_row=keep, **kwargs)
            except KeyboardInterrupt:
                raise PartialResult(rows, "interrupted")
            except MlengError as exc:
                if not rows:
                    raise
                # keep the rows, and say what stopped the run (a wrong copy, a lost device), not just that it did
                raise PartialResult(rows, "failed", exc.message)
        else:
            rows = measure_concurrently(devices, on_row=on_row, **kwargs)
    except PartialResult as partial:
        return _finish(m, partial.rows, context, t0, partial.status, partial.error)
    return _finish(m, rows, context, t0, "complete", None)


def _finish(m, rows, context, t0, status, error):
    m.rows = rows
    add_theory(m.rows, context)
    m.summary = summarize(m.rows, context)
    m.summary["wall_s"] = round(time.monotonic() - t0, 2)
    m.summary["devices"] = context
    return m.finish(status, error)


