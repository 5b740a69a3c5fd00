"""Every shipped recipe runs (on tiny models substituted through --set) and writes a loadable model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from headtool.cli import app
from headtool.loading import load_model
from tiny_models import save_tiny, tiny_model, tokenizer_for

runner = CliRunner()
RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe-models")
    dec = save_tiny("llama", root / "llama")
    enc = root / "minilm-like"
    tiny_model("bert").bert.save_pretrained(enc)  # headless, like all-MiniLM-L6-v2
    tokenizer_for("bert").save_pretrained(enc)
    return {"decoder": dec, "encoder": enc}


def test_recipes_are_shipped():
    names = {p.stem for p in RECIPES}
    assert {"demo", "encoder-kl-prune", "prune-gqa-compensated", "gqa-aligned-merge"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_shipped_recipe_runs(recipe, tiny_folders, tmp_path):
    text = recipe.read_text()
    model = tiny_folders["encoder" if "minilm" in text else "decoder"]
    out = tmp_path / "out"
    args = ["run", str(recipe), "--set", f"model={model}", "--set", "data.max_samples=4",
            "--set", "data.seq_len=16", "--set", "data.batch_size=2", "-o", str(out), "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert [r["step"] for r in summary["steps"]][0] == "load"
    assert len(summary["steps"]) == 1 + len(summary["recipe"]["steps"])
    meta = json.loads((out / "headtool.json").read_text())
    assert meta["recipe"]["model"] == str(model)  # the resolved recipe is saved
    assert "Recipe:" in (out / "README.md").read_text()
    reloaded = load_model(str(out))
    ids = torch.randint(5, 300, (1, 12))
    with torch.no_grad():
        assert torch.isfinite(reloaded.model(input_ids=ids)[0]).all()
    last = summary["steps"][-1]
    assert last["heads"] <= summary["steps"][0]["heads"]


def test_check_only_and_all_problems_at_once(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: ./nope\nsteps:\n  - prune: {fraction: 2}\n  - convert_gqa: {}\n")
    res = runner.invoke(app, ["run", str(bad), "--check"])
    assert res.exit_code == 2
    assert "3 problem(s)" in res.stderr and f"{bad}:3:" in res.stderr and "Traceback" not in res.stderr


def test_impossible_targets_are_found_before_running(tiny_folders, tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text(f"model: {tiny_folders['decoder']}\nsteps:\n  - convert_gqa: {{kv_heads: 3}}\n"
                 "  - prune: {num_heads: 99}\n")
    res = runner.invoke(app, ["run", str(r), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert "2 problem(s)" in res.stderr and not (tmp_path / "o").exists()


def test_recipe_with_a_heal_step(tiny_folders, tmp_path):
    r = tmp_path / "heal.yaml"
    r.write_text(f"model: {tiny_folders['decoder']}\ndtype: float32\nseed: 0\n"
                 "data: {source: 'builtin:pydoc', seq_len: 16, batch_size: 2, max_samples: 8}\n"
                 "steps:\n  - prune: {heads: '0:0,2;1:1,3'}\n  - heal: {max_steps: 4, num_tokens: 256}\n"
                 "  - eval: {data: {skip_samples: 40, max_samples: 4}}\n")
    res = runner.invoke(app, ["run", str(r), "-o", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    steps = json.loads(res.stdout)["steps"]
    assert [s["step"] for s in steps] == ["load", "prune", "heal", "eval"]
    assert steps[2]["steps"] == 4 and steps[1]["heads"] == 8
    assert (tmp_path / "out" / "headtool.json").exists()
