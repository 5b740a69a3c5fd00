"""What each attention head does, measured: entropy, distance, sink and previous-token mass, redundancy.

All statistics come from the attention probabilities of real forwards (eager attention, the
only implementation that returns them) and from each head's contribution to the layer output
(its slice of the output-projection input times its output-projection columns). Numbers only:
nothing here names a head's "role".

Which positions count. A query position is used when it is a real token (attention_mask 1)
and it can attend to at least two keys; in a causal model that skips position 0, whose
attention is forced. The keys a query *can* attend to are the real (non-padding) keys that
receive non-zero probability from at least one head of the layer: this is the model's own
causal / sliding-window mask, found without knowing the family. "First token" is the first
real token of each row (so left padding is handled); "previous token" is used only where
the previous position is a real, attendable key.
"""
from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from ..arch import Adapter, HeadTensor, LayerHeads
from ..console import progress
from ..data.batches import to_device
from ..errors import UsageError
from ..model.latent import LatentAttention, latent_spec
from ..model.placement import input_device, readable_tensor
from .gates import capture_o_proj_inputs

FORMAT = "headtool.inspect/1"
LN2 = math.log(2.0)

#: Per-head statistics (layers x heads) in the order they are reported and plotted.
HEAD_STATS = (
    "entropy",
    "entropy_normalized",
    "mean_distance",
    "first_token_mass",
    "previous_token_mass",
    "twin_attention_similarity",
    "twin_output_similarity",
    "output_rms",
)

DEFINITIONS = {
    "entropy": "entropy of the attention distribution in nats, mean over used query positions",
    "entropy_normalized": "entropy / ln(number of keys the query can attend to); 0 = one key, 1 = uniform",
    "mean_distance": "expected |query position - key position| in tokens under the attention distribution",
    "first_token_mass": "attention probability on the first real token of the row (attention sink)",
    "previous_token_mass": "attention probability on the immediately preceding token",
    "attention_similarity": "1 - JS(p_a, p_b) / ln 2, Jensen-Shannon divergence of two heads' attention "
                            "rows, mean over used query positions; 1 = identical distributions",
    "attention_cosine": "cosine of two heads' attention probability rows, mean over used query positions",
    "output_similarity": "cosine of two heads' contributions to the layer output (head slice of the "
                         "output-projection input times its output-projection columns, no bias), "
                         "over all real tokens as one vector",
    "twin": "the other head of the same layer with the highest similarity",
    "output_rms": "root mean square of the head's output contribution per real token (its size)",
    "kv_groups": "per KV head: mean pairwise similarity of the query heads that share it (within), "
                 "and mean similarity between the query heads of two groups (between)",
    "query positions": "real tokens that can attend to at least two keys (causal models skip position 0); "
                       "previous-token mass only where the previous position is a real, attendable key",
}


# --------------------------------------------------------------------------- eager attention


@contextmanager
def eager_attention(model) -> Iterator[None]:
    """Run `model` with eager attention inside (the only kind that returns probabilities)."""
    before = getattr(model.config, "_attn_implementation", None)
    switch = before not in (None, "eager")
    if switch:
        try:
            model.set_attn_implementation("eager")
        except (ValueError, AttributeError) as e:
            raise UsageError(f"this model cannot switch to eager attention, which inspect needs: {e}") from e
    try:
        yield
    finally:
        if switch:
            model.set_attn_implementation(before)


def _latent_probs(model, batch: dict) -> tuple[torch.Tensor, ...]:
    """Latent attention (convert-mla): transformers records attention maps only from the family's
    own attention classes, so read them from each LatentAttention's output (its eager attention
    returns the per-query-head probabilities, in layer order)."""
    mods = [m for m in model.modules() if isinstance(m, LatentAttention)]
    got: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, i=i: got.__setitem__(i, out[1]))
             for i, m in enumerate(mods)]
    try:
        model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    finally:
        for h in hooks:
            h.remove()
    if len(got) != len(mods) or any(got[i] is None for i in got):
        raise UsageError("the latent attention layers returned no attention probabilities; inspect needs eager "
                         "attention")
    return tuple(got[i] for i in range(len(mods)))


def attention_probs(model, batch: dict) -> tuple[torch.Tensor, ...]:
    """Attention probabilities of every layer, each [B, H, T, T] (the model must be eager)."""
    if latent_spec(model.config):
        return _latent_probs(model, batch)
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                output_attentions=True)
    atts = getattr(out, "attentions", None)
    if not atts or any(a is None for a in atts):
        raise UsageError("the model returned no attention probabilities (output_attentions); "
                         "inspect needs a model whose eager attention returns them")
    return tuple(atts)


