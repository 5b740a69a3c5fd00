"""Scoring methods on tiny models of every family: gradient = finite differences, ablation =
direct one-head-at-a-time loop, Fisher for kl, taylor = sum W*dL/dW, iterative, baselines."""
from __future__ import annotations

import math

import pytest
import torch

from headtool.arch import adapter_for
from headtool.errors import HeadtoolError, UsageError
from headtool.measure.gates import head_gates
from headtool.measure.objectives import forward_output, objective_losses
from headtool.measure.scoring import (kv_group_scores, magnitude_scores, normalize_scores, random_scores,
    removal_counts, score_heads)
from headtool.arch.heads import extract_heads
from tiny_models import ALL, FAMILIES, tiny_model, sample_ids

# OPT uses ReLU: a wide finite-difference step would cross its kinks. The other families compute
# their norms in float32 even in a float64 model (roundoff ~1e-7 in the loss), so they need a
# wide step; a 5-point stencil keeps the truncation error at O(eps^4).
FD_EPS = {"opt": 1e-5}


def _objective(family: str) -> str:
    return "mlm" if FAMILIES[family][1] else "lm"


def _batch(family: str, batch: int, seq: int, seed: int) -> dict:
    ids = sample_ids(family, batch=batch, seq=seq, seed=seed)
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if FAMILIES[family][1]:
        lab = torch.full_like(ids, -100)
        lab[:, 1::3] = ids[:, 1::3]
        b["labels"] = lab
    return b


def _summed_losses(model, adapter, mask, batch, objective) -> tuple[torch.Tensor, float]:
    """Per-example summed loss [B] and the number of loss positions, gates fixed to `mask`."""
    with head_gates(model, adapter, init=mask, dtype=torch.float64) as _, torch.no_grad():
        out, _ = forward_output(model, batch)
        losses, w = objective_losses(objective, out, batch)
        return (losses * w).sum(1), float(w.sum())


@pytest.mark.parametrize("family", ALL)
def test_gradient_scores_equal_finite_differences(family):
    model = tiny_model(family).double()
    adapter = adapter_for(model.config)
    geo = adapter.geometry(model.config)
    obj = _objective(family)
    batch = _batch(family, 2, 12, seed=1)
    res = score_heads(model, adapter, [batch], method="gradient", objective=obj, normalize="none")
    assert res.estimator == "gradient" and res.passes == 1
    eps = FD_EPS.get(family, 1e-2)
    ones = [[1.0] * g.num_heads for g in geo]
    for layer, g in enumerate(geo):
        for head in range(g.num_heads):
            def s(v):
                mask = [list(r) for r in ones]
                mask[layer][head] = v
                return _summed_losses(model, adapter, mask, batch, obj)

            (sp2, n), (sp1, _), (sm1, _), (sm2, _) = s(1 + 2 * eps), s(1 + eps), s(1 - eps), s(1 - 2 * eps)
            d = (-sp2 + 8 * sp1 - 8 * sm1 + sm2) / (12 * eps)  # per-example dS_x/dg
            fd = float(d.abs().sum()) / n
            got = res.raw_scores[layer][head]
            assert abs(got - fd) <= 1e-3 * abs(fd), (family, layer, head, got, fd)
    assert res.baseline_loss == pytest.approx(float(_summed_losses(model, adapter, ones, batch, obj)[0].sum()) / n,
                                              rel=1e-12)


@pytest.mark.parametrize("family", ALL)
def test_ablation_equals_direct_loop(family):
    model = tiny_model(family).double()
    adapter = adapter_for(model.config)
    geo = adapter.geometry(model.config)
    obj = _objective(family)
    batches = [_batch(family, 2, 10, seed=2), _batch(family, 1, 10, seed=3)]  # batches of unequal size
    # 2 heads per pass: several chunks per layer, and copies batched together
    res = score_heads(model, adapter, batches, method="ablation", objective=obj, ablation_chunk=2)
    assert res.normalize == "none" and res.estimator == "ablation"
    assert res.passes == 2 * (1 + len(geo) * 2)

    def mean_loss(mask):
        tot = n = 0.0
        for b in batches:
            s, w = _summed_losses(model, adapter, mask, b, obj)
            tot += float(s.sum())
            n += w
        return tot / n

    ones = [[1.0] * g.num_heads for g in geo]
    base = mean_loss(ones)
    assert res.baseline_loss == pytest.approx(base, rel=1e-12)
    for layer, g in enumerate(geo):
        for head in range(g.num_heads):
            mask = [list(r) for r in ones]
            mask[layer][head] = 0.0
            direct = mean_loss(mask) - base
            assert abs(res.raw_scores[layer][head] - direct) <= 1e-5, (family, layer, head)
    assert res.scores == res.raw_scores


