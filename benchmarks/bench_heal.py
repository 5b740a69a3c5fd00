"""Heal SmolLM2-135M students against the original: held-out perplexity before / after a CPU-sized heal.

Students, each made by a headtool command (see STUDENTS):
  mqa-mean      3 -> 1 KV heads per layer, `convert-gqa --kv-heads 1 --merge mean` (no data)
  mqa           3 -> 1 KV heads, best of mean/aligned/fit on calibration data (fit wins)
  prune25       25% of the query heads removed, `prune --fraction 0.25` (gradient scores)
  prune25-comp  the same with least-squares compensation (`--compensate`)

Calibration of the students uses blocks 0..CALIB-1 of builtin:pydoc; the heal evaluates on the next
--eval-samples blocks and trains on the blocks after them, so every perplexity here is on text
neither the conversion nor the heal has seen. The teacher's perplexity on the same blocks is shown
for reference.

  python benchmarks/bench_heal.py --max-steps 20 --eval-samples 8   # ~25 min on 2 CPU cores
  python benchmarks/bench_heal.py --max-steps 8 --students mqa      # quicker look

Prints a table (stderr) and writes benchmarks/results/heal.json.
"""
from __future__ import annotations

import argparse
import json
import math
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


STUDENTS = {  # name -> the headtool command (after the model) that makes it
    "mqa-mean": ["convert-gqa", "--kv-heads", "1", "--merge", "mean"],
    "mqa": ["convert-gqa", "--kv-heads", "1", "--merge", "mean,aligned,fit"],
    "prune25": ["prune", "--fraction", "0.25"],
    "prune25-comp": ["prune", "--fraction", "0.25", "--compensate", "--unit", "query"],  # the unit of its results
}


def make_with_commands(name: str, out: Path, log: Path) -> list[str]:
    if name not in STUDENTS:
        raise SystemExit(f"unknown student {name!r}; choose from {', '.join(STUDENTS)}")
    op, *opts = STUDENTS[name]
    calib = [] if "mean" in opts and op == "convert-gqa" else \
        ["--data", "builtin:pydoc", "--seq-len", "128", "--max-samples", str(CALIB)]
    cmd = headtool(op, TEACHER, *opts, *calib, "-o", str(out), "--overwrite", "--json")
    _run(cmd, log)
    return cmd


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--students", default=",".join(STUDENTS))
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

    def save(rows: list[dict]) -> None:
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(json.dumps({
            "command": shlex.join(["python", "benchmarks/bench_heal.py", *sys.argv[1:]]), "teacher": TEACHER,
            "seq_len": args.seq_len, "batch_size": args.batch_size, "eval_samples": args.eval_samples,
            "calibration_blocks": CALIB, "torch_threads": __import__("torch").get_num_threads(),
            "rows": rows}, indent=2) + "\n")

    for name in args.students.split(","):
        folder = work / name
        t0 = time.perf_counter()
        made_by = make_with_commands(name, folder, log)
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
               # share of the log-perplexity gap to the teacher that the heal closed
               "gap_closed": (math.log(doc["before"]["perplexity"]) - math.log(doc["after"]["perplexity"]))
               / max(math.log(doc["before"]["perplexity"]) - math.log(teacher["perplexity"]), 1e-12),
               "before_kl": doc["before"]["distill"], "after_kl": doc["after"]["distill"],
               "steps": doc["steps"], "best_step": doc["best_step"], "tokens": doc["tokens"],
               "minutes": round(minutes, 2), "heal_command": shlex.join(heal_cmd),
               "trainable_params": doc["trainable_params"], "memory": doc["memory"],
               "train_loss_first_quarter": doc["train_loss_first_quarter"],
               "train_loss_last_quarter": doc["train_loss_last_quarter"]}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        save(rows)  # after every student: an interrupted run keeps what it measured
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"heal against {TEACHER}: held-out perplexity on builtin:pydoc (seq_len {args.seq_len}, "
                    f"{args.eval_samples} blocks)")
    for c in ("student", "teacher", "before", "after", "factor", "gap closed", "held-out KL before -> after",
              "steps", "minutes"):
        t.add_column(c, justify="left" if c == "student" else "right")
    for r in rows:
        t.add_row(r["student"], f"{r['teacher_perplexity']:.2f}", f"{r['before_perplexity']:.2f}",
                  f"{r['after_perplexity']:.2f}", f"{r['factor']:.1f}x", f"{100 * r['gap_closed']:.0f}%",
                  f"{r['before_kl']:.3f} -> {r['after_kl']:.3f}", str(r["steps"]), f"{r['minutes']:.1f}")
    Console(stderr=True).print(t)


if __name__ == "__main__":
    main()
