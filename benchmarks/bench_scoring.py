"""Scoring cost on a real model, all on the same batches in one run.

Figures (targets from issue 3):
- gradient scoring time / plain forward+backward with parameter gradients (target <= 0.75);
- ablation scoring time / naive "one full forward per head" (target <= 0.5), plus the largest
  difference between the two methods' scores (they compute the same numbers);
- peak memory of gradient scoring vs plain forward+backward: the peak resident set size
  (VmHWM, reset after loading) of a fresh child process running only that workload, minus its
  RSS once the model and batches are loaded (so the model's own weights are not counted).

Usage: python benchmarks/bench_scoring.py [--model smollm2-135m] [--seq-len 64] [--batch-size 2]
       [--batches 1] [--repeats 3] [--naive-heads all|N]
Writes benchmarks/results/scoring.json and prints a table on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HEADTOOL_NO_PROGRESS", "1")

import torch  # noqa: E402

from headtool.data.sources import DataSpec
from headtool.data.batches import make_batches
from headtool.measure.gates import head_gates
from headtool.model.loading import load_model
from headtool.measure.objectives import forward_output, token_losses
from headtool.measure.scoring import score_heads

RESULTS = Path(__file__).parent / "results" / "scoring.json"


def setup(args):
    lm = load_model(args.model, dtype="float32", device="cpu")
    spec = DataSpec(seq_len=args.seq_len, batch_size=args.batch_size, max_samples=args.batch_size * args.batches)
    batches = make_batches(spec, lm.tokenizer, "lm")
    return lm, batches


def fwd_bwd(model, batches) -> None:
    """What training-style code does: forward, loss, backward into every parameter's .grad."""
    for p in model.parameters():
        p.requires_grad_(True)
    model.zero_grad(set_to_none=True)
    for b in batches:
        out, _ = forward_output(model, b)
        losses, w = token_losses("lm", out, b)
        ((losses * w).sum() / w.sum()).backward()
    model.zero_grad(set_to_none=True)


def naive_ablation(lm, batches, heads) -> dict[tuple[int, int], float]:
    """One full forward over all batches per head gated off (plus the ungated baseline)."""
    geo = lm.geometry

    def mean_loss(mask):
        tot = n = 0.0
        with head_gates(lm.model, lm.adapter, init=mask) as _, torch.inference_mode():
            for b in batches:
                out, _ = forward_output(lm.model, b)
                losses, w = token_losses("lm", out, b)
                tot += float((losses * w).sum())
                n += float(w.sum())
        return tot / n

    ones = [[1.0] * g.num_heads for g in geo]
    base = mean_loss(ones)
    out = {}
    for layer, head in heads:
        mask = [list(r) for r in ones]
        mask[layer][head] = 0.0
        out[(layer, head)] = mean_loss(mask) - base
    return out


def memory_child(args, which: str) -> None:
    lm, batches = setup(args)
    forward_output(lm.model, batches[0])  # allocator warm
    base = _rss_kib()
    _reset_peak()  # loading peaks higher than either workload: measure the workload's own peak
    if which == "fwd_bwd":
        fwd_bwd(lm.model, batches.batches)
    else:
        score_heads(lm.model, lm.adapter, batches.batches, method="gradient", objective="lm")
    print(json.dumps({"peak_kib": _status_kib("VmHWM:"), "base_kib": base}))


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _rss_kib() -> int:
    return _status_kib("VmRSS:")


