"""Write a synthetic Llama-shaped checkpoint of a chosen size, tensor by tensor (no model object).

Random bf16 weights, several shards, a stock LlamaConfig: the input for the streaming benchmark.
Peak memory while writing stays at one tensor.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from headtool.io.safetensors_stream import write_checkpoint_streaming


def llama_shape(target_bytes: int, hidden: int = 2048, heads: int = 32, kv_heads: int = 8,
                inter: int = 5632, vocab: int = 32000) -> dict:
    """A Llama config whose bf16 weights total about `target_bytes` (layers chosen to fit)."""
    hd = hidden // heads
    per_layer = (hidden * heads * hd * 2 + hidden * kv_heads * hd * 2 + 3 * hidden * inter + 2 * hidden) * 2
    embed = 2 * vocab * hidden * 2
    layers = max(1, round((target_bytes - embed) / per_layer))
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=hidden,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd, intermediate_size=inter,
                num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=4096, rms_norm_eps=1e-5,
                tie_word_embeddings=False, dtype="bfloat16", rope_theta=10000.0)


def entries_for(cfg: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    h, nq, nkv, hd, inter = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                             cfg["head_dim"], cfg["intermediate_size"])
    out = [("model.embed_tokens.weight", "BF16", (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", "BF16", (h,)),
            (p + "self_attn.q_proj.weight", "BF16", (nq * hd, h)),
            (p + "self_attn.k_proj.weight", "BF16", (nkv * hd, h)),
            (p + "self_attn.v_proj.weight", "BF16", (nkv * hd, h)),
            (p + "self_attn.o_proj.weight", "BF16", (h, nq * hd)),
            (p + "post_attention_layernorm.weight", "BF16", (h,)),
            (p + "mlp.gate_proj.weight", "BF16", (inter, h)),
            (p + "mlp.up_proj.weight", "BF16", (inter, h)),
            (p + "mlp.down_proj.weight", "BF16", (h, inter)),
        ]
    out += [("model.norm.weight", "BF16", (h,)), ("lm_head.weight", "BF16", (cfg["vocab_size"], h))]
    return out


def write_synthetic(folder: Path, target_bytes: int, shard_bytes: int, seed: int = 0) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = llama_shape(target_bytes)
    entries = entries_for(cfg)
    gen = torch.Generator().manual_seed(seed)

    def produce(name: str) -> torch.Tensor:
        shape = next(s for n, _, s in entries if n == name)
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    write_checkpoint_streaming(folder, entries, produce, shard_bytes)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--gb", type=float, default=3.2)
    ap.add_argument("--shard-gb", type=float, default=1.0)
    args = ap.parse_args()
    cfg = write_synthetic(args.folder, int(args.gb * 1e9), int(args.shard_gb * 1e9))
    print(json.dumps({"folder": str(args.folder), "layers": cfg["num_hidden_layers"]}))


if __name__ == "__main__":
    main()
