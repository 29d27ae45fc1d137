"""Rendering for the CLI: JSON, aligned tables, a progress line on stderr."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence  # not typing: it costs every command ~10 ms to import


def print_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def emit(args, value: object, render: Callable[[object], str]) -> None:
    """A command's result on stdout: the value as JSON under --json, else its rendering."""
    if args.json:
        print_json(value)
    else:
        print(render(value))


def format_cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0:
            return "0"
        magnitude = abs(value)
        if magnitude >= 1000:
            return f"{value:.0f}"
        if magnitude >= 100:
            return f"{value:.1f}"
        if magnitude >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def table(rows: Iterable[dict[str, object]], columns: Sequence[str],
          headers: Sequence[str] | None = None) -> str:
    """An aligned plain-text table; numbers right-aligned, text left-aligned."""
    headers = list(headers or columns)
    cells = [[format_cell(row.get(c)) for c in columns] for row in rows]
    numeric = [all(_is_number(row.get(c)) for row in rows if row.get(c) is not None)
               for c in columns] if cells else [False] * len(columns)
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Progress:
    """A one-line progress display on stderr, shown only on a terminal."""

    def __init__(self, total: float | None, label: str = "", stream=None, enabled: bool | None = None):
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.started = time.monotonic()
        self._last = 0.0

    def update(self, done: float, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and (self.total is None or done < self.total):
            return
        self._last = now
        if self.total:
            fraction = min(max(done / self.total, 0.0), 1.0)
            bar = "#" * int(fraction * 30)
            text = f"\r{self.label} [{bar:<30}] {fraction * 100:5.1f}% {note}"
        else:
            text = f"\r{self.label} {now - self.started:6.1f}s {note}"
        self.stream.write(text[:200].ljust(100))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
