"""KV-cache figures of `info`, `eval` and `eval --speed`: the same answer in every command."""
from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoModelForMaskedLM
from typer.testing import CliRunner

from headtool.arch import adapter_for
from headtool.arch.families import BERT
from headtool.cli.app import app
from headtool.model.info import model_info
from tiny_models import save_tiny, tiny_model

runner = CliRunner()


@pytest.fixture()
def pydoc_text(tmp_path):
    import pydoc_data.topics as t

    p = tmp_path / "text.txt"
    p.write_text("\n\n".join(list(t.topics.values())[:40]))
    return p


@pytest.mark.parametrize("model_type", BERT.model_types)
def test_every_encoder_family_keeps_no_kv_cache(model_type):
    """info said 768 B per token for bert while eval --speed said n/a: an encoder has no KV cache."""
    cfg = AutoConfig.for_model(model_type, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, vocab_size=100, max_position_embeddings=64,
                               **({"embedding_size": 32} if model_type == "electra" else {}))
    model = AutoModelForMaskedLM.from_config(cfg)
    info = model_info(model, adapter_for(cfg))
    assert info["kv_cache_bytes_per_token"] is None and info["kv_cache_bytes_per_token_per_layer"] is None


def test_a_decoder_bert_keeps_a_cache():
    """BERT configured as a decoder (BertLMHeadModel) does cache its keys and values."""
    model = tiny_model("llama")
    assert model_info(model, adapter_for(model.config))["kv_cache_bytes_per_token"] == 3 * 2 * 2 * 8 * 4
    cfg = AutoConfig.for_model("bert", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, vocab_size=100, is_decoder=True)
    from transformers import BertLMHeadModel

    assert model_info(BertLMHeadModel(cfg), BERT)["kv_cache_bytes_per_token"] == 2 * 2 * 32 * 4


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_info_and_eval_say_n_a_for_an_encoder_as_speed_does(family, tmp_path, pydoc_text):
    folder = save_tiny(family, tmp_path / family)
    res = runner.invoke(app, ["info", str(folder), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["kv_cache_bytes_per_token"] is None
    assert "n/a" in res.stderr and "768" not in res.stderr
    res = runner.invoke(app, ["eval", str(folder), "--data", str(pydoc_text), "--seq-len", "32",
                              "--max-samples", "2", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["results"][0]["kv_cache_bytes_per_token"] is None
    assert "n/a" in res.stderr
    res = runner.invoke(app, ["eval", str(folder), "--speed", "--context", "16", "--repeats", "1",
                              "--warmup", "0", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)["results"][0]
    assert r["kv_cache_bytes"] is None and r["kv_cache_bytes_per_token"] is None


def test_pruning_an_encoder_summarises_its_kv_cache_as_n_a(tmp_path):
    folder = save_tiny("bert", tmp_path / "bert")
    res = runner.invoke(app, ["prune", str(folder), "--heads", "0:0", "-o", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    totals = json.loads(res.stdout)["totals"] if "totals" in json.loads(res.stdout) else \
        json.loads(res.stdout)["summary"]["totals"]
    assert totals["kv_cache_bytes_per_token"] == {"before": None, "after": None}
    assert "| KV-cache bytes per token | n/a | n/a |" in (tmp_path / "out" / "README.md").read_text()

