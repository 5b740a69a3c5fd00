"""benchmarks/bench_kv_groups.py: the multi-head expansion it measures against must be the same function."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from headtool.arch import adapter_for

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_expanding_kv_heads_to_one_per_query_head_changes_no_logit(family):
    from bench_kv_groups import expand_to_mha

    model = tiny_model(family)
    adapter = adapter_for(model.config)
    wide = copy.deepcopy(model)
    expand_to_mha(wide, adapter)
    assert all(g.num_kv_heads == g.num_heads for g in adapter.geometry(wide.config))
    assert any(g.num_kv_heads < g.num_heads for g in adapter.geometry(model.config))
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, wide(ids).logits, atol=1e-5)


def test_the_table_has_a_row_per_sample_and_a_geometric_mean_per_variant():
    from bench_kv_groups import VARIANTS, render

    def row(seed, variant, news):
        return {"seed": seed, "fraction": 0.25, "variant": variant, "heads_removed": 66,
                "removed_per_layer": [0, 3] if variant == "gqa" else [0, 1, 2], "prune_seconds": 90.0,
                "eval": {"news": {"ratio": news}}}
    doc = {"order": ["news"], "domains": {"news": {"label": "news (Lee corpus)"}}, "variants": VARIANTS,
           "settings": {"fractions": [0.25]},
           "rows": [row(0, "gqa", 1.1), row(1, "gqa", 1.4), row(0, "any", 1.0), row(1, "any", 1.21)]}
    table = render(doc)
    assert "| 25% | geometric mean | one per KV group (`--unit query`) | **1.241x** |" in table
    assert "| 25% | geometric mean | any single head (`--unit head`) | **1.100x** |" in table
    assert "| 25% (66) | 1 | any single head (`--unit head`) | 1.210x | 0, 1, 2 |" in table


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_prune_of_the_expanded_model_is_a_prune_with_unit_head(family, tmp_path):
    """The bench's 'any single head' rows prune the model expanded to one K/V head per query head;
    `prune --unit head` on the grouped model (uneven groups, the KV heads kept) makes the same
    choices and the same function, with the refit, so those rows measure it."""
    from bench_kv_groups import expand_to_mha

    from headtool.data.batches import make_batches
    from headtool.data.sources import DataSpec
    from headtool.model.loading import model_from_object
    from headtool.workflows.prune import prune_loaded
    from headtool.workflows.requests import PruneRequest
    from tiny_models import tiny_causal_tokenizer

    tok = tiny_causal_tokenizer()
    gqa = model_from_object(tiny_model(family), tok, ref="tiny")
    wide_model = copy.deepcopy(gqa.model)
    expand_to_mha(wide_model, gqa.adapter)
    wide = model_from_object(wide_model, tok, ref="tiny")
    spec = DataSpec(source="builtin:pydoc", seq_len=32, batch_size=2, max_samples=6)
    ids = make_batches(spec, tok, "lm").batches[0]["input_ids"]
    for n in (1, 3):  # one head leaves groups of 1 and 2; three go where the refit says
        done = {}
        for name, lm, unit in (("gqa", gqa, "head"), ("wide", wide, "query")):
            req = PruneRequest(model="tiny", num_heads=n, unit=unit, compensate=True, data=spec,
                               protect_layers="none", heldout_samples=0)
            pruned = model_from_object(copy.deepcopy(lm.model), tok, ref="tiny")
            done[name] = (prune_loaded(pruned, req).result, pruned.model)
        assert done["gqa"][0].selection.kept == done["wide"][0].selection.kept
        assert any(g.uneven for g in done["gqa"][0].geometry_after) == (n == 1)
        with torch.no_grad():
            a, b = done["gqa"][1](ids).logits, done["wide"][1](ids).logits
        assert torch.allclose(a, b, atol=1e-4), (n, (a - b).abs().max())
