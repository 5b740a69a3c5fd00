"""prune --normalize obs: heads per layer from the error the refit leaves, weighted by each layer's loss
sensitivity (surgery/obs_allocation.py)."""
from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from typer.testing import CliRunner

from headtool.arch import adapter_for
from headtool.cli import app
from headtool.data.batches import make_batches
from headtool.data.sources import DataSpec
from headtool.measure.scoring import score_heads
from headtool.surgery.obs_allocation import SensitivityProbe, layer_errors, layer_sensitivity, split_counts
from tiny_models import ALL, checkpoint_tensors, save_tiny, tiny_model, tokenizer_for

runner = CliRunner()
COMMON = ["--data", "builtin:pydoc", "--max-samples", "8", "--seq-len", "16", "--batch-size", "2"]
SPEC = DataSpec(source="builtin:pydoc", max_samples=4, seq_len=16, batch_size=2)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("obs") / "src", num_hidden_layers=4, num_key_value_heads=4)


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("seed", range(6))
def test_split_is_the_cheapest_exact_split(seed):
    """The dynamic programme finds the exact optimum a brute force over every choice finds."""
    rng = random.Random(seed)
    counts = [[0] + sorted(rng.sample(range(1, 5), rng.randint(0, 3))) for _ in range(4)]
    costs = [[0.0] + [rng.random() * n for n in c[1:]] for c in counts]
    for total in range(0, 13):
        options = [(sum(counts[i][k] for i, k in enumerate(ks)), sum(costs[i][k] for i, k in enumerate(ks)))
                   for ks in itertools.product(*[range(len(c)) for c in counts])]
        feasible = [c for n, c in options if n == total]
        got = split_counts(costs, counts, total)
        if not feasible:
            assert got is None
            continue
        assert sum(got) == total and all(n in c for n, c in zip(got, counts))
        assert sum(costs[i][counts[i].index(n)] for i, n in enumerate(got)) == pytest.approx(min(feasible))


def test_sensitivity_is_the_gradient_at_the_attention_output():
    """The squared gradient taken through a zero added to each output projection's output equals the one
    autograd gives that output directly, and the Gram is that of the projection's input."""
    model = tiny_model("llama").eval()
    adapter = adapter_for(model.config)
    batches = make_batches(SPEC, tokenizer_for("llama"), "lm").batches
    got = layer_sensitivity(model, adapter, batches, "lm")
    layers = adapter.num_layers(model.config)
    outs, ins = {}, {i: [] for i in range(layers)}
    handles = []
    for i in range(layers):
        o = adapter.o_proj_module(model, i)
        handles.append(o.register_forward_hook(lambda m, a, out, i=i: outs.__setitem__(i, out)))
        handles.append(o.register_forward_pre_hook(lambda m, a, i=i: ins[i].append(a[0].detach().double())))
    energy = [0.0] * layers
    for b in batches:
        out = model(input_ids=b["input_ids"], labels=b["labels"])
        grads = torch.autograd.grad(out.loss, [outs[i] for i in range(layers)])
        energy = [e + float(g.double().pow(2).sum()) for e, g in zip(energy, grads)]
    for h in handles:
        h.remove()
    assert got.gradient_energy == pytest.approx(energy, rel=1e-4)
    assert all(e > 0 for e in got.gradient_energy)
    for i in range(layers):
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in ins[i]])
        assert torch.allclose(got.grams[i], x.T @ x, rtol=1e-6, atol=1e-8)
    assert all(not p.grad_fn and p.grad is None for p in model.parameters())  # nothing trained, nothing left


@pytest.mark.parametrize("family", ALL)
def test_sensitivity_rides_on_the_scoring_pass(family):
    """A SensitivityProbe attached to gradient scoring measures what obs's own pass measures (Grams to
    rounding, energies to 1e-6: the scoring loss is the sum, rescaled per batch), and the scores are those
    of scoring without it, bit for bit (the zeros it adds change no value and no gradient)."""
    model = tiny_model(family).eval()
    adapter = adapter_for(model.config)
    objective = "mlm" if family in ("bert", "roberta") else "lm"
    batches = make_batches(SPEC, tokenizer_for(family), objective).batches
    alone = layer_sensitivity(model, adapter, batches, objective)
    probe = SensitivityProbe(model, adapter)
    with_probe = score_heads(model, adapter, batches, method="gradient", objective=objective, probe=probe)
    plain = score_heads(model, adapter, batches, method="gradient", objective=objective)
    assert with_probe.raw_scores == plain.raw_scores and with_probe.scores == plain.scores
    got = probe.result()
    assert got.tokens == alone.tokens and all(e > 0 for e in got.gradient_energy)
    assert got.gradient_energy == pytest.approx(alone.gradient_energy, rel=1e-6)
    for g, a in zip(got.grams, alone.grams):
        assert torch.allclose(g, a, rtol=1e-9, atol=1e-12)
    assert all(not p.grad_fn and p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="one round"):
        score_heads(model, adapter, batches, method="ablation", objective=objective, probe=SensitivityProbe(model, adapter))


