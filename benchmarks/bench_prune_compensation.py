"""SmolLM2-135M: 25% of query heads removed (gradient scores), perplexity on held-out pydoc blocks.

Variants: none (gradient selection, no refit), scores (sequential refit, heads chosen by scores),
refit (refit + refit-aware choice inside layers), refit_all (also refit unpruned layers).
Prints one JSON line per variant; ratios are to the unpruned model on the same held-out blocks.

    python benchmarks/bench_prune_compensation.py 16 16 none,scores,refit
"""
import copy, json, sys, time
from dataclasses import replace
from headtool.model.loading import load_model, model_from_object
from headtool.data.sources import DataSpec
from headtool.data.batches import make_batches
from headtool.measure.scoring import score_heads
from headtool.surgery.selection import Target, select_heads
from headtool.surgery.pruning import prune
from headtool.measure.evaluation import evaluate

n_cal = int(sys.argv[1]) if len(sys.argv) > 1 else 16
n_eval = int(sys.argv[2]) if len(sys.argv) > 2 else 16
variants = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none", "scores", "refit", "refit_all"]
t0 = time.time()
lm = load_model("smollm2-135m", dtype="float32", device="cpu")
spec = DataSpec(source="builtin:pydoc", seq_len=128, batch_size=4, max_samples=n_cal)
cal = make_batches(spec, lm.tokenizer, "lm").batches
ev = make_batches(replace(spec, skip_samples=n_cal, max_samples=n_eval), lm.tokenizer, "lm").batches
base = evaluate(lm.model, ev, "lm")
print(json.dumps({"base": base, "t": time.time() - t0}), flush=True)
res = score_heads(lm.model, lm.adapter, cal, method="gradient", objective="lm")
sel = select_heads(res.scores, lm.geometry, Target(fraction=0.25))
print(json.dumps({"removed": sel.num_removed(lm.geometry), "t": time.time() - t0}), flush=True)
for v in variants:
    m = copy.deepcopy(lm.model)
    l2 = model_from_object(m, lm.tokenizer)
    kw = dict(compensate=v != "none", choose_in_layer="scores" if v in ("none", "scores") else "refit",
              refit_layers="all" if v == "refit_all" else "pruned", calib_batches=cal)
    r = prune(l2, sel, **kw)
    e = evaluate(m, ev, "lm")
    print(json.dumps({"variant": v, "loss": e["loss"], "ppl": e["perplexity"],
                      "ratio": e["perplexity"] / base["perplexity"], "removed": r.summary()["heads_removed"],
                      "t": time.time() - t0}), flush=True)
    del m, l2
