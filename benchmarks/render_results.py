"""Regenerate README.md's Results from benchmarks/results/*.json (nothing typed by hand).

The text between `<!-- results:begin -->` and `<!-- results:end -->` is replaced by tables
made from the JSON files the benchmark scripts write, each with the command that made it.

    python benchmarks/render_results.py           # rewrite README.md
    python benchmarks/render_results.py --check   # exit 1 if README.md is out of date (tests run this)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE.parent / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

sys.path.insert(0, str(HERE))


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 1000 else f"{v:.2f}"


def cross_domain_section(doc: dict) -> str:
    from bench_cross_domain import render

    d = doc["domains"]
    out = [n for n in doc["order"] if n != doc.get("in_domain")]
    lines = [
        "### Quality on text calibration never saw: SmolLM2-135M, no training",
        "",
        "Calibrated (scores, refits, merges) on one source, evaluated on domains no part of the pipeline "
        "saw: " + "; ".join(f"{d[n].get('label', n)}, {d[n].get('what', '')}" for n in out)
        + ". The in-domain column (pydoc blocks after the calibration ones) is last and flatters: it is "
        "the kind of text the refits were fitted to. Perplexity (ratio to the unpruned model)." + _unit_note(doc),
        "",
        render(doc),
    ]
    return "\n".join(lines)


def _unit_note(doc: dict) -> str:
    """How a run's prune rows chose heads, where it ran with prune's --unit auto."""
    if doc["settings"].get("unit") != "auto":
        return ""
    return (" Prune rows at prune's default `--unit auto`: single query heads (`--unit head`, a layer's KV "
            "groups may end up different in size) with `--compensate`, one query head from every KV group a "
            "step without a refit.")


def protect_section(doc: dict) -> str:
    from bench_cross_domain import render

    st = doc["settings"]
    return "\n".join([
        f"### The first layer (`--protect-layers`): SmolLM2-135M, {st['cal']} calibration blocks, no training",
        "",
        "The same heads chosen with the first layer in the global ranking (`--protect-layers none`, the "
        "behaviour before the option existed) and kept whole (`0`, what the default `auto` does in the "
        "global ranking); gradient scores, `--compensate`. Columns as in the table above.",
        "",
        render(doc),
    ])


def normalize_section(doc: dict) -> str:
    from bench_cross_domain import BEFORE_OBS, auto_before_obs, render, self_judged_blocks

    st = doc["settings"]
    before = any(auto_before_obs(r) for r in doc["rows"])
    judged = f"on {self_judged_blocks(doc['rows'])} blocks of self text that the calibration did not read"
    return "\n".join([
        f"### How many heads each layer loses (`--normalize`): SmolLM2-135M, {st['cal']} calibration blocks, "
        "no training",
        "",
        "The same gradient scores, normalized per layer (`layer`, Michel et al. 2019: what prune used before "
        "the option) or raw (`none`: first-order estimates of the loss each head costs, on one scale across "
        "layers); `layer,none` prunes and refits with both and keeps the one with the lower "
        f"loss {judged} (no evaluation text takes part in the choice). `auto`, prune's default with "
        "`--compensate`, is `obs` (the heads per layer from what the refit cannot repair; below)"
        + (f", and was `layer,none` before (rows marked {BEFORE_OBS})" if before else "")
        + ". Columns as in the table above.",
        "",
        render(doc),
    ])


def calibration_size_section(docs: list[dict]) -> str:
    """One table over runs of bench_cross_domain that differ only in --cal and --seed: what more
    calibration text buys out of domain, how much another sample of the same size moves it, and the cost."""
    from bench_cross_domain import (BEFORE_OBS, BEFORE_OBS_NOTE, EARLIER_REFIT, auto_before_obs, chosen_allocation,
                                    earlier_refit_flags, refit_settings, self_judged_blocks)

    def key(doc: dict) -> tuple[int, int]:
        return doc["settings"]["cal"], doc["settings"].get("seed", 0)

    # a run still under way (no prune row written yet) is left out
    docs = sorted((doc for doc in docs if any(r["kind"] == "prune" for r in doc["rows"])), key=key)
    widest = max(docs, key=lambda doc: len(doc["order"]))
    names = widest["order"]
    d = widest["domains"]
    head = [d[n].get("label", n) for n in names]
    cal = docs[0]["settings"]["calibrations"][0]
    sizes = sorted({doc["settings"]["cal"] for doc in docs})
    prunes = [r for doc in docs for r in doc["rows"] if r["kind"] == "prune"]
    lines = [
        "### How much calibration text, and which (`--max-samples`, the sample): SmolLM2-135M, heads removed "
        "with `--compensate`, no training",
        "",
        "prune at its defaults (gradient scores on the calibration blocks, "
        + (f"`--normalize auto` as it was when these ran, `layer,none` choosing on {self_judged_blocks(prunes)} "
           f"blocks of self text the calibration did not read ({BEFORE_OBS})" if any(auto_before_obs(r) for r in prunes)
           else "`--normalize auto`")
        + (f", `--anchor 1 {earlier_refit_flags()}` (the defaults then)"
           if any(refit_settings(r) == EARLIER_REFIT for r in prunes) else ", `--anchor 1`")
        + ", the first layer protected) calibrated on "
        f"more or fewer blocks of `{cal}` (half each; {', '.join(map(str, sizes))} blocks of 128 tokens; the CLI "
        "reads 64 unless `--max-samples`), and on other samples of the same size (seed: which pydoc blocks and "
        "which self text; every other table uses seed 0, and a larger calibration adds blocks to the same ones). "
        "Perplexity ratio to the unpruned model on the evaluation sets of the tables above; the in-domain set "
        "starts after each run's calibration and held-out blocks (so it differs a little between runs) and is "
        "left out for other seeds, whose pydoc blocks it could hold. Seconds: scoring, then pruning and "
        "refitting (both normalizations) with the evaluation.",
        "",
        "| calibration blocks | seed | removed | " + " | ".join(head) + " | seconds |",
        "| ---: | ---: | --- | " + " | ".join("---:" for _ in names) + " | ---: |",
    ]
    for doc in docs:
        scores = doc["calibration"][cal]["score_seconds"]
        scores = scores.get("gradient") if isinstance(scores, dict) else scores
        blocks, seed = key(doc)
        for r in doc["rows"]:
            if r["kind"] != "prune":
                continue
            chosen = chosen_allocation(r)
            cells = [f"{r['eval'][n]['ratio']:.2f}x" if n in r["eval"] else "-" for n in names]
            lines.append(f"| {blocks} | {seed} | {r['fraction']:.0%} ({r['heads_removed']}), chose {chosen} | "
                         + " | ".join(cells) + f" | {scores:.0f} + {r['seconds']:.0f} |")
    lines += [""] + ([BEFORE_OBS_NOTE] if any(auto_before_obs(r) for r in prunes) else []) + ["Commands:"] + [f"`{doc['command']}`" for doc in docs]
    return "\n".join(lines)


def served_section(doc: dict) -> str:
    from bench_cross_domain import render

    return "\n".join([
        "### Calibrating on the served text: SmolLM2-135M, heads removed, no training",
        "",
        "As the out-of-domain table, each calibration a mixture of `builtin:pydoc+self` with one evaluation "
        "set's own text (the blocks after those it is evaluated on; a third of the calibration blocks): that "
        "cell is in-domain for the row (marked), the other set still unseen. What a user who knows the text "
        "the model will serve gains by mixing it in (`--data served.txt+builtin:pydoc+self`).",
        "",
        render(doc),
    ])


def general_prose_section(doc: dict) -> str:
    from bench_cross_domain import render

    return "\n".join([
        "### General prose in the calibration: SmolLM2-135M, no training",
        "",
        "As the out-of-domain table, calibrated on `builtin:pydoc+self` (what `--data auto` reads) and on it "
        "mixed with encyclopedic prose (`wiki+builtin:pydoc+self`: a third of the calibration blocks from the "
        "Wikipedia set's own text, after the blocks it is evaluated on; that cell is in-domain, marked). News and "
        "legal text stay unseen by both: what general prose in the calibration buys on text no step saw.",
        "",
        render(doc),
    ])


def _seed_span(seeds: list[int]) -> str:
    """`0-5` for consecutive seeds, else `0, 2, 7`."""
    if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def allocation_section(doc: dict) -> str:
    from bench_allocation import render

    st = doc["settings"]
    return "\n".join([
        "### How many heads each layer loses, per calibration sample (`--normalize`): SmolLM2-135M, samples "
        f"{_seed_span(st['seeds'])}, no training",
        "",
        "Each `--normalize` mode pruned alone at prune's defaults on "
        f"{st['cal']} blocks of `{st['calibration']}` (calibration sample = `--seed`): the judge's loss (the "
        "64 blocks of self text the calibration did not read, on which a list of modes keeps the lowest) and "
        "the out-of-domain ratios as above. `auto` (`layer,none`: the default with `--compensate` when these "
        "ran; it is `obs` now, the next table) keeps the row marked so; "
        "`layer,geometric,none`, the bold one. The geometric means compare what each keeps over the samples. "
        "The judge's loss of every other mode carries its paired difference from the one `auto` kept (the same "
        "64 blocks, block by block) and that difference's standard error. The second table judges the same "
        "prunes as `--allocation-margin` 1 and 2 would: the first mode of the list is kept unless a later "
        "one's loss is lower than the one kept so far by more than 1 or 2 standard errors.",
        "",
        render(doc),
        "",
        f"`{doc['command']}`",
    ])


def obs_allocation_section(doc: dict) -> str:
    from bench_cross_domain import EARLIER_REFIT, earlier_refit_flags
    from bench_obs_allocation import baselines, compared_power, damping_flag, obs_rows, render, render_power

    from sample_runs import default_power

    from headtool.surgery.prune_defaults import DEFAULT_PRUNE_DAMPING

    st = doc["settings"]
    damping = damping_flag(doc)
    earlier = f"{EARLIER_REFIT['damping']:g}"
    if st.get("anchor_power"):
        return "\n".join([
            "### A freer refit where a layer lost more heads ("
            + f"`--anchor-power {st['anchor_power']:g}`{damping}".replace("` `", " ") + "): SmolLM2-135M, "
            f"samples {_seed_span(st['seeds'])}, no training",
            "",
            f"The prunes of the table above (`--normalize obs`, 64 blocks of `{st['calibration']}`, the same "
            f"calibration samples, judge and evaluation blocks) with each pruned layer's anchor times (kept heads / "
            f"heads)^{st['anchor_power']:g}: a layer that keeps 3 of its 9 heads is refit at a ninth of the anchor "
            "when the power is 2; the counts per layer and the heads inside each layer are still chosen at the "
            "anchor itself (costed at the freer anchors, the split piled the heads into fewer layers and lost on "
            "seeds 0-1)"
            + (f". Here the ridge toward zero under the anchor is{damping} ({earlier} in the rows compared "
               f"with and in the tables above): at the freer anchors {earlier} pulled toward zero about as hard as "
               f"the anchor pulls toward the weights. Beside every sample, the same power at `--damping {earlier}`"
               if damping else ". Beside every sample, the row without the power")
            + "; the judge loss carries its paired "
            "difference from that row's. Seconds: the whole prune, each from its own run (not compared).",
            "",
            render_power(doc, obs_rows(RESULTS, compared_power(doc))),
            "",
            f"`{doc['command']}`",
        ])
    return "\n".join([
        "### Heads per layer from what the refit cannot repair (`--normalize obs`): SmolLM2-135M, samples "
        f"{_seed_span(st['seeds'])}, no training",
        "",
        f"prune at its defaults on {st['cal']} blocks of `{st['calibration']}` (calibration sample = `--seed`) "
        f"with `--normalize obs` and one anchor for every layer (`{earlier_refit_flags()}`, the defaults "
        f"when these ran; `--anchor-power {default_power(st['cal']):g} --damping "
        f"{DEFAULT_PRUNE_DAMPING:g}` now on {st['cal']} blocks, the tables below): each layer's count from the "
        "error the anchored refit leaves after removing the heads it would choose, weighted by the layer's loss sensitivity E||dL/dy||² at its attention output "
        "(one forward and backward pass over the calibration), split over the layers exactly. Beside every "
        "sample, what `auto` kept when these ran (`layer,none`; from these runs the default is `obs`) and "
        "`--normalize layer,geometric,none --allocation-margin 1` kept in the table "
        "above (the same calibration and evaluation blocks). obs's judge loss carries its paired difference "
        "from that `auto`'s pick on the same 64 blocks of self text, ± one standard error. Seconds: the whole "
        "prune (statistics, refit, no evaluation), with the statistics in brackets.",
        "",
        render(doc, baselines(RESULTS)),
        "",
        f"`{doc['command']}`",
    ])


def obs_blocks_sections(docs: list[dict]) -> str:
    """One calibration-size table per refit setting and evaluation (what `blocks_rows` compares): the largest
    run's, which sets every smaller run beside it (the smaller obs_blocks runs add their commands)."""
    from bench_obs_allocation import COMPARED_EVAL

    groups: dict[tuple, list[dict]] = {}
    for doc in docs:
        st = doc["settings"]
        groups.setdefault((st["anchor_power"], st.get("damping"), st.get("eval", COMPARED_EVAL)), []).append(doc)
    parts = []
    for runs in groups.values():
        runs.sort(key=lambda doc: doc["settings"]["cal"], reverse=True)
        parts.append(obs_blocks_section(runs[0], runs[1:]))
    return "\n\n".join(parts)