def test_ablation_in_float32_batched_matches_one_head_per_pass():
    model = tiny_model("qwen2")
    adapter = adapter_for(model.config)
    batch = _batch("qwen2", 3, 16, seed=4)
    a = score_heads(model, adapter, [batch], method="ablation", objective="lm")
    b = score_heads(model, adapter, [batch], method="ablation", objective="lm", ablation_chunk=1)
    assert a.passes == 1 + 3 and b.passes == 1 + 12
    for ra, rb in zip(a.raw_scores, b.raw_scores):
        for x, y in zip(ra, rb):
            assert abs(x - y) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3", "gpt_neox"])
def test_taylor_equals_weight_times_weight_gradient(family):
    """TextPruner's |sum over the head's output-projection slice of W * dL/dW|, with real weight grads."""
    model = tiny_model(family).double()
    adapter = adapter_for(model.config)
    geo = adapter.geometry(model.config)
    batches = [_batch(family, 2, 12, seed=5), _batch(family, 2, 12, seed=6)]
    res = score_heads(model, adapter, batches, method="taylor", objective="lm", normalize="none")
    o_ht = next(ht for ht in adapter.tensors if ht.kinds == ("o",))
    expect = [[0.0] * g.num_heads for g in geo]
    n = 0.0
    for b in batches:
        model.zero_grad()
        out, _ = forward_output(model, b)
        losses, w = objective_losses("lm", out, b)
        (losses * w).sum().backward()
        n += float(w.sum())
        for i, g in enumerate(geo):
            weight = adapter.layer_module(model, i).get_parameter(o_ht.name)
            wg = extract_heads(weight.detach() * weight.grad, o_ht, g, "o")
            for h in range(g.num_heads):
                expect[i][h] += abs(float(wg[h].sum()))
    for i, g in enumerate(geo):
        for h in range(g.num_heads):
            assert res.raw_scores[i][h] == pytest.approx(expect[i][h] / n, rel=1e-9)


def _headless_bert():
    return tiny_model("bert").bert.double()


def test_kl_on_headless_encoder_uses_fisher_and_is_nonzero():
    model = _headless_bert()
    adapter = adapter_for(model.config)
    batch = {k: v for k, v in _batch("bert", 2, 12, seed=7).items() if k != "labels"}
    # first-order: exactly zero, the reason for the Fisher form
    with head_gates(model, adapter, requires_grad=True, dtype=torch.float64) as gates:
        out, is_logits = forward_output(model, batch)
        assert not is_logits
        d, w = objective_losses("kl", out, batch, out.detach(), False)
        grads = torch.autograd.grad((d * w).sum(), gates.values)
        assert max(float(g.abs().max()) for g in grads) < 1e-12
    res = score_heads(model, adapter, [batch], method="gradient", objective="kl", seed=3)
    assert res.estimator == "fisher" and res.baseline_loss == 0.0
    flat = [v for r in res.raw_scores for v in r]
    assert all(v > 0 for v in flat) and all(math.isfinite(v) for v in flat)
    again = score_heads(model, adapter, [batch], method="gradient", objective="kl", seed=3)
    other = score_heads(model, adapter, [batch], method="gradient", objective="kl", seed=4)
    assert again.raw_scores == res.raw_scores and other.raw_scores != res.raw_scores
    abl = score_heads(model, adapter, [batch], method="ablation", objective="kl")
    assert all(v > 0 for r in abl.raw_scores for v in r)


