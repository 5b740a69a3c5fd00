"""`headtool inspect` statistics on tiny models whose attention is set by hand.

The hand-built heads are real forwards, not hooks: a previous-token head from constant q/k
biases whose RoPE rotations peak at distance 1; a first-token head whose key reads an
embedding direction only the first token has; twins by copying one head's q slice and
output-projection columns into another head of the same KV group; uniform heads from zero q/k.
"""
from __future__ import annotations

import math

import pytest
import torch

from headtool.arch import adapter_for
from headtool.measure.inspection import head_output_maps, inspect_heads, o_weight_tensor
from headtool.arch.heads import extract_heads
from tiny_models import sample_ids, tiny_model

FIRST_ID = 1  # token id every row starts with in the hand-built llama


def _batch(ids: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids) if mask is None else mask}


@torch.no_grad()
def hand_built_llama() -> torch.nn.Module:
    """Layer 0: head 0 previous-token, head 2 first-token. Layer 1: heads 0 and 1 identical."""
    m = tiny_model("llama", attention_bias=True)
    ad = adapter_for(m.config)
    geo = ad.geometry(m.config)[0]
    hd = geo.head_dim
    inv_freq = m.model.rotary_emb.inv_freq  # [hd/2]; RoPE pairs components (k, k + hd/2)
    att0 = m.model.layers[0].self_attn
    q_rows = lambda h: slice(h * hd, (h + 1) * hd)  # noqa: E731 - separate q/k projections, head-major

    # previous token: q = u, k = R(omega) u per frequency pair -> logit ~ sum cos((1 - (i - j)) omega)
    s = 40.0
    att0.q_proj.weight[q_rows(0)] = 0
    att0.k_proj.weight[q_rows(0)] = 0
    qb, kb = torch.zeros(hd), torch.zeros(hd)
    for k in range(3):  # the three fastest frequencies; the slowest is left for the first-token head
        w = float(inv_freq[k])
        qb[k] = s
        kb[k], kb[k + hd // 2] = s * math.cos(w), s * math.sin(w)
    att0.q_proj.bias[q_rows(0)] = qb
    att0.k_proj.bias[q_rows(0)] = kb

    # first token: only FIRST_ID's embedding has a component on hidden dim 0; KV head 1 reads it
    emb = m.model.embed_tokens.weight
    emb[:, 0] = 0
    emb[FIRST_ID] = 0
    emb[FIRST_ID, 0] = 5.0
    slow = hd // 2 - 1  # slowest RoPE frequency: hardly rotates over a short sequence
    att0.k_proj.weight[q_rows(1)] = 0
    att0.k_proj.bias[q_rows(1)] = 0
    att0.k_proj.weight[hd + slow, 0] = 30.0
    att0.q_proj.weight[q_rows(2)] = 0
    att0.q_proj.bias[q_rows(2)] = 0
    att0.q_proj.bias[2 * hd + slow] = 30.0

    # twins in layer 1: query head 1 := query head 0 (both read KV head 0), same output columns
    att1 = m.model.layers[1].self_attn
    att1.q_proj.weight[q_rows(1)] = att1.q_proj.weight[q_rows(0)]
    att1.q_proj.bias[q_rows(1)] = att1.q_proj.bias[q_rows(0)]
    att1.o_proj.weight[:, q_rows(1)] = att1.o_proj.weight[:, q_rows(0)]
    return m


def _ids_starting_with_first(batch=3, seq=24) -> torch.Tensor:
    ids = sample_ids("llama", batch=batch, seq=seq)
    ids[ids == FIRST_ID] = 7
    ids[:, 0] = FIRST_ID
    return ids


def test_hand_built_heads_are_reported_exactly():
    m = hand_built_llama()
    r = inspect_heads(m, adapter_for(m.config), [_batch(_ids_starting_with_first())])
    st = r["statistics"]
    assert r["causal"] is True
    assert st["previous_token_mass"][0][0] > 0.999
    assert st["mean_distance"][0][0] == pytest.approx(1.0, abs=1e-2)
    assert st["entropy_normalized"][0][0] < 0.01
    assert st["first_token_mass"][0][2] > 0.999
    # the other heads are ordinary: neither property
    assert max(st["previous_token_mass"][0][h] for h in (1, 2, 3)) < 0.9
    assert max(st["first_token_mass"][0][h] for h in (0, 1, 3)) < 0.9
    # identical heads 0 and 1 of layer 1: each other's twin, similarity 1 in attention and output
    assert r["twins"]["attention"][1][:2] == [1, 0]
    assert r["twins"]["output"][1][:2] == [1, 0]
    assert st["twin_attention_similarity"][1][0] > 0.9999
    assert st["twin_output_similarity"][1][0] > 0.9999
    assert r["similarity"]["attention_cosine"][1][0][1] > 0.9999
    others = [r["similarity"]["attention"][1][i][j] for i in range(4) for j in range(4) if i < j and (i, j) != (0, 1)]
    assert max(others) < 0.99
    assert r["top_pairs"][0]["layer"] == 1 and r["top_pairs"][0]["heads"] == [0, 1]
    assert r["top_pairs"][0]["same_kv_group"] is True
    # GQA: query heads 0 and 1 share KV head 0, so that group's within-similarity is 1
    g = r["kv_groups"]
    assert g["group_size"] == [2, 2, 2]
    assert g["within_attention_similarity"][1][0] > 0.9999
    assert g["within_attention_similarity"][1][1] < 0.99
    assert len(g["between_attention_similarity"][1]) == 2


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_uniform_attention_matches_closed_forms(family):
    """Zero q/k: every head attends uniformly over the keys it may see; the figures have closed forms."""
    m = tiny_model(family)
    ad = adapter_for(m.config)
    geos = ad.geometry(m.config)
    with torch.no_grad():
        for i, g in enumerate(geos):
            layer = ad.layer_module(m, i)
            for ht in ad.tensors:
                t = layer.get_parameter(ht.name)
                for kind in ("q", "k"):
                    if kind in ht.kinds:
                        t.index_fill_(ht.axis, ht.positions(kind, g).reshape(-1), 0.0)
    T = 12
    ids = sample_ids(family, batch=2, seq=T)
    r = inspect_heads(m, ad, [_batch(ids)])
    st = r["statistics"]
    if family == "gpt2":  # causal: query i sees i + 1 keys; position 0 is skipped
        qs = range(1, T)
        dist = sum(i / 2 for i in qs) / len(qs)
        first = sum(1 / (i + 1) for i in qs) / len(qs)
        ent = sum(math.log(i + 1) for i in qs) / len(qs)
    else:  # bidirectional: every query sees all T keys
        qs = range(T)
        dist = sum(sum(abs(i - j) for j in range(T)) / T for i in qs) / T
        first = 1 / T
        ent = math.log(T)
    assert r["causal"] is (family == "gpt2")
    for layer in range(len(geos)):
        for h in range(geos[layer].num_heads):
            assert st["entropy_normalized"][layer][h] == pytest.approx(1.0, abs=1e-5)
            assert st["entropy"][layer][h] == pytest.approx(ent, abs=1e-4)
            assert st["mean_distance"][layer][h] == pytest.approx(dist, abs=1e-4)
            assert st["first_token_mass"][layer][h] == pytest.approx(first, abs=1e-5)
            assert st["twin_attention_similarity"][layer][h] == pytest.approx(1.0, abs=1e-5)
    if family == "gpt2":
        prev = sum(1 / (i + 1) for i in range(1, T)) / (T - 1)
        assert st["previous_token_mass"][0][0] == pytest.approx(prev, abs=1e-5)
    assert r["kv_groups"] is None


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_head_outputs_sum_to_the_output_projection(family):
    """x_h @ maps[h] over heads + bias equals o_proj(x): the Linear / Conv1D axis is right."""
    m = tiny_model(family)
    ad = adapter_for(m.config)
    geo = ad.geometry(m.config)[0]
    ht = o_weight_tensor(ad)
    maps = head_output_maps(m, ad, 0, geo)
    x = torch.randn(5, geo.num_heads * geo.head_dim)
    pos = ht.positions("o", geo)
    total = sum(x[:, pos[h]] @ maps[h] for h in range(geo.num_heads))
    o = ad.o_proj_module(m, 0)
    bias = o.bias if getattr(o, "bias", None) is not None else 0
    with torch.no_grad():
        torch.testing.assert_close(total + bias, o(x), atol=1e-5, rtol=1e-5)
    assert maps.shape == extract_heads(o.weight.detach(), ht, geo, "o").shape


@pytest.mark.parametrize("family,side", [("llama", "right"), ("llama", "left"), ("bert", "right")])
def test_padding_is_masked(family, side):
    """A padded row gives the same statistics as the same tokens without padding."""
    m = hand_built_llama() if family == "llama" else tiny_model(family)
    ad = adapter_for(m.config)
    full = _ids_starting_with_first(batch=2, seq=16) if family == "llama" else sample_ids(family, batch=2, seq=16)
    n = 10
    short = full[1:, :n]
    pad = torch.full((1, 16 - n), 0, dtype=torch.long)
    row = torch.cat([short, pad], 1) if side == "right" else torch.cat([pad, short], 1)
    mask = torch.cat([torch.ones(1, n), torch.zeros(1, 16 - n)], 1) if side == "right" else \
        torch.cat([torch.zeros(1, 16 - n), torch.ones(1, n)], 1)
    padded = _batch(torch.cat([full[:1], row]), torch.cat([torch.ones(1, 16), mask]).long())
    a = inspect_heads(m, ad, [padded])
    b = inspect_heads(m, ad, [_batch(full[:1]), _batch(short)])
    assert a["query_positions"] == b["query_positions"]
    for key, va in a["statistics"].items():
        torch.testing.assert_close(torch.tensor(va), torch.tensor(b["statistics"][key]), atol=2e-4, rtol=1e-3,
                                   msg=lambda s: f"{key}: {s}")
    torch.testing.assert_close(torch.tensor(a["similarity"]["attention"]), torch.tensor(b["similarity"]["attention"]),
                               atol=2e-4, rtol=1e-3)


def test_inspect_restores_the_attention_implementation():
    m = tiny_model("llama")
    before = m.config._attn_implementation
    inspect_heads(m, adapter_for(m.config), [_batch(sample_ids("llama", batch=1, seq=8))])
    assert m.config._attn_implementation == before