def _reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure_memory(args, which: str) -> dict:
    cmd = [sys.executable, __file__, "--memory-child", which, "--model", args.model, "--seq-len", str(args.seq_len),
           "--batch-size", str(args.batch_size), "--batches", str(args.batches)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    return {"peak_rss_mib": d["peak_kib"] / 1024, "rss_after_load_mib": d["base_kib"] / 1024,
            "peak_increase_mib": (d["peak_kib"] - d["base_kib"]) / 1024}


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--batches", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="timings of the short runs: best of N")
    ap.add_argument("--naive-heads", default="all", help="'all' or N heads spread over the model (extrapolated)")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        memory_child(args, args.memory_child)
        return
    from rich.console import Console
    from rich.table import Table

    con = Console(stderr=True)
    lm, batches = setup(args)
    model, b = lm.model, batches.batches
    total_heads = sum(g.num_heads for g in lm.geometry)
    con.print(f"{args.model}: {total_heads} heads; {len(b)} batch(es) of {args.batch_size} x {args.seq_len} tokens; "
              f"torch threads {torch.get_num_threads()}")
    forward_output(model, b[0])  # warm-up

    t_fb = timed(lambda: fwd_bwd(model, b), args.repeats)
    t_grad = timed(lambda: score_heads(model, lm.adapter, b, method="gradient", objective="lm"), args.repeats)
    t_fb2 = timed(lambda: fwd_bwd(model, b), args.repeats)  # again, to bracket load changes
    t_fb = min(t_fb, t_fb2)
    t_fwd = timed(lambda: naive_ablation(lm, b, []), args.repeats)  # one ungated forward pass over the data

    t0 = time.perf_counter()
    abl = score_heads(model, lm.adapter, b, method="ablation", objective="lm")
    t_abl = time.perf_counter() - t0
    all_heads = [(i, h) for i, g in enumerate(lm.geometry) for h in range(g.num_heads)]
    if args.naive_heads == "all":
        heads = all_heads
    else:
        n = int(args.naive_heads)
        heads = all_heads[:: max(1, len(all_heads) // n)][:n]
    t0 = time.perf_counter()
    naive = naive_ablation(lm, b, heads)
    t_naive = (time.perf_counter() - t0) * (len(all_heads) / len(heads))
    max_diff = max(abs(naive[(i, h)] - abl.raw_scores[i][h]) for i, h in heads)

    mem_fb = measure_memory(args, "fwd_bwd")
    mem_grad = measure_memory(args, "gradient")

    res = {
        "model": args.model, "heads": total_heads, "seq_len": args.seq_len, "batch_size": args.batch_size,
        "batches": len(b), "tokens": int(sum(x["input_ids"].numel() for x in b)),
        "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "load_average_1min": os.getloadavg()[0],
        "forward_s": t_fwd,
        "fwd_bwd_param_grads_s": t_fb, "gradient_scoring_s": t_grad, "gradient_ratio": t_grad / t_fb,
        "ablation_s": t_abl, "ablation_forward_passes": abl.passes, "naive_one_forward_per_head_s": t_naive,
        "naive_heads_measured": len(heads), "ablation_ratio": t_abl / t_naive,
        "ablation_vs_naive_max_abs_diff": max_diff,
        # the same naive cost estimated from one timed ungated forward (less exposed to load swings
        # between the two timed sections on a shared machine)
        "naive_from_forward_s": t_fwd * (len(all_heads) + 1),
        "ablation_ratio_vs_forward_estimate": t_abl / (t_fwd * (len(all_heads) + 1)),
        "memory_fwd_bwd": mem_fb, "memory_gradient_scoring": mem_grad,
        "memory_ratio_peak_increase": mem_grad["peak_increase_mib"] / max(mem_fb["peak_increase_mib"], 1e-9),
        "command": shlex.join(["python", "benchmarks/bench_scoring.py", *sys.argv[1:]]),
        "memory_measure": "peak RSS (VmHWM, reset via /proc/self/clear_refs after loading) of a child process "
                          "running only the workload, minus its RSS after loading the model and data",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")

    t = Table(title=f"scoring cost: {args.model}, {res['tokens']} tokens", title_justify="left")
    for c in ("measure", "value", "reference", "ratio", "target"):
        t.add_column(c, justify="left" if c == "measure" else "right")
    t.add_row("gradient scoring vs fwd+bwd (param grads)", f"{t_grad:.2f} s", f"{t_fb:.2f} s",
              f"{res['gradient_ratio']:.2f}", "<= 0.75")
    t.add_row(f"ablation ({abl.passes} passes) vs naive ({len(all_heads)} forwards)", f"{t_abl:.1f} s",
              f"{t_naive:.1f} s", f"{res['ablation_ratio']:.2f}", "<= 0.5")
    t.add_row("peak RSS increase: gradient vs fwd+bwd", f"{mem_grad['peak_increase_mib']:.0f} MiB",
              f"{mem_fb['peak_increase_mib']:.0f} MiB", f"{res['memory_ratio_peak_increase']:.2f}", "")
    t.add_row("ablation vs naive: max |score diff|", f"{max_diff:.2e}", "", "", "")
    t.add_row("ablation vs (heads + 1) x one timed forward", f"{t_abl:.1f} s", f"{res['naive_from_forward_s']:.1f} s",
              f"{res['ablation_ratio_vs_forward_estimate']:.2f}", "<= 0.5")
    t.add_row("one forward over the data", f"{t_fwd:.3f} s", "", "", "")
    con.print(t)
    con.print(f"written to {RESULTS}")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
