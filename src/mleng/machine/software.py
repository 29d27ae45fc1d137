"""Versions of the software stack: torch and the CUDA, cuDNN and NCCL it was built with, nvidia-ml-py."""

from __future__ import annotations

import importlib.metadata
from typing import Any


def package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def cudnn_version_string(version: int | None) -> str | None:
    """torch.backends.cudnn.version(): 90100 -> '9.1.0' (cuDNN 9 encoding), 8902 -> '8.9.2' (cuDNN 8)."""
    if not version:
        return None
    if version >= 90000:
        return f"{version // 10000}.{(version % 10000) // 100}.{version % 100}"
    return f"{version // 1000}.{(version % 1000) // 100}.{version % 100}"


def nccl_version_string(version: Any) -> str | None:
    """torch.cuda.nccl.version(): (2, 21, 5) -> '2.21.5'; old torch returned 22105."""
    if version is None:
        return None
    if isinstance(version, (tuple, list)):
        return ".".join(str(part) for part in version)
    number = int(version)
    if number >= 10000:  # NCCL >= 2.9 encodes major*10000 + minor*100 + patch
        return f"{number // 10000}.{(number % 10000) // 100}.{number % 100}"
    return f"{number // 1000}.{(number % 1000) // 100}.{number % 100}"


def torch_versions() -> dict[str, Any]:
    """torch, cuda, cudnn, nccl (None when absent) and the reason for each one that is absent."""
    out: dict[str, Any] = {"torch": None, "torch_git": None, "cuda": None, "hip": None, "cudnn": None,
                           "nccl": None, "distributed_backends": []}
    reasons: dict[str, str] = {}
    try:
        import torch
    except Exception as exc:  # an ImportError, or a broken install raising OSError on a missing .so
        reason = f"torch cannot be imported: {type(exc).__name__}: {exc}"
        for name in ("torch", "cuda", "cudnn", "nccl"):
            reasons[name] = reason
        out["unavailable"] = reasons
        return out
    out["torch"] = torch.__version__
    out["torch_git"] = getattr(torch.version, "git_version", None)
    out["cuda"] = torch.version.cuda
    out["hip"] = getattr(torch.version, "hip", None)
    if out["cuda"] is None:
        reasons["cuda"] = f"torch {torch.__version__} is built without CUDA (torch.version.cuda is None)"
    try:
        out["cudnn"] = cudnn_version_string(torch.backends.cudnn.version())
    except Exception as exc:
        reasons["cudnn"] = f"torch.backends.cudnn.version() failed: {exc}"
    if out["cudnn"] is None and "cudnn" not in reasons:
        reasons["cudnn"] = "torch reports no cuDNN (CPU build or cuDNN not found)"
    try:
        out["nccl"] = nccl_version_string(torch.cuda.nccl.version())
    except Exception as exc:
        reasons["nccl"] = f"torch has no NCCL ({type(exc).__name__}: {exc})"
    try:
        import torch.distributed as dist

        if dist.is_available():
            out["distributed_backends"] = [name for name, probe in (
                ("gloo", dist.is_gloo_available), ("nccl", dist.is_nccl_available),
                ("mpi", dist.is_mpi_available), ("ucc", getattr(dist, "is_ucc_available", lambda: False)),
            ) if probe()]
    except Exception as exc:
        reasons["distributed_backends"] = f"torch.distributed unusable: {exc}"
    out["unavailable"] = reasons
    return out


def software_info(torch: bool = True) -> dict[str, Any]:
    """The 'software' section; with torch=False only the installed torch version (no import, no CUDA libs)."""
    if torch:
        out = torch_versions()
    else:
        reason = "not read (collect(torch_versions=False)); torch was not imported"
        out = {"torch": package_version("torch"), "torch_git": None, "cuda": None, "hip": None, "cudnn": None,
               "nccl": None, "distributed_backends": [],
               "unavailable": {"cuda": reason, "cudnn": reason, "nccl": reason}}
        if out["torch"] is None:
            out["unavailable"]["torch"] = "torch is not installed"
    out["nvidia_ml_py"] = package_version("nvidia-ml-py")
    if out["nvidia_ml_py"] is None:
        out["unavailable"]["nvidia_ml_py"] = "nvidia-ml-py is not installed"
    # filled in from NVML by collect(); None with a reason when there is no driver
    out["driver"] = None
    out["cuda_driver"] = None
    return out
