"""headtool prune: saved folders equal the gated original on every family, reload anywhere, fail cleanly."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest
import torch
from typer.testing import CliRunner

from headtool.arch import LAYOUT_KEY, RESIZE_SPEC_KEY
from headtool.io.output import write_output
from headtool.cli.app import app
from headtool.measure.gates import head_gates
from headtool.model.loading import load_model
from headtool.surgery.pruning import markdown_table, prune
from headtool.surgery.selection import Selection
from tiny_models import ALL, FAMILIES, GQA, logits_of, sample_ids, save_tiny

runner = CliRunner()
# families whose tiny model has several KV heads a layer: --unit head can leave them uneven groups
UNEVEN = [f for f in GQA if FAMILIES[f][0].get("num_key_value_heads", 1) > 1]


def _cases(family: str, geo) -> dict[str, list[list[int]]]:
    """Kept query heads per layer: non-uniform (--unit query), uniform, and whole KV groups."""
    nq, nkv = geo[0].num_heads, geo[0].num_kv_heads
    if nkv == nq:  # multi-head: single heads
        return {"nonuniform": [[1, 3], [0, 1, 2, 3], [2]], "uniform": [[0, 1], [1, 2], [0, 3]]}
    if nkv == 1:  # one KV head: query heads only
        return {"nonuniform": [[1, 3], [0, 1, 2, 3], [2]], "uniform": [[0, 1], [2, 3], [0, 3]]}
    return {"nonuniform": [[1, 3], [0, 1, 2, 3], [0, 2]],  # one query head per group left in layers 0, 2
            "uniform": [[0, 2], [1, 3], [1, 2]],
            "group": [[2, 3], [0, 1, 2, 3], [0, 1]],  # whole groups (with their KV head) removed
            # --unit head: groups of 1 and 2 query heads in layers 0 and 2 (both KV heads kept), one
            # KV head left in layer 1
            "uneven": [[1, 2, 3], [3], [0, 2, 3]]}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Every family x case: pruned folder, gated-original reference logits, input ids."""
    root = tmp_path_factory.mktemp("prune")
    out = {}
    for family in ALL:
        src = save_tiny(family, root / f"src_{family}")
        ids = sample_ids(family)
        for case, kept in _cases(family, load_model(str(src), dtype="float32", device="cpu").geometry).items():
            lm = load_model(str(src), dtype="float32", device="cpu")
            geo = lm.geometry
            sel = Selection.from_kept(geo, kept, uneven=case == "uneven")
            with head_gates(lm.model, lm.adapter, init=sel.mask(geo)):
                ref = logits_of(lm.model, ids)
            result = prune(lm, sel)
            folder = root / f"{family}-{case}"
            w = write_output(folder, model=lm.model, tokenizer=lm.tokenizer, source=lm,
                             meta={"operation": "prune", "kept_heads": [list(k) for k in sel.kept]},
                             card_table=markdown_table(result))
            torch.save({"ids": ids, "ref": ref}, root / f"{family}-{case}.pt")
            out[(family, case)] = {"folder": folder, "ids": ids, "ref": ref, "kind": w["config_kind"],
                                   "geo": result.geometry_after, "in_memory": logits_of(lm.model, ids)}
    return out


