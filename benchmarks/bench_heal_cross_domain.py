"""Does healing close the gap on text nobody trained on? SmolLM2-135M students healed on pydoc or on a
pydoc + self-generated mixture, evaluated on the cross-domain benchmark's domains (issue 18).

Student (--student): `gqa`, 3 -> 1 KV heads with `fit` (+ anchored refit), calibrated on --cal blocks of
--calibration (what `bench_cross_domain.py` measures as its row); or `mla`, convert-mla at --kv-cache of
the cache with --rope-dim rotary dims (uniform ranks, refit on; a row of `bench_mla.py`), written to
results/heal_cross_domain_mla.json. Each heal (`heal_loaded`, what `headtool heal`
and a recipe's heal step run: --train attention, --max-steps, batches of --batch-size x --seq-len)
starts from the same student and trains on --heal-data; its own held-out blocks are the first
--eval-samples blocks after --heal-skip (training skips them). --heal-skip is set so that the
pydoc part of the heal data never reaches the in-domain evaluation blocks (pydoc blocks
cal + held .. cal + held + eval - 1 of its seeded order: the heal's pydoc share starts after them).

Evaluation: news (Lee corpus), legal (builtin:licenses), wiki (Wikipedia articles), in-domain
pydoc, exactly the sets of bench_cross_domain.py (same --eval and --cal + --held), and the heal's
own held-out blocks (the heal data's domain: what "in-domain" means for a heal on `self` alone,
where pydoc is out of domain too).
Gap closed per domain: the share of the student's log-perplexity excess over the teacher that the
heal removed.

    HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_heal_cross_domain.py

Writes benchmarks/results/heal_cross_domain.json after every heal and prints the table.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cross_domain import MODEL, calibration_spec, evaluation_sets, perplexities, served_source  # noqa: E402
from run_clock import RunClock  # noqa: E402

from headtool.data.batches import make_batches  # noqa: E402
from headtool.data.sources import DataSpec, parse_sources  # noqa: E402
from headtool.model.loading import load_model, model_from_object  # noqa: E402
from headtool.train.options import HealOptions  # noqa: E402
from headtool.workflows.convert_gqa import convert_loaded  # noqa: E402
from headtool.workflows.convert_mla import convert_mla_loaded  # noqa: E402
from headtool.workflows.heal import heal_loaded  # noqa: E402
from headtool.workflows.requests import ConvertRequest, HealRequest, LatentRequest  # noqa: E402

HERE = Path(__file__).resolve().parent


def gap_closed(before: float, after: float, teacher: float) -> float:
    """Share of log(before / teacher) that the heal removed (1: back to the teacher)."""
    return (math.log(before) - math.log(after)) / max(math.log(before) - math.log(teacher), 1e-12)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default="builtin:pydoc+self", help="the student's calibration --data")
    ap.add_argument("--heal-data", default="builtin:pydoc,builtin:pydoc+self:640",
                    help="comma list of heal --data sources, one heal each")
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--cal", type=int, default=32)
    ap.add_argument("--held", type=int, default=8)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--eval-samples", type=int, default=16, help="the heal's own held-out blocks")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--student", choices=("gqa", "mla"), default="gqa",
                    help="gqa: --kv-heads 1 --merge fit; mla: convert-mla --kv-cache --rope-dim")
    ap.add_argument("--kv-cache", type=float, default=1 / 3, help="--student mla: the cache budget")
    ap.add_argument("--rope-dim", type=int, default=64, help="--student mla: rotary dims of the shared key")
    ap.add_argument("--variants", default="",
                    help="heal option overrides, one heal each per --heal-data source: ';' between variants, "
                         "',' between options of one, as HealOptions fields (lr=1e-3,hidden_weight=1,"
                         "hidden_layers=all); an empty variant is the defaults [default: the defaults only]")
    ap.add_argument("--out", default=None, help="[default: results/heal_cross_domain.json, "
                                                "heal_cross_domain_mla.json for --student mla]")
    a = ap.parse_args()
    variants = [parse_variant(v) for v in a.variants.split(";")] if a.variants else [{}]
    command = shlex.join(["python", "benchmarks/bench_heal_cross_domain.py", *sys.argv[1:]])
    clock = RunClock()
    log = clock.log


    lm = load_model(MODEL, dtype="float32", device="cpu")
    tok = lm.tokenizer
    used = a.cal + a.held
    domains, evals = evaluation_sets(tok, seq_len=a.seq_len, batch_size=a.batch_size, n_eval=a.eval, used=used,
                                     min_blocks=64, log=log)
    teacher, _ = perplexities(lm.model, evals)
    cal, calibrated_on = calibration_spec(a.calibration, domains, blocks=a.cal, evaluated=a.eval,
                                          seq_len=a.seq_len, batch_size=a.batch_size)
    t0 = time.perf_counter()
    if a.student == "mla":
        done = convert_mla_loaded(lm, LatentRequest(model=MODEL, kv_cache=a.kv_cache, rope_dim=a.rope_dim, data=cal,
                                                    heldout_samples=a.held), text_model=lm)
        student = done.conv.model
        ranks = done.summary["kv_rank"]
        spelled = str(ranks[0]) if len(set(ranks)) == 1 else f"{min(ranks)}..{max(ranks)}"
        made_by = (f"convert_mla_loaded: --kv-cache {a.kv_cache:.4g} --rope-dim {a.rope_dim} (kv_rank {spelled}) "
                   f"--data {a.calibration} --max-samples {a.cal} --heldout-samples {a.held} (refit and anchor: "
                   "the defaults)")
    else:
        conv = convert_loaded(lm, ConvertRequest(model=MODEL, kv_heads=1, merge="fit", data=cal,
                                                 heldout_samples=a.held), text_model=lm)
        student = conv.best.model
        made_by = (f"convert_loaded: --kv-heads 1 --merge fit --data {a.calibration} --max-samples {a.cal} "
                   f"--heldout-samples {a.held} (anchor: the default)")
    make_s = time.perf_counter() - t0
    before, _ = perplexities(student, evals)
    log("student: " + "  ".join(f"{n} {before[n]['perplexity']:.2f}" for n in evals))
    doc = {"model": MODEL, "command": command, "student": {
        "kind": a.student, "made_by": made_by, "seconds": round(make_s, 1), "calibrated_on": calibrated_on,
        **({"kv_cache": a.kv_cache, "rope_dim": a.rope_dim} if a.student == "mla" else {})},
        "domains": domains, "order": list(domains), "teacher": teacher, "before": before,
        "settings": {"max_steps": a.max_steps, "batch_size": a.batch_size, "seq_len": a.seq_len,
                     "train": "attention", "eval_samples": a.eval_samples}, "rows": []}
    out = Path(a.out or HERE / "results" / ("heal_cross_domain_mla.json" if a.student == "mla"
                                            else "heal_cross_domain.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    for source, overrides in [(s.strip(), v) for s in a.heal_data.split(",") if s.strip() for v in variants]:
        parts = parse_sources(source)
        # the heal's pydoc share starts after the in-domain evaluation blocks (its held-out first); an
        # evaluation set named in the heal data (its own text: served_source) skips at least as many, so
        # past the blocks it is evaluated on
        skip = (used + a.eval) * len(parts)
        text, healed_on = served_source(source, domains)
        data = DataSpec(source=text, seq_len=a.seq_len, batch_size=a.batch_size, seed=0, skip_samples=skip)
        req = HealRequest(student=MODEL, teacher=MODEL, output="", data=data, eval_samples=a.eval_samples,
                          opts=heal_options(a.max_steps, overrides))
        # the heal's own held-out blocks (heal_loaded holds out the first --eval-samples of --data)
        held = {"heal": make_batches(replace(data, max_samples=a.eval_samples), tok, "lm", model=lm).batches}
        held_teacher, _ = perplexities(lm.model, held)
        held_before, _ = perplexities(student, held)
        healed = model_from_object(copy.deepcopy(student), tok, ref=MODEL)
        t0 = time.perf_counter()
        res = heal_loaded(healed, lm, req)
        heal_s = time.perf_counter() - t0
        after, _ = perplexities(healed.model, evals)
        held_after, _ = perplexities(healed.model, held)
        info = res.to_json()
        row = {"heal_data": source, "heal_options": overrides, "healed_on": healed_on, "skip_samples": skip,
               "seconds": round(heal_s, 1), "steps": info.get("steps"), "tokens": info.get("tokens"),
               "best_step": info.get("best_step"), "after": after,
               "gap_closed": {n: gap_closed(before[n]["perplexity"], after[n]["perplexity"],
                                            teacher[n]["perplexity"]) for n in evals},
               "heal_heldout": {"blocks": a.eval_samples, "teacher": held_teacher["heal"],
                                "before": held_before["heal"], "after": held_after["heal"],
                                "gap_closed": gap_closed(held_before["heal"]["perplexity"],
                                                         held_after["heal"]["perplexity"],
                                                         held_teacher["heal"]["perplexity"])}}
        doc["rows"].append(row)
        out.write_text(json.dumps(doc, indent=2) + "\n")
        log(f"heal on {source}{variant_label(overrides)}: " + "  ".join(
            f"{n} {before[n]['perplexity']:.2f} -> {after[n]['perplexity']:.2f} "
            f"({100 * row['gap_closed'][n]:.0f}% closed)" for n in evals)
            + f"  its own held-out {held_before['heal']['perplexity']:.2f} -> {held_after['heal']['perplexity']:.2f} "
            f"(teacher {held_teacher['heal']['perplexity']:.2f}, {100 * row['heal_heldout']['gap_closed']:.0f}% "
            f"closed)  [{heal_s:.0f} s]")
    print(render(doc))


def parse_variant(text: str) -> dict:
    """'lr=1e-3,hidden_layers=all' -> HealOptions overrides, typed as the field's annotation."""
    fields = {f.name: f for f in dataclasses.fields(HealOptions)}
    out: dict = {}
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise SystemExit(f"--variants: {part!r} is not NAME=VALUE with NAME a HealOptions field")
        kind = str(fields[key].type)  # the annotation's text: "str", "int | None", "float", "bool"
        out[key] = (value if kind.startswith("str") else value.lower() in ("1", "true", "on") if kind == "bool"
                    else int(value) if kind.startswith("int") else float(value))
    return out


