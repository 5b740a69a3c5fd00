"""Reliability: every bad input gives exit 2 and one clear line, writes nothing, and never touches the input.

A table of cases, each run through the real CLI (CliRunner on headtool.cli.app; a few in real
subprocesses). For every case the input model folders are hashed before and after, and no
output folder or hidden temporary folder may appear. Also: simulated disk-full while writing,
float16 scoring, a loss that turns NaN, remote code and pickled weights never executed, and the
modeling file that prune writes reading nothing outside its folder.
"""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from headtool.cli.app import app
from tiny_models import save_tiny

runner = CliRunner()


# --------------------------------------------------------------------------- helpers
def tree_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (relative path -> digest); a file: its own digest."""
    if folder.is_file():
        return {"": hashlib.sha256(folder.read_bytes()).hexdigest()}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def strays(parent: Path, name: str) -> list[str]:
    """Hidden temporary / old folders that a write of `name` could leave beside it."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-")
                  or p.name.startswith(f".{name}.old-"))


def invoke(args: list[str], input: str | None = None):
    return runner.invoke(app, args, input=input)


def error_line(stderr: str, first: bool = True) -> str:
    """The one line that names the problem (asserts the shape of stderr).

    Bad input is caught before any work, so its line comes first; a failure while running
    (`first=False`) may follow the progress lines printed before it.
    """
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert lines, "stderr is empty"
    assert "Traceback" not in stderr
    errs = [ln for ln in lines if ln.startswith("error:")]
    assert errs, f"no 'error:' line in {stderr!r}"
    assert len(errs) == 1 and len(errs[0]) < 400, stderr
    if first:  # the error comes first (a recipe lists its problems below it)
        assert lines.index(errs[0]) <= 1 and len(lines) <= 12, stderr
    else:
        assert errs[0] == lines[-1], stderr
    return errs[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Input models shared by the cases (never modified: hashed around every case)."""
    root = tmp_path_factory.mktemp("models")
    save_tiny("llama", root / "llama")
    save_tiny("llama", root / "llama_other", seed=1)
    save_tiny("gpt2", root / "gpt2")
    save_tiny("bert", root / "bert")
    r = invoke(["score", str(root / "llama"), "--method", "magnitude", "-o", str(root / "scores.json")])
    assert r.exit_code == 0, r.stderr
    (root / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return root


@dataclass
class Env:
    base: Path   # shared input models (read-only)
    tmp: Path    # per-case scratch: broken copies live here
    out: Path    # the output folder that must not appear

    def m(self, name: str = "llama") -> str:
        return str(self.base / name)

    def copy(self, name: str = "llama") -> Path:
        dst = self.tmp / f"in_{name}"
        shutil.copytree(self.base / name, dst)
        return dst

    def scores(self, edit: Callable[[dict], object]) -> str:
        doc = json.loads((self.base / "scores.json").read_text())
        edit(doc)
        p = self.tmp / "bad_scores.json"
        p.write_text(json.dumps(doc))  # allow_nan: NaN/Infinity literals are written as they are
        return str(p)

    def file(self, name: str, data: bytes | str) -> str:
        p = self.tmp / name
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        return str(p)


def _prune(env: Env, model: str, *extra: str) -> list[str]:
    return ["prune", model, "-o", str(env.out), *extra]


# --- builders of broken inputs
def _t5_folder(env: Env) -> str:
    from transformers import AutoConfig
    d = env.tmp / "t5"
    d.mkdir()
    AutoConfig.for_model("t5", d_model=32, d_kv=8, num_heads=4, num_layers=2, d_ff=64,
                         vocab_size=100).save_pretrained(d)
    return str(d)


def _corrupt(env: Env) -> str:
    d = env.copy()
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    return str(d)


def _truncated(env: Env) -> str:
    d = env.copy()
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    return str(d)


def _missing_tensor(env: Env) -> str:
    d = env.copy()
    p = d / "model.safetensors"
    sd = load_file(p)
    key = next(k for k in sd if "layers.1." in k and "q_proj" in k)
    del sd[key]
    save_file(sd, p, metadata={"format": "pt"})
    return str(d)


def _nonuniform_missing_tensor(env: Env) -> str:
    """A headtool output with per-layer heads (built by resize, not remote code) missing a tensor."""
    d = env.tmp / "nonuniform"
    r = invoke(["prune", env.m(), "--heads", "0:0,2", "-o", str(d)])
    assert r.exit_code == 0, r.stderr
    p = d / "model.safetensors"
    sd = load_file(p)
    del sd[next(k for k in sd if "layers.1." in k and "k_proj" in k)]
    save_file(sd, p, metadata={"format": "pt"})
    return str(d)


def _bad_config_json(env: Env) -> str:
    d = env.copy()
    (d / "config.json").write_text("{not json")
    return str(d)


def _recipe(env: Env, text: str) -> str:
    return env.file("recipe.yaml", text)


def _out_exists(env: Env) -> list[str]:
    env.out.mkdir()
    (env.out / "config.json").write_text("{}")
    return _prune(env, env.m(), "--heads", "0:0,2")


def _out_under_file(env: Env) -> list[str]:
    f = env.tmp / "a_file"
    f.write_text("x")
    env.out = f / "out"
    return ["prune", env.m(), "--heads", "0:0,2", "-o", str(env.out)]


def _out_inside_input(env: Env) -> list[str]:
    env.out = env.base / "llama" / "pruned"
    return ["prune", env.m(), "--heads", "0:0,2", "-o", str(env.out)]


def _out_readonly(env: Env) -> list[str]:
    if os.geteuid() == 0:
        pytest.skip("running as root: permissions do not bind (the under-a-file case covers it)")
    ro = env.tmp / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    env.out = ro / "out"
    return ["prune", env.m(), "--heads", "0:0,2", "-o", str(env.out)]


def _quantized(env: Env) -> str:
    """A checkpoint whose config says bitsandbytes 4-bit (not installed here): transformers needs the
    package to load it, and surgery must refuse it whether or not the package is there."""
    d = env.copy()
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _quantized_recipe(env: Env) -> list[str]:
    r = env.file("q.yaml", f"model: {_quantized(env)}\noutput: {env.out}\nsteps:\n  - prune: {{heads: '0:0'}}\n")
    return ["run", r]


NON_UTF8 = b"caf\xe9 na\xefve \xff\xfe broken " * 50
JSONL = "\n".join(json.dumps({"content": "some words here " * 20}) for _ in range(4))

# (id, args builder, words the error line must contain (lower case; any of a tuple))
CASES: list[tuple[str, Callable[[Env], list[str]], tuple]] = [
    # models
    ("model-missing", lambda e: ["info", str(e.tmp / "nope")], ("not found",)),
    ("model-empty-folder", lambda e: ["info", str(e.tmp)], ("no config.json",)),
    ("model-is-a-text-file", lambda e: ["info", e.file("m.txt", "hello")], ("not a model",)),
    ("config-not-json", lambda e: ["info", _bad_config_json(e)], ("config.json",)),
    ("config-unsupported-family", lambda e: ["info", _t5_folder(e)], ("t5",)),
    ("weights-corrupt", lambda e: _prune(e, _corrupt(e), "--heads", "0:0,2"), ("weights", "safetensors")),
    ("weights-truncated", lambda e: _prune(e, _truncated(e), "--heads", "0:0,2"), ("weights", "safetensors")),
    ("weights-missing-layer", lambda e: _prune(e, _missing_tensor(e), "--heads", "0:0,2"), ("missing",)),
    # quantized: surgery is refused from the config (before the quantization package is needed); the
    # commands that only read the model say which package loading needs
    ("quantized-prune", lambda e: _prune(e, _quantized(e), "--heads", "0:0"), ("quantized checkpoint (bitsandbytes)",)),
    ("quantized-convert-gqa", lambda e: ["convert-gqa", _quantized(e), "--kv-heads", "1", "-o", str(e.out)],
     ("quantized checkpoint (bitsandbytes)",)),
    ("quantized-convert-mla", lambda e: ["convert-mla", _quantized(e), "--kv-rank", "4", "-o", str(e.out)],
     ("quantized checkpoint (bitsandbytes)",)),
    ("quantized-heal", lambda e: ["heal", _quantized(e), "--teacher", e.m(), "-o", str(e.out)],
     ("quantized checkpoint (bitsandbytes)",)),
    ("quantized-recipe", _quantized_recipe, ("quantized checkpoint (bitsandbytes)",)),
    ("quantized-info", lambda e: ["info", _quantized(e)], ("requires bitsandbytes",)),
    ("weights-missing-headtool-folder", lambda e: ["info", _nonuniform_missing_tensor(e)], ("missing",)),
    ("eval-second-model-missing", lambda e: ["eval", e.m(), str(e.tmp / "nope"), "--max-samples", "1"],
     ("not found",)),
    ("dtype-unknown", lambda e: ["info", e.m(), "--dtype", "float8"], ("--dtype",)),
    ("device-unknown", lambda e: ["info", e.m(), "--device", "tpu9"], ("--device",)),
    # score documents
    ("scores-missing", lambda e: _prune(e, e.m(), "--scores", str(e.tmp / "nope.json"), "--fraction", "0.25"),
     ("nope.json",)),
    ("scores-not-json", lambda e: _prune(e, e.m(), "--scores", e.file("s.json", "{oops"), "--fraction", "0.25"),
     ("json",)),
    ("scores-stdin-not-json", lambda e: _prune(e, e.m(), "--scores", "-", "--fraction", "0.25"), ("json",)),
    ("scores-wrong-format", lambda e: _prune(e, e.m(), "--scores", e.scores(lambda d: d.update(
        format="headtool.scores/9")), "--fraction", "0.25"), ("format",)),
    ("scores-other-model", lambda e: _prune(e, e.m("llama_other"), "--scores", str(e.base / "scores.json"),
                                            "--fraction", "0.25"), ("fingerprint", "another model")),
    ("scores-nan", lambda e: _prune(e, e.m(), "--scores", e.scores(lambda d: d["scores"][1].__setitem__(
        2, float("nan"))), "--fraction", "0.25"), ("nan", "finite")),
    ("scores-inf", lambda e: _prune(e, e.m(), "--scores", e.scores(lambda d: d["scores"][0].__setitem__(
        0, float("inf"))), "--fraction", "0.25"), ("inf", "finite")),
    ("scores-wrong-shape", lambda e: _prune(e, e.m(), "--scores", e.scores(lambda d: d["scores"].pop()),
                                            "--fraction", "0.25"), ("shape", "layers")),
    ("scores-ragged-row", lambda e: _prune(e, e.m(), "--scores", e.scores(lambda d: d["scores"][1].pop()),
                                           "--fraction", "0.25"), ("shape", "heads", "layer")),
    # targets and head lists
    ("fraction-0", lambda e: _prune(e, e.m(), "--scores", str(e.base / "scores.json"), "--fraction", "0"),
     ("--fraction",)),
    ("fraction-1.5", lambda e: _prune(e, e.m(), "--scores", str(e.base / "scores.json"), "--fraction", "1.5"),
     ("--fraction",)),
    ("num-heads-too-many", lambda e: _prune(e, e.m(), "--scores", str(e.base / "scores.json"),
                                            "--num-heads", "99"), ("--num-heads",)),
    ("min-heads-impossible", lambda e: _prune(e, e.m(), "--scores", str(e.base / "scores.json"),
                                              "--fraction", "0.5", "--min-heads-per-layer", "5"),
     ("--min-heads-per-layer", "min")),
    ("heads-not-a-number", lambda e: _prune(e, e.m(), "--heads", "3:x"), ("--heads",)),
    ("heads-layer-out-of-range", lambda e: _prune(e, e.m(), "--heads", "99:0"), ("99",)),
    ("heads-head-out-of-range", lambda e: _prune(e, e.m(), "--heads", "0:7"), ("7",)),
    ("heads-empty-list", lambda e: _prune(e, e.m(), "--heads", ";;"), ("--heads",)),
    ("heads-listed-twice", lambda e: _prune(e, e.m(), "--heads", "0:0,2;0:2"), ("listed twice",)),
    ("heads-without-layer", lambda e: _prune(e, e.m(), "--heads", "2,0:1"), ("no layer",)),
    ("inspect-heads-garbage", lambda e: ["inspect", e.m(), "--data", str(e.base / "text.txt"), "--heads", "0-1",
                                         "--plot", str(e.tmp / "png")], ("--heads",)),
    ("heads-whole-layer", lambda e: _prune(e, e.m(), "--heads", "0:0,1,2,3"), ("layer 0", "min")),
    ("heads-and-fraction", lambda e: _prune(e, e.m(), "--heads", "0:0,2", "--fraction", "0.2"), ("--heads",)),
    ("shard-size-garbage", lambda e: _prune(e, e.m(), "--heads", "0:0,2", "--shard-size", "lots"),
     ("--shard-size", "size")),
    ("threshold-nan", lambda e: _prune(e, e.m(), "--scores", str(e.base / "scores.json"), "--threshold", "nan"),
     ("--threshold",)),
    ("fraction-nan", lambda e: _prune(e, e.m(), "--scores", str(e.base / "scores.json"), "--fraction", "nan"),
     ("--fraction",)),
    ("num-heads-0", lambda e: _prune(e, e.m(), "--scores", str(e.base / "scores.json"), "--num-heads", "0"),
     ("--num-heads",)),
    ("scope-unknown", lambda e: _prune(e, e.m(), "--scores", str(e.base / "scores.json"), "--fraction", "0.25",
                                       "--scope", "x"), ("--scope",)),
    ("unit-unknown", lambda e: _prune(e, e.m(), "--scores", str(e.base / "scores.json"), "--fraction", "0.25",
                                      "--unit", "x"), ("--unit",)),
    ("heads-negative", lambda e: _prune(e, e.m(), "--heads", "0:-1"), ("--heads",)),
    ("scores-a-json-list", lambda e: _prune(e, e.m(), "--scores", e.file("l.json", "[1, 2]"), "--fraction", "0.25"),
     ("score document",)),
    ("scores-a-string-value", lambda e: _prune(e, e.m(), "--scores", e.scores(lambda d: d["scores"][0].__setitem__(
        0, "x")), "--fraction", "0.25"), ("finite",)),
    ("scores-key-missing", lambda e: _prune(e, e.m(), "--scores", e.scores(lambda d: d.pop("scores")),
                                            "--fraction", "0.25"), ("scores",)),
    ("scores-a-folder", lambda e: _prune(e, e.m(), "--scores", str(e.tmp), "--fraction", "0.25"), ("folder",)),
    ("scores-of-another-family", lambda e: _prune(e, e.m("gpt2"), "--scores", str(e.base / "scores.json"),
                                                  "--fraction", "0.25"), ("another model",)),
    ("model-hub-id-offline", lambda e: ["info", "someorg/somemodel"], ("offline",)),
    ("model-bad-gguf", lambda e: ["info", e.file("m.gguf", b"notgguf")], ("gguf",)),
    # convert-gqa
    ("kv-heads-not-dividing", lambda e: ["convert-gqa", e.m(), "--kv-heads", "3", "-o", str(e.out)],
     ("--kv-heads",)),
    ("kv-heads-zero", lambda e: ["convert-gqa", e.m(), "--kv-heads", "0", "-o", str(e.out)], ("--kv-heads",)),
    ("kv-heads-more-than-now", lambda e: ["convert-gqa", e.m(), "--kv-heads", "4", "-o", str(e.out)],
     ("--kv-heads",)),
    ("kv-heads-gpt2", lambda e: ["convert-gqa", e.m("gpt2"), "--kv-heads", "2", "-o", str(e.out)],
     ("gpt2", "kv")),
    ("kv-heads-bert", lambda e: ["convert-gqa", e.m("bert"), "--kv-heads", "2", "-o", str(e.out)],
     ("bert", "kv")),
    # convert-mla
    ("kv-rank-above-full", lambda e: ["convert-mla", e.m(), "--kv-rank", "99", "-o", str(e.out)], ("--kv-rank",)),
    ("kv-rank-zero", lambda e: ["convert-mla", e.m(), "--kv-rank", "0", "-o", str(e.out)], ("--kv-rank",)),
    ("rope-dim-odd", lambda e: ["convert-mla", e.m(), "--kv-rank", "4", "--rope-dim", "3", "-o", str(e.out)],
     ("--rope-dim",)),
    ("latent-bert", lambda e: ["convert-mla", e.m("bert"), "--kv-rank", "4", "-o", str(e.out)],
     ("bert", "not supported")),
    ("latent-gpt2-rope", lambda e: ["convert-mla", e.m("gpt2"), "--kv-rank", "4", "--rope-dim", "4", "-o",
                                    str(e.out)], ("--rope-dim 4", "no rotary embedding")),
    ("latent-no-output", lambda e: ["convert-mla", e.m(), "--kv-rank", "4"], ("-o",)),
    # data
    ("data-missing", lambda e: ["score", e.m(), "--data", str(e.tmp / "nope.txt")], ("nope.txt",)),
    ("data-empty", lambda e: ["score", e.m(), "--data", e.file("empty.txt", "")], ("empty",)),
    ("data-wrong-text-column", lambda e: ["score", e.m(), "--data", e.file("d.jsonl", JSONL),
                                          "--text-column", "body"], ("body",)),
    ("data-not-utf8", lambda e: ["score", e.m(), "--data", e.file("latin1.txt", NON_UTF8)], ("utf-8", "utf8")),
    ("data-too-short", lambda e: ["score", e.m(), "--data", e.file("short.txt", "hi there"), "--seq-len", "64"],
     ("short", "block", "tokens")),
    ("data-bad-jsonl", lambda e: ["score", e.m(), "--data", e.file("bad.jsonl", '{"text": "a"}\n{oops\n')],
     ("json",)),
    ("data-corrupt-parquet", lambda e: ["score", e.m(), "--data", e.file("bad.parquet", b"PAR1garbage")],
     ("parquet",)),
    ("data-csv-no-text-column", lambda e: ["score", e.m(), "--data", e.file("d.csv", "a,b\n1,2\n")],
     ("--text-column",)),
    ("data-label-column-missing", lambda e: ["score", e.m(), "--data", e.file("d.csv", "a,b\nx y,2\n"),
                                             "--text-column", "a", "--label-column", "zz"], ("zz",)),
    ("data-self-not-a-count", lambda e: ["score", e.m(), "--data", "self:abc"], ("self:abc",)),  # no emoji
    ("seq-len-0", lambda e: ["score", e.m(), "--seq-len", "0"], ("--seq-len",)),
    ("batch-size-0", lambda e: ["score", e.m(), "--batch-size", "0"], ("--batch-size",)),
    ("score-method-unknown", lambda e: ["score", e.m(), "--method", "bogus"], ("--method",)),
    ("score-output-folder-missing", lambda e: ["score", e.m(), "--method", "magnitude", "-o",
                                               str(e.tmp / "nodir" / "s.json")], ("does not exist",)),
    ("inspect-data-missing", lambda e: ["inspect", e.m(), "--data", str(e.tmp / "nope.txt")], ("nope.txt",)),
    ("eval-data-missing", lambda e: ["eval", e.m(), "--data", str(e.tmp / "nope.txt")], ("nope.txt",)),
    # recipes
    ("recipe-missing", lambda e: ["run", str(e.tmp / "nope.yaml")], ("nope.yaml",)),
    ("recipe-not-yaml", lambda e: ["run", _recipe(e, "model: [unclosed\nsteps: {")], ("yaml", "recipe")),
    ("recipe-several-problems", lambda e: ["run", _recipe(e, (
        f"model: {e.m()}\nbogus_key: 1\ndata: {{source: 'builtin:pydoc', seq_len: many}}\n"
        "steps:\n  - prune: {fraction: 2.0}\n  - frobnicate: {}\n"))], ("problem", "bogus_key", "recipe")),
    # output folders
    ("output-exists", _out_exists, ("--overwrite",)),
    ("output-inside-input", _out_inside_input, ("inside",)),
    ("output-under-a-file", _out_under_file, ("not a folder",)),
    ("output-not-writable", _out_readonly, ("permission",)),
    # root passes os.access there, and the write failed after the work with the temp folder's name (exit 1)
    ("output-on-proc", lambda e: ["prune", e.m(), "--heads", "0:0,2", "-o", "/proc/headtool-out"],
     ("cannot write into /proc",)),
    ("convert-output-exists", lambda e: (e.out.mkdir(), (e.out / "config.json").write_text("{}"),
                                         ["convert-gqa", e.m(), "--kv-heads", "1", "-o", str(e.out)])[-1],
     ("--overwrite",)),
    ("output-is-a-file", lambda e: (e.out.write_text("x"), _prune(e, e.m(), "--heads", "0:0,2"))[-1],
     ("not a folder",)),
    # checked with the options, before the data is read (it was refused only when writing, after calibration)
    ("convert-shard-size-garbage", lambda e: ["convert-gqa", e.m(), "--kv-heads", "1", "--data",
                                              str(e.tmp / "nope.txt"), "--shard-size", "garbage", "-o", str(e.out)],
     ("--shard-size",)),
    ("latent-shard-size-infinite", lambda e: ["convert-mla", e.m(), "--kv-rank", "4", "--data",
                                              str(e.tmp / "nope.txt"), "--shard-size", "infGB", "-o", str(e.out)],
     ("--shard-size",)),
    # reads no data: --data was accepted and ignored (by the option's source: its default is not None)
    ("convert-mean-reads-no-data", lambda e: ["convert-gqa", e.m(), "--kv-heads", "1", "--merge", "mean", "--data",
                                              "builtin:pydoc", "-o", str(e.out)], ("reads no data",)),
    ("convert-merge-unknown", lambda e: ["convert-gqa", e.m(), "--kv-heads", "1", "--merge", "bogus", "-o",
                                         str(e.out)], ("--merge",)),
    ("convert-grouping-unknown", lambda e: ["convert-gqa", e.m(), "--kv-heads", "1", "--grouping", "bogus", "-o",
                                            str(e.out)], ("--grouping",)),
    ("heal-output-is-the-input", lambda e: ["heal", e.m(), "--teacher", e.m(), "-o", e.m(), "--max-samples", "1"],
     ("inside",)),
    ("demo-output-is-a-file", lambda e: ["demo", "-o", e.file("demo.txt", "not a folder")], ("not a folder",)),
    ("heal-teacher-missing", lambda e: ["heal", e.m(), "--teacher", str(e.tmp / "nope"), "-o", str(e.out),
                                        "--max-samples", "1"], ("not found",)),
    # options that nothing reads in this combination (accepted and silently ignored before: audit)
    ("prune-refit-options-without-compensate", lambda e: _prune(e, e.m(), "--heads", "0:0,2", "--damping", "0.5",
                                                                "--anchor", "2", "--refit-layers", "all"),
     ("--refit-layers, --damping, --anchor only apply to the refit, which needs --compensate",)),
    ("prune-heldout-without-compensate", lambda e: _prune(e, e.m(), "--heads", "0:0,2", "--heldout-samples", "3",
                                                          "--heldout-data", "builtin:licenses"),
     ("--heldout-samples, --heldout-data only apply to the refit, which needs --compensate",)),
    ("prune-choose-refit-without-compensate", lambda e: _prune(e, e.m(), "--scores", str(e.base / "scores.json"),
                                                               "--fraction", "0.25", "--choose-in-layer", "refit"),
     ("--choose-in-layer refit only applies to the refit, which needs --compensate",)),
    ("prune-eval-samples-without-eval-data", lambda e: _prune(e, e.m(), "--heads", "0:0,2", "--eval-samples", "3"),
     ("--eval-samples only applies with --eval-data",)),
    ("convert-refit-options-with-mean", lambda e: ["convert-gqa", e.m(), "--kv-heads", "1", "--merge", "mean",
                                                   "--damping", "0.1", "--anchor", "2", "-o", str(e.out)],
     ("--damping, --anchor only apply to the output-projection refit, which --merge mean does not make",)),
    ("convert-anchor-with-no-refit", lambda e: ["convert-gqa", e.m(), "--kv-heads", "1", "--no-refit", "--anchor",
                                                "0", "-o", str(e.out)],
     ("--anchor only applies to the output-projection refit, which --no-refit turns off",)),
    ("convert-heldout-nothing-calibrated", lambda e: ["convert-gqa", e.m(), "--kv-heads", "1", "--merge", "mean",
                                                      "--heldout-samples", "2", "-o", str(e.out)],
     ("--heldout-samples only applies to a conversion that calibrates",)),
    ("convert-heldout-data-without-heldout-blocks", lambda e: ["convert-gqa", e.m(), "--kv-heads", "1",
                                                               "--heldout-samples", "0", "--heldout-data",
                                                               "builtin:licenses", "-o", str(e.out)],
     ("--heldout-data only applies with held-out blocks, which --heldout-samples 0 turns off",)),
    ("convert-compare-merges-on-nothing", lambda e: ["convert-gqa", e.m(), "--kv-heads", "1", "--merge", "mean,fit",
                                                     "--heldout-samples", "0", "-o", str(e.out)],
     ("--merge mean,fit: the merges are compared on held-out blocks", "--heldout-samples 0 leaves none")),
    ("latent-heldout-data-without-heldout-blocks", lambda e: ["convert-mla", e.m(), "--kv-rank", "4",
                                                              "--heldout-samples", "0", "--heldout-data",
                                                              "builtin:licenses", "-o", str(e.out)],
     ("--heldout-data only applies with held-out blocks, which --heldout-samples 0 turns off",)),
    ("convert-eval-samples-without-eval-data", lambda e: ["convert-gqa", e.m(), "--kv-heads", "1", "--eval-samples",
                                                          "2", "-o", str(e.out)],
     ("--eval-samples only applies with --eval-data",)),
    ("latent-refit-options-with-no-refit", lambda e: ["convert-mla", e.m(), "--kv-rank", "4", "--no-refit",
                                                      "--anchor", "0", "--heldout-samples", "2", "--heldout-data",
                                                      "builtin:licenses", "-o", str(e.out)],
     ("--anchor, --heldout-samples, --heldout-data only apply to the output-projection refit, which --no-refit",)),
    ("latent-eval-samples-without-eval-data", lambda e: ["convert-mla", e.m(), "--kv-rank", "4", "--eval-samples",
                                                         "2", "-o", str(e.out)],
     ("--eval-samples only applies with --eval-data",)),
]


def _id(c) -> str:
    return c.values[0] if hasattr(c, "values") else c[0]


@pytest.mark.parametrize("name,build,words", CASES, ids=[_id(c) for c in CASES])
def test_bad_input(name, build, words, base: Path, tmp_path: Path) -> None:
    env = Env(base=base, tmp=tmp_path, out=tmp_path / "out")
    before = tree_hashes(base)
    args = build(env)
    out_existed = env.out.exists()
    out_before = tree_hashes(env.out) if out_existed else None
    stdin = "{this is not json" if name == "scores-stdin-not-json" else None
    r = invoke(args, input=stdin)
    line = error_line(r.stderr)
    print(f"[{name}] {line}")
    assert r.exit_code == 2, (r.exit_code, r.stderr)
    assert any(w.lower() in line.lower() for w in words), (words, line)
    assert tree_hashes(base) == before, "an input file changed"
    if out_existed:
        assert tree_hashes(env.out) == out_before, "the existing output folder changed"
    else:
        assert not env.out.exists(), "an output folder was written"
    if env.out.parent.is_dir():
        assert strays(env.out.parent, env.out.name) == []


# commands that take no model, data or file from the user beyond an output folder
NO_BAD_INPUT_CASE: dict[str, str] = {}  # command -> why it has none (every command has one today)


def test_every_command_has_bad_input_cases(base: Path, tmp_path: Path) -> None:
    """The app's commands against the table: a command added without a bad-input case fails."""
    import typer

    commands = set(typer.main.get_command(app).commands)
    tested = set()
    for i, (name, build, _) in enumerate(CASES):
        env = Env(base=base, tmp=tmp_path / str(i), out=tmp_path / str(i) / "out")
        env.tmp.mkdir()
        try:
            tested.add(build(env)[0])
        except pytest.skip.Exception:
            continue
    assert tested <= commands, tested - commands
    assert commands - tested == set(NO_BAD_INPUT_CASE), commands - tested


@pytest.mark.parametrize("args", [
    ["info", "/no/such/model"],
    ["prune", "{llama}", "--heads", "0:x", "-o", "{out}"],
    ["convert-gqa", "{llama}", "--kv-heads", "3", "-o", "{out}"],
    ["convert-mla", "{llama}", "--kv-rank", "99", "-o", "{out}"],
], ids=["missing", "heads-malformed", "kv-heads", "kv-rank"])
def test_bad_input_subprocess(args, base: Path, tmp_path: Path) -> None:
    """The real entry point: exit 2, one 'error:' line, no traceback, nothing written."""
    args = [a.format(llama=base / "llama", out=tmp_path / "out") for a in args]
    before = tree_hashes(base / "llama")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HEADTOOL_NO_PROGRESS": "1"}
    env.pop("HEADTOOL_DEBUG", None)
    p = subprocess.run([sys.executable, "-m", "headtool", *args], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), p.stderr
    assert p.stdout == ""
    assert not (tmp_path / "out").exists() and strays(tmp_path, "out") == []
    assert tree_hashes(base / "llama") == before


def test_debug_is_taken_after_the_command_too(tmp_path: Path) -> None:
    """`headtool info X --debug` failed 'No such option: --debug' (the parser takes it only before the
    command); the README says --debug shows the traceback, wherever it is typed."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HEADTOOL_NO_PROGRESS": "1"}
    env.pop("HEADTOOL_DEBUG", None)
    p = subprocess.run([sys.executable, "-m", "headtool", "info", str(tmp_path / "nope"), "--debug"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" in p.stderr and "error: model not found" in p.stderr, p.stderr


def test_debug_moves_before_the_command_but_not_past_a_double_dash() -> None:
    from headtool.cli.app import debug_first

    assert debug_first(["h", "info", "x", "--debug"]) == ["h", "--debug", "info", "x"]
    assert debug_first(["h", "--debug", "info", "x"]) == ["h", "--debug", "info", "x"]
    assert debug_first(["h", "run", "r.yaml", "--", "--debug"]) == ["h", "run", "r.yaml", "--", "--debug"]


# --------------------------------------------------------------------------- disk full
def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["safetensors", "config", "rename"])
def test_disk_full_while_writing(where: str, base: Path, tmp_path: Path, monkeypatch) -> None:
    """No space left: exit 1 (a failure while running, the input was fine), one clear line, nothing left."""
    import transformers.modeling_utils as mu

    import headtool.io.output as ck

    if where == "safetensors":
        monkeypatch.setattr(mu, "safe_save_file", _enospc)
    elif where == "config":
        monkeypatch.setattr(ck, "_copy_inputs", _enospc)
    else:
        monkeypatch.setattr(ck.os, "replace", _enospc)
    before = tree_hashes(base / "llama")
    out = tmp_path / "out"
    r = invoke(["prune", str(base / "llama"), "--heads", "0:0,2", "-o", str(out)])
    line = error_line(r.stderr, first=False)
    assert r.exit_code == 1, r.stderr
    assert "no space left" in line.lower(), line
    assert "internal error" not in line
    assert not out.exists() and strays(tmp_path, "out") == []
    assert tree_hashes(base / "llama") == before


def test_disk_full_writing_scores(base: Path, tmp_path: Path, monkeypatch) -> None:
    """The score document is written atomically too: a failed write leaves no file."""
    import headtool.io.files as files

    monkeypatch.setattr(files.os, "replace", _enospc)
    out = tmp_path / "s.json"
    r = invoke(["score", str(base / "llama"), "--method", "magnitude", "-o", str(out)])
    line = error_line(r.stderr, first=False)
    assert r.exit_code == 1 and "no space left" in line.lower(), r.stderr
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- numerical faults
def _score_doc(model: str, *extra: str) -> dict:
    r = invoke(["score", model, "--data", "builtin:pydoc", "--max-samples", "4", "--seq-len", "16",
                "--batch-size", "2", *extra])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_float16_scoring_accumulates_in_float32(base: Path) -> None:
    d32 = _score_doc(str(base / "llama"), "--dtype", "float32")
    d16 = _score_doc(str(base / "llama"), "--dtype", "float16")
    a = torch.tensor(d32["raw_scores"], dtype=torch.float64)
    b = torch.tensor(d16["raw_scores"], dtype=torch.float64)
    assert torch.isfinite(b).all() and math.isfinite(d16["baseline_loss"])
    assert abs(d16["baseline_loss"] - d32["baseline_loss"]) < 0.05 * abs(d32["baseline_loss"])
    assert ((a - b).abs().max() / a.abs().max()).item() < 0.05


def test_nan_loss_stops_scoring(base: Path, tmp_path: Path) -> None:
    """A weight set to NaN: `headtool score` stops naming the batch, exit 1, no document written."""
    d = tmp_path / "nanmodel"
    shutil.copytree(base / "llama", d)
    p = d / "model.safetensors"
    sd = load_file(p)
    key = next(k for k in sd if "layers.1." in k and "o_proj" in k)
    sd[key][0, 0] = float("nan")
    save_file(sd, p, metadata={"format": "pt"})
    out = tmp_path / "s.json"
    r = invoke(["score", str(d), "--data", "builtin:pydoc", "--max-samples", "4", "--seq-len", "16",
                "--batch-size", "2", "-o", str(out)])
    line = error_line(r.stderr, first=False)
    assert r.exit_code == 1, r.stderr
    assert "batch" in line.lower() and re.search(r"nan|inf|finite", line.lower()), line
    assert not out.exists() and r.stdout.strip() == ""


# --------------------------------------------------------------------------- safety
def test_remote_code_refused_and_not_run(base: Path, tmp_path: Path) -> None:
    d = tmp_path / "remote"
    shutil.copytree(base / "llama", d)
    marker = tmp_path / "REMOTE_CODE_RAN"
    (d / "modeling_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaForCausalLM\n"
        "class EvilForCausalLM(LlamaForCausalLM):\n    pass\n")
    (d / "configuration_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'llama'\n")
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                       "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (d / "config.json").write_text(json.dumps(cfg))
    for args in (["info", str(d)], ["prune", str(d), "--heads", "0:0,2", "-o", str(tmp_path / "out")]):
        r = invoke(args)
        line = error_line(r.stderr)
        assert r.exit_code == 2, r.stderr
        assert "--trust-remote-code" in line, line
        assert not marker.exists(), "remote code ran without --trust-remote-code"
    assert not (tmp_path / "out").exists()


class _Evil:
    """Unpickling this runs a function: a safe (weights_only) loader must refuse it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_malicious_pickle_bin_not_executed(base: Path, tmp_path: Path) -> None:
    d = tmp_path / "pickled"
    shutil.copytree(base / "llama", d)
    sd = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    marker = tmp_path / "PICKLE_RAN"
    payload = {**sd, "evil": _Evil(str(marker))}
    torch.save(payload, d / "pytorch_model.bin", pickle_protocol=pickle.HIGHEST_PROTOCOL)
    assert not marker.exists()
    before = tree_hashes(d)
    r = invoke(["info", str(d)])
    line = error_line(r.stderr)
    assert r.exit_code == 2, r.stderr
    assert not marker.exists(), "a pickle in pytorch_model.bin was executed"
    assert "weights" in line.lower() or "pickle" in line.lower() or "weights_only" in line.lower(), line
    assert tree_hashes(d) == before


def test_plain_pickle_bin_still_loads_safely(base: Path, tmp_path: Path) -> None:
    """A .bin of plain tensors loads (through weights_only) and gives the same model."""
    d = tmp_path / "binmodel"
    shutil.copytree(base / "llama", d)
    sd = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    torch.save(sd, d / "pytorch_model.bin")
    a = invoke(["info", str(d), "--json"])
    b = invoke(["info", str(base / "llama"), "--json"])
    assert a.exit_code == 0, a.stderr
    assert json.loads(a.stdout)["params"] == json.loads(b.stdout)["params"]


FORBIDDEN = ("open(", "urllib", "requests", "subprocess", "os.system", "__import__", "socket", "http",
             "eval(", "exec(", "importlib", "pickle", "torch.load", "Path(", "os.environ", "shutil",
             "glob", "listdir", "sys.path", "compile(", "getattr(__builtins__")


def _modeling_sources() -> dict[str, str]:
    from headtool.templates import modeling_file_source

    src = Path(__file__).parents[1] / "src" / "headtool" / "templates" / "modeling_headtool.py"
    return {"template": src.read_text(),
            "rendered": modeling_file_source({"HeadtoolLlamaForCausalLM": "LlamaForCausalLM"})}


def test_modeling_file_reads_nothing_outside_its_folder() -> None:
    for which, text in _modeling_sources().items():
        code = "\n".join(ln.split("#", 1)[0] for ln in text.splitlines())  # comments do not run
        found = [w for w in FORBIDDEN if w in code]
        assert not found, f"{which} modeling file contains {found}"
        imports = {m.group(1).split(".")[0] for m in re.finditer(r"^\s*(?:from|import)\s+([\w.]+)", code, re.M)}
        # sys: only sys.modules, the family's modeling module that built the model (sys.path is forbidden above)
        assert imports <= {"__future__", "torch", "transformers", "typing", "math", "dataclasses",
                           "collections", "functools", "copy", "itertools", "sys"}, imports
        assert not re.search(r"sys\.(?!modules\b)", code), f"{which} modeling file uses sys beyond sys.modules"


def test_written_modeling_file_matches_template(base: Path, tmp_path: Path) -> None:
    """The file prune copies into a non-uniform output is the checked one, nothing added."""
    out = tmp_path / "nonuniform"
    r = invoke(["prune", str(base / "llama"), "--heads", "0:0,2", "-o", str(out)])
    assert r.exit_code == 0, r.stderr
    written = (out / "modeling_headtool.py")
    assert written.exists(), sorted(p.name for p in out.iterdir())
    code = "\n".join(ln.split("#", 1)[0] for ln in written.read_text().splitlines())
    assert not [w for w in FORBIDDEN if w in code]


def test_library_surgery_refuses_a_quantized_model_in_memory() -> None:
    """The library's surgery entry points (not only the CLI's loading) refuse a model whose config
    says quantized: with the package installed it would load, and slicing would drop its scales."""
    from headtool.errors import UsageError
    from headtool.model.loading import model_from_object
    from headtool.surgery.pruning import prune
    from headtool.surgery.selection import Selection
    from tiny_models import tiny_model

    model = tiny_model("llama")
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    lm = model_from_object(model)
    with pytest.raises(UsageError, match=r"quantized checkpoint \(gptq\)"):
        prune(lm, Selection.from_kept(lm.geometry, [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3]]))
