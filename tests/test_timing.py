"""The timing core: statistics, cache sizing, and real timing of real work on the CPU."""

import time

import pytest

from mleng.measure import timing
from mleng.measure.timing import TimingStats, quantile, time_fn


def test_statistics_of_known_samples():
    stats = TimingStats.from_samples([5.0, 1.0, 4.0, 2.0, 3.0])
    assert stats.median_s == 3.0
    assert stats.mean_s == 3.0
    assert (stats.min_s, stats.max_s) == (1.0, 5.0)
    assert stats.p10_s == pytest.approx(1.4)
    assert stats.p90_s == pytest.approx(4.6)
    assert stats.iqr_s == pytest.approx(2.0)
    assert stats.iters == 5
    assert stats.samples_s == (5.0, 1.0, 4.0, 2.0, 3.0)  # order of measurement kept


def test_quantile_matches_linear_interpolation():
    ordered = [10.0, 20.0, 30.0, 40.0]
    assert quantile(ordered, 0.0) == 10.0
    assert quantile(ordered, 1.0) == 40.0
    assert quantile(ordered, 0.5) == 25.0
    assert quantile([7.0], 0.9) == 7.0
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_merged_and_to_dict():
    merged = TimingStats.from_samples([1.0, 2.0]).merged(TimingStats.from_samples([3.0]))
    assert merged.iters == 3 and merged.median_s == 2.0
    as_dict = merged.to_dict()
    assert "samples_s" not in as_dict and as_dict["iters"] == 3
    assert merged.to_dict(with_samples=True)["samples_s"] == [1.0, 2.0, 3.0]


def test_time_fn_times_real_cpu_work_and_calls_setup_each_iteration():
    torch = pytest.importorskip("torch")
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    setups = []
    stats = time_fn(lambda: a @ b, device="cpu", warmup=2, iters=7, setup=lambda: setups.append(1))
    assert stats.iters == 7
    assert len(setups) == 2 + 7  # warm-up calls are prepared the same way
    assert 0 < stats.min_s <= stats.median_s <= stats.max_s < 1.0


def test_time_fn_excludes_setup_and_flush_from_the_timed_region():
    def slow_setup():
        time.sleep(0.02)

    stats = time_fn(lambda: None, device="cpu", warmup=0, iters=3, setup=slow_setup)
    assert stats.max_s < 0.01


def test_time_fn_sees_a_known_duration():
    stats = time_fn(lambda: time.sleep(0.01), device="cpu", warmup=1, iters=5, flush_l2=False)
    assert 0.009 < stats.median_s < 0.05


def test_cache_size_and_flush_buffer_from_the_machine():
    pytest.importorskip("torch")
    size = timing.cache_bytes("cpu")
    assert size >= 1 << 20
    buffer = timing.flush_buffer("cpu")
    assert buffer.numel() >= 2 * size
    assert timing.flush_buffer("cpu") is buffer  # one per device


def test_iters_must_be_positive():
    with pytest.raises(ValueError):
        time_fn(lambda: None, device="cpu", iters=0)


def test_process_elapsed_counts_from_process_start():
    elapsed = timing.process_elapsed_s()
    assert 0 <= elapsed < 3600
