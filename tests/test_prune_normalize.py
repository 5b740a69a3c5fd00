"""prune --normalize: how scores compare across layers (how many heads each layer loses), and the
comparison of normalizations on held-out blocks that --compensate makes by default."""
from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from headtool.arch import adapter_for
from headtool.cli import app
from headtool.data.batches import make_batches
from headtool.data.sources import DataSpec
from headtool.errors import UsageError
from headtool.measure.evaluation import evaluate
from headtool.model.loading import load_model
from headtool.surgery.pruning import prune, trial_copy
from headtool.surgery.selection import Selection
from headtool.workflows.data_plan import ALLOCATION_BLOCKS, allocation_spec, eval_spec, part_blocks, self_blocks_read
from headtool.workflows.prune import Scored, normalizations
from headtool.workflows.requests import PruneRequest
from tiny_models import ALL, logits_of, sample_ids, save_tiny, tiny_model

runner = CliRunner()
COMMON = ["--data", "builtin:pydoc", "--max-samples", "8", "--seq-len", "16", "--batch-size", "2"]
SPEC = DataSpec(source="builtin:pydoc", max_samples=8, seq_len=16, batch_size=2)
RAW = [[0.5, 0.1, 0.2, 0.3], [0.01, 0.02, 0.03, 0.04]]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    # multi-head attention, 5 layers: the two normalizations give different allocations
    return save_tiny("llama", tmp_path_factory.mktemp("normalize") / "src", num_hidden_layers=5, num_key_value_heads=4)


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _req(**kw) -> PruneRequest:
    return PruneRequest(**{"model": "m", "fraction": 0.25, "compensate": True, "data": SPEC, **kw})


def test_auto_is_obs_with_compensate_and_compares_layer_and_none_where_obs_cannot_run():
    scored = Scored(RAW, RAW, "layer", "gradient")
    assert normalizations(_req(), scored, SPEC, "causal-lm") == ["obs"]
    assert normalizations(_req(), Scored(RAW, RAW, "none", "magnitude"), SPEC, "causal-lm") == ["obs"]
    assert normalizations(_req(), Scored(RAW, None, "layer", "gradient"), SPEC, "causal-lm") == ["obs"]
    assert normalizations(_req(anchor="0,1"), scored, SPEC, "causal-lm") == ["obs"]
    # no refit to ask (anchor inf) or one count per layer: the loss-based scores' two modes compared
    for no_obs in ({"anchor": "inf"}, {"scope": "layer"}):
        assert normalizations(_req(**no_obs), scored, SPEC, "causal-lm") == ["layer", "none"]
        assert normalizations(_req(**no_obs), Scored(RAW, RAW, "none", "magnitude"), SPEC, "causal-lm") is None
        assert normalizations(_req(**no_obs), Scored(RAW, None, "layer", "gradient"), SPEC, "causal-lm") is None
        assert normalizations(_req(**no_obs), Scored(RAW, RAW, "layer", "gradient", iterative=True), SPEC,
                              "causal-lm") is None
    assert normalizations(_req(normalize="layer,geometric,none"), scored, SPEC, "causal-lm") == \
        ["layer", "geometric", "none"]
    assert normalizations(_req(compensate=False), scored, SPEC, "causal-lm") is None
    assert normalizations(_req(threshold=0.1, fraction=None), scored, SPEC, "causal-lm") is None
    assert normalizations(_req(), scored, SPEC, "base") is None  # kl: no loss for obs or a comparison
    assert normalizations(_req(normalize="none,layer,none"), scored, SPEC, "causal-lm") == ["none", "layer"]


def test_allocation_margin_with_an_auto_that_compares_nothing_is_a_usage_error():
    scored = Scored(RAW, RAW, "layer", "gradient")
    with pytest.raises(UsageError, match="auto is obs here"):
        normalizations(_req(allocation_margin=1.0), scored, SPEC, "causal-lm")
    assert normalizations(_req(allocation_margin=1.0, anchor="inf"), scored, SPEC, "causal-lm") == ["layer", "none"]


