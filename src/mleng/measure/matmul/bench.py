"""MAMF: devices and dtypes, memory checks, and the real timed matmul (MatmulBench)."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from mleng.measure.sizes import format_bytes
from mleng.errors import NotAvailableError, UsageError
from mleng.measure.matmul.search import BURST_IDLE_S, BURST_WARMUP, FINAL_WARMUP_S
from mleng.measure.matmul.shapes import CPU_LOW_PRECISION_MAX_DIM, FP8_DTYPES, Shape
from mleng.measure.timing import TimingStats

# ---------------------------------------------------------------- devices and dtypes

def resolve_device(spec: str | int | None):
    """--device: None (first accelerator, else CPU), N (accelerator N), 'cpu', 'cuda:N', 'mps', 'xpu:N'."""
    import torch

    def accelerator_type() -> str | None:
        if torch.cuda.is_available():
            return "cuda"
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            return "xpu"
        if torch.backends.mps.is_available():
            return "mps"
        return None

    if spec is None or str(spec) == "":
        kind = accelerator_type()
        return torch.device(f"{kind}:0" if kind in ("cuda", "xpu") else (kind or "cpu"))
    text = str(spec).strip().lower()
    if text.isdigit():
        kind = accelerator_type()
        if kind is None:
            raise NotAvailableError(f"--device {text}: no GPU is visible to torch on this machine",
                                    hint="use --device cpu, or check the driver and CUDA_VISIBLE_DEVICES")
        text = f"{kind}:{text}" if kind != "mps" else "mps"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(f"--device {spec!r} is not a device", hint="use N, cpu, cuda:N, mps or xpu:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise NotAvailableError(f"--device {spec}: CUDA is not available in this torch "
                                    f"({torch.__version__}) on this machine", hint="use --device cpu")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise NotAvailableError(f"--device {spec}: only {torch.cuda.device_count()} GPU(s) visible",
                                    hint=f"use an index below {torch.cuda.device_count()}")
        return torch.device("cuda", index)
    if device.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise NotAvailableError(f"--device {spec}: no XPU available")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise NotAvailableError(f"--device {spec}: MPS is not available")
    if device.type not in ("cpu", "cuda", "xpu", "mps"):
        raise UsageError(f"--device {spec}: device type {device.type} is not supported by mleng mamf")
    return device


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "xpu":
        return torch.xpu.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    from mleng.measure.timing import cpu_model_name

    return cpu_model_name()


def cpu_has_native(dtype: str) -> bool:
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return False
    wanted = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}.get(dtype, ())
    return any(flag in flags for flag in wanted)


def check_dtype_supported(device, dtype: str, max_dim: int) -> None:
    """Refuse, with the reason, a dtype the device cannot run (or, on a CPU, cannot run at this size)."""
    import torch

    is_rocm = bool(getattr(torch.version, "hip", None))
    if dtype in FP8_DTYPES:
        if device.type != "cuda":
            raise NotAvailableError(f"--dtype {dtype} needs a CUDA or ROCm GPU (torch._scaled_mm); "
                                    f"{device.type} has no fp8 matmul", hint="use --dtype bfloat16 or float32")
        if not hasattr(torch, dtype):
            raise NotAvailableError(f"this torch ({torch.__version__}) has no torch.{dtype}")
        if dtype == "float8_e4m3fnuz" and not is_rocm:
            raise NotAvailableError("float8_e4m3fnuz is the ROCm (MI300) fp8 format; NVIDIA GPUs use float8_e4m3fn",
                                    hint="use --dtype float8_e4m3fn")
        if not is_rocm and torch.cuda.get_device_capability(device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(device)
            raise NotAvailableError(f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) "
                                    f"has no fp8 tensor cores; fp8 needs 8.9 (Ada) or newer",
                                    hint="use --dtype bfloat16")
    if device.type == "cuda" and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise NotAvailableError(f"{torch.cuda.get_device_name(device)} does not support bfloat16 matmul",
                                hint="use --dtype float16")
    if device.type == "cpu" and dtype in ("bfloat16", "float16") and max_dim > CPU_LOW_PRECISION_MAX_DIM \
            and not cpu_has_native(dtype):
        raise UsageError(
            f"this CPU has no native {dtype} instructions: a {dtype} matmul above "
            f"{CPU_LOW_PRECISION_MAX_DIM} (largest dimension asked: {max_dim}) would take minutes",
            hint=f"use --dtype float32 on this CPU, or shapes of at most {CPU_LOW_PRECISION_MAX_DIM}",
        )


def element_bytes(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1}[dtype]


def output_bytes(dtype: str) -> int:
    return 2 if dtype in FP8_DTYPES else element_bytes(dtype)


def bytes_needed(m_k: int, n_k: int, m_n: int, dtype: str) -> int:
    return (m_k + n_k) * element_bytes(dtype) + m_n * output_bytes(dtype)


def free_memory_bytes(device) -> int | None:
    import torch

    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "xpu" and hasattr(torch.xpu, "mem_get_info"):
        return int(torch.xpu.mem_get_info(device)[0])
    if device.type == "cpu":
        from mleng.machine.system import host_available_bytes

        return host_available_bytes()
    return None


def check_fits(device, dtype: str, shapes: Sequence[Shape]) -> None:
    """Refuse shapes whose operands cannot be held in the device's free memory."""
    from mleng.measure.timing import cache_bytes

    need = bytes_needed(max(s.m * s.k for s in shapes), max(s.n * s.k for s in shapes),
                        max(s.m * s.n for s in shapes), dtype)
    need += 2 * cache_bytes(device)  # the cache-flush buffer
    free = free_memory_bytes(device)
    if free is not None and need > 0.9 * free:
        largest = max(shapes, key=lambda s: s.m * s.k + s.n * s.k + s.m * s.n)
        raise UsageError(
            f"shape {largest} in {dtype} needs {format_bytes(need)} of memory on {device}, "
            f"but only {format_bytes(free)} is free",
            hint="use smaller dimensions",
        )
    if dtype in FP8_DTYPES:
        bad = [s for s in shapes if s.m % 16 or s.n % 16 or s.k % 16]
        if bad:
            raise UsageError(f"fp8 matmul (torch._scaled_mm) needs every dimension divisible by 16; {bad[0]} is not")


