"""`headtool inspect`: per-head attention statistics and redundancy, as tables, JSON and PNGs."""
from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ...console import err_console, info, print_json
from ...errors import UsageError
from ..options import MODEL_HELP, JsonOpt, LoadOptions, command_inputs, data_options, model_options

PATTERN_TOKENS = 32

# statistic -> (title, number format for the table)
_SHOWN = {
    "entropy_normalized": ("normalised attention entropy (0 = one key, 1 = uniform)", "{:.2f}"),
    "entropy": ("attention entropy (nats)", "{:.2f}"),
    "mean_distance": ("mean attention distance (tokens)", "{:.1f}"),
    "first_token_mass": ("attention mass on the first token", "{:.2f}"),
    "previous_token_mass": ("attention mass on the previous token", "{:.2f}"),
    "twin_attention_similarity": ("nearest twin: attention similarity (1 - JS/ln2)", "{:.2f}"),
    "twin_output_similarity": ("nearest twin: output cosine after the output projection", "{:.2f}"),
    "output_rms": ("output size (RMS of the head's contribution per token)", "{:.3f}"),
}
_GROUP_SHOWN = {
    "within_attention_similarity": "KV group: mean attention similarity of its query heads",
    "within_output_similarity": "KV group: mean output cosine of its query heads",
}


def _present(rows: list) -> list[list[float]]:
    """Rows without the None cells (layers with a single head have no twin)."""
    return [[v for v in r if v is not None] for r in rows]


def _nan_for_none(rows: list) -> list[list[float]]:
    return [[math.nan if v is None else v for v in r] for r in rows]


def _render_tables(doc: dict[str, Any]) -> None:
    from ..render import heatmap_table, pairs_table

    con = err_console()
    for key, (title, fmt) in _SHOWN.items():  # long titles above the table: narrow tables wrap them
        con.print(f"[bold]{title}[/bold] ({key})")
        con.print(heatmap_table("", _present(doc["statistics"][key]), fmt=fmt))
    groups = doc.get("kv_groups")
    if groups:
        if doc.get("model", {}).get("kv_rank") is not None:
            con.print("latent attention: every query head of a layer reads the one latent, so each layer is "
                      "one group (kv0) below")
        for key, title in _GROUP_SHOWN.items():
            con.print(f"[bold]{title}[/bold] (kv_groups.{key})")
            con.print(heatmap_table("", _present(groups[key]), col_label="kv"))
    if doc["top_pairs"]:
        con.print(pairs_table("most similar head pairs (by attention similarity)", doc["top_pairs"]))


def _example_ids(lm, batches, text: str | None):
    import torch

    if text is not None:
        if not text.strip():
            raise UsageError("--text is empty")
        ids = lm.tokenizer(text, return_tensors="pt")["input_ids"][:, :2 * PATTERN_TOKENS]
        return ids
    first = batches[0]
    row = first["input_ids"][0][first["attention_mask"][0].bool()]
    return row[:PATTERN_TOKENS].view(1, -1).to(torch.long)


def _write_plots(out: Path, doc: dict[str, Any], lm, batches, heads, text: str | None) -> list[str]:
    from ...measure.inspection import attention_pattern
    from ..plotting import plot_heatmap
    from ..render import attention_png

    written = []
    for key, (title, _) in _SHOWN.items():
        written.append(plot_heatmap(_nan_for_none(doc["statistics"][key]), str(out / f"{key}.png"),
                                    title=f"{title}\n{lm.ref}", colorbar_label=key))
    groups = doc.get("kv_groups")
    if groups:
        for key, title in _GROUP_SHOWN.items():
            written.append(plot_heatmap(_nan_for_none(groups[key]), str(out / f"kv_group_{key}.png"),
                                        title=f"{title}\n{lm.ref}", colorbar_label=key, col_label="KV head"))
    if heads:
        ids = _example_ids(lm, batches, text)
        toks = [lm.tokenizer.decode([t]).replace("\n", "\\n") for t in ids[0].tolist()]
        pats = attention_pattern(lm.model, ids, heads)
        for (layer, head), probs in pats.items():
            p = out / f"attention_L{layer}_H{head}.png"
            attention_png(p, f"layer {layer} head {head} attention on one example ({len(toks)} tokens)\n{lm.ref}",
                          probs.numpy(), toks)
            written.append(str(p))
    return written


def inspect_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    json_out: JsonOpt = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="write PNG heatmaps (and --heads patterns) "
                                                 "into this folder (needs matplotlib)")] = None,
    heads: Annotated[Optional[str], typer.Option("--heads", help="heads whose attention pattern on one example "
                                                 "is drawn (with --plot), as for prune: LAYER:HEAD,HEAD;LAYER:HEAD, "
                                                 'e.g. "3:0,5;7:2" (layer 3 heads 0 and 5, layer 7 head 2); '
                                                 '"3:1,5:0" works too (an item with ":" starts a new layer)')] = None,
    text: Annotated[Optional[str], typer.Option("--text", help="the example text for --heads (default: the "
                                                "first tokens of the data)")] = None,
    top: Annotated[int, typer.Option("--top", help="how many of the most similar head pairs to list")] = 10,
    load: LoadOptions = LoadOptions(),
    data_spec=None,
) -> None:
    """What each head does, measured: entropy, distance, first/previous-token mass, redundancy.

    Eager attention on real batches (default: 16 blocks of builtin:pydoc). Numbers only.
    Example: headtool inspect smollm2-135m --json --plot inspect_png --heads "3:1,5;7:0"
    """
    from ...data.sources import DataSpec
    from ...io.files import check_output_path
    from ...workflows.inspect import InspectRequest, run_inspect

    req = InspectRequest(model, top=top, pattern_heads=heads, data=data_spec or DataSpec(), load=load)
    req.validate()
    if (heads or text is not None) and plot is None:
        raise UsageError("--heads/--text draw attention patterns and need --plot DIR")
    if text is not None and not text.strip():
        raise UsageError("--text is empty")
    if plot is not None:
        from ..plotting import _pyplot

        _pyplot()  # fail before the work when matplotlib is missing
        check_output_path(plot, "--plot", command_inputs(model, req.data), folder=True)
    run = run_inspect(req)
    doc, lm, chosen = run.document, run.loaded, run.pattern_heads
    _render_tables(doc)
    if plot is not None:
        created = not plot.exists()
        plot.mkdir(parents=True, exist_ok=True)
        try:
            doc["plots"] = _write_plots(plot, doc, lm, run.batches, chosen, text)
        except BaseException:
            if created:  # a folder this run made holds no half set of pictures
                shutil.rmtree(plot, ignore_errors=True)
            raise
        info(f"wrote {len(doc['plots'])} PNG files to {plot}")
    if json_out:
        print_json(doc)


def register(app: typer.Typer) -> None:
    app.command("inspect")(model_options(data_options()(inspect_cmd)))
