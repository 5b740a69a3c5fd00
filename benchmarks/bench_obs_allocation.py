"""How many heads each layer loses by what the refit cannot repair (`prune --normalize obs`), per
calibration sample, against the allocations from scores that bench_allocation measured.

For every calibration sample (bench_cross_domain --seed) and fraction, SmolLM2-135M is pruned at prune's
defaults (gradient scores on 64 blocks of `builtin:pydoc+self`, `--compensate --anchor 1`, the first
layer protected) with `--normalize obs`, `--anchor-power 0` and `--damping 0.01` unless given (one anchor for
every layer, the defaults when obs_allocation.json was made: the rows every --anchor-power table compares with), judged on the 64 blocks of self text a list of modes is judged
on (so its paired difference from `auto`'s pick is known: bench_allocation recorded those blocks' losses
for the same samples), and evaluated out of domain as bench_cross_domain.py. The table puts every sample
beside what `auto` and `layer,geometric,none --allocation-margin 1` kept in benchmarks/results/
allocation*.json (the same calibration, evaluation blocks and machine: their ratios reproduce to the
digit), with geometric means over the samples. With `--cal N` other than 64 (prune's default with
`--compensate` is PRUNE_CALIBRATION_BLOCKS, 256 since 2026-12-06) the table sets each sample beside every
smaller run at the same `--anchor-power` and `--damping` (a larger calibration adds blocks to the same ones).
With `--eval N` other than 16 (blocks of 128 tokens a set) the same prunes are judged on more text, and the table
sets each sample's ratios (± one standard error over the evaluation blocks) beside its 16-block ratios.

    python benchmarks/bench_obs_allocation.py --seeds 0,1,2,3,4,5,6,7,8,9 --fractions 0.25,0.5
    python benchmarks/bench_obs_allocation.py --seeds 0,1,2,3,4 --fractions 0.25,0.5 --cal 128 \
        --anchor-power 3 --damping 0.001 --out benchmarks/results/obs_blocks_128.json
    python benchmarks/bench_obs_allocation.py --seeds 0,1,2,3,4 --fractions 0.25,0.5 --cal 256 \
        --anchor-power 3 --damping 0.001 --out benchmarks/results/obs_blocks_256.json
    python benchmarks/bench_obs_allocation.py --seeds 0,1,2,3,4 --fractions 0.25,0.5 --cal 256 \
        --anchor-power 3 --damping 0.001 --eval 128 --out benchmarks/results/obs_eval_256.json
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_cross_domain as cross  # noqa: E402
from bench_allocation import MODES, judged  # noqa: E402
from sample_runs import add_sample_options, document, geomean, removed_per_layer, start  # noqa: E402

from headtool.measure.evaluation import evaluate, paired_difference  # noqa: E402
from headtool.model.loading import model_from_object  # noqa: E402
from headtool.workflows.prune import prune_loaded  # noqa: E402
from headtool.workflows.requests import PruneRequest  # noqa: E402

CALIBRATION = "builtin:pydoc+self"
LISTED = ("obs", "layer", "none")  # obs with auto's two modes, judged as prune judges a list


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sample_options(ap, fractions="0.25,0.5", out="obs_allocation.json")
    ap.add_argument("--anchor-power", type=float, default=0.0,
                    help="prune --anchor-power (default 0 here, not prune's: its table then sets these rows "
                         "beside obs without it)")
    ap.add_argument("--damping", type=float, default=cross.EARLIER_REFIT["damping"],
                    help="prune --damping (default 0.01 here, the setting of the rows the tables compare with)")
    a = ap.parse_args()
    run = start(a)
    lm, tok = run.lm, run.lm.tokenizer
    doc = document(run, "bench_obs_allocation.py", CALIBRATION, anchor_power=a.anchor_power,
                   damping=a.damping)
    for seed in run.seeds:
        sample = run.scored(CALIBRATION, seed)
        spec, scores, score_s, judge = sample.spec, sample.scores, sample.score_seconds, sample.judge
        for fraction in run.fractions:
            t0 = time.perf_counter()
            plm = model_from_object(copy.deepcopy(lm.model), tok, ref=cross.MODEL)
            req = PruneRequest(model=cross.MODEL, fraction=fraction, compensate=True, data=spec, normalize="obs",
                               anchor_power=a.anchor_power, damping=a.damping, unit="query")  # the unit of its results (prune's default then)
            done = prune_loaded(plm, req, scores=scores, text_model=lm)
            prune_s = time.perf_counter() - t0
            verdict = evaluate(plm.model, judge, "lm", label="judge obs", per_block=True)
            row = {"seed": seed, "fraction": fraction, "score_seconds": round(score_s, 1),
                   "heads_removed": done.result.summary()["heads_removed"],
                   "judge_loss": verdict["loss"], "judge_block_sums": [round(v, 6) for v in verdict["block_sums"]],
                   "judge_block_weights": verdict["block_weights"],
                   "removed_per_layer": removed_per_layer(done.result),
                   "statistics_seconds": done.result.allocation["obs"]["seconds"],
                   "prune_seconds": round(prune_s, 1), "eval": run.ratios(plm.model),
                   "anchors": [r.get("anchor") for r in done.result.compensation]}
            doc["rows"].append(row)
            run.clock.log(f"seed {seed} {fraction:.0%} obs: judge {row['judge_loss']:.4f}, " + " / ".join(
                f"{n} {r['ratio']:.3f}x" for n, r in row["eval"].items()))
            run.save(doc)
    if a.eval != COMPARED_EVAL:
        print(render_eval(doc, fewer_eval_rows(doc)))
    elif a.cal != COMPARED_CAL:
        print(render_blocks(doc, blocks_rows(doc)))
    else:
        print(render_power(doc, obs_rows(power=compared_power(doc))) if a.anchor_power else render(doc, baselines()))


def baselines(folder: Path = HERE / "results") -> dict:
    """bench_allocation's rows by (seed, fraction), from every allocation*.json."""
    rows = {}
    for path in sorted(folder.glob("allocation*.json")):
        for r in json.loads(path.read_text())["rows"]:
            rows[(r["seed"], r["fraction"])] = r
    return rows


