"""What an architecture adapter describes: head geometry and where head-carrying tensors live.

Everything that knows module names, fused layouts or config keys is an `Adapter`; the rest
of headtool works on these descriptions only (so the same tensor math serves an in-memory
model and a checkpoint streamed shard by shard).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

# Kinds of head-carrying slices: query, key, value projections (their output axis) and the
# output projection (its input axis, one slice per query head).
KINDS = ("q", "k", "v", "o")

LAYOUT_KEY = "headtool_head_layout"
# config key of headtool's remote-code outputs: how to resize each layer (Adapter.resize_spec)
RESIZE_SPEC_KEY = "headtool_resize_spec"
# what a resize attribute can be set to, computed from a layer's LayerHeads
RESIZE_QUANTITIES = ("num_heads", "num_kv_heads", "head_dim", "group_size", "q_width", "kv_width")


@dataclass(frozen=True)
class LayerHeads:
    """Head geometry of one attention layer.

    Query heads read KV heads in contiguous groups: KV head k serves the next `sizes()[k]` query
    heads. The groups are equal (`group_sizes` None) unless a prune removed single query heads
    from a grouped-query layer (`prune --unit head`), which keeps every KV head that still has a
    reader and leaves the groups `group_sizes` (query heads per KV head, in order).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    group_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        sizes = self.group_sizes
        if sizes is None:
            return
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != self.num_kv_heads or sum(sizes) != self.num_heads or min(sizes) < 1:
            raise ValueError(f"KV group sizes {list(sizes)} do not split {self.num_heads} query heads over "
                             f"{self.num_kv_heads} KV heads")
        # equal groups are the ordinary layout: one representation, so geometries compare equal
        object.__setattr__(self, "group_sizes", None if len(set(sizes)) == 1 else sizes)

    @property
    def uneven(self) -> bool:
        """Whether the KV groups differ in size (only `prune --unit head` makes such layers)."""
        return self.group_sizes is not None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (ValueError on a layer whose groups differ: see `sizes`)."""
        if self.group_sizes is not None:
            raise ValueError(f"the KV groups of this layer differ in size ({list(self.group_sizes)})")
        return self.num_heads // self.num_kv_heads

    def sizes(self) -> tuple[int, ...]:
        """Query heads per KV head, in KV-head order."""
        if self.group_sizes is not None:
            return self.group_sizes
        return (self.num_heads // self.num_kv_heads,) * self.num_kv_heads

    def kv_index(self) -> list[int]:
        """The KV head each query head reads, in query-head order."""
        return [k for k, n in enumerate(self.sizes()) for _ in range(n)]

    def kv_head_of(self, q_head: int) -> int:
        """The KV head that query head `q_head` reads (contiguous grouping)."""
        if self.group_sizes is None:
            return q_head // (self.num_heads // self.num_kv_heads)
        return self.kv_index()[q_head]

    def query_heads_of(self, kv_head: int) -> list[int]:
        sizes = self.sizes()
        start = sum(sizes[:kv_head])
        return list(range(start, start + sizes[kv_head]))

    def count(self, kind: str) -> int:
        return self.num_heads if kind in ("q", "o") else self.num_kv_heads


@dataclass(frozen=True)
class HeadTensor:
    """One parameter tensor of a layer whose `axis` carries head slices.

    `kinds` lists the projections stored in it in storage order: ("q",) for a separate
    q_proj, ("q", "k", "v") for a fused concat (GPT-2 c_attn, Phi-3 qkv_proj), and with
    `interleaved` the per-head [q|k|v] blocks of GPT-NeoX's query_key_value.
    `name` is relative to the layer module (e.g. "self_attn.q_proj.weight").
    """

    name: str
    axis: int
    kinds: tuple[str, ...]
    interleaved: bool = False
    optional: bool = False  # biases: absent in some configs of the family

    def positions(self, kind: str, heads: LayerHeads) -> torch.Tensor:
        """Indices along `axis` of every head of `kind`: LongTensor [count(kind), head_dim]."""
        hd = heads.head_dim
        if kind not in self.kinds:
            raise KeyError(f"{self.name} holds no {kind!r} slices")
        if self.interleaved:
            n = heads.num_heads
            width = len(self.kinds) * hd
            j = self.kinds.index(kind)
            return torch.arange(n)[:, None] * width + j * hd + torch.arange(hd)[None, :]
        start = 0
        for k in self.kinds:
            if k == kind:
                break
            start += heads.count(k) * hd
        n = heads.count(kind)
        return start + torch.arange(n * hd).view(n, hd)

    def size(self, heads: LayerHeads) -> int:
        """Length of `axis` for this geometry."""
        return sum(heads.count(k) for k in self.kinds) * heads.head_dim


@dataclass(frozen=True)
class ConfigSupport:
    """What a family's stock config can express, so outputs can stay standard."""

    kv_heads: bool  # has num_key_value_heads
    explicit_head_dim: bool  # head_dim is a config field the modeling code reads
    # stock config/model accept num_heads * head_dim != hidden_size
    heads_need_not_divide_hidden: bool