@pytest.mark.parametrize("family", ALL)
def test_reloaded_folder_equals_the_gated_original(outputs, family):
    for (fam, case), o in outputs.items():
        if fam != family:
            continue
        assert (o["in_memory"] - o["ref"]).abs().max() <= 1e-4, case
        lm = load_model(str(o["folder"]), dtype="float32", device="cpu")
        assert lm.geometry == o["geo"], case
        diff = (logits_of(lm.model, o["ids"]) - o["ref"]).abs().max().item()
        assert diff <= 1e-4, (case, diff)
        cfg = json.loads((o["folder"] / "config.json").read_text())
        doc = json.loads((o["folder"] / "headtool.json").read_text())
        assert doc["format"] == "headtool.surgery/1" and doc["config_kind"] == o["kind"]
        assert doc["source"]["fingerprint"].startswith("sha256:")
        assert (LAYOUT_KEY in cfg) == (o["kind"] == "headtool-remote-code")
        # the family's own model_type, the only key the adapter registry reads (no renamed type,
        # no headtool key other than the per-layer table and its resize spec)
        assert cfg["model_type"] == json.loads((o["folder"].parent / f"src_{fam}" / "config.json").read_text())[
            "model_type"]
        assert {k for k in cfg if k.startswith("headtool")} <= {LAYOUT_KEY, RESIZE_SPEC_KEY}, sorted(cfg)
        assert (o["folder"] / "modeling_headtool.py").exists() == (o["kind"] == "headtool-remote-code")
        assert "| layer |" in (o["folder"] / "README.md").read_text()


def test_standard_configs_where_the_family_allows_them(outputs):
    kinds = {k: o["kind"] for k, o in outputs.items()}
    # explicit head_dim and 2 heads dividing hidden 32 (or Qwen/Mistral that accept any count)
    for fam in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"):
        assert kinds[(fam, "uniform")] == "standard", fam
    for fam in ("bert", "gpt2", "gpt_neox", "opt", "phi3"):  # head_dim derived from the width
        assert kinds[(fam, "uniform")] == "headtool-remote-code", fam
    assert all(kinds[(f, "nonuniform")] == "headtool-remote-code" for f in ALL)
    assert all(kinds[(f, "uneven")] == "headtool-remote-code" for f in UNEVEN)


def test_generation_with_new_kv_head_counts(outputs):
    o = outputs[("qwen3", "nonuniform")]
    lm = load_model(str(o["folder"]), dtype="float32", device="cpu")
    for impl in ("eager", "sdpa"):
        lm.model.set_attn_implementation(impl)
        out = lm.model.generate(o["ids"][:, :6], max_new_tokens=5, do_sample=False)
        assert out.shape == (2, 11)
        diff = (logits_of(lm.model, o["ids"]) - o["ref"]).abs().max().item()
        assert diff <= 1e-4, impl


@pytest.mark.parametrize("family", UNEVEN)
def test_uneven_kv_groups_keep_every_kv_head_with_a_reader_and_generate_as_the_gated_original(outputs, family):
    """--unit head: a layer keeps both KV heads for groups of 1 and 2 query heads; the cache holds
    the KV heads themselves, and cached greedy generation (eager and sdpa) equals the original's
    with the removed heads gated off."""
    o = outputs[(family, "uneven")]
    assert o["kind"] == "headtool-remote-code"
    assert [(g.num_heads, g.num_kv_heads, g.group_sizes) for g in o["geo"]] == [(3, 2, (1, 2)), (1, 1, None),
                                                                                 (3, 2, (1, 2))]
    layout = json.loads((o["folder"] / "config.json").read_text())[LAYOUT_KEY]
    assert layout["group_sizes"] == [[1, 2], None, [1, 2]]
    src = load_model(str(o["folder"].parent / f"src_{family}"), dtype="float32", device="cpu")
    sel = Selection.from_kept(src.geometry, _cases(family, src.geometry)["uneven"], uneven=True)
    lm = load_model(str(o["folder"]), dtype="float32", device="cpu")
    prompt = o["ids"][:, :6]
    for impl in ("eager", "sdpa"):
        try:
            src.model.set_attn_implementation(impl)
        except ValueError:  # Gemma 2: eager only
            continue
        lm.model.set_attn_implementation(impl)
        with head_gates(src.model, src.adapter, init=sel.mask(src.geometry)):
            want = src.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                      do_sample=False, output_logits=True, return_dict_in_generate=True)
        got = lm.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                                output_logits=True, return_dict_in_generate=True)
        assert torch.equal(want.sequences, got.sequences), impl
        diff = max((a - b).abs().max().item() for a, b in zip(want.logits, got.logits))
        assert diff <= 1e-4, (impl, diff)
        # the cache keeps the layer's KV heads, not a copy per query head
        cache = lm.model(prompt, use_cache=True).past_key_values
        assert [cache.layers[i].keys.shape[1] for i in range(3)] == [2, 1, 2], impl