# ---------------------------------------------------------------- the real measurement

class MatmulBench:
    """Times torch matmuls of any shape up to `max_shape`, on views into pre-randomized buffers.

    Inputs are drawn once from a normal distribution into pools as large as the largest shape
    needs; each shape uses contiguous views into them, so a shape costs no allocation. B is
    laid out as nn.Linear's weight (n, k), transposed. The output is re-randomized before every
    timed call and the cache flushed after that (mleng.measure.timing.time_fn).
    """

    def __init__(self, device, dtype: str, max_m_k: int, max_n_k: int, max_m_n: int,
                 tf32: bool = False, fp8_fast_accum: bool = False):
        import torch

        self.device = device
        self.dtype = dtype
        self.fp8_fast_accum = fp8_fast_accum
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        generator_dtype = torch.bfloat16 if dtype in FP8_DTYPES else getattr(torch, dtype)
        self.torch_dtype = getattr(torch, dtype)
        self.a_pool = self._random_pool(max_m_k, generator_dtype)
        self.b_pool = self._random_pool(max_n_k, generator_dtype)
        out_dtype = torch.bfloat16 if dtype in FP8_DTYPES else self.torch_dtype
        self.c_pool = torch.empty(max_m_n, dtype=out_dtype, device=device)
        if dtype in FP8_DTYPES:
            self.scale_a = torch.ones((), dtype=torch.float32, device=device)
            self.scale_b = torch.ones((), dtype=torch.float32, device=device)

    def _random_pool(self, size: int, dtype):
        import torch

        pool = torch.randn(size, dtype=dtype, device=self.device)
        return pool.to(self.torch_dtype) if self.dtype in FP8_DTYPES else pool

    def operands(self, shape: Shape):
        a = self.a_pool[: shape.m * shape.k].view(shape.m, shape.k)
        b = self.b_pool[: shape.n * shape.k].view(shape.n, shape.k).t()
        c = self.c_pool[: shape.m * shape.n].view(shape.m, shape.n)
        return a, b, c

    def call(self, shape: Shape) -> Callable[[], Any]:
        import torch

        a, b, c = self.operands(shape)
        if self.dtype in FP8_DTYPES:
            def fp8_mm():
                return torch._scaled_mm(a, b, self.scale_a, self.scale_b, out_dtype=torch.bfloat16,
                                        use_fast_accum=self.fp8_fast_accum, out=c)
            return fp8_mm
        return lambda: torch.mm(a, b, out=c)

    @property
    def has_boost_clock(self) -> bool:
        """Accelerators run faster from rest than settled; a CPU's turbo is not worth two protocols."""
        return self.device.type != "cpu"

    @property
    def final_fixed_s(self) -> float:
        """Seconds a finalist's protocol adds beyond its calls (see FINAL_WARMUP_S)."""
        return FINAL_WARMUP_S + BURST_IDLE_S if self.has_boost_clock else 0.0

    def __call__(self, shape: Shape, iters: int, phase: str = "coarse") -> TimingStats:
        from mleng.measure.timing import time_fn

        _, _, c = self.operands(shape)
        # A short kernel gets two warm-up calls (the first carries the BLAS heuristic lookup);
        # a long one needs only one.
        warmup = 2 if shape.flops < 2e11 else 1
        warmup_s = idle_s = 0.0
        if self.has_boost_clock:
            if phase == "final":
                warmup_s = FINAL_WARMUP_S
            elif phase == "burst":
                idle_s, warmup = BURST_IDLE_S, BURST_WARMUP
        return time_fn(self.call(shape), device=self.device, warmup=warmup, iters=iters,
                       flush_l2=True, setup=c.normal_, warmup_s=warmup_s, idle_before_s=idle_s)

    def probe(self) -> None:
        """A tiny timed matmul: an unsupported dtype fails here with torch's reason, and the
        one-time costs (flush buffer, thread pools, BLAS handles) stay out of the search."""
        try:
            self(Shape(64, 64, 64), 1, "probe")
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise NotAvailableError(f"{self.dtype} matmul does not run on {self.device}: {first_line}") from None

    def warm_up(self, shape: Shape, monitor=None, min_s: float = 1.0, max_s: float = 3.0) -> dict[str, Any]:
        """Run `shape` back to back until the SM clock settles (NVML), or for `min_s` without NVML."""
        from mleng.measure.timing import sync

        fn = self.call(shape)
        t0 = time.monotonic()
        calls = 0
        settled = None
        while True:
            for _ in range(8):
                fn()
            sync(self.device)
            calls += 8
            elapsed = time.monotonic() - t0
            if elapsed >= max_s:
                break
            if elapsed >= min_s:
                settled = monitor.sm_clock_settled() if monitor is not None else None
                if settled is None or settled:
                    break
        return {"shape": str(shape), "seconds": round(time.monotonic() - t0, 3), "calls": calls,
                "clock_settled": settled}


