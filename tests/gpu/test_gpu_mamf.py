"""The matmul benchmark on CUDA: bf16 torch.mm and fp8 torch._scaled_mm, in-process and through `mleng mamf`."""

import json

import pytest

pytestmark = pytest.mark.gpu

SHAPE = (4096, 4096, 4096)


def _relative_error(torch, out, ref):
    return float(torch.linalg.vector_norm(out.double() - ref.double()) / torch.linalg.vector_norm(ref.double()))


def _peak(spec, key):
    return (spec.tflops or {}).get(key) if spec else None


def _fp8_capable(torch):
    return not getattr(torch.version, "hip", None) and torch.cuda.get_device_capability(0) >= (8, 9)


def test_bf16_bench_computes_the_product_at_a_physical_rate(torch_cuda, device, spec):
    from mleng.measure.matmul import MatmulBench, Shape

    torch = torch_cuda
    shape = Shape(*SHAPE)
    bench = MatmulBench(device, "bfloat16", shape.m * shape.k, shape.n * shape.k, shape.m * shape.n)
    bench.probe()
    a, b, c = bench.operands(shape)
    bench.call(shape)()
    torch.cuda.synchronize()
    assert _relative_error(torch, c, a.float() @ b.float()) < 1e-2
    stats = bench(shape, 20, "final")
    tflops = shape.flops / stats.median_s / 1e12
    assert stats.iters == 20 and tflops > 1.0
    if _peak(spec, "bf16"):
        assert 0.05 * _peak(spec, "bf16") < tflops < _peak(spec, "bf16")


def test_fp8_scaled_mm_is_right_and_below_the_fp8_peak(torch_cuda, device, spec):
    from mleng.measure.matmul import MatmulBench, Shape, check_dtype_supported

    torch = torch_cuda
    if not _fp8_capable(torch):
        pytest.skip(f"fp8 matmul needs compute capability 8.9+; this GPU is {torch.cuda.get_device_capability(0)}")
    check_dtype_supported(device, "float8_e4m3fn", SHAPE[0])  # must not refuse
    shape = Shape(*SHAPE)
    bench = MatmulBench(device, "float8_e4m3fn", shape.m * shape.k, shape.n * shape.k, shape.m * shape.n)
    bench.probe()
    a, b, c = bench.operands(shape)
    assert a.dtype == torch.float8_e4m3fn and b.dtype == torch.float8_e4m3fn and c.dtype == torch.bfloat16
    assert float(a.float().std()) > 0.5  # random normal inputs, not zeros
    c.fill_(float("nan"))
    bench.call(shape)()
    torch.cuda.synchronize()
    assert not torch.isnan(c).any(), "the fp8 product left elements unwritten"
    # Unit scales: the fp8 values times each other, accumulated in fp32, rounded to bf16.
    assert _relative_error(torch, c, a.float() @ b.float()) < 1e-2
    stats = bench(shape, 20, "final")
    tflops = shape.flops / stats.median_s / 1e12
    assert tflops > 1.0
    if _peak(spec, "fp8"):
        assert 0.05 * _peak(spec, "fp8") < tflops < _peak(spec, "fp8")


def test_fp8_is_refused_with_the_reason_below_ada(torch_cuda, device):
    from mleng.errors import NotAvailableError
    from mleng.measure.matmul import check_dtype_supported

    if _fp8_capable(torch_cuda):
        pytest.skip("this GPU has fp8 tensor cores; the refusal applies to older ones")
    with pytest.raises(NotAvailableError, match="fp8 needs 8.9"):
        check_dtype_supported(device, "float8_e4m3fn", 4096)


def _check_monitor(summary):
    monitor = summary["gpu_monitor"]
    assert monitor["available"], monitor
    assert monitor["samples"] > 0 and monitor["sm_clock_max_mhz"] > 0
    clocks = monitor["sm_clock_mhz"]
    assert 0 < clocks["min"] <= clocks["mean"] <= clocks["max"] <= 1.05 * monitor["sm_clock_max_mhz"]
    assert monitor["power_w"]["max"] > 0


def test_mamf_cli_ten_second_headline_is_below_the_datasheet_peak(run_mleng, torch_cuda, spec):
    result = run_mleng("mamf", "--max-seconds", "10", "--json", "--no-store", timeout=120)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    s = record["summary"]
    assert record["status"] == "complete" and s["dtype"] == "bfloat16"
    assert s["device_name"] == torch_cuda.cuda.get_device_name(0)
    assert s["value"] and s["value"] > 1.0 and s["best_phase"] == "final"  # the headline is re-measured
    assert s["m"] * s["n"] * s["k"] > 0 and s["best_shape"] == f"{s['m']}x{s['n']}x{s['k']}"
    assert s["shapes_tried"] >= 1 and s["iters"] >= 20 and s["stop_reason"]
    assert s["tflops_median"] <= s["tflops_max"]
    assert s["wall_s_from_process_start"] < 10 + 5, "the 10 s budget counts from process start"
    _check_monitor(s)
    peak = _peak(spec, "bf16")
    if not peak:
        pytest.skip(f"mleng.specs has no entry for {s['device_name']}: no datasheet peak to compare with")
    assert s["theoretical"] == peak
    assert 0.1 * peak < s["value"] < peak, f"{s['value']} TFLOPS against a dense bf16 peak of {peak}"
    assert s["ratio"] == pytest.approx(s["value"] / peak, abs=1e-3)
    if s.get("burst"):
        assert s["burst"]["tflops_median"] < peak


def test_mamf_cli_fp8_exact_shape(run_mleng, torch_cuda, spec):
    if not _fp8_capable(torch_cuda):
        pytest.skip("fp8 matmul needs compute capability 8.9+")
    result = run_mleng("mamf", "--dtype", "fp8", "--m", "4096", "--n", "4096", "--k", "4096",
                       "--max-seconds", "30", "--json", "--no-store", timeout=120)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    s = record["summary"]
    assert record["status"] == "complete" and s["dtype"] == "float8_e4m3fn" and s["spec_key"] == "fp8"
    assert s["best_shape"] == "4096x4096x4096" and s["value"] > 1.0
    assert {r["phase"] for r in record["rows"]} >= {"final"}
    _check_monitor(s)
    if _peak(spec, "fp8"):
        assert s["theoretical"] == _peak(spec, "fp8") and s["value"] < s["theoretical"]
