"""The kernels `mleng membw` times besides torch's own: Triton copy/read/write (when Triton is installed) and
the CUDA driver's device-to-device copy, the ceiling a copy kernel of ours is compared with."""

from __future__ import annotations

from typing import Any, Callable

from mleng.errors import MlengError


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
