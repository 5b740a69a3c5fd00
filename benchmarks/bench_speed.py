"""What multi-query attention buys at inference: SmolLM2-135M (9 query / 3 KV heads) against a 9/1 copy.

The 3 -> 1 KV-head copy is made here by averaging each layer's K and V projections over the
three KV heads (headtool.surgery.extract_heads / assemble, config num_key_value_heads = 1,
save_pretrained). Its quality is irrelevant: only speed and memory are measured, with
`headtool.workflows.evaluate.run_speed`, the code behind `headtool eval --speed`.

    python benchmarks/bench_speed.py --batch 2 --context 1024 --new-tokens 32 --repeats 3 --warmup 1

writes benchmarks/results/speed.json (the speed document plus how it was made).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from headtool.arch import LayerHeads  # noqa: E402
from headtool.model.loading import load_model
from headtool.measure.speed import SpeedSpec
from headtool.model.placement import LoadOptions
from headtool.workflows.evaluate import SpeedRequest, run_speed
from headtool.arch.heads import assemble, extract_heads

RESULTS = Path(__file__).parent / "results" / "speed.json"


def mean_kv_copy(ref: str, kv_heads: int, out: Path) -> Path:
    """Write `ref` with its KV heads averaged into `kv_heads` groups (consecutive KV heads merged)."""
    lm = load_model(ref, dtype="float32", device="cpu")
    model, adapter = lm.model, lm.adapter
    geometry = adapter.geometry(model.config)
    sd = model.state_dict()
    new_sd = dict(sd)
    for i, geo in enumerate(geometry):
        if geo.num_kv_heads % kv_heads:
            raise SystemExit(f"layer {i}: {geo.num_kv_heads} KV heads do not split into {kv_heads} groups")
        new_geo = LayerHeads(geo.num_heads, kv_heads, geo.head_dim)
        prefix = adapter.layer_prefix(model, i)
        for ht in adapter.tensors:
            key = prefix + ht.name
            if key not in sd:
                continue
            blocks = {}
            for kind in ht.kinds:
                b = extract_heads(sd[key], ht, geo, kind)  # [n, hd, *rest]
                if kind in ("k", "v"):
                    b = b.reshape(kv_heads, geo.num_kv_heads // kv_heads, *b.shape[1:]).mean(1)
                blocks[kind] = b
            new_sd[key] = assemble(ht, new_geo, blocks)
    config = model.config
    adapter.set_standard_heads(config, LayerHeads(geometry[0].num_heads, kv_heads, geometry[0].head_dim))
    new = type(model)(config)
    new.load_state_dict(new_sd, strict=True)
    new.save_pretrained(out)
    lm.tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the converted model in this folder")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="headtool-bench-speed-"))
    try:
        folder = mean_kv_copy(args.model, args.kv_heads, args.keep or tmp / f"kv{args.kv_heads}")
        convert_s = time.perf_counter() - t0
        spec = SpeedSpec(batch=args.batch, context=args.context, new_tokens=args.new_tokens,
                         repeats=args.repeats, warmup=args.warmup)
        doc = run_speed(SpeedRequest((args.model, str(folder)), spec,
                                     load=LoadOptions(dtype="float32", device="cpu")))
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    doc["results"][0]["label"] = args.model
    doc["results"][1]["label"] = f"{args.model} K/V averaged to {args.kv_heads} KV head(s) per layer"
    doc["benchmark"] = {
        "command": "python benchmarks/bench_speed.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "second_model": f"{args.model} with each layer's K/V projections averaged into {args.kv_heads} KV "
                        "head(s) (quality irrelevant: speed only)",
        "convert_s": round(convert_s, 1),
        "total_s": round(time.perf_counter() - t0, 1),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "cpu_count": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    for r in doc["results"]:
        print(f"{r['label']}: prefill {r['prefill_tokens_per_s']:.1f} tok/s, decode {r['decode_tokens_per_s']:.2f} "
              f"tok/s ({r['decode_ms_per_step']:.1f} ms/step), KV cache {r['kv_cache_bytes'] / 2**20:.1f} MiB, "
              f"peak Δ {(r['peak_memory_delta_bytes'] or 0) / 2**20:.1f} MiB, ratios {r['ratio']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
