"""Heal SmolLM2-135M students against the original: held-out perplexity before / after a CPU-sized heal.

Students (made by headtool's own commands, or with --students-from fallback by the small in-file
surgery below):
  mqa     3 -> 1 KV heads per layer   (`headtool convert-gqa --kv-heads 1 --merge mean,aligned,fit`;
          fallback: the mean of each group's K/V projections, a stock config with num_key_value_heads=1)
  prune25 25% of the query heads removed (`headtool prune --fraction 0.25 --compensate`;
          fallback: in each of the 23 layers with the smallest heads, the smallest query head of every
          KV group removed (69 of 270 heads) with headtool.surgery + headtool.resize)

Calibration of the students uses blocks 0..CALIB-1 of builtin:pydoc; the heal evaluates on the next
--eval-samples blocks and trains on the blocks after them, so every perplexity here is on text
neither the conversion nor the heal has seen. The teacher's perplexity on the same blocks is shown
for reference.

  python benchmarks/bench_heal.py                  # ~10-20 min on 2 CPU cores
  python benchmarks/bench_heal.py --max-steps 20 --students mqa   # quicker look

Prints a table (stderr) and writes benchmarks/results/heal.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEACHER = "smollm2-135m"
CALIB = 64  # calibration blocks of the conversion / pruning (blocks 0..63)


def _run(cmd: list[str], log: Path) -> dict:
    """Run a headtool command, its JSON result from stdout; stderr goes to the log."""
    print("$ " + shlex.join(cmd), file=sys.stderr, flush=True)
    with open(log, "a") as err:
        err.write("$ " + shlex.join(cmd) + "\n")
        err.flush()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}), see {log}: {shlex.join(cmd)}")
    return json.loads(proc.stdout)


def headtool(*args: str) -> list[str]:
    return [sys.executable, "-m", "headtool", *args]


# --------------------------------------------------------------------------- students


def make_with_commands(name: str, out: Path, log: Path) -> list[str]:
    common = ["--data", "builtin:pydoc", "--seq-len", "128", "--max-samples", str(CALIB), "-o", str(out),
              "--overwrite", "--json"]
    if name == "mqa":
        cmd = headtool("convert-gqa", TEACHER, "--kv-heads", "1", "--merge", "mean,aligned,fit", *common)
    else:
        cmd = headtool("prune", TEACHER, "--fraction", "0.25", "--compensate", *common)
    _run(cmd, log)
    return cmd


def make_fallback(name: str, out: Path) -> list[str]:
    """The same students made in this file from headtool.surgery (no convert/prune command needed)."""
    import torch

    from headtool.checkpoint import write_output
    from headtool.loading import load_model
    from headtool.surgery import assemble, extract_heads, keep_for_query_heads, prune_layer_tensors

    lm = load_model(TEACHER, dtype="float32", device="cpu")
    model, ad = lm.model, lm.adapter
    geo = ad.geometry(model.config)
    if name == "mqa":
        from transformers import AutoModelForCausalLM

        sd = model.state_dict()
        new_geo = [type(g)(g.num_heads, 1, g.head_dim) for g in geo]
        for i, g in enumerate(geo):
            prefix = ad.layer_prefix(model, i)
            for ht in ad.tensors:
                key = prefix + ht.name
                if key not in sd or not set(ht.kinds) & {"k", "v"}:
                    continue
                blocks = {}
                for kind in ht.kinds:
                    b = extract_heads(sd[key], ht, g, kind)
                    blocks[kind] = b.mean(0, keepdim=True) if kind in ("k", "v") else b
                sd[key] = assemble(ht, new_geo[i], blocks)
        config = type(model.config).from_dict(model.config.to_dict())
        ad.set_standard_heads(config, new_geo[0])
        student = AutoModelForCausalLM.from_config(config).to(torch.float32)
        student.load_state_dict(sd, strict=False)  # tied lm_head may be absent from sd
        student.tie_weights()
        meta = {"operation": "convert-gqa", "method": "mean (benchmark fallback)",
                "num_kv_heads": [1] * len(geo)}
    else:
        mags = []  # (layer, group, head, o_proj column norm)
        for i, g in enumerate(geo):
            w = ad.o_proj_module(model, i).weight.detach()
            norms = w.view(w.shape[0], g.num_heads, g.head_dim).pow(2).sum((0, 2)).sqrt()
            mags.append(norms)
        # per layer: the smallest head of each group; remove those in the 23 layers where they are smallest
        drops = {}
        for i, g in enumerate(geo):
            drops[i] = [min(g.query_heads_of(k), key=lambda h: float(mags[i][h])) for k in range(g.num_kv_heads)]
        cost = sorted(range(len(geo)), key=lambda i: sum(float(mags[i][h]) for h in drops[i]))
        chosen = sorted(cost[:23])
        kept_heads = []
        for i, g in enumerate(geo):
            kept = [h for h in range(g.num_heads) if not (i in chosen and h in drops[i])]
            kept_heads.append(kept)
            if len(kept) == g.num_heads:
                continue
            from headtool.resize import resize_attention

            keep = keep_for_query_heads(g, kept)
            tensors = prune_layer_tensors(model.state_dict(), ad, ad.layer_prefix(model, i), g, keep)
            resize_attention(model, ad, i, keep.geometry(g), tensors)
        student = model
        meta = {"operation": "prune", "method": "smallest o_proj heads (benchmark fallback)",
                "kept_heads": kept_heads}
    write_output(out, model=student, tokenizer=lm.tokenizer, source=lm, meta=meta, overwrite=True)
    return ["(in-file fallback)", name]


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--students", default="mqa,prune25")
    ap.add_argument("--students-from", choices=("commands", "fallback"), default="commands")
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--train", default="attention")
    ap.add_argument("--workdir", default=str(HERE / "results" / "heal-work"))
    ap.add_argument("--results", default=str(HERE / "results" / "heal.json"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    data = ["--data", "builtin:pydoc", "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
    held = ["--skip-samples", str(CALIB), "--max-samples", str(args.eval_samples)]
    teacher = _run(headtool("eval", TEACHER, *data, *held, "--json"), log)["results"][0]
    rows = []
    for name in args.students.split(","):
        folder = work / name
        t0 = time.perf_counter()
        made_by = (make_with_commands(name, folder, log) if args.students_from == "commands"
                   else make_fallback(name, folder))
        make_min = (time.perf_counter() - t0) / 60
        heal_cmd = headtool("heal", str(folder), "--teacher", TEACHER, *data, "--skip-samples", str(CALIB),
                            "--eval-samples", str(args.eval_samples), "--max-steps", str(args.max_steps),
                            "--train", args.train, "-o", str(work / f"{name}-healed"), "--overwrite", "--json")
        if args.lr:
            heal_cmd[-3:-3] = ["--lr", str(args.lr)]
        t0 = time.perf_counter()
        doc = _run(heal_cmd, log)
        minutes = (time.perf_counter() - t0) / 60
        after = _run(headtool("eval", str(work / f"{name}-healed"), *data, *held, "--json"), log)["results"][0]
        row = {"student": name, "made_by": shlex.join(made_by), "make_minutes": round(make_min, 2),
               "teacher_perplexity": teacher["perplexity"], "before_perplexity": doc["before"]["perplexity"],
               "after_perplexity": doc["after"]["perplexity"], "after_perplexity_reloaded": after["perplexity"],
               "factor": doc["before"]["perplexity"] / doc["after"]["perplexity"],
               "before_kl": doc["before"]["distill"], "after_kl": doc["after"]["distill"],
               "steps": doc["steps"], "best_step": doc["best_step"], "tokens": doc["tokens"],
               "minutes": round(minutes, 2), "heal_command": shlex.join(heal_cmd),
               "trainable_params": doc["trainable_params"], "memory": doc["memory"],
               "train_loss_first_quarter": doc["train_loss_first_quarter"],
               "train_loss_last_quarter": doc["train_loss_last_quarter"]}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"heal against {TEACHER}: held-out perplexity on builtin:pydoc (seq_len {args.seq_len}, "
                    f"{args.eval_samples} blocks)")
    for c in ("student", "teacher", "before", "after", "factor", "held-out KL before -> after", "steps", "minutes"):
        t.add_column(c, justify="left" if c == "student" else "right")
    for r in rows:
        t.add_row(r["student"], f"{r['teacher_perplexity']:.2f}", f"{r['before_perplexity']:.2f}",
                  f"{r['after_perplexity']:.2f}", f"{r['factor']:.1f}x",
                  f"{r['before_kl']:.3f} -> {r['after_kl']:.3f}", str(r["steps"]), f"{r['minutes']:.1f}")
    Console(stderr=True).print(t)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps({"teacher": TEACHER, "students_from": args.students_from,
                                              "seq_len": args.seq_len, "batch_size": args.batch_size,
                                              "eval_samples": args.eval_samples, "calibration_blocks": CALIB,
                                              "torch_threads": __import__("torch").get_num_threads(),
                                              "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
