"""The MAMF search engine against a synthetic rate surface, and the shape parsers."""

import math
import time

import pytest

from mleng.errors import UsageError
from mleng.measure.matmul import (
    FINAL_ROUNDS, FINALISTS, SEEDS_FILE, SearchSpace, Shape, adaptive_search, coarse_candidates, exhaustive_search,
    parse_dims, parse_grid, parse_range, product_shapes, seed_shapes, wave_fitting_pairs,
)
from mleng.measure.timing import TimingStats

# A hill in log space whose top is on no lattice point of the coarse sweep, next to a lower decoy
# hill where the large square shapes are, the way big shapes look good on real GPUs.
PEAK = Shape(2304, 1792, 13120)
PEAK_TFLOPS = 800.0
DECOY = Shape(8192, 8192, 4096)
DECOY_TFLOPS = 780.0


def synthetic_tflops(shape: Shape) -> float:
    def hill(center: Shape, height: float, width_mn: float, width_k: float) -> float:
        distance = ((math.log(shape.m / center.m) ** 2 + math.log(shape.n / center.n) ** 2) / width_mn
                    + math.log(shape.k / center.k) ** 2 / width_k)
        return height * math.exp(-distance)

    return max(hill(PEAK, PEAK_TFLOPS, 0.08, 0.3), hill(DECOY, DECOY_TFLOPS, 0.05, 0.1), 50.0)