def obs_blocks_section(doc: dict, smaller_runs: Sequence[dict] = ()) -> str:
    from bench_obs_allocation import blocks_rows, render_blocks
    from headtool.workflows.requests import CALIBRATION_BLOCKS, PRUNE_CALIBRATION_BLOCKS

    st = doc["settings"]
    smaller = blocks_rows(doc, RESULTS)
    sizes = " and ".join(map(str, smaller))
    default = (f"From this run `prune --compensate` reads {st['cal']} blocks unless `--max-samples` says otherwise "
               f"({CALIBRATION_BLOCKS} without `--compensate`)." if st["cal"] == PRUNE_CALIBRATION_BLOCKS else
               f"`prune --compensate` reads {PRUNE_CALIBRATION_BLOCKS} blocks by default (`--max-samples "
               f"{st['cal']}` gives this run's).")
    return "\n".join([
        f"### More calibration text for the refit (`--max-samples {st['cal']}`): SmolLM2-135M, samples "
        f"{_seed_span(st['seeds'])}, no training",
        "",
        f"The prunes of the table above (`--normalize obs`, `--anchor-power {st['anchor_power']:g} --damping "
        f"{st['damping']:g}`, the first layer protected, the same evaluation blocks) calibrated on {st['cal']} "
        f"blocks of `{st['calibration']}` instead of {sizes} (half each; a smaller calibration is the first "
        "blocks of the same sample: a larger one adds blocks to it), set beside those runs sample by sample. "
        "Scores, the allocation's statistics and the refit all read the larger calibration. " + default
        + " Seconds: the whole prune (statistics, refit, no evaluation), each from its own run (not compared).",
        "",
        render_blocks(doc, smaller),
        "",
        f"`{doc['command']}`",
        *(line for run in smaller_runs
          for line in ("", f"The {run['settings']['cal']}-block rows: `{run['command']}`")),
    ])


