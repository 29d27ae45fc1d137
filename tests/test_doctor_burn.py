"""Burn-in on the CPU: a clean run passes; a wrong result injected through the fault hook fails the burn-in and
names the device (a repeat that changed, a device whose bits differ from its peers), in-process and through
`mleng doctor --burn` (MLENG_BURN_FAULT)."""

import json

import pytest

from mleng.doctor import burn


def by_check(findings, check):
    return {f.subject: f for f in findings if f.check == check}


def test_clean_burn_passes_with_bitwise_repeats_and_the_reference_tile():
    result = burn.run_burn(1.5, devices=["cpu"], size=128)
    device = result["devices"][0]
    assert device["repeat_mismatches"] == 0 and device["iterations"] > 10
    assert device["first_hash"] == device["last_hash"]
    assert 0 < device["tile_error_first"] <= burn.TILE_TOLERANCE  # bf16 output rounding, never exactly 0
    correctness = by_check(burn.burn_findings(result), "burn_correctness")["cpu"]
    assert correctness.severity == "ok" and "bitwise identical" in correctness.summary


def test_a_wrong_repeat_fails_and_names_the_device():
    def fault(label, iteration, out):
        if label == "cpu#1" and iteration == 5:
            out.view(-1)[7] += 1

    result = burn.run_burn(1.0, devices=["cpu", "cpu", "cpu"], size=96, fault=fault)
    findings = by_check(burn.burn_findings(result), "burn_correctness")
    assert {s: f.severity for s, f in findings.items()} == {"cpu#0": "ok", "cpu#1": "fail", "cpu#2": "ok"}
    bad = findings["cpu#1"]
    assert "WRONG RESULTS" in bad.summary and "1 of" in bad.summary and bad.measured["repeat_mismatches"] == 1
    assert "dcgm-diag-failures" in bad.handbook


def test_a_device_whose_first_result_differs_from_its_peers_is_named():
    def fault(label, iteration, out):
        if label == "cpu#2" and iteration == 0:
            out.view(-1)[0] += 1   # a consistently wrong device: its repeats agree with its own bad first result

    result = burn.run_burn(0.5, devices=["cpu", "cpu", "cpu"], size=96, fault=fault)
    findings = by_check(burn.burn_findings(result), "burn_correctness")
    assert [s for s, f in findings.items() if f.severity == "fail"] == ["cpu#2"]
    assert "differs bitwise from the other 2" in findings["cpu#2"].summary


def test_a_tile_off_the_reference_fails_even_when_every_device_agrees():
    result = burn.run_burn(0.3, devices=["cpu"], size=96)
    result["devices"][0]["tile_error_last"] = 0.9
    assert by_check(burn.burn_findings(result), "burn_correctness")["cpu"].severity == "fail"


def test_drift_is_judged_on_gpus_from_enough_rounds():
    rounds = [{"tflops": 760.0, "seconds": 1.0}] * 7 + [{"tflops": 690.0, "seconds": 1.0}] * 6
    drift = burn.tflops_drift(rounds)
    assert drift["first"] == 760.0 and drift["last"] == 690.0 and drift["drift"] == pytest.approx(-0.0921, abs=1e-4)
    result = {"size": 8192, "duration_s": 13.0, "devices": [{
        "device": "cuda:0", "name": "NVIDIA H200", "uuid": "GPU-1", "index": 0, "iterations": 9000,
        "rounds": rounds, "repeat_mismatches": 0, "mismatch_rounds": [], "first_hash": "a", "last_hash": "a",
        "tile_error_first": 0.004, "tile_error_last": 0.004,
        "telemetry": {"whole": {"temperature_c_max": 84}, "first_third": {"sm_clock_mhz_mean": 1755},
                      "last_third": {"sm_clock_mhz_mean": 1410, "limiting_reasons": ["sw_thermal_slowdown"]}}}]}
    tflops = by_check(burn.burn_findings(result), "burn_tflops")["gpu 0 (NVIDIA H200)"]
    assert tflops.severity == "warn" and "760 -> 690 TFLOPS" in tflops.summary
    assert "SM clock 1755 -> 1410 MHz, up to 84 C (sw_thermal_slowdown)" in tflops.summary
    assert tflops.gpu_uuid == "GPU-1"
    assert burn.tflops_drift(rounds[:5])["drift"] is None


def test_durations():
    assert burn.parse_duration("90s") == 90 and burn.parse_duration("10m") == 600 and burn.parse_duration("1h") == 3600
    assert burn.parse_duration("45") == 45
    for bad in ("soon", "0s", "-1m"):
        with pytest.raises(ValueError):
            burn.parse_duration(bad)


def test_doctor_burn_cli_fails_on_an_injected_wrong_result(run_mleng):
    result = run_mleng("doctor", "--no-measure", "--no-store", "--burn", "2s", "--json",
                       env={burn.FAULT_ENV: "cpu:3"}, timeout=180)
    assert result.returncode == 1, result.stderr
    record = json.loads(result.stdout)
    bad = [r for r in record["rows"] if r["check"] == "burn_correctness"]
    assert [(r["subject"], r["severity"]) for r in bad] == [("cpu", "fail")]
    assert record["summary"]["burn"]["devices"][0]["repeat_mismatches"] == 1
    assert record["params"]["burn_s"] == 2.0


def test_doctor_burn_refuses_bad_input(run_mleng):
    assert run_mleng("doctor", "--burn", "soon", "--no-store").returncode == 2
    refused = run_mleng("doctor", "--burn", "1m", "--fingerprint", "tests/fixtures/fingerprints/h200_healthy.json")
    assert refused.returncode == 2 and "--burn runs on this machine" in refused.stderr