def test_prune_scores_and_allocates_on_one_pass(src, tmp_path):
    """`prune --compensate` (obs by default) takes obs's sensitivity from its scoring pass and writes the model a
    prune with the same scores from a document (obs then runs its own pass) writes: the pass is saved, the
    result is the same."""
    one, two, doc = tmp_path / "one", tmp_path / "two", tmp_path / "scores.json"
    r = _run("prune", src, "--fraction", "0.5", "--compensate", *COMMON, "-o", one)
    assert r.exit_code == 0, r.output
    obs = json.loads((one / "headtool.json").read_text())["summary"]["allocation"]["obs"]
    assert obs["sensitivity_from"] == "the scoring pass"
    assert _run("score", src, *COMMON, "-o", doc).exit_code == 0
    r = _run("prune", src, "--fraction", "0.5", "--compensate", "--scores", doc, *COMMON, "-o", two)
    assert r.exit_code == 0, r.output
    own = json.loads((two / "headtool.json").read_text())["summary"]["allocation"]["obs"]
    assert "sensitivity_from" not in own
    assert own["layer_sensitivity"] == pytest.approx(obs["layer_sensitivity"], rel=1e-5)
    a, b = checkpoint_tensors(one), checkpoint_tensors(two)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_head_the_refit_can_rebuild_costs_nothing():
    """Layer 0's head 1 made a copy of head 0 (same q, k, v): removing either leaves no error once the other
    head's output columns take both (a weak anchor), while any other head costs something."""
    model = tiny_model("llama", num_key_value_heads=4).eval()
    adapter = adapter_for(model.config)
    geo = adapter.geometry(model.config)[0]
    attn = adapter.layer_module(model, 0).self_attn
    d = geo.head_dim
    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight[d:2 * d] = proj.weight[:d]
    batches = make_batches(SPEC, tokenizer_for("llama"), "lm").batches
    sens = layer_sensitivity(model, adapter, batches, "lm", layers=[0])
    one = layer_errors(model, adapter, [geo], [g / sens.tokens for g in sens.grams], [[0, 1, 2]], "query",
                       damping=1e-9, anchor=1e-9)[0]
    assert one[0] == 0.0
    # the cheapest single head is one of the copies, at (numerically) no cost; a second head costs more
    assert one[1] < 1e-6 * one[2] and one[2] > 0


def test_prune_with_obs_records_the_allocation(src, tmp_path):
    out = tmp_path / "out"
    r = _run("prune", src, "--fraction", "0.5", "--compensate", "--normalize", "obs", *COMMON, "-o", out, "--json")
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "headtool.json").read_text())
    a = meta["summary"]["allocation"]
    assert a["normalize"] == "obs" and len(a["obs"]["layer_sensitivity"]) == 4
    assert all(v > 0 for v in a["obs"]["layer_sensitivity"])
    removed = a["candidates"][0]["removed_per_layer"]
    assert sum(removed) == 8 and removed[0] == 0  # half of 16 heads; the first layer protected
    layer = _run("prune", src, "--fraction", "0.5", "--compensate", "--normalize", "layer", *COMMON, "--dry-run",
                 "--json")
    assert layer.exit_code == 0, layer.output
    assert sum(json.loads(layer.stdout)["allocation"]["candidates"][0]["removed_per_layer"]) == 8
    assert "refit errors weighted by loss sensitivity" in r.stderr


def test_obs_compared_with_a_normalization(src):
    r = _run("prune", src, "--fraction", "0.5", "--compensate", "--normalize", "obs,layer", *COMMON, "--dry-run",
             "--json")
    assert r.exit_code == 0, r.output
    a = json.loads(r.stdout)["allocation"]
    assert [c["normalize"] for c in a["candidates"]] == ["obs", "layer"]
    assert "obs" in a and a["normalize"] in ("obs", "layer")


