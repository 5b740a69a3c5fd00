"""convert-mla --kv-cache: a budget in cache bytes, split across layers uniformly or by the layers'
weighted spectra (--rank-allocation auto, as CARE); exactly one of --kv-rank / --kv-cache."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tiny_models import sample_ids, save_tiny, tiny_model

from headtool.arch import adapter_for
from headtool.cli.app import app
from headtool.measure.calibration import attention_input_grams
from headtool.surgery import latent as L
from headtool.workflows import requests

runner = CliRunner()
TODAY = 3 * 2 * 2 * 8 * 4  # tiny llama: 3 layers, 2 KV heads of 8 dims, K and V, fp32 bytes


def _cli(src, out, *args):
    return runner.invoke(app, ["convert-mla", str(src), "--rope-dim", "4", "--max-samples", "4", "--seq-len", "16",
                               "--no-refit", "-o", str(out), "--json", *map(str, args)])


@pytest.mark.parametrize("fraction", [0.5, 0.4])
def test_the_budget_is_met_uniform_below_it_auto_exactly(tmp_path, fraction):
    src = save_tiny("llama", tmp_path / "src")
    dims = int(fraction * TODAY / 4)  # whole cache dims within the budget (48 at 0.5, 38 at 0.4)
    for alloc in ("uniform", "auto"):
        out = tmp_path / f"{alloc}-{fraction}"
        r = _cli(src, out, "--kv-cache", fraction, "--rank-allocation", alloc)
        assert r.exit_code == 0, r.stderr
        doc = json.loads(r.stdout)
        used = doc["after"]["kv_cache_bytes_per_token"]
        assert used == sum((k + 4) * 4 for k in doc["kv_rank"]) <= fraction * TODAY
        if alloc == "auto":
            assert used == dims * 4 and sum(doc["kv_rank"]) == dims - 3 * 4
        else:
            assert doc["kv_rank"] == [(dims - 12) // 3] * 3
        meta = json.loads((out / "headtool.json").read_text())
        assert meta["kv_rank"] == doc["kv_rank"] and meta["rank_allocation"] == alloc
        assert meta["options"]["kv_cache"] == fraction
        assert "KV cache budget" in r.stderr


def test_ranks_for_a_budget_stay_within_each_layers_full_rank():
    """A prune can leave layers with fewer KV heads (full rank 2 x KV heads x head_dim): uniform stops at
    a small layer's full rank, auto's start spreads the whole total within every layer's."""
    from headtool.arch import LayerHeads

    geometry = [LayerHeads(3, 3, 8), LayerHeads(2, 2, 8), LayerHeads(4, 4, 8)]  # full ranks 48, 32, 64
    assert L.ranks_for_budget(geometry, 0.75, 0) == [36, 32, 36]
    start = L.ranks_for_budget(geometry, 0.75, 0, "auto")
    assert sum(start) == 108 and all(r <= top for r, top in zip(start, (48, 32, 64))), start
    assert L.ranks_for_budget(geometry, 1.0, 0, "auto") == [48, 32, 64]
    assert L.ranks_for_budget(geometry[:1] * 3, 0.5, 0, "auto") == [24, 24, 24]


