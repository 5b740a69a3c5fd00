"""Rich tables and heatmaps for people (always rendered to stderr by the CLI)."""
from __future__ import annotations

from fractions import Fraction
from typing import Any, Sequence

from rich import table as _rich_table
from rich.text import Text


class Table(_rich_table.Table):
    """rich's Table, whose cells fold onto more lines where the console is too narrow for them (COLUMNS=40)
    instead of ending in '…': a figure cut to '7…' hides its value."""

    def add_column(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("overflow", "fold")
        super().add_column(*args, **kwargs)


def human_int(n: int | float) -> str:
    n = float(n)
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def human_bytes(n: int | float | None) -> str:
    """Bytes in KiB/MiB/GiB; None (a figure that does not apply, e.g. an encoder's KV cache) as n/a."""
    if n is None:
        return "n/a"
    n = float(n)
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def exact_bytes(n: int) -> str:
    """human_bytes with the exact count beside it where it rounds ('1.5 KiB (1,536 B)', but '384 B')."""
    return human_bytes(n) + (f" ({n:,} B)" if abs(n) >= 1024 else "")


def fraction_text(x: float) -> str:
    """A fraction as typed: '0.5' as 0.5, a ratio such as 1/3 (stored as 0.333...) as '1/3' rather than
    the '0.333333' that :g gives; anything else as :g."""
    if float(f"{x:g}") == x:
        return f"{x:g}"
    ratio = Fraction(x).limit_denominator(1000)
    return f"{ratio.numerator}/{ratio.denominator}" if float(ratio) == x else f"{x:g}"


def value_range(v: Any) -> str:
    """One value, or a per-layer list as `lo..hi` (a list of equal values as that value)."""
    if isinstance(v, list):
        lo, hi = min(v), max(v)
        return str(lo) if lo == hi else f"{lo}..{hi}"
    return str(v)


def _fmt_list(v: Any, every: bool = False) -> str:
    """One value, or a per-layer range (`every`: each layer's value)."""
    if not isinstance(v, list) or min(v) == max(v):
        return value_range(v)
    return f"{', '.join(map(str, v))} (per layer)" if every else f"{value_range(v)} (per layer)"


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
        ("KV cache per token", kv_cell(f)),
    ]
    if window_cell(f):
        rows.append(("KV cache, sliding window", window_cell(f)))
    if f.get("kv_group_sizes"):  # prune --unit head
        uneven = f["kv_group_sizes"]
        rows.insert(4, ("KV groups", "query heads per KV head differ in "
                        + ", ".join(f"layer {i} ({'+'.join(map(str, s))})" for i, s in uneven.items())))
    if "kv_rank" in f:  # convert-mla output: the cache holds a latent, not the source's KV heads
        rows[3] = ("latent attention", f"kv_rank {_fmt_list(f['kv_rank'], every=True)} + shared rotary key "
                                       f"{f['rope_dim']} dims per token and layer (replaces "
                                       f"{_fmt_list(f['source_num_kv_heads'])} KV heads)")
    for k, v in rows:
        t.add_row(k, v)
    return t


def kv_cell(f: dict[str, Any]) -> str:
    """The info table's KV-cache figure."""
    per_token = f["kv_cache_bytes_per_token"]
    if per_token is None:
        return "n/a (an encoder keeps no KV cache)"
    windows = f.get("kv_cache_window_per_layer") or []
    if windows and all(w is not None for w in windows):
        return "0 B once the context fills the windows: every layer's cache is bounded by its sliding window"
    text = exact_bytes(per_token)
    if any(w is not None for w in windows):
        n = sum(w is None for w in windows)
        text += f" in the {n} global layer{'s' if n > 1 else ''} (the sliding-window layers apart)"
    return text


def window_cell(f: dict[str, Any]) -> str | None:
    """The sliding-window layers' bounded cache (None for a model without them)."""
    windows = f.get("kv_cache_window_per_layer") or []
    sliding = [w for w in windows if w is not None]
    if not sliding:
        return None
    size = value_range(sliding)
    return (f"{len(sliding)} of {len(windows)} layers, window {size} tokens: at most "
            f"{exact_bytes(f['kv_cache_window_bytes'])} in all, whatever "
            "the context")


