"""Byte sizes as users type them and as every table shows them: the one size rule of mleng.

IEC suffixes are powers of two (KiB, MiB, GiB, TiB), SI suffixes powers of ten (KB, MB, GB, TB), and a
bare K/M/G/T is a power of two, as in nccl-tests' `-b 1G`. Output uses binary prefixes.
"""

from __future__ import annotations

import re

from mleng.errors import UsageError

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kb": 10**3, "kib": 2**10,
    "m": 2**20, "mb": 10**6, "mib": 2**20,
    "g": 2**30, "gb": 10**9, "gib": 2**30,
    "t": 2**40, "tb": 10**12, "tib": 2**40,
}
GIB = 2**30  # the one constant for "/ GIB" arithmetic in estimates and messages

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from '64MiB', '4GiB', '1G' (a bare K/M/G/T is binary, KB/MB/GB/TB decimal); `what` names the flag."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise UsageError(f"{what} {text!r} is not a size",
                             hint="write it like 64MiB, 4GiB, 1G or a plain number of bytes")
        exact = float(match.group(1)) * _UNITS[unit]
        if exact != int(exact):
            raise UsageError(f"{what} {text!r} is not a whole number of bytes ({exact:g})",
                             hint="write it like 64MiB, 4GiB, 1G or a plain number of bytes")
        value = int(exact)
    if value <= 0:
        raise UsageError(f"{what} must be more than 0 bytes (got {text!r})")
    return value


def format_bytes(n: float | None) -> str:
    """Binary prefixes for display: 4 GiB, 1.5 GiB, 512 MiB, 4 KiB; '-' for a missing value."""
    if n is None or isinstance(n, bool) or not isinstance(n, (int, float)):
        return "-" if n is None else str(n)
    n = float(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


def format_gib(n: float | None, digits: int = 2) -> str:
    """Fixed GiB for columns and messages that compare sizes side by side (12.34 GiB); '-' for a missing value."""
    return "-" if n is None else f"{n / GIB:.{digits}f} GiB"


def size_sweep(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """min_bytes, min_bytes x factor, ... up to max_bytes (nccl-tests' -b/-e/-f)."""
    if min_bytes > max_bytes:
        raise UsageError(f"--min-bytes {format_bytes(min_bytes)} is above --max-bytes {format_bytes(max_bytes)}")
    if min_bytes < max_bytes and factor <= 1:
        raise UsageError(f"--factor {factor:g} must be above 1 to step from min to max bytes")
    sizes, size = [], float(min_bytes)
    while size <= max_bytes * (1 + 1e-9):
        sizes.append(int(size))
        if factor <= 1:
            break
        size *= factor
    return sizes