def o_weight_tensor(adapter: Adapter) -> HeadTensor:
    """The layout of the output-projection weight (one 'o' slice per query head)."""
    for ht in adapter.tensors:
        if ht.kinds == ("o",) and ht.name.endswith("weight"):
            return ht
    raise UsageError(f"family {adapter.family}: no output-projection weight layout")


def head_output_maps(model, adapter: Adapter, layer: int, geo: LayerHeads) -> torch.Tensor:
    """[H, head_dim, hidden]: head h's output contribution is x_h @ maps[h] (Linear or Conv1D
    alike, and latent attention's o_proj, a Linear in every family)."""
    module = adapter.o_proj_module(model, layer)
    w = readable_tensor(module).detach().float()
    w = w.T if adapter.o_axis(module) == 1 else w  # [heads x head_dim, hidden]
    return w.reshape(geo.num_heads, geo.head_dim, -1)


# --------------------------------------------------------------------------- accumulation


@dataclass
class _LayerAcc:
    """Sums over batches of one layer (divide by the counts at the end)."""

    geo: LayerHeads
    ent: torch.Tensor
    ent_norm: torch.Tensor
    dist: torch.Tensor
    first: torch.Tensor
    prev: torch.Tensor
    js: torch.Tensor  # [H, H] summed JS divergence
    cos: torch.Tensor  # [H, H] summed row cosine
    gram: torch.Tensor  # [H, H] of output contributions
    n_query: float = 0.0
    n_prev: float = 0.0
    n_tokens: float = 0.0

    @classmethod
    def new(cls, geo: LayerHeads) -> "_LayerAcc":
        h = geo.num_heads
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        return cls(geo, z(h), z(h), z(h), z(h), z(h), z(h, h), z(h, h), z(h, h))


def _row_entropy(p: torch.Tensor) -> torch.Tensor:
    return -torch.special.xlogy(p, p).sum(-1)


