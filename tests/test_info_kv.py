"""KV-cache figures of `info`, `eval` and `eval --speed`: the same answer in every command."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForMaskedLM
from typer.testing import CliRunner

from headtool.arch import adapter_for
from headtool.arch.families import BERT
from headtool.cli.app import app
from headtool.model.info import model_info
from tiny_models import save_tiny, tiny_model

runner = CliRunner()


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



@pytest.mark.parametrize("family,overrides,windows", [
    ("gemma3_text", {}, [8, 8, None]),
    ("gemma2", {}, [8, None, 8]),
    ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=1), [None, 8, 8]),
    ("mistral", dict(sliding_window=8), [8, 8, 8]),
    ("phi3", dict(sliding_window=8), [8, 8, 8]),
    ("llama", {}, None),
])
def test_sliding_window_layers_are_bounded_by_their_window(family, overrides, windows):
    """info counted a sliding-window layer's cache as growing with every token (gemma3_text: 384 B per
    token where the two local layers stop at their window): per token now counts the global layers,
    and the window layers are stated apart, as the cache transformers builds holds them."""
    from headtool.measure.speed import cache_bytes

    model = tiny_model(family, **overrides)
    info = model_info(model, adapter_for(model.config))
    per_layer = 2 * 2 * 8 * 4
    assert info["kv_cache_bytes_per_token_per_layer"] == [per_layer] * 3
    assert info.get("kv_cache_window_per_layer") == windows
    n_global = 3 if windows is None else windows.count(None)
    assert info["kv_cache_bytes_per_token"] == n_global * per_layer
    if windows is not None:
        assert info["kv_cache_window_bytes"] == (3 - n_global) * per_layer * 8
    # the cache of a 20-token sequence: the global layers hold 20 tokens, a window layer at most 8
    with torch.no_grad():
        out = model(input_ids=torch.randint(5, 100, (1, 20)), use_cache=True)
    measured, _ = cache_bytes(out.get("cache", None) or out.get("past_key_values"))
    assert info["kv_cache_bytes_per_token"] * 20 <= measured <= \
        info["kv_cache_bytes_per_token"] * 20 + info.get("kv_cache_window_bytes", 0)


def test_info_states_the_window_layers_apart(tmp_path):
    folder = save_tiny("gemma3_text", tmp_path / "g3")
    res = runner.invoke(app, ["info", str(folder), "--json"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["kv_cache_bytes_per_token"] == 128 and info["kv_cache_window_bytes"] == 2048
    assert "in the 1 global layer " in res.stderr
    assert "2 of 3 layers, window 8 tokens: at most 2.0 KiB" in res.stderr


def test_conversions_compare_every_layers_bytes_per_token():
    """convert-gqa / convert-mla budget and compare every layer's bytes (a model whose every layer slides
    would otherwise read '0 B -> 0 B, 0.00x smaller')."""
    from headtool.surgery import latent, merging

    model = tiny_model("mistral", sliding_window=8)
    adapter = adapter_for(model.config)
    for figures in (merging.summary_figures(model, adapter), latent.summary_figures(model, adapter)):
        assert figures["kv_cache_bytes_per_token"] == 3 * 2 * 2 * 8 * 4
        assert figures["kv_cache_window_per_layer"] == [8, 8, 8] and figures["kv_cache_window_bytes"] == 3072


@pytest.mark.parametrize("command,args", [("convert-gqa", ["--kv-heads", "1", "--merge", "mean"]),
                                          ("convert-mla", ["--kv-cache", "0.5", "--no-refit"])])
def test_a_conversions_table_and_card_say_they_count_every_layer(tmp_path, command, args):
    """On a model with sliding-window layers a conversion's KV figure counts every layer, where info
    counts the global ones: the table said so, the model card's row did not."""
    folder = save_tiny("gemma3_text", tmp_path / "g3")
    out = tmp_path / "out"
    res = runner.invoke(app, [command, str(folder), *args, "-o", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "KV cache per token (every layer, windows not full)" in res.stderr
    assert "| KV cache bytes per token (every layer, windows not full) |" in (out / "README.md").read_text()


def test_speed_refuses_new_tokens_for_an_encoder(tmp_path):
    """eval --speed --new-tokens 8 on bert was accepted and titled '8 decode steps' where decode is n/a."""
    folder = save_tiny("bert", tmp_path / "bert")
    res = runner.invoke(app, ["eval", str(folder), "--speed", "--context", "16", "--new-tokens", "8",
                              "--repeats", "1", "--warmup", "0"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "--new-tokens 8" in lines[0] and "does not generate" in lines[0]
    assert "Traceback" not in res.stderr
    res = runner.invoke(app, ["eval", str(folder), "--speed", "--context", "16", "--repeats", "1", "--warmup", "0",
                              "--json"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["settings"]["new_tokens"] is None
    assert "decode steps" not in res.stderr and "no decode" in res.stderr


def test_info_of_a_latent_model_names_no_kv_heads(tmp_path):
    """info --json of a convert-mla output said num_kv_heads 2 (the heads it replaced) beside kv_rank, and
    grouped_query true: the latent is what every query head reads; the replaced heads are source_num_kv_heads."""
    src = save_tiny("llama", tmp_path / "src")
    res = runner.invoke(app, ["convert-mla", str(src), "--kv-rank", "6", "--rope-dim", "4", "-o", str(tmp_path / "mla"),
                              "--data", "builtin:pydoc", "--max-samples", "4", "--seq-len", "16"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["info", str(tmp_path / "mla"), "--json"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["kv_rank"] == 6 and doc["num_kv_heads"] is None and doc["total_kv_heads"] is None
    assert doc["grouped_query"] is None and doc["source_num_kv_heads"] == 2
    assert doc["kv_cache_bytes_per_token"] == 3 * (6 + 4) * 4
    assert "replaces 2 KV heads" in res.stderr
    res = runner.invoke(app, ["eval", str(src), str(tmp_path / "mla"), "--data", "builtin:pydoc", "--max-samples",
                              "2", "--seq-len", "16", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["results"][1]["total_kv_heads"] is None and "12/latent" in res.stderr


def test_speed_refuses_a_context_past_robertas_positions(tmp_path):
    """RoBERTa's positions start after the padding index (130 rows take 128 tokens): --context 129 passed the
    check and failed inside the model with an internal error."""
    folder = save_tiny("roberta", tmp_path / "rob")
    res = runner.invoke(app, ["eval", str(folder), "--speed", "--context", "129", "--repeats", "1", "--warmup", "0"])
    assert res.exit_code == 2, res.output
    assert "--context 129 exceeds the model's 128 positions" in res.stderr and "internal error" not in res.stderr


def test_a_figure_under_a_kib_is_not_given_twice():
    """The info table said '384 B (384 B)': the exact count is added only where the unit rounds."""
    from headtool.cli.render import kv_cell

    assert kv_cell({"kv_cache_bytes_per_token": 384}) == "384 B"
    assert kv_cell({"kv_cache_bytes_per_token": 1536}) == "1.5 KiB (1,536 B)"
