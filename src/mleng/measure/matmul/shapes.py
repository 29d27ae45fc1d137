"""MAMF: shapes, dtypes, search results and the command-line shape parsers."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

from mleng.measure.dtypes import canonical
from mleng.errors import UsageError
from mleng.measure.timing import TimingStats

DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e4m3fnuz")
# dtype -> key of mleng.specs Accelerator.tflops (dense rates).
SPEC_KEYS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32",
             "float8_e4m3fn": "fp8", "float8_e4m3fnuz": "fp8"}
FP8_DTYPES = ("float8_e4m3fn", "float8_e4m3fnuz")

# CPUs without native bf16/fp16 emulate them very slowly; larger shapes are refused.
CPU_LOW_PRECISION_MAX_DIM = 512


def rate(tflops: float) -> float:
    """A rate rounded for the record: two decimals, or four significant digits for a CPU's small ones."""
    return round(tflops, 2) if abs(tflops) >= 10 else float(f"{tflops:.4g}")


def canonical_dtype(name: str) -> str:
    return canonical(name, DTYPES)


@dataclasses.dataclass(frozen=True, order=True)
class Shape:
    """A matmul C[m, n] = A[m, k] @ B[k, n]."""

    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def __str__(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


@dataclasses.dataclass
class ShapeResult:
    shape: Shape
    stats: TimingStats
    phase: str
    wall_s: float = 0.0

    @property
    def tflops_median(self) -> float:
        return self.shape.flops / self.stats.median_s / 1e12

    @property
    def tflops_mean(self) -> float:
        return self.shape.flops / self.stats.mean_s / 1e12

    @property
    def tflops_max(self) -> float:
        return self.shape.flops / self.stats.min_s / 1e12

    def row(self, dtype: str) -> dict[str, Any]:
        return {
            "m": self.shape.m, "n": self.shape.n, "k": self.shape.k, "dtype": dtype,
            "tflops_median": rate(self.tflops_median), "tflops_mean": rate(self.tflops_mean),
            "tflops_max": rate(self.tflops_max), "time_us_median": round(self.stats.median_s * 1e6, 2),
            "time_us_p10": round(self.stats.p10_s * 1e6, 2), "time_us_p90": round(self.stats.p90_s * 1e6, 2),
            "iters": self.stats.iters, "phase": self.phase,
        }


@dataclasses.dataclass
class SearchResult:
    results: list[ShapeResult]
    best: ShapeResult | None
    stop_reason: str
    interrupted: bool = False
    burst: ShapeResult | None = None

    @property
    def shapes_tried(self) -> int:
        return len({r.shape for r in self.results})

    def phase_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.results:
            counts[r.phase] = counts.get(r.phase, 0) + 1
        return counts


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """The box the adaptive search stays in; every dimension a multiple of `granule`."""

    lo: int = 1024
    hi: int = 16384
    granule: int = 64

    def __post_init__(self) -> None:
        if self.granule < 1 or self.lo < self.granule or self.hi < self.lo:
            raise UsageError(f"bad search space: dimensions {self.lo}..{self.hi} in steps of {self.granule}")

    def snap(self, value: int) -> int:
        value = int(round(value / self.granule)) * self.granule
        return min(max(value, self.lo), self.hi)

    def contains(self, shape: Shape) -> bool:
        return all(self.lo <= d <= self.hi and d % self.granule == 0 for d in (shape.m, shape.n, shape.k))

    @property
    def max_shape(self) -> Shape:
        return Shape(self.hi, self.hi, self.hi)


# measure(shape, iters, phase): phase is "seed", "coarse", "refine", "grid", "probe", "final" or "burst";
# the real measurement warms up or idles by phase (see FINAL_WARMUP_S).
Measure = Callable[[Shape, int, str], TimingStats]
OnResult = Callable[[ShapeResult, "ShapeResult | None"], None]


# ---------------------------------------------------------------- shapes from the command line

def parse_range(text: str) -> list[int]:
    """'START:STOP:STEP' (STOP included) or a single integer -> the list of values."""
    parts = text.strip().split(":")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        raise UsageError(f"bad range {text!r}: expected START:STOP:STEP with integers, e.g. 1024:16384:1024") from None
    if len(numbers) == 1:
        numbers = [numbers[0], numbers[0], 1]
    if len(numbers) != 3:
        raise UsageError(f"bad range {text!r}: expected START:STOP:STEP, e.g. 1024:16384:1024")
    start, stop, step = numbers
    if step <= 0:
        raise UsageError(f"bad range {text!r}: STEP must be positive")
    if start <= 0:
        raise UsageError(f"bad range {text!r}: matrix dimensions must be positive (START is {start})")
    if stop < start:
        raise UsageError(f"bad range {text!r}: STOP ({stop}) is below START ({start})")
    return list(range(start, stop + 1, step))


def parse_grid(tokens: Sequence[str]) -> tuple[list[int], list[int], list[int]]:
    """--grid forms: 'A:B:C' (all three dims), 'M N K' ranges as three 'A:B:C', or nine integers
    'M_START M_STOP M_STEP N_START N_STOP N_STEP K_START K_STOP K_STEP', or three integers
    'START STOP STEP' for all three dims."""
    tokens = [t for token in tokens for t in token.replace(",", " ").split()]
    if len(tokens) == 1:
        values = parse_range(tokens[0])
        return values, list(values), list(values)
    if len(tokens) == 3 and all(":" in t for t in tokens):
        return parse_range(tokens[0]), parse_range(tokens[1]), parse_range(tokens[2])
    if len(tokens) == 3:
        values = parse_range(":".join(tokens))
        return values, list(values), list(values)
    if len(tokens) == 9:
        return (parse_range(":".join(tokens[0:3])), parse_range(":".join(tokens[3:6])),
                parse_range(":".join(tokens[6:9])))
    raise UsageError(
        f"bad --grid {' '.join(tokens)!r}",
        hint="give START:STOP:STEP for all three dims, three such ranges (M N K), "
             "or nine integers M_START M_STOP M_STEP N_START N_STOP N_STEP K_START K_STOP K_STEP",
    )


def parse_dims(values: Iterable[str | int], name: str) -> list[int]:
    """An explicit list of one dimension's values ('4096', '4096,8192', or ranges)."""
    out: list[int] = []
    for value in values:
        for token in str(value).replace(",", " ").split():
            if ":" in token:
                out.extend(parse_range(token))
                continue
            try:
                number = int(token)
            except ValueError:
                raise UsageError(f"bad --{name} value {token!r}: expected a positive integer") from None
            if number <= 0:
                raise UsageError(f"bad --{name} value {number}: matrix dimensions must be positive")
            out.append(number)
    return out


def product_shapes(m_values: Sequence[int], n_values: Sequence[int], k_values: Sequence[int]) -> list[Shape]:
    return [Shape(m, n, k) for m in m_values for n in n_values for k in k_values]