def test_fisher_on_headless_encoder_is_unbiased_for_the_curvature():
    """The Hutchinson Fisher of many copies of one example approaches the exact curvature
    (1/2N) * sum_t (2/s) |dO_t/dg|^2 (computed here from the full Jacobian)."""
    model = _headless_bert()
    adapter = adapter_for(model.config)
    batch = {k: v for k, v in _batch("bert", 1, 6, seed=8).items() if k != "labels"}
    geo = adapter.geometry(model.config)
    flat0 = torch.ones(sum(g.num_heads for g in geo), dtype=torch.float64)

    def outputs(flat):
        rows, k = [], 0
        for g in geo:
            rows.append(flat[k:k + g.num_heads])
            k += g.num_heads
        with head_gates(model, adapter, dtype=torch.float64) as gates:
            gates.values[:] = rows
            return forward_output(model, batch)[0]

    jac = torch.autograd.functional.jacobian(outputs, flat0)  # [1, T, D, heads]
    ref = outputs(flat0).detach()
    scale = float(ref.pow(2).sum(-1).mean())
    exact = (2 / scale) * jac.pow(2).sum((0, 1, 2)) / (2 * ref.shape[1])
    copies = 512  # each copy draws its own noise: the estimate averages over them
    many = {k: v.repeat(copies, 1) for k, v in batch.items()}
    res = score_heads(model, adapter, [many], method="gradient", objective="kl", seed=0)
    est = torch.tensor([v for r in res.raw_scores for v in r])
    rel = (est - exact).abs() / exact
    assert float(rel.median()) < 0.1 and float(rel.max()) < 0.35, rel


def test_fisher_for_a_language_model_with_kl_samples_labels_and_is_nonzero():
    model = tiny_model("llama")
    adapter = adapter_for(model.config)
    batch = {k: v for k, v in _batch("llama", 2, 12, seed=9).items() if k != "labels"}
    res = score_heads(model, adapter, [batch], method="gradient", objective="kl", seed=0)
    assert res.estimator == "fisher"
    assert all(v > 0 for r in res.raw_scores for v in r)
    with pytest.raises(UsageError, match="first-order"):
        score_heads(model, adapter, [batch], method="taylor", objective="kl")
    emp = score_heads(model, adapter, [_batch("llama", 2, 12, seed=9)], method="fisher", objective="lm")
    assert emp.estimator == "fisher" and all(v > 0 for r in emp.raw_scores for v in r)


def test_normalize_layer_gives_unit_rows_and_keeps_raw():
    model = tiny_model("gpt2")
    adapter = adapter_for(model.config)
    res = score_heads(model, adapter, [_batch("gpt2", 2, 12, seed=1)], method="gradient", objective="lm")
    assert res.normalize == "layer"
    for s_row, r_row in zip(res.scores, res.raw_scores):
        assert math.sqrt(sum(v * v for v in s_row)) == pytest.approx(1.0, rel=1e-12)
        norm = math.sqrt(sum(v * v for v in r_row))
        assert s_row == pytest.approx([v / norm for v in r_row], rel=1e-12)
    assert normalize_scores([[0.0, 0.0]], "layer") == [[0.0, 0.0]]


def test_normalize_geometric_divides_by_the_square_root_of_the_layer_norm():
    model = tiny_model("gpt2")
    adapter = adapter_for(model.config)
    res = score_heads(model, adapter, [_batch("gpt2", 2, 12, seed=1)], method="gradient", objective="lm",
                      normalize="geometric")
    assert res.normalize == "geometric"
    for s_row, r_row in zip(res.scores, res.raw_scores):
        norm = math.sqrt(sum(v * v for v in r_row))
        assert s_row == pytest.approx([v / norm ** 0.5 for v in r_row], rel=1e-12)
    assert normalize_scores([[0.0, 0.0]], "geometric") == [[0.0, 0.0]]


