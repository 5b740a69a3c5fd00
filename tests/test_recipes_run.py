"""Every shipped recipe runs (on tiny models substituted through --set) and writes a loadable model."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from headtool.cli.app import app
from headtool.model.loading import load_model
from tiny_models import checkpoint_tensors, save_tiny, tiny_model, tokenizer_for

runner = CliRunner()
RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe-models")
    dec = save_tiny("llama", root / "llama")
    enc = root / "minilm-like"
    tiny_model("bert").bert.save_pretrained(enc)  # headless, like all-MiniLM-L6-v2
    tokenizer_for("bert").save_pretrained(enc)
    return {"decoder": dec, "encoder": enc}


def test_recipes_are_shipped():
    names = {p.stem for p in RECIPES}
    assert {"demo", "encoder-kl-prune", "prune-gqa-compensated", "gqa-aligned-merge"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_shipped_recipe_runs(recipe, tiny_folders, tmp_path):
    text = recipe.read_text()
    model = tiny_folders["encoder" if "minilm" in text else "decoder"]
    out = tmp_path / "out"
    args = ["run", str(recipe), "--set", f"model={model}", "--set", "data.max_samples=4",
            "--set", "data.seq_len=16", "--set", "data.batch_size=2", "-o", str(out), "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert [r["step"] for r in summary["steps"]][0] == "load"
    assert len(summary["steps"]) == 1 + len(summary["recipe"]["steps"])
    meta = json.loads((out / "headtool.json").read_text())
    assert meta["recipe"]["model"] == str(model)  # the resolved recipe is saved
    assert "Recipe:" in (out / "README.md").read_text()
    reloaded = load_model(str(out))
    ids = torch.randint(5, 300, (1, 12))
    with torch.no_grad():
        assert torch.isfinite(reloaded.model(input_ids=ids)[0]).all()
    last = summary["steps"][-1]
    assert last["heads"] <= summary["steps"][0]["heads"]


def test_check_only_and_all_problems_at_once(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: ./nope\nsteps:\n  - prune: {fraction: 2}\n  - convert_gqa: {}\n")
    res = runner.invoke(app, ["run", str(bad), "--check"])
    assert res.exit_code == 2
    assert "4 problem(s)" in res.stderr and f"{bad}:3:" in res.stderr and "Traceback" not in res.stderr
    assert "steps.0 (prune), steps.1 (convert_gqa) rewrite the weights but the recipe has no output" in res.stderr


def test_impossible_targets_are_found_before_running(tiny_folders, tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text(f"model: {tiny_folders['decoder']}\nsteps:\n  - convert_gqa: {{kv_heads: 3}}\n"
                 "  - prune: {num_heads: 99}\n")
    res = runner.invoke(app, ["run", str(r), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert "2 problem(s)" in res.stderr and not (tmp_path / "o").exists()


def test_recipe_with_a_heal_step(tiny_folders, tmp_path):
    r = tmp_path / "heal.yaml"
    r.write_text(f"model: {tiny_folders['decoder']}\ndtype: float32\nseed: 0\n"
                 "data: {source: 'builtin:pydoc', seq_len: 16, batch_size: 2, max_samples: 8}\n"
                 "steps:\n  - prune: {heads: '0:0,2;1:1,3'}\n  - heal: {max_steps: 4, data: {num_tokens: 256, max_samples: null}}\n"
                 "  - eval: {data: {skip_samples: 40, max_samples: 4}}\n")
    res = runner.invoke(app, ["run", str(r), "-o", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    steps = json.loads(res.stdout)["steps"]
    assert [s["step"] for s in steps] == ["load", "prune", "heal", "eval"]
    assert steps[2]["steps"] == 4 and steps[1]["heads"] == 8
    assert (tmp_path / "out" / "headtool.json").exists()
    # the heal row carries its held-out figures before and after (it named keys the result never had)
    heal = steps[2]
    assert heal["distill_after"] <= heal["distill_before"]  # the kept weights are never worse held-out
    assert heal["perplexity"] == pytest.approx(math.exp(heal["loss_after"]))
    assert heal["perplexity_before"] == pytest.approx(math.exp(heal["loss_before"]))
    assert "loss before" in res.stderr and f"{heal['loss_before']:.4f}" in res.stderr


def test_convert_step_records_how_close_the_merges_were(tiny_folders, tmp_path):
    """A convert_gqa step with several merges reports each held-out loss and, for the merges it did
    not keep, the paired gap to the kept one (as convert-gqa's summary does)."""
    r = tmp_path / "merge.yaml"
    r.write_text(f"model: {tiny_folders['decoder']}\ndtype: float32\nseed: 0\n"
                 "data: {source: 'builtin:pydoc', seq_len: 16, batch_size: 2, max_samples: 8}\n"
                 "steps:\n  - convert_gqa: {kv_heads: 1, merge: 'mean,fit'}\n")
    res = runner.invoke(app, ["run", str(r), "-o", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    step = json.loads(res.stdout)["steps"][1]
    losses, kept = step["heldout_loss"], step["merge"]
    (other,) = set(losses) - {kept}
    gap = step["heldout_gap"]
    assert set(gap) == {other} and gap[other]["standard_error"] > 0
    assert gap[other]["difference"] == pytest.approx(losses[other] - losses[kept], rel=1e-4, abs=1e-6)


def test_convert_step_choosing_on_its_eval_data_says_so_and_records_it(tiny_folders, tmp_path):
    """A convert_gqa step with several merges, heldout_samples 0 and eval_data chose the merge on the
    evaluation blocks, unsaid: the row and a warning say so, and the output records them as fitted on."""
    r = tmp_path / "merge.yaml"
    r.write_text(f"model: {tiny_folders['decoder']}\ndtype: float32\nseed: 0\n"
                 "data: {source: 'builtin:pydoc', seq_len: 16, batch_size: 2, max_samples: 4}\n"
                 "steps:\n  - convert_gqa: {kv_heads: 1, merge: 'mean,fit', heldout_samples: 0, "
                 "eval_data: 'builtin:licenses', eval_samples: 2}\n")
    res = runner.invoke(app, ["run", str(r), "-o", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    step = json.loads(res.stdout)["steps"][1]
    assert step["merge_chosen_on"] == "eval_data" and "chosen on the --eval-data blocks" in " ".join(res.stderr.split())
    meta = json.loads((tmp_path / "out" / "headtool.json").read_text())
    assert {e["role"] for e in meta["data_read"] if e["source"] == "builtin:licenses"} == {"fit", "eval"}


def test_sequential_recipe_equals_the_plain_one(tiny_folders, tmp_path, monkeypatch):
    """`sequential: true` routes compensation and data-aware merging through the one-layer-at-a-time
    path (as --sequential does); on CPU it must write the weights of the plain run."""
    body = (f"model: {tiny_folders['decoder']}\ndtype: float32\nseed: 0\ndevice: cpu\n"
            "data: {source: 'builtin:pydoc', seq_len: 16, batch_size: 2, max_samples: 4}\n"
            "steps:\n  - prune: {heads: '0:1,3;1:0,2', compensate: true}\n  - convert_gqa: {kv_heads: 1, merge: fit}\n")
    import headtool.measure.layerwise as layerwise

    visits: list = []
    real_on_device = layerwise.on_device

    def spy(layer, device):
        visits.append(device)
        return real_on_device(layer, device)

    monkeypatch.setattr(layerwise, "on_device", spy)
    outs, placed = {}, {}
    for name, extra in (("plain", ""), ("sequential", "sequential: true\n")):
        visits.clear()
        r = tmp_path / f"{name}.yaml"
        r.write_text(extra + body)
        res = runner.invoke(app, ["run", str(r), "-o", str(tmp_path / name), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["recipe"].get("sequential") is (True if extra else None)
        outs[name] = checkpoint_tensors(tmp_path / name)
        placed[name] = {str(d) for d in visits}
    assert placed["plain"] <= {"None"} and placed["sequential"] == {"cpu"}  # layers were sent to the device
    assert outs["plain"].keys() == outs["sequential"].keys()
    for k, v in outs["plain"].items():
        torch.testing.assert_close(outs["sequential"][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lines, needle", [
    ("sequential: true\ndevice_map: auto\n", "device_map: sequential places layers itself"),
    ("max_memory: cpu=1GiB\n", "max_memory: caps devices for device_map"),
    ("device_map: auto\nmax_memory: gpu=lots\n", "max_memory: unknown device 'gpu'"),
    ("sequential: yes please\n", "sequential:"),
])
def test_placement_keys_are_validated_with_their_location(tiny_folders, tmp_path, lines, needle):
    r = tmp_path / "r.yaml"
    r.write_text(f"model: {tiny_folders['decoder']}\n{lines}steps:\n  - score: {{method: magnitude}}\n")
    res = runner.invoke(app, ["run", str(r), "--check"])
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and f"{r}:" in res.stderr and "Traceback" not in res.stderr


def test_offloaded_recipe_scores_and_evaluates_but_refuses_rewrites(tiny_folders, tmp_path):
    pytest.importorskip("accelerate")
    head = (f"model: {tiny_folders['decoder']}\ndtype: float32\ndevice: cpu\ndevice_map: auto\n"
            "max_memory: cpu=200KB\ndata: {source: 'builtin:pydoc', seq_len: 16, batch_size: 2, max_samples: 4}\n")
    ok = tmp_path / "ok.yaml"
    ok.write_text(head + "steps:\n  - score: {method: gradient}\n  - eval: {}\n")
    res = runner.invoke(app, ["run", str(ok), "--json"])
    assert res.exit_code == 0, res.output
    offloaded = json.loads(res.stdout)["steps"][-1]
    plain = tmp_path / "plain.yaml"
    plain.write_text(head.replace("device_map: auto\nmax_memory: cpu=200KB\n", "")
                     + "steps:\n  - score: {method: gradient}\n  - eval: {}\n")
    res = runner.invoke(app, ["run", str(plain), "--json"])
    assert res.exit_code == 0, res.output
    assert offloaded["loss"] == pytest.approx(json.loads(res.stdout)["steps"][-1]["loss"], rel=1e-5)
    bad = tmp_path / "bad.yaml"
    bad.write_text(head + "steps:\n  - prune: {heads: '0:1', unit: head}\n")
    res = runner.invoke(app, ["run", str(bad), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert "use sequential: true" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_demo_summary_states_its_calibration_and_a_domain_it_never_saw(tiny_folders, tmp_path):
    """Issue 18: the demo says which text it was calibrated on and reports the perplexity on a
    domain no step saw (builtin:licenses) before the flattering in-domain figure."""
    from headtool.cli.commands.demo import outputs_line, quality_lines

    recipe = next(p for p in RECIPES if p.stem == "demo")
    res = runner.invoke(app, ["run", str(recipe), "--set", f"model={tiny_folders['decoder']}",
                              "--set", "data.max_samples=4", "--set", "data.seq_len=16", "--set", "steps.3.data.max_samples=4",
                              "--set", "steps.4.data.max_samples=4", "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    data = {r["step"]: r.get("data") for r in summary["steps"][1:4]}
    assert data == {"score": "builtin:pydoc+self", "prune": "builtin:pydoc+self", "convert_mla": "builtin:pydoc+self"}
    assert outputs_line("headtool-demo", summary | {"output": {"config_kind": "headtool-remote-code"}}) == (
        "outputs in headtool-demo/: scores.json, model/ (reload with headtool, or with transformers: "
        "AutoModelForCausalLM.from_pretrained('headtool-demo/model', trust_remote_code=True))")
    assert outputs_line("d", {"output": {"config_kind": "standard"}}).endswith("from_pretrained('d/model'))")
    lines = quality_lines(summary)
    assert lines[0] == "calibrated on builtin:pydoc+self"
    assert lines[1].startswith("perplexity on builtin:licenses, a domain no step saw: ")
    assert lines[2].startswith("perplexity on builtin:pydoc, held-out blocks of the calibration's kind (flatters): ")
    # each figure with its standard error over the 4 blocks (paired with the original on the same blocks)
    licences = next(r for r in summary["steps"] if r["step"] == "eval" and r["data"] == "builtin:licenses")
    ratio = licences["perplexity"] / licences["perplexity_before"]
    assert licences["loss_delta_se"] > 0
    assert lines[1].endswith(f"({ratio:.2f}x the original, ± {ratio * licences['loss_delta_se']:.2f} over these "
                             "blocks)")
    assert "data" in res.stderr  # the summary table's column


def test_kept_heads_name_the_recipe_models_heads_through_every_step(tmp_path):
    """A recipe's headtool.json gives its model as the source, so kept_heads and kv_groups name that
    model's query heads, composed through every step: a second prune was left out (only the first
    prune's heads were recorded) and the conversion's groups were positions in the pruned model."""
    src = save_tiny("llama", tmp_path / "src")  # 3 layers of 4 query heads over 2 KV heads
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\noutput: {tmp_path / 'out'}\n"
                      "data: {source: 'builtin:pydoc', seq_len: 16, batch_size: 2, max_samples: 2}\nsteps:\n"
                      "  - prune: {heads: '1:0,2'}\n  - prune: {heads: '0:0,2;2:1,3'}\n"
                      "  - convert_gqa: {kv_heads: 1, merge: mean}\n")
    res = runner.invoke(app, ["run", str(recipe)])
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "out" / "headtool.json").read_text())
    assert meta["kept_heads"] == [[1, 3], [1, 3], [0, 2]]
    assert meta["kv_groups"] == [[[1, 3]], [[1, 3]], [[0, 2]]]
    # the mean merge leaves the query rows as they are: each kept row is the named head's row of the source
    before, after = checkpoint_tensors(src), checkpoint_tensors(tmp_path / "out")
    for layer, kept in enumerate(meta["kept_heads"]):
        q = f"model.layers.{layer}.self_attn.q_proj.weight"
        d = before[q].shape[0] // 4
        assert torch.equal(after[q], torch.cat([before[q][h * d:(h + 1) * d] for h in kept]))


def test_a_recipe_eval_marks_text_an_earlier_step_was_fitted_on(tmp_path):
    """As `headtool eval` does: the eval step on the calibration's source is marked in-domain (it flatters),
    the one on another domain is not (recipe evals carried no mark)."""
    src = save_tiny("llama", tmp_path / "src")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\n"
                      "data: {source: 'builtin:pydoc', seq_len: 16, batch_size: 2, max_samples: 4}\nsteps:\n"
                      "  - prune: {heads: '1:0', compensate: true}\n"
                      "  - eval: {data: {source: 'builtin:licenses', max_samples: 2}}\n"
                      "  - eval: {data: {max_samples: 2}}\n")
    res = runner.invoke(app, ["run", str(recipe), "--dry-run", "--json"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    evals = [r for r in json.loads(res.stdout)["steps"] if r["step"] == "eval"]
    assert [(r["data"], r["in_domain"]) for r in evals] == [("builtin:licenses", False), ("builtin:pydoc", True)]
    assert "builtin:pydoc *" in res.stderr and "in-domain" in res.stderr


def test_a_recipe_eval_on_the_calibrations_mixture_starts_after_it_as_headtool_eval_does(tmp_path):
    """An eval step on the mixture the steps calibrated on (the recipe's own data block) evaluated the
    calibration blocks themselves, from block 0, where `headtool eval` of the written model starts after
    them: the two disagreed on the loss. The step now makes eval's cut on the record its output carries."""
    texts = {"a.txt": "alpha {i} beta {j} gamma.", "b.txt": "delta {i} epsilon {j} zeta."}
    for name, line in texts.items():
        (tmp_path / name).write_text(" ".join(line.format(i=i, j=i * 7 % 13) for i in range(1500)))
    src = save_tiny("llama", tmp_path / "src")
    mixture = f"{tmp_path / 'a.txt'}+{tmp_path / 'b.txt'}"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\noutput: {tmp_path / 'out'}\n"
                      f"data: {{source: '{mixture}', seq_len: 16, batch_size: 2, max_samples: 4}}\nsteps:\n"
                      "  - convert_gqa: {kv_heads: 1, merge: fit, heldout_samples: 2}\n"
                      "  - eval: {data: {max_samples: 2}}\n")
    res = runner.invoke(app, ["run", str(recipe), "--json"])
    assert res.exit_code == 0, res.output
    row = json.loads(res.stdout)["steps"][-1]
    assert row["skip_samples"] == 6 and row["in_domain"] is True  # after 4 calibration + 2 held-out blocks
    res = runner.invoke(app, ["eval", str(src), str(tmp_path / "out"), "--data", mixture, "--seq-len", "16",
                              "--batch-size", "2", "--max-samples", "2", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["data"]["skip_samples"] == 6
    assert [r["loss"] for r in doc["results"]] == [row["loss_before"], row["loss"]]


def test_a_score_document_on_stdout_beside_run_json_is_refused(tmp_path):
    """`output: '-'` and `run --json` both wrote to stdout: two JSON documents that no reader parses."""
    src = save_tiny("llama", tmp_path / "src")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\nsteps:\n  - score: {{method: magnitude, output: '-'}}\n")
    for extra in (["--json"], ["--check", "--json"]):
        res = runner.invoke(app, ["run", str(recipe), *extra])
        assert res.exit_code == 2, res.output
        assert "steps.0.output" in res.stderr and "--json" in res.stderr
    res = runner.invoke(app, ["run", str(recipe)])  # alone on stdout, the document is one JSON document
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["scores"]


def test_a_prune_after_a_conversion_scores_the_converted_heads_itself(tmp_path, monkeypatch):
    """An earlier score step's scores were handed to a prune after convert_gqa, which reorders the query
    heads into their groups (grouping: similarity): the prune removed heads by other heads' scores."""
    from headtool.workflows import recipe_runner

    given = []
    real = recipe_runner.prune_loaded

    def spy(lm, req, **kw):
        given.append(kw.get("scores"))
        return real(lm, req, **kw)

    monkeypatch.setattr(recipe_runner, "prune_loaded", spy)
    src = save_tiny("llama", tmp_path / "src")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\ndtype: float32\n"
                      "data: {source: 'builtin:pydoc', seq_len: 16, batch_size: 2, max_samples: 2}\nsteps:\n"
                      f"  - score: {{method: magnitude, output: {tmp_path / 's.json'}}}\n"
                      "  - convert_gqa: {kv_heads: 1, merge: mean, grouping: similarity}\n"
                      "  - prune: {num_heads: 2}\n"
                      "  - score: {method: magnitude}\n  - prune: {num_heads: 2}\n")
    res = runner.invoke(app, ["run", str(recipe), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert given[0] is None and given[1] is not None


def test_the_recorded_recipe_names_the_output_it_was_written_to(tmp_path):
    """With -o the model was written there, but headtool.json's recipe, the model card's and `run --json`'s
    named the recipe file's output: (another folder): the recipe as run was not the one recorded."""
    src = save_tiny("llama", tmp_path / "src")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\noutput: {tmp_path / 'elsewhere'}\nsteps:\n  - prune: {{heads: '1:0', unit: head}}\n")
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(recipe), "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["recipe"]["output"] == str(out)
    assert json.loads((out / "headtool.json").read_text())["recipe"]["output"] == str(out)
    assert f"output: {out}\n" in (out / "README.md").read_text() and "elsewhere" not in (out / "README.md").read_text()
    assert not (tmp_path / "elsewhere").exists()
    res = runner.invoke(app, ["run", str(recipe), "-o", str(out), "--overwrite", "--check", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["output"] == str(out) and json.loads(res.stdout)["overwrite"] is True
    res = runner.invoke(app, ["run", str(recipe), "--check", "--json"])
    assert json.loads(res.stdout)["output"] == str(tmp_path / "elsewhere") and "overwrite" not in json.loads(res.stdout)


def test_a_step_refused_while_running_is_named_and_listed_heads_are_checked_before_any_step(tmp_path):
    """A prune step's heads: that leave KV groups unequal were refused only when the run reached the step
    (after every step before it), as 'error: layer 1: kept query heads ...', naming no step of a recipe
    that may prune twice; any step refused while running named none either."""
    src = save_tiny("llama", tmp_path / "src")  # 3 layers of 4 query heads over 2 KV heads
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\noutput: {tmp_path / 'out'}\n"
                      "data: {source: 'builtin:pydoc', seq_len: 16, batch_size: 2, max_samples: 2}\nsteps:\n"
                      "  - eval: {}\n  - prune: {heads: '0:0,1', unit: query}\n  - prune: {heads: '1:0', unit: query}\n")
    res = runner.invoke(app, ["run", str(recipe)])
    assert res.exit_code == 2, res.output
    assert f"{recipe}:7:12: steps.2: layer 1: kept query heads" in res.stderr, res.stderr
    assert "step 1/" not in res.stderr and not (tmp_path / "out").exists()  # before the eval step ran
    (tmp_path / "short.txt").write_text("a few words only")
    recipe.write_text(f"model: {src}\noutput: {tmp_path / 'out'}\nsteps:\n  - prune: {{heads: '1:0,1'}}\n"
                      f"  - eval: {{data: {{source: {tmp_path / 'short.txt'}, seq_len: 64}}}}\n")
    res = runner.invoke(app, ["run", str(recipe)])
    assert res.exit_code == 2, res.output
    line = " ".join(res.stderr.split("error: ", 1)[1].split())
    assert line.startswith(f"{recipe}:5:11: steps.1 (eval): "), res.stderr
    assert not (tmp_path / "out").exists()


def test_a_prune_that_scores_the_heads_itself_names_its_data_in_the_summary(tmp_path):
    """The summary's data column (and `run --json`'s row) named a prune's data only when it refit: a prune
    that scored the heads on builtin:pydoc showed none, as if it had read no text."""
    src = save_tiny("llama", tmp_path / "src")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\ndtype: float32\n"
                      "data: {source: 'builtin:pydoc', seq_len: 16, batch_size: 2, max_samples: 2}\nsteps:\n"
                      "  - prune: {num_heads: 2, method: gradient}\n  - prune: {num_heads: 2, method: magnitude}\n")
    res = runner.invoke(app, ["run", str(recipe), "--dry-run", "--json"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["steps"]
    assert rows[1]["data"] == "builtin:pydoc" and "data" not in rows[2]
    assert "prune │ builtin:pydoc" in res.stderr


def test_a_recipe_refused_at_a_later_step_leaves_no_score_document(tmp_path):
    """A score step wrote its document when it ran: a later step refused (exit 2, no model written) left
    that document behind, a file from a run that was refused."""
    src = save_tiny("llama", tmp_path / "src")
    (tmp_path / "short.txt").write_text("a few words only")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\nsteps:\n  - score: {{method: magnitude, output: {tmp_path / 's.json'}}}\n"
                      f"  - eval: {{data: {{source: {tmp_path / 'short.txt'}, seq_len: 64}}}}\n")
    res = runner.invoke(app, ["run", str(recipe)])
    assert res.exit_code == 2, res.output
    assert not (tmp_path / "s.json").exists()
    recipe.write_text(f"model: {src}\nsteps:\n  - score: {{method: magnitude, output: {tmp_path / 's.json'}}}\n")
    assert runner.invoke(app, ["run", str(recipe)]).exit_code == 0
    assert json.loads((tmp_path / "s.json").read_text())["scores"]