def render(doc: dict, base: dict) -> str:
    """Per fraction and sample: obs's judge loss (with its paired difference from auto's pick) and ratios,
    beside auto's and the margin list's ratios; then geometric means, and obs's wins sample by sample."""
    order = doc["order"]
    labels = [doc["domains"][n].get("label", n) for n in order]
    lines = ["| removed | calibration sample | allocation | judge loss (self text; obs: paired difference from "
             "`auto`'s pick ± one standard error) | " + " | ".join(labels) + " | heads a layer lost (the counts "
             "that occur) | seconds of the prune (of which obs's statistics) |",
             "| --- | ---: | --- | ---: | " + " | ".join("---:" for _ in order) + " | --- | ---: |"]
    picks: dict[tuple, list] = {}
    for fraction in doc["settings"]["fractions"]:
        rows = [r for r in doc["rows"] if r["fraction"] == fraction and (r["seed"], fraction) in base]
        for r in rows:
            b = base[(r["seed"], fraction)]
            auto, margin = b["auto"], judged(b, MODES, 1.0)
            diff, se = paired_difference(r["judge_block_sums"], b["modes"][auto]["judge_block_sums"],
                                         b["judge_block_weights"])
            entries = [("`obs`", f"{r['judge_loss']:.4f} ({diff:+.4f} ± {se:.4f})", r["eval"], r["removed_per_layer"],
                        f"{r['prune_seconds']:.0f} ({r['statistics_seconds']:.0f})"),
                       (f"`auto` (kept {auto})", f"{b['modes'][auto]['judge_loss']:.4f}", b["modes"][auto]["eval"],
                        b["modes"][auto]["removed_per_layer"], ""),
                       (f"`layer,geometric,none` margin 1 (kept {margin})", f"{b['modes'][margin]['judge_loss']:.4f}",
                        b["modes"][margin]["eval"], b["modes"][margin]["removed_per_layer"], "")]
            for name, judge, ev, removed, secs in entries:
                lines.append(f"| {fraction:.0%} ({r['heads_removed']}) | {r['seed']} | {name} | {judge} | "
                             + " | ".join(f"{ev[n]['ratio']:.3f}x" for n in order)
                             + f" | {', '.join(map(str, sorted(set(removed))))} | {secs} |")
            listed = {"modes": {"obs": {"judge_loss": r["judge_loss"], "judge_block_sums": r["judge_block_sums"],
                                        "eval": r["eval"]}, **b["modes"]},
                      "judge_block_weights": b["judge_block_weights"]}
            picks.setdefault((fraction, "list"), []).append(listed["modes"][judged(listed, LISTED)]["eval"])
            picks.setdefault((fraction, "obs"), []).append(r["eval"])
            picks.setdefault((fraction, "auto"), []).append(b["modes"][auto]["eval"])
            picks.setdefault((fraction, "margin"), []).append(b["modes"][margin]["eval"])
        if len(rows) > 1:
            names = {"obs": "`obs`", "auto": "`auto` (layer,none)", "margin": "`layer,geometric,none` margin 1",
                     "list": f"`{','.join(LISTED)}` (the judge's pick)"}
            for key, name in names.items():
                lines.append(mean_line(fraction, name, picks[(fraction, key)], order,
                                       picks[(fraction, "auto")] if key == "obs" else None,
                                       "samples where obs beat auto"))
    return "\n".join(lines)


