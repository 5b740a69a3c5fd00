"""Heatmaps as pictures (matplotlib is an optional extra: `pip install matplotlib`)."""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Sequence

from ..errors import UsageError

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

    target = Path(path)
    if not target.suffix:
        raise UsageError(f"--plot {path}: give a file name with a picture suffix, e.g. {path}.png")
    if not target.parent.exists():
        raise UsageError(f"--plot {path}: folder {target.parent} does not exist")
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
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        fig.savefig(tmp)
        os.replace(tmp, target)
    except ValueError as e:  # unknown picture format
        os.unlink(tmp)
        raise UsageError(f"--plot {path}: {str(e).splitlines()[0]}") from None
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        plt.close(fig)
    return str(target)


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return ""
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 100 or a < 0.01:
        return f"{v:.1e}"
    return f"{v:.2f}"
