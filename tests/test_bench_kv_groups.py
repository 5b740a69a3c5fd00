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
    assert "| 25% | geometric mean | one per KV group (today) | **1.241x** |" in table
    assert "| 25% | geometric mean | any single head | **1.100x** |" in table
    assert "| 25% (66) | 1 | any single head | 1.210x | 0, 1, 2 |" in table