def eval_table(result: dict[str, Any]) -> Table:
    res = result["results"]
    metric = next(m for m in ("perplexity", "accuracy", "embedding_cosine") if m in res[0])
    d = result["data"]
    after = f", after its first {d['skip_samples']}" if d.get("skip_samples") else ""
    t = Table(title=f"headtool eval ({result['objective']}, {d.get('samples')} samples, "
                    f"{d.get('tokens')} tokens of {d.get('source')}{after})", title_justify="left")
    loss_name = "nMSE vs first" if metric == "embedding_cosine" else "loss"
    for col in ("model", loss_name, "Δ", metric, "ratio", "params", "heads", "KV/token"):
        t.add_column(col, justify="left" if col == "model" else "right")
    base = res[0]
    captions = []
    if any("loss_delta_se" in r for r in res):
        captions.append(f"Δ ± one standard error over the {d.get('samples')} blocks, paired with the first model: "
                        "how far other blocks of the same text could move the gap")
    if any(r.get("in_domain") for r in res):
        fitted = "; ".join(_fitted(r) for r in res if r.get("in_domain"))
        captions.append(f"* fitted on {d.get('source')}'s domain ({fitted}): in-domain figures flatter")
    if captions:
        t.caption = "\n".join(captions)
        t.caption_justify = "left"
    for r in res:
        dl = r["loss"] - base["loss"]
        ratio = (r[metric] / base[metric]) if base.get(metric) else float("nan")
        se = f" ± {r['loss_delta_se']:.4f}" if "loss_delta_se" in r else ""
        t.add_row(
            r["model"] + (" *" if r.get("in_domain") else ""), f"{r['loss']:.4f}",
            "" if r is base else f"{dl:+.4f}{se}",
            f"{100 * r[metric]:.2f}%" if metric == "accuracy" else f"{r[metric]:.4f}",
            "" if r is base else f"{ratio:.3f}x", human_int(r["params"]),
            heads_cell(r),
            human_bytes(r["kv_cache_bytes_per_token"]),
        )
    return t


def _fitted(r: dict[str, Any]) -> str:
    return f"{r['model']}: {', '.join(r.get('fitted_on') or [])}"


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
                  row_label: str = "layer", col_label: str = "h") -> "Heatmap":
    """A layers x heads table of coloured cells with their values (ragged rows allowed)."""
    return Heatmap(title, matrix, fmt, row_label, col_label)


class Heatmap:
    """A layers x heads heatmap that fits the console by showing the heads in slices, one table each,
    every slice with the layer column: squeezed into one table, a model of 32 heads in 120 columns
    (or 9 in 40) had every value cut to '0…'."""

    def __init__(self, title: str, matrix: Sequence[Sequence[float]], fmt: str, row_label: str, col_label: str):
        self.title, self.fmt, self.row_label, self.col_label = title, fmt, row_label, col_label
        self.matrix = [list(row) for row in matrix]
        flat = [v for row in self.matrix for v in row]
        self.lo, self.hi = (min(flat), max(flat)) if flat else (0.0, 1.0)
        self.width = max((len(r) for r in self.matrix), default=0)

    def _cell(self, v: float) -> Text:
        c = heat_color((v - self.lo) / ((self.hi - self.lo) or 1.0))
        return Text(" " + self.fmt.format(v) + " ", style=f"black on {c}")

    def _slices(self, max_width: int) -> list[range]:
        """Consecutive head ranges, each as wide as fits beside the layer column (at least one head)."""
        label = max(len(self.row_label), len(str(len(self.matrix) - 1)))
        slices, start, used = [], 0, label
        for j in range(self.width):
            cells = [self._cell(r[j]).cell_len for r in self.matrix if j < len(r)]
            need = max([len(f"{self.col_label}{j}"), *cells]) + 1  # + the separator before it
            if j > start and used + need > max_width:
                slices.append(range(start, j))
                start, used = j, label
            used += need
        slices.append(range(start, self.width))
        return slices

    def table(self, heads: range, title: str) -> Table:
        t = Table(title=title, title_justify="left", padding=(0, 0), show_edge=False)
        t.add_column(self.row_label, justify="right", style="bold")
        for j in heads:
            t.add_column(f"{self.col_label}{j}", justify="right")
        for i, row in enumerate(self.matrix):
            t.add_row(str(i), *(self._cell(row[j]) if j < len(row) else Text("") for j in heads))
        return t

    def __rich_console__(self, console, options):
        for k, heads in enumerate(self._slices(options.max_width)):
            yield self.table(heads, self.title if k == 0 else "")


