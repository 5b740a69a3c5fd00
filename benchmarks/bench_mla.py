"""Latent attention (convert-mla) against merged K/V heads at the same cache: SmolLM2-135M, no training.

Rows: the original; `convert-mla --kv-cache F` for every budget of --budgets (default a third of
the cache, the MQA budget of a 3-KV-head model, and an eighth), each with --rank-allocation
uniform and auto; and `convert-gqa --kv-heads 1 --merge fit` (a third of the cache). Every row runs
the workflow function its command runs (`convert_mla_loaded`, `convert_loaded`) on the same
calibration blocks (--cal blocks of --calibration, default `builtin:pydoc+self`; --held more of
it for the refit checks; several calibrations, comma-separated, repeat the rows for each, and an
evaluation set's name, alone or in a mixture such as `news+builtin:pydoc+self`, calibrates on that
set's own text after its evaluated blocks: domain-matched) and is evaluated on the evaluation
sets of bench_cross_domain.py (news, legal, wiki: text no calibration saw unless named so; in-domain
pydoc last, which flatters). Reported per row:
perplexity (ratio to the original) per set, KV-cache bytes per token (as computed from the
model: latent + rotary key, or K and V heads), and decode tokens/s with a --context token
prompt (`measure.speed.measure_models`, the code behind `headtool eval --speed`: all rows timed
interleaved on the same prompt, median of --repeats).

    HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_mla.py

writes benchmarks/results/mla.json (after every row; a partial run keeps its rows) and prints the
markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from fractions import Fraction
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: shared cores

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_cross_domain, run as a script

from bench_cross_domain import calibration_mark, calibration_spec, evaluation_sets, perplexities  # noqa: E402
from run_clock import RunClock  # noqa: E402

from headtool.measure.speed import SpeedSpec, measure_models, speed_input_ids  # noqa: E402
from headtool.model.info import model_info  # noqa: E402
from headtool.model.loading import load_model  # noqa: E402
from headtool.workflows.convert_gqa import convert_loaded  # noqa: E402
from headtool.workflows.convert_mla import convert_mla_loaded  # noqa: E402
from headtool.workflows.requests import ConvertRequest, LatentRequest  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = "smollm2-135m"
ALLOCATIONS = ("uniform", "auto")


def parse_budgets(text: str) -> list[tuple[float, str, int | None]]:
    """'1/3:64,1/8:16' -> [(fraction, its spelling, rope_dim)]; a budget without ':D' keeps the default rope_dim."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        frac, _, rope = item.partition(":")
        out.append((float(Fraction(frac)), frac, int(rope) if rope else None))
    return out


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if v >= 1000 else f"{v:.2f}"


