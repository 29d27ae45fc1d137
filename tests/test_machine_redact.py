"""Secret-looking environment variables never leave the machine in a fingerprint."""

from __future__ import annotations

from mleng.machine import redact
from mleng.machine.fingerprint import collect


def test_secret_names_by_word_case_insensitive():
    for name in ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "NCCL_FOO_KEY", "TORCH_AUTH_X",
                 "DB_PASSWORD", "FTP_PASSWD", "GOOGLE_APPLICATION_CREDENTIALS", "SESSION_COOKIE",
                 "SSH_PRIVATE", "slurm_job_token", "Cuda_Api_Key"):
        assert redact.is_secret_name(name), name
    for name in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "MASTER_ADDR",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTORCH_CUDA_ALLOC_CONF"):
        assert not redact.is_secret_name(name), name


def test_redact_replaces_only_secret_values():
    out = redact.redact({"NCCL_IB_HCA": "mlx5_0", "NCCL_FOO_KEY": "k1", "TORCH_AUTH_X": "a1"})
    assert out == {"NCCL_IB_HCA": "mlx5_0", "NCCL_FOO_KEY": redact.REDACTED, "TORCH_AUTH_X": redact.REDACTED}


def test_captured_env_picks_the_families_and_redacts_within_them():
    environ = {
        "NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_FOO_KEY": "nccl-secret",
        "TORCH_AUTH_X": "torch-secret", "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_ID": "42",
        "SLURM_JOB_TOKEN": "slurm-secret", "FI_PROVIDER": "efa", "UCX_TLS": "rc", "MASTER_ADDR": "node1",
        "MASTER_PORT": "29500", "WORLD_SIZE": "16", "RANK": "3", "LOCAL_RANK": "3", "OMP_NUM_THREADS": "8",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:True",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
        "HF_TOKEN": "hf-secret", "HOME": "/root", "PATH": "/usr/bin", "RANKING": "not ours",
    }
    env = redact.captured_env(environ)
    assert list(env) == sorted(env)
    assert "HOME" not in env and "PATH" not in env and "HF_TOKEN" not in env and "RANKING" not in env
    assert env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1" and env["NCCL_DEBUG"] == "INFO"
    assert env["NCCL_FOO_KEY"] == env["TORCH_AUTH_X"] == env["SLURM_JOB_TOKEN"] == redact.REDACTED
    for name in ("FI_PROVIDER", "UCX_TLS", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                 "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "LD_LIBRARY_PATH",
                 "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID"):
        assert env[name] == environ[name]
    assert not {"nccl-secret", "torch-secret", "slurm-secret", "hf-secret"} & set(env.values())


def test_collect_redacts_the_real_environment(monkeypatch):
    monkeypatch.setenv("NCCL_IB_PKEY_SECRET_TEST", "in-process-secret")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    fp = collect(gpus=False, torch_versions=False)
    assert fp["env"]["NCCL_IB_PKEY_SECRET_TEST"] == redact.REDACTED
    assert fp["env"]["NCCL_DEBUG"] == "WARN"
    assert "in-process-secret" not in repr(fp)
