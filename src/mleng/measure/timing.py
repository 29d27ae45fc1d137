"""Timing core for every benchmark: device events on CUDA, host clock plus synchronize elsewhere."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

# Fallback when a CPU does not publish its last-level cache size in sysfs.
_DEFAULT_CPU_LLC_BYTES = 32 * 2**20
# Floor for the flush buffer: some devices report a tiny or zero L2.
_MIN_FLUSH_BYTES = 8 * 2**20
# Devices that report no cache size (MPS, some XPUs): a flush of twice this, 256 MiB, the size
# triton.testing.do_bench uses for every device.
_UNKNOWN_DEVICE_CACHE_BYTES = 128 * 2**20

_flush_buffers: dict[str, Any] = {}


@dataclasses.dataclass(frozen=True)
class TimingStats:
    """Per-iteration times of one timed function, in seconds, with their summary statistics."""

    samples_s: tuple[float, ...]
    median_s: float
    mean_s: float
    min_s: float
    max_s: float
    p10_s: float
    p90_s: float
    p99_s: float
    iqr_s: float
    cv: float            # population standard deviation / mean
    iters: int

    @classmethod
    def from_samples(cls, samples_s: Sequence[float]) -> "TimingStats":
        if not samples_s:
            raise ValueError("TimingStats needs at least one sample")
        ordered = sorted(float(s) for s in samples_s)
        mean = math.fsum(ordered) / len(ordered)
        variance = math.fsum((s - mean) ** 2 for s in ordered) / len(ordered)
        return cls(
            samples_s=tuple(float(s) for s in samples_s),
            median_s=quantile(ordered, 0.5),
            mean_s=mean,
            min_s=ordered[0],
            max_s=ordered[-1],
            p10_s=quantile(ordered, 0.1),
            p90_s=quantile(ordered, 0.9),
            p99_s=quantile(ordered, 0.99),
            iqr_s=quantile(ordered, 0.75) - quantile(ordered, 0.25),
            cv=math.sqrt(variance) / mean if mean > 0 and len(ordered) > 1 else 0.0,
            iters=len(ordered),
        )

    def merged(self, other: "TimingStats") -> "TimingStats":
        """Statistics over the samples of both: a re-measurement adds to what was seen."""
        return TimingStats.from_samples(self.samples_s + other.samples_s)

    def to_dict(self, with_samples: bool = False) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "samples_s"}
        if with_samples:
            out["samples_s"] = list(self.samples_s)
        return out


def quantile(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of an already sorted sequence (numpy's default method)."""
    if not ordered:
        raise ValueError("quantile of no values")
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class Stopwatch:
    """One timed region: CUDA events on a CUDA device (never a host clock around asynchronous work),
    the host clock elsewhere. For loops that time() cannot express, such as collectives where every
    rank times its own part and the slowest rank's time is kept."""

    def __init__(self, device: Any):
        import torch

        self.torch = torch
        self.cuda = str(device).startswith("cuda")
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.start_event.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since start(), after the device finished the work queued meanwhile."""
        self.mark_end()
        return self.elapsed()

    def mark_end(self) -> None:
        """Right after the timed work is queued: with several devices timed at once, each one's end, so the
        others' work does not count in its time (the burn-in)."""
        if self.cuda:
            self.end_event.record()
        else:
            self._t1 = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds from start() to mark_end(), once the device finished that work."""
        if self.cuda:
            self.end_event.synchronize()
            return self.start_event.elapsed_time(self.end_event) / 1e3
        return self._t1 - self._t0

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()


def as_device(device: Any):
    import torch

    return device if isinstance(device, torch.device) else torch.device(device)


def sync(device: Any) -> None:
    """Wait until all work queued on the device is done; a no-op on CPU."""
    import torch

    device = as_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def cache_bytes(device: Any) -> int:
    """The size of the cache a flush must evict: the GPU's L2, or the CPU's last-level cache."""
    import torch

    device = as_device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    if device.type == "xpu":
        props = torch.xpu.get_device_properties(device)
        return int(getattr(props, "l2_cache_size", 0) or 0) or _UNKNOWN_DEVICE_CACHE_BYTES
    if device.type == "cpu":
        return cpu_last_level_cache_bytes()
    return _UNKNOWN_DEVICE_CACHE_BYTES


def cpu_last_level_cache_bytes() -> int:
    """Largest cache size cpu0 reports in sysfs (the L3 on most servers)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
        except OSError:
            continue
        multiplier = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * multiplier)
    return max(sizes) if sizes else _DEFAULT_CPU_LLC_BYTES


def flush_buffer(device: Any):
    """A byte buffer twice the cache size, kept per device; writing it evicts the cache."""
    import torch

    device = as_device(device)
    key = str(device)
    if key not in _flush_buffers:
        size = max(2 * cache_bytes(device), _MIN_FLUSH_BYTES)
        _flush_buffers[key] = torch.empty(size, dtype=torch.int8, device=device)
    return _flush_buffers[key]


def time_fn(fn: Callable[[], Any], *, device: Any, warmup: int = 3, iters: int = 10,
            flush_l2: bool = True, setup: Callable[[], Any] | None = None,
            warmup_s: float = 0.0, idle_before_s: float = 0.0) -> TimingStats:
    """Time `iters` calls of fn after `warmup` untimed ones.

    Before each timed call: `setup()` (e.g. re-randomize an output), then the cache flush,
    both outside the timed region. CUDA is timed with one pair of events per iteration and
    a single synchronize at the end, so the host never stalls the queue between calls.
    `warmup_s` keeps warming up (prepared calls, back to back) until that much wall time has
    passed, so that a GPU's clock settles to what this work sustains; `idle_before_s` leaves
    the device idle that long first, so that each measurement starts from a rested card.
    """
    import torch

    if iters < 1:
        raise ValueError("iters must be at least 1")
    device = as_device(device)
    buffer = flush_buffer(device) if flush_l2 else None

    def prepare() -> None:
        if setup is not None:
            setup()
        if buffer is not None:
            buffer.fill_(1)

    if idle_before_s > 0:
        sync(device)
        time.sleep(idle_before_s)
    for _ in range(max(warmup, 0)):
        prepare()
        fn()
    sync(device)
    if warmup_s > 0:
        started = time.perf_counter()
        chunk = 1
        while time.perf_counter() - started < warmup_s:
            for _ in range(chunk):
                prepare()
                fn()
            sync(device)
            chunk = min(chunk * 2, 64)

    if device.type == "cuda":
        # Events record on the current stream of the current device: make it ours.
        with torch.cuda.device(device):
            return _time_cuda(fn, prepare, device, iters)

    samples = []
    for _ in range(iters):
        prepare()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return TimingStats.from_samples(samples)


def _time_cuda(fn: Callable[[], Any], prepare: Callable[[], None], device: Any,
               iters: int) -> TimingStats:
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        prepare()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return TimingStats.from_samples([start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)])


def process_elapsed_s() -> float:
    """Seconds since this process started (Linux /proc), so that budgets include import and device init."""
    try:
        with open("/proc/self/stat") as f:
            # The command name (field 2) may hold spaces; fields after its closing parenthesis are fixed.
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "CPU"


_IMPORTED_AT = time.monotonic()
