"""`mleng specs` through real subprocesses: output, JSON, exit codes, and what start-up imports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def mleng(*args: str, tmp_path, python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {"MLENG_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, *python_flags, "-m", "mleng", "specs", *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_show_h200_json_parses(tmp_path):
    result = mleng("show", "h200", "--json", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kind"] == "accelerator" and data["key"] == "h200-sxm"
    assert data["tflops"]["bf16"] == 989 and data["memory_bandwidth_tbps"] == 4.8
    assert all(s["read_on"] for s in data["sources"])


def test_show_takes_an_nvml_name_without_quotes(tmp_path):
    result = mleng("show", "NVIDIA", "H100", "80GB", "HBM3", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("h100-sxm: NVIDIA H100 SXM")
    assert "989.4 TFLOPS" in result.stdout  # the formula line
    assert "sources:" in result.stdout and "read 2026-12-02" in result.stdout


def test_show_prints_the_recorded_choice(tmp_path):
    result = mleng("show", "mi355x", tmp_path=tmp_path)
    assert result.returncode == 0
    assert "where sources disagree:" in result.stdout and "tflops.bf16: 2500 (not 2300)" in result.stdout


def test_show_a_link(tmp_path):
    result = mleng("show", "nvlink-4", "--json", tmp_path=tmp_path)
    data = json.loads(result.stdout)
    assert data["kind"] == "link" and data["unidirectional_gbps"] == 450
    human = mleng("show", "pcie", "gen5", tmp_path=tmp_path)
    assert "63.02 GB/s" in human.stdout and "128b/130b" in human.stdout


def test_compare_prints_a_column_per_accelerator_and_ratios(tmp_path):
    result = mleng("compare", "h100", "h200", "b200", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = lines[0].split()
    assert header == ["spec", "h100-sxm", "h200-sxm", "h200-sxm/h100-sxm", "b200", "b200/h100-sxm"]
    bf16 = next(line for line in lines if line.startswith("bf16 dense"))
    assert bf16.split()[-5:] == ["989", "989", "1.00", "2250", "2.28"]
    bandwidth = next(line for line in lines if line.startswith("memory bandwidth"))
    assert bandwidth.split()[-5:] == ["3.35", "4.80", "1.43", "8", "2.39"]
    assert "maximum TGP" in result.stdout  # B200's power term differs from H100's TDP


def test_compare_json(tmp_path):
    result = mleng("compare", "h100", "NVIDIA B200", "--json", tmp_path=tmp_path)
    data = json.loads(result.stdout)
    assert data["accelerators"] == ["h100-sxm", "b200"]
    bf16 = next(row for row in data["rows"] if row["field"] == "tflops.bf16")
    assert bf16["ratio_to_first"]["b200"] == pytest.approx(2250 / 989)
    assert bf16["ratio_to_first"]["h100-sxm"] == 1.0


@pytest.mark.parametrize("args,expected", [
    (("show", "h300"), "unknown accelerator or link 'h300'; closest: h200-sxm"),
    (("compare", "h100", "h300"), "unknown accelerator or link 'h300'; closest: h200-sxm"),
    (("compare", "h100"), "at least two"),
    (("compare", "h100", "NVIDIA H100 80GB HBM3"), "same entry"),
    (("list", "--vendor", "acme"), "no vendor 'acme'; known: AMD, AWS, Google, Intel, NVIDIA"),
    (("list", "--kind", "links", "--family", "smoke"), "no link family 'smoke'"),
])
def test_bad_input_gets_one_line_and_exit_2(tmp_path, args, expected):
    result = mleng(*args, tmp_path=tmp_path)
    assert result.returncode == 2
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_list_filters_by_vendor(tmp_path):
    result = mleng("list", "--vendor", "amd", "--json", tmp_path=tmp_path)
    data = json.loads(result.stdout)
    assert data["units"]["tflops"].startswith("dense TFLOPS")
    assert {a["vendor"] for a in data["accelerators"]} == {"AMD"}
    assert "mi300x" in [a["key"] for a in data["accelerators"]]


def test_list_links(tmp_path):
    result = mleng("list", "--kind", "links", tmp_path=tmp_path)
    assert result.returncode == 0
    assert "nvlink-4" in result.stdout and "ib-ndr" in result.stdout and "efa-v4" in result.stdout
    data = json.loads(mleng("list", "--kind", "links", "--json", tmp_path=tmp_path).stdout)
    assert len(data["links"]) >= 30


def test_list_marks_announced_parts(tmp_path):
    result = mleng("list", tmp_path=tmp_path)
    assert result.returncode == 0
    assert "rubin*" in result.stdout and "h200-sxm " in result.stdout
    assert "accelerators; dense TFLOPS (no sparsity)" in result.stdout


def test_specs_list_imports_no_heavy_library(tmp_path):
    result = mleng("list", tmp_path=tmp_path, python_flags=("-X", "importtime"))
    assert result.returncode == 0
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    top_level = {name.split(".")[0] for name in imported}
    assert "mleng.specs.catalog" in imported and "tomllib" in top_level  # the measurement saw the real work
    for heavy in ("torch", "numpy", "matplotlib", "yaml", "pynvml"):
        assert heavy not in top_level, f"`mleng specs list` imported {heavy}"