def mean_line(fraction: float, name: str, got: list[dict], order: list[str], beaten: list[dict] | None = None,
              wins: str = "") -> str:
    """A table's geometric-mean row over the samples' evaluations `got`; with `beaten` (the same samples'
    evaluations of another rule) how many samples were better, per set."""
    count = "" if beaten is None else f" ({wins}: " + ", ".join(
        f"{sum(g[n]['ratio'] < b[n]['ratio'] for g, b in zip(got, beaten))}/{len(got)} {n}" for n in order) + ")"
    return (f"| {fraction:.0%} | geometric mean of {len(got)} | {name}{count} | | "
            + " | ".join(f"**{geomean([e[n]['ratio'] for e in got]):.3f}x**" for n in order) + " | | |")


#: the calibration size of the runs every other table compares with (the CLI's before 2026-12-06)
COMPARED_CAL = 64


#: the evaluation blocks per set of the runs the calibration tables compare (sample_runs' --eval default)
COMPARED_EVAL = 16


def _runs(folder: Path, power: float, damping: float | None,
          eval_blocks: int = COMPARED_EVAL) -> list[tuple[int, list[dict]]]:
    """(calibration blocks, rows) of every obs run in `folder` (obs_allocation*.json, obs_blocks_*.json) pruned
    at --anchor-power `power` and `damping` (default the 0.01 the power tables compare with) and evaluated on
    `eval_blocks` blocks a set (other evaluations give other ratios of the same prunes)."""
    damping = cross.EARLIER_REFIT["damping"] if damping is None else damping
    runs = []
    for pattern in ("obs_allocation*.json", "obs_blocks_*.json"):
        for path in sorted(folder.glob(pattern)):
            doc = json.loads(path.read_text())
            st = {**cross.EARLIER_REFIT, **doc["settings"]}
            same_eval = st.get("eval", COMPARED_EVAL) == eval_blocks
            if st["anchor_power"] == power and st["damping"] == damping and same_eval:
                runs.append((st.get("cal", COMPARED_CAL), doc["rows"]))
    return runs


def _by_size(runs: list[tuple[int, list[dict]]]) -> dict[int, dict]:
    """`_runs`' rows by calibration size, then by (seed, fraction)."""
    out: dict[int, dict] = {}
    for blocks, rows in runs:
        out.setdefault(blocks, {}).update({(r["seed"], r["fraction"]): r for r in rows})
    return out


