"""Theoretical-rate formulas against the published peaks, and the busbw factors of nccl-tests."""

from __future__ import annotations

import pytest

from mleng.errors import UsageError
from mleng.specs import (
    BUSBW_FACTORS,
    algbw_gbps,
    busbw_factor,
    busbw_gbps,
    clock_behind_spec,
    load_accelerators,
    lookup_accelerator,
    memory_clock_behind_spec,
    peak_memory_bandwidth_tbps,
    peak_tflops,
    peak_tflops_at_clock,
    spec_clock_mhz,
)


@pytest.mark.parametrize("clock_mhz,fmas,units,expected", [
    (1830, 512, 528, 989.4),       # H100 SXM, Tensor Cores
    (1410, 256, 432, 311.9),       # A100 SXM
    (2100, 256, 1216, 1307.4),     # MI300X, Matrix Cores
    (1700, 128, 880, 383.0),       # MI250X
    (2400, 512, 1024, 2516.6),     # MI355X
    (1650, 256 * 256, 2, 432.5),   # Gaudi 2, MMEs
    (1600, 256 * 256, 8, 1677.7),  # Gaudi 3
])
def test_peak_tflops_reproduces_the_published_figures(clock_mhz, fmas, units, expected):
    assert peak_tflops(clock_mhz, fmas, units) == pytest.approx(expected, abs=0.05)


def test_gaudi3_whitepaper_figure_needs_a_higher_clock():
    assert clock_behind_spec(1835, 256 * 256, 8) == pytest.approx(1750, abs=1)
    assert round(peak_tflops(1600, 256 * 256, 8)) == 1678 and int(peak_tflops(1600, 256 * 256, 8)) == 1677


def test_clock_behind_spec_exposes_the_clock_the_vendor_assumed():
    assert clock_behind_spec(989, 512, 528) == pytest.approx(1829.20, abs=0.01)
    # the widely quoted 1980 MHz H100 boost clock would give a peak NVIDIA never published
    assert peak_tflops(1980, 512, 528) == pytest.approx(1070.53, abs=0.01)
    assert clock_behind_spec(peak_tflops(1234, 256, 432), 256, 432) == pytest.approx(1234)


@pytest.mark.parametrize("acc", [a for a in load_accelerators().values()
                                 if a.max_clock_mhz and a.matrix_units and a.fmas_per_clock_per_unit],
                         ids=lambda a: a.key)
def test_the_data_reproduces_its_own_peak(acc):
    spec = acc.tflops.get("bf16") or acc.tflops["fp16"]
    assert peak_tflops(acc.max_clock_mhz, acc.fmas_per_clock_per_unit, acc.matrix_units) == pytest.approx(spec, rel=0.01)


def test_enough_entries_carry_the_formula_inputs():
    with_formula = [a.key for a in load_accelerators().values()
                    if a.max_clock_mhz and a.matrix_units and a.fmas_per_clock_per_unit]
    assert {"h100-sxm", "h200-sxm", "a100-sxm", "mi300x", "mi355x", "gaudi3", "v100-sxm2"} <= set(with_formula)


def test_peak_at_measured_clock_scales_the_spec():
    assert peak_tflops_at_clock("h100", "bf16", 1830) == pytest.approx(989.4, abs=0.1)
    throttled = peak_tflops_at_clock("NVIDIA H100 80GB HBM3", "torch.bfloat16", 1500)
    assert throttled == pytest.approx(989 * 1500 / 1829.2, rel=1e-4)
    assert peak_tflops_at_clock("h100", "fp8", 915) == pytest.approx(1979 / 2, rel=1e-3)


def test_spec_clock_falls_back_to_the_listed_clock():
    assert spec_clock_mhz("h100") == pytest.approx(1829.2, abs=0.1)  # derived from 989 and the unit counts
    assert spec_clock_mhz("b200") == 1965  # no unit counts: the device-reported max clock in the data


