"""The recipe step `convert_mla`: the same request and code as `headtool convert-mla`, so the same
bytes on disk; it runs after score and prune and before eval; head surgery after it is refused."""
from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from tiny_models import save_tiny

from headtool.cli.app import app
from headtool.model.loading import load_model

runner = CliRunner()
DATA = "{source: 'builtin:pydoc', seq_len: 16, batch_size: 2, max_samples: 4}"


def _recipe(tmp_path, model, steps: str, name: str = "r.yaml"):
    path = tmp_path / name
    path.write_text(f"model: {model}\nseed: 0\ndata: {DATA}\nsteps:\n{steps}")
    return path


def test_a_recipe_prunes_layers_unevenly_then_converts_to_latent_attention(tmp_path):
    """prune (different query heads per layer, in memory) -> convert_mla: each latent layer keeps
    its own heads; the folder reloads with them."""
    from transformers import AutoModelForCausalLM

    src = save_tiny("llama", tmp_path / "src")
    steps = ("  - prune: {heads: '0:0,2;2:1,3'}\n"
             "  - convert_mla: {kv_rank: 5, rope_dim: 4}\n")
    r = runner.invoke(app, ["run", str(_recipe(tmp_path, src, steps)), "-o", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.stderr
    rows = json.loads(r.stdout)["steps"]
    assert [x["step"] for x in rows] == ["load", "prune", "convert_mla"] and rows[2]["heads"] == 8
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert [m.num_heads for m in model.modules() if type(m).__name__ == "LatentAttention"] == [2, 4, 2]
    assert model.config.headtool_mla["num_heads"] == [2, 4, 2]


def test_cli_and_recipe_step_write_byte_identical_safetensors(tmp_path):
    src = save_tiny("llama", tmp_path / "src")
    r = runner.invoke(app, ["convert-mla", str(src), "--kv-rank", "6", "--rope-dim", "4", "--data", "builtin:pydoc",
                            "--max-samples", "4", "--seq-len", "16", "--batch-size", "2", "--heldout-samples", "2",
                            "-o", str(tmp_path / "cli")])
    assert r.exit_code == 0, r.stderr
    recipe = _recipe(tmp_path, src, "  - convert_mla: {kv_rank: 6, rope_dim: 4, heldout_samples: 2}\n")
    r = runner.invoke(app, ["run", str(recipe), "-o", str(tmp_path / "recipe"), "--json"])
    assert r.exit_code == 0, r.stderr
    a = (tmp_path / "cli" / "model.safetensors").read_bytes()
    b = (tmp_path / "recipe" / "model.safetensors").read_bytes()
    assert a == b
    row = json.loads(r.stdout)["steps"][1]
    assert row["step"] == "convert_mla" and row["data"] == "builtin:pydoc" and row["calibration_blocks"] == 4
    # as `headtool info` gives it (a number when every layer has it), as the eval rows after it do
    assert row["kv_rank"] == 6 and row["rope_dim"] == 4 and row["kv_cache_bytes_per_token"] == 3 * 10 * 4
    meta = json.loads((tmp_path / "recipe" / "headtool.json").read_text())
    assert meta["kv_rank"] == [6, 6, 6] and meta["rope_dim"] == 4
    assert "latent attention" in (tmp_path / "recipe" / "README.md").read_text()


def test_recipe_score_prune_convert_mla_eval(tmp_path):
    src = save_tiny("llama", tmp_path / "src")
    steps = ("  - score: {method: gradient}\n"
             "  - prune: {fraction: 0.5, scope: layer}\n"
             "  - convert_mla: {kv_rank: 5, rope_dim: 4, eval_data: 'builtin:pydoc', eval_samples: 2}\n"
             "  - eval: {data: {skip_samples: 40, max_samples: 4}}\n")
    r = runner.invoke(app, ["run", str(_recipe(tmp_path, src, steps)), "-o", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.stderr
    rows = json.loads(r.stdout)["steps"]
    assert [x["step"] for x in rows] == ["load", "score", "prune", "convert_mla", "eval"]
    assert rows[2]["heads"] == 6 and rows[3]["heads"] == 6  # half the query heads, then latent attention
    assert rows[3]["loss_after"] > 0 and rows[3]["eval_data"] == "builtin:pydoc"
    assert rows[4]["kv_rank"] == 5 and rows[4]["kv_cache_bytes_per_token"] == 3 * (5 + 4) * 4
    assert {k: rows[3][k] for k in ("kv_rank", "rope_dim", "kv_cache_bytes_per_token")} == \
        {k: rows[4][k] for k in ("kv_rank", "rope_dim", "kv_cache_bytes_per_token")}
    assert "latent 5+4" in r.stderr
    out = load_model(str(tmp_path / "out"), dtype="float32", device="cpu")
    assert out.model.config.headtool_mla["kv_rank"] == [5, 5, 5]
    with torch.no_grad():
        logits = out.model(input_ids=torch.randint(5, 300, (1, 12))).logits
    assert torch.isfinite(logits).all()


def test_head_surgery_after_convert_mla_and_bad_ranks_are_refused_before_running(tmp_path):
    """The step order is the validator's (found before the model loads, by --check too); a rank
    this model cannot take is found once the model is loaded, before any step runs."""
    src = save_tiny("llama", tmp_path / "src")
    steps = ("  - convert_mla: {kv_rank: 99, rope_dim: 4}\n"
             "  - prune: {fraction: 0.25}\n")
    recipe = _recipe(tmp_path, src, steps)
    for extra in (["--check"], []):
        r = runner.invoke(app, ["run", str(recipe), "-o", str(tmp_path / "out"), *extra])
        assert r.exit_code == 2 and "1 problem(s)" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert f"{recipe}:6:" in r.stderr and "steps.1: prune after convert_mla is not supported" in r.stderr
    recipe = _recipe(tmp_path, src, "  - convert_mla: {kv_rank: 99, rope_dim: 4}\n  - eval: {}\n")
    r = runner.invoke(app, ["run", str(recipe), "-o", str(tmp_path / "out")])
    assert r.exit_code == 2 and "--kv-rank 99" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_summary_kv_column_names_a_uniform_latent_once():
    """The run summary showed `latent 120..120+72` for the per-layer ranks of a uniform budget."""
    from headtool.cli.commands.run import _kv

    assert _kv({"kv_rank": [120] * 30, "rope_dim": 72}) == "latent 120+72"
    assert _kv({"kv_rank": [96, 120, 144], "rope_dim": 72}) == "latent 96..144+72"
    assert _kv({"kv_rank": 80, "rope_dim": 48}) == "latent 80+48"
    assert _kv({"kv_rank": None, "kv_heads": 3}) == "3"