def obs_eval_section(doc: dict) -> str:
    from bench_obs_allocation import COMPARED_EVAL, fewer_eval_rows, render_eval

    st = doc["settings"]
    tokens = st["eval"] * 128
    return "\n".join([
        f"### The same prunes judged on more text ({st['eval']} evaluation blocks a set): SmolLM2-135M, samples "
        f"{_seed_span(st['seeds'])}, {st['cal']} calibration blocks, no training",
        "",
        f"Every out-of-domain ratio above is measured on {COMPARED_EVAL} blocks of 128 tokens a set (2,048 tokens): "
        "paired, the same blocks for every prune, so differences between prunes are measured more tightly than "
        "each ratio itself. Here the prunes of the calibration-size table (prune's defaults: `--normalize obs "
        f"--anchor-power {st['anchor_power']:g} --damping {st['damping']:g}`, {st['cal']} blocks of "
        f"`{st['calibration']}`) are judged on {st['eval']} blocks a set ({tokens:,} tokens; the first "
        f"{COMPARED_EVAL} of them are the blocks above, each set's own seeded order), each beside its "
        f"{COMPARED_EVAL}-block ratio. ± is one standard error of the ratio over the evaluation blocks (the "
        "paired difference of the two models' mean losses, blocks the sampling unit): how far another draw of "
        "as many blocks of the same text could move it. The issue's levels are read from the larger evaluation.",
        "",
        render_eval(doc, fewer_eval_rows(doc, RESULTS)),
        "",
        f"`{doc['command']}`",
    ])


