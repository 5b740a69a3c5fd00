"""`headtool convert-mla`: K/V heads into a shared latent (multi-head latent attention)."""
from __future__ import annotations

from typing import Any

import typer

from ...console import err_console, print_json
from ...data.sources import AUTO_SOURCE
from ...io.provenance import IN_DOMAIN_NOTE
from ...workflows.requests import LatentRequest, calibration_data
from ..options import JsonOpt, LoadOptions, command_options, data_options, model_options


def _table(summary: dict[str, Any]):
    from ..render import Table

    from ...model.info import conversion_kv_label  # torch: only once a command runs
    from ..render import fraction_text, human_bytes, human_int

    t = Table(title=f"headtool convert-mla: {summary['model']} -> {summary['output']}", show_header=False,
              title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value")
    b, a = summary["before"], summary["after"]
    ranks = summary["kv_rank"]
    t.add_row("attention", f"{b['num_heads']} query heads / {b['num_kv_heads']} KV heads -> latent attention")
    t.add_row("latent (kv_rank)", str(ranks[0]) if len(set(ranks)) == 1 else
              f"{', '.join(map(str, ranks))} (per layer, {summary.get('rank_allocation')} allocation)")
    rotary = bool(summary["rope_dim"])
    t.add_row("shared rotary key", f"{summary['rope_dim']} dims" if rotary else "none (no RoPE: learned positions)")
    t.add_row("parameters", f"{human_int(b['params'])} -> {human_int(a['params'])} ({a['params'] - b['params']:+,})")
    t.add_row(conversion_kv_label(b), f"{human_bytes(b['kv_cache_bytes_per_token'])} -> "
                                    f"{human_bytes(a['kv_cache_bytes_per_token'])} "
                                    f"({100 * summary['kv_cache_fraction']:.1f}%, "
                                    f"{summary['kv_cache_reduction']:.2f}x smaller)")
    if summary.get("kv_cache_budget") is not None:
        budget = summary["kv_cache_budget"] * b["kv_cache_bytes_per_token"]
        t.add_row("KV cache budget", f"--kv-cache {fraction_text(summary['kv_cache_budget'])}: {budget:,.0f} B per token, "
                                     f"{a['kv_cache_bytes_per_token']:,} B used")
    layers = summary["layers"]
    if rotary:
        t.add_row("rotary key energy kept", f"{min(x['rope_energy'] for x in layers):.3f}..."
                                            f"{max(x['rope_energy'] for x in layers):.3f} (per layer)")
    t.add_row("latent energy kept", f"{min(x['latent_energy'] for x in layers):.3f}..."
                                    f"{max(x['latent_energy'] for x in layers):.3f} (weighted, per layer)")
    if summary.get("refit"):
        kept = sum(r["kept"] for r in summary["refit"])
        t.add_row("output-projection refit", f"kept in {kept}/{len(summary['refit'])} layers")
    if summary.get("eval_before"):
        e0, e1 = summary["eval_before"], summary["eval_after"]
        ppl = (f"; perplexity {e0['perplexity']:.2f} -> {e1['perplexity']:.2f} "
               f"({e1['perplexity'] / e0['perplexity']:.3f}x)") if "perplexity" in e0 else ""
        t.add_row("eval loss", f"{e0['loss']:.4f} -> {e1['loss']:.4f}{ppl}")
        if (summary.get("eval_data") or {}).get("in_domain"):
            t.add_row("", IN_DOMAIN_NOTE)
    t.add_row("written", f"{summary.get('path', summary['output'])} ({summary.get('config_kind')} config; "
                         "load with trust_remote_code=True)")
    return t


@command_options(LatentRequest)
def convert_mla_cmd(json_out: JsonOpt = False, fields=None, load: LoadOptions = LoadOptions(),
                    data_spec=None) -> None:
    """K/V heads into one latent per token and layer (multi-head latent attention), RoPE exact.

    Per-frequency rotations across the KV heads (RoRoPE) move the position information into a
    rotary key of --rope-dim dims shared by all query heads; the rest of K and all of V become one
    --kv-rank latent (activation-whitened factorization on --data, default auto: builtin:pydoc
    mixed with self-generated text on a causal LM; 64 blocks); or --kv-cache FRACTION of today's
    cache bytes (1/3 or 0.5), split across layers uniformly or, with --rank-allocation auto, by the
    layers' measured spectra. The cache holds the latent and the rotary key. The folder loads with
    trust_remote_code=True (a self-contained modeling file).

    Example: headtool convert-mla smollm2-135m --kv-cache 1/3 -o smollm2-mla
    Example: headtool convert-mla smollm2-135m --kv-rank 64 --rope-dim 64 -o smollm2-mla
    Example: headtool convert-mla smollm2-135m --kv-cache 1/8 --rope-dim 24 --rank-allocation auto -o smollm2-mla
    """
    from ...workflows.convert_mla import run_convert_mla

    summary = run_convert_mla(LatentRequest(**fields, data=data_spec or calibration_data(), load=load))
    err_console().print(_table(summary))
    if json_out:
        print_json(summary)


def register(app: typer.Typer) -> None:
    app.command("convert-mla")(model_options(data_options(default=AUTO_SOURCE)(convert_mla_cmd)))
