"""Least-squares refit of output projections: statistics, the OBS identity, sequential calibration."""
from __future__ import annotations

import copy

import pytest
import torch

from headtool.arch import adapter_for
from headtool.surgery.compensation import (LayerStats, o_proj_matrix, obs_cost, relative_error, removal_cost,
    ridge_solution, sequential_refit, squared_error)
from headtool.surgery.pruning import prune_layer
from tiny_models import sample_ids, tiny_model


def _stats(x: torch.Tensor, y: torch.Tensor) -> LayerStats:
    return LayerStats(x.T @ x, x.T @ y, float((y * y).sum()), x.shape[0], False)


def test_statistics_give_the_exact_error_and_the_ridge_solution():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 12, generator=g, dtype=torch.float64)
    y = torch.randn(200, 5, generator=g, dtype=torch.float64)
    st = _stats(x, y)
    w = torch.randn(5, 12, generator=g, dtype=torch.float64)
    assert squared_error(st, w) == pytest.approx(float(((x @ w.T - y) ** 2).sum()), rel=1e-10)
    w_ls = torch.linalg.lstsq(x, y).solution.T
    assert torch.allclose(ridge_solution(st, 1e-10), w_ls, atol=1e-6)


def test_obs_cost_is_the_error_left_after_refitting_without_the_columns():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 8, generator=g, dtype=torch.float64)
    w = torch.randn(4, 8, generator=g, dtype=torch.float64)
    st = _stats(x, x @ w.T)  # target reproduced exactly by the full weights
    s, keep = [2, 5], [0, 1, 3, 4, 6, 7]
    refit = torch.linalg.lstsq(x[:, keep], x @ w.T).solution
    left = float(((x[:, keep] @ refit - x @ w.T) ** 2).sum())
    assert obs_cost(w, torch.linalg.inv(st.G), s) == pytest.approx(left, rel=1e-8)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_removal_cost_matches_the_refit_and_sequential_refit_lowers_the_error(family):
    original = tiny_model(family)
    adapter = adapter_for(original.config)
    batches = [{"input_ids": sample_ids(family, batch=4, seq=24, seed=s),
                "attention_mask": torch.ones(4, 24, dtype=torch.long)} for s in range(2)]
    modified = copy.deepcopy(original)
    geo = adapter.geometry(original.config)
    captured = {}

    def on_layer(layer, stats, held):
        kept = [1, 3] if geo[layer].num_kv_heads == 2 else [0, 1]
        gone = [h for h in range(geo[layer].num_heads) if h not in kept]
        captured[layer] = (removal_cost(stats, 1e-2, adapter, geo[layer])(gone), stats, kept)
        prune_layer(modified, adapter, layer, geo[layer], kept)
        from headtool.surgery.compensation import o_columns
        return o_columns(adapter, geo[layer], kept)

    report = sequential_refit(original, modified, adapter, batches, layers=[0, 1], on_layer=on_layer)
    assert [r["layer"] for r in report] == [0, 1]
    for r in report:
        assert r["kept"] and r["rel_error_after"] < r["rel_error_before"]
    # the cost predicted before removal equals the ridge objective of the refit weights
    cost, stats, kept = captured[0]
    from headtool.surgery.compensation import o_columns
    sub = stats.restrict(o_columns(adapter, geo[0], kept))
    n_all = stats.G.shape[0] - (1 if stats.bias else 0)
    lam = 1e-2 * float(stats.G.diagonal()[:n_all].mean())  # the damping of the full layer
    gd = sub.G.clone()
    n = gd.shape[0] - (1 if sub.bias else 0)
    gd.diagonal()[:n] += lam
    w = torch.linalg.solve(gd, sub.C).T
    ridge_obj = squared_error(sub, w) + lam * float((w[:, :n] ** 2).sum())
    assert cost == pytest.approx(ridge_obj, rel=1e-6)
    # the refit weights are in the model
    w_model = o_proj_matrix(adapter, adapter.o_proj_module(modified, 0))
    assert relative_error(sub, w_model) == pytest.approx(report[0]["rel_error_after"], rel=1e-4)


def test_heldout_batches_veto_a_refit_that_does_not_generalize():
    original = tiny_model("llama")
    adapter = adapter_for(original.config)
    ids = sample_ids("llama", batch=1, seq=6)
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]  # 6 tokens, 32 unknowns
    held = [{"input_ids": sample_ids("llama", batch=4, seq=24, seed=9),
             "attention_mask": torch.ones(4, 24, dtype=torch.long)}]
    modified = copy.deepcopy(original)
    with torch.no_grad():
        modified.model.layers[0].self_attn.v_proj.weight.mul_(0.5)
    report = sequential_refit(original, modified, adapter, batches, layers=[0], damping=1e-6,
                              heldout_batches=held)
    r = report[0]
    assert "heldout_rel_error_after" in r
    assert r["kept"] == (r["heldout_rel_error_after"] < r["heldout_rel_error_before"])