def pairs_table(title: str, pairs: Sequence[dict[str, Any]]) -> Table:
    """The most similar head pairs (layer, heads, attention and output similarity)."""
    t = Table(title=title, title_justify="left")
    for col in ("layer", "heads", "attention sim", "output sim", "same KV group"):
        t.add_column(col, justify="right")
    for p in pairs:
        t.add_row(str(p["layer"]), f"{p['heads'][0]} & {p['heads'][1]}", f"{p['attention_similarity']:.3f}",
                  f"{p['output_similarity']:.3f}", "yes" if p.get("same_kv_group") else "no")
    return t


def heads_cell(r: dict[str, Any]) -> str:
    """'query heads/KV heads' of an eval row; latent attention (convert-mla) caches a latent instead."""
    kv = "latent" if r.get("kv_rank") is not None else r.get("total_kv_heads", "?")
    return f"{r.get('total_heads', '?')}/{kv}"


def speed_table(doc: dict[str, Any]) -> Table:
    """Prefill/decode throughput, KV cache and memory of models side by side (ratios to the first)."""
    s = doc["settings"]
    decode = "no decode" if s.get("new_tokens") is None else f"{s['new_tokens']} decode steps"
    t = Table(title=f"headtool eval --speed (batch {s['batch']} x context {s['context']}, {decode}"
                    f", median of {s['repeats']} after {s['warmup']} warm-up, {s['threads']} threads, "
                    f"{s['device']})", title_justify="left")
    for col in ("model", "prefill tok/s", "ratio", "decode tok/s", "ratio", "ms/step", "KV cache", "ratio",
                "peak mem Δ", "heads"):
        t.add_column(col, justify="left" if col == "model" else "right")

    def ratio(r: dict, key: str, first: bool) -> str:
        v = r["ratio"].get(key)
        return "" if first or v is None else f"{v:.3f}x"

    for i, r in enumerate(doc["results"]):
        first = i == 0
        dec = r.get("decode_tokens_per_s")
        t.add_row(
            r["model"], f"{r['prefill_tokens_per_s']:,.1f}", ratio(r, "prefill_tokens_per_s", first),
            "n/a" if dec is None else f"{dec:,.2f}", ratio(r, "decode_tokens_per_s", first),
            "n/a" if r.get("decode_ms_per_step") is None else f"{r['decode_ms_per_step']:.1f}",
            "n/a" if r.get("kv_cache_bytes") is None else human_bytes(r["kv_cache_bytes"]),
            ratio(r, "kv_cache_bytes", first),
            "n/a" if r.get("peak_memory_delta_bytes") is None else human_bytes(r["peak_memory_delta_bytes"]),
            heads_cell(r),
        )
    return t


def attention_png(path, title: str, probs, tokens: Sequence[str]) -> None:
    """One head's attention probabilities on one text: rows = queries, columns = keys, with token labels."""
    from .plotting import _pyplot

    plt = _pyplot()
    n = len(tokens)
    size = min(3 + 0.2 * n, 14)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    im = ax.imshow(probs, cmap="magma", vmin=0.0, vmax=1.0, interpolation="nearest")
    if n <= 80:
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        ax.set_xticklabels(tokens, rotation=90, fontsize=6)
        ax.set_yticklabels(tokens, fontsize=6)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="attention probability")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
