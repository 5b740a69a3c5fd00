"""What the benchmarks that prune SmolLM2-135M once per calibration sample share (bench_kv_groups,
bench_allocation): their options, the model with the out-of-domain sets and their baseline, each
sample's calibration, a pruned model's ratios to the baseline, the JSON document (its header, saved
after every row), and the geometric mean they summarize samples by."""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import bench_cross_domain as cross
import torch
from run_clock import RunClock

from headtool.measure.evaluation import paired_difference
from headtool.model.loading import LoadedModel, load_model
from headtool.surgery.prune_defaults import default_anchor_power

HERE = Path(__file__).resolve().parent
SEQ_LEN = 128  # tokens per calibration and evaluation block


def default_power(cal: int) -> float:
    """The --anchor-power prune refits at when none is given, on `cal` full blocks of calibration."""
    return default_anchor_power(cal * SEQ_LEN)


def add_sample_options(ap: argparse.ArgumentParser, fractions: str, out: str) -> None:
    ap.add_argument("--seeds", default="0,1,2", help="calibration samples (bench_cross_domain --seed)")
    ap.add_argument("--fractions", default=fractions)
    ap.add_argument("--cal", type=int, default=64)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--out", default=str(HERE / "results" / out))


@dataclass
class Sample:
    """A calibration sample as the allocation benches prune it."""

    spec: Any
    scores: Any
    score_seconds: float
    judge: list


@dataclass
class SampleRun:
    """One run: its clock, the model, the evaluation sets (out of domain only) and their baseline."""

    clock: RunClock
    lm: LoadedModel
    domains: dict
    evals: dict
    base: dict
    seeds: list[int]
    fractions: list[float]
    cal: int
    eval: int
    out: Path
    base_blocks: dict = field(default_factory=dict)  # per evaluation set: the unpruned model's block sums

    def calibration(self, source: str, seed: int):
        """The calibration of one sample: `cal` blocks of `source` (bench_cross_domain's cut)."""
        return cross.calibration_spec(source, self.domains, blocks=self.cal, evaluated=self.eval, seq_len=SEQ_LEN,
                                      batch_size=4, seed=seed)[0]

    @property
    def default_power(self) -> float:
        """The --anchor-power prune refits at when none is given, on this run's calibration."""
        return default_power(self.cal)

    def scored(self, source: str, seed: int) -> "Sample":
        """One sample's calibration, its gradient scores (and their seconds), and the blocks prune's judge
        of a list of modes reads: self text after every self block the calibration read."""
        from headtool.data.batches import make_batches
        from headtool.workflows.data_plan import allocation_spec
        from headtool.workflows.requests import ScoreRequest
        from headtool.workflows.score import score_loaded

        spec = self.calibration(source, seed)
        t0 = time.perf_counter()
        scores = score_loaded(self.lm, ScoreRequest(model=cross.MODEL, method="gradient", data=spec),
                              text_model=self.lm).result
        seconds = time.perf_counter() - t0
        judge_spec = allocation_spec(spec, spec.skip_samples + spec.max_samples, True)[0]
        return Sample(spec, scores, seconds, make_batches(judge_spec, self.lm.tokenizer, "lm", model=self.lm).batches)

    def ratios(self, model) -> dict:
        """`model`'s perplexities on the evaluation sets, each with its ratio to the unpruned model's and
        the standard error of its log (`log_ratio_se`: the paired difference of the two models' mean
        losses over the same blocks, the blocks the sampling unit), which says how far the evaluation
        blocks alone could move the ratio."""
        ev, _ = cross.perplexities(model, self.evals, per_block=True)
        out = {}
        for n, e in ev.items():
            diff, se = paired_difference(e.pop("block_sums"), self.base_blocks[n], e.pop("block_weights"))
            out[n] = {**e, "ratio": e["perplexity"] / self.base[n]["perplexity"], "log_ratio_se": se}
        return out

    def add_row(self, doc: dict, row: dict, label: str) -> None:
        """Append a measured row, save the document, and log the row's ratios under `label`."""
        doc["rows"].append(row)
        self.save(doc)
        self.clock.log(f"{label}: " + " / ".join(f"{n} {r['ratio']:.4f}x" for n, r in row["eval"].items()))

    def save(self, doc: dict) -> None:
        """Write the document as it stands (after every row: a run cut short keeps what it measured)."""
        doc["total_seconds"] = self.clock.seconds()
        self.out.write_text(json.dumps(doc, indent=2) + "\n")


