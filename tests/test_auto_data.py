"""`--data auto`, the default of the steps that calibrate: builtin:pydoc mixed with text sampled
from the model on a causal LM (the calibration that held up best out of domain), builtin:pydoc on
other models; eval and inspect keep builtin:pydoc. Evaluation or held-out blocks of one source of
a calibration mixture never overlap the blocks the mixture read."""
from __future__ import annotations

import json

import pytest
from _data_fixtures import tiny_causal_tokenizer
from tiny_models import save_tiny
from typer.testing import CliRunner

from headtool.cli import app
from headtool.data.batches import blocks_read, make_batches, resolve_auto
from headtool.data.sources import DataSpec, parse_sources
from headtool.distributed import World
from headtool.errors import UsageError
from headtool.model.loading import load_model
from headtool.train.options import HealOptions
from headtool.workflows.data_plan import eval_spec, heldout_spec, part_blocks
from headtool.workflows.heal import _data_specs
from headtool.workflows.recipe_runner import build_request
from headtool.workflows.recipe_schema import load_recipe, normalise_steps

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("family,expected", [("llama", "builtin:pydoc+self"), ("gpt2", "builtin:pydoc+self"),
                                             ("bert", "builtin:pydoc")])
def test_auto_is_pydoc_and_self_text_on_causal_lms_and_pydoc_elsewhere(tmp_path, family, expected):
    lm = load_model(str(save_tiny(family, tmp_path / "m")), dtype="float32")
    task = "lm" if lm.task == "causal-lm" else "mlm"
    spec = resolve_auto(DataSpec(source="auto", seq_len=16, max_samples=4), lm.tokenizer, lm, task)
    assert spec.source == expected
    assert resolve_auto(spec, lm.tokenizer, lm, task) is spec  # a concrete source is left as it is
    # make_batches resolves it too (for callers that hand it `auto`), to the same blocks
    a = make_batches(DataSpec(source="auto", seq_len=16, max_samples=4), lm.tokenizer, task, model=lm)
    b = make_batches(spec, lm.tokenizer, task, model=lm)
    assert a.info["source"] == expected and a.info["fingerprint"] == b.info["fingerprint"]


def test_auto_without_a_model_or_for_labelled_data_is_pydoc():
    tok = tiny_causal_tokenizer()
    assert resolve_auto(DataSpec(source="auto"), tok, None).source == "builtin:pydoc"
    assert resolve_auto(DataSpec(source=" AUTO "), tok, None).source == "builtin:pydoc"


def test_auto_stands_alone_in_a_mixture():
    with pytest.raises(UsageError, match="auto stands alone"):
        parse_sources("auto+builtin:licenses")
    with pytest.raises(UsageError, match="auto stands alone"):
        parse_sources("builtin:licenses*2+auto*1")


def test_the_calibrating_commands_default_to_auto_and_eval_keeps_pydoc(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / "cache"))
    src = save_tiny("llama", tmp_path / "src")
    for cmd in ("score", "convert-gqa", "convert-mla", "heal"):
        helptext = _run(cmd, "--help").output
        assert "auto" in helptext and "builtin:pydoc+self" in helptext, cmd
    res = _run("score", src, "--max-samples", 4, "--seq-len", 16)
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["data"]["source"] == "builtin:pydoc+self"
    assert "--data auto: builtin:pydoc+self" in res.stderr
    assert list((tmp_path / "cache" / "selfcal").glob("*.json"))  # the self text was sampled and cached
    ev = _run("eval", src, "--max-samples", 2, "--seq-len", 16, "--json")
    assert ev.exit_code == 0, ev.stderr
    assert json.loads(ev.stdout)["data"]["source"] == "builtin:pydoc"
    bad = _run("score", src, "--data", "auto+builtin:licenses", "--seq-len", 16)
    assert bad.exit_code == 2 and "auto stands alone" in bad.stderr and "Traceback" not in bad.output


