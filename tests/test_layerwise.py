"""Layer-by-layer replay (sequential calibration): the same numbers as full forward passes.

References here are the plain way: full forwards of the whole model with hooks, one per layer
for the refit. The layerwise code must agree on every family, with padding, and when each
layer is moved to an execution device (the model kept elsewhere).
"""
from __future__ import annotations

import copy

import pytest
import torch

from headtool.arch import adapter_for
from headtool.measure.calibration import attention_input_grams
from headtool.surgery.compensation import (_accumulate, o_proj_matrix, ridge_solution, sequential_refit,
    set_o_proj_matrix)
from headtool.measure.layerwise import Replayer, real_tokens, record_inputs
from headtool.surgery.pruning import prune_layer
from tiny_models import ALL, sample_ids, tiny_model


def _batches(family: str, pad: bool = True) -> list[dict]:
    out = []
    for s in range(2):
        ids = sample_ids(family, batch=3, seq=12, seed=s)
        mask = torch.ones_like(ids)
        if pad:
            mask[1, :4] = 0  # left padding in one row
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _reference_grams(model, adapter, batches) -> dict[int, torch.Tensor]:
    """E[x~x~ᵀ] per layer from ordinary forwards with hooks."""
    sums, count, state = {}, 0.0, {}

    def make(i):
        def hook(mod, args):
            x = real_tokens(args[0], state["mask"]).to(torch.float64)
            xa = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
            sums[i] = sums.get(i, 0) + xa.T @ xa
        return hook

    n = adapter.num_layers(model.config)
    handles = [adapter.projection_module(model, i, "q").register_forward_pre_hook(make(i)) for i in range(n)]
    with torch.no_grad():
        for b in batches:
            state["mask"] = b["attention_mask"]
            count += float(b["attention_mask"].sum())
            model(**b)
    for h in handles:
        h.remove()
    return {i: g / count for i, g in sums.items()}


@pytest.mark.parametrize("family", ALL)
def test_layerwise_replay_gives_the_grams_of_full_forwards(family):
    model = tiny_model(family).eval()
    adapter = adapter_for(model.config)
    batches = _batches(family)
    ref = _reference_grams(model, adapter, batches)
    got = attention_input_grams(model, adapter, batches)
    assert set(got) == set(ref)
    for i in ref:
        assert torch.allclose(got[i], ref[i], rtol=1e-5, atol=1e-6), (family, i)


def test_recording_leaves_the_model_as_it_was():
    model = tiny_model("llama").eval()
    adapter = adapter_for(model.config)
    ids = sample_ids("llama")
    before = model(input_ids=ids).logits
    inputs = record_inputs(model, adapter, _batches("llama"))
    assert all("forward" not in adapter.layer_module(model, i).__dict__ for i in range(2))
    assert torch.equal(model(input_ids=ids).logits, before)
    assert inputs.num_batches == 2 and len(inputs.calls[0]) == adapter.num_layers(model.config)


def test_replay_of_every_layer_reproduces_the_last_hidden_state():
    model = tiny_model("llama").eval()
    adapter = adapter_for(model.config)
    batches = _batches("llama", pad=False)
    inputs = record_inputs(model, adapter, batches)
    replay = Replayer(inputs)
    hidden = inputs.hidden
    for i in range(adapter.num_layers(model.config)):
        hidden = replay.run(adapter.layer_module(model, i), i, hidden)
    with torch.no_grad():
        for b, h in zip(batches, hidden):
            ref = model.model.norm(h)
            out = model.model(**b).last_hidden_state
            assert torch.allclose(ref, out, atol=1e-5)


def _reference_refit(original, modified, adapter, batches, layers, damping, on_layer):
    """Sequential refit the plain way: full forwards up to each layer, targets captured first."""
    targets = {}
    for layer in layers:  # targets from the untouched original, before any change
        ys = []
        h = adapter.o_proj_module(original, layer).register_forward_hook(
            lambda m, a, o: ys.append(o.reshape(-1, o.shape[-1])[state["mask"].reshape(-1).bool()]))
        state = {}
        with torch.no_grad():
            for b in batches:
                state["mask"] = b["attention_mask"]
                original(**b)
        h.remove()
        targets[layer] = ys
    for layer in layers:
        xs, state = [], {}
        h = adapter.o_proj_module(modified, layer).register_forward_pre_hook(
            lambda m, a: xs.append(a[0].reshape(-1, a[0].shape[-1])[state["mask"].reshape(-1).bool()]))
        with torch.no_grad():
            for b in batches:
                state["mask"] = b["attention_mask"]
                modified(**b)
        h.remove()
        module = adapter.o_proj_module(modified, layer)
        stats = _accumulate(xs, targets[layer], getattr(module, "bias", None) is not None)
        columns = on_layer(modified, layer)
        stats = stats.restrict(columns)
        set_o_proj_matrix(adapter, adapter.o_proj_module(modified, layer), ridge_solution(stats, damping))


