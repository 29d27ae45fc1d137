"""`mleng env` as a real subprocess: the summary, --json, --from a fingerprint file (modelled or recorded), redaction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mleng.machine.fingerprint import TOP_LEVEL_KEYS

FIXTURES = Path(__file__).parent / "fixtures" / "fingerprints"
MLENG = [sys.executable, "-m", "mleng"]

SECRETS = {
    "HF_TOKEN": "supersecret-hf-7f3a",
    "WANDB_API_KEY": "supersecret-wandb-91c2",
    "AWS_SECRET_ACCESS_KEY": "supersecret-aws-0d8e",
    "NCCL_FOO_KEY": "supersecret-nccl-55b1",
    "TORCH_AUTH_X": "supersecret-torch-c4d9",
    "SLURM_JOB_PASSWORD": "supersecret-slurm-2e6f",
    "CUDA_PRIVATE_THING": "supersecret-cuda-a1b2",
}


def run_mleng(args: list[str], tmp_path: Path, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, MLENG_HOME=str(tmp_path / "home"), **(extra_env or {}))
    return subprocess.run(MLENG + args, capture_output=True, text=True, env=env, timeout=180)


@pytest.fixture(scope="module")
def secret_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("env")
    extra = dict(SECRETS, NCCL_IB_HCA="mlx5_0,mlx5_1", NCCL_DEBUG="INFO", MASTER_PORT="29500")
    return run_mleng(["env", "--json"], tmp, extra), run_mleng(["env"], tmp, extra)


def test_env_json_is_the_whole_fingerprint(secret_runs):
    as_json, _ = secret_runs
    assert as_json.returncode == 0, as_json.stderr
    fp = json.loads(as_json.stdout)
    assert tuple(fp) == TOP_LEVEL_KEYS
    assert fp["gpus"]["available"] is False
    assert fp["gpus"]["reason"] == "NVML Shared Library Not Found (no NVIDIA driver on this machine)"
    assert fp["env"]["NCCL_IB_HCA"] == "mlx5_0,mlx5_1" and fp["env"]["MASTER_PORT"] == "29500"
    for name in ("NCCL_FOO_KEY", "TORCH_AUTH_X", "SLURM_JOB_PASSWORD", "CUDA_PRIVATE_THING"):
        assert fp["env"][name] == "<redacted>"


def test_no_secret_value_appears_anywhere_in_the_output(secret_runs):
    for result in secret_runs:
        assert result.returncode == 0, result.stderr
        for value in SECRETS.values():
            assert value not in result.stdout
            assert value not in result.stderr
            assert "supersecret" not in result.stdout


def test_env_summary_has_every_section(secret_runs):
    _, human = secret_runs
    text = human.stdout
    for heading in ("host\n", "software\n", "gpus: not available: NVML Shared Library Not Found", "\nnuma",
                    "network interfaces", "infiniband", "limits\n", "memlock (ulimit -l)", "nofile (ulimit -n)",
                    "/dev/shm", "env ("):
        assert heading in text, heading
    assert "NCCL_IB_HCA=mlx5_0,mlx5_1" in text and "NCCL_FOO_KEY=<redacted>" in text
    assert "Traceback" not in human.stderr


def test_env_from_a_modelled_h200_fingerprint(tmp_path):
    result = run_mleng(["env", "--from", str(FIXTURES / "h200_throttled.json")], tmp_path)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "gpus: 8 x NVIDIA H200, driver 580.159.04, CUDA driver 13.0" in text
    gpu_rows = [line for line in text.splitlines() if "/140.4 GiB" in line]
    assert len(gpu_rows) == 8
    assert "1100/1980" in gpu_rows[5] and "hw_slowdown,sw_thermal_slowdown" in gpu_rows[5]
    assert "mlx5_7     1  ACTIVE  LinkUp          400.0  InfiniBand  ib7" in text
    assert "memlock (ulimit -l)  soft unlimited" in text


def test_env_from_json_round_trips(tmp_path):
    path = FIXTURES / "h200_bad_ifname.json"
    result = run_mleng(["env", "--from", str(path), "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    on_file = json.loads(path.read_text())
    assert on_file.pop("_provenance").startswith("modelled")  # an annotation of the file, not of the machine
    assert json.loads(result.stdout) == on_file


def test_env_from_a_measurement_record_uses_its_machine(tmp_path):
    record = {"schema": "mleng.measurement/1", "id": "x", "kind": "mamf",
              "machine": json.loads((FIXTURES / "h200_pcie_downtrained.json").read_text())}
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    result = run_mleng(["env", "--from", str(path)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Gen4x8/Gen5x16" in result.stdout


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("{not json", "is not valid JSON"),
    ('{"kind": "mamf"}', "is not an mleng fingerprint"),
])
def test_env_from_a_bad_file_is_one_clear_error(tmp_path, content, message):
    path = tmp_path / "fp.json"
    if content is not None:
        path.write_text(content)
    result = run_mleng(["env", "--from", str(path)], tmp_path)
    assert result.returncode == 2
    assert message in result.stderr and str(path) in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_env_without_gpus_and_torch(tmp_path):
    result = run_mleng(["env", "--no-gpus", "--no-torch", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    fp = json.loads(result.stdout)
    assert fp["gpus"]["reason"] == "not collected (gpus=False)"
    assert "torch_versions=False" in fp["software"]["unavailable"]["nccl"]
