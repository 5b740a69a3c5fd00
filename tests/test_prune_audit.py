"""headtool prune as a compression engineer drives it: listed heads, refused combinations, chained prunes."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from headtool.cli.app import app
from tiny_models import save_tiny

runner = CliRunner()


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("audit") / "src")


def _prune(*args, input=None):
    return runner.invoke(app, ["prune", *map(str, args)], input=input)


def _one_line_exit_2(r, needle: str) -> None:
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.stderr


@pytest.mark.parametrize("unit", ["head", "query"])
def test_listed_heads_are_removed_as_listed_with_compensate(llama_src, tmp_path, unit):
    """--heads with --compensate: the refit chose other heads inside each listed layer (--choose-in-layer
    auto is refit with --compensate), so the heads removed were not those listed."""
    heads = {"head": "1:1;2:3", "query": "1:1,3;2:0,2"}[unit]
    kept = {"head": [[0, 1, 2, 3], [0, 2, 3], [0, 1, 2]], "query": [[0, 1, 2, 3], [0, 2], [1, 3]]}[unit]
    out = tmp_path / "o"
    r = _prune(llama_src, "--heads", heads, "--unit", unit, "--compensate", "--data", "builtin:pydoc",
               "--max-samples", "4", "--seq-len", "16", "-o", out, "--json")
    assert r.exit_code == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["kept_heads"] == kept
    assert [row["removed_heads"] for row in res["layers"]][1:] == [sorted(set(range(4)) - set(k)) for k in kept[1:]]
    assert res["compensation"] and json.loads((out / "headtool.json").read_text())["kept_heads"] == kept
    r = _prune(llama_src, "--heads", heads, "--unit", unit, "--compensate", "--choose-in-layer", "refit",
               "--data", "builtin:pydoc", "--max-samples", "4", "--seq-len", "16", "-o", tmp_path / "n")
    _one_line_exit_2(r, "--choose-in-layer refit")
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize("extra,flag", [(["--protect-layers", "1"], "--protect-layers"),
                                        (["--scope", "layer"], "--scope"),
                                        (["--normalize", "layer"], "--normalize"),
                                        (["--normalize", "layer,none", "--allocation-margin", "1"], "--allocation-margin")])
@pytest.mark.parametrize("streaming", [False, True])
def test_options_of_a_choice_from_scores_are_refused_with_listed_heads(llama_src, tmp_path, extra, flag, streaming):
    """--heads 1:1 --protect-layers 1 removed head 1 of the protected layer; --scope / --normalize /
    --allocation-margin were read by nothing: each is one line, exit 2, nothing written."""
    out = tmp_path / "o"
    r = _prune(llama_src, "--heads", "1:1", "--unit", "head", *extra, "-o", out,
               *(["--streaming"] if streaming else []))
    _one_line_exit_2(r, flag)
    assert "--heads lists them" in r.stderr and not out.exists()


@pytest.mark.parametrize("streaming", [False, True])
def test_unit_group_with_listed_heads_takes_whole_groups_only(llama_src, tmp_path, streaming):
    """--unit group --heads 1:0,2 (one head from each KV group of layer 1) was pruned as --unit query
    would: the KV groups stayed. Whole groups pass; a split group is one line, exit 2, nothing written."""
    mode = ["--streaming"] if streaming else []
    r = _prune(llama_src, "--heads", "1:0,2", "--unit", "group", *mode, "-o", tmp_path / "n")
    _one_line_exit_2(r, "--unit group removes whole KV groups: layer 1")
    assert "0,1 | 2,3" in r.stderr and not (tmp_path / "n").exists()
    r = _prune(llama_src, "--heads", "1:2,3", "--unit", "group", *mode, "-o", tmp_path / "y", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads((tmp_path / "y" / "headtool.json").read_text())
    assert doc["kept_heads"][1] == [0, 1] and doc["num_kv_heads"] == [2, 1, 2]


def test_a_chained_prune_records_its_heads_in_the_original_model(llama_src, tmp_path):
    """`prune A -o B; prune B -o C`: C's kept_heads are positions in B (its input), as before; C also records
    original_kept_heads, the same heads as indices of A (composed through B's headtool.json), with A's source.
    Pruning A by them directly writes C's tensors (in memory and streamed); a third prune composes again, a
    recipe on B does too, and a first prune (of a folder headtool did not write) records no lineage."""
    from tiny_models import checkpoint_tensors
    import torch

    b, c, cs, d, direct = (tmp_path / n for n in ("b", "c", "cs", "d", "direct"))
    r = _prune(llama_src, "--heads", "1:0;2:3", "--unit", "head", "-o", b, "--json")
    assert r.exit_code == 0, r.stderr
    first = json.loads((b / "headtool.json").read_text())
    assert "original_kept_heads" not in first and "original_kept_heads" not in json.loads(r.stdout)
    for out, mode in ((c, []), (cs, ["--streaming"])):
        r = _prune(b, "--heads", "1:0;2:1", "--unit", "head", *mode, "-o", out)
        assert r.exit_code == 0, r.stderr
        doc = json.loads((out / "headtool.json").read_text())
        assert doc["kept_heads"] == [[0, 1, 2, 3], [1, 2], [0, 2]]  # positions in b
        assert doc["original_kept_heads"] == [[0, 1, 2, 3], [2, 3], [0, 2]]
        assert doc["original_source"] == first["source"] and doc["source"]["path"] == str(b.resolve())
        assert "original_kept_heads" in (out / "README.md").read_text()
    r = _prune(llama_src, "--heads", "1:0,1;2:1,3", "--unit", "head", "-o", direct)
    assert r.exit_code == 0, r.stderr
    want = checkpoint_tensors(direct)
    for out in (c, cs):
        got = checkpoint_tensors(out)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    r = _prune(c, "--heads", "2:0", "--unit", "head", "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["original_kept_heads"] == [[0, 1, 2, 3], [2, 3], [2]]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {b}\nsteps:\n  - prune: {{heads: '1:0;2:1', unit: head}}\n")
    r = runner.invoke(app, ["run", str(recipe), "-o", str(tmp_path / "rec")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "rec" / "headtool.json").read_text())
    assert doc["original_kept_heads"] == [[0, 1, 2, 3], [2, 3], [0, 2]] and doc["original_source"] == first["source"]


@pytest.mark.parametrize("how", [["--heads", "1:0,1"], ["--heads", "1:0,1", "--streaming"], ["--scores", "DOC", "--num-heads", "2"]])
def test_data_options_that_nothing_reads_are_refused(llama_src, tmp_path, how):
    """--data / --max-samples / --seq-len with listed heads or a score document and no refit, comparison or
    evaluation were accepted and read by nothing (headtool.json's data_read named the score document's text,
    not the one given). One line, exit 2, nothing written; with --eval-data they still apply."""
    doc = runner.invoke(app, ["score", str(llama_src), "--method", "magnitude"])
    (tmp_path / "doc.json").write_text(doc.stdout)
    how = [str(tmp_path / "doc.json") if a == "DOC" else a for a in how]
    r = _prune(llama_src, *how, "--data", "builtin:licenses", "--max-samples", "3", "-o", tmp_path / "n")
    _one_line_exit_2(r, "--data, --max-samples: prune reads no text")
    assert not (tmp_path / "n").exists()
    r = _prune(llama_src, *how, "--seq-len", "64", "--dry-run")
    _one_line_exit_2(r, "--seq-len: prune reads no text")
    if "--streaming" not in how:
        r = _prune(llama_src, *how, "--data", "builtin:licenses", "--max-samples", "2", "--seq-len", "16",
                   "--eval-data", "builtin:licenses", "--eval-samples", "2", "--dry-run", "--json")
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout)["eval_data"]["skip_samples"] == 2


def test_several_anchors_without_held_out_blocks_are_refused(llama_src, tmp_path):
    """prune --compensate --anchor auto took no held-out blocks (its default) and chose each layer's
    anchor on the calibration blocks the refit was fitted to, where the weakest anchor wins, unsaid
    (convert-gqa/convert-mla refuse the same). With held-out blocks, or one anchor, it runs."""
    base = [llama_src, "--fraction", "0.25", "--compensate", "--data", "builtin:pydoc", "--max-samples", "4",
            "--seq-len", "16"]
    for anchor in ("auto", "0.1,1"):
        _one_line_exit_2(_prune(*base, "--anchor", anchor, "-o", tmp_path / "o"), "chosen on held-out blocks")
    assert not (tmp_path / "o").exists()
    assert _prune(*base, "--anchor", "auto", "--heldout-samples", "2", "-o", tmp_path / "a").exit_code == 0
    assert _prune(*base, "--anchor", "0.5,inf", "-o", tmp_path / "b").exit_code == 0


def test_the_lineage_of_heads_goes_through_heal_and_the_conversions(llama_src, tmp_path):
    """original_kept_heads was lost through a heal (prune -> heal -> prune named positions in the healed
    folder only) and never written by convert-gqa/convert-mla of a pruned folder: heal and convert-mla keep
    every head where it is and carry the lineage on; convert-gqa composes its order with it."""
    b, h, c, g, m = (tmp_path / n for n in ("b", "h", "c", "g", "m"))
    assert _prune(llama_src, "--heads", "1:0,2", "--unit", "query", "-o", b).exit_code == 0
    first = json.loads((b / "headtool.json").read_text())
    kept_b = first["kept_heads"]
    r = runner.invoke(app, ["heal", str(b), "--teacher", str(llama_src), "--data", "builtin:pydoc", "--seq-len", "16",
                            "--batch-size", "2", "--eval-samples", "2", "--max-steps", "1", "-o", str(h)])
    assert r.exit_code == 0, r.output
    healed = json.loads((h / "headtool.json").read_text())
    assert healed["original_kept_heads"] == kept_b and healed["original_source"] == first["source"]
    assert _prune(h, "--heads", "1:0", "--unit", "head", "-o", c).exit_code == 0
    doc = json.loads((c / "headtool.json").read_text())
    assert doc["original_kept_heads"] == [kept_b[0], [kept_b[1][1]], kept_b[2]]
    assert doc["original_source"] == first["source"]
    r = runner.invoke(app, ["convert-gqa", str(b), "--kv-heads", "1", "--merge", "mean", "-o", str(g)])
    assert r.exit_code == 0, r.output
    doc = json.loads((g / "headtool.json").read_text())
    assert doc["original_kept_heads"] == [[kb[p] for p in order] for kb, order in zip(kept_b, doc["kept_heads"])]
    r = runner.invoke(app, ["convert-mla", str(b), "--kv-cache", "0.5", "--no-refit", "-o", str(m)])
    assert r.exit_code == 0, r.output
    assert json.loads((m / "headtool.json").read_text())["original_kept_heads"] == kept_b
    # a first operation on a folder headtool did not cut records none
    r = runner.invoke(app, ["convert-mla", str(llama_src), "--kv-cache", "0.5", "--no-refit", "-o", str(tmp_path / "m0")])
    assert r.exit_code == 0 and "original_kept_heads" not in json.loads((tmp_path / "m0" / "headtool.json").read_text())


def test_a_streamed_sharded_index_says_what_an_in_memory_one_says(llama_src, tmp_path):
    """A sharded --streaming output's model.safetensors.index.json lacked the total_parameters that
    transformers writes in memory: the same index now, weight map and metadata."""
    for out, mode in ((tmp_path / "mem", []), (tmp_path / "str", ["--streaming"])):
        assert _prune(llama_src, "--heads", "1:0,1", "--shard-size", "20KB", *mode, "-o", out).exit_code == 0
    mem, streamed = (json.loads((tmp_path / n / "model.safetensors.index.json").read_text()) for n in ("mem", "str"))
    assert streamed == mem and mem["metadata"]["total_parameters"] > 0


@pytest.mark.parametrize("mode", [[], ["--streaming"]])
def test_the_card_names_the_config_kind_once(llama_src, tmp_path, mode):
    """A prune's model card said 'Config kind: ...' in its header and again under its summary table."""
    out = tmp_path / "o"
    assert _prune(llama_src, "--heads", "1:0", "--unit", "head", *mode, "-o", out).exit_code == 0
    card = (out / "README.md").read_text()
    assert card.count("Config kind") == 1 and "Config kind: **headtool-remote-code**" in card, card
