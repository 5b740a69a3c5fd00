"""User mistakes on the command line: one line on stderr, exit 2, no traceback, nothing written."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from headtool.cli.app import app
from tiny_models import save_tiny

runner = CliRunner()


def _refused(args: list[str]) -> str:
    res = runner.invoke(app, args)
    err = res.stderr if hasattr(res, "stderr") else res.output
    assert res.exit_code == 2, (res.exit_code, res.output, repr(res.exception))
    assert "Traceback" not in err and "internal error" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("family, limit", [("gpt2", 128), ("bert", 128), ("roberta", 128)])
def test_a_seq_len_past_learned_positions_is_a_usage_error(tmp_path, family, limit):
    """--seq-len longer than a model's learned position table (GPT-2, OPT, BERT; RoBERTa's starts after
    the padding index) failed inside the model: 'internal error: IndexError: index out of range in
    self ... please report it' (exit 1), or a tensor size mismatch for BERT. The tokenizer's maximum
    length caught it only where the tokenizer states one (OPT's does not)."""
    model = save_tiny(family, tmp_path / "m")
    out = tmp_path / "out"
    for cmd in (["eval", str(model)], ["score", str(model)], ["prune", str(model), "--fraction", "0.2", "-o", str(out)]):
        line = _refused([*cmd, "--data", "builtin:pydoc", "--max-samples", "1", "--seq-len", str(limit + 1)])
        assert line == (f"error: --seq-len {limit + 1} is longer than the model's {limit} positions "
                        f"(max_position_embeddings); use --seq-len {limit} or less"), line
    assert not out.exists()
    res = runner.invoke(app, ["eval", str(model), "--data", "builtin:pydoc", "--max-samples", "1",
                              "--seq-len", str(limit)])
    assert res.exit_code == 0, res.output


def test_a_folder_given_as_a_recipe_is_named_a_folder(tmp_path):
    """`headtool run some-folder` said 'recipe not found: some-folder' of a folder that is there."""
    (tmp_path / "recipes").mkdir()
    for extra in ([], ["--check"]):
        line = _refused(["run", str(tmp_path / "recipes"), *extra])
        assert line == (f"error: {tmp_path / 'recipes'} is a folder, not a recipe; give a recipe YAML file "
                        "(e.g. recipes/demo.yaml)"), line
    assert _refused(["run", str(tmp_path / "nope.yaml")]) == f"error: recipe not found: {tmp_path / 'nope.yaml'}"


def _prune_json(args: list[str]) -> dict:
    import json

    res = runner.invoke(app, ["prune", *args, "--dry-run", "--json"])
    assert res.exit_code == 0, (res.output, repr(res.exception))
    return json.loads(res.stdout)


def test_prune_scores_with_a_data_free_method_without_data(tmp_path):
    """`prune m --fraction 0.2 --method magnitude` (or random), which read no data, failed with 'internal
    error: AttributeError: 'NoneType' object has no attribute 'seed''; with --data it ran. --seed still
    draws --method random's scores."""
    model = save_tiny("qwen2", tmp_path / "m")
    doc = _prune_json([str(model), "--fraction", "0.2", "--method", "magnitude"])
    assert doc["heads_removed"] == 2 and doc["scores"]["method"] == "magnitude"
    drawn = {seed: _prune_json([str(model), "--fraction", "0.3", "--method", "random", "--seed", seed])["kept_heads"]
             for seed in ("0", "7")}
    assert drawn["0"] != drawn["7"]
    assert _prune_json([str(model), "--fraction", "0.3", "--method", "random", "--seed", "7"])["kept_heads"] == drawn["7"]


def test_prune_method_with_scores_or_heads_is_refused(tmp_path):
    """--method picks how prune scores the heads itself; with --scores or --heads nothing scores and it was
    silently ignored (`--scores s.json --method ablation` pruned by the document's gradient scores)."""
    model = save_tiny("qwen2", tmp_path / "m")
    scores = tmp_path / "s.json"
    res = runner.invoke(app, ["score", str(model), "--method", "magnitude", "-o", str(scores)])
    assert res.exit_code == 0, res.output
    for given in (["--scores", str(scores), "--fraction", "0.2"], ["--heads", "1:0,2"]):
        line = _refused(["prune", str(model), *given, "--method", "ablation", "--dry-run"])
        assert line == "error: --method only applies when prune scores the heads itself (no --scores or --heads)"
    assert _prune_json([str(model), "--scores", str(scores), "--fraction", "0.2"])["heads_removed"] == 2


def test_score_ablation_batch_needs_the_ablation_method(tmp_path):
    """--ablation-batch sizes the batched ablation passes; with any other --method (gradient by default)
    it was silently ignored."""
    model = save_tiny("qwen2", tmp_path / "m")
    base = ["score", str(model), "--data", "builtin:pydoc", "--max-samples", "2", "--seq-len", "16"]
    for method in ([], ["--method", "taylor"]):
        assert _refused([*base, *method, "--ablation-batch", "3"]) == \
            "error: --ablation-batch only applies with --method ablation"
    res = runner.invoke(app, [*base, "--method", "ablation", "--ablation-batch", "3"])
    assert res.exit_code == 0, res.output
