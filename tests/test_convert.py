"""convert-gqa: exactness on identical heads, function-preserving alignment, reloadable outputs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from tiny_models import GQA, logits_of, sample_ids, save_tiny, tiny_model

from headtool.surgery import merging as C
from headtool.arch import LayerHeads, adapter_for
from headtool.measure.calibration import attention_input_grams
from headtool.cli.app import app
from headtool.errors import UsageError
from headtool.model.resize import resize_attention

# one family of each kind: plain, q/k/v biases, qk-norm before RoPE, fused qkv, Gemma
EXACT_FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "gemma"]


def _batches(family: str, n: int = 2, seq: int = 24, seed: int = 7) -> list[dict]:
    ids = sample_ids(family, batch=n, seq=seq, seed=seed)
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]


def _with_identical_kv(model, partner: dict[int, int]):
    """Copy KV head partner[j] onto KV head j in every layer (through surgery's own slicing)."""
    ad = adapter_for(model.config)
    for i, geo in enumerate(ad.geometry(model.config)):
        state = model.state_dict()
        prefix = ad.layer_prefix(model, i)
        b = C.read_blocks(state, ad, prefix, geo)
        for j, src in partner.items():
            b.k[j], b.v[j] = b.k[src], b.v[src]
        model.load_state_dict({**state, **C.write_tensors(b, ad, prefix, state, geo, geo)})
    return model


CASES = {"contiguous": ({1: 0, 3: 2}, [(0, 1), (2, 3)]), "similarity": ({2: 0, 3: 1}, [(0, 2), (1, 3)])}
FULL = [(g, m) for g in CASES for m in C.METHODS]


@pytest.mark.parametrize("family, combos", [("llama", FULL)] + [
    (f, [("similarity", "fit"), ("contiguous", "aligned")]) for f in EXACT_FAMILIES[1:]])
def test_identical_kv_heads_merge_exactly(family, combos):
    """Grouping x merge method is exact when the heads merged together are identical (the full
    matrix on llama; fused qkv, biases, qk-norm and Gemma on the two data-aware paths)."""
    ids = sample_ids(family, seed=3)
    for grouping in dict.fromkeys(g for g, _ in combos):
        partner, groups = CASES[grouping]
        model = _with_identical_kv(tiny_model(family, num_key_value_heads=4), partner)
        ad = adapter_for(model.config)
        ref = logits_of(model, ids)
        grams = attention_input_grams(model, ad, _batches(family))
        for method in [m for g, m in combos if g == grouping]:
            refit = family == "llama" and method == "fit"
            conv = C.convert_model(model, ad, 2, method=method, grouping=grouping, grams=grams,
                                   refit=refit, batches=_batches(family, seed=8),
                                   heldout_batches=_batches(family, seed=9))
            assert [p.groups for p in conv.plans] == [groups] * 3
            assert conv.model.config.num_key_value_heads == 2
            diff = (logits_of(conv.model, ids) - ref).abs().max().item()
            assert diff <= 1e-4, (family, grouping, method, diff)
        assert (logits_of(model, ids) - ref).abs().max().item() == 0.0  # the input is untouched


@pytest.mark.parametrize("family", ["llama", "phi3", "qwen3"])
def test_alignment_maps_alone_change_no_logits(family):
    model = tiny_model(family, seed=4, num_key_value_heads=4)
    ad = adapter_for(model.config)
    ids = sample_ids(family, seed=3)
    ref = logits_of(model, ids)
    grams = attention_input_grams(model, ad, _batches(family))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    changed = 0.0
    for i, geo in enumerate(ad.geometry(model.config)):
        tensors = C.aligned_layer_tensors(model, ad, i, C.contiguous_groups(geo, 2), grams[i])
        changed = max(changed, max((tensors[k] - before[k]).abs().max().item() for k in tensors))
        resize_attention(model, ad, i, geo, tensors)
    assert changed > 1e-2  # the maps are not the identity
    assert (logits_of(model, ids) - ref).abs().max().item() <= 1e-4


def test_alignment_reduces_merge_distance():
    """The maps bring each group's heads closer (what `aligned` then averages)."""
    model = tiny_model("llama", seed=5, num_key_value_heads=4)
    ad = adapter_for(model.config)
    geo = ad.geometry(model.config)[0]
    grams = attention_input_grams(model, ad, _batches("llama"))
    b = C.read_blocks(model.state_dict(), ad, ad.layer_prefix(model, 0), geo)
    rot = ad.rotary_dim(model.config, geo.head_dim)
    raw = C.kv_distances(b, grams[0], rot, False, False)
    aligned = C.apply_alignment(b, geo, C.contiguous_groups(geo, 2), grams[0], rot)
    after = C.kv_distances(aligned, grams[0], rot, False, False)
    assert after[0, 1] < raw[0, 1] and after[2, 3] < raw[2, 3]
    # the closed-form aligned distance (pairwise optimum) bounds what the group maps reach
    closed = C.kv_distances(b, grams[0], rot, True, True)
    assert closed[0, 1] <= after[0, 1] + 1e-6 and closed[2, 3] <= after[2, 3] + 1e-6


def test_data_aware_merges_beat_mean_on_a_tiny_model():
    """On the calibration distribution, fit < aligned <= mean in output error (not a tautology:
    mean ignores the data)."""
    model = tiny_model("llama", seed=6, num_key_value_heads=4)
    ad = adapter_for(model.config)
    cal = _batches("llama", n=4, seq=32)
    grams = attention_input_grams(model, ad, cal)
    ids = cal[0]["input_ids"]
    ref = logits_of(model, ids)
    err = {}
    for method in C.METHODS:
        conv = C.convert_model(model, ad, 2, method=method, grams=grams)
        err[method] = (logits_of(conv.model, ids) - ref).pow(2).mean().item()
    assert err["fit"] < err["mean"] and err["aligned"] < err["mean"], err


def test_targets_and_families_without_kv_heads():
    geo = [LayerHeads(9, 3, 64)] * 2
    assert C.valid_kv_targets(geo) == [1]
    assert C.valid_kv_targets([LayerHeads(12, 12, 8)]) == [1, 2, 3, 4, 6]
    ad = adapter_for(tiny_model("llama").config)
    with pytest.raises(UsageError, match="valid values: 1"):
        C.check_target(ad, geo, 3)
    with pytest.raises(UsageError, match="no KV-head setting"):
        C.check_target(adapter_for(tiny_model("gpt2").config), [LayerHeads(4, 4, 8)], 2)


def test_balanced_partition_finds_the_clusters():
    d = torch.ones(6, 6)
    for a, b in ((0, 3), (1, 4), (2, 5)):
        d[a, b] = d[b, a] = 0.0
    d.fill_diagonal_(0.0)
    assert sorted(C.balanced_partition(d, 3)) == [[0, 3], [1, 4], [2, 5]]


def test_uneven_split_of_old_kv_heads():
    """N that divides the query heads but not the KV heads: an old KV head serves two groups."""
    model = tiny_model("llama", seed=2, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                       hidden_size=48)
    ad = adapter_for(model.config)
    grams = attention_input_grams(model, ad, _batches("llama"))
    for grouping in C.GROUPINGS:
        conv = C.convert_model(model, ad, 2, method="fit", grouping=grouping, grams=grams)
        assert conv.model.config.num_key_value_heads == 2
        assert torch.isfinite(logits_of(conv.model, sample_ids("llama"))).all()


# ---------------------------------------------------------------- CLI and output folders
runner = CliRunner()


def _cli(*args):
    return runner.invoke(app, ["convert-gqa", *(str(a) for a in args)])


@pytest.mark.parametrize("family", GQA)
def test_output_loads_with_stock_transformers_and_generates(family, tmp_path):
    from transformers import AutoModelForCausalLM

    src = save_tiny(family, tmp_path / "src", num_key_value_heads=4)
    out = tmp_path / "out"
    r = _cli(src, "--kv-heads", 2, "--merge", "fit", "--no-refit", "--data", "builtin:pydoc",
             "--max-samples", 4, "--seq-len", 16, "--heldout-samples", 0, "-o", out, "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["num_kv_heads_after"] == [2, 2, 2] and doc["kv_cache_reduction"] == pytest.approx(2.0)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.num_key_value_heads == 2
    ids = sample_ids(family, batch=1, seq=5)
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 9)
    meta = json.loads((out / "headtool.json").read_text())
    assert meta["operation"] == "convert-gqa" and meta["num_kv_heads"] == [2, 2, 2]
    assert sorted(meta["kept_heads"][0]) == [0, 1, 2, 3]


def test_native_gqa_to_mqa_and_compare_methods(tmp_path):
    """GQA (2 KV heads) to MQA, three methods compared, the best written; similarity grouping."""
    from transformers import AutoModelForCausalLM

    src = save_tiny("qwen2", tmp_path / "src")
    out = tmp_path / "out"
    r = _cli(src, "--kv-heads", 1, "--merge", "mean,aligned,fit", "--grouping", "similarity",
             "--max-samples", 6, "--seq-len", 24, "--eval-data", "builtin:pydoc", "--eval-samples", 4,
             "-o", out, "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [x["method"] for x in doc["results"]] == ["mean", "aligned", "fit"]
    held = {x["method"]: x["heldout_loss"] for x in doc["results"]}
    assert doc["chosen"] == min(held, key=held.get)  # chosen on held-out calibration blocks, never on eval
    # every other method records how far its held-out loss was above the written one's, paired over
    # the same blocks: the gap is the loss difference (float32 sums per block and per batch), with a
    # standard error; the model card and the table say it
    for x in doc["results"]:
        if x["method"] == doc["chosen"]:
            assert "difference" not in x and "standard_error" not in x
        else:
            assert x["difference"] == pytest.approx(x["heldout_loss"] - held[doc["chosen"]], rel=1e-4, abs=1e-6)
            assert x["difference"] >= 0 and 0 < x["standard_error"] < float("inf")
    card = (out / "README.md").read_text()
    assert f"Held-out loss of `{doc['chosen']}`" in card and "paired difference" in card
    assert "(+gap ± se)" in r.stderr and "held-out loss above the written" in r.stderr
    assert all("loss" in x["eval"] for x in doc["results"])
    # no --data: auto, i.e. builtin:pydoc mixed with text sampled from this causal LM; the evaluation
    # on builtin:pydoc starts after the pydoc blocks the calibration and held-out blocks read
    assert doc["calibration_data"]["source"] == "builtin:pydoc+self"
    pydoc = {k: next(m for m in doc[k]["mixture"] if m["source"] == "builtin:pydoc")
             for k in ("calibration_data", "heldout_data")}
    assert pydoc["heldout_data"]["skip_samples"] == pydoc["calibration_data"]["samples"]
    assert doc["eval_data"]["skip_samples"] == pydoc["heldout_data"]["skip_samples"] + pydoc["heldout_data"]["samples"]
    assert "KV cache per token" in r.stderr and "perplexity" in r.stderr
    assert AutoModelForCausalLM.from_pretrained(out).config.num_key_value_heads == 1


@pytest.mark.parametrize("args, needle", [
    (["--kv-heads", 2], "valid values: 1"),
    (["--kv-heads", 3], "valid values: 1"),
    (["--kv-heads", 1, "--merge", "median"], "--merge"),
    (["--kv-heads", 1, "--grouping", "random"], "--grouping"),
])
def test_bad_targets_exit_2(tmp_path, args, needle):
    src = save_tiny("llama", tmp_path / "src")
    r = _cli(src, *args, "-o", tmp_path / "out")
    assert r.exit_code == 2 and needle in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_families_without_kv_heads_exit_2(tmp_path, family):
    src = save_tiny(family, tmp_path / "src")
    r = _cli(src, "--kv-heads", 2, "-o", tmp_path / "out")
    assert r.exit_code == 2 and "no KV-head setting" in r.stderr


def test_existing_output_refused_and_subprocess(tmp_path):
    src = save_tiny("mistral", tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    p = subprocess.run([sys.executable, "-m", "headtool", "convert-gqa", str(src), "--kv-heads", "1",
                        "--merge", "mean", "-o", str(tmp_path / "out")], capture_output=True, text=True)
    assert p.returncode == 2 and "already exists" in p.stderr
    assert (tmp_path / "out" / "keep.txt").exists()


def test_kv_targets_leave_layers_that_have_so_few_kv_heads_already():
    """A layer with the target's KV heads or fewer (a prune removed whole groups) stays as it is;
    the others must divide their query heads by the target."""
    from headtool.arch import LayerHeads
    from headtool.surgery.merging import merged_geometry, valid_kv_targets

    geometry = [LayerHeads(4, 2, 8), LayerHeads(6, 3, 8), LayerHeads(3, 1, 8), LayerHeads(5, 3, 8, (2, 2, 1))]
    assert valid_kv_targets(geometry) == [1]  # 2 would have to divide layer 3's 5 query heads
    assert valid_kv_targets(geometry[:3]) == [1, 2]
    assert merged_geometry(geometry[:3], 2) == [LayerHeads(4, 2, 8), LayerHeads(6, 2, 8), LayerHeads(3, 1, 8)]
    assert valid_kv_targets([LayerHeads(4, 1, 8)]) == []


def test_merges_chosen_on_the_evaluation_say_so_and_record_it(tmp_path):
    """Several --merge with --heldout-samples 0 and --eval-data were chosen on the evaluation blocks,
    whose loss of the written merge was then reported as a result, unsaid: a warning names what chose it,
    the summary and the card say so, the figure is marked in-domain, and the blocks are recorded as
    fitted on (so `headtool eval` starts after them)."""
    src = save_tiny("llama", tmp_path / "src", num_key_value_heads=4)
    out = tmp_path / "out"
    r = _cli(src, "--kv-heads", 2, "--merge", "mean,fit", "--data", "builtin:pydoc", "--max-samples", 4,
             "--seq-len", 16, "--heldout-samples", 0, "--eval-data", "builtin:licenses", "--eval-samples", 2,
             "-o", out, "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    losses = {x["method"]: x["eval"]["loss"] for x in doc["results"]}
    assert doc["chosen"] == min(losses, key=losses.get) and doc["chosen_on"] == "eval_data"
    assert doc["eval_data"]["in_domain"] is True
    err = " ".join(r.stderr.split())
    assert "warning:" in err and "chosen on the --eval-data blocks of builtin:licenses" in err
    assert "which chose the merge" in err
    meta = json.loads((out / "headtool.json").read_text())
    assert meta["summary"]["chosen_on"] == "eval_data"
    fitted = {e["source"]: e["blocks"] for e in meta["data_read"] if e["role"] == "fit"}
    assert fitted["builtin:licenses"] == 2 and fitted["builtin:pydoc"] == 4
    card = (out / "README.md").read_text()
    assert "chosen on the evaluation blocks" in card


@pytest.mark.parametrize("command", [["convert-gqa", "--kv-heads", "2", "--merge", "fit"],
                                     ["convert-mla", "--kv-rank", "4"]])
def test_card_says_what_judged_the_refit_without_held_out_blocks(tmp_path, command):
    """The card said each layer's refit was 'chosen on held-out blocks of `the calibration data`' with
    --heldout-samples 0: there were none; it was judged on the calibration blocks it was fitted to."""
    src = save_tiny("llama", tmp_path / "src", num_key_value_heads=4)
    r = runner.invoke(app, [command[0], str(src), *command[1:], "--data", "builtin:pydoc", "--max-samples", "4",
                            "--seq-len", "16", "--heldout-samples", "0", "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.stderr
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Output-projection refit per layer" in card
    assert "held-out blocks of `the calibration data`" not in card
    assert "calibration blocks it was fitted to: no held-out blocks, --heldout-samples 0" in card


def test_one_merge_or_held_out_blocks_choose_without_the_evaluation(tmp_path):
    src = save_tiny("llama", tmp_path / "src", num_key_value_heads=4)
    r = _cli(src, "--kv-heads", 2, "--merge", "mean,fit", "--data", "builtin:pydoc", "--max-samples", 8,
             "--seq-len", 16, "--heldout-samples", 2, "--eval-data", "builtin:licenses", "--eval-samples", 2,
             "-o", tmp_path / "out", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["chosen_on"] == "heldout_data" and doc["eval_data"]["in_domain"] is False
    assert "warning:" not in r.stderr
    meta = json.loads((tmp_path / "out" / "headtool.json").read_text())
    assert [e["role"] for e in meta["data_read"] if e["source"] == "builtin:licenses"] == ["eval"]


@pytest.mark.parametrize("command", [["convert-gqa", "--kv-heads", "2"], ["convert-mla", "--kv-rank", "4"]])
@pytest.mark.parametrize("anchor", ["auto", "0,1"])
def test_anchor_candidates_without_held_out_blocks_exit_2(tmp_path, command, anchor):
    """--anchor auto (or a list) with --heldout-samples 0 chose each layer's anchor on the calibration
    blocks the refit was fitted to (where the weakest anchor fits best), unsaid: refused now."""
    src = save_tiny("llama", tmp_path / "src", num_key_value_heads=4)
    r = runner.invoke(app, [command[0], str(src), *command[1:], "--anchor", anchor, "--heldout-samples", "0",
                            "-o", str(tmp_path / "out")])
    assert r.exit_code == 2, r.stderr
    assert f"--anchor {anchor}" in r.stderr and "--heldout-samples 0" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_one_anchor_without_held_out_blocks_is_allowed():
    from headtool.workflows.requests import ConvertRequest, LatentRequest

    for anchor in ("1", "0.1,inf"):
        ConvertRequest(model="m", kv_heads=1, anchor=anchor, heldout_samples=0, output="o").validate()
        LatentRequest(model="m", kv_rank=4, anchor=anchor, heldout_samples=0, output="o").validate()


def test_help_and_refusal_name_the_families_convert_gqa_converts(tmp_path):
    """--help said it converts MHA to GQA while gpt2/opt/bert (MHA) were refused with 'use prune': both
    name the families whose config has a KV-head setting now, the list the adapter registry gives."""
    import re

    import typer.main

    from headtool.arch import kv_head_families

    text = " ".join(typer.main.get_command(app).commands["convert-gqa"].help.split())
    listed = re.search(r"Families whose config sets the KV heads, MHA checkpoints included: ([^.]+)\.", text)
    assert listed and listed.group(1).split(", ") == kv_head_families()
    for family, instead in (("gpt2", "convert-mla"), ("opt", "convert-mla"), ("bert", "prune")):
        src = save_tiny(family, tmp_path / family)
        r = _cli(src, "--kv-heads", 2, "-o", tmp_path / "out")
        line = " ".join(r.stderr.split())
        assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"convert-gqa converts {', '.join(kv_head_families())}" in line and instead in line
        assert ("convert-mla" in line) is (family != "bert")


def test_a_conversion_without_calibration_takes_the_block_options_of_its_evaluation(tmp_path):
    """--merge mean (contiguous, no refit) reads no calibration data, so its data options were all
    refused, --seq-len too, though --eval-data's blocks are cut with it: the evaluation could only
    run at the default 128 tokens. --seq-len, --batch-size and --seed apply to it now; the others
    (and these without --eval-data) are still refused."""
    src = save_tiny("llama", tmp_path / "src", num_key_value_heads=4)
    r = _cli(src, "--kv-heads", 2, "--merge", "mean", "--eval-data", "builtin:licenses", "--eval-samples", 2,
             "--seq-len", 16, "--batch-size", 1, "--seed", 3, "-o", tmp_path / "out", "--json")
    assert r.exit_code == 0, r.stderr
    ev = json.loads(r.stdout)["eval_data"]
    assert (ev["seq_len"], ev["seed"], ev["samples"]) == (16, 3, 2)
    for args in (["--eval-data", "builtin:licenses", "--max-samples", 4], ["--seq-len", 16]):
        r = _cli(src, "--kv-heads", 2, "--merge", "mean", *args, "-o", tmp_path / "no")
        assert r.exit_code == 2 and "reads no data" in r.stderr and args[-2] in r.stderr, r.stderr
