"""Quality on SmolLM2-135M without training: held-out perplexity after pruning or K/V merging.

One table: the unpruned model on top; 10%, 25% and 50% of the 270 query heads removed, heads
chosen by random / magnitude / taylor / gradient / ablation scores, each without and with
`--compensate` (sequential least-squares refit of the output projections, heads inside a
layer chosen by the error left after the refit); and 3 -> 1 KV heads with mean / aligned / fit.

Data (all `builtin:pydoc`, blocks of --seq-len tokens): scores and calibration use blocks
0..CAL-1; the refit checks of `fit` use the next HELD blocks; perplexity is measured on the
EVAL blocks after those, never seen by scoring or calibration.

    HF_HUB_OFFLINE=1 python benchmarks/bench_quality.py            # ~25 min on 2 CPU cores

Writes benchmarks/results/quality.json (after every row, so a partial run keeps its rows).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_clock, run as a script
from bench_cross_domain import EARLIER_REFIT  # noqa: E402
from run_clock import RunClock  # noqa: E402

from headtool.surgery import merging as C
from headtool.measure.calibration import attention_input_grams
from headtool.data.sources import DataSpec
from headtool.data.batches import make_batches
from headtool.measure.evaluation import evaluate
from headtool.model.loading import load_model, model_from_object
from headtool.surgery.pruning import prune
from headtool.measure.scoring import score_heads
from headtool.surgery.selection import Target, select_heads

HERE = Path(__file__).resolve().parent
METHODS = ("random", "magnitude", "taylor", "gradient", "ablation")
MERGES = ("mean", "aligned", "fit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cal", type=int, default=32, help="calibration / scoring blocks")
    ap.add_argument("--held", type=int, default=8, help="blocks held out for the refit checks of fit")
    ap.add_argument("--eval", type=int, default=32, help="evaluation blocks")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--fractions", default="0.1,0.25,0.5")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--merges", default=",".join(MERGES))
    ap.add_argument("--out", default=str(HERE / "results" / "quality.json"))
    a = ap.parse_args()
    fractions = [float(f) for f in a.fractions.split(",") if f]
    methods = [m for m in a.methods.split(",") if m]
    merges = [m for m in a.merges.split(",") if m]
    command = shlex.join(["python", "benchmarks/bench_quality.py", *sys.argv[1:]])

    clock = RunClock()
    log = clock.log
    lm = load_model("smollm2-135m", dtype="float32", device="cpu")
    spec = DataSpec(source="builtin:pydoc", seq_len=a.seq_len, batch_size=a.batch_size, max_samples=a.cal)
    cal = make_batches(spec, lm.tokenizer, "lm")
    held = make_batches(replace(spec, max_samples=a.held, skip_samples=a.cal), lm.tokenizer, "lm")
    ev = make_batches(replace(spec, max_samples=a.eval, skip_samples=a.cal + a.held), lm.tokenizer, "lm")
    base = evaluate(lm.model, ev.batches, "lm")
    doc = {"model": "smollm2-135m", "command": command, "data": {"calibration": cal.info, "heldout": held.info,
           "eval": ev.info}, "unpruned": {"loss": base["loss"], "perplexity": base["perplexity"],
           "heads": sum(g.num_heads for g in lm.geometry)}, "prune": [], "convert": [], "scores_seconds": {}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        doc["total_seconds"] = clock.seconds()
        out.write_text(json.dumps(doc, indent=2) + "\n")


    log(f"unpruned perplexity {base['perplexity']:.3f}")
    scores = {}
    for method in methods:
        t0 = time.perf_counter()
        data = None if method in ("random", "magnitude") else cal.batches
        scores[method] = score_heads(lm.model, lm.adapter, data, method=method, objective="lm", seed=0).scores
        doc["scores_seconds"][method] = round(time.perf_counter() - t0, 1)
        log(f"scores {method}: {doc['scores_seconds'][method]} s")
    save()

    for fraction in fractions:
        for method in methods:
            sel = select_heads(scores[method], lm.geometry, Target(fraction=fraction))
            for compensate in (False, True):
                t0 = time.perf_counter()
                model = copy.deepcopy(lm.model)
                # the refit settings quality.json's rows ran at (the library's defaults then)
                r = prune(model_from_object(model, lm.tokenizer), sel, compensate=compensate,
                          calib_batches=cal.batches if compensate else None, **EARLIER_REFIT)
                e = evaluate(model, ev.batches, "lm")
                row = {"fraction": fraction, "method": method, "compensate": compensate,
                       "heads_removed": r.summary()["heads_removed"], "loss": e["loss"],
                       "perplexity": e["perplexity"], "ratio": e["perplexity"] / base["perplexity"],
                       "seconds": round(time.perf_counter() - t0, 1)}
                doc["prune"].append(row)
                save()
                log(f"prune {fraction:.0%} {method:<9} compensate={compensate!s:<5} ppl {e['perplexity']:10.2f} "
                    f"({row['ratio']:.2f}x, {row['seconds']} s)")
                del model

    if merges:
        t0 = time.perf_counter()
        grams = attention_input_grams(lm.model, lm.adapter, cal.batches)
        grams_s = time.perf_counter() - t0
        for method in merges:
            t0 = time.perf_counter()
            conv = C.convert_model(lm.model, lm.adapter, 1, method=method, grams=grams, refit=method == "fit",
                                   batches=cal.batches, heldout_batches=held.batches)
            e = evaluate(conv.model, ev.batches, "lm")
            row = {"kv_heads": "3 -> 1", "method": method, "refit": method == "fit", "loss": e["loss"],
                   "perplexity": e["perplexity"], "ratio": e["perplexity"] / base["perplexity"],
                   "seconds": round(time.perf_counter() - t0 + (grams_s if method != "mean" else 0.0), 1)}
            doc["convert"].append(row)
            save()
            log(f"convert 3->1 {method:<8} ppl {e['perplexity']:10.2f} ({row['ratio']:.2f}x)")
            del conv
    save()
    print(render(doc))


def render(doc: dict) -> str:
    """The markdown table of a quality document (also used to regenerate README's Results)."""
    base = doc["unpruned"]
    lines = ["| change | heads chosen by | no compensation | `--compensate` |", "| --- | --- | ---: | ---: |",
             f"| none (unpruned, {base['heads']} query heads) | - | {base['perplexity']:.2f} | - |"]
    cells: dict[tuple, dict] = {(r["fraction"], r["method"], r["compensate"]): r for r in doc["prune"]}
    seen = []
    for r in doc["prune"]:
        if (r["fraction"], r["method"]) not in seen:
            seen.append((r["fraction"], r["method"]))
    best = {}
    for (f, m) in seen:
        for c in (False, True):
            if (f, m, c) in cells:
                best[f] = min(best.get(f, float("inf")), cells[(f, m, c)]["perplexity"])

    def cell(f, m, c):
        r = cells.get((f, m, c))
        if r is None:
            return "-"
        txt = f"{_fmt(r['perplexity'])} ({r['ratio']:.2f}x)"
        return f"**{txt}**" if r["perplexity"] == best[f] else txt

    for (f, m) in seen:
        n = cells.get((f, m, False), cells.get((f, m, True)))["heads_removed"]
        lines.append(f"| {f:.0%} of query heads removed ({n}) | {m} | {cell(f, m, False)} | {cell(f, m, True)} |")
    for r in doc["convert"]:
        label = r["method"] + (" (+ sequential refit)" if r.get("refit") else "")
        lines.append(f"| 3 → 1 KV heads | merge {label} | {_fmt(r['perplexity'])} ({r['ratio']:.2f}x) | - |")
    return "\n".join(lines)


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if v >= 1000 else f"{v:.2f}"


if __name__ == "__main__":
    main()
