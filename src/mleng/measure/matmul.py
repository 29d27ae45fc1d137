"""MAMF: the maximum achievable matmul TFLOPS of a device, found by an adaptive shape search."""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Sequence

from mleng.errors import MlengError, NotAvailableError, UsageError
from mleng.measure.timing import TimingStats, process_elapsed_s
from mleng.machine.fingerprint import collect_for_record

DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e4m3fnuz")
DTYPE_ALIASES = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
    "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8_e4m3fn": "float8_e4m3fn",
    "fp8_e4m3fnuz": "float8_e4m3fnuz",
}
# dtype -> key of mleng.specs Accelerator.tflops (dense rates).
SPEC_KEYS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32",
             "float8_e4m3fn": "fp8", "float8_e4m3fnuz": "fp8"}
FP8_DTYPES = ("float8_e4m3fn", "float8_e4m3fnuz")

# Iteration counts. Screening takes few iterations (the rate of a shape is stable to about a
# percent over five); finalists take enough to fill FINAL_TARGET_S each.
SCREEN_ITERS = 5
REFINE_ITERS = 8
FINAL_TARGET_S = 0.25
FINAL_MIN_ITERS = 20
FINAL_MAX_ITERS = 200
FINALISTS = 8
# Finalists differ by at least this (or a quarter of the dimension, if less) in some dimension,
# so that they are not one shape's neighbours.
FINALIST_DISTANCE = 512
# Rounds of finalists: another round of the next-best shapes runs while time is left and the
# previous round raised the best final median.
FINAL_ROUNDS = 3
# Finalists are measured twice. "final": after FINAL_WARMUP_S of the shape back to back, so that the
# clock has settled to what the shape sustains (the headline). "burst": after BURST_IDLE_S of idle,
# BURST_WARMUP + BURST_ITERS calls, the way a shape runs when it starts from a rested card (the
# protocol of the widely used mamf-finder script: 50 warm-up and 100 timed calls per shape, shapes
# back to back with host work between them, comes closer to this one).
FINAL_WARMUP_S = 0.3
BURST_IDLE_S = 0.5
BURST_WARMUP = 10
BURST_ITERS = 50
# Pattern-search step sizes, coarse to fine; a step below the space's granule is skipped.
REFINE_STEPS = (1024, 512, 256, 128, 64, 32, 16)
REFINE_CENTERS = 6
# Extra centers are refined only while their coarse rate is this close to the best.
EXTRA_CENTER_WITHIN = 0.03
# CPUs without native bf16/fp16 emulate them very slowly; larger shapes are refused.
CPU_LOW_PRECISION_MAX_DIM = 512


def rate(tflops: float) -> float:
    """A rate rounded for the record: two decimals, or four significant digits for a CPU's small ones."""
    return round(tflops, 2) if abs(tflops) >= 10 else float(f"{tflops:.4g}")


def canonical_dtype(name: str) -> str:
    key = name.strip().lower().replace("torch.", "")
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}", hint=f"use one of: {', '.join(DTYPES)}")
    return key


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


# ---------------------------------------------------------------- the search engine

