"""mleng plan: the book's ZeRO feasibility example, collective volumes per strategy, busbw read from a stored
`mleng comm` run at each payload, compute time from a stored `mleng step` run, the verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mleng.plan import comm_model
from mleng.plan.arch import resolve
from mleng.plan.planner import Compute, PlanSetup, plan

COMM_FIXTURE = Path(__file__).parent / "fixtures" / "plan" / "comm_gloo_2ranks.json"


def test_book_idefics_80b_example():
    """The book (section 5.5): comms 3*2*80/42.5 = 11 s, compute 4*2*80*1024*3584/(512*1e3*250) = 18 s."""
    r = comm_model.book_feasibility(3, 2, 80, 42.5, 4, 1024, 3584, 512, 250)
    assert r["comms_s"] == pytest.approx(11.29, abs=0.01)
    assert r["compute_s"] == pytest.approx(18.35, abs=0.01)
    assert r["comm_bound"] is False and r["exposed_s"] == 0


def test_book_form_on_the_command_line(run_mleng):
    done = run_mleng("plan", "--params", "80B", "--gpus", "512", "--seq", "1024", "--global-batch", "3584",
                     "--recompute", "full", "--busbw", "42.5", "--tflops", "250", "--param-bytes", "2", "--json")
    assert done.returncode == 0, done.stderr
    rows = {r["strategy"]: r for r in json.loads(done.stdout)["rows"]}
    assert rows["zero3"]["comms_s"] == pytest.approx(11.29, abs=0.01)
    assert rows["zero3"]["compute_s"] == pytest.approx(18.35, abs=0.01)
    assert rows["ddp"]["comms_s"] == pytest.approx(2 * 2 * 80 / 42.5, abs=0.01)
    same = run_mleng("plan", "--params", "80e9", "--gpus", "512", "--seq", "1024", "--global-batch", "3584",
                     "--recompute", "full", "--busbw", "42.5", "--tflops", "250", "--json")
    assert json.loads(same.stdout)["rows"] == json.loads(done.stdout)["rows"]


def test_per_block_payloads_add_up_to_the_books_multipliers():
    """With one busbw for every size the per-block ZeRO-3 traffic is the book's 3 x bytes x params (times the
    ring factor (n-1)/n the book leaves out), except the root (embeddings and head), which FSDP2 keeps gathered
    from forward to backward: 2 x for it; DDP's is 2 x."""
    arch = resolve("70b")
    n, busbw = 512, 42.5
    setup = PlanSetup(gpus=n, seq=1024, micro_batch=7, grad_accum=1, recompute="full", param_bytes=2, grad_bytes=2,
                      strategies=("ddp", "zero3"))
    out = plan(arch, setup, comm_model.constant_curves(busbw, "given"), Compute(250, "given"))
    rows = {r["strategy"]: r for r in out["strategies"]}
    p = arch.params()
    root = p.embedding + p.output + p.final_norm
    ring = (n - 1) / n
    assert rows["zero3"]["comm_s"] == pytest.approx((3 * p.layers + 2 * root) * 2 * ring / (busbw * 1e9), rel=1e-3)
    assert rows["ddp"]["comm_s"] == pytest.approx(2 * 2 * p.total * ring / (busbw * 1e9), rel=1e-3)
    book = comm_model.book_feasibility(3, 2, p.total / 1e9, busbw, 4, 1024, 7 * n, n, 250)["comms_s"]
    assert rows["zero3"]["comm_s"] == pytest.approx(book, rel=0.02)


def test_compute_time_is_hardware_flops_over_the_rate():
    from mleng.step.flops import flops_per_token

    arch = resolve("8b")
    setup = PlanSetup(gpus=8, seq=4096, micro_batch=2, grad_accum=3, recompute="full", strategies=("fsdp",))
    out = plan(arch, setup, comm_model.constant_curves(100, "given"), Compute(400, "given"))
    f = flops_per_token(arch.step_config(), 4096, recompute=True).hardware
    assert out["strategies"][0]["compute_s"] == pytest.approx(f * 4096 * 2 * 3 / 400e12, rel=1e-3)


def test_busbw_interpolates_log_log_between_stored_sizes():
    curve = comm_model.BusbwCurve("all_gather", [(1 << 20, 10.0), (1 << 22, 40.0)], 8, "test")
    assert curve.at(1 << 21)[0] == pytest.approx(20.0)
    assert curve.at(1 << 10)[0] == 10.0 and "below" in curve.at(1 << 10)[1]
    assert curve.at(1 << 30)[0] == 40.0 and "above" in curve.at(1 << 30)[1]


