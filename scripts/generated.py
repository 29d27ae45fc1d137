"""Shared by the scripts that write a generated file the repository keeps: write it, or (--check) say it is stale."""

from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(path: Path, text: str, root: Path, command: str, check: bool) -> int:
    """With `check`, 1 (and a message naming `command`) when `path` differs from `text`, else 0; without, write it."""
    name = path.relative_to(root)
    if check:
        if (path.read_text() if path.exists() else "") != text:
            print(f"{name} is stale: run {command}", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {name}")
    return 0
