"""MAMF: the search engine (adaptive and exhaustive) over an abstract measure(shape, iters, phase)."""

from __future__ import annotations

import heapq
import math
import time
from typing import Iterable, Sequence

from mleng.measure.matmul.shapes import (
    Measure,
    OnResult,
    SearchResult,
    SearchSpace,
    Shape,
    ShapeResult,
)

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
            if any(_finalist_neighbours(result.shape, other.shape) for other in chosen + list(self.finals.values())):
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
            if any(_within_distance(result.shape, c, steps[0]) for c in chosen):
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
                         for shape in _compass_moves(center_shape, step, space)
                         if search.time_left() >= search.finals_reserve_s()]
            best_neighbor = max(neighbors, key=lambda r: r.tflops_median, default=None)
            if best_neighbor is not None and best_neighbor.tflops_median > center.tflops_median:
                push(best_neighbor, step_index)
            elif step_index + 1 < len(steps):
                push(center, step_index + 1)
        # All centers converged: refine more only while there are coarse shapes close to the best.
        if add_centers(REFINE_CENTERS, EXTRA_CENTER_WITHIN) == 0:
            return "converged"


def _finalist_neighbours(a: Shape, b: Shape) -> bool:
    return all(abs(x - y) < min(FINALIST_DISTANCE, max(x, y) // 4)
               for x, y in ((a.m, b.m), (a.n, b.n), (a.k, b.k)))


def _within_distance(a: Shape, b: Shape, distance: int) -> bool:
    return abs(a.m - b.m) <= distance and abs(a.n - b.n) <= distance and abs(a.k - b.k) <= distance


def _compass_moves(shape: Shape, step: int, space: SearchSpace) -> list[Shape]:
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