def test_iterative_records_removal_order_and_scores_agree_with_it():
    model = tiny_model("llama")
    adapter = adapter_for(model.config)
    batches = [_batch("llama", 2, 12, seed=1)]
    res = score_heads(model, adapter, batches, method="ablation", objective="lm", iterative=3, fraction=0.5)
    order = res.removal_order
    assert len(order) == 6 and len({tuple(x) for x in order}) == 6
    assert [len(r["removed"]) for r in res.rounds] == removal_counts(12, 3, 0.5, None) == [2, 2, 2]
    assert res.rounds[0]["heads_alive"] == 12 and res.rounds[2]["heads_alive"] == 8
    # every layer keeps a head; the removed heads are the lowest scores, in the order they fell
    for layer in range(3):
        assert any([layer, h] not in order for h in range(4))
    ranked = sorted(((v, i, j) for i, r in enumerate(res.scores) for j, v in enumerate(r)))
    assert {(i, j) for _, i, j in ranked[:4]} == {tuple(x) for x in order[:4]}
    first_four = [res.scores[i][j] for i, j in order[:4]]
    assert first_four == sorted(first_four)
    # round 2 ran with the first two heads gated off: its baseline loss is the gated model's
    assert res.rounds[1]["loss"] != res.rounds[0]["loss"]
    assert res.rounds[1]["raw_scores"][order[0][0]][order[0][1]] is None
    with pytest.raises(UsageError, match="iterative"):
        score_heads(model, adapter, None, method="random", iterative=2)
    # 0.9 of 12 heads is 11, but 3 layers keep a head each: the last round gated off fewer, silently
    with pytest.raises(UsageError, match="at most 9 can go; lower --fraction"):
        score_heads(model, adapter, batches, method="ablation", objective="lm", iterative=2, fraction=0.9)
    with pytest.raises(UsageError, match="at most 9 can go; lower --iterative-fraction"):
        score_heads(model, adapter, batches, method="gradient", objective="lm", iterative=3, iterative_fraction=0.3)


def test_removal_counts():
    assert removal_counts(270, 4, 0.3, None) == [20, 20, 20, 21]
    assert removal_counts(100, 3, None, 0.1) == [10, 10, 10]
    with pytest.raises(UsageError):
        removal_counts(10, 2, 1.5, None)


def test_magnitude_and_random_and_kv_groups():
    model = tiny_model("llama")
    adapter = adapter_for(model.config)
    geo = adapter.geometry(model.config)
    mag = score_heads(model, adapter, None, method="magnitude")
    assert mag.objective is None and mag.baseline_loss is None and mag.normalize == "none"
    attn = adapter.attention_module(model, 1)
    hd, g = 8, geo[1].group_size
    h = 3
    kv = h // g
    expect = (attn.q_proj.weight[h * hd:(h + 1) * hd].pow(2).sum() + attn.o_proj.weight[:, h * hd:(h + 1) * hd].pow(2).sum()
              + (attn.k_proj.weight[kv * hd:(kv + 1) * hd].pow(2).sum()
                 + attn.v_proj.weight[kv * hd:(kv + 1) * hd].pow(2).sum()) / g)
    assert mag.raw_scores[1][h] == pytest.approx(math.sqrt(float(expect)), rel=1e-6)
    assert magnitude_scores(model, adapter, geo) == mag.raw_scores
    r1, r2 = random_scores(geo, 1), random_scores(geo, 1)
    assert r1 == r2 and r1 != random_scores(geo, 2) and all(0 <= v < 1 for r in r1 for v in r)
    kv_scores = kv_group_scores(mag.scores, geo)
    assert kv_scores[0] == [mag.scores[0][0] + mag.scores[0][1], mag.scores[0][2] + mag.scores[0][3]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_models_score_in_float32(dtype):
    model = tiny_model("llama")
    adapter = adapter_for(model.config)
    batch = _batch("llama", 2, 12, seed=1)
    ref = score_heads(model, adapter, [batch], method="gradient", objective="lm")
    low = score_heads(model.to(dtype), adapter, [batch], method="gradient", objective="lm")
    for a, b in zip(ref.scores, low.scores):
        for x, y in zip(a, b):
            assert math.isfinite(y) and abs(x - y) < 0.1


def test_nonfinite_loss_names_the_batch():
    model = tiny_model("llama")
    adapter = adapter_for(model.config)
    good, bad = _batch("llama", 2, 8, seed=1), _batch("llama", 2, 8, seed=2)
    with torch.no_grad():
        model.model.embed_tokens.weight[int(bad["input_ids"][0, 0])] = float("nan")
    for method in ("gradient", "ablation"):
        with pytest.raises(HeadtoolError, match="batch 1"):
            score_heads(model, adapter, [good, bad], method=method, objective="lm")


def test_parameters_are_left_as_they_were():
    model = tiny_model("gpt2")
    adapter = adapter_for(model.config)
    model.train()
    score_heads(model, adapter, [_batch("gpt2", 2, 8, seed=1)], method="gradient", objective="lm")
    assert model.training and all(p.requires_grad and p.grad is None for p in model.parameters())