def test_remote_code_folders_load_where_headtool_is_not_installed(outputs, tmp_path):
    """transformers + trust_remote_code only: a subprocess whose sys.path lacks headtool."""
    jobs = [{"folder": str(o["folder"]), "ref": str(o["folder"]) + ".pt",
             "auto": "AutoModelForMaskedLM" if FAMILIES[fam][1] else "AutoModelForCausalLM"}
            for (fam, case), o in outputs.items() if o["kind"] == "headtool-remote-code"]
    assert len(jobs) >= 13
    script = tmp_path / "reload.py"
    script.write_text('''
import json, sys
try:
    import headtool  # noqa: F401
    print(json.dumps({"headtool_importable": True})); sys.exit(0)
except ImportError:
    pass
import torch, transformers
res = {"headtool_importable": False, "diffs": {}, "gen": {}}
for job in json.loads(sys.argv[1]):
    d = torch.load(job["ref"])
    m = getattr(transformers, job["auto"]).from_pretrained(job["folder"], trust_remote_code=True,
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        out = m(input_ids=d["ids"], attention_mask=torch.ones_like(d["ids"])).logits
    # relative to the logits' scale: another process's fp32 kernels may round differently
    res["diffs"][job["folder"]] = (out - d["ref"]).abs().max().item() / max(1.0, d["ref"].abs().max().item())
    if job["auto"] == "AutoModelForCausalLM":
        res["gen"][job["folder"]] = m.generate(d["ids"][:, :4], max_new_tokens=3, do_sample=False).shape[1]
print(json.dumps(res))
''')
    site = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    # -I: no PYTHONPATH, no cwd; -S: no site (so no .pth of the editable install); then only site-packages
    code = f"import sys; sys.path.append({site!r}); sys.argv = sys.argv[:1] + sys.argv[1:]; " \
           f"exec(compile(open({str(script)!r}).read(), 'reload.py', 'exec'))"
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code, json.dumps(jobs)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["headtool_importable"] is False
    # 1e-4 of the largest logit: a process other than the one that made the reference was measured
    # 2.0e-4 / 2.9e-4 off (gpt2, logits up to 6.2; about 1 run in 10 here and once in CI, always one
    # batch row whole, and not when the reference is made again or with hooks on its modules), while
    # keeping another head in the last layer moves them by 0.27 to 1.3 of it (every family)
    bad = {k: v for k, v in res["diffs"].items() if not v <= 1e-4}
    assert not bad and len(res["diffs"]) == len(jobs)
    assert all(n == 7 for n in res["gen"].values())


# ----------------------------------------------------------------------------- the command line
@pytest.fixture(scope="module")
def llama_src(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("cli") / "src")


def _prune(*args, input=None):
    return runner.invoke(app, ["prune", *map(str, args)], input=input)


