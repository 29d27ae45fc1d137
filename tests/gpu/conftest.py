"""GPU tests: real CUDA, real NVML, the real CLI. Every test here is skipped, with the reason, where CUDA is missing.

Run them on any machine with an NVIDIA GPU: `python -m pytest -q -m gpu tests/gpu`.
Sizes are small (a few hundred MiB, budgets of seconds) so the whole folder takes a few minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def cuda_skip_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when CUDA is usable."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure means no CUDA for us
        return f"GPU tests need torch with CUDA; torch cannot be imported ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        build = f"CUDA build {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"GPU tests need CUDA: torch.cuda.is_available() is False (torch {torch.__version__}, {build})"
    return None


_REASON = cuda_skip_reason()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if _REASON:
            item.add_marker(pytest.mark.skip(reason=_REASON))


@pytest.fixture(scope="session")
def torch_cuda():
    import torch

    torch.cuda.init()
    return torch


@pytest.fixture
def device(torch_cuda):
    """cuda:0 as the current device; the caching allocator emptied afterwards, so the CLI runs in
    subprocesses find the card's memory free."""
    torch_cuda.cuda.set_device(0)
    yield torch_cuda.device("cuda:0")
    torch_cuda.cuda.synchronize()
    torch_cuda.cuda.empty_cache()


@pytest.fixture(scope="session")
def spec(torch_cuda):
    """The mleng.specs entry of the detected GPU, or None where the specs do not know it."""
    from mleng.errors import MlengError
    from mleng.specs import lookup_accelerator

    try:
        return lookup_accelerator(torch_cuda.cuda.get_device_name(0))
    except MlengError:
        return None


@pytest.fixture(scope="session")
def nvml_gpu0(torch_cuda):
    """The NVML record of the GPU torch calls cuda:0, matched by UUID (CUDA_VISIBLE_DEVICES can renumber)."""
    from mleng.machine import nvml

    section = nvml.collect_gpus()
    assert section["available"], f"NVML is not usable on a CUDA machine: {section['reason']}"
    uuid = _torch_uuid(torch_cuda, 0)
    matches = [d for d in section["devices"] if d.get("uuid") == uuid]
    assert matches, f"no NVML device has torch's cuda:0 UUID {uuid}: {[d.get('uuid') for d in section['devices']]}"
    return matches[0]


def _torch_uuid(torch, index: int) -> str:
    text = str(torch.cuda.get_device_properties(index).uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


@pytest.fixture(scope="session")
def uuid0(torch_cuda):
    """cuda:0's UUID as torch reads it, in NVML's spelling (GPU-...)."""
    return _torch_uuid(torch_cuda, 0)