@pytest.mark.parametrize("alloc", ["uniform", "auto"])
def test_a_budget_converts_a_prune_that_left_layers_different_kv_heads(tmp_path, alloc):
    """GPT-2 pruned to 3 / 2 / 4 heads (each its own KV head): --kv-cache 0.75 asked a uniform 36 of
    the 2-head layer, whose full rank is 32, and refused it as '--kv-rank 36' (never given); auto's
    even start did the same before its allocation ran."""
    src = save_tiny("gpt2", tmp_path / "src")
    pruned = tmp_path / "pruned"
    assert runner.invoke(app, ["prune", str(src), "--heads", "0:0;1:1,2", "-o", str(pruned)]).exit_code == 0
    r = runner.invoke(app, ["convert-mla", str(pruned), "--kv-cache", "0.75", "--rank-allocation", alloc,
                            "--max-samples", "4", "--seq-len", "16", "--no-refit", "-o", str(tmp_path / "mla"),
                            "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    today = (3 + 2 + 4) * 2 * 8 * 4
    assert doc["before"]["kv_cache_bytes_per_token"] == today
    assert doc["after"]["kv_cache_bytes_per_token"] == sum(doc["kv_rank"]) * 4 <= 0.75 * today
    assert all(k <= top for k, top in zip(doc["kv_rank"], (48, 32, 64)))
    if alloc == "auto":
        assert sum(doc["kv_rank"]) == 108
    else:
        assert doc["kv_rank"] == [36, 32, 36]


def test_one_kv_rank_on_a_prune_that_left_layers_different_kv_heads(tmp_path):
    """--rank-allocation uniform's help: the same kv_rank in every layer, or a layer's full rank where that is
    less. --kv-rank 64 on GPT-2 pruned to 3 / 2 / 4 heads (full ranks 48, 32, 64) was refused as 'must be
    between 1 and 48 in layer 0', so no --kv-rank could convert every layer exactly; it is full rank
    everywhere now (the output equals the source), and only a rank above every layer's is refused."""
    src = save_tiny("gpt2", tmp_path / "src")
    pruned = tmp_path / "pruned"
    assert runner.invoke(app, ["prune", str(src), "--heads", "0:0;1:1,2", "-o", str(pruned)]).exit_code == 0
    common = ["--max-samples", "4", "--seq-len", "16", "--no-refit", "--eval-data", "builtin:licenses",
              "--eval-samples", "2"]
    r = runner.invoke(app, ["convert-mla", str(pruned), "--kv-rank", "64", *common, "-o", str(tmp_path / "mla"),
                            "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kv_rank"] == [48, 32, 64]
    assert doc["eval_after"]["loss"] == pytest.approx(doc["eval_before"]["loss"], abs=1e-4)
    r = runner.invoke(app, ["convert-mla", str(pruned), "--kv-rank", "65", *common, "-o", str(tmp_path / "x")])
    assert r.exit_code == 2 and "--kv-rank 65: must be between 1 and 64" in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()


def test_a_ratio_is_an_exact_budget_where_its_decimal_falls_short(tmp_path):
    """--kv-cache 1/3 is a third of the cache to the byte; 0.3333 is a little less (never exceeded)."""
    src = save_tiny("llama", tmp_path / "src")
    sums = {}
    for spelled in ("1/3", "0.3333"):
        out = tmp_path / spelled.replace("/", "-")
        r = _cli(src, out, "--kv-cache", spelled, "--rank-allocation", "auto")
        assert r.exit_code == 0, r.stderr
        doc = json.loads(r.stdout)
        sums[spelled] = sum(doc["kv_rank"])
        if spelled == "1/3":
            assert doc["after"]["kv_cache_bytes_per_token"] == TODAY // 3
            assert json.loads((out / "headtool.json").read_text())["options"]["kv_cache"] == 1 / 3
    assert sums == {"1/3": 32 - 12, "0.3333": 31 - 12}
    assert requests.LatentRequest("m", kv_cache="1/3").kv_cache == requests.LatentRequest("m", kv_cache=1 / 3).kv_cache
    for bad in (float("inf"), float("nan"), True, "", "1/3/4"):  # a recipe's .inf, nan or yes; odd text
        with pytest.raises(ValueError, match=r"fraction in \(0, 1\]"):
            requests.parse_budget(bad)


def test_uniform_budget_equals_the_plain_kv_rank_run(tmp_path):
    src = save_tiny("llama", tmp_path / "src")
    assert _cli(src, tmp_path / "a", "--kv-cache", 0.5).exit_code == 0
    assert _cli(src, tmp_path / "b", "--kv-rank", 12).exit_code == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("family, args, rope", [
    ("llama", ["--kv-cache", 0.5], 6),  # 3/8 of the 16 dims a layer may hold
    ("llama", ["--kv-cache", 0.25], 2),  # 3/8 of 8 is 3: even, so 2
    ("llama", ["--kv-cache", 1], 16),  # the whole cache: every rotary dim of the 2 KV heads (exact)
    ("llama", ["--kv-rank", 6], 8),  # no budget: one head's rotary dims
    ("gpt2", ["--kv-cache", 0.25], 0),  # no RoPE, no rotary key
])
def test_the_default_rope_dim_is_three_eighths_of_the_budget(tmp_path, family, args, rope):
    from headtool.workflows.convert_mla import ROPE_SHARE

    assert ROPE_SHARE == 3 / 8
    src = save_tiny(family, tmp_path / "src")
    r = runner.invoke(app, ["convert-mla", str(src), *map(str, args), "--max-samples", "4", "--seq-len", "16",
                            "--no-refit", "-o", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["rope_dim"] == rope
    if "--kv-cache" in args:
        assert doc["after"]["kv_cache_bytes_per_token"] <= args[1] * doc["before"]["kv_cache_bytes_per_token"]


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
def test_the_whole_cache_is_exact_at_the_default_rope_dim(tmp_path, family):
    """--kv-cache 1 took 3/8 of the budget for the rotary key (12 of 32 dims a layer on the tiny
    llama): the latent was full rank but RoPE was dropped on the other slots, a max logit error of
    about 7 at today's cache size. Every rotary dim plus the full-rank latent is exactly today's cache:
    that is the default there now, and the written model gives the original's logits."""
    from transformers import AutoModelForCausalLM

    from tiny_models import logits_of

    src = save_tiny(family, tmp_path / "src")
    out = tmp_path / "out"
    r = runner.invoke(app, ["convert-mla", str(src), "--kv-cache", "1", "--max-samples", "4", "--seq-len", "16",
                            "-o", str(out), "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["after"]["kv_cache_bytes_per_token"] == doc["before"]["kv_cache_bytes_per_token"]
    ids = sample_ids(family, seed=3)
    original = AutoModelForCausalLM.from_pretrained(src).eval()
    converted = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert (logits_of(converted, ids) - logits_of(original, ids)).abs().max().item() <= 1e-4


def _heavy_middle_layer(scale: float = 6.0):
    """A tiny llama whose layer 1 has far more K/V energy than layers 0 and 2, spread over many
    directions: the K and V projections of layers 0 and 2 are cut to rank 2 (their energy sits in
    a few latent dims), layer 1's are full rank and scaled up."""
    model = tiny_model("llama", seed=4)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                if i == 1:
                    proj.weight.mul_(scale)
                else:
                    u, sv, vh = torch.linalg.svd(proj.weight, full_matrices=False)
                    proj.weight.copy_((u[:, :2] * sv[:2]) @ vh[:2])
    return model


def test_auto_gives_more_rank_where_the_spectrum_is_heavier():
    model = _heavy_middle_layer()
    ad = adapter_for(model.config)
    ids = sample_ids("llama", batch=2, seq=24, seed=7)
    grams = attention_input_grams(model, ad, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])
    auto = L.convert_model_latent(model, ad, 8, rope_dim=4, grams=grams, allocation="auto")
    ranks = auto.spec["kv_rank"]
    assert sum(ranks) == 24 and ranks[1] > ranks[0] and ranks[1] > ranks[2], ranks
    assert [x["kv_rank"] for x in auto.layers] == ranks
    after = L.summary_figures(auto.model, ad)["kv_cache_bytes_per_token_per_layer"]
    assert after == [(r + 4) * 4 for r in ranks]  # the template builds each layer at its own rank
    uniform = L.convert_model_latent(model, ad, 8, rope_dim=4, grams=grams, allocation="uniform")
    assert uniform.spec["kv_rank"] == [8, 8, 8]


def test_allocate_ranks_is_the_greedy_choice():
    spectra = [torch.tensor([9.0, 5.0, 1.0]), torch.tensor([8.0, 7.0, 6.0, 0.5])]
    assert L.allocate_ranks(spectra, 5) == [2, 3]  # after 1 each: 7, 6, 5 are the largest drops
    assert L.allocate_ranks(spectra, 2) == [1, 1]
    with pytest.raises(Exception, match="does not fit"):
        L.allocate_ranks(spectra, 8)
    assert requests.RANK_ALLOCATIONS == L.RANK_ALLOCATIONS


@pytest.mark.parametrize("args, needle", [
    (["--kv-rank", 8, "--kv-cache", 0.5], "exactly one of --kv-rank"),
    ([], "exactly one of --kv-rank"),
    (["--kv-cache", 1.5], "--kv-cache 1.5: must be a fraction in (0, 1]"),
    (["--kv-cache", 0], "--kv-cache"),
    (["--kv-cache", "4/3"], "--kv-cache 4/3: must be a fraction in (0, 1]"),
    (["--kv-cache", "a/b"], "--kv-cache a/b: give a fraction in (0, 1]"),
    (["--kv-cache", "1/0"], "--kv-cache 1/0: give a fraction in (0, 1]"),
    (["--kv-cache", 0.1], "--kv-cache 0.1: 9 cache dims per token for 3 layers cannot hold --rope-dim 4"),
    (["--kv-cache", 0.5, "--rank-allocation", "sideways"], "--rank-allocation must be one of uniform, auto"),
])
def test_bad_budgets_exit_2_with_one_line(tmp_path, args, needle):
    src = save_tiny("llama", tmp_path / "src")
    r = _cli(src, tmp_path / "out", *args)
    assert r.exit_code == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_a_recipe_takes_the_budget_and_needs_exactly_one_target(tmp_path):
    src = save_tiny("llama", tmp_path / "src")
    r = tmp_path / "r.yaml"
    r.write_text(f"model: {src}\ndata: {{seq_len: 16, max_samples: 4}}\nsteps:\n"
                 "  - convert_mla: {kv_cache: 0.5, rank_allocation: auto, rope_dim: 4, refit: false}\n")
    res = runner.invoke(app, ["run", str(r), "--dry-run", "--json"])
    assert res.exit_code == 0, res.stderr
    row = json.loads(res.stdout)["steps"][1]
    assert sum(row["kv_rank"]) == 36 and row["kv_cache_bytes_per_token"] == TODAY // 2
    assert row["kv_cache"] == 0.5 and row["rank_allocation"] == "auto"
    r.write_text(f"model: {src}\ndata: {{seq_len: 16, max_samples: 4}}\nsteps:\n"
                 "  - convert_mla: {kv_cache: 1/3, rank_allocation: auto, rope_dim: 4, refit: false}\n")
    res = runner.invoke(app, ["run", str(r), "--dry-run", "--json"])
    assert res.exit_code == 0, res.stderr
    row = json.loads(res.stdout)["steps"][1]
    assert row["kv_cache_bytes_per_token"] == TODAY // 3 and row["kv_cache"] == 1 / 3
    r.write_text(f"model: {src}\nsteps:\n  - convert_mla: {{kv_cache: 0.5, kv_rank: 4}}\n")
    res = runner.invoke(app, ["run", str(r), "--check"])
    assert res.exit_code == 2 and "exactly one target of kv_rank, kv_cache" in res.stderr


# ---------------------------------------------------------------- info, eval and inspect on MLA outputs
def test_info_and_eval_show_the_latent_not_the_source_kv_heads(tmp_path):
    src = save_tiny("llama", tmp_path / "src")
    assert _cli(src, tmp_path / "mla", "--kv-cache", 0.5, "--rank-allocation", "auto").exit_code == 0
    ranks = json.loads((tmp_path / "mla" / "headtool.json").read_text())["kv_rank"]
    r = runner.invoke(app, ["info", str(tmp_path / "mla"), "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kv_rank"] == (ranks if len(set(ranks)) > 1 else ranks[0]) and doc["rope_dim"] == 4
    assert doc["kv_cache_bytes_per_token"] == TODAY // 2
    assert doc["kv_cache_bytes_per_token_per_layer"] == [(k + 4) * 4 for k in ranks]
    assert "latent attention" in r.stderr and "KV heads  (total" not in r.stderr
    assert ", ".join(map(str, ranks)) in r.stderr or len(set(ranks)) == 1
    r = runner.invoke(app, ["eval", str(src), str(tmp_path / "mla"), "--max-samples", "2", "--seq-len", "16",
                            "--json"])
    assert r.exit_code == 0, r.stderr
    assert "12/latent" in r.stderr and json.loads(r.stdout)["results"][1]["rope_dim"] == 4


def test_per_layer_ranks_reload_with_plain_transformers(tmp_path):
    """The modeling file builds each layer at its own rank: trust_remote_code and headtool's loader agree."""
    from transformers import AutoModelForCausalLM

    from headtool.model.loading import load_model
    from tiny_models import logits_of

    model = _heavy_middle_layer()
    src = tmp_path / "src"
    model.save_pretrained(src)
    from tiny_models import tokenizer_for

    tokenizer_for("llama").save_pretrained(src)
    assert _cli(src, tmp_path / "mla", "--kv-cache", 0.5, "--rank-allocation", "auto").exit_code == 0
    ranks = json.loads((tmp_path / "mla" / "headtool.json").read_text())["kv_rank"]
    assert len(set(ranks)) > 1, ranks
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", trust_remote_code=True).eval()
    ours = load_model(str(tmp_path / "mla"), dtype="float32", device="cpu").model
    ids = sample_ids("llama", seed=3)
    assert (logits_of(remote, ids) - logits_of(ours, ids)).abs().max().item() <= 1e-5
    assert [m.kv_rank for m in remote.modules() if type(m).__name__ == "LatentAttention"] == ranks


# GPT-2 / NeoX: o_proj named otherwise; Qwen 3: normed heads
@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "qwen3"])
def test_inspect_reads_latent_attention_exactly(family, tmp_path):
    """At full rank the latent model's attention is the original's, head by head: inspect reports
    the same statistics; every query head shares the latent, so a layer is one group."""
    from headtool.io.output import write_output
    from headtool.model.loading import model_from_object

    model = tiny_model(family)
    ad = adapter_for(model.config)
    ids = sample_ids(family, batch=2, seq=24, seed=7)
    grams = L.latent_grams(model, ad, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])
    geo = ad.geometry(model.config)[0]
    rope = geo.num_kv_heads * ad.rotary_dim(model.config, geo.head_dim)
    rank = L.latent_dims(geo, 0, rope)
    conv = L.convert_model_latent(model, ad, rank, rope_dim=rope, grams=grams)
    src = save_tiny(family, tmp_path / "src")  # the same seed: the same weights, with a tokenizer
    from tiny_models import tokenizer_for

    write_output(tmp_path / "mla", model=conv.model, tokenizer=tokenizer_for(family),
                 source=model_from_object(model), meta={"operation": "convert-mla"})
    docs = []
    for m in (src, tmp_path / "mla"):
        r = runner.invoke(app, ["inspect", str(m), "--data", "builtin:pydoc", "--max-samples", "2", "--seq-len",
                                "16", "--json", "--heads", "1:2", "--plot", str(tmp_path / f"plots-{m.name}")])
        assert r.exit_code == 0, r.stderr
        docs.append(json.loads(r.stdout))
    assert (tmp_path / "plots-mla" / "attention_L1_H2.png").exists() and "one group (kv0)" in r.stderr
    a, b = docs
    for key in ("entropy", "mean_distance", "first_token_mass", "output_rms"):
        assert torch.allclose(torch.tensor(a["statistics"][key]), torch.tensor(b["statistics"][key]), atol=1e-4), key
    assert b["kv_groups"]["group_size"] == [4, 4, 4]
    if geo.num_kv_heads == geo.num_heads:  # multi-head attention has no groups to report
        assert a["kv_groups"] is None
    else:
        assert a["kv_groups"]["group_size"] == [geo.num_heads // geo.num_kv_heads] * 3
    assert b["model"]["kv_rank"] == rank


@pytest.mark.parametrize("family,rope_dim,least", [("llama", None, "9/96"), ("gpt2", None, "3/192"),
                                                    ("llama", "4", "15/96")])
def test_a_budget_too_small_names_the_least_that_fits(tmp_path, family, rope_dim, least):
    """--kv-cache 0.001 said 'raise --kv-cache or lower --rope-dim' where --rope-dim was the default 2 (the
    least RoPE allows) or 0 (GPT-2, no RoPE): no lower value exists. It names the least budget that fits,
    and --rope-dim only where a lower one is allowed."""
    src = save_tiny(family, tmp_path / "src")
    r = runner.invoke(app, ["convert-mla", str(src), "--kv-cache", "0.001",
                            *(["--rope-dim", rope_dim] if rope_dim else []), "-o", str(tmp_path / "out")])
    assert r.exit_code == 2, r.stderr
    assert f"raise --kv-cache to at least {least}" in r.stderr, r.stderr
    assert ("lower --rope-dim" in r.stderr) == (rope_dim is not None), r.stderr
    assert not (tmp_path / "out").exists()


def test_a_ratio_budget_is_shown_as_typed(tmp_path):
    """--kv-cache 1/3 was shown as '--kv-cache 0.333333' in the table (the float it is kept as)."""
    from headtool.cli.render import fraction_text

    assert [fraction_text(x) for x in (1 / 3, 0.5, 0.4, 3 / 8, 2 / 7, 0.123456789)] == \
        ["1/3", "0.5", "0.4", "0.375", "2/7", "0.123457"]
    src = save_tiny("llama", tmp_path / "src")
    r = _cli(src, tmp_path / "o", "--kv-cache", "1/3")
    assert r.exit_code == 0, r.stderr
    assert "--kv-cache 1/3:" in r.stderr, r.stderr