def kv_groups_section(doc: dict) -> str:
    from bench_cross_domain import earlier_refit_flags
    from bench_kv_groups import render

    st = doc["settings"]
    return "\n".join([
        "### Heads removed in whole GQA steps or one at a time (`--unit query` or `head`): SmolLM2-135M, no training"
        + ("" if st.get("eval", 16) == 16 else f", {st['cal']} calibration blocks, {st['eval']} evaluation blocks a set"),
        "",
        "On a grouped-query layer `prune --unit query` (the default until 2026-12-07; `auto` since, which is `head` "
        "for a compensated prune over all layers, from these measurements) removes one query head from every KV "
        "group at a time (the groups stay "
        "equal in size), so SmolLM2-135M (9 query heads in 3 groups) loses 0, 3 or 6 heads a layer. What that "
        "costs, measured by pruning the model expanded exactly to multi-head attention (each query head its own "
        "copy of its group's K/V head; the same perplexities), where any single head can go: prune's defaults "
        f"on {st['cal']} blocks of `{st['calibration']}` (calibration sample = `--seed`"
        + ("; `--normalize auto` as it was when this ran: `layer,none` judged on self text"
           if any(r.get("allocation") in ("layer", "none") for r in doc["rows"]) else "")
        + (f"; one anchor for every layer, `{earlier_refit_flags()}`, the defaults then"
           if "anchor_power" not in st else f"; `--anchor-power {st['anchor_power']:g} --damping {st['damping']:g}`")
        + "), the same number of heads, "
        + ("out-of-domain ratios as above" if st.get("eval", 16) == 16 else
           f"out-of-domain ratios judged on {st['eval']} evaluation blocks a set") + ". "
        "`prune --unit head` removes single heads without the expansion: it keeps the 3 K/V heads, with groups "
        "of different sizes, and makes the same choices to the same function (tests/test_bench_kv_groups.py), so "
        "the any-single-head rows are what it gives.",
        "",
        render(doc),
        "",
        f"`{doc['command']}`",
    ])


