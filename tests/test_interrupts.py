"""Interrupted writes: SIGINT / SIGKILL at several moments leave the output complete or absent.

`headtool prune` and `headtool convert-gqa` run in real subprocesses on a small model written
in many small shards (so that the write takes long enough to be hit). A signal is sent as soon
as the hidden temporary folder appears, once it holds a few shards, or after a fixed delay.
Afterwards the output folder is either complete (config.json, headtool.json, every shard of the
index, loads with from_pretrained) or absent; after SIGINT no temporary folder remains; after
SIGKILL one may remain, but it is hidden (`.out.tmp-*`) and never has the output's name. The
input's files are byte-identical in every case.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_reliability import strays, tree_hashes
from tiny_models import save_tiny

LAYERS = 6
PRUNE_HEADS = ";".join(f"{i}:0,2" for i in range(LAYERS))  # uniform: a standard config


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """~10 MB of fp32 weights: with --shard-size 200KB the write produces dozens of shards."""
    d = tmp_path_factory.mktemp("interrupt") / "llama"
    save_tiny("llama", d, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS)
    return d


def _env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HEADTOOL_NO_PROGRESS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("HEADTOOL_DEBUG", None)
    return env


def _temp_folders(parent: Path, name: str) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-")]


def _run_and_signal(args: list[str], out: Path, sig: int, when: str) -> tuple[int, str, bool]:
    """Start headtool, send `sig` at `when`; (return code, stderr, whether the signal hit a running write)."""
    p = subprocess.Popen([sys.executable, "-m", "headtool", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env=_env())
    hit_write = False
    try:
        start = time.monotonic()
        while p.poll() is None and time.monotonic() - start < 90:
            tmps = _temp_folders(out.parent, out.name)
            if when.startswith("delay:"):
                if time.monotonic() - start >= float(when[6:]):
                    break
            elif tmps and (when == "tmp" or sum(1 for _ in tmps[0].glob("*.safetensors")) >= 3):
                break
            time.sleep(0.002)
        if p.poll() is None:
            hit_write = bool(_temp_folders(out.parent, out.name))
            p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, err.decode(errors="replace"), hit_write


def _assert_complete_or_absent(out: Path) -> str:
    if not out.exists():
        return "absent"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "headtool.json"} <= names, names
    index = out / "model.safetensors.index.json"
    if index.exists():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        assert shards <= names, shards - names
    else:
        assert "model.safetensors" in names
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(out)  # loads whole: every tensor present
    assert m.config.num_attention_heads == 2
    return "complete"


MOMENTS = [(signal.SIGINT, "tmp"), (signal.SIGKILL, "tmp"), (signal.SIGINT, "shards"),
           (signal.SIGKILL, "shards"), (signal.SIGINT, "delay:1.0")]


@pytest.mark.parametrize("sig,when", MOMENTS, ids=[f"{s.name}-{w}" for s, w in MOMENTS])
def test_prune_interrupted(sig, when, model: Path, tmp_path: Path) -> None:
    before = tree_hashes(model)
    out = tmp_path / "out"
    rc, err, hit = _run_and_signal(["prune", str(model), "--heads", PRUNE_HEADS, "--shard-size", "200KB",
                                    "-o", str(out)], out, sig, when)
    state = _assert_complete_or_absent(out)
    left = strays(tmp_path, "out")
    if sig == signal.SIGINT:
        assert left == [], left
        if hit:  # caught inside the command: the clean exit path (or the rename won the race: complete)
            assert rc in (0, 130), (rc, err)
            assert "Traceback" not in err
    else:
        assert all(n.startswith(".out.tmp-") for n in left), left
    assert tree_hashes(model) == before
    print(f"{sig.name} at {when}: rc={rc} hit_write={hit} output={state} strays={left}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_convert_gqa_interrupted(sig, model: Path, tmp_path: Path) -> None:
    before = tree_hashes(model)
    out = tmp_path / "out"
    rc, err, hit = _run_and_signal(["convert-gqa", str(model), "--kv-heads", "1", "--merge", "mean",
                                    "--no-refit", "--shard-size", "200KB", "-o", str(out)], out, sig, "tmp")
    if out.exists():
        names = {p.name for p in out.iterdir()}
        assert {"config.json", "headtool.json"} <= names
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(out).config.num_key_value_heads == 1
    left = strays(tmp_path, "out")
    if sig == signal.SIGINT:
        assert left == [], left
        if hit:
            assert rc in (0, 130) and "Traceback" not in err, (rc, err)
    else:
        assert all(n.startswith(".out.tmp-") for n in left), left
    assert tree_hashes(model) == before
    print(f"convert-gqa {sig.name}: rc={rc} hit_write={hit} output={'complete' if out.exists() else 'absent'}")


def test_uninterrupted_run_completes(model: Path, tmp_path: Path) -> None:
    """The control: the same command, not interrupted, writes a complete folder of many shards."""
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "headtool", "prune", str(model), "--heads", PRUNE_HEADS,
                        "--shard-size", "200KB", "-o", str(out)], capture_output=True, text=True, env=_env(),
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert _assert_complete_or_absent(out) == "complete"
    assert len(list(out.glob("*.safetensors"))) >= 3
    assert strays(tmp_path, "out") == []
