"""`mleng upgrade` against the published H200 -> B200 figures of the upgrade framework."""

import json

import pytest

from mleng.decide.upgrade import Workload, attention_share, decide
from mleng.specs import lookup_accelerator

H200, B200 = lookup_accelerator("h200"), lookup_accelerator("b200")
# The book's measured speedups of Llama-3.1-8B training, B200 over H200, by sequence length. The 8K
# and 32K rows are dominated by the long-context config's offload overhead, which a FLOP model
# does not see; from 64K on the step is what the model describes.
BOOK_SPEEDUP_BY_SEQ_LEN = {65536: 1.84, 131072: 1.99, 196608: 2.02, 262144: 2.03}
BOOK_ATTENTION_SHARE = {8192: 0.13, 32768: 0.36, 65536: 0.53, 131072: 0.70, 196608: 0.77, 262144: 0.82}


def test_spec_ratios_match_the_book():
    result = decide(H200, B200, 3.5, 7.0, Workload())
    assert result["gate2_throughput"]["spec_speedup"] == pytest.approx(2.28, abs=0.005)
    assert result["gate2_throughput"]["memory_bandwidth_speedup"] == pytest.approx(1.67, abs=0.005)


def test_mamf_speedup_from_measured_values():
    result = decide(H200, B200, 3.5, 7.0, Workload(), mamf_old_tflops=794.5, mamf_new_tflops=1745.0)
    assert result["gate2_throughput"]["mamf_speedup"] == pytest.approx(2.196, abs=0.001)
    assert result["gate2_throughput"]["speedup_source"] == "stored MAMF runs"


@pytest.mark.parametrize("seq_len,share", sorted(BOOK_ATTENTION_SHARE.items()))
def test_attention_share_tracks_the_book(seq_len, share):
    assert attention_share(Workload(kind="attention", seq_len=seq_len)) == pytest.approx(share, abs=0.03)


@pytest.mark.parametrize("seq_len,speedup", sorted(BOOK_SPEEDUP_BY_SEQ_LEN.items()))
def test_workload_speedup_tracks_the_book(seq_len, speedup):
    result = decide(H200, B200, 3.5, 7.0, Workload(kind="attention", seq_len=seq_len),
                    mamf_old_tflops=794.5, mamf_new_tflops=1745.0)
    assert result["gate2_throughput"]["workload_speedup"] == pytest.approx(speedup, rel=0.06)


def test_long_context_at_double_price_is_break_even_or_better():
    result = decide(H200, B200, 3.5, 7.0, Workload(kind="attention", seq_len=131072),
                    mamf_old_tflops=794.5, mamf_new_tflops=1745.0)
    assert result["verdict"].startswith(("upgrade", "tie"))
    assert result["cost"]["break_even_price_to"] == pytest.approx(3.5 * result["gate2_throughput"]["speedup"], rel=0.01)


def test_short_dense_bound_context_at_double_price_holds():
    result = decide(H200, B200, 3.5, 7.0, Workload(kind="attention", seq_len=8192),
                    mamf_old_tflops=794.5, mamf_new_tflops=1745.0)
    assert result["verdict"] == "hold"
    assert result["cost"]["cost_per_token_ratio"] > 1.05


def test_memory_gate_fires_where_only_the_new_gpu_fits():
    # The book: H200 tops out near 256K tokens for this config, B200 runs past ~350K.
    result = decide(H200, B200, 3.5, 7.0, Workload(kind="attention", seq_len=327680))
    gate1 = result["gate1_capability"]
    assert gate1["passed"] and result["verdict"] == "upgrade"
    assert 256_000 <= gate1["max_seq_len"]["from"] < 300_000
    assert gate1["max_seq_len"]["to"] > 350_000


def test_needed_dtype_disqualifies_the_old_gpu():
    result = decide(H200, B200, 3.5, 20.0, Workload(need_dtype="fp4"))
    assert result["gate1_capability"]["passed"]
    assert "fp4" in result["gate1_capability"]["new_dtypes"]
    assert result["verdict"] == "upgrade"


def test_cli_json_and_bad_input(run_mleng):
    out = run_mleng("upgrade", "--from", "h200", "--to", "b200", "--price-from", "3.5", "--price-to", "6.0",
                    "--workload", "attention", "--seq-len", "32768", "--model-params", "8e9", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["cost"]["price_ratio"] == pytest.approx(6.0 / 3.5, rel=1e-3)
    human = run_mleng("upgrade", "--from", "h200", "--to", "b200", "--price-from", "3.5", "--price-to", "6.0")
    assert "verdict:" in human.stdout
    bad = run_mleng("upgrade", "--from", "h200", "--to", "b9000", "--price-from", "3.5", "--price-to", "6.0")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    negative = run_mleng("upgrade", "--from", "h200", "--to", "b200", "--price-from", "-1", "--price-to", "6.0")
    assert negative.returncode == 2 and "positive" in negative.stderr


def test_from_step_uses_the_measured_mfu_of_a_stored_h200_step_run(run_mleng):
    from pathlib import Path

    from mleng.results.store import Store

    record = json.loads((Path(__file__).parent / "fixtures" / "records" / "step_h200_8b_4l_compiled.json").read_text())
    with Store() as store:
        run_id = store.save(record)
    prices = ["--to", "b200", "--price-from", "3.5", "--price-to", "6.0"]
    assumed = json.loads(run_mleng("upgrade", "--from", "h200", *prices, "--json").stdout)
    measured_run = run_mleng("upgrade", "--from", "h200", *prices, "--from-step", run_id, "--json")
    assert measured_run.returncode == 0, measured_run.stderr
    measured = json.loads(measured_run.stdout)
    assert measured["cost"]["assumed_mfu_from"] == pytest.approx(record["summary"]["mfu"])
    assert run_id in measured["cost"]["mfu_source"]
    # the same work at 55% instead of 40% MFU costs proportionally less per token on the old GPU
    old_cost = assumed["cost"]["cost_per_million_tokens"]["from"]
    assert measured["cost"]["cost_per_million_tokens"]["from"] == pytest.approx(old_cost * 0.40 / record["summary"]["mfu"],
                                                                                rel=0.02)
    human = run_mleng("upgrade", "--from", "h200", *prices, "--from-step", run_id)
    assert f"measured by mleng step run {run_id}" in human.stdout

    for argv, words in ((["--from", "h100", *prices, "--from-step", run_id], "not on NVIDIA H100"),
                        (["--from", "h200", *prices, "--from-step", run_id, "--mfu", "0.3"], "--mfu and --from-step"),
                        (["--from", "h200", *prices, "--from-step", run_id, "--dtype", "fp8"], "bfloat16 peak"),
                        (["--from", "h200", *prices, "--from-step", "nope"], "nope")):
        bad = run_mleng("upgrade", *argv)
        assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
