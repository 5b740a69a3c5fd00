"""Heatmaps as pictures (matplotlib is an optional extra: `pip install matplotlib`)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from ..errors import UsageError
from ..io.files import check_output_path, write_file

# Grids up to this many cells get their values written in them.
ANNOTATE_MAX_CELLS = 400


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib (or pip install 'headtool[plot]')") from None
    return plt


def plot_heatmap(matrix: Sequence[Sequence[float]], path: str, *, title: str, colorbar_label: str = "importance",
                 row_label: str = "layer", col_label: str = "query head", marked: Sequence[Sequence[int]] = ()) -> str:
    """Save a layers x heads heatmap to `path` (format from the suffix; ragged rows shown blank).

    `marked` cells ([layer, head]) get a cross, e.g. the heads an iterative run removed.
    Written to a temporary file beside `path` and renamed, so a failed run leaves no half file.
    """
    plt = _pyplot()
    import numpy as np

    target = check_plot_file(path)
    rows, cols = len(matrix), max((len(r) for r in matrix), default=0)
    grid = np.full((rows, cols), np.nan)
    for i, r in enumerate(matrix):
        grid[i, : len(r)] = r
    fig_w = min(4.0 + 0.55 * cols, 24.0)
    fig_h = min(2.0 + 0.32 * rows, 30.0)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=110)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#dddddd")
    im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, interpolation="nearest")
    cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
    cb.set_label(colorbar_label, fontsize=9)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(col_label)
    ax.set_ylabel(row_label)
    ax.set_xticks(range(cols))
    ax.set_yticks(range(rows) if rows <= 48 else range(0, rows, max(1, rows // 24)))
    finite = grid[np.isfinite(grid)]
    if rows * cols <= ANNOTATE_MAX_CELLS and finite.size:
        lo, hi = float(finite.min()), float(finite.max())
        mid = (lo + hi) / 2
        fs = 8 if cols <= 12 else 6
        for i in range(rows):
            for j in range(len(matrix[i])):
                v = grid[i, j]
                ax.text(j, i, _fmt(v), ha="center", va="center", fontsize=fs,
                        color="black" if v > mid else "white")
    for i, j in marked:
        ax.plot([j], [i], marker="x", color="red", markersize=7, mew=1.5)
    fig.tight_layout()
    try:
        write_file(target, lambda name: fig.savefig(name, format=target.suffix[1:].lower()), suffix=target.suffix)
    finally:
        plt.close(fig)
    return str(target)


def check_plot_file(path: str, inputs: Sequence[str | None] = ()) -> Path:
    """A --plot picture's path, or a UsageError before any work: a picture suffix matplotlib writes,
    in a folder that exists, not inside an input (io.files.check_output_path)."""
    target = check_output_path(path, "--plot", inputs)
    formats = _pyplot().figure().canvas.get_supported_filetypes()
    _pyplot().close("all")
    if target.suffix[1:].lower() not in formats:
        raise UsageError(f"--plot {path}: give a file name with a picture suffix ({', '.join(sorted(formats))}), "
                         f"e.g. {target.with_suffix('.png')}")
    return target


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return ""
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 100 or a < 0.01:
        return f"{v:.1e}"
    return f"{v:.2f}"
