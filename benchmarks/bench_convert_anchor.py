"""How freely the conversions' output-projection refit may move (`--anchor`), out of domain: `convert-mla
--kv-cache 1/3` and `convert-gqa --kv-heads 1 --merge fit` on SmolLM2-135M.

Both commands refit every layer's output projection after the conversion as ridge toward the weights without
a refit (`--anchor`, relative to the Gram's mean diagonal), each layer's refit kept only where it lowers the
error on held-out blocks. For every calibration sample (`--cal` blocks of builtin:pydoc+self, sample =
`--seed`), kind and anchor, the command's workflow runs at its defaults but for `--anchor` and is judged on
`--eval` blocks a set of text calibration never saw (news, legal, wiki: bench_cross_domain's sets). The
anchors of one sample share its calibration and evaluation blocks (paired); the table gives each ratio ±
one standard error over the evaluation blocks, the geometric mean over the samples, and in how many
(sample, set) cells each anchor beat the first one listed. Rows already in --out (the same kind, sample and
anchor) are kept, so a long run can be split.

    python benchmarks/bench_convert_anchor.py --kinds mla,gqa --seeds 0,1,2 --anchors 1,0.3,0.1 --cal 64 \\
        --out benchmarks/results/convert_anchor_064.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_cross_domain as cross  # noqa: E402
from sample_runs import add_sample_options, document, paired_lines, resume, start  # noqa: E402

from headtool.surgery.compensation import DEFAULT_ANCHOR  # noqa: E402
from headtool.workflows.convert_gqa import convert_loaded  # noqa: E402
from headtool.workflows.convert_mla import convert_mla_loaded  # noqa: E402
from headtool.workflows.requests import ConvertRequest, LatentRequest  # noqa: E402

CALIBRATION = "builtin:pydoc+self"
KINDS = {"mla": "convert-mla --kv-cache 1/3", "gqa": "convert-gqa --kv-heads 1 --merge fit"}


def row_key(r: dict) -> tuple:
    return r["kind"], r["seed"], r["anchor"]


def convert(run, kind: str, spec, anchor: float):
    """The converted model of one row (the command's workflow at its defaults but for --anchor) and its
    refit record."""
    if kind == "mla":
        done = convert_mla_loaded(run.lm, LatentRequest(model=cross.MODEL, kv_cache="1/3", data=spec,
                                                        anchor=f"{anchor:g}"), text_model=run.lm)
        return done.conv.model, done.summary["refit"] or []
    conv = convert_loaded(run.lm, ConvertRequest(model=cross.MODEL, kv_heads=1, merge="fit", data=spec,
                                                 anchor=f"{anchor:g}"), text_model=run.lm)
    return conv.best.model, conv.best.refit or []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sample_options(ap, fractions="", out="convert_anchor.json")
    ap.set_defaults(eval=128)
    ap.add_argument("--kinds", default="mla,gqa", help=f"comma-separated: {', '.join(KINDS)}")
    ap.add_argument("--anchors", default="1,0.3,0.1",
                    help="--anchor values, comma-separated (the first is what the others are set beside)")
    a = ap.parse_args()
    kinds = [k for k in a.kinds.split(",") if k.strip()]
    if set(kinds) - set(KINDS):
        raise SystemExit(f"--kinds: use {', '.join(KINDS)}")
    anchors = [float(x) for x in a.anchors.split(",") if x.strip()]
    run = start(a)
    doc = document(run, "bench_convert_anchor.py", CALIBRATION, kinds=kinds, anchors=anchors,
                   default_anchor=DEFAULT_ANCHOR)
    old = resume(doc, Path(a.out), ("cal", "eval", "calibration"))
    if old is not None:  # the table lists the kinds and anchors of every run, the earlier ones first
        doc["settings"]["kinds"] = list(dict.fromkeys(old["settings"]["kinds"] + kinds))
        doc["settings"]["anchors"] = list(dict.fromkeys(old["settings"]["anchors"] + anchors))
    done_keys = {row_key(r) for r in doc["rows"]}
    for seed in run.seeds:
        spec = run.calibration(CALIBRATION, seed)
        for kind in kinds:
            for anchor in anchors:
                if (kind, seed, anchor) in done_keys:
                    continue
                t0 = time.perf_counter()
                model, refit = convert(run, kind, spec, anchor)
                row = {"kind": kind, "seed": seed, "anchor": anchor, "refits_kept": sum(bool(r["kept"]) for r in refit),
                       "convert_seconds": round(time.perf_counter() - t0, 1), "eval": run.ratios(model)}
                run.add_row(doc, row, f"{kind} seed {seed} anchor {anchor:g}")
    run.save(doc)
    print(render(doc))


def render(doc: dict) -> str:
    """Per kind: every sample's ratios (± one standard error) at every anchor, then over the samples
    measured at both that anchor and the first, the geometric mean and the cells in which it beat the first."""
    order = doc["order"]
    labels = [doc["domains"][n].get("label", n) for n in order]
    lines = ["| command | --anchor | calibration sample | " + " | ".join(labels)
             + " | better than the first anchor (cells) |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in order) + " | ---: |"]
    for kind in [k for k in KINDS if any(r["kind"] == k for r in doc["rows"])]:
        rows = {(r["seed"], r["anchor"]): r for r in doc["rows"] if r["kind"] == kind}
        anchors = [x for x in doc["settings"]["anchors"] if any(k[1] == x for k in rows)]
        lines += paired_lines(rows, anchors, order, lambda x: f"`{KINDS[kind]}` | {x:g}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