def heal_options(max_steps: int, overrides: dict) -> HealOptions:
    """The benchmark's heal (--train attention, --max-steps) with a variant's overrides on top (any field,
    train and max_steps included)."""
    opts = HealOptions(**{"train": "attention", "max_steps": max_steps, **overrides})
    opts.validate()
    return opts


def variant_label(overrides: dict) -> str:
    """' (lr 0.001, hidden_layers all)' or '' for the defaults."""
    return " (" + ", ".join(f"{k} {v}" for k, v in overrides.items()) + ")" if overrides else ""


def render(doc: dict) -> str:
    """Perplexity before -> after and the gap closed, per domain (in-domain last), then the heal data's own
    held-out blocks where the run measured them."""
    names = doc["order"]
    d = doc["domains"]
    own = any("heal_heldout" in r for r in doc["rows"])
    lines = ["| heal data | " + " | ".join(d[n].get("label", n) for n in names)
             + (" | the heal data's held-out blocks (teacher / student before)" if own else "") + " | seconds |",
             "| --- | " + " | ".join("---:" for _ in names) + (" | ---:" if own else "") + " | ---: |",
             "| teacher (unpruned) | " + " | ".join(f"{doc['teacher'][n]['perplexity']:.2f}" for n in names)
             + (" |" if own else "") + " | |",
             "| student, before healing | " + " | ".join(f"{doc['before'][n]['perplexity']:.2f}" for n in names)
             + (" |" if own else "") + " | |"]
    for r in doc["rows"]:
        h = r.get("heal_heldout")
        cell = (f" | {h['after']['perplexity']:.2f} ({100 * h['gap_closed']:.0f}% closed; "
                f"{h['teacher']['perplexity']:.2f} / {h['before']['perplexity']:.2f})" if h else " | -")
        lines.append(f"| `{r['heal_data']}`{variant_label(r.get('heal_options') or {})} | " + " | ".join(
            f"{r['after'][n]['perplexity']:.2f} ({100 * r['gap_closed'][n]:.0f}% closed"
            + ("; healed on it" if n in r.get("healed_on", ()) else "") + ")" for n in names)
            + (cell if own else "") + f" | {r['seconds']:.0f} |")
    varied = any(r.get("heal_options") for r in doc["rows"])
    lines += ["", f"Student: {doc['student']['made_by']}. Heal: `--train attention`, {doc['settings']['max_steps']} "
              f"steps{' (unless a row says otherwise)' if varied else ''} of {doc['settings']['batch_size']} x "
              f"{doc['settings']['seq_len']} tokens. Gap closed: the "
              "share of the student's log-perplexity excess over the teacher that the heal removed.",
              f"`{doc['command']}`"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
