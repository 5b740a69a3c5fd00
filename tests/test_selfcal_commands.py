"""`--data self` and mixtures through the commands and recipes: the same blocks either way, sampled
from the original model even after a recipe's steps changed it."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from headtool.cli import app
from tiny_models import save_tiny

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_prune_compensate_on_self_text_and_the_recipe_step_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / "cache"))
    src = save_tiny("llama", tmp_path / "src")
    cli = _run("prune", src, "--data", "self", "--max-samples", 6, "--seq-len", 16, "--batch-size", 2, "--fraction", 0.25,
               "--compensate", "--heldout-samples", 2, "-o", tmp_path / "cli", "--json")
    assert cli.exit_code == 0, cli.stderr
    doc = json.loads(cli.stdout)
    assert doc["options"]["calibration_data"]["source"] == "self"
    cached = list((tmp_path / "cache" / "selfcal").glob("*.json"))
    assert len(cached) == 1  # generated once; the held-out blocks extend the same cache entry

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\ndtype: float32\n"
                      "data: {source: self, seq_len: 16, batch_size: 2, max_samples: 6}\n"
                      "steps:\n  - prune: {fraction: 0.25, compensate: true, heldout_samples: 2}\n")
    res = _run("run", recipe, "-o", tmp_path / "rec", "--json")
    assert res.exit_code == 0, res.stderr
    a = (tmp_path / "cli" / "model.safetensors").read_bytes()
    b = (tmp_path / "rec" / "model.safetensors").read_bytes()
    assert a == b  # one request, one code path: the same blocks, the same refit, the same bytes


def test_a_recipe_samples_self_text_from_the_original_model(tmp_path, monkeypatch):
    """After a prune step the model in memory is smaller; `self` text for the next step still comes
    from the model the recipe loaded (the cache key is its fingerprint)."""
    monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / "cache"))
    src = save_tiny("llama", tmp_path / "src")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\ndtype: float32\n"
                      "data: {source: 'builtin:pydoc+self', seq_len: 16, batch_size: 2, max_samples: 6}\n"
                      "steps:\n  - prune: {heads: '0:0,2;1:1,3'}\n  - convert_gqa: {kv_heads: 1, merge: fit}\n")
    res = _run("run", recipe, "-o", tmp_path / "out", "--json")
    assert res.exit_code == 0, res.stderr
    # the cached self text is what the untouched model samples, not what the pruned one would
    import torch

    from headtool.data.selfgen import self_blocks
    from headtool.model.loading import load_model

    lm = load_model(str(src), dtype="float32")
    cached = self_blocks(lm, lm.tokenizer, 3, 16)
    fresh = self_blocks(lm, lm.tokenizer, 3, 16, cache=False)
    assert cached.generated == 0 and torch.equal(cached.ids, fresh.ids)


def test_self_data_on_an_encoder_is_one_clear_line(tmp_path):
    src = save_tiny("bert", tmp_path / "enc")
    res = _run("score", src, "--data", "self:2", "--seq-len", 16)
    assert res.exit_code == 2
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--data self samples text from a causal language model" in errors[0], res.stderr
    assert "Traceback" not in res.output