def test_peak_at_clock_refuses_what_it_cannot_know():
    with pytest.raises(UsageError, match="no published fp8"):
        peak_tflops_at_clock("a100", "fp8", 1410)
    with pytest.raises(UsageError, match="clock behind"):
        peak_tflops_at_clock("tpu-v5e", "bf16", 1000)
    with pytest.raises(UsageError, match="unknown dtype"):
        peak_tflops_at_clock("h100", "fp3", 1000)
    with pytest.raises(UsageError, match="measured_clock_mhz"):
        peak_tflops_at_clock("h100", "bf16", 0)


@pytest.mark.parametrize("args", [(0, 512, 528), (-1830, 512, 528), (1830, 0, 528), (1830, 512, True), ("1830", 512, 528)])
def test_peak_tflops_rejects_impossible_inputs(args):
    with pytest.raises(UsageError):
        peak_tflops(*args)


def test_h200_bandwidth_from_memory_clock_and_bus_width():
    h200 = lookup_accelerator("h200")
    assert h200.memory_bus_width_bits == 6144
    clock = memory_clock_behind_spec(4.8, h200.memory_bus_width_bits)
    assert clock == pytest.approx(3125)
    assert peak_memory_bandwidth_tbps(clock, 6144) == pytest.approx(4.8, rel=0.05)
    # 3125 MHz DDR is 6.25 Gb/s per pin, within HBM3e's 9.6 Gb/s maximum (the book's HBM table)
    assert 2 * clock / 1000 <= 9.6


def test_memory_bandwidth_formula_matches_the_book_and_the_data():
    assert peak_memory_bandwidth_tbps(3996, 8192) == pytest.approx(8.184, abs=0.001)  # B200 worked example
    for acc in load_accelerators().values():
        if acc.memory_clock_mhz and acc.memory_bus_width_bits:
            derived = peak_memory_bandwidth_tbps(acc.memory_clock_mhz, acc.memory_bus_width_bits)
            assert derived == pytest.approx(acc.memory_bandwidth_tbps, rel=0.03), acc.key


def test_h100_bandwidth_inversion():
    # 3.35 TB/s over 5 stacks x 1024 bits implies the 2619 MHz memory clock the device reports
    assert memory_clock_behind_spec(3.35, 5120) == pytest.approx(2617, abs=3)


@pytest.mark.parametrize("op,n,expected", [
    ("all_reduce", 2, 1.0), ("all_reduce", 8, 1.75), ("all_reduce", 64, 2 * 63 / 64), ("all_reduce", 1, 0.0),
    ("all_gather", 8, 0.875), ("reduce_scatter", 8, 0.875), ("all_to_all", 4, 0.75),
    ("broadcast", 8, 1.0), ("reduce", 8, 1.0), ("send_recv", 2, 1.0),
])
def test_busbw_factors_as_nccl_tests_defines_them(op, n, expected):
    assert busbw_factor(op, n) == pytest.approx(expected)
    assert BUSBW_FACTORS[op](n) == pytest.approx(expected)


@pytest.mark.parametrize("spelling", ["all-reduce", "allreduce", "AllReduce", "ALL_REDUCE", "all reduce"])
def test_busbw_factor_accepts_common_spellings(spelling):
    assert busbw_factor(spelling, 8) == 1.75


def test_busbw_factor_rejects_bad_input():
    with pytest.raises(UsageError, match="known: all_reduce"):
        busbw_factor("allscatter", 8)
    for n in (0, -2, 2.5, True):
        with pytest.raises(UsageError):
            busbw_factor("all_reduce", n)


def test_algbw_and_busbw():
    size = 2**30  # 1 GiB
    assert algbw_gbps(size, 0.01) == pytest.approx(107.374, abs=1e-3)
    assert busbw_gbps("all-reduce", size, 0.01, 8) == pytest.approx(107.374 * 1.75, abs=1e-2)
    # undoing it: elapsed t = P * factor / busbw
    busbw = busbw_gbps("all_gather", size, 0.02, 4)
    assert size * busbw_factor("all_gather", 4) / (busbw * 1e9) == pytest.approx(0.02)
