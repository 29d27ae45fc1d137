"""The one dtype table: the names users type (bf16, fp32, half, fp8) and the torch names they mean."""

from __future__ import annotations

from typing import Sequence

from mleng.errors import UsageError

# alias -> torch dtype name. Every command accepts these; each says which of the names it measures.
ALIASES = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
    "fp64": "float64", "double": "float64",
    "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8_e4m3fn": "float8_e4m3fn", "fp8_e4m3fnuz": "float8_e4m3fnuz",
}

# What mleng comm moves and reduces: uint8 and the fp8 kinds are left out (gloo cannot reduce them, and the
# --check patterns are signed).
COLLECTIVE_DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "int8")


def torch_name(text: str) -> str:
    """The torch name a user's dtype spelling means ('bf16', 'torch.bfloat16', 'BFloat16' -> 'bfloat16')."""
    key = str(text).strip().lower().replace("torch.", "")
    return ALIASES.get(key, key)


def canonical(text: str, allowed: Sequence[str]) -> str:
    """The torch name of `text` (see torch_name), if `allowed` holds it."""
    key = torch_name(text)
    if key not in allowed:
        raise UsageError(f"unknown dtype {text!r}", hint=f"use one of: {', '.join(allowed)}")
    return key
