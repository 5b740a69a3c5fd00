"""Snapshot of what every command prints and writes on tiny models of every family.

A refactor that must not change behaviour is checked by running this before and after it and
comparing the two JSON files: every stdout document and every written file is hashed (JSON
documents without the keys that measure time or memory, which differ run to run).

    python benchmarks/behaviour_snapshot.py --out before.json      # on the old code
    python benchmarks/behaviour_snapshot.py --out after.json --compare before.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HEADTOOL_NO_PROGRESS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from headtool.cli import app  # noqa: E402  (the same name before and after the package move)
from tiny_models import ALL, save_tiny  # noqa: E402

MEASURED_KEYS = {"elapsed_s", "seconds", "headtool_version", "peak_rss_bytes"}  # differ run to run
DATA = ["--data", "builtin:pydoc", "--seq-len", "16", "--batch-size", "2"]


def _normalized(obj):
    """The JSON value without the keys that measure time or memory (they differ between runs)."""
    if isinstance(obj, dict):
        return {k: _normalized(v) for k, v in obj.items() if k not in MEASURED_KEYS}
    if isinstance(obj, list):
        return [_normalized(v) for v in obj]
    return obj


def _digest(text: str | bytes, name: str = "") -> str:
    if isinstance(text, str):
        text = text.encode()
    if name.endswith(".json") or name == "<stdout>":
        try:
            text = json.dumps(_normalized(json.loads(text)), sort_keys=True).encode()
        except ValueError:
            pass
    return hashlib.sha256(text).hexdigest()[:16]


def _folder(path: Path) -> dict[str, str]:
    return {p.name: _digest(p.read_bytes(), p.name) for p in sorted(path.iterdir()) if p.is_file()}


def _commands(family: str, src: str, root: Path) -> dict[str, list[str]]:
    gqa = family not in ("bert", "roberta", "gpt2", "gpt_neox", "opt")
    out = lambda name: str(root / f"{family}-{name}")  # noqa: E731
    cmds = {
        "info": ["info", src, "--json"],
        "score-gradient": ["score", src, *DATA, "--max-samples", "4"],
        "score-ablation": ["score", src, *DATA, "--max-samples", "4", "--method", "ablation"],
        "prune-comp": ["prune", src, *DATA, "--max-samples", "4", "--fraction", "0.25", "--compensate",
                       "--heldout-samples", "2", "--eval-data", "builtin:pydoc", "--eval-samples", "2",
                       "-o", out("prune-comp"), "--json"],
        "prune-heads": ["prune", src, "--heads", "0:1,3;2:0,2", "-o", out("prune-heads"), "--json"],
        "prune-stream": ["prune", src, "--heads", "0:1,3;2:0,2", "--streaming", "-o", out("prune-stream"), "--json"],
        "convert": ["convert-gqa", src, "--kv-heads", "1", "--merge", "mean,aligned,fit", *DATA,
                    "--max-samples", "4", "--eval-data", "builtin:pydoc", "--eval-samples", "2",
                    "-o", out("convert"), "--json"],
        "convert-stream": ["convert-gqa", src, "--kv-heads", "1", "--merge", "mean", "--streaming",
                           "-o", out("convert-stream"), "--json"],
        "eval": ["eval", src, out("prune-heads"), *DATA, "--max-samples", "2", "--json"],
        "inspect": ["inspect", src, *DATA, "--max-samples", "2", "--json"],
    }
    cmds["heal"] = ["heal", out("prune-comp"), "--teacher", src, *DATA, "--max-samples", "8", "--max-steps", "2",
                    "--eval-samples", "2", "-o", out("heal"), "--json"]
    recipe = root / f"{family}-recipe.yaml"
    recipe.write_text(f"model: {src}\ndtype: float32\nseed: 0\ndevice: cpu\n"
                      "data: {source: 'builtin:pydoc', seq_len: 16, batch_size: 2, max_samples: 4}\n"
                      "steps:\n  - score: {method: gradient}\n  - prune: {fraction: 0.25, compensate: true}\n"
                      "  - eval: {}\n")
    cmds["run"] = ["run", str(recipe), "-o", out("recipe"), "--json"]
    if gqa:
        cmds["convert-similarity"] = ["convert-gqa", src, "--kv-heads", "1", "--grouping", "similarity",
                                      "--merge", "fit", *DATA, "--max-samples", "4", "-o", out("convert-sim"),
                                      "--json"]
    return cmds


def snapshot(root: Path, families: list[str]) -> dict:
    runner = CliRunner()
    doc: dict = {}
    for family in families:
        src = save_tiny(family, root / f"src-{family}")
        for name, args in _commands(family, str(src), root).items():
            torch.manual_seed(0)
            res = runner.invoke(app, args)
            entry = {"exit_code": res.exit_code, "stdout": _digest(res.stdout, "<stdout>")}
            if res.exit_code:
                entry["stderr"] = res.stderr.strip().splitlines()[-1:] if res.stderr else []
            if "-o" in args and Path(args[args.index("-o") + 1]).is_dir():
                entry["files"] = _folder(Path(args[args.index("-o") + 1]))
            doc[f"{family}/{name}"] = entry
        print(f"{family}: {len(doc)} results", file=sys.stderr)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="snapshot JSON to write")
    ap.add_argument("--compare", help="an earlier snapshot: list every difference, exit 1 if any")
    ap.add_argument("--families", default=",".join(ALL))
    ap.add_argument("--root", default="/tmp/headtool-snapshot", help="work folder (emptied first; the same "
                    "path in both runs, since paths appear in the outputs)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    doc = snapshot(root, args.families.split(","))
    Path(args.out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"{len(doc)} results in {time.perf_counter() - t0:.0f} s -> {args.out}", file=sys.stderr)
    if args.compare:
        old = json.loads(Path(args.compare).read_text())
        diffs = [k for k in sorted(set(old) | set(doc)) if old.get(k) != doc.get(k)]
        for k in diffs:
            print(f"differs: {k}\n  before {old.get(k)}\n  after  {doc.get(k)}")
        print(f"{len(diffs)} of {len(doc)} differ", file=sys.stderr)
        sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
