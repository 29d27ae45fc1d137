"""Small SVG charts: a line chart (log or linear x), a bar chart and a time series."""

from __future__ import annotations

import html
import math
from typing import Sequence

WIDTH, HEIGHT = 720, 340
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 70, 20, 30, 70
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    exponent = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * exponent:
            return step * exponent
    return 10 * exponent


def _frame(title: str, y_label: str, x_label: str, y_max: float, body: list[str], x_ticks: list[str]) -> str:
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{_esc(title)}" class="chart">',
             f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
             f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="14" font-weight="bold">{_esc(title)}</text>']
    for i in range(6):
        value = y_max * i / 5
        y = MARGIN_TOP + plot_h - plot_h * i / 5
        parts.append(f'<line x1="{MARGIN_LEFT}" y1="{y:.1f}" x2="{WIDTH - MARGIN_RIGHT}" y2="{y:.1f}" '
                     f'stroke="#e0e0e0"/>')
        parts.append(f'<text x="{MARGIN_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{value:.4g}</text>')
    parts.append(f'<text x="16" y="{MARGIN_TOP + plot_h / 2}" font-size="12" text-anchor="middle" '
                 f'transform="rotate(-90 16 {MARGIN_TOP + plot_h / 2})">{_esc(y_label)}</text>')
    parts.append(f'<text x="{MARGIN_LEFT + plot_w / 2}" y="{HEIGHT - 8}" font-size="12" '
                 f'text-anchor="middle">{_esc(x_label)}</text>')
    parts.append(f'<rect x="{MARGIN_LEFT}" y="{MARGIN_TOP}" width="{plot_w}" height="{plot_h}" fill="none" '
                 f'stroke="#888"/>')
    parts.extend(x_ticks)
    parts.extend(body)
    parts.append("</svg>")
    return "\n".join(parts)


def line_chart(title: str, series: dict[str, Sequence[tuple[float, float]]], x_label: str, y_label: str,
               log_x: bool = False, reference: tuple[float, str] | None = None,
               x_format=lambda v: f"{v:.4g}") -> str:
    points = [p for values in series.values() for p in values]
    if not points:
        return ""
    xs = [math.log2(x) if log_x else x for x, _ in points]
    x_min, x_max = min(xs), max(xs)
    if x_max == x_min:
        x_max = x_min + 1
    y_max = _nice_max(max([y for _, y in points] + ([reference[0]] if reference else [])) * 1.05)
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM

    def sx(x: float) -> float:
        value = math.log2(x) if log_x else x
        return MARGIN_LEFT + (value - x_min) / (x_max - x_min) * plot_w

    def sy(y: float) -> float:
        return MARGIN_TOP + plot_h - y / y_max * plot_h

    body = []
    if reference:
        y = sy(reference[0])
        body.append(f'<line x1="{MARGIN_LEFT}" y1="{y:.1f}" x2="{WIDTH - MARGIN_RIGHT}" y2="{y:.1f}" '
                    f'stroke="#d62728" stroke-dasharray="6 4"/>')
        body.append(f'<text x="{WIDTH - MARGIN_RIGHT - 4}" y="{y - 5:.1f}" text-anchor="end" font-size="11" '
                    f'fill="#d62728">{_esc(reference[1])}</text>')
    for i, (name, values) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        ordered = sorted(values)
        path = " ".join(f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(ordered))
        body.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        body.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"><title>{_esc(name)}: '
                    f'{x_format(x)} -> {y:.4g}</title></circle>' for x, y in ordered)
        body.append(f'<rect x="{MARGIN_LEFT + 10}" y="{MARGIN_TOP + 8 + i * 16}" width="10" height="10" fill="{color}"/>')
        body.append(f'<text x="{MARGIN_LEFT + 24}" y="{MARGIN_TOP + 17 + i * 16}" font-size="11">{_esc(name)}</text>')
    tick_values = sorted({x for x, _ in points})
    if len(tick_values) > 10:
        stride = math.ceil(len(tick_values) / 10)
        tick_values = tick_values[::stride]
    ticks = [f'<text x="{sx(x):.1f}" y="{HEIGHT - MARGIN_BOTTOM + 16}" text-anchor="middle" font-size="10">'
             f'{_esc(x_format(x))}</text>' for x in tick_values]
    return _frame(title, y_label, x_label, y_max, body, ticks)


def bar_chart(title: str, bars: Sequence[tuple[str, float]], y_label: str,
              reference: tuple[float, str] | None = None, highlight: set[str] | None = None,
              highlight_label: str = "") -> str:
    if not bars:
        return ""
    y_max = _nice_max(max([v for _, v in bars] + ([reference[0]] if reference else [])) * 1.05)
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
    slot = plot_w / len(bars)
    body, ticks = [], []
    for i, (label, value) in enumerate(bars):
        height = value / y_max * plot_h
        x = MARGIN_LEFT + i * slot + slot * 0.15
        marked = highlight and label in highlight
        color = "#d62728" if marked else "#1f77b4"
        body.append(f'<rect x="{x:.1f}" y="{MARGIN_TOP + plot_h - height:.1f}" width="{slot * 0.7:.1f}" '
                    f'height="{height:.1f}" fill="{color}"><title>{_esc(label)}: {value:.4g}</title></rect>')
        if marked and highlight_label:
            body.append(f'<text x="{x + slot * 0.35:.1f}" y="{MARGIN_TOP + plot_h - height - 4:.1f}" '
                        f'text-anchor="middle" font-size="10" fill="#d62728">{_esc(highlight_label)}</text>')
        cx = MARGIN_LEFT + i * slot + slot / 2
        ticks.append(f'<text x="{cx:.1f}" y="{HEIGHT - MARGIN_BOTTOM + 12}" font-size="9" text-anchor="end" '
                     f'transform="rotate(-35 {cx:.1f} {HEIGHT - MARGIN_BOTTOM + 12})">{_esc(label)}</text>')
    if reference:
        y = MARGIN_TOP + plot_h - reference[0] / y_max * plot_h
        body.append(f'<line x1="{MARGIN_LEFT}" y1="{y:.1f}" x2="{WIDTH - MARGIN_RIGHT}" y2="{y:.1f}" '
                    f'stroke="#d62728" stroke-dasharray="6 4"/>')
        body.append(f'<text x="{WIDTH - MARGIN_RIGHT - 4}" y="{y - 5:.1f}" text-anchor="end" font-size="11" '
                    f'fill="#d62728">{_esc(reference[1])}</text>')
    return _frame(title, y_label, "", y_max, body, ticks)
