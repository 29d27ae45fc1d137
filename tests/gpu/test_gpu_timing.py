"""measure/timing on CUDA: per-iteration device events, the L2 flush sized from the device, synchronize."""

import time

import pytest

pytestmark = pytest.mark.gpu


def _matmul(torch, device, n=4096):
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    return lambda: torch.mm(a, b, out=c), 2 * n ** 3


def test_event_timing_agrees_with_the_host_clock_and_fills_every_stat(torch_cuda, device, spec):
    from mleng.measure.timing import time_fn

    torch = torch_cuda
    fn, flops = _matmul(torch, device, 8192)
    calls = []
    stats = time_fn(fn, device=device, warmup=3, iters=20, setup=lambda: calls.append(1))
    assert stats.iters == 20 and len(stats.samples_s) == 20 and len(calls) == 23  # setup before every call
    assert all(s > 0 for s in stats.samples_s)
    assert stats.min_s <= stats.p10_s <= stats.median_s <= stats.p90_s <= stats.max_s
    assert stats.min_s <= stats.mean_s <= stats.max_s and stats.iqr_s >= 0

    # The same kernel timed by the host around 20 back-to-back calls, synchronized both ends.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    host_per_call = (time.perf_counter() - t0) / 20
    assert 0.6 * host_per_call < stats.median_s < 1.4 * host_per_call, (stats.median_s, host_per_call)

    tflops = flops / stats.median_s / 1e12
    peak = (spec.tflops or {}).get("bf16") if spec else None
    assert tflops > 1.0
    if peak:
        assert tflops < peak, f"{tflops:.1f} TFLOPS is above the datasheet's dense bf16 {peak}"


def test_events_time_the_kernel_not_the_cache_flush_between_calls(torch_cuda, device):
    """The flush (a write of twice the L2) runs between the events; a tiny kernel's time must not include it."""
    from mleng.measure import timing
    from mleng.measure.timing import time_fn

    torch = torch_cuda
    x = torch.randn(1024, device=device)
    flushed = time_fn(lambda: x.add_(1.0), device=device, warmup=3, iters=30, flush_l2=True)
    plain = time_fn(lambda: x.add_(1.0), device=device, warmup=3, iters=30, flush_l2=False)
    flush = time_fn(lambda: None, device=device, warmup=3, iters=30, flush_l2=True)
    buffer = time_fn(lambda: timing.flush_buffer(device).fill_(1), device=device, warmup=3, iters=30, flush_l2=False)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    # Compared with the flush itself (a write of 2 x L2), not with a fixed time: the add's time with a
    # flush between calls must stay far below the flush's own, which the events must not include.
    assert flushed.median_s < 0.5 * buffer.median_s + plain.median_s, (
        f"tiny kernel timed at {flushed.median_s * 1e6:.1f} us with a {2 * l2 >> 20} MiB flush that takes "
        f"{buffer.median_s * 1e6:.1f} us")
    assert flush.median_s < 0.5 * buffer.median_s


def test_flush_buffer_is_twice_the_devices_l2(torch_cuda, device):
    from mleng.measure import timing

    props = torch_cuda.cuda.get_device_properties(device)
    assert timing.cache_bytes(device) == props.L2_cache_size > 2**20
    buffer = timing.flush_buffer(device)
    assert buffer.device.type == "cuda" and buffer.numel() == max(2 * props.L2_cache_size, 8 * 2**20)
    assert timing.flush_buffer("cuda:0") is buffer  # one per device, reused


def test_sync_waits_for_queued_work(torch_cuda, device):
    from mleng.measure.timing import sync

    torch = torch_cuda
    torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning at GPU clocks, queued asynchronously
    assert not torch.cuda.current_stream().query()
    sync(device)
    assert torch.cuda.current_stream().query()
