"""prune --unit head on grouped-query models: single query heads go, every KV head with a reader stays,
the groups differ in size; the written model equals the gated original (in memory, streamed, refit), and
what cannot take such layers (a second prune by KV groups) says so in one line. convert-gqa merges them
(into equal groups again); convert-mla takes them: tests/test_convert_mla.py."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from headtool.arch import LAYOUT_KEY
from headtool.cli.app import app
from headtool.measure.gates import head_gates
from headtool.model.loading import load_model
from headtool.surgery.selection import Selection
from tiny_models import logits_of, sample_ids, save_tiny, tiny_model, tokenizer_for

runner = CliRunner()


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("uneven") / "src")  # 3 layers, 4 query heads, 2 KV heads


def _gated_logits(src_folder, kept, ids):
    lm = load_model(str(src_folder), dtype="float32", device="cpu")
    sel = Selection.from_kept(lm.geometry, kept, uneven=True)
    with head_gates(lm.model, lm.adapter, init=sel.mask(lm.geometry)):
        return logits_of(lm.model, ids)


def _written(folder):
    lm = load_model(str(folder), dtype="float32", device="cpu")
    return lm, json.loads((folder / "headtool.json").read_text())


@pytest.mark.parametrize("streaming", [False, True], ids=["in-memory", "streaming"])
def test_listed_heads_leave_uneven_groups_and_equal_the_gated_original(src, tmp_path, streaming):
    out = tmp_path / "out"
    r = runner.invoke(app, ["prune", str(src), "--heads", "0:0;2:3", "--unit", "head", "-o", str(out), "--json"]
                      + (["--streaming"] if streaming else []))
    assert r.exit_code == 0, r.output
    lm, meta = _written(out)
    assert [(g.num_heads, g.num_kv_heads, g.group_sizes) for g in lm.geometry] == [(3, 2, (1, 2)), (4, 2, None),
                                                                                   (3, 2, (2, 1))]
    assert json.loads((out / "config.json").read_text())[LAYOUT_KEY]["group_sizes"] == [[1, 2], None, [2, 1]]
    ids = sample_ids("llama")
    diff = (logits_of(lm.model, ids) - _gated_logits(src, meta["kept_heads"], ids)).abs().max().item()
    assert diff <= 1e-4
    # without --unit head the same list is refused: the groups would differ
    r = runner.invoke(app, ["prune", str(src), "--heads", "0:0", "-o", str(tmp_path / "never")]
                      + (["--streaming"] if streaming else []))
    assert r.exit_code == 2 and "--unit head" in r.stderr and not (tmp_path / "never").exists()


def test_refit_prune_chooses_single_heads_and_the_table_shows_the_groups(src, tmp_path):
    """--compensate with --unit head: one head is one step (the layer keeps its other group whole)."""
    out = tmp_path / "out"
    r = runner.invoke(app, ["prune", str(src), "--num-heads", "1", "--unit", "head", "--compensate", "--protect-layers",
                            "none", "--data", "builtin:pydoc", "--max-samples", "4", "--seq-len", "32", "-o", str(out)])
    assert r.exit_code == 0, r.output
    lm, meta = _written(out)
    [layer] = [i for i, g in enumerate(lm.geometry) if g.num_heads == 3]
    sizes = lm.geometry[layer].group_sizes
    assert sorted(sizes) == [1, 2] and lm.geometry[layer].num_kv_heads == 2
    assert meta["summary"]["layers"][layer]["kv_group_sizes_after"] == list(sizes)
    assert f"2 → 2 ({sizes[0]}+{sizes[1]})" in (out / "README.md").read_text()
    assert f"({sizes[0]}+{sizes[1]})" in r.output
    # the refit changed the layer's output projection: the gated original with those columns is the reference
    ids = sample_ids("llama")
    ref = load_model(str(src), dtype="float32", device="cpu")
    sel = Selection.from_kept(ref.geometry, meta["kept_heads"], uneven=True)
    hd = ref.geometry[layer].head_dim
    o_new = lm.adapter.o_proj_module(lm.model, layer).weight.detach()
    o_ref = ref.adapter.o_proj_module(ref.model, layer).weight
    with torch.no_grad():
        o_ref.zero_()
        for j, h in enumerate(sel.kept[layer]):
            o_ref[:, h * hd:(h + 1) * hd] = o_new[:, j * hd:(j + 1) * hd]
    with head_gates(ref.model, ref.adapter, init=sel.mask(ref.geometry)):
        want = logits_of(ref.model, ids)
    assert (logits_of(lm.model, ids) - want).abs().max().item() <= 1e-4


def test_a_second_prune_by_kv_groups_refuses_uneven_layers_in_one_line_and_auto_takes_single_heads(src, tmp_path):
    pruned = tmp_path / "pruned"
    assert runner.invoke(app, ["prune", str(src), "--heads", "1:0", "--unit", "head", "-o", str(pruned)]).exit_code == 0
    info = runner.invoke(app, ["info", str(pruned), "--trust-remote-code", "--json"])
    assert info.exit_code == 0 and json.loads(info.stdout)["kv_group_sizes"] == {"1": [1, 2]}
    assert "layer 1 (1+2)" in runner.invoke(app, ["info", str(pruned), "--trust-remote-code"]).output
    cases = [
        (["prune", str(pruned), "--heads", "0:0,2", "--unit", "query", "-o", str(tmp_path / "a")], "--unit head"),
        (["prune", str(pruned), "--num-heads", "2", "--compensate", "--data", "builtin:pydoc", "--max-samples", "2",
          "--seq-len", "16", "--unit", "group", "-o", str(tmp_path / "a")], "--unit head"),
    ]
    for args, msg in cases:
        r = runner.invoke(app, [*args, "--trust-remote-code"])
        assert r.exit_code == 2, (args, r.output)
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and msg in lines[0], (args, r.stderr)
        assert not (tmp_path / "a").exists()
    # a second prune goes on from the uneven layer by single heads (--unit auto, the default, is head there)
    again = tmp_path / "again"
    r = runner.invoke(app, ["prune", str(pruned), "--heads", "1:2", "-o", str(again), "--trust-remote-code"])
    assert r.exit_code == 0, r.output
    lm, meta = _written(again)
    assert [(g.num_heads, g.num_kv_heads) for g in lm.geometry][1] == (2, 2)
    # loaded through the folder's own copy of the modeling file, pruned again: still the gated original
    ids = sample_ids("llama")
    kept = [[0, 1, 2, 3], [1, 2], [0, 1, 2, 3]]  # the second list counts the pruned layer's heads: 2 is head 3
    assert (logits_of(lm.model, ids) - _gated_logits(src, kept, ids)).abs().max().item() <= 1e-4
    for folder in (pruned, again):
        remote = load_model(str(folder), dtype="float32", device="cpu", trust_remote_code=True)
        want = _gated_logits(src, kept if folder == again else [[0, 1, 2, 3], [1, 2, 3], [0, 1, 2, 3]], ids)
        assert (logits_of(remote.model, ids) - want).abs().max().item() <= 1e-4, folder


@pytest.fixture(scope="module")
def twin_kv(tmp_path_factory):
    """A tiny llama (6 query heads, 3 KV heads) whose KV heads are equal in every layer: merging them
    changes nothing."""
    model = tiny_model("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    hd = model.config.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight[hd:2 * hd] = proj.weight[:hd]
                proj.weight[2 * hd:] = proj.weight[:hd]
    folder = tmp_path_factory.mktemp("twin") / "src"
    model.save_pretrained(folder)
    tokenizer_for("llama").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_convert_gqa_merges_uneven_groups_into_equal_ones(twin_kv, tmp_path, kv_heads):
    """A prune by single heads (layer 0 lost a whole group: 2 KV heads left; layer 2 groups 2+1+1)
    merged to fewer KV heads: equal groups again where a layer is merged, a layer that has the
    target's KV heads already stays as it is (--kv-heads 2: layer 0), and with equal KV heads the
    merge is exact (mean in memory and streamed); the data-aware merges and similarity grouping
    take the uneven layers too."""
    pruned = tmp_path / "pruned"
    r = runner.invoke(app, ["prune", str(twin_kv), "--heads", "0:0,1;2:3,4", "--unit", "head", "-o", str(pruned)])
    assert r.exit_code == 0, r.output
    before = load_model(str(pruned), dtype="float32", device="cpu")
    assert [(g.num_kv_heads, g.group_sizes) for g in before.geometry] == [(2, None), (3, None), (3, (2, 1, 1))]
    ids = sample_ids("llama")
    want = logits_of(before.model, ids)
    layer0 = {k: v for k, v in before.model.state_dict().items() if ".layers.0." in k}
    outs = {}
    for name, extra in {"mean": ["--merge", "mean"], "streamed": ["--merge", "mean", "--streaming"],
                        "fit": ["--merge", "fit", "--grouping", "similarity", "--data", "builtin:pydoc",
                                "--max-samples", "2", "--seq-len", "16"]}.items():
        outs[name] = tmp_path / name
        r = runner.invoke(app, ["convert-gqa", str(pruned), "--kv-heads", str(kv_heads), "-o", str(outs[name]), *extra])
        assert r.exit_code == 0, (name, r.output)
        layout = json.loads((outs[name] / "config.json").read_text()).get(LAYOUT_KEY, {})
        assert "group_sizes" not in layout, name
        lm = load_model(str(outs[name]), dtype="float32", device="cpu")
        assert [(g.num_heads, g.num_kv_heads, g.group_sizes) for g in lm.geometry] == \
            [(4, kv_heads, None), (6, kv_heads, None), (4, kv_heads, None)], name
        if name != "fit":
            assert (logits_of(lm.model, ids) - want).abs().max().item() <= 1e-4, name
        if kv_heads == 2 and name != "fit":  # layer 0 already had 2 KV heads: its weights as they were
            after = lm.model.state_dict()
            assert all(torch.equal(after[k], v) for k, v in layer0.items()), name
    remote = load_model(str(outs["mean"]), dtype="float32", device="cpu", trust_remote_code=True)
    assert (logits_of(remote.model, ids) - want).abs().max().item() <= 1e-4


def test_streamed_prune_from_scores_takes_single_heads_as_in_memory(src, tmp_path):
    """prune --streaming --scores with --unit head: the same heads and tensors as the in-memory prune; --unit
    auto without a refit is query there (one head from every group a step)."""
    from tiny_models import checkpoint_tensors

    doc_path = tmp_path / "scores.json"
    r = runner.invoke(app, ["score", str(src), "--data", "builtin:pydoc", "--max-samples", "2", "--seq-len", "16",
                            "-o", str(doc_path)])
    assert r.exit_code == 0, r.output
    doc = json.loads(doc_path.read_text())
    forced = [[0.01, 0.9, 0.8, 0.7], [0.6, 0.9, 0.8, 0.7], [0.6, 0.9, 0.8, 0.02]]  # weakest: 0:0 and 2:3
    doc["scores"] = doc["raw_scores"] = forced
    doc_path.write_text(json.dumps(doc))
    kept = {}
    for unit in ("head", "auto"):
        for mode in ("memory", "streamed"):
            out = tmp_path / f"{unit}-{mode}"
            r = runner.invoke(app, ["prune", str(src), "--scores", str(doc_path), "--num-heads", "2", "--unit", unit,
                                    "--protect-layers", "none", "-o", str(out)]
                              + (["--streaming"] if mode == "streamed" else []))
            assert r.exit_code == 0, r.output
            kept[unit, mode] = _written(out)[1]["kept_heads"]
        a, b = checkpoint_tensors(tmp_path / f"{unit}-memory"), checkpoint_tensors(tmp_path / f"{unit}-streamed")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert kept[unit, "memory"] == kept[unit, "streamed"]
    assert kept["head", "memory"] == [[1, 2, 3], [0, 1, 2, 3], [0, 1, 2]]
    # query steps: each layer's weakest head of every group, the step of the lowest mean first (layer 2: 0.31)
    assert kept["auto", "memory"] == [[0, 1, 2, 3], [0, 1, 2, 3], [1, 2]]
