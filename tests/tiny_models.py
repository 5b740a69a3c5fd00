"""Tiny random models of every supported family, built offline inside the tests.

Weights use a large init range so that every head visibly matters: equivalence tests with
1e-4 tolerances would pass trivially on the near-uniform logits of a 0.02 init.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

from _data_fixtures import bert_tokenizer, tiny_causal_tokenizer

VOCAB = 400  # tiny_causal_tokenizer's vocabulary
HIDDEN = 32
LAYERS = 3

# family -> (config kwargs, masked-LM?)
FAMILIES: dict[str, tuple[dict[str, Any], bool]] = {
    "bert": (dict(num_attention_heads=4), True),
    "roberta": (dict(num_attention_heads=4, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                     max_position_embeddings=130), True),
    "gpt2": (dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=128, bos_token_id=0,
                  eos_token_id=0), False),
    "gpt_neox": (dict(num_attention_heads=4, rotary_pct=0.5, max_position_embeddings=128, bos_token_id=0,
                      eos_token_id=0), False),
    "opt": (dict(num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=HIDDEN, max_position_embeddings=128,
                 pad_token_id=1, bos_token_id=0, eos_token_id=0), False),
    "llama": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8), False),
    "mistral": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=None), False),
    "qwen2": (dict(num_attention_heads=4, num_key_value_heads=2), False),
    "qwen3": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8), False),
    "gemma": (dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8), False),
    "gemma2": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
                    query_pre_attn_scalar=8), False),
    "gemma3_text": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
                         query_pre_attn_scalar=8, layer_types=["sliding_attention", "sliding_attention",
                                                               "full_attention"]), False),
    "phi3": (dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=0,
                  eos_token_id=0), False),
}

ALL = list(FAMILIES)
GQA = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"]
MHA_ONLY = ["bert", "roberta", "gpt2", "gpt_neox", "opt"]


def tiny_config(family: str, **overrides: Any):
    extra, mlm = FAMILIES[family]
    tok = bert_tokenizer() if mlm else tiny_causal_tokenizer()
    kw: dict[str, Any] = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                              vocab_size=len(tok), initializer_range=0.3, max_position_embeddings=128)
    if family in ("bert", "roberta"):
        kw.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if family == "gpt2":
        kw.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "max_position_embeddings"):
            kw.pop(k)
    if family == "opt":
        kw.pop("intermediate_size")
        kw.update(dropout=0.0, attention_dropout=0.0)
    kw.update(extra)
    kw.update(overrides)
    return AutoConfig.for_model(family, **kw)


def tiny_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random fp32 model in eval mode; the same seed gives the same weights."""
    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    cls = AutoModelForMaskedLM if FAMILIES[family][1] else AutoModelForCausalLM
    model = cls.from_config(cfg)
    with torch.no_grad():  # norms and biases away from their init so they matter too
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def tokenizer_for(family: str):
    return bert_tokenizer() if FAMILIES[family][1] else tiny_causal_tokenizer()


def save_tiny(family: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny model with its tokenizer as a Hugging Face folder."""
    model = tiny_model(family, seed=seed, **overrides)
    model.save_pretrained(folder)
    tokenizer_for(family).save_pretrained(folder)
    return folder


def sample_ids(family: str, batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer_for(family))
    low = 5 if FAMILIES[family][1] else 1
    return torch.randint(low, min(vocab, 400), (batch, seq), generator=g)


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's safetensors shards, by name (to compare outputs)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out
