"""The matplotlib figures of the measurements (`mleng comm --plot`), drawn off screen."""

from __future__ import annotations

from mleng.errors import UsageError
from mleng.measure.sizes import format_bytes


def pyplot():
    """matplotlib.pyplot on the Agg backend, or a UsageError: called before a run that will plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib, which is not installed",
                         hint="pip install matplotlib (or mleng[plot]), or drop --plot") from None
    return plt


def plot_busbw(rows: list[dict], path: str, reference_gbps: float | None, reference_note: str) -> None:
    """`mleng comm`: busbw against size, one line per op, the reference rate dashed where there is one."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op and "busbw_gbps" in r]
        ax.plot([r["size_bytes"] for r in mine], [r["busbw_gbps"] for r in mine], marker="o", label=op)
    if reference_gbps:
        ax.axhline(reference_gbps, linestyle="--", color="gray", label=f"reference {reference_gbps:g} GB/s")
    ax.set_xscale("log", base=2)
    sizes = sorted({r["size_bytes"] for r in rows})
    ax.set_xticks(sizes)
    ax.set_xticklabels([format_bytes(s) for s in sizes], rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("size per rank (binary prefixes)")
    ax.set_ylabel("busbw (GB/s, base 10)")
    ax.set_title("mleng comm" + ("" if reference_gbps else f" ({reference_note})"), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UsageError(f"cannot write the plot to {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)