def obs_rows(folder: Path = HERE / "results", power: float = 0.0, damping: float | None = None,
             cal: int = COMPARED_CAL) -> dict:
    """Rows of the obs runs pruned at --anchor-power `power` and `damping` on `cal` calibration blocks, by
    (seed, fraction)."""
    return _by_size(_runs(folder, power, damping)).get(cal, {})


def blocks_rows(doc: dict, folder: Path = HERE / "results") -> dict[int, dict]:
    """The rows a run on more calibration blocks is set beside, by calibration size (largest first): every
    smaller calibration run at the same power and damping (COMPARED_CAL, the CLI's before 2026-12-06, among
    them)."""
    st = doc["settings"]
    sizes = _by_size(_runs(folder, st["anchor_power"], st.get("damping"), st.get("eval", COMPARED_EVAL)))
    return {blocks: sizes[blocks] for blocks in sorted(sizes, reverse=True) if blocks < st["cal"]}


def fewer_eval_rows(doc: dict, folder: Path = HERE / "results") -> dict:
    """The rows of the same prunes (calibration size, power, damping) evaluated on COMPARED_EVAL blocks a set,
    by (seed, fraction): what a run on more evaluation blocks is set beside."""
    st = doc["settings"]
    return obs_rows(folder, st["anchor_power"], st.get("damping"), st["cal"])