def test_removing_nothing_reproduces_the_model(llama_src, tmp_path):
    r = _prune(llama_src, "--heads", "", "-o", tmp_path / "same", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["config_kind"] == "standard"
    a = load_model(str(llama_src), dtype="float32", device="cpu")
    b = load_model(str(tmp_path / "same"), dtype="float32", device="cpu")
    ids = sample_ids("llama")
    assert torch.equal(logits_of(a.model, ids), logits_of(b.model, ids))


def test_scores_from_a_pipe_with_eval_compensation_and_shards(llama_src, tmp_path):
    doc = runner.invoke(app, ["score", str(llama_src), "--method", "magnitude"])
    assert doc.exit_code == 0, doc.stderr
    out = tmp_path / "out"
    r = _prune(llama_src, "--scores", "-", "--fraction", "0.5", "--data", "builtin:pydoc", "--max-samples", "4",
               "--seq-len", "16", "--compensate", "--eval-data", "builtin:pydoc", "--eval-samples", "4",
               "--shard-size", "20KB", "--protect-layers", "none", "-o", out, "--json", input=doc.stdout)
    assert r.exit_code == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["heads_removed"] == 6 and res["eval"]["before"]["loss"] > 0
    assert [c["layer"] for c in res["compensation"]] == [i for i, k in enumerate(res["kept_heads"]) if len(k) < 4]
    assert res["options"]["target"]["unit"] == "head"  # --unit auto with --compensate
    assert "single query heads removed (--unit auto)" in r.stderr and "--unit query keeps" in r.stderr
    assert res["eval_data"]["skip_samples"] == 4  # evaluation blocks never used for calibration
    assert (out / "model.safetensors.index.json").exists()
    assert "query heads" in r.stderr and "KV cache per token" in r.stderr
    lm = load_model(str(out), dtype="float32", device="cpu")
    assert [g.num_heads for g in lm.geometry] == [len(k) for k in res["kept_heads"]]
    hj = json.loads((out / "headtool.json").read_text())
    assert hj["kept_heads"] == res["kept_heads"] and hj["num_kv_heads"] == res["num_kv_heads"]


def test_calibration_text_from_a_pipe_serves_every_cut(llama_src, tmp_path):
    """`--data -` with --compensate cuts calibration and held-out blocks from stdin (it once read
    stdin twice and found the second read empty); with `--scores -` too, stdin cannot hold both."""
    text = "The quick brown fox jumps over the lazy dog. " * 300
    r = _prune(llama_src, "--data", "-", "--num-heads", "2", "--compensate", "--max-samples", "4", "--seq-len", "16",
               "--heldout-samples", "2", "-o", tmp_path / "a", "--json", input=text)
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["options"]["calibration_data"]["source"] == "-"
    # a real pipe, the way a shell runs it
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "headtool", "convert-gqa", str(llama_src), "--kv-heads", "1", "--merge", "fit", "--data", "-",
                        "--max-samples", "4", "--seq-len", "16", "-o", str(tmp_path / "b")],
                       input=text, text=True, capture_output=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = runner.invoke(app, ["score", str(llama_src), "--method", "magnitude"]).stdout
    r = _prune(llama_src, "--scores", "-", "--data", "-", "--num-heads", "2", "--compensate", "-o", tmp_path / "c",
               input=doc)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "both read stdin" in lines[0], r.stderr
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("heads", ["0:0,2;2:1,3", "0:0,0:2,2:1,2:3"], ids=["prune-form", "pair-form"])
def test_heads_in_either_form_remove_the_same_heads(llama_src, tmp_path, heads):
    r = _prune(llama_src, "--heads", heads, "-o", tmp_path / "x", "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["kept_heads"] == [[1, 3], [0, 1, 2, 3], [0, 2]]


def test_the_first_layer_is_protected_unless_told_otherwise(llama_src, tmp_path):
    """Scores that make layer 0 the weakest: by default its heads stay and the others make up the
    number; --protect-layers none ranks it with the rest; a layer that does not exist exits 2."""
    doc = json.loads(runner.invoke(app, ["score", str(llama_src), "--method", "magnitude"]).stdout)
    doc["scores"] = [[0.01, 0.02, 0.03, 0.04], [0.5, 0.6, 0.7, 0.8], [0.9, 1.0, 1.1, 1.2]]
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps(doc))
    r = _prune(llama_src, "--scores", scores, "--num-heads", "2", "--unit", "group", "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["kept_heads"] == [[0, 1, 2, 3], [2, 3], [0, 1, 2, 3]]
    assert res["options"]["target"]["protect_layers"] == [0] and "(protected)" in r.stderr
    r = _prune(llama_src, "--scores", scores, "--num-heads", "2", "--unit", "group", "--protect-layers", "none",
               "--dry-run", "--json")
    assert json.loads(r.stdout)["kept_heads"] == [[2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    r = _prune(llama_src, "--scores", scores, "--num-heads", "2", "--unit", "group", "--protect-layers", "0,-1",
               "--dry-run", "--json")
    assert json.loads(r.stdout)["kept_heads"] == [[0, 1, 2, 3], [2, 3], [0, 1, 2, 3]]
    r = _prune(llama_src, "--scores", scores, "--num-heads", "6", "--scope", "layer", "--dry-run", "--json")
    assert [len(k) for k in json.loads(r.stdout)["kept_heads"]] == [2, 2, 2]  # auto: none with --scope layer
    for value, msg in (("3", "layer 3 does not exist"), ("x", "cannot read 'x'")):
        r = _prune(llama_src, "--scores", scores, "--num-heads", "2", "--protect-layers", value, "-o", tmp_path / "n")
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and msg in lines[0], r.stderr
        assert not (tmp_path / "n").exists()


@pytest.mark.parametrize("layers", [1, 3])
def test_streamed_prune_resolves_auto_protection_against_the_checkpoint(tmp_path, layers):
    """--streaming reads the layer count from the checkpoint before it resolves `auto`: a one-layer
    model is ranked (nothing protected, as in memory), a deeper one keeps its first layer; the
    streamed heads equal the in-memory prune's."""
    src = save_tiny("llama", tmp_path / "src", num_hidden_layers=layers)
    doc = json.loads(runner.invoke(app, ["score", str(src), "--method", "magnitude"]).stdout)
    doc["scores"] = [[0.01 * (i + 1) + j for j in range(4)] for i in range(layers)]  # layer 0 the weakest
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps(doc))
    kept = {}
    for mode in ("streaming", "in-memory"):
        r = _prune(src, "--scores", scores, "--num-heads", "2", "-o", tmp_path / mode, "--json",
                   *(["--streaming"] if mode == "streaming" else []))
        assert r.exit_code == 0, r.stderr
        kept[mode] = json.loads(r.stdout)["kept_heads"]
    assert kept["streaming"] == kept["in-memory"]
    assert len(kept["streaming"][0]) == (4 if layers > 1 else 2)
    meta = json.loads((tmp_path / "streaming" / "headtool.json").read_text())
    assert meta["options"]["target"]["protect_layers"] == ([0] if layers > 1 else [])


def test_prune_help_states_the_head_grammar():
    text = " ".join(runner.invoke(app, ["prune", "--help"]).stdout.split())
    assert '"3:0,5;7:2"' in text and '"3:1,5:0"' in text


@pytest.mark.parametrize("streaming", [False, True], ids=["in-memory", "streaming"])
def test_outputs_name_the_source_as_typed(llama_src, tmp_path, monkeypatch, streaming):
    """headtool.json and the card name the model as the user typed it (here `~/...`); the
    resolved folder is kept beside it under `path`, and the card does not show it."""
    import shutil

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(llama_src, tmp_path / "models" / "tiny")
    out = tmp_path / "out"
    r = _prune("~/models/tiny", "--heads", "0:0,2", "-o", out, "--json", *(["--streaming"] if streaming else []))
    assert r.exit_code == 0, r.stderr
    doc = json.loads((out / "headtool.json").read_text())
    assert doc["source"]["ref"] == "~/models/tiny" and doc["source"]["path"] == str(tmp_path / "models" / "tiny")
    card = (out / "README.md").read_text()
    assert "# prune of ~/models/tiny\n" in card and str(tmp_path) not in card
    if not streaming:
        assert json.loads(r.stdout)["source"]["ref"] == "~/models/tiny"


def test_dry_run_writes_nothing(llama_src, tmp_path):
    r = _prune(llama_src, "--heads", "0:0,2", "-o", tmp_path / "x", "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["layers"][0]["heads_after"] == 2
    assert not (tmp_path / "x").exists()


def test_bad_targets_exit_2_with_one_line_and_write_nothing(llama_src, tmp_path):
    other = save_tiny("llama", tmp_path / "other", seed=5)
    other_scores = tmp_path / "other.json"
    assert runner.invoke(app, ["score", str(other), "--method", "magnitude", "-o", str(other_scores)]).exit_code == 0
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "config.json").write_text("{}")
    out = tmp_path / "never"
    cases = [
        (["--heads", "0:0", "--fraction", "1.5"], "--heads"),
        (["--scores", other_scores, "--fraction", "1.5"], "fraction"),
        (["--scores", other_scores, "--fraction", "0"], "fraction"),
        (["--scores", other_scores, "--num-heads", "99"], "only 12"),
        (["--scores", other_scores, "--fraction", "0.5", "--min-heads-per-layer", "9"], "impossible"),
        (["--scores", other_scores, "--fraction", "0.2"], "fingerprint"),
        (["--heads", "7:0"], "layer 7"),
        (["--heads", "0:0"], "unequal"),
        (["--heads", "0:0,2,0"], "layer 0 head 0 is listed twice"),
        (["--heads", "0;1:2"], "head 0 has no layer before it"),
        (["--heads", "0:9"], "layer 0 has query heads 0..3, not 9"),
        (["--heads", "layer0"], "LAYER:HEAD,HEAD;LAYER:HEAD"),
    ]
    for args, msg in cases:
        r = _prune(llama_src, *args, "-o", out)
        assert r.exit_code == 2, (args, r.stderr)
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and msg.lower() in lines[0].lower(), (args, r.stderr)
        assert not out.exists()
    r = _prune(llama_src, "--heads", "0:0,2", "-o", existing)
    assert r.exit_code == 2 and "--overwrite" in r.stderr and (existing / "config.json").read_text() == "{}"
    r = _prune(llama_src, "--heads", "0:0,2", "-o", llama_src / "inside")
    assert r.exit_code == 2 and "inside the input" in r.stderr and not (llama_src / "inside").exists()
    r = _prune(llama_src, "--heads", "0:0,2", "-o", existing, "--overwrite")
    assert r.exit_code == 0 and (existing / "headtool.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_sequential_calibration_writes_the_same_checkpoint(llama_src, tmp_path):
    """--sequential (model kept on CPU, one layer at a time on --device) changes where, not what."""
    from safetensors.torch import load_file

    args = ["--heads", "0:1,2;2:0,3", "--data", "builtin:pydoc", "--max-samples", "4", "--seq-len", "16",
            "--compensate", "--device", "cpu"]
    plain, seq = tmp_path / "plain", tmp_path / "seq"
    assert _prune(llama_src, *args, "-o", plain).exit_code == 0
    r = _prune(llama_src, *args, "--sequential", "-o", seq)
    assert r.exit_code == 0, r.stderr
    a, b = load_file(plain / "model.safetensors"), load_file(seq / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    bad = _prune(llama_src, *args, "--sequential", "--device-map", "auto", "-o", tmp_path / "bad")
    assert bad.exit_code == 2 and "--sequential" in bad.stderr


def test_auto_protection_needs_a_ranking_across_layers():
    """`auto` protects the first layer only where layers are ranked together: not in a model of
    one layer (it would protect everything), not with --scope layer."""
    from headtool.workflows.prune import prune_target
    from headtool.workflows.requests import PruneRequest

    from headtool.arch import LayerHeads

    layers = lambda n: [LayerHeads(6, 3, 8)] * n  # noqa: E731
    assert prune_target(PruneRequest(model="m", fraction=0.5), layers(30)).protect == (0,)
    assert prune_target(PruneRequest(model="m", fraction=0.5), layers(1)).protect == ()
    assert prune_target(PruneRequest(model="m", fraction=0.5, scope="layer"), layers(30)).protect == ()
    assert prune_target(PruneRequest(model="m", fraction=0.5, protect_layers="0"), layers(1)).protect == (0,)
    # and --unit auto: single heads for a compensated prune over all layers (selection.resolve_unit)
    assert prune_target(PruneRequest(model="m", fraction=0.5, compensate=True), layers(2)).unit == "head"
    assert prune_target(PruneRequest(model="m", fraction=0.5), layers(2)).unit == "query"
