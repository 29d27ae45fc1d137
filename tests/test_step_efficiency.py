"""MAMFU's ceiling: the stored `mleng mamf` run of the same GPU (by UUID, through CUDA_VISIBLE_DEVICES as
recorded), else of the same model, else none with the reason; a CPU by host and model. MFU's peak: sourced,
never guessed."""

from __future__ import annotations

from mleng.results.record import Measurement
from mleng.results.store import Store
from mleng.step.efficiency import find_stored_mamf, mamf_record_uuid

GPUS = {"available": True, "devices": [{"index": 0, "uuid": "GPU-aaa"}, {"index": 1, "uuid": "GPU-bbb"},
                                       {"index": 3, "uuid": "GPU-ccc"}]}


def _mamf(started_at: str, device: str, value: float, env=None, name="NVIDIA H200", dtype="bfloat16",
          host="node1", status="complete") -> Measurement:
    m = Measurement(kind="mamf", summary={"value": value, "unit": "TFLOPS", "device": device, "device_name": name,
                                           "dtype": dtype, "spec_key": "bf16" if dtype == "bfloat16" else "fp32"},
                    machine={"host": {"hostname": host}, "gpus": GPUS, "env": env or {}})
    m.started_at = started_at
    m.status = status
    return m


def test_the_uuid_of_a_stored_run_follows_cuda_visible_devices():
    assert mamf_record_uuid(_mamf("t", "cuda:1", 1.0)) == "GPU-bbb"
    assert mamf_record_uuid(_mamf("t", "cuda:0", 1.0, env={"CUDA_VISIBLE_DEVICES": "3"})) == "GPU-ccc"
    assert mamf_record_uuid(_mamf("t", "cuda:1", 1.0, env={"CUDA_VISIBLE_DEVICES": "GPU-x,GPU-y"})) == "GPU-y"
    assert mamf_record_uuid(_mamf("t", "cuda:2", 1.0, env={"CUDA_VISIBLE_DEVICES": "0,1"})) is None
    assert mamf_record_uuid(_mamf("t", "cpu", 1.0)) is None


def test_the_same_card_wins_over_a_newer_run_of_another_card_of_the_model(tmp_path):
    path = tmp_path / "results.sqlite"
    with Store(path) as store:
        store.save(_mamf("2026-01-01T00:00:00+00:00", "cuda:0", 760.0, env={"CUDA_VISIBLE_DEVICES": "3"}))
        store.save(_mamf("2026-02-01T00:00:00+00:00", "cuda:1", 700.0))                    # GPU-bbb, newer
        store.save(_mamf("2026-03-01T00:00:00+00:00", "cuda:3", 999.0, status="interrupted"))  # not complete
        store.save(_mamf("2026-03-02T00:00:00+00:00", "cuda:3", 50.0, dtype="float32"))      # other dtype
    h200 = {"type": "cuda", "name": "NVIDIA H200", "uuid": "GPU-ccc", "host": "node1"}
    match, _ = find_stored_mamf(h200, "bfloat16", path)
    assert match["tflops"] == 760.0 and match["match"] == "GPU UUID"
    other = dict(h200, uuid="GPU-zzz")
    match, _ = find_stored_mamf(other, "bfloat16", path)
    assert match["tflops"] == 700.0 and match["match"].startswith("GPU model")
    match, note = find_stored_mamf(dict(h200, name="NVIDIA H100 80GB HBM3"), "bfloat16", path)
    assert match is None and "no stored bfloat16 `mleng mamf` run of NVIDIA H100 80GB HBM3" in note


def test_a_cpu_is_matched_by_host_and_model_and_a_missing_store_is_said(tmp_path):
    path = tmp_path / "results.sqlite"
    match, note = find_stored_mamf({"type": "cpu", "name": "AMD EPYC", "uuid": None, "host": "vm"}, "float32", path)
    assert match is None and note == "no results store yet" and not path.exists()
    with Store(path) as store:
        store.save(_mamf("2026-01-01T00:00:00+00:00", "cpu", 0.2, name="AMD EPYC", dtype="float32", host="vm"))
    cpu = {"type": "cpu", "name": "AMD EPYC", "uuid": None, "host": "vm"}
    assert find_stored_mamf(cpu, "float32", path)[0]["match"] == "host and CPU model"
    assert find_stored_mamf(dict(cpu, host="other"), "float32", path)[0] is None


def test_the_peak_is_sourced_or_none_with_the_reason():
    import torch

    from mleng.step.efficiency import dense_peak

    value, note = dense_peak(torch.device("cpu"), {"name": "AMD EPYC"}, "float32")
    assert value is None and "CPU" in note
    from mleng.measure.matmul import theoretical_tflops

    # the same lookup on a GPU name (what a CUDA rank does): H200's dense bf16 from the spec data, not 2x sparse
    fake = torch.device("meta")
    value, note = theoretical_tflops(fake, "NVIDIA H200", "bfloat16", False)
    assert value is not None and 900 < value < 1000 and "dense bf16" in note
    value, note = theoretical_tflops(fake, "NVIDIA H999", "bfloat16", False)
    assert value is None and "no spec entry" in note
