"""Least-squares refit of output projections: statistics, the OBS identity, sequential calibration."""
from __future__ import annotations

import copy
import functools
import inspect
import json
import math
from types import SimpleNamespace

import pytest
import torch
from tiny_models import sample_ids, tiny_model

from headtool.arch import adapter_for
from headtool.errors import UsageError
from headtool.measure.calibration import attention_input_grams
from headtool.surgery.compensation import (
    ANCHOR_GRID,
    DEFAULT_ANCHOR,
    LayerStats,
    RemovalCost,
    _damped,
    _ObsCost,
    choose_anchor,
    o_columns,
    o_proj_matrix,
    obs_cost,
    relative_error,
    removal_cost,
    ridge_solution,
    sequential_refit,
    set_o_proj_matrix,
    squared_error,
)
from headtool.data.sources import DataSpec
from headtool.surgery.merging import convert_model
from headtool.surgery.prune_defaults import (DEFAULT_PRUNE_DAMPING, FEW_TOKENS_ANCHOR_POWER, MANY_CALIBRATION_TOKENS,
                                             MANY_TOKENS_ANCHOR_POWER, default_anchor_power)
from headtool.surgery.pruning import markdown_table, prune, prune_layer
from headtool.arch import LayerHeads
from headtool.surgery.selection import Selection, candidate_sets, choose_removals
from headtool.workflows.requests import PruneRequest


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


@functools.lru_cache(maxsize=1)
def _llama_adapter():
    return adapter_for(tiny_model("llama").config)


def _random_layer(seed: int, heads: int, dims: int, out: int = 6):
    """The statistics and weights of a random output projection of `heads` x `dims` inputs."""
    g = torch.Generator().manual_seed(seed)
    n = heads * dims
    x = torch.randn(4 * n, n, generator=g, dtype=torch.float64) @ torch.randn(n, n, generator=g, dtype=torch.float64)
    w0 = torch.randn(out, n, generator=g, dtype=torch.float64)
    y = x @ (w0 + 0.3 * torch.randn(out, n, generator=g, dtype=torch.float64)).T
    return _stats(x, y), w0


@pytest.mark.parametrize("anchor", [0.0, 0.7])
def test_the_incremental_removal_cost_grows_a_set_to_the_cost_computed_from_scratch(anchor):
    stats, w0 = _random_layer(3, heads=6, dims=3)
    geo = LayerHeads(6, 2, 3)
    cost = removal_cost(stats, 1e-3, _llama_adapter(), geo, anchor=anchor, w0=w0)
    assert isinstance(cost, RemovalCost)
    state, grown = cost.start(), []
    for unit in ([4], [0, 2], [5]):  # units of different sizes, grown in no particular order
        options = [[h] for h in range(6) if h not in grown + unit]
        assert cost.extensions(state, options) == pytest.approx([cost(sorted(grown + o)) for o in options], rel=1e-9)
        state, grown = cost.extend(state, unit), grown + unit
        assert cost.extensions(state, [[1]]) == pytest.approx([cost(sorted(grown + [1]))], rel=1e-9)


def test_the_incremental_obs_cost_falls_back_where_a_block_is_not_definite():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 6, generator=g, dtype=torch.float64)
    x = torch.randn(20, 6, generator=g, dtype=torch.float64)
    g_inv = x.T @ x / 20
    g_inv[3, 3] = -0.5  # every set holding column 3 has a block that is not definite
    obs = _ObsCost(w, g_inv)
    blocks = [[c] for c in range(6)]
    state = obs.empty()
    for c in (0, 3, 5):
        values = obs.extension_values(state, [b for b in blocks if b[0] not in state.columns])
        want = [obs_cost(w, g_inv, state.columns + b) for b in blocks if b[0] not in state.columns]
        assert values == pytest.approx(want, rel=1e-8)
        state = obs.extended(state, [c])
        assert state.value == pytest.approx(obs_cost(w, g_inv, state.columns), rel=1e-8)
    assert not state.exact  # costed from scratch since column 3 joined


@pytest.mark.parametrize("unit,geo,counts", [("head", LayerHeads(9, 3, 2), range(9)),
                                              ("query", LayerHeads(16, 4, 2), [0, 4, 8, 12]),
                                              ("group", LayerHeads(16, 8, 2), range(0, 16, 2))])