@dataclass
class Adapter:
    """Per-family knowledge; instances live in `headtool.arch.registry`."""

    family: str
    model_types: tuple[str, ...]
    layers_path: str  # relative to the base model, e.g. "layers", "encoder.layer", "h"
    o_proj: str  # module (relative to a layer) whose input is the concatenated heads
    tensors: tuple[HeadTensor, ...]
    support: ConfigSupport
    heads_key: str = "num_attention_heads"
    kv_heads_key: str | None = None
    layers_key: str = "num_hidden_layers"
    hidden_key: str = "hidden_size"
    head_dim_key: str | None = None
    conv1d: bool = False  # weights stored transposed (GPT-2 Conv1D): q/k/v heads on axis 1
    rotary: bool = False
    qk_norm: tuple[str, ...] = ()  # per-head-dim norm weights shared by all heads (kept as is)
    attention: str = "self_attn"  # attention module relative to a layer
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # Resizing attention in place (prune, convert-gqa): numbers that an attention module keeps
    # as attributes and reads in forward, as (path relative to the layer, quantity) with a
    # quantity in RESIZE_QUANTITIES; and config keys that the attention forward reads from
    # `self.config` (those layers get a per-layer view of the config).
    resize_attrs: tuple[tuple[str, str], ...] = ()
    resize_config_keys: tuple[tuple[str, str], ...] = ()
    # convert-mla: the attention can be rebuilt as latent attention exactly (RoPE on rotate_half
    # pairs or none at all, softmax(q.k * scaling) with the module's `scaling` attribute and what
    # attention_extras names, no qk-norm, called by the decoder layer with the hidden states, the
    # mask, (cos, sin) if rotary and the cache as `cache`, `past_key_values` or `layer_past`)
    latent: bool = False
    # dropout inside the attention module (used by heal, which trains in train mode): the
    # attention-weight dropout (a float or an nn.Dropout attribute) and, where the module drops out
    # its own output (GPT-2's resid_dropout), that one; latent attention rebuilds both
    attention_dropout_attr: str = "attention_dropout"
    output_dropout_attr: str | None = None
    # model types of the family whose learned positions start after the padding index (RoBERTa:
    # max_position_embeddings 514 takes 512 tokens)
    positions_after_padding: tuple[str, ...] = ()
    # an encoder family (BERT): bidirectional attention over the whole input, no KV cache, unless the
    # config makes it a decoder (is_decoder, as BertLMHeadModel: causal, with a cache)
    encoder: bool = False

    # ---------------------------------------------------------------- geometry
    def caches_kv(self, config) -> bool:
        """Whether the model keeps a KV cache (decoders); an encoder reads its whole input at once."""
        return not self.encoder or bool(getattr(config, "is_decoder", False))

    def max_positions(self, config) -> int | None:
        """The most tokens one sequence may hold where positions are learned (a table of
        max_position_embeddings rows: GPT-2, OPT, BERT): a longer one fails inside the model. None for
        rotary positions, which run past the configured length."""
        n = getattr(config, "max_position_embeddings", None)
        if self.rotary or not isinstance(n, int) or n < 1:
            return None
        if getattr(config, "model_type", None) in self.positions_after_padding:
            n -= int(getattr(config, "pad_token_id", None) or 0) + 1
        return n

    def cache_windows(self, config) -> list[int | None]:
        """Per layer, the most tokens its KV cache holds: the sliding window (Gemma 2/3's local layers,
        Mistral's or Phi-3's `sliding_window` on every layer, Qwen's layers past max_window_layers) or
        the attention chunk; None where the cache grows with the whole context. As transformers builds
        the cache: `layer_types` where the config has them, else `sliding_window` for every layer."""
        n = self.num_layers(config)

        def tokens(key: str) -> int | None:
            v = getattr(config, key, None)
            return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
        window, chunk = tokens("sliding_window"), tokens("attention_chunk_size")
        types = getattr(config, "layer_types", None)
        if isinstance(types, (list, tuple)) and len(types) == n:
            return [window if t == "sliding_attention" else chunk if t == "chunked_attention" else None
                    for t in types]
        return [window or chunk] * n

    def num_layers(self, config) -> int:
        return int(getattr(config, self.layers_key))

    def base_head_dim(self, config) -> int:
        if self.head_dim_key and getattr(config, self.head_dim_key, None):
            return int(getattr(config, self.head_dim_key))
        return int(getattr(config, self.hidden_key)) // int(getattr(config, self.heads_key))

    def geometry(self, config) -> list[LayerHeads]:
        """Per-layer head geometry; honours headtool's per-layer table for pruned models."""
        n_layers = self.num_layers(config)
        layout = getattr(config, LAYOUT_KEY, None)
        if layout:
            hd = int(layout["head_dim"])
            sizes = layout.get("group_sizes") or [None] * len(layout["num_heads"])
            return [
                LayerHeads(int(q), int(kv), hd, None if gs is None else tuple(int(x) for x in gs))
                for q, kv, gs in zip(layout["num_heads"], layout["num_kv_heads"], sizes)
            ]
        nq = int(getattr(config, self.heads_key))
        nkv = nq
        if self.kv_heads_key and getattr(config, self.kv_heads_key, None):
            nkv = int(getattr(config, self.kv_heads_key))
        hd = self.base_head_dim(config)
        return [LayerHeads(nq, nkv, hd) for _ in range(n_layers)]

    def hidden_size(self, config) -> int:
        return int(getattr(config, self.hidden_key))

    # ---------------------------------------------------------------- modules
    def base_model(self, model: nn.Module) -> nn.Module:
        return getattr(model, "base_model", model)

    def base_prefix(self, model: nn.Module) -> str:
        """State-dict prefix of the base model inside `model` ('' or e.g. 'model.')."""
        base = self.base_model(model)
        for name, mod in model.named_modules():
            if mod is base:
                return f"{name}." if name else ""
        return ""

    def layer_module(self, model: nn.Module, i: int) -> nn.Module:
        return self.base_model(model).get_submodule(f"{self.layers_path}.{i}")

    def o_proj_module(self, model: nn.Module, i: int) -> nn.Module:
        """Layer i's output projection: the family's, or, once convert-mla replaced the attention,
        the latent attention's own `o_proj` (an nn.Linear in every family)."""
        attn = self.attention_module(model, i)
        if getattr(attn, "kv_b_proj", None) is not None:
            return attn.o_proj
        return self.layer_module(model, i).get_submodule(self.o_proj)

    def attention_module(self, model: nn.Module, i: int) -> nn.Module:
        return self.layer_module(model, i).get_submodule(self.attention)

    def layer_prefix(self, model: nn.Module, i: int) -> str:
        """Full state-dict prefix of layer i, e.g. 'model.layers.3.'."""
        return f"{self.base_prefix(model)}{self.layers_path}.{i}."

    def layer_prefix_in_keys(self, keys: Iterable[str], i: int) -> str:
        """Prefix of layer i among checkpoint keys (for streaming, without a model)."""
        probe = f"{self.layers_path}.{i}.{self.tensors[0].name}"
        for k in keys:
            if k.endswith(probe):
                return k[: -len(self.tensors[0].name)]
        raise KeyError(f"no weights for layer {i} ({probe})")

    def qkv_axis(self) -> int:
        return 1 if self.conv1d else 0

    def o_axis(self, module: nn.Module | None = None) -> int:
        """Axis of the output projection's weight that runs over the heads: 1 for [out, in]
        (nn.Linear, also latent attention's o_proj in a Conv1D family), 0 for GPT-2's Conv1D."""
        if isinstance(module, nn.Linear):
            return 1
        return 0 if self.conv1d else 1

    # ---------------------------------------------------------------- convert-gqa (K/V merging)
    def projection_module(self, model: nn.Module, i: int, kind: str) -> nn.Module:
        """The module whose weight carries `kind` ('q','k','v','o') slices in layer i.

        Its input is the attention input for q/k/v (shared by the three, also when fused),
        which is all that K/V merging needs to collect statistics.
        """
        for ht in self.tensors:
            if kind in ht.kinds and ht.name.endswith(".weight"):
                return self.layer_module(model, i).get_submodule(ht.name[: -len(".weight")])
        raise KeyError(f"{self.family}: no weight carries {kind!r} slices")

    def attention_scaling(self, model: nn.Module, i: int) -> float:
        """The softmax scale of layer i's attention scores (q.k * scaling)."""
        return float(self.attention_module(model, i).scaling)

    def attention_extras(self, model: nn.Module, i: int) -> dict[str, Any]:
        """What layer i's attention passes to the attention function besides q, k, v and the mask:
        `softcap` (Gemma 2's tanh capping of the scores), `sliding_window` (None: global), and the
        dropout probabilities in training, `dropout` (attention weights) and `output_dropout`
        (the module's own output, 0.0 where the decoder layer drops it out instead)."""
        attn = self.attention_module(model, i)

        def probability(attr: str | None) -> float:
            value = getattr(attn, attr, 0.0) if attr else 0.0
            return float(value.p if isinstance(value, nn.Dropout) else value or 0.0)
        return {"softcap": getattr(attn, "attn_logit_softcapping", None),
                "sliding_window": getattr(attn, "sliding_window", None),
                "dropout": probability(self.attention_dropout_attr),
                "output_dropout": probability(self.output_dropout_attr)}

    def rotary_inv_freq(self, model: nn.Module) -> torch.Tensor:
        """The rotary frequencies (radians per token) of the planes, as the model computes them [r/2]."""
        rope = getattr(self.base_model(model), "rotary_emb", None)
        if rope is None or getattr(rope, "inv_freq", None) is None:
            raise ValueError(f"{self.family}: no rotary embedding with inv_freq in the base model")
        return rope.inv_freq.detach().to("cpu", torch.float64)

    def rotary_dim(self, config, head_dim: int) -> int:
        """How many leading dims of each q/k head rotate (rotate_half pairs (p, p + r/2)); 0 without RoPE."""
        if not self.rotary:
            return 0
        rope = getattr(config, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
        if factor is None:
            factor = getattr(config, "partial_rotary_factor", None) or getattr(config, "rotary_pct", None) or 1.0
        r = int(head_dim * float(factor))
        return r - (r % 2)

    # ---------------------------------------------------------------- config
    def can_write_standard_config(self, config, geometry: list[LayerHeads]) -> bool:
        """True when `geometry` is expressible by the family's stock config fields."""
        first = geometry[0]
        if any(g != first for g in geometry):
            return False
        if first.uneven or first.num_heads % first.num_kv_heads:
            return False
        if not self.support.kv_heads and first.num_kv_heads != first.num_heads:
            return False
        base_hd = self.base_head_dim(config)
        if first.head_dim != base_hd:
            return False
        hidden = self.hidden_size(config)
        if first.num_heads * first.head_dim != hidden:
            if not self.support.explicit_head_dim:
                return False
            # e.g. Llama/Gemma2 configs validate hidden_size % num_heads == 0 even with head_dim
            if not self.support.heads_need_not_divide_hidden and hidden % first.num_heads:
                return False
        return self._config_accepts(config, first)

    def _config_accepts(self, config, heads: LayerHeads) -> bool:
        """Whether the family's config class itself accepts `heads` (its validators run)."""
        try:
            d = config.to_dict()
            d.pop(LAYOUT_KEY, None)
            d.pop(RESIZE_SPEC_KEY, None)
            d.pop("auto_map", None)
            d[self.heads_key] = heads.num_heads
            if self.kv_heads_key:
                d[self.kv_heads_key] = heads.num_kv_heads
            if self.head_dim_key:
                d[self.head_dim_key] = heads.head_dim
            type(config).from_dict(d)
        except Exception:  # noqa: BLE001 - any validator complaint means "not standard"
            return False
        return True

    # ---------------------------------------------------------------- resizing
    def resize_spec(self) -> dict[str, Any]:
        """JSON-able description of how to resize a layer's attention to a new geometry.

        Stored in remote-code output configs (RESIZE_SPEC_KEY) and executed by the
        self-contained modeling file as well as by `headtool.model.resize` (one implementation).
        """
        return {
            "layers_path": self.layers_path,
            "attention": self.attention,
            "conv1d": self.conv1d,
            "tensors": [{"name": t.name, "axis": t.axis, "kinds": list(t.kinds), "optional": t.optional}
                        for t in self.tensors],
            "attrs": [list(a) for a in self.resize_attrs],
            "config_keys": [list(c) for c in self.resize_config_keys],
        }

    def set_standard_heads(self, config, heads: LayerHeads) -> None:
        """Write a uniform head geometry into `config` in the family's own keys."""
        if self.head_dim_key:
            setattr(config, self.head_dim_key, heads.head_dim)
        setattr(config, self.heads_key, heads.num_heads)
        if self.kv_heads_key:
            setattr(config, self.kv_heads_key, heads.num_kv_heads)
        if hasattr(config, LAYOUT_KEY):
            delattr(config, LAYOUT_KEY)

    def config_keys(self) -> dict[str, str | None]:
        return {
            "num_heads": self.heads_key,
            "num_kv_heads": self.kv_heads_key,
            "head_dim": self.head_dim_key,
            "num_layers": self.layers_key,
            "hidden_size": self.hidden_key,
        }
