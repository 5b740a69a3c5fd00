"""Rich tables and heatmaps for people (always rendered to stderr by the CLI)."""
from __future__ import annotations

from typing import Any, Sequence

from rich.table import Table
from rich.text import Text


def human_int(n: int | float) -> str:
    n = float(n)
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def human_bytes(n: int | float) -> str:
    n = float(n)
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt_list(v: Any) -> str:
    if isinstance(v, list):
        lo, hi = min(v), max(v)
        return f"{lo}..{hi} (per layer)" if lo != hi else str(lo)
    return str(v)


def info_table(ref: str, f: dict[str, Any]) -> Table:
    t = Table(title=f"headtool info: {ref}", show_header=False, title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value")
    rows = [
        ("family", f"{f['family']} ({f['model_type']}, {f['architecture']})"),
        ("layers", str(f["num_layers"])),
        ("query heads", _fmt_list(f["num_heads"]) + f"  (total {f['total_heads']})"),
        ("KV heads", _fmt_list(f["num_kv_heads"]) + f"  (total {f['total_kv_heads']})"),
        ("head_dim", _fmt_list(f["head_dim"])),
        ("hidden size", str(f["hidden_size"])),
        ("parameters", f"{human_int(f['params'])} ({f['params']:,})"),
        ("attention parameters", f"{human_int(f['attention_params'])} "
                                 f"({100 * f['attention_params'] / max(f['params'], 1):.1f}%)"),
        ("dtype", f["dtype"]),
        ("KV cache per token", f"{human_bytes(f['kv_cache_bytes_per_token'])} "
                               f"({f['kv_cache_bytes_per_token']:,} B)"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def eval_table(result: dict[str, Any]) -> Table:
    res = result["results"]
    metric = next(m for m in ("perplexity", "accuracy", "embedding_cosine") if m in res[0])
    d = result["data"]
    t = Table(title=f"headtool eval ({result['objective']}, {d.get('samples')} samples, "
                    f"{d.get('tokens')} tokens of {d.get('source')})", title_justify="left")
    loss_name = "nMSE vs first" if metric == "embedding_cosine" else "loss"
    for col in ("model", loss_name, "Δ", metric, "ratio", "params", "heads", "KV/token"):
        t.add_column(col, justify="left" if col == "model" else "right")
    base = res[0]
    for r in res:
        dl = r["loss"] - base["loss"]
        ratio = (r[metric] / base[metric]) if base.get(metric) else float("nan")
        t.add_row(
            r["model"], f"{r['loss']:.4f}", "" if r is base else f"{dl:+.4f}",
            f"{100 * r[metric]:.2f}%" if metric == "accuracy" else f"{r[metric]:.4f}",
            "" if r is base else f"{ratio:.3f}x", human_int(r["params"]),
            f"{r['total_heads']}/{r['total_kv_heads']}", human_bytes(r["kv_cache_bytes_per_token"]),
        )
    return t


def heat_color(x: float) -> str:
    """Blue (low) -> yellow -> red (high) for x in [0, 1]."""
    x = min(max(x, 0.0), 1.0)
    if x < 0.5:
        a = x / 0.5
        r, g, b = int(40 + 215 * a), int(60 + 180 * a), int(160 - 120 * a)
    else:
        a = (x - 0.5) / 0.5
        r, g, b = 255, int(240 - 190 * a), int(40 - 20 * a)
    return f"rgb({r},{g},{b})"


def heatmap_table(title: str, matrix: Sequence[Sequence[float]], fmt: str = "{:.2f}",
                  row_label: str = "layer", col_label: str = "h") -> Table:
    """A layers x heads table of coloured cells with their values (ragged rows allowed)."""
    flat = [v for row in matrix for v in row]
    lo, hi = (min(flat), max(flat)) if flat else (0.0, 1.0)
    span = (hi - lo) or 1.0
    width = max((len(r) for r in matrix), default=0)
    t = Table(title=title, title_justify="left", padding=(0, 0), show_edge=False)
    t.add_column(row_label, justify="right", style="bold")
    for j in range(width):
        t.add_column(f"{col_label}{j}", justify="right")
    for i, row in enumerate(matrix):
        cells = []
        for v in row:
            c = heat_color((v - lo) / span)
            cells.append(Text(" " + fmt.format(v) + " ", style=f"black on {c}"))
        cells += [Text("")] * (width - len(row))
        t.add_row(str(i), *cells)
    return t
