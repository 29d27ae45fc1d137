"""`mleng report`: a self-contained page, rendered for real in headless Chromium."""

import json
import random
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from mleng.results.record import Measurement
from mleng.results.store import Store

FIXTURES = Path(__file__).parent / "fixtures" / "fingerprints"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _all_devices_mamf() -> Measurement:
    """A record in the shape `mleng mamf --all-devices` stores, for 8 GPUs with GPU 5 slow."""
    machine = json.loads((FIXTURES / "h200_throttled.json").read_text())
    m = Measurement.start("mamf", {"all_devices": True, "devices": 8}, machine=machine)
    rng = random.Random(0)
    per_device = []
    for device in range(8):
        best = 560.0 if device == 5 else 780.0 + rng.uniform(-5, 5)
        for m_dim in (1024, 2048, 4096):
            for k in (4096, 8192, 13312):
                m.rows.append({"device": device, "m": m_dim, "n": 2048, "k": k, "dtype": "bfloat16",
                               "tflops_median": best * rng.uniform(0.8, 1.0), "iters": 50, "phase": "coarse"})
        per_device.append({"device": device, "device_name": "NVIDIA H200", "best_shape": "2048x2048x13312",
                           "tflops_median": best, "tflops_max": best + 3, "status": "complete"})
    m.summary = {"value": 560.0, "unit": "TFLOPS", "theoretical": 989.0, "ratio": 560 / 989, "dtype": "bfloat16",
                 "per_device": per_device, "slowest_device": 5, "spread_pct": 28.4,
                 "gpu_monitor": {"available": True, "sm_clock_max_mhz": 1980.0,
                                 "timeline": [{"t_s": t * 0.5, "sm_clock_mhz": 1980 - 30 * t, "power_w": 300 + 20 * t}
                                              for t in range(20)]}}
    return m.finish()


def _collective() -> Measurement:
    m = Measurement.start("comm", {"ops": ["all_reduce"]}, machine={"host": {"hostname": "node3"}})
    for i, size in enumerate(2**p for p in range(15, 35)):
        m.rows.append({"op": "all_reduce", "size_bytes": size, "count": size // 2, "dtype": "bfloat16",
                       "time_us": 10 + size / 3e5, "algbw_gbps": min(200.0, size / 1e8), "busbw_gbps": min(367.0, size / 5e7)})
    m.summary = {"value": 367.0, "unit": "GB/s", "theoretical": 450.0, "ratio": 367 / 450}
    return m.finish()


def _png_size_and_colors(path: Path) -> tuple[int, int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    chunks, offset = b"", 8
    while offset < len(data):
        length = struct.unpack(">I", data[offset:offset + 4])[0]
        kind = data[offset + 4:offset + 8]
        if kind == b"IDAT":
            chunks += data[offset + 8:offset + 8 + length]
        offset += 12 + length
    raw = zlib.decompress(chunks)
    return width, height, len(set(raw[i:i + 3] for i in range(1, min(len(raw), 3_000_000), 997)))


def test_report_has_every_plot_and_no_external_resource(run_mleng, tmp_path):
    doctor = run_mleng("doctor", "--fingerprint", str(FIXTURES / "h200_throttled.json"), "--json")
    doctor_id = json.loads(doctor.stdout)["id"]
    mamf, collective = _all_devices_mamf(), _collective()
    with Store() as store:
        store.save(mamf)
        store.save(collective)
    out = tmp_path / "report.html"
    result = run_mleng("report", doctor_id, mamf.id, collective.id, "-o", str(out))
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    for title in ("busbw against message size", "link spec 450 GB/s", "best median TFLOPS per GPU (slowest in red)",
                  "TFLOPS per shape around the best", "SM clock during the run", "gpu-clock-throttling"):
        assert title in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    assert page.count("<svg") == 5


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium; CI installs it)")
def test_report_renders_in_headless_chromium(run_mleng, tmp_path):
    mamf, collective = _all_devices_mamf(), _collective()
    with Store() as store:
        store.save(mamf)
        store.save(collective)
    out = tmp_path / "report.html"
    assert run_mleng("report", mamf.id, collective.id, "-o", str(out)).returncode == 0
    shot = tmp_path / "report.png"
    common = CHROMIUM_FLAGS + [f"--user-data-dir={tmp_path / 'profile'}"]
    subprocess.run([CHROMIUM, *common, "--window-size=1100,2400", f"--screenshot={shot}", out.as_uri()],
                   capture_output=True, timeout=120)
    width, height, colors = _png_size_and_colors(shot)
    assert (width, height) == (1100, 2400)
    assert colors > 5, "the screenshot is blank"
    dom = subprocess.run([CHROMIUM, *common, "--dump-dom", out.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert dom.count("<svg") == 5 and "slowest" in dom and "GPU 5" in dom


def test_report_of_a_recorded_h200_step_run_plots_where_the_time_goes(run_mleng, tmp_path):
    record = json.loads((Path(__file__).parent / "fixtures" / "records" / "step_h200_8b_4l_compiled.json").read_text())
    with Store() as store:
        run_id = store.save(record)
    out = tmp_path / "report.html"
    result = run_mleng("report", run_id, "-o", str(out))
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    assert "where the time goes" in page and page.count("<svg") == 1
    assert "MFU 55.4%" in page and "MAMFU 71.6%" in page
    for name in ("gemm", "attention", "elementwise other", "idle"):
        assert f"{name}: " in page, name      # one bar per share, titled with its value
