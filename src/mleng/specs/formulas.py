"""Theoretical rates: peak TFLOPS from clock and unit counts, memory bandwidth from clock and bus, busbw factors."""

from __future__ import annotations

from typing import Callable

from mleng.errors import UsageError
from mleng.specs.catalog import Accelerator, lookup_accelerator, normalize_dtype


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UsageError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def peak_tflops(clock_mhz: float, fmas_per_clock_per_unit: float, units: int) -> float:
    """clock x FMAs per clock per unit x 2 FLOPs per FMA x units, in TFLOPS (10^12 FLOP/s)."""
    clock_hz = _positive("clock_mhz", clock_mhz) * 1e6
    fmas = _positive("fmas_per_clock_per_unit", fmas_per_clock_per_unit)
    return clock_hz * fmas * 2 * _positive("units", units) / 1e12


def clock_behind_spec(spec_tflops: float, fmas_per_clock_per_unit: float, units: int) -> float:
    """The clock (MHz) a published peak assumes: the inverse of peak_tflops.

    It tells which clock a vendor's number was computed at, e.g. H100's 989 needs 1829 MHz,
    not the widely quoted 1980 MHz.
    """
    per_mhz = peak_tflops(1.0, fmas_per_clock_per_unit, units)
    return _positive("spec_tflops", spec_tflops) / per_mhz


def spec_clock_mhz(accelerator: Accelerator | str) -> float:
    """The compute clock behind an accelerator's published peak.

    Derived from the bf16 (else fp16) peak and the matrix-unit counts where the data has them,
    because that is the clock the peak really assumes; else the clock the data file lists.
    """
    acc = lookup_accelerator(accelerator)
    if acc.fmas_per_clock_per_unit and acc.matrix_units:
        for dtype in ("bf16", "fp16"):
            if dtype in acc.tflops:
                return clock_behind_spec(acc.tflops[dtype], acc.fmas_per_clock_per_unit, acc.matrix_units)
    if acc.max_clock_mhz:
        return float(acc.max_clock_mhz)
    raise UsageError(f"{acc.key}: the clock behind its published peak is not known "
                     f"(no max_clock_mhz and no matrix-unit counts in the spec data)")


def peak_tflops_at_clock(accelerator: Accelerator | str, dtype: str, measured_clock_mhz: float) -> float:
    """The dense peak the card can reach at a measured clock: spec peak x measured / spec clock.

    A card held below its spec clock (power cap, heat) cannot reach the datasheet number; this is
    the ceiling to compare a measurement against.
    """
    acc = lookup_accelerator(accelerator)
    key = normalize_dtype(dtype)
    if key not in acc.tflops:
        have = ", ".join(acc.tflops) or "none"
        raise UsageError(f"{acc.key} has no published {key} rate; it has: {have}")
    measured = _positive("measured_clock_mhz", measured_clock_mhz)
    return acc.tflops[key] * measured / spec_clock_mhz(acc)


def peak_memory_bandwidth_tbps(memory_clock_mhz: float, bus_width_bits: int) -> float:
    """DDR memory: clock x bus width in bytes x 2 transfers per clock, in TB/s (10^12 bytes/s).

    Inputs as the device reports them, e.g. torch's memory_clock_rate (kHz) / 1000 and memory_bus_width.
    """
    clock_hz = _positive("memory_clock_mhz", memory_clock_mhz) * 1e6
    bus_bytes = _positive("bus_width_bits", bus_width_bits) / 8
    return clock_hz * bus_bytes * 2 / 1e12


def memory_clock_behind_spec(bandwidth_tbps: float, bus_width_bits: int) -> float:
    """The memory clock (MHz) a published bandwidth assumes: the inverse of peak_memory_bandwidth_tbps."""
    return _positive("bandwidth_tbps", bandwidth_tbps) / peak_memory_bandwidth_tbps(1.0, bus_width_bits)


# busbw = algbw x factor(n ranks), as nccl-tests defines it (doc/PERFORMANCE.md): the factor turns
# the payload rate into the rate each rank's link must carry in a ring, so it compares with the wire.
BUSBW_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}

_OP_SPELLINGS = {
    "allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all", "sendrecv": "send_recv", "p2p": "send_recv",
    "allgatherintotensor": "all_gather", "reducescattertensor": "reduce_scatter",
}


def collective_name(op: str) -> str:
    """The BUSBW_FACTORS key for a spelling such as 'all-reduce', 'allreduce' or 'all_reduce'."""
    squashed = "".join(ch for ch in str(op).lower() if ch.isalnum())
    for name in BUSBW_FACTORS:
        if squashed == name.replace("_", ""):
            return name
    if squashed in _OP_SPELLINGS:
        return _OP_SPELLINGS[squashed]
    raise UsageError(f"unknown collective '{op}'; known: {', '.join(BUSBW_FACTORS)}")


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of a collective over n ranks (all_reduce: 2(n-1)/n)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f"the number of ranks must be a positive integer, got {n!r}")
    return BUSBW_FACTORS[collective_name(op)](n)


def algbw_gbps(size_bytes: float, time_s: float) -> float:
    """Payload bytes / elapsed seconds, in GB/s base 10."""
    return _positive("size_bytes", size_bytes) / _positive("time_s", time_s) / 1e9


def busbw_gbps(op: str, size_bytes: float, time_s: float, n: int) -> float:
    """algbw x busbw_factor: comparable with a link's unidirectional GB/s (ring algorithms)."""
    return algbw_gbps(size_bytes, time_s) * busbw_factor(op, n)