def render(doc: dict) -> str:
    """Markdown: perplexity (ratio) per evaluation set, cache per token, parameters, prefill and decode
    tokens/s (ratio) when the run timed them, and a calibration column when it had several."""
    order = doc["order"]
    labels = [doc["domains"][n].get("label", n) for n in order]
    ctx = doc["settings"]["context"]
    with_params = all("params" in r for r in doc["rows"])
    several = len(doc["settings"].get("calibrations", [])) > 1  # then a calibration column
    timed = any(r.get("speed") for r in doc["rows"])  # a run with --no-speed has no speed columns
    head = ["change", *(["calibration"] if several else []), "kv_rank + rope_dim per layer", *labels,
            "KV cache / token", *(["parameters"] if with_params else []),
            *([f"prefill tok/s @ {ctx}", f"decode tok/s @ {ctx}"] if timed else [])]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- |" + (" --- |" if several else "")
             + " ---: |" * (len(head) - 2 - several)]
    base_bytes = doc["rows"][0]["kv_cache_bytes_per_token"]
    base_params = doc["rows"][0].get("params")
    for r in doc["rows"]:
        # a set the row was calibrated on (domain-matched calibration) is in-domain for it: marked
        cells = [f"{_fmt(r['eval'][n]['perplexity'])} ({r['eval'][n]['ratio']:.2f}x){calibration_mark(n, r)}"
                 for n in order]
        ranks = r.get("kv_rank")
        rank = "-" if ranks is None else (str(ranks[0]) if len(set(ranks)) == 1 else f"{min(ranks)}..{max(ranks)}")
        if ranks is not None and r.get("rope_dim") is not None:
            rank += f" + {r['rope_dim']}"
        speed = r.get("speed") or {}
        ratios = speed.get("ratio") or {}

        def rate(key: str) -> str:
            v = speed.get(key)
            return "-" if v is None else f"{v:.2f} ({ratios[key]:.2f}x)" if ratios.get(key) else f"{v:.2f}"
        params = ([f"{r['params'] / 1e6:.2f}M ({r['params'] / base_params:.3f}x)"] if with_params else [])
        calibration = [f"`{r['calibration']}`" if r.get("calibration") else "-"] if several else []
        lines.append("| " + " | ".join([r["change"], *calibration, rank, *cells,
                                          f"{r['kv_cache_bytes_per_token']:,} B "
                                          f"({r['kv_cache_bytes_per_token'] / base_bytes:.3f}x)",
                                          *params, *([rate("prefill_tokens_per_s"),
                                                      rate("decode_tokens_per_s")] if timed else [])]) + " |")
    lines += ["", f"`{doc['command']}`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL, help="the model (a tiny local folder for a smoke run)")
    ap.add_argument("--calibration", default="builtin:pydoc+self",
                    help="calibration --data source; several, comma-separated, each run on every row; an evaluation "
                         "set's name (news, legal, wiki) calibrates on that set's own text after its evaluation blocks "
                         "(domain-matched: that column is then in-domain, marked in the table)")
    ap.add_argument("--budgets", default="1/3,1/8",
                    help="comma list of FRACTION[:ROPE_DIM]: --kv-cache and --rope-dim of the convert-mla rows "
                         "(without :ROPE_DIM, the default of convert-mla)")
    ap.add_argument("--allocations", default=",".join(ALLOCATIONS), help="--rank-allocation of the rows")
    ap.add_argument("--gqa", default="fit", help="convert-gqa --kv-heads 1 merge of the comparison row ('' for none)")
    ap.add_argument("--cal", type=int, default=32, help="calibration blocks")
    ap.add_argument("--held", type=int, default=8, help="held-out blocks after them (refit checks)")
    ap.add_argument("--eval", type=int, default=16, help="evaluation blocks of every set")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--min-blocks", type=int, default=64, help="fail when an evaluation text gives fewer blocks")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens of the decode timing")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-speed", action="store_true", help="skip the decode timing")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "mla.json")
    a = ap.parse_args(argv)
    budgets = parse_budgets(a.budgets)
    allocations = [x.strip() for x in a.allocations.split(",") if x.strip()]
    if any(x not in ALLOCATIONS for x in allocations):
        ap.error(f"--allocations: use {', '.join(ALLOCATIONS)}")
    import torch
    import transformers

    if a.threads:
        torch.set_num_threads(a.threads)
    command = shlex.join(["python", "benchmarks/bench_mla.py", *(argv if argv is not None else sys.argv[1:])])
    clock = RunClock()
    log = clock.log


    lm = load_model(a.model, dtype="float32", device="cpu")
    tok = lm.tokenizer
    domains, evals = evaluation_sets(tok, seq_len=a.seq_len, batch_size=a.batch_size, n_eval=a.eval,
                                     used=a.cal + a.held, min_blocks=a.min_blocks, log=log)
    calibrations = [x.strip() for x in a.calibration.split(",") if x.strip()]

    doc: dict = {"model": a.model, "dtype": "float32", "command": command,
                 "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                              "transformers": transformers.__version__},
                 "settings": {"calibration": a.calibration, "calibrations": calibrations,
                              "budgets": [[s, r] for _, s, r in budgets],
                              "allocations": allocations, "gqa": a.gqa, "cal": a.cal, "held": a.held,
                              "eval": a.eval, "seq_len": a.seq_len, "batch_size": a.batch_size,
                              "context": a.context, "new_tokens": a.new_tokens, "repeats": a.repeats,
                              "threads": torch.get_num_threads(),
                              "convert_mla": "convert_mla_loaded: --kv-cache F --rope-dim D --rank-allocation A, "
                                             "--heldout-samples HELD, refit on (the defaults otherwise)",
                              "convert_gqa": "convert_loaded: --kv-heads 1 --merge M --heldout-samples HELD"},
                 "domains": domains, "order": list(domains), "rows": []}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    models: list[tuple[str, object]] = []

    def save() -> None:
        doc["total_seconds"] = clock.seconds()
        a.out.write_text(json.dumps(doc, indent=2) + "\n")

    base: dict = {}

    def add(row: dict, model) -> None:
        t0 = time.perf_counter()
        row["eval"], _ = perplexities(model, evals)
        row["eval_seconds"] = round(time.perf_counter() - t0, 1)
        if not base:
            base.update(row["eval"])
        for name, r in row["eval"].items():
            r["ratio"] = r["perplexity"] / base[name]["perplexity"]
        info = model_info(model, lm.adapter)
        row.update(kv_cache_bytes_per_token=info["kv_cache_bytes_per_token"], params=info["params"])
        doc["rows"].append(row)
        models.append((row["change"], model))
        save()
        cells = "  ".join(f"{n} {_fmt(r['perplexity'])} ({r['ratio']:.2f}x)" for n, r in row["eval"].items())
        log(f"{row['change']:<40} {cells}  cache {row['kv_cache_bytes_per_token']:,} B")

    add({"change": "none (original)", "kind": "original"}, lm.model)
    for calibration in calibrations:
        spec, calibrated_on = calibration_spec(calibration, domains, blocks=a.cal, evaluated=a.eval,
                                               seq_len=a.seq_len, batch_size=a.batch_size)
        for fraction, spelled, rope in budgets:
            for alloc in allocations:
                t0 = time.perf_counter()
                req = LatentRequest(model=a.model, kv_cache=fraction, rope_dim=rope, rank_allocation=alloc,
                                    data=spec, heldout_samples=a.held)
                done = convert_mla_loaded(lm, req, text_model=lm)
                s = done.summary
                add({"change": f"convert-mla, {spelled} of the cache, {alloc}", "kind": "mla", "kv_cache": fraction,
                     "calibration": calibration, "calibrated_on": calibrated_on, "rank_allocation": alloc,
                     "rope_dim": s["rope_dim"], "kv_rank": s["kv_rank"],
                     "refits_kept": sum(bool(r["kept"]) for r in s["refit"] or []),
                     "surgery_seconds": round(time.perf_counter() - t0, 1)}, done.conv.model)
        if a.gqa:
            t0 = time.perf_counter()
            held = {} if a.gqa == "mean" else {"heldout_samples": a.held}  # mean reads no data
            req = ConvertRequest(model=a.model, kv_heads=1, merge=a.gqa, data=spec, **held)
            conv = convert_loaded(lm, req, text_model=lm)
            add({"change": f"convert-gqa --kv-heads 1, merge {a.gqa}", "kind": "gqa", "method": a.gqa,
                 "calibration": calibration, "calibrated_on": calibrated_on,
                 "surgery_seconds": round(time.perf_counter() - t0, 1)}, conv.best.model)
    if not a.no_speed:
        sspec = SpeedSpec(batch=1, context=a.context, new_tokens=a.new_tokens, repeats=a.repeats, warmup=a.warmup)
        ids = speed_input_ids(tok, sspec)
        log(f"decode timing: {len(models)} models, context {a.context}, {a.new_tokens} new tokens, "
            f"{a.repeats} rounds")
        speeds = measure_models([(name, m, True) for name, m in models], ids, sspec,
                                on_round=lambda i: log(f"speed round {i + 1}/{a.repeats}"))
        for row, sp in zip(doc["rows"], speeds):
            row["speed"] = sp
        save()
    print(render(doc))


if __name__ == "__main__":
    main()
