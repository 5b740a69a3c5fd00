"""`headtool inspect` on the command line: JSON contract, tables, PNGs, bad input exits 2."""
from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from conftest import needs_smollm2
from headtool.cli.app import app
from tiny_models import save_tiny

runner = CliRunner()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    import pydoc_data.topics as t

    p = tmp_path_factory.mktemp("data") / "text.txt"
    p.write_text("\n\n".join(list(t.topics.values())[:30]))
    return p


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("m") / "llama")


def _args(model, text_file, *extra):
    return ["inspect", str(model), "--data", str(text_file), "--seq-len", "24", "--max-samples", "2", *extra]


def test_inspect_json_contract(llama, text_file):
    res = runner.invoke(app, _args(llama, text_file, "--json"))
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["format"] == "headtool.inspect/1"
    for key in ("model", "data", "statistics", "twins", "similarity", "kv_groups", "top_pairs", "definitions",
                "causal", "elapsed_s", "headtool_version"):
        assert key in doc
    assert doc["model"]["num_heads"] == 4 and doc["model"]["fingerprint"].startswith("sha256:")
    # the model as typed beside the folder it resolved to, as score's document names it (a .gguf or
    # packaged model resolves to a converted copy in the cache, whose name says nothing)
    assert (doc["model"]["ref"], doc["model"]["path"]) == (str(llama), str(llama))
    assert doc["data"]["samples"] == 2 and doc["data"]["seq_len"] == 24
    for name, rows in doc["statistics"].items():
        assert len(rows) == 3 and all(len(r) == 4 for r in rows), name
    assert all(0.0 <= v <= 1.0 for r in doc["statistics"]["first_token_mass"] for v in r)
    assert len(doc["similarity"]["output"][0]) == 4 and doc["similarity"]["attention"][0][1][1] == 1.0
    assert len(doc["kv_groups"]["within_attention_similarity"][0]) == 2
    assert len(doc["top_pairs"]) == 10
    assert "attention entropy" in res.stderr and "most similar head pairs" in res.stderr
    # reproducible numbers
    again = runner.invoke(app, _args(llama, text_file, "--json"))
    assert json.loads(again.stdout)["statistics"] == doc["statistics"]


def test_inspect_without_json_prints_nothing_on_stdout(llama, text_file):
    res = runner.invoke(app, _args(llama, text_file, "--top", "0"))
    assert res.exit_code == 0, res.output
    assert res.stdout == "" and "mean attention distance" in res.stderr


def test_inspect_plots(llama, text_file, tmp_path):
    out = tmp_path / "png"
    res = runner.invoke(app, _args(llama, text_file, "--json", "--plot", str(out), "--heads", "0:1,2:3"))
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    names = sorted(p.name for p in out.iterdir())
    assert "attention_L0_H1.png" in names and "attention_L2_H3.png" in names
    assert "previous_token_mass.png" in names and "kv_group_within_attention_similarity.png" in names
    assert len(names) == len(doc["plots"]) == 12
    assert all((out / n).read_bytes()[:8] == PNG_MAGIC for n in names)
    # --text: the pattern of a given example text instead of the data's first tokens
    res = runner.invoke(app, _args(llama, text_file, "--plot", str(tmp_path / "t"), "--heads", "1:0",
                                   "--text", "def f(x): return x"))
    assert res.exit_code == 0, res.output
    assert (tmp_path / "t" / "attention_L1_H0.png").read_bytes()[:8] == PNG_MAGIC
    # prune's grammar (layers separated by ';') is read too, and means the same heads as the pairs
    res = runner.invoke(app, _args(llama, text_file, "--plot", str(tmp_path / "u"), "--heads", "0:1,3;2:0",
                                   "--text", "def f(x): return x"))
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "u").glob("attention_*")) == [
        "attention_L0_H1.png", "attention_L0_H3.png", "attention_L2_H0.png"]


@pytest.mark.parametrize("extra,message", [
    (["--heads", "3:0", "--plot", "OUT"], "layer 3 does not exist"),
    (["--heads", "0:9", "--plot", "OUT"], "layer 0 has query heads 0..3, not 9"),
    (["--heads", "zero", "--plot", "OUT"], "LAYER:HEAD"),
    (["--heads", "0:1,0:1", "--plot", "OUT"], "layer 0 head 1 is listed twice"),
    (["--heads", "1,0:2", "--plot", "OUT"], "head 1 has no layer before it"),
    (["--heads", ";", "--plot", "OUT"], "lists no heads"),
    (["--heads", " ", "--plot", "OUT"], "lists no heads"),
    (["--heads", "0:1"], "need --plot"),
    (["--top", "-1"], "--top"),
    (["--plot", "FILE"], "not a folder"),
])
def test_inspect_bad_input_exits_2(llama, text_file, tmp_path, extra, message):
    (tmp_path / "file").write_text("x")
    extra = [str(tmp_path / "png") if a == "OUT" else str(tmp_path / "file") if a == "FILE" else a for a in extra]
    res = runner.invoke(app, _args(llama, text_file, *extra))
    assert res.exit_code == 2, res.output
    assert message in res.stderr and "Traceback" not in res.output
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) == 1, res.stderr


def test_inspect_help_states_the_head_grammar():
    text = " ".join(runner.invoke(app, ["inspect", "--help"]).stdout.split())
    assert '"3:0,5;7:2"' in text and '"3:1,5:0"' in text


def test_inspect_missing_model_exits_2(tmp_path, text_file):
    res = runner.invoke(app, ["inspect", str(tmp_path / "nope"), "--data", str(text_file)])
    assert res.exit_code == 2 and "not found" in res.stderr


def test_plot_without_matplotlib_names_the_install(llama, text_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    res = runner.invoke(app, _args(llama, text_file, "--plot", str(tmp_path / "png")))
    assert res.exit_code == 2
    assert "pip install matplotlib" in res.stderr
    assert not (tmp_path / "png").exists()


def test_inspect_mha_conv1d_model(tmp_path, text_file):
    gpt2 = save_tiny("gpt2", tmp_path / "gpt2")
    res = runner.invoke(app, _args(gpt2, text_file, "--json"))
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["causal"] is True and doc["kv_groups"] is None  # MHA: no KV groups
    assert doc["model"]["family"] == "gpt2"
    assert all(-1.0 <= v <= 1.0 for r in doc["statistics"]["twin_output_similarity"] for v in r)


@pytest.mark.realmodel
@needs_smollm2
def test_inspect_smollm2_shapes(smollm2):
    import torch

    from headtool.measure.inspection import inspect_heads

    ids = smollm2.tokenizer("def f(x):\n    return x + 1\n\nThe quick brown fox jumps over the lazy dog.",
                            return_tensors="pt")["input_ids"]
    before = smollm2.model.config._attn_implementation
    r = inspect_heads(smollm2.model, smollm2.adapter, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])
    assert len(r["statistics"]["entropy"]) == 30 and len(r["statistics"]["entropy"][0]) == 9
    assert len(r["kv_groups"]["within_attention_similarity"][0]) == 3
    assert r["causal"] is True
    assert smollm2.model.config._attn_implementation == before  # eager only for the pass