def quality_section(doc: dict) -> str:
    from bench_quality import render

    cal, held, ev = doc["data"]["calibration"], doc["data"]["heldout"], doc["data"]["eval"]
    at25 = [r for r in doc["prune"] if r["fraction"] == 0.25]
    best = min(at25, key=lambda r: r["perplexity"]) if at25 else None
    lines = [
        "### In-domain quality (flatters): SmolLM2-135M, heads removed or merged, no training",
        "",
        f"Perplexity on {ev['samples']} blocks of {ev['seq_len']} tokens of `{ev['source']}` that neither "
        f"scoring nor calibration saw (calibration: {cal['samples']} blocks, refit checks: "
        f"{held['samples']} more). With `--compensate` the scores decide how many heads each layer "
        "loses and the refit error decides which (`--choose-in-layer auto`); the output projections "
        "are then refit layer after layer. Bold: the best at each fraction.",
        "",
        render(doc),
        "",
    ]
    if best is not None:
        verdict = "within" if best["ratio"] <= 1.3 else "outside"
        text = (f"Best at 25% of query heads removed: {best['method']} scores "
                f"{'with' if best['compensate'] else 'without'} compensation, {best['perplexity']:.2f} = "
                f"{best['ratio']:.2f}x the unpruned model ({verdict} the 1.3x target). The refit is fit on "
                "text of the same kind as the evaluation (Python documentation), which flatters it")
        beaten = [r for r in doc["prune"] if r["ratio"] < 1.0]
        if beaten:
            text += (f": at {min(r['fraction'] for r in beaten):.0%} it even beats the unpruned model, so "
                     "read figures near 1.0x as no measurable loss on this kind of text, not as a gain")
        merges = doc.get("convert", [])
        if merges and min(r["ratio"] for r in merges) > 1.3:
            best_merge = min(merges, key=lambda r: r["ratio"])
            text += (f". Merging 3 → 1 KV heads stays at {best_merge['ratio']:.2f}x even with the best merge "
                     f"({best_merge['method']}): that is where training is needed (Healing, below)")
        lines += [text + ".", ""]
    secs = doc.get("scores_seconds", {})
    if secs:
        lines += ["Scoring time on the calibration set: " +
                  ", ".join(f"{m} {s:.0f} s" for m, s in secs.items() if s) + ".", ""]
    lines += [f"`{doc['command']}`"]
    return "\n".join(lines)


