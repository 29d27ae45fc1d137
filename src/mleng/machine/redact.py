"""Which environment variables the fingerprint captures, and hiding the ones that look like secrets."""

from __future__ import annotations

import os
from typing import Mapping

REDACTED = "<redacted>"

# A name containing any of these (case-insensitive) is treated as a secret, whatever its prefix:
# HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, NCCL_FOO_KEY, TORCH_AUTH_X ...
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH", "COOKIE", "PRIVATE")

# Families of variables that change how distributed training behaves.
CAPTURED_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "SLURM_", "FI_", "UCX_", "PYTORCH_", "GLOO_",
                     "NVIDIA_", "OMPI_", "PMIX_", "MLENG_")

CAPTURED_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                  "GROUP_RANK", "NODE_RANK", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_LIBRARY_PATH",
                  "LD_PRELOAD", "TP_SOCKET_IFNAME", "HF_HOME")


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def is_captured_name(name: str) -> bool:
    return name in CAPTURED_NAMES or name.startswith(CAPTURED_PREFIXES)


def redact(variables: Mapping[str, str]) -> dict[str, str]:
    """The same mapping with every secret-looking value replaced by REDACTED."""
    return {name: (REDACTED if is_secret_name(name) else value) for name, value in variables.items()}


def captured_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that matter for GPU/cluster runs, sorted by name, secrets redacted."""
    environ = os.environ if environ is None else environ
    chosen = {name: environ[name] for name in sorted(environ) if is_captured_name(name)}
    return redact(chosen)