def test_the_beam_chooses_the_same_sets_growing_factors_as_costing_every_set_anew(unit, geo, counts):
    stats, w0 = _random_layer(7, heads=geo.num_heads, dims=2)
    cost = removal_cost(stats, 1e-3, _llama_adapter(), geo, anchor=0.5, w0=w0)
    calls: list = []
    scratch = choose_removals(geo, counts, unit, lambda s: calls.append(s) or cost(s))
    assert choose_removals(geo, counts, unit, cost) == scratch
    assert len(calls) < sum(len(candidate_sets(geo, n, unit)) for n in counts)  # a beam, not every set


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


# ----------------------------------------------------------------------------- anchored refits
def _bias_stats(x: torch.Tensor, y: torch.Tensor) -> LayerStats:
    xa = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
    return LayerStats(xa.T @ xa, xa.T @ y, float((y * y).sum()), x.shape[0], True)


@pytest.mark.parametrize("bias", [False, True])
def test_anchor_zero_is_the_plain_damped_refit_and_inf_is_no_refit_bit_for_bit(bias):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 12, generator=g, dtype=torch.float64)
    y = torch.randn(50, 5, generator=g, dtype=torch.float64)
    st = _bias_stats(x, y) if bias else _stats(x, y)
    w0 = torch.randn(5, st.G.shape[0], generator=g, dtype=torch.float64)
    plain = torch.linalg.solve(_damped(st.G, 1e-2, bias), st.C).T  # the refit as it always was
    assert torch.equal(ridge_solution(st, 1e-2), plain)
    assert torch.equal(ridge_solution(st, 1e-2, anchor=0.0, w0=w0), plain)
    assert torch.equal(ridge_solution(st, 1e-2, anchor=math.inf, w0=w0), w0)


@pytest.mark.parametrize("bias", [False, True])
def test_the_anchored_refit_minimizes_the_error_plus_the_pull_toward_w0(bias):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 10, generator=g, dtype=torch.float64)
    y = torch.randn(40, 4, generator=g, dtype=torch.float64)
    st = _bias_stats(x, y) if bias else _stats(x, y)
    n_in = st.G.shape[0]
    w0 = torch.randn(4, n_in, generator=g, dtype=torch.float64)
    damping, anchor = 1e-2, 0.3
    mean_diag = float(st.G.diagonal()[:10].mean())
    lam, mu = damping * mean_diag, anchor * mean_diag
    # the same problem as one stacked least squares: [X; √λ I (not the bias); √μ I] W = [Y; 0; √μ W0ᵀ]
    xa = torch.cat([x, torch.ones_like(x[:, :1])], dim=1) if bias else x
    damp = torch.eye(n_in, dtype=torch.float64)[:10] * lam ** 0.5
    a = torch.cat([xa, damp, torch.eye(n_in, dtype=torch.float64) * mu ** 0.5])
    b = torch.cat([y, torch.zeros(10, 4, dtype=torch.float64), mu ** 0.5 * w0.T])
    want = torch.linalg.lstsq(a, b).solution.T
    assert torch.allclose(ridge_solution(st, damping, anchor, w0), want, atol=1e-10)
    # a stronger anchor lands closer to W0
    dist = [float((ridge_solution(st, damping, a_, w0) - w0).norm()) for a_ in (0.0, 0.1, 1.0, 10.0, 1e6)]
    assert dist == sorted(dist, reverse=True) and dist[-1] < 1e-4 * dist[0]


def test_the_anchored_removal_cost_is_the_objective_of_the_anchored_refit_without_those_heads():
    original = tiny_model("llama")
    adapter = adapter_for(original.config)
    batches = [{"input_ids": sample_ids("llama", batch=4, seq=24, seed=s),
                "attention_mask": torch.ones(4, 24, dtype=torch.long)} for s in range(2)]
    geo = adapter.geometry(original.config)
    got = {}

    def on_layer(layer, stats, held):
        w0 = o_proj_matrix(adapter, adapter.o_proj_module(original, layer))
        got[layer] = (stats, w0)

    sequential_refit(original, copy.deepcopy(original), adapter, batches, layers=[0], anchor=math.inf,
                     on_layer=on_layer)
    stats, w0 = got[0]
    gone = [1, 3]
    kept_cols = o_columns(adapter, geo[0], [0, 2])
    sub, w0k = stats.restrict(kept_cols), w0[:, kept_cols]
    lam = 1e-2 * float(stats.G.diagonal().mean())  # the damping of the full layer, as the cost uses
    for anchor in (0.5, math.inf):
        cost = removal_cost(stats, 1e-2, adapter, geo[0], anchor=anchor, w0=w0)(gone)
        if math.isinf(anchor):
            assert cost == pytest.approx(squared_error(sub, w0k), rel=1e-9)
            continue
        mu = anchor * float(stats.G.diagonal().mean())
        h = sub.G + (lam + mu) * torch.eye(sub.G.shape[0], dtype=torch.float64)
        w = torch.linalg.solve(h, sub.C + mu * w0k.T).T
        objective = squared_error(sub, w) + lam * float((w ** 2).sum()) + mu * float(((w - w0k) ** 2).sum())
        assert cost == pytest.approx(objective, rel=1e-8)


