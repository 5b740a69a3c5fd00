"""The supported families: module names, fused layouts and config keys, in one place."""
from __future__ import annotations

from .base import Adapter, ConfigSupport, HeadTensor


def _separate(prefix: str, q: str, k: str, v: str, o: str, bias: bool) -> tuple[HeadTensor, ...]:
    """Separate q/k/v/o Linear layers (PyTorch layout: [out, in])."""
    ts = [
        HeadTensor(f"{prefix}{q}.weight", 0, ("q",)),
        HeadTensor(f"{prefix}{k}.weight", 0, ("k",)),
        HeadTensor(f"{prefix}{v}.weight", 0, ("v",)),
        HeadTensor(f"{o}.weight", 1, ("o",)),
    ]
    if bias:
        ts += [
            HeadTensor(f"{prefix}{q}.bias", 0, ("q",), optional=True),
            HeadTensor(f"{prefix}{k}.bias", 0, ("k",), optional=True),
            HeadTensor(f"{prefix}{v}.bias", 0, ("v",), optional=True),
        ]
    return tuple(ts)


def _llama_like(family: str, model_types: tuple[str, ...], *, divides: bool, qk_norm: bool = False,
                head_dim_explicit: bool = True, latent: bool = False) -> Adapter:
    return Adapter(
        family=family,
        model_types=model_types,
        layers_path="layers",
        o_proj="self_attn.o_proj",
        tensors=_separate("self_attn.", "q_proj", "k_proj", "v_proj", "self_attn.o_proj", bias=True),
        support=ConfigSupport(kv_heads=True, explicit_head_dim=head_dim_explicit,
                              heads_need_not_divide_hidden=divides),
        kv_heads_key="num_key_value_heads",
        head_dim_key="head_dim",
        rotary=True,
        qk_norm=("self_attn.q_norm.weight", "self_attn.k_norm.weight") if qk_norm else (),
        # the forward views q/k/v with head_dim and repeats K/V by num_key_value_groups
        resize_attrs=(("self_attn.num_key_value_groups", "group_size"),),
        latent=latent,
    )


BERT = Adapter(
    family="bert",
    model_types=("bert", "roberta", "xlm-roberta", "camembert", "electra", "ernie", "data2vec-text"),
    layers_path="encoder.layer",
    o_proj="attention.output.dense",
    attention="attention",
    tensors=_separate("attention.self.", "query", "key", "value", "attention.output.dense", bias=True),
    support=ConfigSupport(kv_heads=False, explicit_head_dim=False, heads_need_not_divide_hidden=False),
    resize_attrs=(("attention.self.num_attention_heads", "num_heads"),
                  ("attention.self.all_head_size", "q_width")),
    positions_after_padding=("roberta", "xlm-roberta", "camembert", "data2vec-text"),
    encoder=True,
)

GPT2 = Adapter(
    family="gpt2",
    model_types=("gpt2",),
    layers_path="h",
    o_proj="attn.c_proj",
    attention="attn",
    tensors=(
        HeadTensor("attn.c_attn.weight", 1, ("q", "k", "v")),  # Conv1D: [in, out]
        HeadTensor("attn.c_attn.bias", 0, ("q", "k", "v")),
        HeadTensor("attn.c_proj.weight", 0, ("o",)),
    ),
    support=ConfigSupport(kv_heads=False, explicit_head_dim=False, heads_need_not_divide_hidden=False),
    heads_key="n_head",
    layers_key="n_layer",
    hidden_key="n_embd",
    conv1d=True,
    # c_attn's output is split in chunks of split_size (q, k, v)
    resize_attrs=(("attn.num_heads", "num_heads"), ("attn.split_size", "q_width")),
    latent=True,  # learned positions: no rotary key, all of K and V in the latent
    attention_dropout_attr="attn_dropout",
    output_dropout_attr="resid_dropout",
)

GPT_NEOX = Adapter(
    family="gpt_neox",
    model_types=("gpt_neox",),
    layers_path="layers",
    o_proj="attention.dense",
    attention="attention",
    tensors=(
        HeadTensor("attention.query_key_value.weight", 0, ("q", "k", "v"), interleaved=True),
        HeadTensor("attention.query_key_value.bias", 0, ("q", "k", "v"), interleaved=True, optional=True),
        HeadTensor("attention.dense.weight", 1, ("o",)),
    ),
    support=ConfigSupport(kv_heads=False, explicit_head_dim=False, heads_need_not_divide_hidden=False),
    rotary=True,
    latent=True,  # partial rotary: the dims that never rotate go into the latent
)

OPT = Adapter(
    family="opt",
    model_types=("opt",),
    layers_path="decoder.layers",
    o_proj="self_attn.out_proj",
    tensors=_separate("self_attn.", "q_proj", "k_proj", "v_proj", "self_attn.out_proj", bias=True),
    support=ConfigSupport(kv_heads=False, explicit_head_dim=False, heads_need_not_divide_hidden=False),
    resize_attrs=(("self_attn.num_heads", "num_heads"),),
    latent=True,  # learned positions: no rotary key, all of K and V in the latent
    attention_dropout_attr="dropout",
)

LLAMA = _llama_like("llama", ("llama",), divides=False, latent=True)
MISTRAL = _llama_like("mistral", ("mistral",), divides=True, latent=True)
QWEN2 = _llama_like("qwen2", ("qwen2",), divides=True, latent=True)
QWEN3 = _llama_like("qwen3", ("qwen3",), divides=True, qk_norm=True, latent=True)
GEMMA = _llama_like("gemma", ("gemma", "gemma2"), divides=False, latent=True)
GEMMA3 = _llama_like("gemma3", ("gemma3_text",), divides=False, qk_norm=True, latent=True)

PHI3 = Adapter(
    family="phi3",
    model_types=("phi3",),
    layers_path="layers",
    o_proj="self_attn.o_proj",
    tensors=(
        HeadTensor("self_attn.qkv_proj.weight", 0, ("q", "k", "v")),
        HeadTensor("self_attn.o_proj.weight", 1, ("o",)),
    ),
    # Phi-3's config has no head_dim field of its own; its modeling code reads one if present.
    support=ConfigSupport(kv_heads=True, explicit_head_dim=False, heads_need_not_divide_hidden=False),
    kv_heads_key="num_key_value_heads",
    head_dim_key="head_dim",
    rotary=True,
    resize_attrs=(("self_attn.num_key_value_groups", "group_size"),
                  ("self_attn.num_key_value_heads", "num_kv_heads")),
    # Phi3Attention.forward splits qkv with self.config.num_attention_heads
    resize_config_keys=(("num_attention_heads", "num_heads"), ("num_key_value_heads", "num_kv_heads")),
    latent=True,
)

ALL_ADAPTERS: tuple[Adapter, ...] = (BERT, GPT2, GPT_NEOX, OPT, LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GEMMA3, PHI3)