def render_eval(doc: dict, fewer: dict) -> str:
    """Per fraction and sample: the ratios on the run's evaluation blocks (± one standard error of the
    log ratio over those blocks) beside the same prune's ratios on the first COMPARED_EVAL of them
    (a larger evaluation adds blocks to the same ones), then geometric means of both. The prunes are
    the same (same calibration and settings, deterministic); only the text they are judged on grows."""
    order = doc["order"]
    n_eval = doc["settings"]["eval"]
    labels = [doc["domains"][n].get("label", n) for n in order]
    lines = ["| removed | calibration sample | evaluation blocks a set | " + " | ".join(labels) + " |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in order) + " |"]
    for fraction in doc["settings"]["fractions"]:
        rows = [r for r in doc["rows"] if r["fraction"] == fraction and (r["seed"], fraction) in fewer]
        for r in rows:
            small = fewer[(r["seed"], fraction)]["eval"]
            lines.append(f"| {fraction:.0%} ({r['heads_removed']}) | {r['seed']} | {n_eval} | " + " | ".join(
                f"{r['eval'][n]['ratio']:.3f}x ± {r['eval'][n]['log_ratio_se'] * r['eval'][n]['ratio']:.3f}"
                for n in order) + " |")
            lines.append(f"| | | {COMPARED_EVAL} | " + " | ".join(f"{small[n]['ratio']:.3f}x" for n in order) + " |")
        if len(rows) > 1:
            for blocks, evals in ((n_eval, [r["eval"] for r in rows]),
                                  (COMPARED_EVAL, [fewer[(r["seed"], fraction)]["eval"] for r in rows])):
                lines.append(f"| {fraction:.0%} | geometric mean of {len(rows)} | {blocks} | " + " | ".join(
                    f"**{geomean([e[n]['ratio'] for e in evals]):.3f}x**" for n in order) + " |")
    return "\n".join(lines)


def sample_line(first: dict, cells: list[str], row: dict, order: list[str]) -> str:
    """One table row of a sample (`first`: the run's row, for the fraction, heads and seed): `cells` after
    the sample, then `row`'s ratios, the counts a layer lost and the prune's seconds."""
    return (f"| {first['fraction']:.0%} ({first['heads_removed']}) | {first['seed']} | " + " | ".join(cells) + " | "
            + " | ".join(f"{row['eval'][n]['ratio']:.3f}x" for n in order)
            + f" | {', '.join(map(str, sorted(set(row['removed_per_layer']))))} | {row['prune_seconds']:.0f} |")


def render_blocks(doc: dict, smaller: dict[int, dict]) -> str:
    """Per fraction and sample: obs on `cal` calibration blocks beside the same prune on each smaller calibration
    (`blocks_rows`: the first blocks of the same sample, since a larger calibration adds blocks), then geometric
    means, each with how many samples beat the next smaller calibration. Only samples every calibration ran.
    No judge column: each run's judge is the self text after its own calibration, so they are not paired."""
    order = doc["order"]
    cal = doc["settings"]["cal"]
    labels = [doc["domains"][n].get("label", n) for n in order]
    lines = ["| removed | calibration sample | calibration blocks | " + " | ".join(labels)
             + " | heads a layer lost (the counts that occur) | seconds of the prune |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in order) + " | --- | ---: |"]
    for fraction in doc["settings"]["fractions"]:
        rows = [r for r in doc["rows"] if r["fraction"] == fraction
                and all((r["seed"], fraction) in runs for runs in smaller.values())]
        sizes = [(cal, {(r["seed"], fraction): r for r in rows}), *smaller.items()]
        for r in rows:
            for blocks, runs in sizes:
                lines.append(sample_line(r, [str(blocks)], runs[(r["seed"], fraction)], order))
        if len(rows) > 1:
            evals = [[runs[(r["seed"], fraction)]["eval"] for r in rows] for _, runs in sizes]
            for i, (blocks, _) in enumerate(sizes):
                if i + 1 < len(sizes):
                    lines.append(mean_line(fraction, f"{blocks} blocks", evals[i], order, evals[i + 1],
                                           f"samples better than {sizes[i + 1][0]} blocks"))
                else:
                    lines.append(mean_line(fraction, f"{blocks} blocks", evals[i], order))
    return "\n".join(lines)


def compared_power(doc: dict) -> float:
    """The --anchor-power of the rows a power run is set beside: 0 (what the power changes), or its own
    power when the run also changes the damping (what the damping changes)."""
    return doc["settings"]["anchor_power"] if damping_flag(doc) else 0.0


def damping_flag(doc: dict) -> str:
    """` --damping D` where a run's damping is not the 0.01 of the rows it is compared with."""
    damping = doc["settings"].get("damping", cross.EARLIER_REFIT["damping"])
    return f" `--damping {damping:g}`" if damping != cross.EARLIER_REFIT["damping"] else ""


def render_power(doc: dict, plain: dict) -> str:
    """Per fraction and sample: obs with --anchor-power P beside obs without it (the same calibration,
    judge and evaluation blocks), the judge loss's paired difference, then geometric means and wins."""
    order = doc["order"]
    power = doc["settings"]["anchor_power"]
    setting, base = f"{power:g}" + damping_flag(doc), f"{compared_power(doc):g}"
    labels = [doc["domains"][n].get("label", n) for n in order]
    lines = ["| removed | calibration sample | `--anchor-power` | judge loss (self text; paired difference from "
             f"power {base} ± one standard error) | " + " | ".join(labels) + " | heads a layer lost (the counts that "
             "occur) | seconds of the prune |",
             "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in order) + " | --- | ---: |"]
    for fraction in doc["settings"]["fractions"]:
        rows = [r for r in doc["rows"] if r["fraction"] == fraction and (r["seed"], fraction) in plain]
        for r in rows:
            b = plain[(r["seed"], fraction)]
            diff, se = paired_difference(r["judge_block_sums"], b["judge_block_sums"], b["judge_block_weights"])
            for p, judge, row in ((setting, f"{r['judge_loss']:.4f} ({diff:+.4f} ± {se:.4f})", r),
                                  (base, f"{b['judge_loss']:.4f}", b)):
                lines.append(sample_line(r, [p, judge], row, order))
        if len(rows) > 1:
            without = [plain[(r["seed"], fraction)]["eval"] for r in rows]
            lines.append(mean_line(fraction, setting, [r["eval"] for r in rows], order, without,
                                   f"samples better than power {base}"))
            lines.append(mean_line(fraction, base, without, order))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