def _noisy_problem(seed: int, n_cal: int, noise: float, shift: float):
    """W0 [4, 12] and a true W close to it; calibration X ~ N(0, I), targets with noise."""
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(4, 12, generator=g, dtype=torch.float64)
    w_true = w0 + shift * torch.randn(4, 12, generator=g, dtype=torch.float64)
    x = torch.randn(n_cal, 12, generator=g, dtype=torch.float64)
    y = x @ w_true.T + noise * torch.randn(n_cal, 4, generator=g, dtype=torch.float64)
    return g, w0, w_true, _stats(x, y)


def test_heldout_statistics_reject_a_refit_that_only_fits_the_calibration_domain():
    # calibration: few tokens of a domain whose targets differ from W0's; held-out domain: W0 is right there
    g, w0, _, cal = _noisy_problem(4, n_cal=16, noise=1.0, shift=1.0)
    xh = 3.0 * torch.randn(400, 12, generator=g, dtype=torch.float64)
    held = _stats(xh, xh @ w0.T)
    w, rec = choose_anchor(cal, w0, 1e-2, ANCHOR_GRID, held)
    assert w is None and rec["kept"] is False and rec["anchor"] is None
    assert rec["heldout_rel_error_before"] == pytest.approx(0.0, abs=1e-12)
    assert set(rec["heldout_rel_errors"]) == {"0", "0.01", "0.1", "1", "10", "inf"}
    assert rec["rel_error_after"] < rec["rel_error_before"]  # the refit did fit the calibration data


def test_heldout_statistics_pick_a_finite_anchor_where_the_refit_helps():
    # enough calibration data of the domain the held-out blocks come from: the refit generalizes
    g, w0, w_true, cal = _noisy_problem(5, n_cal=2000, noise=0.1, shift=1.0)
    xh = torch.randn(500, 12, generator=g, dtype=torch.float64)
    held = _stats(xh, xh @ w_true.T + 0.1 * torch.randn(500, 4, generator=g, dtype=torch.float64))
    w, rec = choose_anchor(cal, w0, 1e-4, ANCHOR_GRID, held)
    assert rec["kept"] and rec["anchor"] is not None and rec["anchor"] <= 0.1
    assert rec["heldout_rel_error_after"] < 0.1 * rec["heldout_rel_error_before"]
    assert torch.equal(w, ridge_solution(cal, 1e-4, rec["anchor"], w0))
    # noisy, scarce calibration data of a true W near W0: the pull toward W0 is what generalizes
    g, w0, w_true, cal = _noisy_problem(6, n_cal=14, noise=2.0, shift=0.3)
    xh = torch.randn(2000, 12, generator=g, dtype=torch.float64)
    held = _stats(xh, xh @ w_true.T)
    w, rec = choose_anchor(cal, w0, 1e-4, ANCHOR_GRID, held)
    errs = rec["heldout_rel_errors"]
    assert rec["kept"] and 0 < rec["anchor"] < math.inf
    assert errs[f"{rec['anchor']:g}"] == min(errs.values()) < min(errs["0"], errs["inf"])


def test_one_anchor_without_heldout_keeps_the_refit_where_it_lowers_the_calibration_error():
    _, w0, _, cal = _noisy_problem(7, n_cal=200, noise=0.1, shift=1.0)
    w, rec = choose_anchor(cal, w0, 1e-2, 0.0)
    assert rec["kept"] and rec["anchor"] == 0.0 and "heldout_rel_error_before" not in rec
    assert "rel_errors" not in rec  # one finite candidate: nothing to list
    assert torch.equal(w, ridge_solution(cal, 1e-2))
    with pytest.raises(UsageError):
        choose_anchor(cal, w0, 1e-2, [-1.0])