class _Search:
    """Bookkeeping shared by the adaptive and the exhaustive search: budget, cache, best so far."""

    def __init__(self, measure: Measure, deadline: float, on_result: OnResult | None, final_fixed_s: float = 0.0,
                 bursts: bool = True):
        self.measure_fn = measure
        self.bursts_enabled = bursts
        self.deadline = deadline
        self.on_result = on_result
        self.final_fixed_s = final_fixed_s
        self.results: list[ShapeResult] = []
        self.screened: dict[Shape, ShapeResult] = {}
        self.finals: dict[Shape, ShapeResult] = {}
        self.bursts: dict[Shape, ShapeResult] = {}
        self._overheads: list[float] = []
        self._reserve: tuple[int, float] = (-1, 0.0)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def best_screened(self) -> ShapeResult | None:
        return max(self.screened.values(), key=lambda r: r.tflops_median, default=None)

    def headline(self) -> ShapeResult | None:
        """The best finalist when there are finalists: their medians rest on many iterations."""
        pool = self.finals or self.screened
        return max(pool.values(), key=lambda r: r.tflops_median, default=None)

    def best_burst(self) -> ShapeResult | None:
        return max(self.bursts.values(), key=lambda r: r.tflops_median, default=None)

    def measure(self, shape: Shape, iters: int, phase: str) -> ShapeResult:
        t0 = time.monotonic()
        stats = self.measure_fn(shape, iters, phase)
        result = ShapeResult(shape, stats, phase, wall_s=time.monotonic() - t0)
        self.results.append(result)
        if phase == "final":
            self.finals[shape] = result
        elif phase == "burst":
            self.bursts[shape] = result
        else:
            self.screened.setdefault(shape, result)
        if self.on_result is not None:
            self.on_result(result, self.headline())
        return result

    def screen(self, shape: Shape, iters: int, phase: str) -> ShapeResult:
        return self.screened.get(shape) or self.measure(shape, iters, phase)

    def wall_per_call_s(self, result: ShapeResult) -> float:
        """A call's time plus the typical overhead per call (setup, flush, host) seen so far.

        The overhead is the median over all screened shapes, so that one slow first call (thread
        pools, allocations) does not make every estimate too large.
        """
        if len(self._overheads) != len(self.screened):
            self._overheads = sorted(max(r.wall_s / (r.stats.iters + 2) - r.stats.median_s, 0.0)
                                     for r in self.screened.values())
        overhead = self._overheads[len(self._overheads) // 2] if self._overheads else 0.0
        return result.stats.median_s + overhead

    def final_iters(self, result: ShapeResult) -> int:
        wanted = math.ceil(FINAL_TARGET_S / self.wall_per_call_s(result))
        return int(min(max(wanted, FINAL_MIN_ITERS), FINAL_MAX_ITERS))

    def final_cost_s(self, result: ShapeResult) -> float:
        calls = self.final_iters(result) + 2 + (BURST_WARMUP + BURST_ITERS if self.bursts_enabled else 0)
        return self.final_fixed_s + self.wall_per_call_s(result) * calls + 0.02

    def top(self, count: int, pool: Iterable[ShapeResult] | None = None) -> list[ShapeResult]:
        ranked = sorted(pool if pool is not None else self.screened.values(),
                        key=lambda r: r.tflops_median, reverse=True)
        return ranked[:count]

    def finalists(self, count: int) -> list[ShapeResult]:
        """The best screened shapes not yet measured as finalists, no two of them neighbours."""
        chosen: list[ShapeResult] = []
        for result in self.top(len(self.screened)):
            if len(chosen) >= count:
                break
            if result.shape in self.finals:
                continue
            if any(_neighbours(result.shape, other.shape) for other in chosen + list(self.finals.values())):
                continue
            chosen.append(result)
        return chosen

    def finals_reserve_s(self) -> float:
        """Time kept for the finalists; recomputed as the screened set grows by a few percent,
        since ranking thousands of shapes before every measurement would cost seconds."""
        count = len(self.screened)
        cached_count, cached_value = self._reserve
        if cached_count < 0 or count - cached_count >= max(10, cached_count // 20):
            self._reserve = (count, sum(self.final_cost_s(r) for r in self.top(FINALISTS)) * 1.2)
        return self._reserve[1]

    def run_finals(self, count: int = FINALISTS, iters: int | None = None, rounds: int = FINAL_ROUNDS) -> None:
        for round_index in range(rounds):
            best_before = self.headline().tflops_median if self.finals else 0.0
            candidates = self.finalists(count)
            if not candidates:
                return
            if round_index > 0 and self.time_left() < sum(self.final_cost_s(r) for r in candidates):
                return
            for result in candidates:
                if self.time_left() < self.final_cost_s(result) and self.finals:
                    return
                self.measure(result.shape, iters or self.final_iters(result), "final")
                if self.bursts_enabled:
                    self.measure(result.shape, BURST_ITERS, "burst")
            if self.headline().tflops_median <= best_before:
                return

    def result(self, stop_reason: str, interrupted: bool = False) -> SearchResult:
        return SearchResult(self.results, self.headline(), stop_reason, interrupted=interrupted,
                            burst=self.best_burst())


def adaptive_search(measure: Measure, space: SearchSpace, *, deadline: float,
                    on_result: OnResult | None = None, sm_count: int | None = None,
                    final_fixed_s: float = 0.0, bursts: bool = True,
                    seeds: Sequence[Shape] = ()) -> SearchResult:
    """Seeds, coarse sweep, pattern-search refinement around the best shapes, then finalists re-measured.

    `measure(shape, iters, phase)` times one shape; `deadline` is a time.monotonic() value. The search
    stops at the deadline (keeping time for the finalists) or when refinement no longer finds
    a better shape. Ctrl-C stops it and keeps what was measured. `final_fixed_s` is the time each
    finalist's protocol adds beyond its calls (warm-up seconds, idle gap), for the time reserved;
    `bursts` adds each finalist's measurement from a rested card (phase "burst"). `seeds` (shapes
    that were fastest on this kind of device before, phase "seed") are screened first, so that a
    short budget spends its finalists on shapes known to be good rather than on the smallest ones
    of the sweep.
    """
    search = _Search(measure, deadline, on_result, final_fixed_s, bursts)
    stop_reason = "converged"
    try:
        for shape in seeds:
            # Seeds are few and likely finalists: screen them while the finalists still fit.
            if search.screened and search.time_left() < search.finals_reserve_s():
                break
            if space.contains(shape):
                search.screen(shape, SCREEN_ITERS, "seed")
        for shape in coarse_candidates(space, sm_count):
            if search.screened and search.time_left() < 2 * search.finals_reserve_s():
                stop_reason = "time budget"
                break
            search.screen(shape, SCREEN_ITERS, "coarse")
        if stop_reason == "converged":
            stop_reason = _refine(search, space)
        search.run_finals()
        if search.time_left() <= 0:
            stop_reason = "time budget"
    except KeyboardInterrupt:
        return search.result("interrupted", interrupted=True)
    return search.result(stop_reason)


def _refine(search: _Search, space: SearchSpace) -> str:
    """Compass search from several centers at once, always expanding the fastest open center."""
    steps = [s for s in REFINE_STEPS if s >= space.granule and s % space.granule == 0]
    if not steps:
        return "converged"
    heap: list[tuple[float, Shape, int]] = []
    seen: set[tuple[Shape, int]] = set()
    chosen: list[Shape] = []

    def push(result: ShapeResult, step_index: int) -> None:
        key = (result.shape, step_index)
        if key not in seen:
            seen.add(key)
            heapq.heappush(heap, (-result.tflops_median, result.shape, step_index))

    def add_centers(count: int, within: float | None) -> int:
        best = search.best_screened()
        added = 0
        for result in search.top(len(search.screened)):
            if added >= count:
                break
            if within is not None and best and result.tflops_median < (1 - within) * best.tflops_median:
                break
            if any(_near(result.shape, c, steps[0]) for c in chosen):
                continue
            chosen.append(result.shape)
            push(result, 0)
            added += 1
        return added

    add_centers(REFINE_CENTERS, None)
    while True:
        while heap:
            if search.time_left() < search.finals_reserve_s():
                return "time budget"
            _, center_shape, step_index = heapq.heappop(heap)
            center = search.screened[center_shape]
            step = steps[step_index]
            neighbors = [search.screen(shape, REFINE_ITERS, "refine")
                         for shape in _neighbors(center_shape, step, space)
                         if search.time_left() >= search.finals_reserve_s()]
            best_neighbor = max(neighbors, key=lambda r: r.tflops_median, default=None)
            if best_neighbor is not None and best_neighbor.tflops_median > center.tflops_median:
                push(best_neighbor, step_index)
            elif step_index + 1 < len(steps):
                push(center, step_index + 1)
        # All centers converged: refine more only while there are coarse shapes close to the best.
        if add_centers(REFINE_CENTERS, EXTRA_CENTER_WITHIN) == 0:
            return "converged"


def _neighbours(a: Shape, b: Shape) -> bool:
    return all(abs(x - y) < min(FINALIST_DISTANCE, max(x, y) // 4)
               for x, y in ((a.m, b.m), (a.n, b.n), (a.k, b.k)))


def _near(a: Shape, b: Shape, distance: int) -> bool:
    return abs(a.m - b.m) <= distance and abs(a.n - b.n) <= distance and abs(a.k - b.k) <= distance


def _neighbors(shape: Shape, step: int, space: SearchSpace) -> list[Shape]:
    """One step along each axis, and the four diagonal moves in (m, n), where the output tiles live."""
    moves = [(step, 0, 0), (-step, 0, 0), (0, step, 0), (0, -step, 0), (0, 0, step), (0, 0, -step),
             (step, step, 0), (step, -step, 0), (-step, step, 0), (-step, -step, 0)]
    out = []
    for dm, dn, dk in moves:
        candidate = Shape(shape.m + dm, shape.n + dn, shape.k + dk)
        if candidate != shape and space.contains(candidate):
            out.append(candidate)
    return out


def coarse_candidates(space: SearchSpace, sm_count: int | None = None) -> list[Shape]:
    """The first sweep: a geometric lattice over the space, plus shapes whose output tiles fill whole waves.

    Ordered cheapest first, so that a best-so-far exists within the first second.
    """
    mn_values = _lattice(space, (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0))
    k_values = _lattice(space, (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0))
    shapes = {Shape(m, n, k) for m in mn_values for n in mn_values for k in k_values}
    for m, n in wave_fitting_pairs(space, sm_count):
        for k in k_values:
            shapes.add(Shape(m, n, k))
    return sorted(shapes, key=lambda s: (s.flops, s))


def _lattice(space: SearchSpace, factors: Sequence[float]) -> list[int]:
    """Values 1024 * factor inside the space, snapped to the granule, plus both ends of the space."""
    base = 1024
    values = {space.snap(base * f) for f in factors if space.lo <= base * f <= space.hi}
    values.update({space.lo, space.hi})
    # Spaces smaller than the 1024-based lattice (a CPU's) get a geometric ladder of their own.
    if len(values) < 4:
        value = space.lo
        while value < space.hi:
            values.add(space.snap(value))
            value *= 1.5
    return sorted(values)


def wave_fitting_pairs(space: SearchSpace, sm_count: int | None, waves: Sequence[int] = (1, 2)) -> list[tuple[int, int]]:
    """(m, n) pairs whose 128x256 or 256x128 output tiles fill nearly whole waves of `sm_count` SMs.

    A GEMM kernel runs one output tile per SM at a time; a tile count just over a multiple of the
    SM count leaves most SMs idle for the last wave, so the fastest shapes sit just under it.
    """
    if not sm_count:
        return []
    step = max(256, space.granule)
    dims = [d for d in range(step, space.hi + 1, step) if d >= space.lo]
    pairs = set()
    for tile_m, tile_n in ((128, 256), (256, 128)):
        for m in dims:
            for n in dims:
                tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n)
                for w in waves:
                    if 0.96 * w * sm_count <= tiles <= w * sm_count:
                        pairs.add((m, n))
    return sorted(pairs)


def exhaustive_search(measure: Measure, shapes: Sequence[Shape], *, deadline: float,
                      on_result: OnResult | None = None, iters: int | None = None,
                      final_fixed_s: float = 0.0, bursts: bool = True) -> SearchResult:
    """Every shape, in order: screened with few iterations, the best re-measured with many.

    When there are no more shapes than finalists, each is measured once with the full count.
    """
    search = _Search(measure, deadline, on_result, final_fixed_s, bursts)
    stop_reason = "all shapes measured"
    try:
        if len(shapes) <= FINALISTS:
            for shape in shapes:
                if search.finals and search.time_left() <= 0:
                    stop_reason = "time budget"
                    break
                probe = search.measure(shape, 3, "probe") if iters is None else None
                search.measure(shape, iters or search.final_iters(probe), "final")
                if bursts:
                    search.measure(shape, BURST_ITERS, "burst")
        else:
            for shape in shapes:
                if search.screened and search.time_left() < search.finals_reserve_s():
                    stop_reason = "time budget"
                    break
                search.screen(shape, SCREEN_ITERS, "grid")
            search.run_finals(iters=iters)
    except KeyboardInterrupt:
        return search.result("interrupted", interrupted=True)
    return search.result(stop_reason)


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
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
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
            f"shape {largest} in {dtype} needs {_gib(need)} of memory on {device}, "
            f"but only {_gib(free)} is free",
            hint="use smaller dimensions",
        )
    if dtype in FP8_DTYPES:
        bad = [s for s in shapes if s.m % 16 or s.n % 16 or s.k % 16]
        if bad:
            raise UsageError(f"fp8 matmul (torch._scaled_mm) needs every dimension divisible by 16; {bad[0]} is not")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


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


# ---------------------------------------------------------------- seeds: where to look first

SEEDS_FILE = os.path.join(os.path.dirname(__file__), "data", "mamf_seeds.toml")
# Stored runs consulted for seeds: the newest few of the same device model and dtype.
STORE_SEED_RUNS = 5


def _shape_from_text(text: Any) -> Shape | None:
    try:
        m, n, k = (int(v) for v in str(text).lower().split("x"))
    except (TypeError, ValueError):
        return None
    return Shape(m, n, k) if min(m, n, k) > 0 else None


def seed_shapes(name: str, dtype: str, space: SearchSpace, store_path: str | os.PathLike | None = None,
                seeds_file: str | os.PathLike = SEEDS_FILE) -> tuple[list[Shape], dict[str, Any]]:
    """Shapes that were fastest on this device model before: from stored runs, then the data file.

    Seeds only decide where the search looks first; every seed is measured like any other shape, so
    a wrong or stale seed costs a few milliseconds and cannot raise the result. An unreadable store
    or data file gives no seeds (and says why in the returned provenance), never an error.
    """
    import tomllib

    seeds: list[Shape] = []
    provenance: dict[str, Any] = {"store": 0, "data": 0}

    def add(shape: Shape | None, source: str) -> None:
        if shape is not None and space.contains(shape) and shape not in seeds:
            seeds.append(shape)
            provenance[source] += 1

    try:
        from mleng.results.store import Store

        with Store(store_path, create=False) as store:
            runs = [r for r in store.list(kind="mamf", limit=200)
                    if r["status"] == "complete" and r["summary"].get("device_name") == name
                    and r["summary"].get("dtype") == dtype][:STORE_SEED_RUNS]
        for run in runs:
            add(_shape_from_text(run["summary"].get("best_shape")), "store")
            add(_shape_from_text((run["summary"].get("burst") or {}).get("best_shape")), "store")
    except (MlengError, OSError, ValueError) as exc:
        provenance["store_unread"] = str(exc).splitlines()[0]
    try:
        with open(seeds_file, "rb") as f:
            data = tomllib.load(f)
        for entry in data.get("seed", []):
            if entry.get("device_name") == name and entry.get("dtype") == dtype:
                for text in entry.get("shapes", []):
                    add(_shape_from_text(text), "data")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        provenance["data_unread"] = str(exc).splitlines()[0]
    provenance["shapes"] = [str(s) for s in seeds]
    return seeds, provenance


# ---------------------------------------------------------------- one whole run

@dataclasses.dataclass
class MamfOptions:
    device: str | int | None = None
    dtype: str | None = None          # None: bfloat16 on accelerators, float32 on CPU
    tf32: bool = False
    fp8_fast_accum: bool = False
    max_seconds: float = 60.0         # wall clock from process start
    shapes: list[Shape] | None = None  # exhaustive/exact mode when given
    min_dim: int | None = None
    max_dim: int | None = None
    granule: int = 64
    iters: int | None = None          # finalist/exact iteration count; None: adaptive
    seeds: bool = True                # start from the best shapes of earlier runs on this device model
    store_path: str | None = None     # where earlier runs are read from (None: the default store)


def _signal_name() -> str:
    from mleng import signals

    return signals.describe()


def run_mamf(options: MamfOptions, on_result: OnResult | None = None,
             on_start: Callable[[dict[str, Any]], None] | None = None):
    """Resolve device and dtype, warm up, search, and return the finished Measurement.

    Ctrl-C at any point after start-up returns the record with status 'interrupted' and the best
    shape so far. Usage problems raise before anything is measured.
    """
    import torch

    from mleng.measure.gpu_monitor import GpuMonitor, compact_samples
    from mleng.results.record import Measurement

    device = resolve_device(options.device)
    dtype = canonical_dtype(options.dtype) if options.dtype else ("float32" if device.type == "cpu" else "bfloat16")
    if options.tf32 and (device.type != "cuda" or dtype != "float32"):
        raise UsageError(f"--tf32 on changes float32 matmuls on NVIDIA GPUs only; this run is {dtype} on {device}",
                         hint="drop --tf32 (or measure --dtype float32 on a CUDA GPU)")
    if options.shapes is not None:
        shapes = list(options.shapes)
        if not shapes:
            raise UsageError("no shapes to measure")
        for shape in shapes:
            if min(shape.m, shape.n, shape.k) <= 0:
                raise UsageError(f"shape {shape}: matrix dimensions must be positive")
        space = None
        max_dim = max(max(s.m, s.n, s.k) for s in shapes)
        fit_shapes = shapes
    else:
        default_hi = 16384 if device.type != "cpu" else 4096
        hi = options.max_dim or default_hi
        lo = options.min_dim or min(1024 if device.type != "cpu" else 256, hi)
        granule = options.granule if dtype not in FP8_DTYPES else max(16, options.granule)
        space = SearchSpace(lo=_round_up(lo, granule), hi=hi - hi % granule or granule, granule=granule)
        max_dim = space.hi
        fit_shapes = [space.max_shape]
    if options.max_seconds <= 0:
        raise UsageError(f"--max-seconds must be positive (got {options.max_seconds})")
    check_dtype_supported(device, dtype, max_dim)
    check_fits(device, dtype, fit_shapes)

    name = device_name(device)
    theoretical, spec_note = theoretical_tflops(device, name, dtype, options.tf32)
    params = {"device": str(device), "dtype": dtype, "tf32": options.tf32, "max_seconds": options.max_seconds,
              "search": "adaptive" if space else "exhaustive",
              "space": dataclasses.asdict(space) if space else None,
              "shapes": len(shapes) if space is None else None, "iters": options.iters,
              "seeds": options.seeds if space else None}
    if dtype in FP8_DTYPES:
        params["fp8_fast_accum"] = options.fp8_fast_accum
    measurement = Measurement.start("mamf", params, machine=collect_for_record())
    deadline = time.monotonic() + options.max_seconds - process_elapsed_s()

    monitor = None
    if device.type == "cuda" and not getattr(torch.version, "hip", None):
        monitor = GpuMonitor(uuid=_nvml_uuid(device), index=device.index)
    elif device.type == "cuda":
        monitor = GpuMonitor(index=device.index)
    if monitor is not None:
        monitor.start()
    phase_windows: dict[str, list[float]] = {}
    row_telemetry: dict[int, dict[str, Any]] = {}

    def record(result: ShapeResult, best: ShapeResult | None) -> None:
        if monitor is not None:
            now = monitor.now_s()
            window = phase_windows.setdefault(result.phase, [now - result.wall_s, now])
            window[1] = now
            if result.phase in ("final", "burst"):
                row_telemetry[id(result)] = _row_telemetry(monitor.summary(now - result.wall_s, now))
        if on_result is not None:
            on_result(result, best)

    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    warm: dict[str, Any] | None = None
    seed_info: dict[str, Any] | None = None
    search: SearchResult | None = None
    interrupted = False
    try:
        if space is not None:
            bench = MatmulBench(device, dtype, space.hi * space.hi, space.hi * space.hi, space.hi * space.hi,
                                tf32=options.tf32, fp8_fast_accum=options.fp8_fast_accum)
        else:
            bench = MatmulBench(device, dtype, max(s.m * s.k for s in shapes), max(s.n * s.k for s in shapes),
                                max(s.m * s.n for s in shapes), tf32=options.tf32,
                                fp8_fast_accum=options.fp8_fast_accum)
        bench.probe()
        if on_start is not None:
            on_start({"device": str(device), "name": name, "dtype": dtype, "params": params})
        if device.type != "cpu":
            warm_shape = Shape(8192, 8192, 8192) if space is None or space.hi >= 8192 else space.max_shape
            if space is None:
                warm_shape = max(shapes, key=lambda s: s.flops)
            # A short budget (a doctor's quick tier) must not go to warming up.
            left = max(deadline - time.monotonic(), 0.0)
            warm = bench.warm_up(warm_shape, monitor, min_s=min(1.0, 0.1 * left), max_s=min(3.0, 0.2 * left))
            if monitor is not None:
                phase_windows["warmup"] = [monitor.now_s() - warm["seconds"], monitor.now_s()]
        if space is not None:
            seeds: list[Shape] = []
            if options.seeds:
                seeds, seed_info = seed_shapes(name, dtype, space, options.store_path)
            search = adaptive_search(bench, space, deadline=deadline, on_result=record, sm_count=sm_count,
                                     final_fixed_s=bench.final_fixed_s, bursts=bench.has_boost_clock,
                                     seeds=seeds)
        else:
            search = exhaustive_search(bench, shapes, deadline=deadline, on_result=record, iters=options.iters,
                                       final_fixed_s=bench.final_fixed_s, bursts=bench.has_boost_clock)
        interrupted = search.interrupted
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if monitor is not None:
            monitor.stop()

    results = search.results if search else []
    best = search.best if search else None
    measurement.rows = [{**r.row(dtype), **row_telemetry.get(id(r), {})} for r in results]
    burst = search.burst if search else None
    summary: dict[str, Any] = {
        "value": rate(best.tflops_median) if best else None,
        "unit": "TFLOPS",
        "theoretical": theoretical,
        "ratio": round(best.tflops_median / theoretical, 4) if best and theoretical else None,
        "device": str(device),
        "device_name": name,
        "dtype": dtype,
        "spec_key": spec_key(dtype, options.tf32),
        "spec_note": spec_note,
        "best_shape": str(best.shape) if best else None,
        "m": best.shape.m if best else None, "n": best.shape.n if best else None,
        "k": best.shape.k if best else None,
        "tflops_median": rate(best.tflops_median) if best else None,
        "tflops_mean": rate(best.tflops_mean) if best else None,
        "tflops_max": rate(best.tflops_max) if best else None,
        "iters": best.stats.iters if best else None,
        "best_phase": best.phase if best else None,
        "burst": ({"best_shape": str(burst.shape), "tflops_median": rate(burst.tflops_median),
                   "tflops_mean": rate(burst.tflops_mean), "tflops_max": rate(burst.tflops_max),
                   "iters": burst.stats.iters, "idle_before_s": BURST_IDLE_S, "warmup_calls": BURST_WARMUP}
                  if burst else None),
        "final_warmup_s": FINAL_WARMUP_S if device.type != "cpu" else 0.0,
        "shapes_tried": search.shapes_tried if search else 0,
        "measurements": len(results),
        "phases": search.phase_counts() if search else {},
        "stop_reason": "interrupted" if interrupted else (search.stop_reason if search else None),
        "search": params["search"],
        "wall_s_from_process_start": round(process_elapsed_s(), 2),
        "warmup": warm,
        "seeds": seed_info,
    }
    if monitor is not None:
        overall = monitor.summary()
        overall["timeline"] = compact_samples(monitor.window())
        summary["gpu_monitor"] = overall
        summary["gpu_monitor_by_phase"] = {phase: monitor.summary(w[0], w[1]) for phase, w in phase_windows.items()}
        measuring = [w for p, w in phase_windows.items() if p != "warmup"]
        if measuring:
            summary["gpu_monitor_measuring"] = monitor.summary(min(w[0] for w in measuring),
                                                               max(w[1] for w in measuring))
    else:
        summary["gpu_monitor"] = {"available": False,
                                  "reason": "no NVML telemetry for this device type" if device.type != "cuda"
                                  else "NVML telemetry is NVIDIA-only"}
    measurement.summary = summary
    if interrupted:
        measurement.finish("interrupted", f"stopped by {_signal_name()}; the best shape so far is kept")
    else:
        measurement.finish("complete")
    return measurement


def _row_telemetry(window: dict[str, Any]) -> dict[str, Any]:
    """The SM clock and power while one finalist was measured, for its row."""
    out: dict[str, Any] = {}
    if window.get("samples"):
        out["sm_clock_mhz_mean"] = (window.get("sm_clock_mhz") or {}).get("mean")
        out["power_w_mean"] = (window.get("power_w") or {}).get("mean")
    return out


def _round_up(value: int, granule: int) -> int:
    return -(-value // granule) * granule


def spec_key(dtype: str, tf32: bool) -> str:
    return "tf32" if dtype == "float32" and tf32 else SPEC_KEYS[dtype]


def theoretical_tflops(device, name: str, dtype: str, tf32: bool) -> tuple[float | None, str | None]:
    """The datasheet dense rate for this card and dtype from mleng.specs, or None with the reason."""
    if device.type == "cpu":
        return None, "no theoretical peak is kept for CPUs"
    from mleng.specs import lookup_accelerator

    try:
        accelerator = lookup_accelerator(name)
    except MlengError as exc:
        return None, f"no spec entry for {name!r}: {exc.message}"
    value = (accelerator.tflops or {}).get(spec_key(dtype, tf32))
    if value is None:
        return None, f"spec entry {accelerator.key} has no {spec_key(dtype, tf32)} rate"
    return float(value), f"{accelerator.key} ({accelerator.name}), dense {spec_key(dtype, tf32)}"


def _nvml_uuid(device) -> str | None:
    """The GPU's UUID in NVML's spelling, so that the monitor samples the same card torch uses."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def run_all_devices(child_argv: Callable[[int], list[str]], count: int, env: dict[str, str] | None = None):
    """One `mleng mamf --device I --json --no-store` process per GPU, all at the same time.

    Returns a Measurement whose rows are every GPU's shapes (with a `device` field) and whose
    summary names each GPU's best, the slowest GPU and the spread between slowest and fastest.
    """
    import signal

    from mleng.results.record import Measurement

    processes = []
    for index in range(count):
        command = [sys.executable, "-m", "mleng", *child_argv(index)]
        processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env=env or os.environ.copy()))
    measurement = Measurement.start("mamf", {"all_devices": True, "devices": count,
                                             "child_argv": child_argv(0)}, machine=collect_for_record())
    outputs = []
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # children get Ctrl-C and stop themselves
    try:
        for index, process in enumerate(processes):
            stdout, stderr = process.communicate()
            outputs.append((index, process.returncode, stdout, stderr))
    finally:
        signal.signal(signal.SIGINT, previous)

    per_device, errors, interrupted = [], [], False
    for index, code, stdout, stderr in outputs:
        try:
            record = json.loads(stdout)
        except json.JSONDecodeError:
            message = (stderr.strip().splitlines() or [f"exit status {code}"])[-1]
            errors.append(f"GPU {index}: {message}")
            continue
        interrupted |= record.get("status") == "interrupted"
        summary = record.get("summary", {})
        for row in record.get("rows", []):
            measurement.rows.append({"device": index, **row})
        per_device.append({
            "device": index, "device_name": summary.get("device_name"), "best_shape": summary.get("best_shape"),
            "tflops_median": summary.get("tflops_median"), "tflops_mean": summary.get("tflops_mean"),
            "tflops_max": summary.get("tflops_max"), "ratio": summary.get("ratio"),
            "shapes_tried": summary.get("shapes_tried"), "status": record.get("status"),
            "sm_clock_mean_mhz": ((summary.get("gpu_monitor_measuring") or {}).get("sm_clock_mhz") or {}).get("mean"),
            "below_max_clock": (summary.get("gpu_monitor_measuring") or {}).get("below_max_clock"),
            "power_mean_w": ((summary.get("gpu_monitor_measuring") or {}).get("power_w") or {}).get("mean"),
            "record_id": record.get("id"),
        })
        measurement.summary.setdefault("theoretical", summary.get("theoretical"))
        measurement.summary.setdefault("dtype", summary.get("dtype"))
    rates = [d["tflops_median"] for d in per_device if d["tflops_median"] is not None]
    slowest = min((d for d in per_device if d["tflops_median"] is not None),
                  key=lambda d: d["tflops_median"], default=None)
    fastest = max(rates, default=None)
    theoretical = measurement.summary.get("theoretical")
    measurement.summary.update({
        "value": slowest["tflops_median"] if slowest else None,
        "unit": "TFLOPS",
        "ratio": round(slowest["tflops_median"] / theoretical, 4) if slowest and theoretical else None,
        "headline": "slowest GPU's best median",
        "per_device": per_device,
        "slowest_device": slowest["device"] if slowest else None,
        "fastest_tflops": fastest,
        "spread_pct": round((fastest - slowest["tflops_median"]) / fastest * 100, 2) if slowest and fastest else None,
        "errors": errors,
    })
    if errors:
        measurement.finish("failed", "; ".join(errors))
    elif interrupted:
        measurement.finish("interrupted", f"stopped by {_signal_name()}; each GPU's best shape so far is kept")
    else:
        measurement.finish("complete")
    return measurement
