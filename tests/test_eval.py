"""`headtool eval`: same batches for every model, deltas, JSON; headless encoders compared to the first."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from headtool.cli.app import app
from tiny_models import save_tiny

runner = CliRunner()


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_eval_two_models_same_batches(family, tmp_path, pydoc_text):
    a = save_tiny(family, tmp_path / "a", seed=0)
    b = save_tiny(family, tmp_path / "b", seed=1)
    res = runner.invoke(app, ["eval", str(a), str(b), "--data", str(pydoc_text), "--seq-len", "32",
                              "--max-samples", "4", "--batch-size", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["objective"] == ("mlm" if family == "bert" else "lm")
    r0, r1 = out["results"]
    assert r0["tokens"] == r1["tokens"] > 0
    assert r0["loss"] != r1["loss"]
    assert abs(r0["perplexity"] - 2.718281828 ** r0["loss"]) < 1e-6 * r0["perplexity"]
    # identical across runs
    again = runner.invoke(app, ["eval", str(a), "--data", str(pydoc_text), "--seq-len", "32",
                                "--max-samples", "4", "--batch-size", "2", "--json"])
    assert json.loads(again.stdout)["results"][0]["loss"] == r0["loss"]


def test_eval_headless_encoder_reports_agreement(tmp_path, pydoc_text):
    from tiny_models import tiny_model, tokenizer_for

    m = tiny_model("bert").bert  # the headless BertModel inside
    m.save_pretrained(tmp_path / "enc")
    tokenizer_for("bert").save_pretrained(tmp_path / "enc")
    res = runner.invoke(app, ["eval", str(tmp_path / "enc"), str(tmp_path / "enc"), "--data", str(pydoc_text),
                              "--seq-len", "32", "--max-samples", "2", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)["results"]
    assert r[1]["loss"] == 0.0 and abs(r[1]["embedding_cosine"] - 1) < 1e-6


def test_eval_refuses_models_with_other_tokenizers(tmp_path, pydoc_text):
    a = save_tiny("llama", tmp_path / "a")
    b = save_tiny("bert", tmp_path / "b")
    res = runner.invoke(app, ["eval", str(a), str(b), "--data", str(pydoc_text), "--seq-len", "16",
                              "--max-samples", "2"])
    assert res.exit_code == 2
    assert "tokenizer" in res.stderr


def test_eval_bad_objective_and_missing_data(tmp_path):
    a = save_tiny("llama", tmp_path / "a")
    res = runner.invoke(app, ["eval", str(a), "--objective", "mlm", "--max-samples", "2"])
    assert res.exit_code == 2 and "masked-lm" in res.stderr
    res = runner.invoke(app, ["eval", str(a), "--data", str(tmp_path / "nope.txt")])
    assert res.exit_code == 2 and "not found" in res.stderr


def test_eval_gives_each_gap_from_the_first_model_its_paired_standard_error(tmp_path, pydoc_text):
    """The Δ of every model after the first carries one standard error over the evaluated blocks, paired with
    the first model on the same blocks (what `paired_difference` gives on the models' per-block losses): zero
    for a copy of the first model, positive for another model, shown in the table with a caption; absent
    where one block cannot give it."""
    from headtool.data.batches import make_batches
    from headtool.data.sources import DataSpec
    from headtool.measure.evaluation import evaluate, paired_difference
    from headtool.model.loading import load_model

    a = save_tiny("llama", tmp_path / "a", seed=0)
    b = save_tiny("llama", tmp_path / "b", seed=1)
    args = ["--data", str(pydoc_text), "--seq-len", "32", "--max-samples", "6", "--batch-size", "4"]
    res = runner.invoke(app, ["eval", str(a), str(b), str(a), *args, "--json"])
    assert res.exit_code == 0, res.output
    first, other, copy = json.loads(res.stdout)["results"]
    assert "loss_delta_se" not in first and copy["loss_delta_se"] == 0.0
    la, lb = load_model(str(a)), load_model(str(b))
    batches = make_batches(DataSpec(source=str(pydoc_text), seq_len=32, batch_size=4, max_samples=6), la.tokenizer,
                           "lm").batches
    ea, eb = (evaluate(m.model, batches, "lm", per_block=True) for m in (la, lb))
    assert len(ea["block_sums"]) == 6
    diff, se = paired_difference(eb["block_sums"], ea["block_sums"], ea["block_weights"])
    assert abs(diff - (other["loss"] - first["loss"])) < 1e-5 and 0 < se == pytest.approx(other["loss_delta_se"])
    shown = runner.invoke(app, ["eval", str(a), str(b), *args])
    assert f"± {other['loss_delta_se']:.4f}" in shown.output and "one standard error over the 6 blocks" in shown.output
    single = runner.invoke(app, ["eval", str(a), str(b), "--data", str(pydoc_text), "--seq-len", "32",
                                 "--max-samples", "1", "--json"])
    assert single.exit_code == 0 and "loss_delta_se" not in json.loads(single.stdout)["results"][1]


def test_a_classifiers_token_count_is_its_text_not_the_padding(tmp_path):
    """results[].tokens counted every padded position (2048 for 16 examples of about 10 tokens at
    --seq-len 128) beside data.tokens' 160: the same command gave two token counts for one text."""
    from transformers import AutoModelForSequenceClassification

    from tiny_models import tiny_config, tokenizer_for

    data = tmp_path / "lab.csv"
    data.write_text("text,label\n" + "\n".join(f"the river number {i} ran past the mill,{i % 2}"
                                                for i in range(40)) + "\n")
    classifier = tmp_path / "classifier"
    AutoModelForSequenceClassification.from_config(tiny_config("bert", num_labels=2)).save_pretrained(classifier)
    tokenizer_for("bert").save_pretrained(classifier)
    r = runner.invoke(app, ["eval", str(classifier), "--data", str(data), "--label-column", "label",
                            "--max-samples", "16", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    res = doc["results"][0]
    assert res["examples"] == 16 and 0 <= res["accuracy"] <= 1
    assert res["tokens"] == doc["data"]["tokens"] < 16 * 128