def _prune_one_head_per_layer(model, adapter, geo):
    def on_layer(layer, stats=None, held=None):
        kept = list(range(1, geo[layer].num_heads))
        if geo[layer].num_kv_heads != geo[layer].num_heads:  # GQA: keep groups equal in size
            kept = [h for h in range(geo[layer].num_heads) if h % geo[layer].group_size != 0]
        prune_layer(model, adapter, layer, geo[layer], kept)
        return o_columns(adapter, geo[layer], kept)
    return on_layer


def _blocks(lo: int, hi: int, seed: int, n: int = 4, seq: int = 32) -> list[dict]:
    """Random token blocks from ids [lo, hi): disjoint ranges make unrelated 'domains'."""
    ids = torch.randint(lo, hi, (n, seq), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_anchor_inf_is_no_refit_and_anchor_zero_todays_refit_on_a_model(family):
    base = tiny_model(family).eval()
    adapter = adapter_for(base.config)
    geo = adapter.geometry(base.config)
    cal, held = _blocks(1, 200, 1), _blocks(1, 200, 2)
    unrefit = copy.deepcopy(base)
    for layer in range(len(geo)):
        _prune_one_head_per_layer(unrefit, adapter, geo)(layer)
    inf = copy.deepcopy(base)
    report = sequential_refit(inf, inf, adapter, cal, anchor=math.inf, heldout_batches=held,
                              on_layer=_prune_one_head_per_layer(inf, adapter, geo))
    assert not any(r["kept"] for r in report) and all(r["anchor"] is None for r in report)
    ref_sd = unrefit.state_dict()
    assert all(torch.equal(v, ref_sd[k]) for k, v in inf.state_dict().items())

    # anchor 0: each layer gets exactly the plain damped solution of its statistics, as before anchors
    zero = copy.deepcopy(base)
    seen = {}
    prune_zero = _prune_one_head_per_layer(zero, adapter, geo)

    def on_layer(layer, stats, held_stats):
        cols = prune_zero(layer)
        seen[layer] = stats.restrict(cols)
        return cols

    report = sequential_refit(zero, zero, adapter, cal, anchor=0.0, on_layer=on_layer)
    assert all(r["kept"] and r["anchor"] == 0.0 for r in report)
    for layer, sub in seen.items():
        module = copy.deepcopy(adapter.o_proj_module(zero, layer))
        set_o_proj_matrix(adapter, module, torch.linalg.solve(_damped(sub.G, 1e-2, sub.bias), sub.C).T)
        got = adapter.o_proj_module(zero, layer)
        assert torch.equal(got.weight, module.weight)
        assert all(torch.equal(a, b) for a, b in zip(got.parameters(), module.parameters()))


def _kl(reference, model, batches) -> float:
    with torch.no_grad():
        total = 0.0
        for b in batches:
            p = reference(**b).logits.log_softmax(-1)
            q = model(**b).logits.log_softmax(-1)
            total += float((p.exp() * (p - q)).sum(-1).mean())
    return total


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cross_domain_the_heldout_chosen_anchor_is_no_worse_than_the_plain_refit(family):
    """Calibrated on domain A (a few blocks of low token ids), judged on domain B (high ids).

    The plain refit (anchor 0) fits A and hurts B; anchors chosen per layer on held-out blocks of
    B, and the default anchor checked on A alone, both do better on B; the choices are recorded."""
    base = tiny_model(family, seed=0).eval()
    adapter = adapter_for(base.config)
    geo = adapter.geometry(base.config)
    cal = _blocks(1, 40, 1, n=2, seq=24)
    held_b, eval_b = _blocks(200, 400, 2), _blocks(200, 400, 3)
    plain = copy.deepcopy(base)
    sequential_refit(plain, plain, adapter, cal, anchor=0.0, on_layer=_prune_one_head_per_layer(plain, adapter, geo))
    chosen = copy.deepcopy(base)
    report = sequential_refit(chosen, chosen, adapter, cal, anchor=ANCHOR_GRID, heldout_batches=held_b,
                              on_layer=_prune_one_head_per_layer(chosen, adapter, geo))
    assert _kl(base, chosen, eval_b) < _kl(base, plain, eval_b)
    default = copy.deepcopy(base)  # the default anchor, checked on held-out blocks of A only
    sequential_refit(default, default, adapter, cal, heldout_batches=_blocks(1, 40, 4),
                     on_layer=_prune_one_head_per_layer(default, adapter, geo))
    assert _kl(base, default, eval_b) < _kl(base, plain, eval_b)
    for r in report:
        assert set(r["heldout_rel_errors"]) == {"0", "0.01", "0.1", "1", "10", "inf"}
        best = min(r["heldout_rel_errors"].values())
        key = "inf" if r["anchor"] is None else f"{r['anchor']:g}"
        assert r["heldout_rel_errors"][key] == best


def test_the_default_anchor_is_one_value_kept_or_rejected_per_layer():
    base = tiny_model("llama").eval()
    adapter = adapter_for(base.config)
    geo = adapter.geometry(base.config)
    cal, held = _blocks(1, 200, 1), _blocks(1, 200, 2)
    for heldout in (held, None):
        m = copy.deepcopy(base)
        report = sequential_refit(m, m, adapter, cal, heldout_batches=heldout,
                                  on_layer=_prune_one_head_per_layer(m, adapter, geo))
        for r in report:
            assert r["anchor"] in (DEFAULT_ANCHOR, None) and r["kept"] == (r["anchor"] is not None)
            assert "heldout_rel_errors" not in r and "rel_errors" not in r
        explicit = copy.deepcopy(base)
        sequential_refit(explicit, explicit, adapter, cal, heldout_batches=heldout, anchor=DEFAULT_ANCHOR,
                         on_layer=_prune_one_head_per_layer(explicit, adapter, geo))
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), explicit.state_dict().values()))


