"""MAMF: the maximum achievable matmul TFLOPS of a device, found by an adaptive shape search.

shapes: shapes, dtypes, results and the shape parsers; search: the search engine over an abstract
measure(); bench: devices, memory checks and the real timed matmul; run: one whole run and its record.
"""

from mleng.measure.matmul.bench import (
    MatmulBench, check_dtype_supported, check_fits, cpu_has_native, device_name, free_memory_bytes, resolve_device,
)
from mleng.measure.matmul.run import (
    SEEDS_FILE, MamfOptions, nvml_uuid, run_all_devices, run_mamf, seed_shapes, spec_key, theoretical_tflops,
)
from mleng.measure.matmul.search import (
    FINAL_ROUNDS, FINALIST_DISTANCE, FINALISTS, adaptive_search, coarse_candidates, exhaustive_search,
    wave_fitting_pairs,
)
from mleng.measure.matmul.shapes import (
    DTYPES, FP8_DTYPES, SearchResult, SearchSpace, Shape, ShapeResult, canonical_dtype, parse_dims, parse_grid,
    parse_range, product_shapes, rate,
)

__all__ = [
    "DTYPES", "FINAL_ROUNDS", "FINALISTS", "FINALIST_DISTANCE", "FP8_DTYPES", "SEEDS_FILE", "MamfOptions",
    "MatmulBench", "SearchResult", "SearchSpace", "Shape", "ShapeResult", "adaptive_search", "canonical_dtype",
    "check_dtype_supported", "check_fits", "coarse_candidates", "cpu_has_native", "device_name",
    "exhaustive_search", "free_memory_bytes", "nvml_uuid", "parse_dims", "parse_grid", "parse_range",
    "product_shapes", "rate", "resolve_device", "run_all_devices", "run_mamf", "seed_shapes", "spec_key",
    "theoretical_tflops", "wave_fitting_pairs",
]