def _tiny_recipe(tmp_path, monkeypatch, steps: str):
    """A recipe on a tiny llama with a data block that names no source (each step's default)."""
    monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / "cache"))
    src = save_tiny("llama", tmp_path / "src")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\ndtype: float32\ndata: {{seq_len: 16, max_samples: 4}}\nsteps:\n" + steps)
    return recipe


def test_a_recipe_without_data_calibrates_on_auto_and_evaluates_on_pydoc(tmp_path, monkeypatch):
    recipe = _tiny_recipe(tmp_path, monkeypatch, "  - prune: {fraction: 0.25, compensate: true}\n"
                          "  - convert_gqa: {kv_heads: 1, merge: fit}\n  - eval: {}\n")
    r = load_recipe(recipe)
    normalise_steps(r)
    requests = [build_request(r, s) for s in r.steps]
    assert [q.data.source for q in requests] == ["auto", "auto", "builtin:pydoc"]
    with blocks_read() as seen:
        res = _run("run", recipe, "-o", tmp_path / "out", "--json")
    assert res.exit_code == 0, res.stderr
    steps = json.loads(res.stdout)["steps"]
    # the eval step (pydoc, no skip_samples given) starts after every pydoc block the prune and
    # the merge read as part of their mixtures (calibration and held-out): no flattering overlap
    mixed = [i for i in seen if "mixture" in i]
    read = max(p["skip_samples"] + p["samples"] for i in mixed for p in i["mixture"] if p["source"] == "builtin:pydoc")
    evals = [i for i in seen if i["source"] == "builtin:pydoc"]
    assert read > 0 and evals and all(i["skip_samples"] == read for i in evals)
    assert steps[-1]["skip_samples"] == read and "from block" in res.stderr
    assert [(s["step"], s.get("data")) for s in steps[1:]] == [
        ("prune", "builtin:pydoc+self"), ("convert_gqa", "builtin:pydoc+self"), ("eval", "builtin:pydoc")]


def _rows(batches) -> set[tuple[int, ...]]:
    return {tuple(r.tolist()) for b in batches for r in b["input_ids"]}


def test_evaluation_and_held_out_blocks_of_a_mixture_source_follow_the_ones_it_read(tmp_path):
    """The evaluation (or held-out) blocks of one source of a calibration mixture start after the
    blocks of that source the mixture read: disjoint, and the very next ones."""
    tok = tiny_causal_tokenizer()
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(" ".join(f"alpha {i} beta {i * 7} gamma." for i in range(2000)))
    b.write_text(" ".join(f"delta {i} epsilon {i * 3} zeta." for i in range(2000)))
    spec = DataSpec(source=f"{a}*2+{b}", seq_len=16, max_samples=9, batch_size=4)
    cal = make_batches(spec, tok, "lm")
    mix = {m["source"]: m["samples"] for m in cal.info["mixture"]}
    assert mix == {str(a): 6, str(b): 3}
    assert part_blocks(spec, str(a), 9) == 6 and part_blocks(spec, str(b), 9) == 3
    assert part_blocks(spec, "builtin:pydoc", 9) is None and part_blocks(DataSpec(source=str(a)), str(a), 9) is None

    alone = make_batches(DataSpec(source=str(a), seq_len=16, max_samples=10), tok, "lm")
    first_a = [tuple(r.tolist()) for bt in alone.batches for r in bt["input_ids"]]
    cal_rows = _rows(cal.batches)
    read = set(first_a) & cal_rows
    assert len(read) == 6  # the mixture read 6 of the first 10 blocks of a.txt (in a.txt's seeded order)
    espec, skip = eval_spec(spec, str(a), 4, 9)
    assert skip == 6
    ev_rows = {tuple(r.tolist()) for bt in make_batches(espec, tok, "lm").batches for r in bt["input_ids"]}
    assert len(ev_rows) == 4 and not ev_rows & cal_rows and ev_rows | read == set(first_a)  # the next 4
    hspec = heldout_spec(spec, str(b), 2, 9)
    assert hspec.skip_samples == 3
    given, _ = eval_spec(spec, DataSpec(source=str(a), seq_len=16), 4, 9)  # a recipe's eval block
    assert given.skip_samples == 6
    with pytest.raises(UsageError, match="a source of --data"):
        eval_spec(DataSpec(source=f"{a}+{b}", seq_len=16), str(a), 4, 0)