def start(a: argparse.Namespace) -> SampleRun:
    clock = RunClock()
    lm = load_model(cross.MODEL, dtype="float32", device="cpu")
    # held-out blocks of the refit are not read at the defaults; 16 reserved as bench_cross_domain does
    domains, evals = cross.evaluation_sets(lm.tokenizer, seq_len=SEQ_LEN, batch_size=4, n_eval=a.eval, used=a.cal + 16,
                                           min_blocks=64, log=clock.log, in_domain=False)
    base, _ = cross.perplexities(lm.model, evals, per_block=True)
    base_blocks = {n: e.pop("block_sums") for n, e in base.items()}
    for e in base.values():
        del e["block_weights"]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return SampleRun(clock, lm, domains, evals, base, [int(s) for s in a.seeds.split(",") if s.strip()],
                     [float(f) for f in a.fractions.split(",") if f.strip()], a.cal, a.eval, out, base_blocks)


def removed_per_layer(result) -> list[int]:
    """How many heads each layer of a prune's input lost."""
    return [len(r) for r in result.selection.removed(result.geometry_before)]


def document(run: SampleRun, script: str, calibration: str, **extra: Any) -> dict:
    """The JSON document's header (rows appended by the bench); `extra` goes into its settings."""
    import transformers
    return {"model": cross.MODEL, "command": shlex.join(["python", f"benchmarks/{script}", *sys.argv[1:]]),
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "settings": {"seeds": run.seeds, "fractions": run.fractions, "cal": run.cal, "eval": run.eval,
                         "calibration": calibration, **extra, "threads": torch.get_num_threads()},
            "domains": run.domains, "order": list(run.domains), "base": run.base, "rows": []}


def resume(doc: dict, out: Path, same: tuple[str, ...]) -> dict | None:
    """Keep what an earlier run of the same settings (`same`, keys of settings) wrote to `out`: its rows and
    the commands that added them, with this run's command last. Returns the earlier document (None: none), or
    exits where its settings differ."""
    old = None
    earlier: list[str] = []
    if out.exists():
        old = json.loads(out.read_text())
        kept = {k: old["settings"].get(k) for k in same}
        if kept != {k: doc["settings"][k] for k in same}:
            raise SystemExit(f"{out} was measured with other settings ({kept}); give another --out")
        doc["rows"] = old["rows"]
        earlier = old.get("commands", [old["command"]])
    doc["commands"] = [*earlier, doc["command"]]
    return old


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def paired_lines(rows: dict, values: list, order: list[str], cells: Callable[[Any], str]) -> list[str]:
    """Table lines of one paired comparison (rows maps (sample, value) to a row with ratios per set in
    `order`): every sample's ratios (± one standard error) at every value, then over the samples measured at
    both that value and the first, the geometric mean and the (sample, set) cells in which it beat the first.
    `cells(value)` gives the cells before the sample's; one sample carries its count on its own row."""
    first = values[0]
    lines = []
    for x in values:
        seeds = sorted(s for s, y in rows if y == x and (s, first) in rows)
        wins = sum(rows[(s, x)]["eval"][n]["ratio"] < rows[(s, first)]["eval"][n]["ratio"]
                   for s in seeds for n in order)
        count = "" if x == first or not seeds else f"{wins} of {len(seeds) * len(order)}"
        for s in sorted(s for s, y in rows if y == x):
            ev = rows[(s, x)]["eval"]
            lines.append(f"| {cells(x)} | {s} | " + " | ".join(
                f"{ev[n]['ratio']:.4f}x ± {ev[n]['ratio'] * ev[n]['log_ratio_se']:.4f}" for n in order)
                + last_cell(count if len(seeds) == 1 and s in seeds else ""))
        if len(seeds) > 1:  # one sample: its row is the mean
            lines.append(f"| {cells(x)} | geometric mean of {', '.join(map(str, seeds))} | " + " | ".join(
                f"**{geomean([rows[(s, x)]['eval'][n]['ratio'] for s in seeds]):.4f}x**" for n in order)
                + last_cell(count))
    return lines


def last_cell(text: str) -> str:
    return f" | {text} |" if text else " | |"
