"""`headtool score` on the real packaged models, CI-sized (few tokens)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import needs_minilm, needs_smollm2
from headtool.cli.app import app

pytestmark = pytest.mark.realmodel
runner = CliRunner()


@needs_smollm2
def test_score_smollm2_on_pydoc(tmp_path):
    out = tmp_path / "s.json"
    res = runner.invoke(app, ["score", "smollm2-135m", "--data", "builtin:pydoc", "--max-samples", "2",
                              "--seq-len", "32", "--dtype", "float32", "-o", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["model"]["family"] == "llama" and doc["objective"] == "lm"
    assert [len(r) for r in doc["scores"]] == [9] * 30 and [len(r) for r in doc["kv_group_scores"]] == [3] * 30
    assert 0 < doc["baseline_loss"] < 10 and all(v > 0 for r in doc["raw_scores"] for v in r)


@needs_minilm
def test_score_minilm_kl_headless():
    res = runner.invoke(app, ["score", "all-minilm-l6-v2", "--objective", "kl", "--max-samples", "2",
                              "--seq-len", "16"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["objective"] == "kl" and doc["estimator"] == "fisher" and doc["model"]["family"] == "bert"
    assert [len(r) for r in doc["scores"]] == [12] * 6
    assert all(v > 0 for r in doc["raw_scores"] for v in r)
    assert "Fisher" in res.stderr
