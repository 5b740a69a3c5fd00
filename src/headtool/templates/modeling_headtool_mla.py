# Written by headtool into a checkpoint converted to multi-head latent attention (convert-mla).
#
# Every attention layer of the original family is replaced by latent attention: one latent
# vector per token (kv_rank dims) plus one rotary key shared by all query heads (rope_dim dims)
# is all the KV cache holds; each query head expands the latent into its own key (no-RoPE part)
# and value with the up-projection `kv_b_proj`. The table in config.json ("headtool_mla")
# describes the layers; the rest of the model is the family's own code. It needs only torch and
# transformers; load with
#     AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
# headtool itself builds converted models in memory with the same classes (headtool.model.latent).
#
# Two equal ways to compute a layer (the same numbers up to rounding):
# - plain: expand the cached latent into per-head keys and values, then attention;
# - absorbed (decode): fold the key up-projection into the query (q_nope^T W_uk) and attend over
#   the latent itself, one shared "head" for all query heads; the value up-projection is applied
#   to the attention-weighted latent afterwards, next to the output projection.
# `absorb` in the table (or the attribute on each attention module): "auto" (absorbed for a
# single query token, i.e. decoding), true or false.
# Decoding without gradients, the absorbed path folds the up-projections into the query and output
# projections once (refolded whenever a weight changes) where the latent is no wider than one
# head's key and value; with eager and sdpa attention it computes all query heads as rows against
# the one latent "head": no per-head copies of the cache, no slow kernel for keys longer than values.
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

MLA_KEY = "headtool_mla"