def _masks(p: torch.Tensor, key_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(allowed [B,T,T] keys each query can attend to, used queries [B,T], n_allowed [B,T])."""
    allowed = (p > 0).any(dim=1) & key_valid[:, None, :]
    n_allowed = allowed.sum(-1)
    used = key_valid & (n_allowed >= 2)
    return allowed, used, n_allowed


def _accumulate_attention(acc: _LayerAcc, p: torch.Tensor, key_valid: torch.Tensor) -> bool:
    """Add one batch's attention statistics of a layer; returns whether the layer looked causal."""
    p = p.float()
    B, H, T, _ = p.shape
    allowed, used, n_allowed = _masks(p, key_valid)
    w = used.float()  # [B, T]
    acc.n_query += float(w.sum())

    ent = _row_entropy(p)  # [B, H, T]
    acc.ent += (ent * w[:, None]).sum((0, 2)).double()
    norm = torch.log(n_allowed.clamp_min(2).float())  # [B, T]
    acc.ent_norm += (ent / norm[:, None] * w[:, None]).sum((0, 2)).double()

    pos = torch.arange(T, device=p.device, dtype=torch.float32)
    gap = (pos[:, None] - pos[None, :]).abs()  # [T, T]
    acc.dist += ((p * gap).sum(-1) * w[:, None]).sum((0, 2)).double()

    first_idx = key_valid.float().argmax(-1)  # first real token of each row
    first = p.gather(-1, first_idx.view(B, 1, 1, 1).expand(B, H, T, 1))[..., 0]
    acc.first += (first * w[:, None]).sum((0, 2)).double()

    if T > 1:
        prev = torch.diagonal(p, offset=-1, dim1=-2, dim2=-1)  # [B, H, T-1]: p[i, i-1] for i >= 1
        prev_ok = used[:, 1:] & torch.diagonal(allowed, offset=-1, dim1=-2, dim2=-1)
        wp = prev_ok.float()
        acc.prev += (prev * wp[:, None]).sum((0, 2)).double()
        acc.n_prev += float(wp.sum())

    # pairwise: Jensen-Shannon via H(m) - (H(p)+H(q))/2, and the cosine of the rows
    rows_norm = p.norm(dim=-1).clamp_min(1e-30)  # [B, H, T]
    for a in range(H):
        m = 0.5 * (p[:, a:a + 1] + p)  # [B, H, T, T]
        js = (_row_entropy(m) - 0.5 * (ent[:, a:a + 1] + ent)).clamp_min(0)
        acc.js[a] += (js * w[:, None]).sum((0, 2)).double()
        dot = (p[:, a:a + 1] * p).sum(-1) / (rows_norm[:, a:a + 1] * rows_norm)
        acc.cos[a] += (dot * w[:, None]).sum((0, 2)).double()
    return bool(not allowed.triu(1).any())


def _accumulate_outputs(acc: _LayerAcc, x: torch.Tensor, maps: torch.Tensor, ht: HeadTensor,
                        key_valid: torch.Tensor) -> None:
    """Add the Gram matrix of the heads' output contributions over real tokens."""
    geo = acc.geo
    pos = ht.positions("o", geo).to(x.device)  # [H, hd] indices into the o_proj input
    xv = x.float()[key_valid]  # [N, H*hd]
    xh = xv[:, pos]  # [N, H, hd]
    y = torch.einsum("nhd,hdo->hno", xh, maps.to(x.device))  # [H, N, hidden]
    y = y.reshape(geo.num_heads, -1)
    acc.gram += (y @ y.T).double().cpu()
    acc.n_tokens += float(key_valid.sum())


# --------------------------------------------------------------------------- summaries


def _twins(sim: torch.Tensor) -> tuple[list[int | None], list[float | None]]:
    h = sim.shape[0]
    if h < 2:
        return [None] * h, [None] * h
    s = sim.clone()
    s.fill_diagonal_(-math.inf)
    val, idx = s.max(-1)
    return [int(i) for i in idx], [float(v) for v in val]


def _group_matrix(sim: torch.Tensor, geo: LayerHeads) -> tuple[list[float | None], list[list[float]]]:
    """(within-group mean pairwise similarity per KV head, KV x KV mean between-group similarity)."""
    nkv = geo.num_kv_heads
    within: list[float | None] = []
    between = [[0.0] * nkv for _ in range(nkv)]
    for a in range(nkv):
        qa = geo.query_heads_of(a)
        g = len(qa)
        if g > 1:
            block = sim[qa][:, qa]
            within.append(float((block.sum() - block.diagonal().sum()) / (g * (g - 1))))
        else:
            within.append(None)
        for b in range(nkv):
            qb = geo.query_heads_of(b)
            between[a][b] = float(sim[qa][:, qb].mean()) if a != b else (within[-1] if g > 1 else 1.0)
    return within, between


def _round(x: Any, nd: int = 6) -> Any:
    if isinstance(x, float):
        return round(x, nd)
    if isinstance(x, list):
        return [_round(v, nd) for v in x]
    return x


def _finish(accs: list[_LayerAcc], causal: bool, top: int) -> dict[str, Any]:
    stats: dict[str, list] = {k: [] for k in HEAD_STATS}
    sim_att, sim_cos, sim_out, twins_att, twins_out = [], [], [], [], []
    pairs = []
    grouped = any(a.geo.num_heads > a.geo.num_kv_heads for a in accs)
    groups: dict[str, list] = {"within_attention_similarity": [], "within_output_similarity": [],
                               "between_attention_similarity": [], "between_output_similarity": []}
    for layer, a in enumerate(accs):
        nq = max(a.n_query, 1.0)
        stats["entropy"].append((a.ent / nq).tolist())
        stats["entropy_normalized"].append((a.ent_norm / nq).tolist())
        stats["mean_distance"].append((a.dist / nq).tolist())
        stats["first_token_mass"].append((a.first / nq).tolist())
        stats["previous_token_mass"].append((a.prev / max(a.n_prev, 1.0)).tolist() if a.n_prev else
                                            [0.0] * a.geo.num_heads)
        att = (1.0 - (a.js / nq) / LN2).clamp(0.0, 1.0)
        att.fill_diagonal_(1.0)
        cos = a.cos / nq
        cos.fill_diagonal_(1.0)
        d = a.gram.diagonal().clamp_min(1e-30).sqrt()
        out = (a.gram / (d[:, None] * d[None, :])).clamp(-1.0, 1.0)
        out.fill_diagonal_(1.0)
        stats["output_rms"].append((a.gram.diagonal().clamp_min(0) / max(a.n_tokens, 1.0)).sqrt().tolist())
        ti, tv = _twins(att)
        oi, ov = _twins(out)
        stats["twin_attention_similarity"].append(tv)
        stats["twin_output_similarity"].append(ov)
        twins_att.append(ti)
        twins_out.append(oi)
        sim_att.append(att.tolist())
        sim_cos.append(cos.tolist())
        sim_out.append(out.tolist())
        h = a.geo.num_heads
        for i in range(h):
            for j in range(i + 1, h):
                pairs.append({"layer": layer, "heads": [i, j], "attention_similarity": float(att[i, j]),
                              "output_similarity": float(out[i, j]),
                              "same_kv_group": a.geo.kv_head_of(i) == a.geo.kv_head_of(j)})
        if grouped:
            wa, ba = _group_matrix(att, a.geo)
            wo, bo = _group_matrix(out, a.geo)
            groups["within_attention_similarity"].append(wa)
            groups["within_output_similarity"].append(wo)
            groups["between_attention_similarity"].append(ba)
            groups["between_output_similarity"].append(bo)
    pairs.sort(key=lambda r: (-r["attention_similarity"], r["layer"], r["heads"]))
    return {
        "causal": causal,
        "statistics": {k: _round(v) for k, v in stats.items()},
        "twins": {"attention": twins_att, "output": twins_out},
        "similarity": {"attention": _round(sim_att), "attention_cosine": _round(sim_cos),
                       "output": _round(sim_out)},
        # a layer's group size, or its groups' sizes where they differ (prune --unit head)
        "kv_groups": ({"group_size": [list(a.geo.sizes()) if a.geo.uneven else a.geo.group_size for a in accs],
                       **{k: _round(v) for k, v in groups.items()}} if grouped else None),
        "top_pairs": [{**p, "attention_similarity": round(p["attention_similarity"], 6),
                       "output_similarity": round(p["output_similarity"], 6)} for p in pairs[:top]],
        "query_positions": int(sum(a.n_query for a in accs[:1])),
        "tokens": int(sum(a.n_tokens for a in accs[:1])),
        "definitions": DEFINITIONS,
    }


# --------------------------------------------------------------------------- entry points


@torch.no_grad()
def inspect_heads(model, adapter: Adapter, batches: Sequence[dict], *, top: int = 10,
                  label: str = "inspect") -> dict[str, Any]:
    """Per-head attention statistics and redundancy of `model` on `batches` (see module doc)."""
    if not batches:
        raise UsageError("inspect needs at least one batch of data")
    geometry = adapter.geometry(model.config)
    if latent_spec(model.config):  # every query head reads the one latent: a single "KV group" per layer
        geometry = [dataclasses.replace(g, num_kv_heads=1, group_sizes=None) for g in geometry]
    accs = [_LayerAcc.new(g) for g in geometry]
    ht = o_weight_tensor(adapter)
    maps = [head_output_maps(model, adapter, i, g) for i, g in enumerate(geometry)]
    device = input_device(model)
    causal = True
    t0 = time.perf_counter()
    with eager_attention(model), progress() as bar:
        task = bar.add_task(label, total=len(batches), rate="")
        for batch in batches:
            b = to_device(batch, device)
            key_valid = b.get("attention_mask")
            key_valid = torch.ones_like(b["input_ids"], dtype=torch.bool) if key_valid is None else key_valid.bool()
            store: dict[int, list[torch.Tensor]] = {}
            with capture_o_proj_inputs(model, adapter, range(len(geometry)), store):
                atts = attention_probs(model, b)
            if len(atts) != len(geometry):
                raise UsageError(f"the model returned {len(atts)} attention maps for {len(geometry)} layers")
            for i, (acc, p) in enumerate(zip(accs, atts)):
                if p.shape[1] != acc.geo.num_heads:
                    raise UsageError(f"layer {i}: {p.shape[1]} attention heads, geometry says {acc.geo.num_heads}")
                causal &= _accumulate_attention(acc, p, key_valid)
                _accumulate_outputs(acc, store[i][-1], maps[i], ht, key_valid)
            bar.update(task, advance=1)
    result = _finish(accs, causal, top)
    result["elapsed_s"] = round(time.perf_counter() - t0, 3)
    return result


@torch.no_grad()
def attention_pattern(model, input_ids: torch.Tensor, heads: Sequence[tuple[int, int]]) -> dict[tuple[int, int], torch.Tensor]:
    """[T, T] attention probabilities of the chosen (layer, head)s on one example [1, T]."""
    device = input_device(model)
    ids = input_ids.to(device)
    with eager_attention(model):
        atts = attention_probs(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return {(l, h): atts[l][0, h].float().cpu() for l, h in heads}
