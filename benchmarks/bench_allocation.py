"""How many heads each layer loses, per calibration sample: every `--normalize` mode pruned alone, what
the judge of a list of modes says of each, and what each costs on text the calibration never saw.

For every calibration sample (bench_cross_domain --seed: which pydoc blocks and which self text) and
fraction, SmolLM2-135M is pruned at prune's defaults (gradient scores on 64 blocks of
`builtin:pydoc+self`, `--compensate --anchor 1 --anchor-power 0 --damping 0.01`: one anchor for every layer,
the defaults when the recorded runs were made; the first layer protected) once per normalization
(`layer`, `geometric`, `none`; each alone is bit for bit the candidate a list of modes builds). Each
pruned model is scored by the judge a list uses (its mean loss on the 64 blocks of self text the
calibration did not read, the same blocks prune reads) and evaluated out of domain as
bench_cross_domain.py. The table shows what `auto` kept when these runs were made (`layer,none`; it is obs now) and what
`--normalize layer,geometric,none` keeps, per sample and as geometric means.

    python benchmarks/bench_allocation.py --seeds 0,1,2,3,4,5 --fractions 0.25,0.5
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
from sample_runs import add_sample_options, document, geomean, removed_per_layer, start  # noqa: E402

from headtool.measure.evaluation import evaluate, paired_difference  # noqa: E402
from headtool.model.loading import model_from_object  # noqa: E402
from headtool.workflows.prune import prune_loaded, undercuts  # noqa: E402
from headtool.workflows.requests import PruneRequest  # noqa: E402

CALIBRATION = "builtin:pydoc+self"
MODES = ("layer", "geometric", "none")  # `--normalize layer,geometric,none` (a tie keeps the first)
AUTO = ("layer", "none")  # what `--normalize auto` compared with --compensate when these runs were made (now obs)


MARGINS = (1.0, 2.0)  # the judges with a margin the table also shows (standard errors of the paired difference)


def paired(row: dict, mode: str, against: str) -> tuple[float, float]:
    """The judge loss of `mode` minus that of `against` on the same blocks, and its standard error."""
    return paired_difference(row["modes"][mode]["judge_block_sums"], row["modes"][against]["judge_block_sums"],
                             row["judge_block_weights"])


def judged(row: dict, modes: tuple[str, ...], margin: float = 0.0) -> str:
    """What `prune --normalize <modes> --allocation-margin <margin>` keeps, by prune's own rule
    (`undercuts`): the first mode unless a later one's judge loss is lower than the one kept so far by
    more than `margin` standard errors of their paired difference; with no margin, the lowest loss, the
    first on a tie (block losses are read only for a margin)."""
    def verdict(mode: str) -> dict:
        m = row["modes"][mode]
        return {"loss": m["judge_loss"], "block_sums": m.get("judge_block_sums"),
                "block_weights": row.get("judge_block_weights")}
    kept = modes[0]
    for mode in modes[1:]:
        if undercuts(verdict(mode), verdict(kept), margin):
            kept = mode
    return kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sample_options(ap, fractions="0.25,0.5", out="allocation.json")
    a = ap.parse_args()
    run = start(a)
    lm, tok = run.lm, run.lm.tokenizer
    doc = document(run, "bench_allocation.py", CALIBRATION, modes=list(MODES), auto=list(AUTO),
                   **cross.EARLIER_REFIT)
    for seed in run.seeds:
        sample = run.scored(CALIBRATION, seed)
        spec, scores, score_s, judge = sample.spec, sample.scores, sample.score_seconds, sample.judge
        for fraction in run.fractions:
            row = {"seed": seed, "fraction": fraction, "score_seconds": round(score_s, 1), "modes": {}}
            for mode in MODES:
                t0 = time.perf_counter()
                plm = model_from_object(copy.deepcopy(lm.model), tok, ref=cross.MODEL)
                req = PruneRequest(model=cross.MODEL, fraction=fraction, compensate=True, data=spec, normalize=mode,
                                   **cross.EARLIER_REFIT, unit="query")  # the unit of its results (prune's default then)
                done = prune_loaded(plm, req, scores=scores, text_model=lm)
                prune_s = time.perf_counter() - t0
                row["heads_removed"] = done.result.summary()["heads_removed"]
                verdict = evaluate(plm.model, judge, "lm", label=f"judge {mode}", per_block=True)
                row["judge_block_weights"] = verdict["block_weights"]
                row["modes"][mode] = {
                    "judge_loss": verdict["loss"],
                    "judge_block_sums": [round(v, 6) for v in verdict["block_sums"]],
                    "removed_per_layer": removed_per_layer(done.result),
                    "eval": run.ratios(plm.model),
                    "prune_seconds": round(prune_s, 1)}
                run.clock.log(f"seed {seed} {fraction:.0%} {mode}: judge {row['modes'][mode]['judge_loss']:.4f}, " + " / ".join(
                    f"{n} {r['ratio']:.3f}x" for n, r in row["modes"][mode]["eval"].items()))
            row["auto"], row["three"] = judged(row, AUTO), judged(row, MODES)
            doc["rows"].append(row)
            run.save(doc)
    print(render(doc))


def render(doc: dict) -> str:
    """Per fraction: every sample's three modes (judge loss and out-of-domain ratios; what
    `layer,geometric,none` keeps in bold, what `auto` keeps marked), then the geometric means of what
    each keeps, and of each mode alone."""
    order = doc["order"]
    labels = [doc["domains"][n].get("label", n) for n in order]
    lines = ["| removed | calibration sample | `--normalize` | judge loss (self text; paired difference from "
             "`auto`'s ± one standard error) | " + " | ".join(labels)
             + " | heads a layer lost (the counts that occur) |",
             "| --- | ---: | --- | ---: | " + " | ".join("---:" for _ in order) + " | --- |"]
    for fraction in doc["settings"]["fractions"]:
        rows = [r for r in doc["rows"] if r["fraction"] == fraction]
        for r in rows:
            for mode, m in r["modes"].items():
                tag = " (auto)" if mode == r["auto"] else ""
                bold = (lambda s: f"**{s}**") if mode == r["three"] else (lambda s: s)
                lines.append(f"| {fraction:.0%} ({r['heads_removed']}) | {r['seed']} | {mode}{tag} | "
                             f"{m['judge_loss']:.4f}{_gap(r, mode)} | "
                             + " | ".join(bold(f"{m['eval'][n]['ratio']:.3f}x") for n in order)
                             + f" | {', '.join(map(str, sorted(set(m['removed_per_layer']))))} |")
        if len(rows) > 1:
            picks = {"auto (layer,none)": [r["modes"][r["auto"]] for r in rows],
                     "layer,geometric,none": [r["modes"][r["three"]] for r in rows],
                     **{f"{mode} alone": [r["modes"][mode] for r in rows] for mode in doc["settings"]["modes"]}}
            for name, picked in picks.items():
                lines.append(f"| {fraction:.0%} | geometric mean of {len(rows)} | {name} | | "
                             + " | ".join(f"**{geomean([p['eval'][n]['ratio'] for p in picked]):.3f}x**"
                                          for n in order) + " | |")
    if all("judge_block_weights" in r for r in doc["rows"]):
        lines += ["", margin_table(doc)]
    return "\n".join(lines)


def _gap(row: dict, mode: str) -> str:
    """` (+0.0020 ± 0.0073)`: this mode's judge loss above `auto`'s pick, when the row has block losses."""
    if mode == row["auto"] or "judge_block_weights" not in row:
        return ""
    diff, se = paired(row, mode, row["auto"])
    return f" ({diff:+.4f} ± {se:.4f})"


def margin_table(doc: dict) -> str:
    """What judges that need a margin would have kept, from the same prunes: per fraction and list of
    modes, the lowest loss (the default) and `--allocation-margin` 1 and 2 (the first mode unless a later
    one wins by that many standard errors); geometric means over the samples, the mode kept per sample."""
    order = doc["order"]
    labels = [doc["domains"][n].get("label", n) for n in order]
    lines = ["| removed | `--normalize` | judge | " + " | ".join(labels) + " | kept, sample by sample |",
             "| --- | --- | --- | " + " | ".join("---:" for _ in order) + " | --- |"]
    for fraction in doc["settings"]["fractions"]:
        rows = [r for r in doc["rows"] if r["fraction"] == fraction]
        for modes in (AUTO, MODES):
            judges = [("lowest loss (the default)", lambda r: judged(r, modes))]
            judges += [(f"`--allocation-margin {k:g}`", lambda r, k=k: judged(r, modes, k)) for k in MARGINS]
            for name, judge in judges:
                kept = [judge(r) for r in rows]
                lines.append(f"| {fraction:.0%} | {','.join(modes)} | {name} | "
                             + " | ".join(f"{geomean([r['modes'][k]['eval'][n]['ratio'] for r, k in zip(rows, kept)]):.3f}x"
                                          for n in order) + f" | {', '.join(kept)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