def _get(obj, key, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def _of_layer(spec, key: str, layer_idx: int, default=None):
    """A table entry that is one value for all layers or a list with one per layer (`default`
    where the table has no such entry: folders written before it)."""
    value = spec[key] if default is None or key in spec else default
    return value[layer_idx] if isinstance(value, (list, tuple)) else value


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_weights(scores, attention_mask, softcap, dtype):
    """Softmax of scaled scores [..., T], soft-capped as Gemma 2 when `softcap`, under a boolean or
    additive mask [b, 1 or heads, t, >= T]."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : scores.shape[-1]]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    return nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None,
                            **kwargs):
    """Plain softmax attention (scores soft-capped as Gemma 2 when `softcap`); key/value heads are
    shared by `module.num_key_value_groups` query heads."""
    groups = module.num_key_value_groups
    if groups > 1:
        b, n, t, d = key.shape
        key = key[:, :, None].expand(b, n, groups, t, d).reshape(b, n * groups, t, d)
        value = value[:, :, None].expand(b, n, groups, t, value.shape[-1]).reshape(b, n * groups, t, -1)
    weights = attention_weights(torch.matmul(query, key.transpose(2, 3)) * scaling, attention_mask, softcap,
                                query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


class LatentAttention(nn.Module):
    """Multi-head latent attention with a decoupled rotary key, laid out as DeepSeek-V2/V3 with
    q_lora_rank = None and no norm on the latent, except for the query when factored_query:

    q_proj:             hidden -> heads x head_dim                   the original query heads
    q_rope_proj:        per head head_dim -> rope_dim                the rotary query, from the head's query
                        (without factored_query, folders written before it: q_proj gives
                        hidden -> heads x (qk_nope_dim + rope_dim), [q_nope | q_rope] per head)
    kv_a_proj_with_mqa: hidden -> kv_rank + rope_dim                 [latent | shared rotary key]
    kv_b_proj:          kv_rank -> heads x (qk_nope_dim + v_head_dim) [W_uk | W_uv] per head, no bias
    o_proj:             heads x v_head_dim -> hidden
    The rotary part is rope_dim / 2 complex planes, slot s turning with the frequency of plane
    rope_planes[s] of the original heads (rotate_half pairs (s, s + rope_dim / 2)).
    """

    def __init__(self, config, layer_idx: int, spec: dict, source: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        # one value for all layers, or one per layer (a pruned or merged source)
        self.num_heads = int(_of_layer(spec, "num_heads", layer_idx))
        self.qk_nope_dim = int(_of_layer(spec, "qk_nope_dim", layer_idx))
        self.rope_dim = int(spec["rope_dim"])
        self.v_head_dim = int(spec["v_head_dim"])
        self.kv_rank = int(spec["kv_rank"][layer_idx])
        self.rope_planes = [int(p) for p in spec["rope_planes"][layer_idx]]
        self.rotary_half = int(spec["rotary_dim"]) // 2
        self._every_plane = self.rope_planes == list(range(self.rotary_half))
        self.scaling = float(_of_layer(spec, "scaling", layer_idx))  # GPT-2 can scale by 1 / layer
        self.absorb = spec.get("absorb", "auto")
        self.is_causal = True
        # dropout in training as the attention it replaces: on the attention weights and, where that
        # module dropped out its own output (GPT-2), after the output projection
        self.attention_dropout = float(_of_layer(spec, "attention_dropout", layer_idx, 0.0))
        self.output_dropout = nn.Dropout(float(_of_layer(spec, "output_dropout", layer_idx, 0.0)))
        self.num_key_value_groups = 1  # set per call: 1 (plain) or num_heads (absorbed: one latent head)
        # passed on to the attention function as the family's attention does (the mask already
        # limits a sliding layer; flash kernels read the window from here)
        self.sliding_window = (spec.get("sliding_window") or [None] * (layer_idx + 1))[layer_idx]
        self.softcap = spec.get("softcap")  # Gemma 2: tanh soft-capping of the scores
        hidden = int(spec["hidden_size"])
        h = self.num_heads
        # qk-normed families (Qwen 3, Gemma 3) norm every query and key head before RoPE: the layer
        # keeps the original q/k projections and norms (the norms from `source`, the attention it
        # replaces) and takes the latent and the rotary key over [normed keys, hidden state] (the
        # value projection folded in), the rotary queries per head over the normed query
        # (q_rope_proj [heads x rope_dim, head_dim]); the no-RoPE query is the normed query itself
        self.qk_norm = bool(spec.get("qk_norm"))
        # factored query (what convert-mla writes; normed heads always had it): q_proj keeps the
        # original heads and each head's rotary query is q_rope_proj [heads x rope_dim, head_dim]
        # over that head's query, where the DeepSeek layout computes both from the hidden state
        # (rope_dim x hidden more weights per head); tables without the key are that older layout
        self.factored_query = bool(spec.get("factored_query", self.qk_norm))
        if self.qk_norm:
            if source is None:
                raise ValueError("latent attention over normed heads is built from the attention it replaces")
            kv_heads, d = int(_of_layer(spec, "source_num_kv_heads", layer_idx)), self.v_head_dim
            # the projections at this layer's head counts (a pruned source has its own per layer),
            # the norms (per head dim, the family's own classes) as they are
            for name, heads in (("q_proj", h), ("k_proj", kv_heads)):
                setattr(self, name, nn.Linear(hidden, heads * d, bias=getattr(source, name).bias is not None))
            self.q_norm, self.k_norm = source.q_norm, source.k_norm
            self.kv_a_proj_with_mqa = nn.Linear(kv_heads * d + hidden, self.kv_rank + self.rope_dim,
                                                bias=bool(spec["kv_bias"]))
        else:  # the original query heads (factored), or [q_nope | q_rope] rows per head (older folders)
            q_width = self.v_head_dim if self.factored_query else self.qk_nope_dim + self.rope_dim
            self.q_proj = nn.Linear(hidden, h * q_width, bias=bool(spec["q_bias"]))
            self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.rope_dim, bias=bool(spec["kv_bias"]))
        if self.factored_query:
            self.q_rope_proj = nn.Parameter(torch.zeros(h * self.rope_dim, self.v_head_dim))
        self.kv_b_proj = nn.Linear(self.kv_rank, h * (self.qk_nope_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_head_dim, hidden, bias=bool(spec["o_bias"]))
        self._index: dict = {}
        self._folded: tuple | None = None  # (key of the weights it was made from, q weight, q bias, o weight)

    def _slots(self, device) -> torch.Tensor:
        """Columns of the model's (cos, sin) that the rotary slots turn with."""
        if device not in self._index:
            p = torch.tensor(self.rope_planes, dtype=torch.long)
            self._index[device] = torch.cat([p, p + self.rotary_half]).to(device)
        return self._index[device]

    def _absorbed(self, q_len: int) -> bool:
        if self.absorb == "auto":
            return q_len == 1
        return bool(self.absorb)

    def _folds(self) -> bool:
        """Whether to fold the up-projections into q_proj and o_proj: at the ranks a cache saving
        needs (a latent no wider than one head's key and value), where the folded weights are about
        the size of the originals and save two small per-head products a step; not near full rank."""
        return self.kv_rank <= self.qk_nope_dim + self.v_head_dim and not self.qk_norm  # a norm sits in between

    def _folded_weights(self):
        """(q weight, q bias, o weight) with the key up-projection folded into the query's no-RoPE
        part and the value up-projection into the output; cached until a weight changes."""
        params = (self.q_proj.weight, self.q_proj.bias, getattr(self, "q_rope_proj", None), self.kv_b_proj.weight,
                  self.o_proj.weight)
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) if p is not None else None for p in params)
        if self._folded is None or self._folded[0] != key:
            h, nope, rope, rank, vd = (self.num_heads, self.qk_nope_dim, self.rope_dim, self.kv_rank,
                                       self.v_head_dim)
            dtype = self.q_proj.weight.dtype
            w = self.kv_b_proj.weight.float().view(h, nope + vd, rank)
            bq = self.q_proj.bias.float() if self.q_proj.bias is not None else None
            if self.factored_query:  # the DeepSeek layout's rows: [the head's query | its rotary query]
                wh = self.q_proj.weight.float().view(h, vd, -1)
                m = self.q_rope_proj.float().view(h, rope, vd)
                wq = torch.cat([wh[:, :nope], torch.einsum("hrd,hdi->hri", m, wh)], dim=1)
                if bq is not None:
                    bh = bq.view(h, vd)
                    bq = torch.cat([bh[:, :nope], torch.einsum("hrd,hd->hr", m, bh)], dim=1)
            else:
                wq = self.q_proj.weight.float().view(h, nope + rope, -1)
            q_w = torch.cat([torch.einsum("hdr,hdi->hri", w[:, :nope], wq[:, :nope]), wq[:, nope:]], dim=1)
            q_b = None
            if bq is not None:
                bq = bq.view(h, nope + rope)
                q_b = torch.cat([torch.einsum("hdr,hd->hr", w[:, :nope], bq[:, :nope]), bq[:, nope:]], dim=1)
                q_b = q_b.reshape(-1).to(dtype)
            wo = self.o_proj.weight.float().view(-1, h, vd)
            o_w = torch.einsum("ohv,hvr->ohr", wo, w[:, nope:]).reshape(wo.shape[0], h * rank)
            self._folded = (key, q_w.reshape(-1, q_w.shape[-1]).to(dtype), q_b, o_w.to(dtype))
        return self._folded[1:]

    def _latent_rows_attention(self, query, key, latent, attention_mask):
        """Absorbed attention with every query head as rows against the single latent head:
        query [b, h, t, d], key [b, 1, T, d], latent [b, 1, T, r] -> ([b, t, h, r], weights)."""
        b, h, t, d = query.shape
        total = key.shape[2]
        # scaling the h x t query rows costs less than scaling the h x t x T scores
        scores = torch.bmm((query * self.scaling).reshape(b, h * t, d), key[:, 0].transpose(1, 2))
        if attention_mask is None and t > 1:  # no mask given: causal, the queries being the last t positions
            attention_mask = torch.ones(t, total, dtype=torch.bool, device=scores.device).tril(total - t)[None, None]
        weights = attention_weights(scores.view(b, h, t, total), attention_mask, self.softcap, query.dtype)
        out = torch.bmm(weights.view(b, h * t, total), latent[:, 0]).view(b, h, t, -1)
        return out.transpose(1, 2), weights

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, layer_past=None, **kwargs):
        # the families name the cache differently (GPT-NeoX: layer_past)
        cache = next((c for c in (cache, past_key_values, layer_past) if c is not None), None)
        b, t = hidden_states.shape[:2]
        h, nope, rope, rank, vd = self.num_heads, self.qk_nope_dim, self.rope_dim, self.kv_rank, self.v_head_dim
        absorbed = self._absorbed(t)
        folded = (self._folded_weights() if absorbed and nope and not torch.is_grad_enabled() and self._folds()
                  else None)
        if folded is not None:  # the query arrives in latent space: [q_nope W_uk | q_rope] per head
            q = nn.functional.linear(hidden_states, folded[0], folded[1]).view(b, t, h, rank + rope).transpose(1, 2)
            q_lat, q_rope = q.split([rank, rope], dim=-1)
        elif self.factored_query:
            qn = self.q_proj(hidden_states).view(b, t, -1, vd)  # [b, t, h, head_dim]
            if self.qk_norm:
                qn = self.q_norm(qn)
            q_rope = torch.einsum("bthd,hrd->bhtr", qn, self.q_rope_proj.view(h, rope, vd))
            q_nope = qn.transpose(1, 2)[..., :nope]
        else:
            q = self.q_proj(hidden_states).view(b, t, h, nope + rope).transpose(1, 2)
            q_nope, q_rope = q.split([nope, rope], dim=-1)
        if self.qk_norm:
            k = self.k_norm(self.k_proj(hidden_states).view(b, t, -1, vd)).reshape(b, t, -1)
            features = torch.cat([k, hidden_states], dim=-1)
        else:
            features = hidden_states
        latent, k_rope = self.kv_a_proj_with_mqa(features).split([rank, rope], dim=-1)
        k_rope = k_rope.reshape(b, 1, t, rope)
        if rope:  # families without RoPE (GPT-2, OPT: learned positions) have no rotary key
            cos, sin = position_embeddings
            if not (self._every_plane and cos.shape[-1] == rope):  # else the slots are the columns, in order
                idx = self._slots(cos.device)
                cos, sin = cos[..., idx], sin[..., idx]
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q_rope = q_rope * cos + rotate_half(q_rope) * sin
            k_rope = k_rope * cos + rotate_half(k_rope) * sin
        # what a token leaves in the cache: its latent and the shared rotary key side by side, one
        # [b, 1, t, kv_rank + rope_dim] tensor in the cache's key slot (the value slot holds no
        # dims): nothing per head, and the absorbed path attends over it without copying it
        keys = torch.cat([latent.reshape(b, 1, t, rank), k_rope], dim=-1)
        if cache is not None:
            keys, _ = cache.update(keys, keys[..., :0], self.layer_idx, kwargs=kwargs)
        latent, k_rope = keys.split([rank, rope], dim=-1)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        w = self.kv_b_proj.weight.view(h, nope + vd, rank)
        dropout = self.attention_dropout if self.training else 0.0
        if self.sliding_window is not None:
            kwargs["sliding_window"] = self.sliding_window
        if self.softcap is not None:  # the same scores in both paths, so the same capping
            kwargs["softcap"] = self.softcap
        if absorbed:
            if nope:
                if folded is None:
                    q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, w[:, :nope])
                query, key = torch.cat([q_lat, q_rope], dim=-1), keys
            else:
                query, key = q_rope, k_rope
            if self.config._attn_implementation in ("eager", "sdpa") and not (self.training and dropout):
                out, weights = self._latent_rows_attention(query, key, latent, attention_mask)
            else:
                self.num_key_value_groups = h
                out, weights = interface(self, query, key, latent, attention_mask, dropout=dropout,
                                         scaling=self.scaling, **kwargs)
            if folded is not None:  # the value up-projection is folded into the output projection
                return self.output_dropout(nn.functional.linear(out.reshape(b, t, h * rank), folded[2],
                                                                self.o_proj.bias)), weights
            out = torch.einsum("bthr,hvr->bthv", out, w[:, nope:])  # value up-projection, after attention
        else:
            total = latent.shape[2]
            kv = self.kv_b_proj(latent[:, 0]).view(b, total, h, nope + vd).transpose(1, 2)
            k_nope, value = kv.split([nope, vd], dim=-1)
            key = torch.cat([k_nope, k_rope.expand(b, h, total, rope)], dim=-1)
            query = torch.cat([q_nope, q_rope], dim=-1)
            self.num_key_value_groups = 1
            # fused kernels want values as long as keys (CPU sdpa otherwise falls back to its math
            # kernel, about 3x slower at 2k tokens; flash kernels refuse): zero dims, cut after
            pad = nope + rope - vd if self.config._attn_implementation != "eager" else 0
            if pad > 0:
                value = nn.functional.pad(value, (0, pad))
            out, weights = interface(self, query, key, value, attention_mask, dropout=dropout,
                                     scaling=self.scaling, **kwargs)
            if pad > 0:
                out = out[..., :vd]
        out = out.reshape(b, t, h * vd).contiguous()
        return self.output_dropout(self.o_proj(out)), weights


