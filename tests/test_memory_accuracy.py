"""The issue's error bound on CPU: mleng memory's estimate against torch's own memory tracking (MemTracker) of real
training steps of tiny models that the calibration never saw (other layer counts, sequence lengths, micro-batches
and shapes), float32, every recompute mode: median |error| <= 10%, max <= 20%."""

from __future__ import annotations

import json
import statistics
import tomllib

import pytest

torch = pytest.importorskip("torch")

from mleng.plan import coeffile, memory, probe  # noqa: E402
from mleng.plan.arch import Arch, resolve  # noqa: E402
from mleng.plan.memory import TrainSetup, estimate_training  # noqa: E402

# (label, arch, seq, micro_batch, recompute): none of these shapes x lengths is a calibration run.
WIDE_FFN = Arch(name="wide-ffn", vocab_size=640, dim=96, n_layers=3, n_heads=6, n_kv_heads=6, head_dim=16,
                ffn_dim=768)
GQA = Arch(name="gqa", vocab_size=1000, dim=160, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=20, ffn_dim=448)
GRID = [
    ("tiny-4L", resolve("tiny", 4), 128, 1, "none"),
    ("tiny-4L-full", resolve("tiny", 4), 320, 1, "full"),
    ("tiny-6L-sel", resolve("tiny", 6), 160, 2, "selective"),
    ("tiny-2L-mb3", resolve("tiny", 2), 96, 3, "none"),
    ("wide-ffn", WIDE_FFN, 200, 1, "none"),
    ("wide-ffn-full", WIDE_FFN, 200, 2, "full"),
    ("gqa", GQA, 144, 2, "none"),
    ("gqa-sel", GQA, 288, 1, "selective"),
]


@pytest.fixture(scope="module")
def grid_errors():
    errors = {}
    for label, arch, seq, mb, recompute in GRID:
        est = estimate_training(arch, TrainSetup(seq=seq, micro_batch=mb, dtype="float32", recompute=recompute))
        got = probe.measure_step(arch.step_config(), seq, mb, dtype="float32", recompute=recompute, device="cpu")
        assert "MemTracker" in got.tracking
        errors[label] = 100.0 * (est["allocated_peak_bytes"] - got.peak_bytes) / got.peak_bytes
    return errors


def test_error_bound_against_memtracker(grid_errors):
    abs_err = [abs(e) for e in grid_errors.values()]
    summary = ", ".join(f"{k} {v:+.2f}%" for k, v in grid_errors.items())
    assert statistics.median(abs_err) <= 10.0, summary
    assert max(abs_err) <= 20.0, summary


def test_cli_measure_stores_a_memory_record(run_mleng):
    done = run_mleng("memory", "tiny", "--layers", "3", "--seq", "192", "--micro-batch", "2", "--dtype", "float32",
                     "--recompute", "full", "--measure", "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    m = out["measured"]
    assert abs(m["error_pct"]) <= 20 and m["id"].startswith("memory-")
    listed = run_mleng("results", "show", m["id"], "--json")
    record = json.loads(listed.stdout)
    assert record["kind"] == "memory" and record["summary"]["unit"] == "GiB"
    assert record["summary"]["theoretical"] == pytest.approx(m["estimated_peak_bytes"] / 2**30, rel=1e-3)


def test_hook_phases_match_memtracker():
    """The GPU calibration reads its phases through ModTracker hooks and the CUDA allocator; on a CPU the same
    hooks over LiveBytes must give MemTracker's phases (up to the few small tensors MemTracker does not see)."""
    from mleng.step.data import SyntheticTokens
    from mleng.step.model import build

    cfg = resolve("tiny", 3).step_config()
    torch.set_num_threads(1)
    for recompute in ("none", "full"):
        ref = probe.measure_step(cfg, 128, 1, recompute=recompute, device="cpu", phases=True).phase_peak
        live = probe.LiveBytes()
        with live:
            model = build(cfg, 128, "cpu", seed=0)
            if recompute == "full":
                model.enable_checkpointing()
            opt = probe._optimizer("adamw", model.parameters(), torch.device("cpu"))
            data = SyntheticTokens(cfg.vocab_size, 128, "cpu", seed=0)

            def step(i):
                tokens, targets = data.batch(i, 0, 1, 1)
                model(tokens, targets).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

            step(0)
            got = probe.hook_phases(model, step, live.now, live.peak, live.reset)
        offset = got["forward_end"] - ref["forward_end"]
        assert 0 <= offset < 64 * 1024
        for key in ("forward_end", "head_peak_fw", "head_peak_bw", "peak"):
            assert got[key] - ref[key] == pytest.approx(offset, abs=4096), key
        for key in ("layer_post_fw", "layer_pre_bw", "layer_peak_bw"):
            for a, b in zip(got[key], ref[key]):
                assert a - b == pytest.approx(offset, abs=4096), key


def test_calibration_writes_command_machine_date(tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "CALIBRATION_SHAPES", probe.CALIBRATION_SHAPES[:3])
    fitted = probe.run_calibration("float32", "full", device="cpu")
    path = tmp_path / "coeffs.toml"
    coeffile.write_set(path, fitted, "mleng memory --calibrate --recompute full", "cpu")
    data = tomllib.loads(path.read_text())
    entry = data["sets"]["float32/full"]
    assert entry["command"] == "mleng memory --calibrate --recompute full"
    assert "torch" in entry["machine"] and entry["measured_at"]
    assert entry["fit"]["runs"] == 12 and entry["fit"]["max_abs_error_pct"] < 5
    # full recompute keeps one fp32 block input per layer: 4 bytes x hidden per token, measured
    assert entry["components"]["saved_per_layer"]["dim"] == pytest.approx(4.0, abs=0.05)
    est, _ = memory.coefficient_set("float32", "full", data)
    assert est["dtype"] == "float32"


def test_compare_with_a_stored_step_run(run_mleng):
    """A `mleng step` GPU record (modelled here: the fields it writes) against the estimate of its own config."""
    from mleng.results.record import Measurement
    from mleng.results.store import Store

    cfg = resolve("tiny").step_config()
    record = Measurement.start("step", {"model": cfg.to_dict(), "seq": 256, "micro_batch": 2, "dtype": "bfloat16",
                                        "parallel": "fsdp", "world_size": 2, "activation_checkpointing": True,
                                        "compile": False})
    est = estimate_training(resolve("tiny"), TrainSetup(seq=256, micro_batch=2, dtype="bfloat16", gpus=2, fsdp=True,
                                                        recompute="full"))
    record.summary = {"memory": {"peak_allocated_bytes": int(est["allocated_peak_bytes"] * 1.05)}}
    record.finish("complete")
    with Store() as store:
        store.save(record)
    done = run_mleng("memory", "--step", record.id, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["error_pct"] == pytest.approx(100 * (1 / 1.05 - 1), abs=0.01)
    assert out["parallel"] == "fsdp" and out["world_size"] == 2
