"""What the data-aware steps cost against one forward over the same calibration tokens (issue 18).

In one run on one model (default SmolLM2-135M, float32, CPU), on the same N calibration blocks:
- `forward`: one plain forward of the model over the blocks (logits included), timed at the
  start and again at the end; the faster of the two is the unit;
- `grams`: the attention-input Gram matrices that fit and aligned merge from
  (`attention_input_grams`, one layer-by-layer pass);
- `merge fit`: `convert_model(method="fit", refit=True)` to --kv-heads, with the sequential
  output-projection refit judged on the held-out blocks (the convert-gqa default);
- `merge aligned`: `convert_model(method="aligned")` (no refit, the convert-gqa default);
- `prune --compensate`: `prune(compensate=True)` of --fraction of the query heads (chosen from
  gradient scores computed beforehand, not timed in the step), heads chosen inside layers by
  the refit cost (the default), held-out blocks as for the merge; per --unit (a comma list; `auto`
  is what prune's `--unit auto` takes for a compensated prune of this model: `head` on SmolLM2);
- `allocation obs`: the split of those heads over the layers that `--normalize obs` (prune's
  default with `--compensate`) makes before the refit: one forward and backward pass for the
  statistics, then each layer's refit error per count (`obs_selection`, anchor 1 as prune's default);
  per --unit, and once more with every removal set costed from scratch (a Cholesky of the set's
  block each, as before the beam grew its sets' factors), which must choose the same heads;
- `score + obs`: what `headtool prune --compensate` runs before its refit when it scores on --data
  (with the first --unit):
  gradient scores and the obs split on the same blocks, once as two passes (scoring, then the
  allocation's own forward and backward pass) and once as the CLI now runs them (the allocation's
  statistics collected by a `SensitivityProbe` riding on the scoring pass); the row records that
  both give the same selection;
- `self-generation`: `self_blocks` sampling N blocks of --seq-len tokens from the model
  (`--data self:N`: batched generation with a KV cache, the cache on disk bypassed). It samples
  whole groups (32 blocks of 128 tokens), so N = 16 samples 32: twice the forward's tokens,
  which is what `--data self:16` costs the first time.
The convert-gqa steps are reported with and without the shared `grams` pass; each ratio is
seconds / forward seconds. The load average is recorded: on a shared machine it explains a lot.

    python benchmarks/refit_speed.py --blocks 16 [--heldout 4 --seq-len 128 --batch-size 8]
        [--anchor default|0|grid|0,1,inf] [--steps fit,aligned,compensate] [--unit auto,query] [--threads 1]

writes benchmarks/results/refit_speed.json and prints a table. results/refit_speed_before.json is
the same run (--blocks 16) on the code before the anchored refit and the speed work (main at
5313171), for comparison.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import sys
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HEADTOOL_NO_PROGRESS", "1")

import torch

from headtool.data.batches import make_batches
from headtool.data.selfgen import self_blocks
from headtool.data.sources import DataSpec
from headtool.measure.calibration import attention_input_grams
from headtool.measure.scoring import score_heads
from headtool.model.loading import load_model, model_from_object
from headtool.surgery import merging
from headtool.surgery import obs_allocation
from headtool.surgery.obs_allocation import SensitivityProbe, obs_selection
from headtool.surgery.pruning import prune
from headtool.surgery.selection import Target, resolve_unit, select_heads
from headtool.workflows.requests import DEFAULT_PRUNE_DAMPING

RESULTS = Path(__file__).parent / "results" / "refit_speed.json"
STEPS = ("fit", "aligned", "compensate", "obs", "score+obs", "selfgen")


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _anchor_kwargs(text: str) -> dict:
    """{} for the library's default, so that the script also times code from before the parameter."""
    if text == "default":
        return {}
    if text == "grid":
        from headtool.surgery.compensation import ANCHOR_GRID
        return {"anchor": ANCHOR_GRID}
    return {"anchor": [float(a) for a in text.split(",")] if "," in text else float(text)}


