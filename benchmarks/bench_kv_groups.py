"""What pruning in whole GQA steps costs: SmolLM2-135M's heads removed one per KV group (`prune --unit query`,
the default until 2026-12-07) against any single head (`--unit head`).

`prune --unit query` on a grouped-query layer removes one query head from every KV group at a time
(the groups stay equal in size, which the family's stock attention expresses), so SmolLM2-135M
(9 query heads in 3 groups a layer) loses 0, 3 or 6 heads a layer. To measure what that constraint
costs, the model is also expanded exactly to multi-head attention (every query head gets its own
copy of its group's K/V head: the same function, checked on the evaluation sets), where a prune may
remove any single head. Both are pruned by the same code at prune's defaults (gradient scores on the
calibration, `--compensate --anchor 1`, `--normalize auto`: obs now, layer,none judged on self text when
results/kv_groups.json was measured; the first layer protected), the same number of heads, on the same calibration; evaluated out of domain as
bench_cross_domain.py. The expanded model's KV cache is 3x the original's, so it is a measurement
of the selection; `prune --unit head` keeps the 3 K/V heads with groups of different sizes and makes the
same choices to the same function (tests/test_bench_kv_groups.py), so these rows are what it gives.

    python benchmarks/bench_kv_groups.py --seeds 0,1,2 --fractions 0.25
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_cross_domain as cross  # noqa: E402
from sample_runs import add_sample_options, document, geomean, removed_per_layer, start  # noqa: E402

import torch  # noqa: E402

from headtool.arch.heads import LayerKeep, layer_tensor_names  # noqa: E402
from headtool.arch import LayerHeads  # noqa: E402
from headtool.model.loading import model_from_object  # noqa: E402
from headtool.model.resize import resize_attention  # noqa: E402
from headtool.workflows.prune import prune_loaded  # noqa: E402
from headtool.workflows.requests import PruneRequest, ScoreRequest  # noqa: E402
from headtool.workflows.score import score_loaded  # noqa: E402

CALIBRATION = "builtin:pydoc+self"
VARIANTS = {"gqa": "one query head from every KV group a step (prune --unit query)",
            "any": "any single head (prune --unit head; measured on the model expanded to one K/V head per query head)"}


def expand_to_mha(model, adapter) -> None:
    """Give every query head its own copy of its group's K/V head, in place (the same function).

    The kept K/V heads repeat (0, 0, 0, 1, 1, 1, ...), which prune's slicing (sorted positions, for
    heads that survive once each) does not express: the slices are gathered here in head order."""
    for layer, geo in enumerate(adapter.geometry(model.config)):
        if geo.num_kv_heads == geo.num_heads:
            continue
        group = geo.num_heads // geo.num_kv_heads
        keep = LayerKeep(q=tuple(range(geo.num_heads)), kv=tuple(h // group for h in range(geo.num_heads)))
        prefix = adapter.layer_prefix(model, layer)
        layer_sd = {k: v for k, v in model.state_dict().items() if k.startswith(prefix)}
        new = {}
        for key, ht in layer_tensor_names(adapter, prefix, layer_sd.keys()):
            if ht.interleaved:
                raise SystemExit(f"{key}: interleaved head layouts are not expanded by this benchmark")
            idx = torch.cat([ht.positions(k, geo)[list(keep.of(k))].reshape(-1) for k in ht.kinds])
            new[key] = layer_sd[key].index_select(ht.axis, idx).contiguous()
        resize_attention(model, adapter, layer, LayerHeads(geo.num_heads, geo.num_heads, geo.head_dim), new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sample_options(ap, fractions="0.25", out="kv_groups.json")
    a = ap.parse_args()
    run = start(a)
    lm, tok, base = run.lm, run.lm.tokenizer, run.base
    mha = copy.deepcopy(lm.model)
    expand_to_mha(mha, lm.adapter)
    mlm = model_from_object(mha, tok, ref=cross.MODEL)
    expanded = run.ratios(mha)
    for name in base:
        if not math.isclose(base[name]["loss"], expanded[name]["loss"], rel_tol=1e-5):
            raise SystemExit(f"the expanded model differs on {name}: {base[name]} vs {expanded[name]}")
    defaults = PruneRequest(model=cross.MODEL, compensate=True)  # the refit settings its prunes run at
    doc = {**document(run, "bench_kv_groups.py", CALIBRATION, anchor_power=run.default_power,
                      damping=defaults.damping), "variants": VARIANTS}
    for seed in run.seeds:
        spec = run.calibration(CALIBRATION, seed)
        removed: dict[float, int] = {}
        for variant, src in (("gqa", lm), ("any", mlm)):
            t0 = time.perf_counter()
            scores = score_loaded(src, ScoreRequest(model=cross.MODEL, method="gradient", data=spec),
                                  text_model=lm).result
            score_s = time.perf_counter() - t0
            for fraction in run.fractions:
                t0 = time.perf_counter()
                plm = model_from_object(copy.deepcopy(src.model), tok, ref=cross.MODEL)
                count = {"fraction": fraction} if variant == "gqa" else {"num_heads": removed[fraction]}
                req = PruneRequest(model=cross.MODEL, compensate=True, data=spec, unit="query", **count)
                done = prune_loaded(plm, req, scores=scores, text_model=lm)
                prune_s = time.perf_counter() - t0
                s = done.result.summary()
                removed.setdefault(fraction, s["heads_removed"])
                row = {"seed": seed, "fraction": fraction, "variant": variant, "heads_removed": s["heads_removed"],
                       "removed_per_layer": removed_per_layer(done.result),
                       "allocation": (done.result.allocation or {}).get("normalize"),
                       "candidates": [c["normalize"] for c in (done.result.allocation or {}).get("candidates", [])],
                       "eval": run.ratios(plm.model),
                       "score_seconds": round(score_s, 1), "prune_seconds": round(prune_s, 1)}
                doc["rows"].append(row)
                run.save(doc)
                run.clock.log(f"seed {seed} {fraction:.0%} {variant}: " + " / ".join(
                    f"{n} {r['ratio']:.3f}x" for n, r in row["eval"].items()))
    print(render(doc))


def render(doc: dict) -> str:
    """The table: every calibration sample, then the geometric mean over them, per fraction (seconds stay in
    the JSON: the run that wrote the README's shared the machine with a test run)."""
    order = doc["order"]
    labels = [doc["domains"][n].get("label", n) for n in order]
    lines = ["| removed | calibration sample | heads removed per step | " + " | ".join(labels)
             + " | heads a layer lost (the counts that occur) |",
             "| --- | ---: | --- | " + " | ".join("---:" for _ in order) + " | --- |"]
    for fraction in doc["settings"]["fractions"]:
        rows = [r for r in doc["rows"] if r["fraction"] == fraction]
        for variant in doc["variants"]:
            mine = [r for r in rows if r["variant"] == variant]
            step = "one per KV group (`--unit query`)" if variant == "gqa" else "any single head (`--unit head`)"
            for r in mine:
                per = sorted(set(r["removed_per_layer"]))
                lines.append(f"| {fraction:.0%} ({r['heads_removed']}) | {r['seed']} | {step} | "
                             + " | ".join(f"{r['eval'][n]['ratio']:.3f}x" for n in order)
                             + f" | {', '.join(map(str, per))} |")
            if len(mine) > 1:
                lines.append(f"| {fraction:.0%} | geometric mean | {step} | "
                             + " | ".join(f"**{geomean([r['eval'][n]['ratio'] for r in mine]):.3f}x**"
                                          for n in order) + " | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