def heal_section(doc: dict) -> str:
    rows = doc["rows"]
    teacher = rows[0]["teacher_perplexity"] if rows else float("nan")
    steps = sorted({r["steps"] for r in rows})
    lines = [
        f"### Healing: distillation from the original, CPU-sized ({'/'.join(map(str, steps))} steps)",
        "",
        f"`headtool heal STUDENT --teacher {doc['teacher']} --data builtin:pydoc --train attention`, "
        f"batches of {doc['batch_size']} × {doc['seq_len']} tokens; perplexity on {doc['eval_samples']} "
        f"held-out blocks that neither the student's calibration nor the heal trained on (teacher: "
        f"{teacher:.2f}). Gap closed: the share of the student's log-perplexity excess over the "
        "teacher that the heal removed.",
        "",
        "| student (made by) | before | after | factor | gap closed | steps | tokens | minutes | peak RSS |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        made = r["made_by"].split(" -m headtool ", 1)[-1].split(" -o ")[0]
        made = made.replace(f" {doc['teacher']} ", " ", 1)
        gap = r.get("gap_closed")
        if gap is None:
            gap = (math.log(r["before_perplexity"]) - math.log(r["after_perplexity"])) / \
                (math.log(r["before_perplexity"]) - math.log(r["teacher_perplexity"]))
        lines.append(f"| {r['student']} (`{made}`) | {_num(r['before_perplexity'])} | "
                     f"{_num(r['after_perplexity'])} | {r['factor']:.1f}x | {100 * gap:.0f}% | {r['steps']} | "
                     f"{r['tokens']:,} | {r['minutes']:.1f} | {r['memory']['peak_rss_bytes'] / 2**30:.1f} GiB |")
    lines += ["", "Reloaded from disk, the healed checkpoints give the same perplexity "
              f"(largest difference {max(abs(r['after_perplexity_reloaded'] - r['after_perplexity']) for r in rows):.1e})."
              if rows else "", "", f"`{doc.get('command', 'python benchmarks/bench_heal.py')}`"]
    return "\n".join(lines)


def streaming_section(doc: dict) -> str:
    gb = doc["checkpoint_bytes"] / 1e9
    p, c = doc["prune"], doc["convert_mean"]
    durable = doc.get("durable_copy_s")
    lines = [
        "### Streaming surgery: a checkpoint larger than it needs to be in memory",
        "",
        f"A synthetic Llama-shaped checkpoint of {gb:.2f} GB ({doc['layers']} layers, bf16, shards of "
        f"≤ {doc['largest_shard_bytes'] / 1e9:.2f} GB) written tensor by tensor; each command in a fresh "
        "process, peak RSS from the kernel, dirty pages flushed before every timed run. A plain copy of "
        f"the shards takes {doc['copy_s']:.1f} s" + (f", with fsync {durable:.1f} s" if durable else "") +
        " (headtool fsyncs its output).",
        "",
        "| operation | seconds | vs plain copy | peak RSS | of the checkpoint |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, label, r in (("prune", "`prune --streaming` (a query head of every KV group, every layer)", p),
                           ("convert", "`convert-gqa --streaming --merge mean` (8 → 2 KV heads)", c)):
        lines.append(f"| {label} | {r['seconds']:.1f} | {r['time_vs_copy']:.2f}x | "
                     f"{r['peak_rss_mib']:.0f} MiB | {100 * r['rss_fraction_of_checkpoint']:.1f}% |")
    lines += ["", "About 3 s of each run is Python, torch and transformers start-up, which does not grow "
              "with the model; the peak memory is the interpreter plus a few of the largest tensors, "
              "whatever the checkpoint's size.", "", f"`{doc['command']}`"]
    return "\n".join(lines)


def scoring_section(doc: dict) -> str:
    lines = [
        "### Scoring speed and memory",
        "",
        f"SmolLM2-135M, {doc['heads']} heads, {doc['tokens']} tokens, {doc['torch_threads']} threads "
        f"(1-minute load average {doc['load_average_1min']:.1f} when it ran):",
        "",
        "| measurement | headtool | reference | ratio |",
        "| --- | ---: | ---: | ---: |",
        f"| gradient scoring vs forward + backward with parameter gradients | {doc['gradient_scoring_s']:.2f} s | "
        f"{doc['fwd_bwd_param_grads_s']:.2f} s | {doc['gradient_ratio']:.2f}x |",
        f"| its peak memory increase | {doc['memory_gradient_scoring']['peak_increase_mib']:.0f} MiB | "
        f"{doc['memory_fwd_bwd']['peak_increase_mib']:.0f} MiB | {doc['memory_ratio_peak_increase']:.2f}x |",
        f"| exact ablation of all heads vs one forward per head (measured on {doc['naive_heads_measured']}, "
        f"extrapolated) | {doc['ablation_s']:.1f} s | {doc['naive_one_forward_per_head_s']:.1f} s | "
        f"{doc['ablation_ratio']:.2f}x |",
    ]
    if "ablation_ratio_vs_forward_estimate" in doc:
        lines.append(f"| exact ablation vs (heads + 1) × one timed forward | {doc['ablation_s']:.1f} s | "
                     f"{doc['naive_from_forward_s']:.1f} s | {doc['ablation_ratio_vs_forward_estimate']:.2f}x |")
    lines += ["", f"Ablation and the naive loop agree to {doc['ablation_vs_naive_max_abs_diff']:.0e}. "
              f"Memory: {doc['memory_measure']}.", "", f"`{doc.get('command', 'python benchmarks/bench_scoring.py')}`"]
    return "\n".join(lines)


def speed_section(doc: dict) -> str:
    s = doc["settings"]
    lines = [
        "### Inference after merging K/V heads",
        "",
        f"Batch {s['batch']}, {s['context']}-token context, {s['new_tokens']} new tokens, {s['threads']} "
        f"thread(s), {s['device']}, {s['order']}:",
        "",
        "| model | KV heads | KV cache | prefill tokens/s | decode tokens/s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["results"]:
        q = r["ratio"]
        lines.append(f"| {r['label']} | {r['total_kv_heads']} | {r['kv_cache_bytes'] / 2**20:.1f} MiB "
                     f"({q['kv_cache_bytes']:.3f}x) | {r['prefill_tokens_per_s']:.1f} ({q['prefill_tokens_per_s']:.2f}x) | "
                     f"{r['decode_tokens_per_s']:.2f} ({q['decode_tokens_per_s']:.2f}x) |")
    lines += ["", f"`{doc['benchmark']['command']}`" if "benchmark" in doc else ""]
    return "\n".join(lines)


def _heal_options_compared(rows: list[dict]) -> str:
    """The options the rows vary, as flags (`--lr 0.001; --hidden-weight 1 --hidden-layers all`):
    tables of different option sets then carry different titles."""
    def flag(key: str, value) -> str:
        return f"--{key.replace('_', '-')} {f'{value:g}' if isinstance(value, float) else value}"

    return "; ".join(" ".join(flag(k, v) for k, v in r["heal_options"].items())
                     for r in rows if r.get("heal_options"))


def heal_cross_domain_section(doc: dict) -> str:
    from fractions import Fraction

    from bench_heal_cross_domain import render

    mla = doc["student"].get("kind") == "mla"
    student = (f"latent attention (convert-mla) at {Fraction(doc['student']['kv_cache']).limit_denominator(16)} "
               "of the KV cache" if mla else "3 → 1 KV heads")
    served = any(r.get("healed_on") for r in doc["rows"])  # heal data with an evaluation set's own text
    variants = any(r.get("heal_options") for r in doc["rows"])  # bench_heal_cross_domain --variants
    return "\n".join([
        f"### Healing{' with the served text mixed in' if served else ', out of domain'}: SmolLM2-135M {student} "
        "healed on " + " or on ".join(f"`{h}`" for h in dict.fromkeys(r["heal_data"] for r in doc["rows"]))
        + (f": heal options compared ({_heal_options_compared(doc['rows'])})" if variants else ""),
        "",
        ("The student is the uniform-rank convert-mla row of the latent-attention table below, with the "
         if mla else "The same student, with the ") +
        "evaluation sets of the out-of-domain table above; each heal trains the attention "
        "projections against the original model. Perplexity after the heal (the share of the student's "
        "log-perplexity excess over the teacher that it closed)."
        + (" The last column is the heal's own held-out blocks of its data (the heal's in-domain text; "
           "the pydoc column is in-domain for the student's calibration, and out of domain for a heal on "
           "`self` alone)." if any("heal_heldout" in r for r in doc["rows"]) else "")
        + (" Heal data that names an evaluation set trains on that set's own text after the blocks it is "
           "evaluated on (marked: in-domain for that heal); the student's calibration names it likewise "
           "where its line says so." if served else "")
        + (f" Rows differ only in the heal options in parentheses (the defaults otherwise), "
           f"{doc['settings']['max_steps']} steps each." if variants else ""),
        "",
        render(doc),
    ])


def mla_section(doc: dict) -> str:
    from bench_mla import render

    s = doc["settings"]
    return "\n".join([
        "### Latent attention (convert-mla) against merged K/V heads at the same cache: SmolLM2-135M, no training",
        "",
        f"Calibration: {s['cal']} blocks of {s['seq_len']} tokens of `{s['calibration']}` ({s['held']} more held out "
        "for the refit checks); evaluation sets as in the out-of-domain table. Perplexity (ratio to the original), "
        f"KV-cache bytes per token as the model computes them, decode tokens/s after a {s['context']}-token prompt "
        "(all rows timed interleaved, median).",
        "",
        render(doc),
    ])


def mla_context_section(doc: dict) -> str:
    from bench_mla import render

    s = doc["settings"]
    return "\n".join([
        f"### Latent attention at a longer context: decode after {s['context']:,} prompt tokens (SmolLM2-135M, CPU)",
        "",
        f"Rows of the latent-attention table above ({', '.join(b for b, _ in s['budgets'])} of the cache, uniform "
        "ranks, the same calibration, so the same quality columns), timed after a longer prompt: "
        f"{s['context']:,} tokens, then {s['new_tokens']} decode steps, batch 1, {s['threads']} threads, "
        f"{s['repeats']} interleaved rounds (median). The original reads (and its dynamic cache copies) every "
        "cached key and value each step, so what the smaller cache saves grows with the context.",
        "",
        render(doc),
    ])


def mla_rope_section(doc: dict) -> str:
    from bench_mla import render

    s = doc["settings"]
    return "\n".join([
        "### Latent attention: the rotary key's share of the cache (convert-mla --rope-dim at "
        f"--kv-cache {', '.join(sorted({b for b, _ in s['budgets']}))})",
        "",
        f"As the table above (calibration: {s['cal']} blocks of `{s['calibration']}`, uniform ranks, the refit on), "
        "one row per `--rope-dim` at the same cache bytes: the rest of the budget is the latent. From these runs "
        "the default `--rope-dim` of `--kv-cache` is 3/8 of the per-layer budget.",
        "",
        render(doc),
    ])


def mla_calibration_section(doc: dict) -> str:
    from bench_mla import render

    s = doc["settings"]
    budgets = ", ".join(sorted({b for b, _ in s["budgets"]}))
    calibrations = s.get("calibrations") or [s["calibration"]]
    if len(calibrations) > 1:
        what = (f"The rows of the latent-attention table at {budgets} of the cache, each calibrated on {s['cal']} "
                f"blocks of one source ({s['held']} more held out): a row calibrated on an evaluation set's own "
                "text (the blocks after those it is evaluated on) is domain-matched, and that cell is in-domain for "
                "it (marked). They bound what better calibration text can do: the conversion is only as good as "
                "the calibration is close to the text it is used on.")
    elif any(row.get("calibrated_on") for row in doc["rows"]):
        sets = sorted({n for row in doc["rows"] for n in row.get("calibrated_on", [])})
        what = (f"The conversions at {budgets} of the cache calibrated on {s['cal']} blocks of `{calibrations[0]}` "
                f"({s['held']} more held out), which holds the {' and '.join(sets)} set's own text (the blocks after "
                "those it is evaluated on; that cell is in-domain, marked): the other sets are text no step saw. "
                "Compare the `builtin:pydoc+self` rows of the table above, calibrated the same way without it.")
    else:
        what = (f"The same conversions at {budgets} of the cache calibrated on more blocks of one source: "
                f"{s['cal']} blocks of `{calibrations[0]}` ({s['held']} more held out); compare its rows in the "
                "tables above, calibrated on fewer.")
    return "\n".join([
        "### Latent attention and the `fit` merge by calibration text: what calibration alone reaches "
        "(SmolLM2-135M, no training)",
        "",
        what,
        "",
        render(doc),
    ])


def anchor_power_section(doc: dict) -> str:
    from bench_anchor_power import render
    from sample_runs import default_power

    st = doc["settings"]
    unit = {"head": "single heads (`--unit head`, what `--unit auto` takes on this model)",
            "query": "one query head from every KV group a step (`--unit query`)"}[st["unit"]]
    then, now = st["default_anchor_power"], default_power(st["cal"])
    default = (f"P = 3 was chosen with query steps on 64 calibration blocks (`A freer refit where a layer lost "
               f"more heads`); prune's default on {st['cal']} blocks of 128 tokens is "
               + (f"P = {now:g}" if then == now else f"P = {now:g} since these ran (P = {then:g} then)"))
    return "\n".join([
        f"### How strongly the refit holds on to the weights (`--anchor-power`), removing {unit.split(' (')[0]}: "
        f"SmolLM2-135M, no training, {st['cal']} calibration blocks, {st['eval']} evaluation blocks a set",
        "",
        f"`prune --compensate` refits a layer that keeps k of h heads at `--anchor` x (k/h)^P; {default}. Here "
        f"{unit} on {st['cal']} blocks of `{st['calibration']}` (calibration sample = `--seed`), prune's defaults "
        f"(`--damping {st['damping']:g}`, `--normalize auto`) but for `--anchor-power`; the powers of a sample "
        "share its scores and evaluation blocks (paired). Ratio to the unpruned model ± one standard error over "
        "the evaluation blocks; the last column counts the (sample, set) cells in which a power beat the first.",
        "",
        render(doc),
        "",
        "  \n".join(f"`{c}`" for c in doc.get("commands", [doc["command"]])),  # a line break between runs
    ])


def convert_anchor_section(doc: dict) -> str:
    from bench_convert_anchor import KINDS, render

    st = doc["settings"]
    kinds = [k for k in KINDS if any(r["kind"] == k for r in doc["rows"])]
    return "\n".join([
        f"### How freely the conversions' refit may move (`--anchor`): SmolLM2-135M, no training, {st['cal']} "
        f"calibration blocks, {st['eval']} evaluation blocks a set",
        "",
        "After the conversion both commands refit every layer's output projection as ridge toward its weights "
        "without a refit, at `--anchor` times the Gram's mean diagonal, each layer's refit kept only where it "
        "lowers the held-out error. Here " + " and ".join(f"`{KINDS[k]}`" for k in kinds)
        + f" on {st['cal']} blocks of `{st['calibration']}` (calibration sample = `--seed`), the command's "
        "defaults but for `--anchor`; the anchors of a sample share its calibration and evaluation blocks "
        "(paired). Ratio to the original ± one standard error over the evaluation blocks; the last column "
        f"counts the (sample, set) cells in which an anchor beat the first ({st['default_anchor']:g}, the default "
        "of both commands).",
        "",
        render(doc),
        "",
        "  \n".join(f"`{c}`" for c in doc.get("commands", [doc["command"]])),
    ])


SECTIONS = [("cross_domain.json", cross_domain_section), ("cross_domain_normalize*.json", normalize_section),
            ("cross_domain_protect_*.json", protect_section),
            ("cross_domain_blocks_*.json", calibration_size_section, "one table"),
            ("cross_domain_served*.json", served_section), ("cross_domain_wiki*.json", general_prose_section),
            ("allocation*.json", allocation_section), ("obs_allocation*.json", obs_allocation_section),
            ("obs_blocks_*.json", obs_blocks_sections, "all"), ("obs_eval_*.json", obs_eval_section),
            ("kv_groups*.json", kv_groups_section), ("anchor_power_*.json", anchor_power_section),
            ("heal_cross_domain*.json", heal_cross_domain_section),
            ("mla.json", mla_section), ("mla_context*.json", mla_context_section),
            ("mla_calibration*.json", mla_calibration_section),
            ("mla_rope_sweep*.json", mla_rope_section), ("convert_anchor_*.json", convert_anchor_section),
            ("quality.json", quality_section), ("heal.json", heal_section), ("heal-*.json", heal_section),
            ("streaming.json", streaming_section), ("scoring.json", scoring_section), ("speed.json", speed_section)]


def render_all() -> str:
    parts = ["<!-- generated by benchmarks/render_results.py from benchmarks/results/*.json: edit those, "
             "not this -->"]
    for pattern, fn, *how in SECTIONS:
        docs = [json.loads(path.read_text()) for path in sorted(RESULTS.glob(pattern))]
        if how:  # one table from all the runs
            if docs:
                parts.append(fn(docs))
            continue
        # several runs of one benchmark (heal.json, heal-long.json): shortest budget first
        docs.sort(key=lambda doc: max((row.get("steps", 0) for row in doc.get("rows", [])), default=0))
        parts.extend(fn(doc) for doc in docs)
    return "\n\n".join(parts)


def updated_readme(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{render_all()}\n{END}{tail}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check that README.md is up to date")
    args = ap.parse_args()
    text = README.read_text()
    new = updated_readme(text)
    if args.check:
        if new != text:
            raise SystemExit("README.md's Results are out of date: run python benchmarks/render_results.py")
        return
    README.write_text(new)


if __name__ == "__main__":
    main()
