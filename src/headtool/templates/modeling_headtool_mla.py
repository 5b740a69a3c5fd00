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
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

MLA_KEY = "headtool_mla"


def _get(obj, key, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None,
                            **kwargs):
    """Plain softmax attention (scores soft-capped as Gemma 2 when `softcap`); key/value heads are
    shared by `module.num_key_value_groups` query heads."""
    groups = module.num_key_value_groups
    if groups > 1:
        b, n, t, d = key.shape
        key = key[:, :, None].expand(b, n, groups, t, d).reshape(b, n * groups, t, d)
        value = value[:, :, None].expand(b, n, groups, t, value.shape[-1]).reshape(b, n * groups, t, -1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        if mask.dtype == torch.bool:
            weights = weights.masked_fill(~mask, torch.finfo(weights.dtype).min)
        else:
            weights = weights + mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


class LatentAttention(nn.Module):
    """Multi-head latent attention with a decoupled rotary key, laid out as DeepSeek-V2/V3 with
    q_lora_rank = None and no norm on the latent.

    q_proj:             hidden -> heads x (qk_nope_dim + rope_dim)   [q_nope | q_rope] per head
    kv_a_proj_with_mqa: hidden -> kv_rank + rope_dim                 [latent | shared rotary key]
    kv_b_proj:          kv_rank -> heads x (qk_nope_dim + v_head_dim) [W_uk | W_uv] per head, no bias
    o_proj:             heads x v_head_dim -> hidden
    The rotary part is rope_dim / 2 complex planes, slot s turning with the frequency of plane
    rope_planes[s] of the original heads (rotate_half pairs (s, s + rope_dim / 2)).
    """

    def __init__(self, config, layer_idx: int, spec: dict):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = int(spec["num_heads"])
        self.qk_nope_dim = int(spec["qk_nope_dim"])
        self.rope_dim = int(spec["rope_dim"])
        self.v_head_dim = int(spec["v_head_dim"])
        self.kv_rank = int(spec["kv_rank"][layer_idx])
        self.rope_planes = [int(p) for p in spec["rope_planes"][layer_idx]]
        self.rotary_half = int(spec["rotary_dim"]) // 2
        self.scaling = float(spec["scaling"])
        self.absorb = spec.get("absorb", "auto")
        self.is_causal = True
        self.attention_dropout = 0.0
        self.num_key_value_groups = 1  # set per call: 1 (plain) or num_heads (absorbed: one latent head)
        # passed on to the attention function as the family's attention does (the mask already
        # limits a sliding layer; flash kernels read the window from here)
        self.sliding_window = (spec.get("sliding_window") or [None] * (layer_idx + 1))[layer_idx]
        self.softcap = spec.get("softcap")  # Gemma 2: tanh soft-capping of the scores
        hidden = int(spec["hidden_size"])
        h = self.num_heads
        self.q_proj = nn.Linear(hidden, h * (self.qk_nope_dim + self.rope_dim), bias=bool(spec["q_bias"]))
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.rope_dim, bias=bool(spec["kv_bias"]))
        self.kv_b_proj = nn.Linear(self.kv_rank, h * (self.qk_nope_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_head_dim, hidden, bias=bool(spec["o_bias"]))
        self._index: dict = {}

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

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        b, t = hidden_states.shape[:2]
        h, nope, rope, rank, vd = self.num_heads, self.qk_nope_dim, self.rope_dim, self.kv_rank, self.v_head_dim
        q = self.q_proj(hidden_states).view(b, t, h, nope + rope).transpose(1, 2)
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden_states).split([rank, rope], dim=-1)
        latent = latent.reshape(b, 1, t, rank)
        k_rope = k_rope.reshape(b, 1, t, rope)
        cos, sin = position_embeddings
        idx = self._slots(cos.device)
        cos, sin = cos[..., idx].unsqueeze(1), sin[..., idx].unsqueeze(1)
        q_rope = q_rope * cos + rotate_half(q_rope) * sin
        k_rope = k_rope * cos + rotate_half(k_rope) * sin
        if cache is not None:  # the cache holds the latent and the shared rotary key, nothing per head
            latent, k_rope = cache.update(latent, k_rope, self.layer_idx, kwargs=kwargs)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        w = self.kv_b_proj.weight.view(h, nope + vd, rank)
        dropout = self.attention_dropout if self.training else 0.0
        if self.sliding_window is not None:
            kwargs["sliding_window"] = self.sliding_window
        if self.softcap is not None:  # the same scores in both paths, so the same capping
            kwargs["softcap"] = self.softcap
        if self._absorbed(t):
            if nope:
                q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, w[:, :nope])
                query = torch.cat([q_lat, q_rope], dim=-1)
                key = torch.cat([latent, k_rope], dim=-1)
            else:
                query, key = q_rope, k_rope
            self.num_key_value_groups = h
            out, weights = interface(self, query, key, latent, attention_mask, dropout=dropout,
                                     scaling=self.scaling, **kwargs)
            out = torch.einsum("bthr,hvr->bthv", out, w[:, nope:])  # value up-projection, after attention
        else:
            total = latent.shape[2]
            kv = self.kv_b_proj(latent[:, 0]).view(b, total, h, nope + vd).transpose(1, 2)
            k_nope, value = kv.split([nope, vd], dim=-1)
            key = torch.cat([k_nope, k_rope.expand(b, h, total, rope)], dim=-1)
            query = torch.cat([q_nope, q_rope], dim=-1)
            self.num_key_value_groups = 1
            out, weights = interface(self, query, key, value, attention_mask, dropout=dropout,
                                     scaling=self.scaling, **kwargs)
        out = out.reshape(b, t, h * vd).contiguous()
        return self.o_proj(out), weights


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
        new = LatentAttention(config, i, spec)
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