class SyntheticTimer:
    """measure(shape, iters): per-iteration times around the surface's time, jittered symmetrically
    so the median is exact; counts calls."""

    def __init__(self, seconds_per_call: float = 0.0, interrupt_after: int | None = None, clock=None):
        self.calls = 0
        self.shapes: list[Shape] = []
        self.seconds_per_call = seconds_per_call
        self.interrupt_after = interrupt_after
        self.clock = clock

    def __call__(self, shape: Shape, iters: int, phase: str) -> TimingStats:
        if self.interrupt_after is not None and self.calls >= self.interrupt_after:
            raise KeyboardInterrupt
        self.calls += 1
        self.shapes.append(shape)
        if self.clock is not None:
            self.clock.now += self.seconds_per_call
        elif self.seconds_per_call:
            time.sleep(self.seconds_per_call)
        t = shape.flops / (synthetic_tflops(shape) * 1e12)
        jitter = [0.0] + [j * 0.002 * sign for j in range(1, iters // 2 + 1) for sign in (1, -1)]
        return TimingStats.from_samples([t * (1 + e) for e in jitter[:iters]])


def test_adaptive_search_finds_the_known_peak_off_the_grid():
    timer = SyntheticTimer()
    result = adaptive_search(timer, SearchSpace(1024, 16384, 64), deadline=time.monotonic() + 60, sm_count=132)
    assert result.stop_reason == "converged"
    assert result.best.shape == PEAK
    assert result.best.phase == "final"
    assert result.best.tflops_median == pytest.approx(PEAK_TFLOPS, rel=3e-3)
    # A fraction of the 1024-step grid's 4096 shapes, let alone the 64-step lattice the peak is on.
    assert result.shapes_tried < 2000
    counts = result.phase_counts()
    assert counts["coarse"] > 0 and counts["refine"] > 0 and 0 < counts["final"] <= FINALISTS * FINAL_ROUNDS
    assert counts["burst"] == counts["final"]
    assert result.burst.shape == PEAK


def test_the_1024_step_grid_misses_what_the_adaptive_search_finds():
    grid = product_shapes(*parse_grid(["1024:16384:1024"]))
    exhaustive = exhaustive_search(SyntheticTimer(), grid, deadline=time.monotonic() + 60)
    assert exhaustive.stop_reason == "all shapes measured"
    assert exhaustive.shapes_tried == 4096
    assert exhaustive.best.tflops_median < 0.99 * PEAK_TFLOPS


def test_search_stops_at_the_time_budget_and_keeps_the_best_so_far():
    timer = SyntheticTimer(seconds_per_call=0.002)
    started = time.monotonic()
    result = adaptive_search(timer, SearchSpace(1024, 16384, 64), deadline=started + 0.5, sm_count=132)
    elapsed = time.monotonic() - started
    assert result.stop_reason == "time budget"
    assert elapsed < 1.5
    assert result.best is not None
    assert result.best.tflops_median == max(r.tflops_median for r in result.results if r.phase == "final")


class FakeClock:
    """The search's clock for a budget counted in timer calls, not in how fast this machine runs Python."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_a_short_budget_with_the_peak_as_seed_reaches_it_where_the_unseeded_search_does_not(monkeypatch):
    import mleng.measure.matmul.search as search_module

    space = SearchSpace(1024, 16384, 64)
    results = []
    for seeds in ((), [Shape(8192, 1024, 2048), PEAK]):
        clock = FakeClock()
        monkeypatch.setattr(search_module, "time", clock)
        results.append(adaptive_search(SyntheticTimer(seconds_per_call=0.002, clock=clock), space,
                                       deadline=clock.now + 0.3, sm_count=132, seeds=seeds))
    unseeded, seeded = results
    assert unseeded.stop_reason == seeded.stop_reason == "time budget"
    assert unseeded.best.tflops_median < 0.97 * PEAK_TFLOPS
    assert seeded.best.shape == PEAK and seeded.best.phase == "final"
    assert [r.phase for r in seeded.results[:2]] == ["seed", "seed"]


def test_seeds_outside_the_space_are_not_measured():
    timer = SyntheticTimer()
    result = adaptive_search(timer, SearchSpace(1024, 4096, 64), deadline=time.monotonic() + 5,
                             seeds=[Shape(8192, 1024, 2048), Shape(1000, 1024, 1024)])
    assert all(r.phase != "seed" for r in result.results)


def test_seed_shapes_come_from_stored_runs_of_the_same_model_and_dtype_then_the_data_file(tmp_path):
    from mleng.results.record import Measurement
    from mleng.results.store import Store

    def run(name: str, dtype: str, best: str, burst: str, status: str = "complete") -> Measurement:
        m = Measurement.start("mamf", {"dtype": dtype}, machine={})
        m.summary = {"device_name": name, "dtype": dtype, "best_shape": best, "burst": {"best_shape": burst}}
        m.finish(status)
        return m

    store_path = tmp_path / "results.sqlite"
    with Store(store_path) as store:
        store.save(run("NVIDIA H200", "bfloat16", "4096x2048x15360", "5632x1536x16000"))
        store.save(run("NVIDIA H100 80GB HBM3", "bfloat16", "2048x2048x2048", "2048x2048x2048"))
        store.save(run("NVIDIA H200", "float16", "3072x3072x3072", "3072x3072x3072"))
        store.save(run("NVIDIA H200", "bfloat16", "1024x1024x1024", "1024x1024x1024", status="interrupted"))
    data = tmp_path / "seeds.toml"
    data.write_text('[[seed]]\ndevice_name = "NVIDIA H200"\ndtype = "bfloat16"\n'
                    'shapes = ["5632x1536x13056", "4096x2048x15360", "bad", "99999x1x1"]\n')
    seeds, info = seed_shapes("NVIDIA H200", "bfloat16", SearchSpace(1024, 16384, 64), store_path, data)
    assert [str(s) for s in seeds] == ["4096x2048x15360", "5632x1536x16000", "5632x1536x13056"]
    assert (info["store"], info["data"]) == (2, 1)
    none, info = seed_shapes("NVIDIA H200", "bfloat16", SearchSpace(1024, 16384, 64), tmp_path / "absent.sqlite",
                             tmp_path / "absent.toml")
    assert none == [] and "data_unread" in info


def test_the_shipped_seed_list_parses_and_names_its_sources():
    seeds, info = seed_shapes("NVIDIA H200", "bfloat16", SearchSpace(1024, 16384, 64), "/nonexistent/store.sqlite")
    assert info["data"] >= 4 and "data_unread" not in info
    assert "python bench/mamf_seeds.py" in open(SEEDS_FILE).read()


def test_ctrl_c_inside_a_measurement_keeps_what_was_measured():
    timer = SyntheticTimer(interrupt_after=50)
    result = adaptive_search(timer, SearchSpace(1024, 16384, 64), deadline=time.monotonic() + 60)
    assert result.interrupted and result.stop_reason == "interrupted"
    assert len(result.results) == 50
    assert result.best.tflops_median == max(r.tflops_median for r in result.results)


def test_exhaustive_search_of_few_shapes_measures_each_in_full():
    shapes = product_shapes([1024, 2048], [2048], [4096, 8192])
    result = exhaustive_search(SyntheticTimer(), shapes, deadline=time.monotonic() + 60, iters=30)
    finals = [r for r in result.results if r.phase == "final"]
    assert sorted(r.shape for r in finals) == sorted(shapes)
    assert all(r.stats.iters == 30 for r in finals)
    assert result.best.tflops_median == max(r.tflops_median for r in finals)


def test_coarse_sweep_is_cheapest_first_and_inside_the_space():
    space = SearchSpace(1024, 16384, 64)
    shapes = coarse_candidates(space, 132)
    assert all(space.contains(s) for s in shapes)
    assert [s.flops for s in shapes] == sorted(s.flops for s in shapes)
    assert Shape(16384, 16384, 16384) in shapes and Shape(1024, 1024, 1024) in shapes
    small = coarse_candidates(SearchSpace(256, 512, 64))
    assert len(small) >= 8 and all(256 <= d <= 512 for s in small for d in (s.m, s.n, s.k))


def test_wave_fitting_pairs_fill_whole_waves():
    pairs = wave_fitting_pairs(SearchSpace(1024, 16384, 64), 132)
    assert (2048, 2048) in pairs  # 16 x 8 tiles of 128x256 = 128 of 132 SMs
    for m, n in pairs:
        tiles = min(math.ceil(m / 128) * math.ceil(n / 256), math.ceil(m / 256) * math.ceil(n / 128))
        assert tiles <= 2 * 132
    assert wave_fitting_pairs(SearchSpace(), None) == []


@pytest.mark.parametrize("tokens, expected", [
    (["1024:4096:1024"], ([1024, 2048, 3072, 4096],) * 3),
    (["1024", "3072", "1024"], ([1024, 2048, 3072],) * 3),
    (["256:512:256", "1024:1024:1", "64:192:64"], ([256, 512], [1024], [64, 128, 192])),
    (["256", "512", "256", "1024", "1024", "1", "64", "192", "64"], ([256, 512], [1024], [64, 128, 192])),
])
def test_grid_forms(tokens, expected):
    assert parse_grid(tokens) == tuple(list(v) for v in expected)


def test_grid_over_1024_to_16384_has_16_values_per_dimension():
    m, n, k = parse_grid(["1024:16384:1024"])
    assert len(m) == len(n) == len(k) == 16 and m[-1] == 16384


@pytest.mark.parametrize("bad", ["0:1024:256", "-512:1024:256", "1024:512:256", "1024:2048:0", "a:b:c", "1:2"])
def test_bad_ranges_are_refused(bad):
    with pytest.raises(UsageError):
        parse_range(bad)


def test_bad_grid_token_count_is_refused():
    with pytest.raises(UsageError, match="nine integers"):
        parse_grid(["1", "2", "3", "4"])


def test_dimension_lists():
    assert parse_dims(["4096", "8192,16384"], "m") == [4096, 8192, 16384]
    assert parse_dims(["1024:2048:512"], "k") == [1024, 1536, 2048]
    for bad in (["0"], ["-4"], ["x"]):
        with pytest.raises(UsageError):
            parse_dims(bad, "n")