def test_prune_records_each_layers_anchor_in_the_summary_and_the_table():
    model = tiny_model("llama").eval()
    adapter = adapter_for(model.config)
    geo = adapter.geometry(model.config)
    loaded = SimpleNamespace(model=model, adapter=adapter)
    selection = Selection.from_kept(geo, [(1, 3), (0, 1, 2, 3), (0, 2)])  # one head per KV group left
    result = prune(loaded, selection, calib_batches=_blocks(1, 200, 1), heldout_batches=_blocks(200, 400, 2),
                   compensate=True, anchor=[0.0, 1.0], anchor_power=0.0)  # the candidates as given
    comp = result.summary()["compensation"]
    assert [r["layer"] for r in comp] == [0, 2]
    for r in comp:
        assert r["anchor"] in (0.0, 1.0, None) and set(r["heldout_rel_errors"]) == {"0", "1", "inf"}
    table = markdown_table(result)
    assert "| layer | anchor | calibration error | held-out error | refit |" in table
    json.dumps(result.summary(), allow_nan=False)  # headtool.json stays strict JSON (no inf anywhere)
    with pytest.raises(UsageError):
        prune(SimpleNamespace(model=tiny_model("llama"), adapter=adapter), selection,
              calib_batches=_blocks(1, 200, 1), compensate=True, anchor=float("nan"))


def test_convert_with_anchor_inf_is_the_merge_without_refit_bit_for_bit():
    model = tiny_model("llama", num_key_value_heads=4).eval()
    adapter = adapter_for(model.config)
    cal, held = _blocks(1, 200, 1), _blocks(1, 200, 2)
    grams = attention_input_grams(model, adapter, cal)
    plain = convert_model(model, adapter, 2, method="fit", grams=grams)
    inf = convert_model(model, adapter, 2, method="fit", grams=grams, refit=True, batches=cal,
                        heldout_batches=held, anchor=math.inf)
    assert not any(r["kept"] for r in inf.refit)
    ref = plain.model.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in inf.model.state_dict().items())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_anchor_power_scales_each_layers_anchor_by_the_share_of_heads_it_keeps(family):
    """--anchor-power P: a layer that keeps k of h heads is refit with anchor x (k/h)^P (a layer that
    keeps all of them, refit with --refit-layers all, with the anchor as given); P = 0 is one anchor for
    every layer; the library's default on this little calibration is FEW_TOKENS_ANCHOR_POWER, and the
    result records the power it used."""
    base = tiny_model(family, num_key_value_heads=4).eval() if family == "llama" else tiny_model(family).eval()
    adapter = adapter_for(base.config)
    geo = adapter.geometry(base.config)
    h = geo[0].num_heads
    kept = [(0,), tuple(range(h)), tuple(range(h - 1))]
    selection = Selection.from_kept(geo, kept)

    def run(**kw):
        m = copy.deepcopy(base)
        res = prune(SimpleNamespace(model=m, adapter=adapter), selection, calib_batches=_blocks(1, 200, 1),
                    compensate=True, choose_in_layer="scores", refit_layers="all", anchor=0.5, **kw)
        return m, {r["layer"]: r for r in res.compensation}, res.anchor_power
    m0, _, _ = run(anchor_power=0.0)
    m_default, _, used = run()
    m_stated, _, _ = run(anchor_power=FEW_TOKENS_ANCHOR_POWER)
    assert used == FEW_TOKENS_ANCHOR_POWER
    assert all(torch.equal(a, b) for a, b in zip(m_default.state_dict().values(), m_stated.state_dict().values()))
    m2, rows, used = run(anchor_power=2.0)
    assert used == 2.0
    expected = {0: 0.5 / h ** 2, 1: 0.5, 2: 0.5 * ((h - 1) / h) ** 2}
    for layer, strength in expected.items():
        assert rows[layer]["anchor"] in (pytest.approx(strength), None)
    assert rows[0]["anchor"] == pytest.approx(expected[0])  # the layer left with one head takes its refit
    assert not all(torch.equal(a, b) for a, b in zip(m0.state_dict().values(), m2.state_dict().values()))
    with pytest.raises(UsageError, match="anchor-power"):
        prune(SimpleNamespace(model=copy.deepcopy(base), adapter=adapter), selection,
              calib_batches=_blocks(1, 200, 1), compensate=True, anchor_power=-1.0)


