"""membw on CUDA: the Triton copy/read/write kernels, torch, driver and host<->device copies, the PCIe link, the CLI."""

import json

import pytest

pytestmark = pytest.mark.gpu

SIZE = 256 * 2**20  # several times any L2, small enough for seconds


def _triton_or_skip():
    from mleng.measure import membw

    available, reason = membw.triton_available()
    if not available:
        pytest.skip(reason)
    return membw


def _hbm_gbps(torch):
    from mleng.measure.membw import hbm_theoretical_gbps

    return hbm_theoretical_gbps(torch.cuda.get_device_name(0))[0]


def test_triton_kernels_copy_read_and_write_exactly(torch_cuda, device):
    membw = _triton_or_skip()
    torch = torch_cuda
    n = membw.round_size(SIZE) // 4
    src = torch.randn(n, device=device)
    for streaming in (False, True):
        dst = torch.full_like(src, float("nan"))
        membw.triton_copy(src, dst, streaming=streaming)
        torch.cuda.synchronize()
        assert torch.equal(dst, src), f"triton copy (streaming={streaming}) wrote wrong data"

    block = membw.TRITON_READ[0]
    partial = torch.full((n // block,), float("nan"), device=device)
    membw.triton_read(src, partial)
    torch.cuda.synchronize()
    expected = src.view(-1, block).double().sum(dim=1)
    assert torch.allclose(partial.double(), expected, rtol=1e-4, atol=1e-2)

    pattern = torch.randn(membw._PATTERN_ELEMENTS, device=device)
    dst = torch.full_like(src, float("nan"))
    membw.triton_write(pattern, dst)
    torch.cuda.synchronize()
    period = min(membw.TRITON_WRITE[0], pattern.numel())
    assert torch.equal(dst.view(-1, period), pattern[:period].expand(n // period, period))


def test_measure_device_rows_are_physical(torch_cuda, device):
    from mleng.measure import membw

    torch = torch_cuda
    engines = ["torch", "triton", "driver"] if membw.triton_available()[0] else ["torch", "driver"]
    rows = membw.measure_device("cuda:0", size_bytes=SIZE, engines=engines, host_size_bytes=64 * 2**20,
                                iters=5, warmup=2)
    measured = {(r["test"], r["engine"], r.get("host_memory")): r for r in rows if "gbps" in r}
    expected = {(t, e, None) for t in ("copy", "read", "write") for e in engines if e != "driver"}
    expected.add(("copy", "driver", None))  # the driver engine has only the copy (cuMemcpyDtoDAsync)
    expected |= {(t, "torch", m) for t in ("h2d", "d2h") for m in ("pinned", "pageable")}
    assert set(measured) == expected
    hbm = _hbm_gbps(torch)
    link = membw.pcie_link(0)
    pcie, _ = membw.pcie_theoretical_gbps(link["gen"], link["width"])
    for key, row in measured.items():
        assert row["iters"] == 5 and row["gbps_min"] <= row["gbps"] <= row["gbps_max"], key
        assert row["time_us_min"] <= row["time_us"] <= row["time_us_max"], key
        if row["test"] in ("h2d", "d2h"):
            assert row["size_bytes"] == 64 * 2**20 and 0.1 < row["gbps"], key
            if pcie:
                assert row["gbps"] < 1.1 * pcie, f"{key}: {row['gbps']:.1f} GB/s over a {pcie} GB/s link"
        else:
            assert row["size_bytes"] == SIZE and row["gbps"] > 50, key
            if hbm:
                assert row["gbps"] < 1.05 * hbm, f"{key}: {row['gbps']:.0f} GB/s above the {hbm:.0f} GB/s HBM spec"
        if row.get("sm_clock_mhz_mean") is not None:  # NVML telemetry, where the monitor caught a sample
            assert 0 < row["sm_clock_mhz_mean"] < 4000, key
    pinned = measured[("h2d", "torch", "pinned")]["gbps"]
    assert pinned > 1.0, f"pinned host-to-device copies at {pinned:.2f} GB/s"


def test_pcie_link_from_nvml_matches_the_fingerprint(torch_cuda, nvml_gpu0):
    from mleng.measure.membw import pcie_link, pcie_theoretical_gbps

    link = pcie_link(0)
    assert link["source"].startswith("NVML 0"), link["source"]  # found by PCI bus id, not an error text
    assert 1 <= link["gen"] <= 6 and link["width"] in (1, 2, 4, 8, 16, 32)
    assert 1 <= link["gen_current"] <= link["gen"] and 1 <= link["width_current"] <= link["width"]
    # The same card read by index in machine/nvml: the same link.
    assert (link["gen"], link["width"]) == (nvml_gpu0["pcie_gen_max"], nvml_gpu0["pcie_width_max"])
    gbps, source = pcie_theoretical_gbps(link["gen"], link["width"])
    assert gbps and 0.2 < gbps < 300, source


def test_membw_cli_small_size(run_mleng, torch_cuda):
    result = run_mleng("membw", "--size", "256MiB", "--iters", "5", "--warmup", "2", "--json", "--no-store",
                       timeout=180)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    s = record["summary"]
    assert record["status"] == "complete" and record["params"]["devices"] == ["cuda:0"]
    assert record["params"]["size_bytes"] == SIZE
    assert s["device"] == "cuda:0" and s["value"] > 50
    for key in ("read_gbps", "write_gbps", "h2d_pinned_gbps", "d2h_pinned_gbps", "h2d_pageable_gbps"):
        assert s.get(key) and s[key] > 0, key
    assert "driver" in s["per_device"]["cuda:0"]["copy_gbps_by_engine"]
    device = s["devices"]["cuda:0"]
    assert device["name"] == torch_cuda.cuda.get_device_name(0)
    assert device["pcie"]["gen"] and device["pcie"]["width"]
    hbm = _hbm_gbps(torch_cuda)
    if hbm:
        assert s["theoretical"] == hbm and 0.2 < s["ratio"] < 1.05, s["ratio"]
    assert record["machine"]["gpus"]["available"] and record["machine"]["gpus"]["count"] >= 1