def _base_model(model):
    return getattr(model, "base_model", model)


def install_latent_attention(model: nn.Module, config) -> None:
    """Replace every attention layer named in the config's table by LatentAttention (in place)."""
    spec = _get(config, MLA_KEY)
    if not spec:
        return
    base = _base_model(model)
    for i in range(len(spec["kv_rank"])):
        layer = base.get_submodule(f"{spec['layers_path']}.{i}")
        owner_path, _, name = spec["attention"].rpartition(".")
        owner = layer.get_submodule(owner_path) if owner_path else layer
        old = getattr(owner, name)
        new = LatentAttention(config, i, spec, source=old)
        ref = next(old.parameters(), None)
        if ref is not None and ref.device.type != "meta":
            new = new.to(device=ref.device, dtype=ref.dtype)
        setattr(owner, name, new)


def headtool_mla_class(base_cls):
    """A subclass of a transformers model class whose attention layers are latent attention.

    It keeps the family's class name (save_pretrained writes it as the architecture); the module
    exports it as Headtool<name>.
    """

    class Latent(base_cls):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            install_latent_attention(self, config)

        @classmethod
        def is_custom_code(cls) -> bool:
            # the family's own modeling code with its attention layers replaced: the family's
            # checkpoint conventions (weight renamings, init) apply unchanged
            return False

        def _get_static_cache_init_shape(self):
            # the cache holds latents, not the config's KV heads: let a StaticCache size itself
            # lazily from the first states of each layer
            return None

    Latent.__name__ = Latent.__qualname__ = base_cls.__name__
    return Latent


# Classes named in config.json's auto_map (generated by headtool for this checkpoint):
