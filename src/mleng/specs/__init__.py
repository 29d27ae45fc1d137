"""Reference specs of accelerators and links, with sources, plus the theoretical-rate formulas."""

from mleng.specs.catalog import (
    DTYPES,
    Accelerator,
    Choice,
    Link,
    Source,
    find_accelerator,
    load_accelerators,
    load_links,
    lookup,
    lookup_accelerator,
    lookup_link,
    normalize_dtype,
    pcie_link,
    pcie_link_gbps,
)
from mleng.specs.formulas import (
    BUSBW_FACTORS,
    algbw_gbps,
    busbw_factor,
    busbw_gbps,
    clock_behind_spec,
    memory_clock_behind_spec,
    peak_memory_bandwidth_tbps,
    peak_tflops,
    peak_tflops_at_clock,
    spec_clock_mhz,
)

__all__ = [
    "DTYPES", "Accelerator", "Choice", "Link", "Source",
    "find_accelerator", "load_accelerators", "load_links", "lookup", "lookup_accelerator", "lookup_link",
    "normalize_dtype", "pcie_link", "pcie_link_gbps",
    "BUSBW_FACTORS", "algbw_gbps", "busbw_factor", "busbw_gbps", "clock_behind_spec",
    "memory_clock_behind_spec", "peak_memory_bandwidth_tbps", "peak_tflops", "peak_tflops_at_clock",
    "spec_clock_mhz",
]
