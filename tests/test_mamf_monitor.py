"""The NVML sampler (on a machine without NVML, and its summary math) and the rendering of a real H200 record."""

import json
from pathlib import Path

import pytest

from mleng.measure.gpu_monitor import GpuMonitor, clock_note, compact_samples, decode_throttle_reasons, summarize
from mleng.results.record import Measurement

H200_RECORD = Path(__file__).resolve().parents[1] / "docs" / "results" / "mamf_h200_adaptive1.json"


def test_monitor_without_nvml_is_a_noop_with_a_reason():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pytest.skip("this machine has a working NVML driver")  # the CPU CI machine does not
    monitor = GpuMonitor(index=0).start()
    monitor.stop()
    assert monitor.available is False
    assert "NVML" in monitor.reason
    assert monitor.summary() == {"available": False, "reason": monitor.reason}
    assert monitor.sm_clock_settled() is None
    assert monitor.samples == []


def test_summary_of_samples_says_when_the_clock_ran_below_max():
    samples = [{"t_s": i * 0.1, "sm_clock_mhz": clock, "mem_clock_mhz": 3201.0, "power_w": power,
                "temperature_c": 60.0, "throttle_mask": mask}
               for i, (clock, power, mask) in enumerate([(1980.0, 690.0, 0), (1700.0, 700.0, 0x4),
                                                         (1600.0, 701.0, 0x4), (1700.0, 699.0, 0x4 | 0x1)])]
    summary = summarize(samples, sm_clock_max_mhz=1980.0, name="NVIDIA H200")
    assert summary["sm_clock_mhz"] == {"min": 1600.0, "mean": 1745.0, "max": 1980.0}
    assert summary["power_w"]["max"] == 701.0
    assert summary["throttle_reasons"] == {"sw_power_cap": 3, "gpu_idle": 1}
    assert summary["limiting_reasons"] == ["sw_power_cap"]
    assert summary["below_max_clock"] is True
    assert summary["sm_clock_mean_fraction_of_max"] == pytest.approx(1745 / 1980, abs=1e-4)
    note = clock_note(summary)
    assert "1745 MHz" in note and "1980 MHz" in note and "sw_power_cap" in note


def test_a_run_at_max_clock_gets_no_note():
    samples = [{"t_s": 0.0, "sm_clock_mhz": 1980.0, "throttle_mask": 0},
               {"t_s": 0.1, "sm_clock_mhz": 1965.0, "throttle_mask": 0}]
    summary = summarize(samples, 1980.0)
    assert summary["below_max_clock"] is False
    assert clock_note(summary) is None
    assert summary["power_w"] is None  # not sampled: said, not invented


def test_throttle_mask_decoding_and_timeline_compaction():
    assert decode_throttle_reasons(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert decode_throttle_reasons(0) == []
    samples = [{"t_s": i} for i in range(5000)]
    kept = compact_samples(samples, max_samples=1000)
    assert len(kept) <= 1000 and kept[0]["t_s"] == 0
    assert compact_samples(samples[:10]) == samples[:10]


def test_a_real_h200_record_renders_with_its_telemetry():
    from mleng.cli.mamf import render

    record = Measurement.from_dict(json.loads(H200_RECORD.read_text()))
    text = render(record)
    summary = record.summary
    assert summary["device_name"] == "NVIDIA H200" and summary["dtype"] == "bfloat16"
    assert f"{summary['tflops_median']:.1f} TFLOPS" in text
    assert "burst median" in text and "theoretical" in text and "efficiency" in text
    assert "while measuring" in text and "SM clock mean" in text
    if summary["gpu_monitor_measuring"]["below_max_clock"]:
        assert "note: SM clock averaged" in text
    finals = [r for r in record.rows if r["phase"] == "final"]
    assert finals and all(r["iters"] >= 20 and "sm_clock_mhz_mean" in r for r in finals)
    assert summary["tflops_median"] == max(r["tflops_median"] for r in finals)