def test_library_prune_refits_at_the_settings_the_cli_uses():
    """surgery.pruning.prune() called without refit settings refits as `headtool prune --compensate` does
    (it kept the settings from before they were measured, damping 0.01 and power 0, while the CLI moved)."""
    params = inspect.signature(prune).parameters
    cli = PruneRequest(model="m", fraction=0.25, compensate=True)
    assert params["damping"].default == cli.damping == DEFAULT_PRUNE_DAMPING
    assert params["anchor_power"].default is None and cli.anchor_power is None  # both: by the calibration's size


def test_the_default_power_follows_the_calibration_size_and_prunes_default_calibration_is_many_tokens():
    """default_anchor_power: the freer refit from MANY_CALIBRATION_TOKENS on (the tokens of prune's default
    calibration, where it was measured better out of domain), the stiffer one below (better on 16 blocks)."""
    assert default_anchor_power(MANY_CALIBRATION_TOKENS) == MANY_TOKENS_ANCHOR_POWER
    assert default_anchor_power(MANY_CALIBRATION_TOKENS - 1) == FEW_TOKENS_ANCHOR_POWER
    assert MANY_TOKENS_ANCHOR_POWER > FEW_TOKENS_ANCHOR_POWER
    req = PruneRequest(model="m", fraction=0.25, compensate=True)
    assert req.default_blocks * DataSpec().seq_len >= MANY_CALIBRATION_TOKENS


@pytest.mark.parametrize("padded", [False, True])
def test_prune_refits_at_the_power_of_the_tokens_it_reads_padding_not_counted(padded):
    """A calibration of MANY_CALIBRATION_TOKENS real tokens is refit at MANY_TOKENS_ANCHOR_POWER, bit for bit
    as when given; with one padded position it is one token short of that, and stiffer."""
    base = tiny_model("llama", num_key_value_heads=4).eval()
    adapter = adapter_for(base.config)
    geo = adapter.geometry(base.config)
    selection = Selection.from_kept(geo, [tuple(range(g.num_heads - 2)) for g in geo])
    rows, seq = 64, MANY_CALIBRATION_TOKENS // 64
    ids = torch.randint(3, 200, (rows, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, -1] = 0
    batches = [{"input_ids": ids[i:i + 16], "attention_mask": mask[i:i + 16]} for i in range(0, rows, 16)]

    def run(**kw):
        m = copy.deepcopy(base)
        res = prune(SimpleNamespace(model=m, adapter=adapter), selection, calib_batches=batches, compensate=True,
                    choose_in_layer="scores", **kw)
        return m, res.anchor_power
    m_default, used = run()
    expected = FEW_TOKENS_ANCHOR_POWER if padded else MANY_TOKENS_ANCHOR_POWER
    assert used == expected
    m_given, _ = run(anchor_power=expected)
    assert all(torch.equal(a, b) for a, b in zip(m_default.state_dict().values(), m_given.state_dict().values()))