@pytest.mark.parametrize("family", ALL)
def test_sequential_refit_equals_the_plain_full_forward_refit(family):
    """Pruning one query head per layer with compensation: same weights as the O(L²) way."""
    base = tiny_model(family).eval()
    adapter = adapter_for(base.config)
    geo = adapter.geometry(base.config)
    batches = _batches(family)
    layers = list(range(len(geo)))
    from headtool.surgery.compensation import o_columns

    def on_layer_for(model):
        def on_layer(layer, stats=None, held=None):
            kept = list(range(1, geo[layer].num_heads))
            if geo[layer].num_kv_heads != geo[layer].num_heads:  # GQA: keep groups equal in size
                kept = [h for h in range(geo[layer].num_heads) if h % geo[layer].group_size != 0]
            prune_layer(model, adapter, layer, geo[layer], kept)
            return o_columns(adapter, geo[layer], kept)
        return on_layer

    ref_model = copy.deepcopy(base)
    ref_original = copy.deepcopy(base)
    _reference_refit(ref_original, ref_model, adapter, batches, layers, 1e-2,
                     lambda m, layer: on_layer_for(m)(layer))
    got = copy.deepcopy(base)
    report = sequential_refit(got, got, adapter, batches, layers=layers, damping=1e-2, anchor=0.0,
                              on_layer=on_layer_for(got))
    assert all(r["kept"] for r in report)  # the reference always applies the refit
    for layer in layers:
        w_ref = o_proj_matrix(adapter, adapter.o_proj_module(ref_model, layer))
        w_got = o_proj_matrix(adapter, adapter.o_proj_module(got, layer))
        assert torch.allclose(w_got, w_ref, rtol=1e-4, atol=1e-5), (family, layer)
    with torch.no_grad():
        a, b = ref_model(**batches[0]), got(**batches[0])
        key = "logits" if hasattr(a, "logits") else "last_hidden_state"
        assert torch.allclose(getattr(a, key), getattr(b, key), atol=1e-4)


def test_layers_visit_the_execution_device_and_go_back():
    """With a device, each layer moves there to run and returns home; results are unchanged."""
    model = tiny_model("qwen2").eval()
    adapter = adapter_for(model.config)
    batches = _batches("qwen2")
    ref = attention_input_grams(model, adapter, batches)
    seen = []
    layer0 = adapter.layer_module(model, 0)
    hook = layer0.register_forward_pre_hook(lambda m, a: seen.append(next(m.parameters()).device))
    moves = []
    real_to = layer0.to

    def spy_to(*args, **kwargs):
        moves.append(args[0] if args else kwargs.get("device"))
        return real_to(*args, **kwargs)

    layer0.to = spy_to
    try:
        got = attention_input_grams(model, adapter, batches, device="cpu")
    finally:
        hook.remove()
        del layer0.to
    assert moves and all(torch.device(d) == torch.device("cpu") for d in moves)
    assert seen and all(d.type == "cpu" for d in seen)
    for i in ref:
        assert torch.equal(got[i], ref[i])


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "phi3"])
def test_inputs_of_stops_the_layer_at_the_module_and_sees_what_a_full_run_sees(family):
    model = tiny_model(family).eval()
    adapter = adapter_for(model.config)
    inputs = record_inputs(model, adapter, _batches(family))
    replay = Replayer(inputs)
    layer, o_proj = adapter.layer_module(model, 0), adapter.o_proj_module(model, 0)
    full: list[torch.Tensor] = []
    handle = o_proj.register_forward_pre_hook(lambda m, a: full.append(a[0].clone()))
    try:
        replay.run(layer, 0, inputs.hidden)
    finally:
        handle.remove()
    after: list[str] = []  # modules that run once o_proj is reached: none may
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: after.append(n))
             for n, m in layer.named_modules() if n and "mlp" in n.lower()]
    got: dict[int, torch.Tensor] = {}
    try:
        replay.inputs_of(layer, 0, inputs.hidden, o_proj, lambda b, x: got.__setitem__(b, x.clone()))
    finally:
        for h in hooks:
            h.remove()
    assert sorted(got) == list(range(len(full)))
    assert all(torch.equal(got[b], full[b]) for b in got)
    if family != "gpt_neox":  # NeoX's parallel residual may run its MLP first; the others run it after
        assert after == []