@pytest.mark.parametrize("args, needle", [
    (["--fraction", "0.5"], "needs --compensate"),
    (["--threshold", "0.1", "--compensate"], "not --threshold"),
    (["--fraction", "0.5", "--compensate", "--scope", "layer"], "--scope layer"),
    (["--fraction", "0.5", "--compensate", "--anchor", "inf"], "--anchor"),
])
def test_obs_usage_errors(src, args, needle):
    r = _run("prune", src, "--normalize", "obs", *args, *COMMON, "--dry-run")
    assert r.exit_code == 2 and needle in r.stderr, r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("family", ["gpt2", "opt", "bert", "gemma2", "phi3", "qwen3"])
def test_obs_on_other_families(family, tmp_path):
    """Fused or transposed output projections (GPT-2's Conv1D, Phi-3), biases (OPT, BERT), masked-LM
    loss (BERT), per-head norms (Qwen 3), soft-capping (Gemma 2): the same counts logic runs."""
    folder = save_tiny(family, tmp_path / family)
    r = _run("prune", folder, "--fraction", "0.25", "--compensate", "--normalize", "obs", *COMMON, "--dry-run",
             "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    a = doc["allocation"]
    assert a["normalize"] == "obs" and all(v > 0 for v in a["obs"]["layer_sensitivity"])
    assert sum(a["candidates"][0]["removed_per_layer"]) == doc["heads_removed"] > 0


def test_anchor_power_is_recorded_and_needs_compensate(src, tmp_path):
    out = tmp_path / "out"
    r = _run("prune", src, "--fraction", "0.5", "--compensate", "--anchor-power", "2", *COMMON, "-o", out)
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "headtool.json").read_text())
    assert meta["options"]["anchor_power"] == 2.0 and meta["summary"]["allocation"]["normalize"] == "obs"
    kept = {i: len(k) for i, k in enumerate(meta["kept_heads"])}
    rows = [c for c in meta["summary"]["compensation"] if c["anchor"] is not None]
    assert rows and all(c["anchor"] == pytest.approx((kept[c["layer"]] / 4) ** 2) for c in rows)
    # the counts (and the heads) are chosen at the anchor itself: the power only frees the refit
    plain = _run("prune", src, "--fraction", "0.5", "--compensate", *COMMON, "-o", tmp_path / "plain")
    assert plain.exit_code == 0, plain.output
    assert json.loads((tmp_path / "plain" / "headtool.json").read_text())["kept_heads"] == meta["kept_heads"]
    bad = _run("prune", src, "--fraction", "0.5", "--anchor-power", "2", *COMMON, "--dry-run")
    assert bad.exit_code == 2 and "--anchor-power" in bad.stderr and "needs --compensate" in bad.stderr
    assert "Traceback" not in bad.output


def test_compensate_defaults_to_the_measured_anchor_power(src, tmp_path):
    """--compensate without --anchor-power refits at the default power for its calibration, few tokens here
    (the same model, bit for bit, as giving it; headtool.json and the summary say which), --anchor-power 0
    refits every layer at the anchor itself, and a prune without a refit records no power."""
    from safetensors.torch import load_file

    from headtool.surgery.prune_defaults import DEFAULT_PRUNE_DAMPING, FEW_TOKENS_ANCHOR_POWER

    def prune_to(name, *extra):
        r = _run("prune", src, "--fraction", "0.5", *extra, *COMMON, "-o", tmp_path / name)
        assert r.exit_code == 0, r.output
        meta = json.loads((tmp_path / name / "headtool.json").read_text())
        said[name] = r.stderr
        return meta, load_file(str(tmp_path / name / "model.safetensors"))

    said: dict[str, str] = {}
    default, w_default = prune_to("default", "--compensate")
    given, w_given = prune_to("given", "--compensate", "--anchor-power", f"{FEW_TOKENS_ANCHOR_POWER:g}")
    line = f"refit at --anchor-power {FEW_TOKENS_ANCHOR_POWER:g}, the default on fewer than"
    assert line in " ".join(said["default"].split()) and "refit at --anchor-power" not in said["given"]
    zero, w_zero = prune_to("zero", "--compensate", "--anchor-power", "0")
    assert default["options"]["anchor_power"] == FEW_TOKENS_ANCHOR_POWER and zero["options"]["anchor_power"] == 0
    assert default["options"]["damping"] == DEFAULT_PRUNE_DAMPING
    assert w_default.keys() == w_given.keys() and all(torch.equal(w_default[k], w_given[k]) for k in w_default)
    assert any(not torch.equal(w_default[k], w_zero[k]) for k in w_default)
    assert {c["anchor"] for c in zero["summary"]["compensation"] if c["anchor"] is not None} == {1.0}
    plain, _ = prune_to("plain")
    assert plain["options"]["anchor_power"] is None