@pytest.mark.parametrize("value, scored, message", [
    ("auto,none", Scored(RAW, RAW, "layer", "gradient"), "use auto, or one or more"),
    ("sideways", Scored(RAW, RAW, "layer", "gradient"), "use auto, or one or more"),
    ("none", Scored(RAW), "needs raw scores"),
    ("layer", Scored(RAW, RAW, "layer", "gradient", iterative=True), "iterative"),
])
def test_bad_normalize_requests_are_usage_errors(value, scored, message):
    with pytest.raises(UsageError, match=message):
        normalizations(_req(normalize=value), scored, SPEC, "causal-lm")


def test_scores_renormalize_from_the_raw_ones():
    scored = Scored([[1.0, 0.2, 0.4, 0.6], [0.2, 0.4, 0.6, 0.8]], RAW, "layer", "gradient")
    assert scored.matrix("none") == RAW and scored.matrix("layer") is scored.scores
    assert scored.matrix(None) is scored.scores
    norm = Scored(RAW, RAW, "none").matrix("layer")
    assert all(sum(v * v for v in row) == pytest.approx(1.0) for row in norm)
    # geometric: the geometric mean of the raw and the per-layer normalized score, head by head
    geo = Scored(RAW, RAW, "none").matrix("geometric")
    assert all(g == pytest.approx((r * n) ** 0.5) for gr, rr, nr in zip(geo, RAW, norm) for g, r, n in zip(gr, rr, nr))
    # so the heads each layer loses sit between the two: the 4 weakest of 8 by layer
    def lowest4(m):
        weakest = sorted((v, i) for i, row in enumerate(m) for v in row)[:4]
        return [sum(i == layer for _, i in weakest) for layer in range(2)]
    assert [lowest4(Scored(RAW, RAW, "none").matrix(m)) for m in ("none", "geometric", "layer")] == \
        [[0, 4], [1, 3], [2, 2]]