@contextmanager
def _from_scratch_costs():
    """obs_allocation with every removal set costed anew: its removal costs seen as plain functions,
    so the beam cannot grow a set's factor (`selection._FromScratch`); the original restored after."""
    original = obs_allocation.removal_cost

    def plain(*args, **kwargs):
        cost = original(*args, **kwargs)
        return lambda heads: cost(heads)

    obs_allocation.removal_cost = plain
    try:
        yield
    finally:
        obs_allocation.removal_cost = original


def _score_and_obs(lm, batches, target: Target) -> list[dict]:
    """Gradient scores and the obs split of `target`'s heads: two passes, then one (module doc)."""
    def run(shared: bool):
        probe = SensitivityProbe(lm.model, lm.adapter) if shared else None
        scores = score_heads(lm.model, lm.adapter, batches, method="gradient", objective="lm", probe=probe).scores
        total = select_heads(scores, lm.geometry, target).num_removed(lm.geometry)
        return obs_selection(lm.model, lm.adapter, lm.geometry, scores, target, total, None if shared else batches,
                             "lm", damping=DEFAULT_PRUNE_DAMPING, anchor=1.0,
                             sensitivity=probe.result() if shared else None).selection
    two, two_s = _timed(lambda: run(False))
    one, one_s = _timed(lambda: run(True))
    return [{"step": f"score + obs --unit {target.unit}, two passes", "seconds": two_s, "unit": target.unit},
            {"step": f"score + obs --unit {target.unit}, one pass (CLI)", "seconds": one_s, "unit": target.unit,
             "same_selection": one.kept == two.kept}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--source", default="builtin:pydoc")
    ap.add_argument("--blocks", type=int, default=16, help="calibration blocks (N)")
    ap.add_argument("--heldout", type=int, default=None, help="held-out blocks (default: a quarter, at least 4)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--anchor", default="default",
                    help="default (the library's: chosen from the grid on the held-out blocks), a strength, "
                         "a comma list, or grid")
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--unit", default="auto", help="prune's --unit for the compensate and obs steps, a comma list "
                    "(auto: as prune --compensate resolves it for this model)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    steps = [s for s in a.steps.split(",") if s]
    bad = sorted(set(steps) - set(STEPS))
    if bad:
        raise SystemExit(f"unknown steps {bad}; use {', '.join(STEPS)}")
    lm = load_model(a.model, dtype="float32", device="cpu")
    n_held = a.heldout if a.heldout is not None else max(4, a.blocks // 4)
    spec = DataSpec(source=a.source, seq_len=a.seq_len, batch_size=a.batch_size, max_samples=a.blocks)
    cal = make_batches(spec, lm.tokenizer, "lm")
    held = make_batches(DataSpec(source=a.source, seq_len=a.seq_len, batch_size=a.batch_size, max_samples=n_held,
                                 skip_samples=a.blocks), lm.tokenizer, "lm") if n_held else None
    held_batches = held.batches if held else None
    tokens = cal.num_tokens
    kw = _anchor_kwargs(a.anchor)

    def forward():
        with torch.inference_mode():
            for b in cal.batches:
                lm.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)

    forward()  # warm-up (allocator, first-call overheads), not timed
    _, fwd_s = _timed(forward)
    rows = [{"step": "forward", "seconds": fwd_s}]
    load = {"start": os.getloadavg()[0]}
    if {"fit", "aligned"} & set(steps):
        grams, grams_s = _timed(lambda: attention_input_grams(lm.model, lm.adapter, cal.batches))
        rows.append({"step": "grams", "seconds": grams_s})
        for method in ("fit", "aligned"):
            if method not in steps:
                continue
            refit = method == "fit"
            conv, s = _timed(lambda m=method, r=refit: merging.convert_model(
                lm.model, lm.adapter, a.kv_heads, method=m, grams=grams, refit=r, batches=cal.batches,
                heldout_batches=held_batches if r else None, **(kw if r else {})))
            rows.append({"step": f"merge {method}" + (" + refit" if refit else ""), "seconds": s,
                         "with_grams_s": s + grams_s,
                         "refit_layers_kept": None if conv.refit is None else sum(r["kept"] for r in conv.refit)})
            del conv
    units = list(dict.fromkeys(resolve_unit(u, lm.geometry, compensate=True) for u in a.unit.split(",") if u))
    if {"compensate", "obs"} & set(steps):
        scores = score_heads(lm.model, lm.adapter, cal.batches, method="gradient", objective="lm").scores
    for unit in units:
        target = Target(fraction=a.fraction, unit=unit)
        sel = select_heads(scores, lm.geometry, target) if {"compensate", "obs"} & set(steps) else None
        if "compensate" in steps:
            model = copy.deepcopy(lm.model)
            res, s = _timed(lambda: prune(model_from_object(model, lm.tokenizer), sel, calib_batches=cal.batches,
                                          heldout_batches=held_batches, compensate=True, unit=unit, **kw))
            rows.append({"step": f"prune {a.fraction:g} --compensate --unit {unit}", "seconds": s, "unit": unit,
                         "refit_layers_kept": sum(r["kept"] for r in res.compensation)})
            del model
        if "obs" in steps:
            def allocate():
                return obs_selection(lm.model, lm.adapter, lm.geometry, scores, target, sel.num_removed(lm.geometry),
                                     cal.batches, "lm", damping=DEFAULT_PRUNE_DAMPING, anchor=1.0)
            obs, s = _timed(allocate)
            rows.append({"step": f"allocation obs --unit {unit}", "seconds": s, "unit": unit,
                         "removed_per_layer": [len(r) for r in obs.selection.removed(lm.geometry)]})
            with _from_scratch_costs():
                anew, s = _timed(allocate)
            rows.append({"step": f"allocation obs --unit {unit}, sets costed anew", "seconds": s, "unit": unit,
                         "same_selection": anew.selection.kept == obs.selection.kept})
    if "score+obs" in steps:
        rows += _score_and_obs(lm, cal.batches, Target(fraction=a.fraction, unit=units[0]))
    if "selfgen" in steps:
        sb, s = _timed(lambda: self_blocks(lm.model, lm.tokenizer, a.blocks, a.seq_len, seed=0, cache=False))
        # whole groups are sampled (selfgen.group_size): the row says how many, beside the count asked for
        rows.append({"step": f"self-generation ({a.blocks} blocks, {sb.generated} sampled)", "seconds": s,
                     "sampled_blocks": sb.generated})
    _, fwd_end = _timed(forward)  # again at the end: on a shared machine the unit is the faster of the two
    load["end"] = os.getloadavg()[0]
    rows[0]["seconds_at_end"] = fwd_end
    fwd_s = min(fwd_s, fwd_end)
    for r in rows:
        r["x_forward"] = r["seconds"] / fwd_s
        if "with_grams_s" in r:
            r["with_grams_x_forward"] = r["with_grams_s"] / fwd_s
    doc = {"model": a.model, "command": shlex.join(["python", "benchmarks/refit_speed.py", *sys.argv[1:]]),
           "source": a.source, "blocks": a.blocks, "heldout_blocks": n_held, "seq_len": a.seq_len,
           "batch_size": a.batch_size, "tokens": tokens, "kv_heads": a.kv_heads, "fraction": a.fraction,
           "anchor": a.anchor, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "load_average_1min": load, "steps": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{a.model}: {a.blocks} blocks of {a.seq_len} tokens ({tokens} tokens), {n_held} held out, "
          f"{torch.get_num_threads()} threads, load {load['start']:.1f} -> {load['end']:.1f}")
    print(f"{'step':<52} {'seconds':>9} {'x forward':>10} {'+ grams':>9}")
    for r in rows:
        extra = f"{r['with_grams_x_forward']:>9.1f}" if "with_grams_x_forward" in r else ""
        print(f"{r['step']:<52} {r['seconds']:>9.1f} {r['x_forward']:>10.1f} {extra}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