def test_bigger_buckets_or_units_fix_a_latency_bound_config():
    """busbw that grows with the payload (as every measured curve does) makes small buckets slow; the plan says
    which bucket or unit size changes the verdict."""
    curves = {op: comm_model.BusbwCurve(op, [(1 << 20, 1.0), (1 << 30, 100.0)], 8, "modelled curve")
              for op in ("all_reduce", "all_gather", "reduce_scatter")}
    arch = resolve("1b")
    setup = PlanSetup(gpus=8, seq=2048, strategies=("ddp", "fsdp"))
    out = plan(arch, setup, curves, Compute(200, "given"))
    rows = {r["strategy"]: r for r in out["strategies"]}
    ddp = rows["ddp"]
    assert ddp["comm_bound"]
    by_bucket = {a["bucket_mib"]: a["comm_s"] for a in ddp["alternatives"]}
    assert by_bucket[500] < by_bucket[100] < by_bucket[25]
    units = {a["blocks_per_unit"]: a["comm_s"] for a in rows["fsdp"]["alternatives"]}
    assert units[4] < units[1]
    assert any("buckets bring" in v or "blocks per FSDP unit bring" in v for v in out["verdict"])
    assert any("communication-bound" in v for v in out["verdict"])


def _save(record: dict) -> None:
    from mleng.results.record import Measurement
    from mleng.results.store import Store

    record = {k: v for k, v in record.items() if k != "_provenance"}
    with Store() as store:
        store.save(Measurement.from_dict(record))


def test_stored_comm_run_feeds_the_plan(run_mleng):
    record = json.loads(COMM_FIXTURE.read_text())
    assert record["_provenance"].startswith("recorded")
    _save(record)
    done = run_mleng("plan", "tiny", "--gpus", "2", "--comm", "last", "--tflops", "0.01", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert any(record["id"] in a for a in out["assumptions"])
    hows = [c["busbw_how"] for r in out["strategies"] for c in r["collectives"]]
    assert any(h.startswith("interpolated") for h in hows)
    # the all_gather busbw at a stored size is that row's busbw
    rows = [r for r in record["rows"] if r["op"] == "all_gather"]
    curve = comm_model.curves_from_record(record)["all_gather"]
    assert curve.at(rows[0]["size_bytes"])[0] == pytest.approx(rows[0]["busbw_gbps"])


def test_stored_step_run_gives_the_compute_rate(run_mleng):
    """A step record (modelled here: the fields `mleng step` writes) supplies tokens/s per device and its
    hardware FLOPs per token; the plan's compute rate is their product."""
    from mleng.results.record import Measurement
    from mleng.results.store import Store

    record = Measurement.start("step", {"model": resolve("tiny").step_config().to_dict(), "seq": 128,
                                        "micro_batch": 1, "dtype": "float32", "world_size": 1})
    record.summary = {"model": "tiny", "seq": 128, "device_name": "modelled CPU", "tokens_per_s_per_device": 5000.0,
                      "flops_per_token": {"palm": {"hardware": 4.0e6, "model": 4.0e6}}}
    record.finish("complete")
    with Store() as store:
        store.save(record)
    done = run_mleng("plan", "tiny", "--gpus", "2", "--busbw", "1", "--dtype", "float32", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["compute"]["tflops"] == pytest.approx(5000 * 4e6 / 1e12)
    assert record.id in out["compute"]["tflops_source"]


def test_gpus_needed_and_fit_on_a_named_gpu():
    arch = resolve("70b")
    setup = PlanSetup(gpus=8, seq=4096, recompute="full", gpu="h200", strategies=("ddp", "zero3"))
    out = plan(arch, setup, comm_model.constant_curves(100, "given"), Compute(400, "given"))
    rows = {r["strategy"]: r for r in out["strategies"]}
    assert rows["ddp"]["fits"] is False and rows["ddp"]["gpus_needed"] is None
    assert rows["zero3"]["gpus_needed"] is not None and rows["zero3"]["gpus_needed"] <= 16
    assert out["best"] == ("zero3" if rows["zero3"]["fits"] else None)


def test_upgrade_gate_1_uses_mleng_memory(run_mleng):
    """mleng upgrade --model: gate 1 is mleng memory at the explicit --gpus/--zero; a model that fits neither card
    says so and is never UPGRADE on memory grounds; --mfu in (0, 1]; 70B and 70e9; dtype aliases."""
    base = ["upgrade", "--from", "h100", "--to", "h200", "--price-from", "2", "--price-to", "3.5", "--json"]
    done = run_mleng(*base, "--model", "70b", "--gpus", "1", "--seq-len", "8192")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["gate1_capability"]["fits"] == {"from": False, "to": False}
    assert out["verdict"] == "does not fit"
    assert any("mleng memory 70b" in a for a in out["assumptions"])
    fits = json.loads(run_mleng(*base, "--model", "70b", "--gpus", "16", "--zero", "3", "--seq-len", "4096").stdout)
    assert fits["gate1_capability"]["fits"]["to"] is True
    assert fits["gate1_capability"]["usable_memory_gib"]["to"] == pytest.approx(143771 / 1024 - 648347648 / 2**30,
                                                                                abs=0.1)
    for bad, message in ((["--mfu", "1.5"], "--mfu 1.5"), (["--mfu", "0"], "--mfu 0"),
                         (["--model", "8b", "--zero", "4"], "--zero 4")):
        r = run_mleng(*base, *bad)
        assert r.returncode == 2 and message in r.stderr, r.stderr
    a = json.loads(run_mleng(*base, "--model-params", "70B", "--dtype", "bfloat16").stdout)
    b = json.loads(run_mleng(*base, "--model-params", "70e9", "--dtype", "bf16").stdout)
    assert a["gate2_throughput"] == b["gate2_throughput"] and a["dtype"] == "bf16"
