"""convert-mla: exact at full rank (plain, absorbed, cached generation), RoRoPE changes nothing,
outputs reload with plain transformers, reduced ranks cache what they report, the CLI."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import needs_smollm2
from tiny_models import logits_of, sample_ids, save_tiny, tiny_model

from headtool.arch import adapter_for
from headtool.cli.app import app
from headtool.errors import UsageError
from headtool.measure.calibration import attention_input_grams
from headtool.model.latent import LatentAttention
from headtool.surgery import latent as L
from headtool.surgery import merging as C

# plain, sliding window unset, q/k/v biases, Gemma (MQA), Gemma 2 (soft-capped scores, sliding
# layers), Phi-3 (fused qkv), GPT-NeoX (interleaved fused qkv, partial rotary, parallel residual,
# the cache named layer_past), GPT-2 (Conv1D, learned positions: no rotary key), OPT (learned
# positions, biases everywhere), Qwen 3 and Gemma 3 (q and k RMS-normed per head: the latent is
# taken over the normed keys and the values; Gemma 3 with sliding and global layers)
LATENT_FAMILIES = ["llama", "mistral", "qwen2", "gemma", "gemma2", "phi3", "gpt_neox", "gpt2", "opt", "qwen3",
                   "gemma3_text"]


def _grams(model, family: str):
    ids = sample_ids(family, batch=2, seq=24, seed=7)
    return L.latent_grams(model, adapter_for(model.config), [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])


def _full(model):
    """(kv_rank, rope_dim) at which the conversion is exact."""
    ad = adapter_for(model.config)
    g = ad.geometry(model.config)[0]
    rot = ad.rotary_dim(model.config, g.head_dim)
    return L.latent_dims(g, rot, g.num_kv_heads * rot), g.num_kv_heads * rot


def _small_rope(model, dims: int = 4) -> int:
    """A compressing --rope-dim: `dims`, or 0 where the family has no RoPE."""
    ad = adapter_for(model.config)
    return dims if ad.rotary_dim(model.config, ad.geometry(model.config)[0].head_dim) else 0


def _absorb(model, value) -> None:
    n = 0
    for m in model.modules():
        if isinstance(m, LatentAttention):
            m.absorb = value
            n += 1
    assert n == model.config.num_hidden_layers


def _generate(model, ids, n=8):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          min_new_tokens=n)


@pytest.mark.parametrize("family, extra", [(f, {}) for f in LATENT_FAMILIES] + [
    ("phi3", {"partial_rotary_factor": 0.5}),  # dims that never rotate go into the latent
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}),  # a different softmax scale per layer
    ("qwen3", {"attention_bias": True})])  # the value bias folded into the latent projection
def test_full_rank_is_exact_plain_absorbed_and_cached(family, extra):
    model = tiny_model(family, **extra)
    ad = adapter_for(model.config)
    ids = sample_ids(family, seed=3)
    ref = logits_of(model, ids)
    rank, rope = _full(model)
    conv = L.convert_model_latent(model, ad, rank, rope_dim=rope, grams=_grams(model, family))
    for absorb in (False, True):
        _absorb(conv.model, absorb)
        assert (logits_of(conv.model, ids) - ref).abs().max().item() <= 1e-4, absorb
    _absorb(conv.model, "auto")  # plain prefill, absorbed decode steps on the latent cache
    prompt = ids[:1, :6]
    assert _generate(conv.model, prompt).tolist() == _generate(model, prompt).tolist()
    assert (logits_of(model, ids) - ref).abs().max().item() == 0.0  # the input is untouched
    assert all(x["rope_energy"] == pytest.approx(1.0) and x["latent_energy"] == 1.0 for x in conv.layers)
    if ad.qk_norm:  # the value projection is folded into the latent one: the layer does not keep it
        assert not any(hasattr(m, "v_proj") for m in conv.model.modules() if isinstance(m, LatentAttention))


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_normed_head_grams_are_the_moments_of_the_normed_heads(family):
    """Qwen 3 norms q/k on [b, t, heads, d], Gemma 3 on [b, heads, t, d]: the statistics must be
    those of what the attention really uses, whatever the layout, padding left out."""
    model = tiny_model(family)
    ad = adapter_for(model.config)
    geo = ad.geometry(model.config)[0]
    H, K, d = geo.num_heads, geo.num_kv_heads, geo.head_dim
    ids = sample_ids(family, batch=2, seq=12, seed=4)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    grams = L.latent_grams(model, ad, [{"input_ids": ids, "attention_mask": mask}])
    seen = {}
    attn = ad.attention_module(model, 1)

    def grab(name, heads):
        def hook(module, args, out):
            if name != "v":
                out = out if out.shape[2] == heads else out.transpose(1, 2)  # -> [b, t, heads, d]
            seen[name] = out.reshape(2, 12, -1).double()
        return hook

    handles = [attn.q_norm.register_forward_hook(grab("q", H)), attn.k_norm.register_forward_hook(grab("k", K)),
               attn.v_proj.register_forward_hook(grab("v", K))]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    real = mask.reshape(-1).bool()
    q = seen["q"].reshape(24, H, d)[real]
    f = torch.cat([seen["k"], seen["v"]], -1).reshape(24, -1)[real]
    f = torch.cat([f, torch.ones(len(f), 1, dtype=f.dtype)], 1)
    n = float(real.sum())
    assert torch.allclose(grams[1].q, torch.einsum("nhd,nhe->hde", q, q) / n, atol=1e-5)
    assert torch.allclose(grams[1].kv, f.T @ f / n, atol=1e-5)
    assert grams[1].kv.shape == (2 * K * d + 1,) * 2


def test_eager_attention_is_exact_too():
    model = tiny_model("llama", attn_implementation="eager")
    ids = sample_ids("llama", seed=3)
    rank, rope = _full(model)
    conv = L.convert_model_latent(model, adapter_for(model.config), rank, rope_dim=rope, grams=_grams(model, "llama"))
    assert conv.model.config._attn_implementation == "eager"
    for absorb in (False, True):
        _absorb(conv.model, absorb)
        assert (logits_of(conv.model, ids) - logits_of(model, ids)).abs().max().item() <= 1e-4


_DROPOUT = {"gpt2": dict(attn_pdrop=0.2, resid_pdrop=0.2), "opt": dict(attention_dropout=0.2, dropout=0.2)}


@pytest.mark.parametrize("family", LATENT_FAMILIES)
def test_training_mode_drops_out_as_the_original(family):
    """heal trains in train mode: at full rank the latent model with the same random state drops
    out the same attention weights (and GPT-2's attention output) as the original, so a heal of a
    latent student regularizes as the source model did (it trained without either before)."""
    model = tiny_model(family, attn_implementation="eager", **_DROPOUT.get(family, dict(attention_dropout=0.2)))
    ids = sample_ids(family, seed=3)
    rank, rope = _full(model)
    conv = L.convert_model_latent(model, adapter_for(model.config), rank, rope_dim=rope, grams=_grams(model, family))
    _absorb(conv.model, False)

    def trained(m, seed: int) -> torch.Tensor:
        m.train()
        torch.manual_seed(seed)
        try:
            return logits_of(m, ids)
        finally:
            m.eval()
    ref = trained(model, 5)
    assert (trained(model, 6) - ref).abs().max().item() > 1e-3  # dropout is on: another seed differs
    assert (trained(conv.model, 5) - ref).abs().max().item() <= 1e-4


def test_rorope_rotations_alone_change_no_logits():
    """With every rotary slot kept, the per-plane unitary mixes are a change of basis of the keys:
    the tensors differ from the unmixed conversion, the logits do not."""
    model = tiny_model("llama", seed=2, num_key_value_heads=4)
    ad = adapter_for(model.config)
    ids = sample_ids("llama", seed=3)
    ref = logits_of(model, ids)
    grams = _grams(model, "llama")
    rank, rope = _full(model)
    mixed = L.convert_model_latent(model, ad, rank, rope_dim=rope, grams=grams, rotate=True)
    plain = L.convert_model_latent(model, ad, rank, rope_dim=rope, grams=grams, rotate=False)
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    a, b = mixed.model.state_dict()[key], plain.model.state_dict()[key]
    assert a.shape == b.shape and (a[-rope:] - b[-rope:]).abs().max().item() > 1e-2  # not the identity
    for conv in (mixed, plain):
        assert (logits_of(conv.model, ids) - ref).abs().max().item() <= 1e-4
    # the mixes are unitary and put the key energy into the leading rotated heads, plane by plane
    geo = ad.geometry(model.config)[0]
    blocks = C.read_blocks(model.state_dict(), ad, ad.layer_prefix(model, 0), geo)
    u, lam = L.rorope(blocks.k, grams[0], ad.rotary_dim(model.config, geo.head_dim))
    eye = torch.eye(4, dtype=u.dtype).expand_as(u)
    assert torch.allclose(u @ u.conj().transpose(-1, -2), eye, atol=1e-10)
    assert bool((lam[:, :-1] >= lam[:, 1:] - 1e-12).all())
    _, raw = L.identity_mix(blocks.k, grams[0], ad.rotary_dim(model.config, geo.head_dim))
    assert bool((lam[:, 0] >= raw.max(1).values - 1e-9).all())


def _planewise_copies(model):
    """KV head 1 of every layer: head 0's key turned and scaled by a complex number per plane
    (RoRoPE can gather both into one rotated head; no single per-head rotary key can)."""
    ad = adapter_for(model.config)
    g = torch.Generator().manual_seed(5)
    for i, geo in enumerate(ad.geometry(model.config)):
        state = model.state_dict()
        prefix = ad.layer_prefix(model, i)
        b = C.read_blocks(state, ad, prefix, geo)
        r = ad.rotary_dim(model.config, geo.head_dim)
        c = torch.polar(0.5 + torch.rand(r // 2, generator=g, dtype=torch.float64),
                        6.28 * torch.rand(r // 2, generator=g, dtype=torch.float64))
        z = C._planes(b.k[:1], r) * c[None, :, None]
        b.k[1] = C._set_planes(b.k[1:2], z, r)[0]
        model.load_state_dict({**state, **C.write_tensors(b, ad, prefix, state, geo, geo)})
    return model


def test_rorope_gathers_position_information_into_the_rope_dims():
    """Keys that differ per frequency plane only by a complex factor live in one rotated head:
    a rotary key of one head's dims is then exact with RoRoPE and not without."""
    model = _planewise_copies(tiny_model("llama", seed=4))
    ad = adapter_for(model.config)
    ids = sample_ids("llama", seed=3)
    ref = logits_of(model, ids)
    grams = _grams(model, "llama")
    geo = ad.geometry(model.config)[0]
    rope = ad.rotary_dim(model.config, geo.head_dim)  # one head's worth of 2
    rank = L.latent_dims(geo, rope, rope)
    conv = L.convert_model_latent(model, ad, rank, rope_dim=rope, grams=grams)
    assert all(x["rope_energy"] == pytest.approx(1.0) for x in conv.layers)
    assert (logits_of(conv.model, ids) - ref).abs().max().item() <= 1e-4
    plain = L.convert_model_latent(model, ad, rank, rope_dim=rope, grams=grams, rotate=False)
    assert (logits_of(plain.model, ids) - ref).abs().max().item() > 1e-2


def test_factorization_is_exact_within_the_rank_of_k_and_v():
    """The whitened SVD path (kv_rank below full) loses nothing when K/V span no more dims: two
    KV heads with the same value projection need only one head's value dims."""
    model = tiny_model("llama", seed=6)
    ad = adapter_for(model.config)
    for i, geo in enumerate(ad.geometry(model.config)):
        state = model.state_dict()
        prefix = ad.layer_prefix(model, i)
        b = C.read_blocks(state, ad, prefix, geo)
        b.v[1] = b.v[0]
        model.load_state_dict({**state, **C.write_tensors(b, ad, prefix, state, geo, geo)})
    ids = sample_ids("llama", seed=3)
    rank, rope = _full(model)
    geo = ad.geometry(model.config)[0]
    conv = L.convert_model_latent(model, ad, rank - geo.head_dim, rope_dim=rope, grams=_grams(model, "llama"))
    assert (logits_of(conv.model, ids) - logits_of(model, ids)).abs().max().item() <= 1e-4


def test_reduced_rank_caches_what_it_reports_and_error_falls_with_rank():
    model = tiny_model("qwen2", seed=1)
    ad = adapter_for(model.config)
    grams = _grams(model, "qwen2")
    ids = sample_ids("qwen2", seed=3)
    ref = logits_of(model, ids)
    errors = []
    for rank in (4, 12, 20):
        conv = L.convert_model_latent(model, ad, rank, rope_dim=4, grams=grams)
        after = L.summary_figures(conv.model, ad)
        assert after["kv_cache_bytes_per_token_per_layer"] == [(rank + 4) * 4] * 3
        errors.append((logits_of(conv.model, ids) - ref).pow(2).mean().item())
        out = conv.model.generate(ids[:1, :5], attention_mask=torch.ones_like(ids[:1, :5]), max_new_tokens=3,
                                  do_sample=False, min_new_tokens=3, return_dict_in_generate=True)
        layer = out.past_key_values.layers[0]
        assert layer.keys.shape == (1, 1, 7, rank + 4) and layer.values.shape == (1, 1, 7, 0)  # [latent | rotary key]
    assert errors[0] > errors[1] > errors[2]
    assert L.summary_figures(model, ad)["kv_cache_bytes_per_token"] == 3 * 2 * 2 * 8 * 4


@pytest.mark.parametrize("args, needle", [
    (dict(kv_rank=64), "--kv-rank 64: must be between 1 and"),
    (dict(kv_rank=0), "--kv-rank 0"),
    (dict(kv_rank=8, rope_dim=3), "--rope-dim 3"),
    (dict(kv_rank=8, rope_dim=64), "--rope-dim 64"),
])
def test_impossible_targets_are_usage_errors(args, needle):
    model = tiny_model("llama")
    ad = adapter_for(model.config)
    with pytest.raises(UsageError, match=needle.replace("-", r"\-")):
        L.check_latent_target(ad, model.config, ad.geometry(model.config), args["kv_rank"], args.get("rope_dim", 8))


# ---------------------------------------------------------------- output folders and the CLI
runner = CliRunner()


def _cli(*args):
    return runner.invoke(app, ["convert-mla", *(str(a) for a in args)])


def test_cli_writes_a_folder_that_reloads_with_trust_remote_code(tmp_path):
    from transformers import AutoModelForCausalLM

    from headtool.model.loading import load_model

    src = save_tiny("llama", tmp_path / "src")
    out = tmp_path / "out"
    r = _cli(src, "--kv-rank", 6, "--rope-dim", 4, "--data", "builtin:pydoc", "--max-samples", 4, "--seq-len", 16,
             "--no-refit", "--eval-data", "builtin:pydoc", "--eval-samples", 2, "-o", out, "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    per_token = 3 * (6 + 4) * 4  # three layers of a 6-dim latent and a 4-dim rotary key, fp32
    assert doc["kv_rank"] == [6, 6, 6] and doc["rope_dim"] == 4
    assert doc["before"]["kv_cache_bytes_per_token"] == 3 * 2 * 2 * 8 * 4
    assert doc["after"]["kv_cache_bytes_per_token"] == per_token
    assert doc["config_kind"] == "headtool-remote-code" and doc["eval_after"]["loss"] > 0
    assert "KV cache per token" in r.stderr and "latent" in r.stderr
    meta = json.loads((out / "headtool.json").read_text())
    assert meta["operation"] == "convert-mla" and meta["kv_rank"] == [6, 6, 6]
    assert meta["kv_cache_bytes_per_token"] == {"before": 384, "after": per_token}
    assert len(meta["rope_slots"][0]) == 2
    assert "DeepSeek" in (out / "README.md").read_text()
    code = (out / "modeling_headtool.py").read_text()
    assert "LatentAttention" in code and "import headtool" not in code and "from headtool" not in code

    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ours = load_model(str(out), dtype="float32", device="cpu")  # headtool's own loader, no remote code
    ids = sample_ids("llama", seed=3)
    a = logits_of(reloaded, ids)
    assert (logits_of(ours.model, ids) - a).abs().max().item() <= 1e-5
    # the same conversion in memory (same calibration blocks) gives the same model
    lm = load_model(str(src), dtype="float32", device="cpu")
    from headtool.data.batches import make_batches
    from headtool.data.sources import DataSpec

    cal = make_batches(DataSpec(source="builtin:pydoc", max_samples=4, seq_len=16), lm.tokenizer, "lm", model=lm)
    grams = attention_input_grams(lm.model, lm.adapter, cal.batches)
    conv = L.convert_model_latent(lm.model, lm.adapter, 6, rope_dim=4, grams=grams)
    assert (logits_of(conv.model, ids) - a).abs().max().item() <= 1e-5
    gen = _generate(reloaded, ids[:1, :5], 4)
    assert gen.tolist() == _generate(conv.model, ids[:1, :5], 4).tolist()
    assert ours.model.config.headtool_mla["kv_rank"] == [6, 6, 6]
    from headtool.model.info import model_info

    assert model_info(ours.model, ours.adapter)["kv_cache_bytes_per_token"] == per_token
    r = runner.invoke(app, ["info", str(out), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["kv_rank"] == 6 and "latent attention" in r.stderr
    # eval --speed names the latent as eval does (it showed the source's 12/6 KV heads)
    r = runner.invoke(app, ["eval", str(out), "--speed", "--context", "8", "--new-tokens", "2", "--repeats", "1",
                            "--warmup", "0", "--json"])
    assert r.exit_code == 0, r.stderr
    (row,) = json.loads(r.stdout)["results"]
    assert row["kv_rank"] == 6 and row["rope_dim"] == 4 and row["kv_cache_bytes_per_token"] == per_token
    assert "12/latent" in r.stderr and "12/6" not in r.stderr


@pytest.mark.parametrize("family", ["mistral", "gpt2"])  # GPT-2: a Conv1D family whose latent o_proj is Linear
def test_refit_lowers_the_error_and_runs_from_the_cli(family, tmp_path):
    model = tiny_model(family, seed=3)
    ad = adapter_for(model.config)
    ids = sample_ids(family, batch=4, seq=24, seed=11)
    cal = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    grams = attention_input_grams(model, ad, cal)
    ref = logits_of(model, ids)
    rope = _small_rope(model)
    plain = L.convert_model_latent(model, ad, 6, rope_dim=rope, grams=grams)
    refit = L.convert_model_latent(model, ad, 6, rope_dim=rope, grams=grams, refit=True, batches=cal)
    assert plain.refit is None and len(refit.refit) == 3
    assert all(isinstance(ad.o_proj_module(refit.model, i), torch.nn.Linear) for i in range(3))
    err = [(logits_of(c.model, ids) - ref).pow(2).mean().item() for c in (plain, refit)]
    assert err[1] < err[0], err
    if family != "mistral":
        return

    src = save_tiny("llama", tmp_path / "src")
    r = _cli(src, "--kv-rank", 6, "--rope-dim", 4, "--max-samples", 4, "--seq-len", 16, "--heldout-samples", 2,
             "-o", tmp_path / "out", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["refit"]) == 3 and doc["heldout_data"]["samples"] == 2 and "refit" in r.stderr
    assert "Output-projection refit" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.parametrize("family", LATENT_FAMILIES)
def test_full_rank_folder_reloads_exactly(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from headtool.io.output import write_output
    from headtool.model.loading import model_from_object

    model = tiny_model(family)
    rank, rope = _full(model)
    conv = L.convert_model_latent(model, adapter_for(model.config), rank, rope_dim=rope, grams=_grams(model, family))
    write_output(tmp_path / "out", model=conv.model, tokenizer=None, source=model_from_object(model),
                 meta={"operation": "convert-mla"})
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    ids = sample_ids(family, seed=3)
    assert (logits_of(reloaded, ids) - logits_of(model, ids)).abs().max().item() <= 1e-4
    assert _generate(reloaded, ids[:1, :6]).tolist() == _generate(model, ids[:1, :6]).tolist()


@pytest.mark.parametrize("args, needle", [
    (["--kv-rank", 99], "must be between 1 and 24"),
    (["--kv-rank", 8, "--rope-dim", 5], "--rope-dim 5: must be even"),
    (["--kv-rank", 8, "--rope-dim", 18], "--rope-dim 18"),
    (["--kv-rank", 0], "--kv-rank"),
])
def test_cli_bad_targets_exit_2(tmp_path, args, needle):
    src = save_tiny("llama", tmp_path / "src")
    r = _cli(src, *args, "--max-samples", 2, "--seq-len", 8, "-o", tmp_path / "out")
    assert r.exit_code == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["bert"])  # an encoder: no cache to shrink
def test_cli_unsupported_families_exit_2(tmp_path, family):
    src = save_tiny(family, tmp_path / "src")
    r = _cli(src, "--kv-rank", 4, "-o", tmp_path / "out")
    assert r.exit_code == 2 and "not supported yet" in r.stderr, r.stderr


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_cli_learned_positions_default_to_no_rotary_key_and_reload(family, tmp_path):
    """GPT-2 and OPT have no RoPE: --rope-dim defaults to 0 (the whole cache is the latent), any
    other value is a usage error, and the folder reloads with remote code as the in-memory model."""
    from transformers import AutoModelForCausalLM

    from headtool.model.loading import load_model

    src = save_tiny(family, tmp_path / "src")
    bad = _cli(src, "--kv-rank", 6, "--rope-dim", 4, "--max-samples", 2, "--seq-len", 8, "-o", tmp_path / "bad")
    assert bad.exit_code == 2 and "no rotary embedding" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "bad").exists()
    out = tmp_path / "out"
    r = _cli(src, "--kv-rank", 6, "--data", "builtin:pydoc", "--max-samples", 4, "--seq-len", 16, "-o", out, "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["rope_dim"] == 0 and doc["after"]["kv_cache_bytes_per_token"] == 3 * 6 * 4
    assert doc["before"]["kv_cache_bytes_per_token"] == 3 * 2 * 32 * 4
    assert "there is no rotary key" in (out / "README.md").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ours = load_model(str(out), dtype="float32", device="cpu")
    ids = sample_ids(family, seed=3)
    assert (logits_of(reloaded, ids) - logits_of(ours.model, ids)).abs().max().item() <= 1e-5
    assert _generate(reloaded, ids[:1, :5], 4).tolist() == _generate(ours.model, ids[:1, :5], 4).tolist()


@pytest.mark.parametrize("family, unit, heads, counts", [
    ("llama", "query", "0:0,2;2:1,3", [2, 4, 2]), ("qwen3", "query", "0:0,2;2:1,3", [2, 4, 2]),
    # --unit head: KV groups of 1 and 2 query heads in layers 0 and 2; the latent serves each query head
    ("llama", "head", "0:0;2:3", [3, 4, 3]), ("qwen3", "head", "0:1;2:2", [3, 4, 3])])
def test_a_pruned_model_with_a_head_table_converts_exactly_and_reloads(family, unit, heads, counts, tmp_path):
    """prune -> convert-mla: the pruned folder has different query heads per layer (its head table),
    and with --unit head KV groups of different sizes; every latent layer gets its own heads, at full
    rank the pruned model's logits come back, and the folder reloads with trust_remote_code and with
    headtool's loader alike."""
    from transformers import AutoModelForCausalLM

    from headtool.model.loading import load_model

    src = save_tiny(family, tmp_path / "src")
    pruned = tmp_path / "pruned"
    r = runner.invoke(app, ["prune", str(src), "--heads", heads, "--unit", unit, "-o", str(pruned)])
    assert r.exit_code == 0, r.stderr
    lm = load_model(str(pruned), dtype="float32", device="cpu")
    geometry = lm.adapter.geometry(lm.config)
    assert [g.num_heads for g in geometry] == counts
    assert any(g.uneven for g in geometry) == (unit == "head")
    ids = sample_ids(family, seed=3)
    ref = logits_of(lm.model, ids)
    g = geometry[0]
    rot = lm.adapter.rotary_dim(lm.config, g.head_dim)
    rope = g.num_kv_heads * rot
    conv = L.convert_model_latent(lm.model, lm.adapter, L.latent_dims(g, rot, rope), rope_dim=rope,
                                  grams=_grams(lm.model, family))
    assert conv.spec["num_heads"] == counts
    for absorb in (False, True):
        _absorb(conv.model, absorb)
        assert (logits_of(conv.model, ids) - ref).abs().max().item() <= 1e-4, absorb
    out = tmp_path / "mla"
    r = _cli(pruned, "--kv-rank", 6, "--rope-dim", 4, "--max-samples", 4, "--seq-len", 16, "-o", out, "--json")
    assert r.exit_code == 0, r.stderr
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ours = load_model(str(out), dtype="float32", device="cpu")
    assert [m.num_heads for m in reloaded.modules() if isinstance(m, torch.nn.Module)
            and type(m).__name__ == "LatentAttention"] == counts
    assert (logits_of(reloaded, ids) - logits_of(ours.model, ids)).abs().max().item() <= 1e-5
    assert _generate(reloaded, ids[:1, :5], 4).tolist() == _generate(ours.model, ids[:1, :5], 4).tolist()
    r = runner.invoke(app, ["info", str(out), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["num_heads"] == counts
    # inspect reads it too: every query head of a latent layer shares the latent, one group whatever the
    # source's groups were (it raised an internal error on the uneven ones)
    r = runner.invoke(app, ["inspect", str(out), "--data", "builtin:pydoc", "--max-samples", "2", "--seq-len", "16",
                            "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["kv_groups"]["group_size"] == counts


def test_cli_existing_output_refused(tmp_path):
    src = save_tiny("mistral", tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    r = _cli(src, "--kv-rank", 4, "--max-samples", 2, "--seq-len", 8, "-o", tmp_path / "out")
    assert r.exit_code == 2 and "already exists" in r.stderr
    assert (tmp_path / "out" / "keep.txt").exists()


def test_the_latent_modeling_file_imports_nothing_of_headtool():
    from pathlib import Path

    import headtool
    from test_layers import imports_of

    path = Path(headtool.__file__).parent / "templates" / "modeling_headtool_mla.py"
    assert imports_of(path, "headtool.templates.modeling_headtool_mla", False, set()) == []


def test_the_key_weight_default_is_the_measured_one():
    """The CLI/recipe default and the library default are one number."""
    from headtool.workflows.requests import LatentRequest

    assert LatentRequest(model="m", kv_rank=1).key_weight == L.DEFAULT_KEY_WEIGHT


# ---------------------------------------------------------------- the packaged real model
@pytest.mark.realmodel
@needs_smollm2
def test_smollm2_full_rank_exact_and_a_third_of_the_cache_runs(smollm2):
    """SmolLM2-135M (9 query / 3 KV heads of 64): exact at full rank, and at a third of the cache
    (the MQA budget) the conversion runs, caches 128 dims per layer and stays a language model."""
    from headtool.data.batches import make_batches
    from headtool.data.sources import DataSpec
    from headtool.measure.evaluation import evaluate

    lm = smollm2
    cal = make_batches(DataSpec(seq_len=64, batch_size=4, max_samples=4), lm.tokenizer, "lm")
    ev = make_batches(DataSpec(seq_len=64, batch_size=4, max_samples=4, skip_samples=4), lm.tokenizer, "lm")
    grams = attention_input_grams(lm.model, lm.adapter, cal.batches)
    ids = ev.batches[0]["input_ids"][:2, :32]
    ref = logits_of(lm.model, ids)
    full = L.convert_model_latent(lm.model, lm.adapter, 192, rope_dim=192, grams=grams)
    assert (logits_of(full.model, ids) - ref).abs().max().item() <= 1e-3
    del full
    third = L.convert_model_latent(lm.model, lm.adapter, 64, rope_dim=64, grams=grams)
    after = L.summary_figures(third.model, lm.adapter)
    assert after["kv_cache_bytes_per_token"] * 3 == L.summary_figures(lm.model, lm.adapter)["kv_cache_bytes_per_token"]
    base = evaluate(lm.model, ev.batches, "lm")["perplexity"]
    ppl = evaluate(third.model, ev.batches, "lm")["perplexity"]
    assert ppl < 10 * base, (ppl, base)


def _heal_latent_student(tmp_path, *heal_args: str) -> None:
    """tiny llama -> convert-mla (kv_rank 6, a compressing rank) in tmp_path/mla -> heal into tmp_path/healed."""
    src = save_tiny("llama", tmp_path / "src")
    r = _cli(src, "--kv-rank", 6, "--rope-dim", 4, "--max-samples", 4, "--seq-len", 16, "--no-refit",
             "-o", tmp_path / "mla")
    assert r.exit_code == 0, r.stderr
    r = runner.invoke(app, ["heal", str(tmp_path / "mla"), "--teacher", str(src), "--data", "builtin:pydoc",
                            "--max-samples", "6", "--seq-len", "16", "--eval-samples", "2", *heal_args,
                            "-o", str(tmp_path / "healed")])
    assert r.exit_code == 0, r.stderr


def test_heal_trains_a_latent_student_and_writes_latent_attention(tmp_path):
    """heal runs on a convert-mla output as on any student (its attention parameters are the
    latent projections) and writes a folder that is latent attention again."""
    from transformers import AutoModelForCausalLM

    _heal_latent_student(tmp_path, "--max-steps", "2")
    healed = AutoModelForCausalLM.from_pretrained(tmp_path / "healed", trust_remote_code=True)
    assert isinstance(healed.model.layers[0].self_attn, torch.nn.Module)
    assert type(healed.model.layers[0].self_attn).__name__ == "LatentAttention"
    assert healed.config.headtool_mla["kv_rank"] == [6, 6, 6]


def test_heal_lora_trains_a_latent_student_whose_attention_reads_weights(tmp_path):
    """`heal --train lora` on a convert-mla output: latent attention reads kv_b_proj's (and, folded,
    q_proj's and o_proj's) weight instead of calling the module, so the low-rank wrapper must offer
    the effective weight (base + update). It raised AttributeError on 'weight' before."""
    from transformers import AutoModelForCausalLM

    _heal_latent_student(tmp_path, "--max-steps", "3", "--train", "lora", "--lora-rank", "2", "--lr", "1e-2")
    before = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", trust_remote_code=True).state_dict()
    healed = AutoModelForCausalLM.from_pretrained(tmp_path / "healed", trust_remote_code=True)
    assert type(healed.model.layers[0].self_attn).__name__ == "LatentAttention"
    after = healed.state_dict()
    assert before.keys() == after.keys()  # merged back: no adapter tensors
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert any("kv_b_proj" in k for k in changed) and all(".self_attn." in k for k in changed)


@pytest.mark.parametrize("family", LATENT_FAMILIES)
def test_folded_absorbed_decode_equals_plain_and_refolds_when_weights_change(family):
    """At a compressing rank, decoding without gradients folds the up-projections into q_proj and
    o_proj: it must equal the plain path, follow in-place weight changes (heal, load_state_dict),
    and leave the unfolded path (with gradients) to training."""
    model = tiny_model(family)
    ad = adapter_for(model.config)
    ids = sample_ids(family, seed=3)
    conv = L.convert_model_latent(model, ad, 4, rope_dim=_small_rope(model), grams=_grams(model, family))
    layers = [m for m in conv.model.modules() if isinstance(m, LatentAttention)]
    # a per-head norm between q_proj and the key up-projection leaves nothing to fold (Qwen 3, Gemma 3)
    folds = not adapter_for(model.config).qk_norm
    assert all(m._folds() == folds for m in layers)

    def gap() -> float:
        _absorb(conv.model, False)
        plain = logits_of(conv.model, ids)
        _absorb(conv.model, True)
        return (logits_of(conv.model, ids) - plain).abs().max().item()

    assert gap() <= 1e-4
    assert all((m._folded is not None) == folds for m in layers)  # the folded weights did the work
    with torch.no_grad():
        for m in layers:
            m.kv_b_proj.weight.mul_(1.5)
            m.o_proj.weight.add_(0.01)
    assert gap() <= 1e-4  # refolded from the changed weights
    _absorb(conv.model, "auto")
    prompt = ids[:1, :6]
    cached = _generate(conv.model, prompt)
    _absorb(conv.model, False)
    assert cached.tolist() == _generate(conv.model, prompt).tolist()
    _absorb(conv.model, True)
    out = conv.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits  # gradients on: unfolded
    out.float().pow(2).mean().backward()
    assert all(m.kv_b_proj.weight.grad is not None and m.kv_b_proj.weight.grad.abs().sum() > 0 for m in layers)


def _deepseek_layout(conv, model, ad):
    """The same latent model written in the layout of headtool's earlier outputs (no
    `factored_query` in the table): q_proj over the hidden state with each head's [query | rotary
    query] rows, no q_rope_proj."""
    import copy

    from headtool.model.latent import install_latent

    spec = {k: v for k, v in conv.spec.items() if k != "factored_query"}
    tensors = []
    for m in (mm for mm in conv.model.modules() if isinstance(mm, LatentAttention)):
        h, d, nope, rope = m.num_heads, m.v_head_dim, m.qk_nope_dim, m.rope_dim
        wh = m.q_proj.weight.detach().view(h, d, -1)
        maps = m.q_rope_proj.detach().view(h, rope, d)
        values = {k: v.detach().clone() for k, v in m.named_parameters() if k not in ("q_proj.weight", "q_proj.bias",
                                                                                      "q_rope_proj")}
        values["q_proj.weight"] = torch.cat([wh[:, :nope], torch.einsum("hrd,hdi->hri", maps, wh)], 1).reshape(
            h * (nope + rope), -1)
        if m.q_proj.bias is not None:
            bh = m.q_proj.bias.detach().view(h, d)
            values["q_proj.bias"] = torch.cat([bh[:, :nope], torch.einsum("hrd,hd->hr", maps, bh)], 1).reshape(-1)
        tensors.append(values)
    old = copy.deepcopy(model)
    install_latent(old, ad, spec, tensors)
    return old


@pytest.mark.parametrize("family", [f for f in LATENT_FAMILIES if f not in ("qwen3", "gemma3_text")])
def test_factored_query_equals_the_earlier_layout_and_costs_fewer_parameters(family):
    """The rotary query is a per-head map of the head's own query (q_rope_proj, rope_dim x head_dim),
    where the earlier layout gave q_proj rope_dim x hidden more rows per head: the same model
    (plain, absorbed, cached), fewer parameters, and folders in the earlier layout still load."""
    model = tiny_model(family, **({"attention_bias": True} if family in ("llama", "mistral") else {}))
    ad = adapter_for(model.config)
    ids = sample_ids(family, seed=3)
    conv = L.convert_model_latent(model, ad, 4, rope_dim=_small_rope(model), grams=_grams(model, family))
    assert conv.spec["factored_query"] is True
    old = _deepseek_layout(conv, model, ad)
    new_attn = next(m for m in conv.model.modules() if isinstance(m, LatentAttention))
    old_attn = next(m for m in old.modules() if isinstance(m, LatentAttention))
    assert new_attn.factored_query and not old_attn.factored_query
    g = ad.geometry(model.config)[0]
    assert new_attn.q_proj.weight.shape[0] == g.num_heads * g.head_dim  # the original query heads
    if new_attn.rope_dim:
        hidden = new_attn.q_proj.weight.shape[1]
        saved = g.num_heads * new_attn.rope_dim * (hidden - g.head_dim) * model.config.num_hidden_layers
        n_new, n_old = (sum(p.numel() for p in x.parameters()) for x in (conv.model, old))
        assert n_old - n_new == saved + (g.num_heads * new_attn.rope_dim * model.config.num_hidden_layers
                                         if new_attn.q_proj.bias is not None else 0)
    for absorb in (False, True):
        _absorb(conv.model, absorb)
        _absorb(old, absorb)
        assert (logits_of(conv.model, ids) - logits_of(old, ids)).abs().max().item() <= 1e-4, absorb
    _absorb(conv.model, "auto")
    _absorb(old, "auto")
    prompt = ids[:1, :6]
    assert _generate(conv.model, prompt).tolist() == _generate(old, prompt).tolist()


def test_head_surgery_on_a_latent_model_is_refused_up_front(tmp_path):
    """prune, convert-gqa and convert-mla of a convert-mla output (and magnitude scores of it) failed
    late, naming a missing k_proj weight, some after calibration: one line now, before any work."""
    src = save_tiny("llama", tmp_path / "src")
    mla = tmp_path / "mla"
    assert _cli(src, "--kv-rank", 6, "--rope-dim", 4, "--max-samples", 2, "--seq-len", 16, "-o", mla).exit_code == 0
    data = ["--data", "builtin:pydoc", "--max-samples", "2", "--seq-len", "16"]
    out = tmp_path / "out"
    for args in (["prune", str(mla), "--heads", "0:0,1", "-o", str(out)],
                 ["prune", str(mla), "--heads", "0:0,1", "--dry-run"],
                 ["prune", str(mla), "--heads", "0:0,1", "--streaming", "-o", str(out)],
                 ["convert-gqa", str(mla), "--kv-heads", "1", *data, "-o", str(out)],
                 ["convert-mla", str(mla), "--kv-rank", "4", *data, "-o", str(out)],
                 ["score", str(mla), "--method", "magnitude"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2 and "latent attention" in r.stderr and "k_proj" not in r.stderr, (args, r.stderr)
        assert not out.exists()


def test_heldout_data_help_names_no_merge():
    """convert-mla --help said the held-out data chooses 'each layer's refit and the merge': convert-mla
    merges nothing (convert-gqa's wording); it chooses each layer's refit."""
    from headtool.optionspec import options_of
    from headtool.workflows.requests import ConvertRequest, LatentRequest, PruneRequest

    helps = {cls: next(o.meta["help"] for o in options_of(cls) if o.name == "heldout_data")
             for cls in (LatentRequest, ConvertRequest, PruneRequest)}
    assert "merge" not in helps[LatentRequest] and "each layer's refit is chosen" in helps[LatentRequest]
    assert "the merge" in helps[ConvertRequest]
    # prune merges nothing either: its held-out blocks choose the refit and compare --normalize modes
    assert "merge" not in helps[PruneRequest] and "--normalize mode" in helps[PruneRequest]