def test_the_compared_prune_writes_the_candidate_with_the_lower_heldout_loss(src, tmp_path):
    """Both candidates are recorded with their held-out loss; the written model is the one with the
    lower loss, bit for bit the model a prune with that normalization alone writes, and its loss on
    the held-out blocks (64 blocks of text sampled from the original model: the calibration read none
    of it) is the recorded one. The evaluation follows the calibration blocks of its own source."""
    r = _run("prune", src, *COMMON, "--fraction", 0.5, "--compensate", "--normalize", "layer,none",
             "--eval-data", "builtin:pydoc", "--eval-samples", 2, "-o", tmp_path / "cmp", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    alloc = doc["allocation"]
    cands = {c["normalize"]: c for c in alloc["candidates"]}
    assert set(cands) == {"layer", "none"} and alloc["heldout_blocks"] == ALLOCATION_BLOCKS
    assert alloc["compared_on"] == {"source": "self", "skip_samples": 0, "seed": 0}
    assert alloc["normalize"] == min(cands, key=lambda m: cands[m]["heldout_loss"])
    assert doc["options"]["normalize"] == alloc["normalize"]
    assert doc["eval_data"]["skip_samples"] == 8  # after the calibration blocks
    label = {"layer": "per-layer normalized scores", "none": "raw scores"}[alloc["normalize"]]
    assert f"heads per layer from {label} (--normalize {alloc['normalize']}): held-out loss" in r.stderr
    assert f"({ALLOCATION_BLOCKS} blocks of self text; ± one standard error" in " ".join(r.stderr.split())
    assert "Layer allocation: heads per layer from" in (tmp_path / "cmp" / "README.md").read_text()
    one = _run("prune", src, *COMMON, "--fraction", 0.5, "--compensate", "--normalize", alloc["normalize"],
               "--eval-data", "builtin:pydoc", "--eval-samples", 2, "-o", tmp_path / "one",
               "--json")
    assert one.exit_code == 0, one.stderr
    a, b = load_file(tmp_path / "cmp" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    single = json.loads(one.stdout)
    assert single["allocation"]["normalize"] == alloc["normalize"] and len(single["allocation"]["candidates"]) == 1
    lm, orig = load_model(str(tmp_path / "cmp"), trust_remote_code=True), load_model(str(src))

    def loss(model, source: str, skip: int, n: int) -> float:
        spec = DataSpec(source=source, max_samples=n, seq_len=16, batch_size=2, skip_samples=skip)
        return evaluate(model, make_batches(spec, lm.tokenizer, "lm", model=orig).batches, "lm")["loss"]
    held = loss(lm.model, "self", 0, ALLOCATION_BLOCKS)
    assert held == pytest.approx(cands[alloc["normalize"]]["heldout_loss"], rel=1e-5)
    assert loss(lm.model, "builtin:pydoc", 8, 2) == pytest.approx(doc["eval"]["after"]["loss"], rel=1e-5)
    assert loss(orig.model, "builtin:pydoc", 8, 2) == pytest.approx(doc["eval"]["before"]["loss"], rel=1e-5)


def test_every_other_allocation_records_its_paired_difference_from_the_chosen_one(src, tmp_path):
    """How much higher each other candidate's held-out loss was than the chosen one's, with the standard
    error of that difference over the blocks (per-block losses of both models on the same blocks), in
    headtool.json and in the allocation line: whether the choice was clear or a close call."""
    r = _run("prune", src, *COMMON, "--fraction", 0.5, "--compensate", "--normalize", "layer,geometric,none",
             "-o", tmp_path / "p", "--json")
    assert r.exit_code == 0, r.stderr
    alloc = json.loads(r.stdout)["allocation"]
    cands = {c["normalize"]: c for c in alloc["candidates"]}
    chosen = cands[alloc["normalize"]]
    assert "difference" not in chosen and "standard_error" not in chosen
    others = [c for m, c in cands.items() if c["removed_per_layer"] != chosen["removed_per_layer"]]
    assert others  # the tiny model's three allocations are not all the same
    for c in others:
        assert c["difference"] == pytest.approx(c["heldout_loss"] - chosen["heldout_loss"], abs=1e-6)
        assert c["difference"] >= 0 and 0 < c["standard_error"] < math.inf
        assert f"{c['heldout_loss']:.4f} ({c['difference']:+.4f} ± {c['standard_error']:.4f})" in \
            " ".join(r.stderr.split())
    assert "± one standard error of the paired difference" in " ".join(r.stderr.split())


def test_a_margin_keeps_the_first_mode_unless_a_later_one_wins_by_it(src, tmp_path):
    """--allocation-margin K: a later mode replaces the one kept so far only when its held-out loss is
    lower by more than K standard errors of the paired difference; no difference clears a huge margin,
    so the first mode is kept in either order; 0 (the default) keeps the lowest loss, as without it."""
    def allocation(order: str, *margin) -> dict:
        r = _run("prune", src, *COMMON, "--fraction", 0.5, "--compensate", "--normalize", order, *margin,
                 "-o", tmp_path / f"{order}{margin}", "--json")
        assert r.exit_code == 0, r.stderr
        return json.loads(r.stdout)["allocation"]

    free = allocation("layer,none")
    losses = {c["normalize"]: c["heldout_loss"] for c in free["candidates"]}
    assert free["normalize"] == min(losses, key=losses.get) and free["margin_standard_errors"] == 0
    assert allocation("layer,none", "--allocation-margin", 0)["normalize"] == free["normalize"]
    for order in ("layer,none", "none,layer"):
        strict = allocation(order, "--allocation-margin", 1e6)
        assert strict["normalize"] == order.split(",")[0] and strict["margin_standard_errors"] == 1e6


@pytest.mark.parametrize("args", [["--normalize", "layer"], [], ["--compensate"]])
def test_a_margin_without_a_comparison_is_one_line(src, tmp_path, args):
    r = _run("prune", src, *COMMON, "--fraction", 0.5, *args, "--allocation-margin", 1, "-o", tmp_path / "x")
    assert r.exit_code == 2 and "--allocation-margin weighs a comparison of normalizations" in r.stderr
    assert "Traceback" not in r.output and not (tmp_path / "x").exists()


def test_allocations_are_compared_on_self_text_the_calibration_and_evaluation_did_not_read():
    """64 blocks of self text after every self block the calibration (and an evaluation on self text)
    read; a model that cannot sample compares on a quarter of the calibration's source after it, and
    --heldout-data (without --compensate, which would make it the refit's held-out blocks) on that."""
    mix = DataSpec(source="builtin:pydoc+self", max_samples=64, seq_len=16, seed=3)
    assert self_blocks_read(mix, 80) == 40 and self_blocks_read(SPEC, 12) == 0
    assert self_blocks_read(DataSpec(source="self:10"), 16) == 10
    cspec, taken = allocation_spec(mix, 80, True)
    assert (cspec.source, cspec.skip_samples, cspec.max_samples, cspec.seed, taken) == ("self", 40, 64, 3, 0)
    after = DataSpec(source="self", max_samples=16, skip_samples=40)
    assert allocation_spec(mix, 80, True, after=after)[0].skip_samples == 56
    cspec, taken = allocation_spec(mix, 80, False)
    assert (cspec.source, cspec.skip_samples, cspec.max_samples, taken) == ("builtin:pydoc+self", 80, 16, 16)
    cspec, taken = allocation_spec(mix, 80, True, heldout_data="builtin:licenses")  # a source named to judge on
    assert (cspec.source, cspec.skip_samples, cspec.max_samples, taken) == ("builtin:licenses", 0, 16, 0)


def test_longer_blocks_judge_on_the_same_tokens_of_self_text_not_more():
    """64 blocks of 128 tokens (or fewer tokens each); longer blocks fewer of them, 8,192 tokens in all
    and at least 4 blocks: 64 blocks of 2,048 tokens would be 131k tokens to sample."""
    def judged(seq_len: int) -> int:
        return allocation_spec(DataSpec(source="builtin:pydoc+self", max_samples=64, seq_len=seq_len), 80,
                               True)[0].max_samples
    assert [judged(n) for n in (16, 128, 256, 512, 2048, 4096)] == [64, 64, 32, 16, 4, 4]


def test_allocations_compared_without_a_refit_are_judged_on_the_heldout_data_named(src, tmp_path):
    r = _run("prune", src, *COMMON, "--fraction", 0.5, "--normalize", "layer,none", "--heldout-data",
             "builtin:licenses", "-o", tmp_path / "p", "--json")
    assert r.exit_code == 0, r.stderr
    alloc = json.loads(r.stdout)["allocation"]
    assert alloc["compared_on"]["source"] == "builtin:licenses" and alloc["heldout_blocks"] == 4


def test_an_evaluation_on_self_text_starts_after_the_self_blocks_of_a_mixed_calibration():
    """--eval-data self after --data builtin:pydoc+self: the evaluation's self text starts after the
    blocks the calibration read (it started at the first of them: a flattering evaluation)."""
    mix = DataSpec(source="builtin:pydoc+self", max_samples=8, seq_len=16)
    assert part_blocks(mix, "self", 10) == 5 and part_blocks(DataSpec(source="a.txt+self:3"), "self:3", 10) == 3
    espec, skip = eval_spec(mix, "self", 4, 10)
    assert (espec.source, skip, espec.skip_samples) == ("self", 5, 5)


def test_the_default_with_compensate_is_obs_and_a_recipe_step_does_the_same(src, tmp_path):
    cli = _run("prune", src, *COMMON, "--fraction", 0.5, "--compensate", "-o", tmp_path / "cli", "--json")
    assert cli.exit_code == 0, cli.stderr
    alloc = json.loads(cli.stdout)["allocation"]
    assert alloc["normalize"] == "obs" and [c["normalize"] for c in alloc["candidates"]] == ["obs"]
    assert len(alloc["obs"]["layer_sensitivity"]) == 5
    explicit = _run("prune", src, *COMMON, "--fraction", 0.5, "--compensate", "--normalize", "obs", "-o",
                    tmp_path / "obs")
    assert explicit.exit_code == 0, explicit.stderr
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == \
        (tmp_path / "obs" / "model.safetensors").read_bytes()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\ndata: {{source: 'builtin:pydoc', max_samples: 8, seq_len: 16, batch_size: 2}}\n"
                      "steps:\n  - score: {}\n  - prune: {fraction: 0.5, compensate: true}\n")
    rec = _run("run", recipe, "-o", tmp_path / "rec", "--json")
    assert rec.exit_code == 0, rec.stderr
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == \
        (tmp_path / "rec" / "model.safetensors").read_bytes()


def test_a_score_document_is_renormalized_from_its_raw_scores(src, tmp_path):
    """--normalize none on a document scored with per-layer normalization removes the heads a document
    whose scores are its raw scores removes."""
    scores, raw_doc = tmp_path / "s.json", tmp_path / "raw.json"
    assert _run("score", src, *COMMON, "-o", scores).exit_code == 0
    doc = json.loads(scores.read_text())
    assert doc["normalize"] == "layer" and doc["scores"] != doc["raw_scores"]
    raw_doc.write_text(json.dumps({**doc, "scores": doc["raw_scores"], "normalize": "none"}))
    runs = [_run("prune", src, "--scores", d, "--fraction", 0.5, *extra, "--dry-run", "--json")
            for d, extra in ((scores, ["--normalize", "none"]), (raw_doc, []), (scores, []))]
    assert all(r.exit_code == 0 for r in runs), [r.stderr for r in runs]
    kept = [json.loads(r.stdout)["kept_heads"] for r in runs]
    assert kept[0] == kept[1] and kept[0] != kept[2]


def test_comparing_without_data_is_one_line(src, tmp_path):
    scores = tmp_path / "s.json"
    assert _run("score", src, *COMMON, "-o", scores).exit_code == 0
    r = _run("prune", src, "--scores", scores, "--fraction", 0.5, "--normalize", "layer,none", "-o", tmp_path / "x")
    assert r.exit_code == 2 and "held-out blocks" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists()


def test_streaming_takes_the_scores_as_scored(src, tmp_path):
    scores = tmp_path / "s.json"
    assert _run("score", src, *COMMON, "-o", scores).exit_code == 0
    r = _run("prune", src, "--scores", scores, "--fraction", 0.5, "--normalize", "none", "--streaming",
             "-o", tmp_path / "x")
    assert r.exit_code == 2 and "--streaming takes the scores as they were scored" in r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family", ALL)
def test_a_trial_copy_owns_only_the_attention_and_a_refit_prune_on_it_leaves_the_original_untouched(family):
    # comparing allocations prunes the earlier candidates on trial copies: they must cost the attention's
    # memory only, and nothing a trial prune rewrites (in place, as the refit does) may reach the original
    original = tiny_model(family).eval()
    adapter = adapter_for(original.config)
    geo = adapter.geometry(original.config)
    before = {k: v.clone() for k, v in original.state_dict().items()}
    ids = sample_ids(family, batch=2, seq=12)
    logits = logits_of(original, ids)
    trial = trial_copy(original, adapter)

    mine = {id(p) for p in original.parameters()}
    copied = [n for n, p in trial.named_parameters() if id(p) not in mine]
    shared = [n for n, p in trial.named_parameters() if id(p) in mine]
    heads = {adapter.layer_prefix(trial, i) + t.name for i in range(len(geo)) for t in adapter.tensors}
    assert heads & set(dict(trial.named_parameters())) <= set(copied)  # every head-carrying tensor is its own
    assert trial.get_input_embeddings().weight is original.get_input_embeddings().weight
    assert any(".mlp." in n or "intermediate" in n or ".fc1." in n for n in shared)  # the feed-forward weights
    numel = {n: p.numel() for n, p in trial.named_parameters()}
    assert sum(numel[n] for n in copied) < 0.5 * sum(numel.values())

    # one query head fewer in every KV group (GQA), or head 0 with its K/V (one query head per group)
    kept = [tuple(q for q in range(g.num_heads) if q % g.group_size or (q and g.group_size == 1)) for g in geo]
    calib = [{"input_ids": sample_ids(family, batch=2, seq=12, seed=5), "attention_mask": torch.ones(2, 12,
                                                                                                 dtype=torch.long)}]
    reference = copy.deepcopy(original)
    for model in (trial, reference):
        prune(SimpleNamespace(model=model, adapter=adapter), Selection.from_kept(geo, kept), calib_batches=calib,
              compensate=True, refit_layers="all", anchor=0.0)
    assert all(torch.equal(v, before[k]) for k, v in original.state_dict().items())
    assert torch.equal(logits_of(original, ids), logits)
    assert adapter.geometry(original.config) == geo
    assert torch.equal(logits_of(trial, ids), logits_of(reference, ids))  # the trial prunes as a full copy does
    assert not torch.equal(logits_of(trial, ids), logits)