def test_heal_evaluates_a_mixture_source_after_the_blocks_training_reads():
    opts = HealOptions(max_steps=5, grad_accum=1)
    data = DataSpec(source="builtin:pydoc+self", seq_len=16, batch_size=2)
    train, held = _data_specs(data, "builtin:pydoc", 4, opts, World())
    assert train.max_samples == 10 and held.skip_samples == 5  # 10 mixed blocks: 5 of pydoc
    with pytest.raises(UsageError, match="is a source of --data"):
        _data_specs(data, "builtin:pydoc", 4, HealOptions(max_steps=0), World())
    # a source outside the mixture starts at its beginning
    assert _data_specs(data, "builtin:licenses", 4, opts, World())[1].skip_samples == 0


def test_a_calibrating_command_on_an_encoder_defaults_to_pydoc(tmp_path):
    src = save_tiny("bert", tmp_path / "enc")
    res = _run("score", src, "--max-samples", 2, "--seq-len", 16)
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["data"]["source"] == "builtin:pydoc"


def test_prune_scores_and_refits_on_auto_and_reads_nothing_when_told_the_heads(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / "cache"))
    src = save_tiny("llama", tmp_path / "src")
    res = _run("prune", src, "--fraction", 0.25, "--compensate", "--max-samples", 4, "--seq-len", 16,
               "-o", tmp_path / "a", "--json")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["options"]["calibration_data"]["source"] == "builtin:pydoc+self"
    listed = _run("prune", src, "--heads", "0:0,2;1:1,3", "-o", tmp_path / "b", "--json")
    assert listed.exit_code == 0, listed.stderr
    assert "--data auto" not in listed.stderr  # a default that nothing reads is not resolved (no sampling)
    assert json.loads(listed.stdout)["options"]["calibration_data"] is None


def test_a_recipe_eval_that_says_where_it_starts_is_left_alone(tmp_path, monkeypatch):
    recipe = _tiny_recipe(tmp_path, monkeypatch, "  - convert_gqa: {kv_heads: 1, merge: fit}\n"
                          "  - eval: {data: {skip_samples: 0}}\n  - eval: {data: {seq_len: 8}}\n")
    with blocks_read() as seen:
        res = _run("run", recipe, "-o", tmp_path / "out", "--json")
    assert res.exit_code == 0, res.stderr
    evals = [i for i in seen if i["source"] == "builtin:pydoc"]
    assert [i["skip_samples"] for i in evals] == [0, 0]  # one read per eval step
    assert "another seq_len or seed" in res.stderr  # the second eval cannot be placed after them: said


@pytest.mark.parametrize("command", ["convert-gqa", "prune"])
def test_evaluation_on_the_held_out_source_starts_after_the_held_out_blocks(tmp_path, monkeypatch, command):
    monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / "cache"))
    src = save_tiny("llama", tmp_path / "src")
    how = ["--kv-heads", 1, "--merge", "fit"] if command == "convert-gqa" else ["--fraction", 0.25, "--compensate"]
    res = _run(command, src, *how, "--data", "builtin:pydoc", "--max-samples", 4, "--seq-len", 16,
               "--heldout-data", "builtin:licenses", "--heldout-samples", 3, "--eval-data", "builtin:licenses",
               "--eval-samples", 2, "-o", tmp_path / "out", "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    ev = doc["eval_data"]
    assert ev["source"] == "builtin:licenses" and ev["skip_samples"] == 3  # after the 3 held-out blocks
