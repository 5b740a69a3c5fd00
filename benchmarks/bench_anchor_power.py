"""How strongly prune's refit should hold on to the weights: `--anchor-power` P (each pruned layer refit at
--anchor x (kept heads / heads) ^ P) per removal unit, out of domain.

Power 3 was measured with query steps (`--unit query`) on 64 blocks of calibration (bench_obs_allocation);
prune now removes single heads (`--unit auto`) on 256 blocks, and its default power follows the calibration's
size (prune_defaults.default_anchor_power: these runs set it, --cal 64 / 128 / 256). For every calibration
sample (bench_cross_domain --seed: gradient scores on `--cal` blocks of builtin:pydoc+self), fraction and
power, SmolLM2-135M is pruned by prune's code at its defaults but for --unit and --anchor-power
(`--compensate --anchor 1 --damping 0.001 --normalize auto`, the first layer protected) and judged out of
domain on `--eval` blocks a set (news, legal, wiki: bench_cross_domain's sets). The powers of one sample share
its scores and its evaluation blocks, so their ratios compare paired; the table gives each ratio ± one standard
error over the evaluation blocks, the geometric mean over the samples, and in how many (sample, set) cells each
power beat the first one listed. Rows already in --out (the same unit, sample, fraction and power) are kept
and not pruned again, so a long run can be split.

    python benchmarks/bench_anchor_power.py --seeds 0,1,2 --fractions 0.25,0.5 --powers 3,6 \\
        --out benchmarks/results/anchor_power_head.json
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_cross_domain as cross  # noqa: E402
from sample_runs import add_sample_options, document, paired_lines, removed_per_layer, resume, start  # noqa: E402

from headtool.model.loading import model_from_object  # noqa: E402
from headtool.surgery.prune_defaults import FEW_TOKENS_ANCHOR_POWER, MANY_TOKENS_ANCHOR_POWER  # noqa: E402
from headtool.workflows.prune import prune_loaded  # noqa: E402
from headtool.workflows.requests import PRUNE_CALIBRATION_BLOCKS, PruneRequest  # noqa: E402

CALIBRATION = "builtin:pydoc+self"


def row_key(r: dict) -> tuple:
    return r["unit"], r["seed"], r["fraction"], r["anchor_power"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sample_options(ap, fractions="0.25,0.5", out="anchor_power.json")
    ap.set_defaults(cal=PRUNE_CALIBRATION_BLOCKS, eval=128)
    ap.add_argument("--unit", default="head", choices=("head", "query"), help="prune --unit")
    ap.add_argument("--powers", default=f"{FEW_TOKENS_ANCHOR_POWER:g},{MANY_TOKENS_ANCHOR_POWER:g}",
                    help="prune --anchor-power values, comma-separated (the first is what the others are set "
                         "beside; default: the powers prune's default takes on few and on many calibration tokens)")
    a = ap.parse_args()
    powers = [float(p) for p in a.powers.split(",") if p.strip()]
    run = start(a)
    lm, tok = run.lm, run.lm.tokenizer
    defaults = PruneRequest(model=cross.MODEL, compensate=True)
    doc = document(run, "bench_anchor_power.py", CALIBRATION, unit=a.unit, powers=powers, damping=defaults.damping,
                   default_anchor_power=run.default_power)
    # the unit too: the file's README section is titled by its one unit
    resume(doc, Path(a.out), ("unit", "cal", "eval", "calibration", "damping"))
    done_keys = {row_key(r) for r in doc["rows"]}
    for seed in run.seeds:
        todo = [(f, p) for f in run.fractions for p in powers if (a.unit, seed, f, p) not in done_keys]
        if not todo:
            continue
        sample = run.scored(CALIBRATION, seed)
        for fraction, power in todo:
            t0 = time.perf_counter()
            plm = model_from_object(copy.deepcopy(lm.model), tok, ref=cross.MODEL)
            req = PruneRequest(model=cross.MODEL, fraction=fraction, compensate=True, data=sample.spec, unit=a.unit,
                               anchor_power=power)
            pruned = prune_loaded(plm, req, scores=sample.scores, text_model=lm)
            row = {"unit": a.unit, "seed": seed, "fraction": fraction, "anchor_power": power,
                   "heads_removed": pruned.result.summary()["heads_removed"],
                   "removed_per_layer": removed_per_layer(pruned.result),
                   "anchors": [r.get("anchor") for r in pruned.result.compensation],
                   "eval": run.ratios(plm.model), "score_seconds": round(sample.score_seconds, 1),
                   "prune_seconds": round(time.perf_counter() - t0, 1)}
            run.add_row(doc, row, f"seed {seed} {fraction:.0%} P={power:g}")
    run.save(doc)
    print(render(doc))


def render(doc: dict) -> str:
    """Per unit and fraction: every sample's ratios (± one standard error) at every power, then over the
    samples measured at both that power and the first, the geometric mean and the cells in which the power
    beat the first."""
    order = doc["order"]
    labels = [doc["domains"][n].get("label", n) for n in order]
    lines = ["| unit | removed | --anchor-power | calibration sample | " + " | ".join(labels)
             + " | better than the first power (cells) |",
             "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in order) + " | ---: |"]
    for unit in sorted({r["unit"] for r in doc["rows"]}):
        for fraction in sorted({r["fraction"] for r in doc["rows"] if r["unit"] == unit}):
            rows = {(r["seed"], r["anchor_power"]): r for r in doc["rows"]
                    if r["unit"] == unit and r["fraction"] == fraction}
            powers = [p for p in doc["settings"]["powers"] if any(k[1] == p for k in rows)]
            powers += sorted({k[1] for k in rows} - set(powers))
            lines += paired_lines(rows, powers, order, lambda p: f"{unit} | {fraction:.0%} | {p:g}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
