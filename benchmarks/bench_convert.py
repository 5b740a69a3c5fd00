"""SmolLM2-135M, 3 -> 1 KV heads: perplexity of mean / aligned / fit on held-out pydoc blocks.

Calibration: the first CAL blocks of builtin:pydoc (seed 0); refit check: the next HELD blocks;
evaluation: EVAL further blocks never used for calibration (DataSpec.skip_samples).
Writes benchmarks/results/convert.json and prints one table.

    HF_HUB_OFFLINE=1 python benchmarks/bench_convert.py [--cal 64 --held 16 --eval 32 --seq-len 128]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from headtool.surgery import merging as C
from headtool.measure.calibration import attention_input_grams
from headtool.data.sources import DataSpec
from headtool.data.batches import make_batches
from headtool.measure.evaluation import evaluate
from headtool.model.loading import load_model

RUNS = [("mean", False), ("aligned", False), ("aligned", True), ("fit", False), ("fit", True)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cal", type=int, default=64)
    ap.add_argument("--held", type=int, default=16)
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "convert.json"))
    a = ap.parse_args()
    lm = load_model("smollm2-135m", dtype="float32", device="cpu")
    spec = DataSpec(seq_len=a.seq_len, batch_size=a.batch_size)
    cal = make_batches(DataSpec(**{**spec.__dict__, "max_samples": a.cal}), lm.tokenizer, "lm")
    held = make_batches(DataSpec(**{**spec.__dict__, "max_samples": a.held, "skip_samples": a.cal}), lm.tokenizer, "lm")
    ev = make_batches(DataSpec(**{**spec.__dict__, "max_samples": a.eval, "skip_samples": a.cal + a.held}),
                      lm.tokenizer, "lm")
    base = evaluate(lm.model, ev.batches, "lm")
    t0 = time.perf_counter()
    grams = attention_input_grams(lm.model, lm.adapter, cal.batches)
    calib_s = time.perf_counter() - t0
    rows = [{"method": "unconverted (3 KV heads)", "loss": base["loss"], "perplexity": base["perplexity"]}]
    for method, refit in RUNS:
        conv = C.convert_model(lm.model, lm.adapter, 1, method=method, grams=grams, refit=refit,
                               batches=cal.batches, heldout_batches=held.batches)
        r = evaluate(conv.model, ev.batches, "lm")
        rows.append({"method": method + (" + sequential refit" if refit else ""), "loss": r["loss"],
                     "perplexity": r["perplexity"], "seconds": round(conv.seconds, 1),
                     "refit_layers_kept": None if conv.refit is None else sum(x["kept"] for x in conv.refit)})
        print(f"{rows[-1]['method']:<32} loss {r['loss']:.4f}  ppl {r['perplexity']:,.1f}", flush=True)
        del conv
    doc = {"model": "smollm2-135m", "kv_heads": "3 -> 1", "calibration": cal.info, "heldout": held.info,
           "eval": ev.info, "calibration_seconds": round(calib_s, 1), "results": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    print("\n| method | loss | perplexity |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r['method']} | {r['loss']:.4f} | {r['perplexity']:,.1f} |")


if __name__ == "__main__":
    main()
