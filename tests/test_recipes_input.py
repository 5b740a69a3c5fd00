"""What users type into recipes: empty values, YAML 1.1's surprises (`heads: 1:0` is 60), step
orders a run refuses, and weights rewritten with nowhere to write them, all found by `run --check`
and by the run itself before anything runs, as file:line:col problems with exit code 2."""
from __future__ import annotations

import json
from importlib import resources

import pytest
from typer.testing import CliRunner

from tiny_models import save_tiny

from headtool.cli.app import app

runner = CliRunner()
MODEL = "smollm2-135m"  # a packaged name: validation does not load it


def _write(tmp_path, text: str):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def _refused(res, *needles: str) -> None:
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "internal error" not in res.output, res.output
    for needle in needles:
        assert needle in res.stderr, (needle, res.stderr)


# --------------------------------------------------------------------------- 1. empty values
def test_a_step_with_an_empty_value_is_a_step_with_no_options(tmp_path):
    """`- score:` crashed the loader ('internal error: ParserError'): it means `- score: {}`."""
    path = _write(tmp_path, f"model: {MODEL}\nsteps:\n  - score:\n  - eval:\n")
    res = runner.invoke(app, ["run", str(path), "--check", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["steps"] == [{"step": "score"}, {"step": "eval"}]


@pytest.mark.parametrize("text,where,key", [
    (f"name:\nmodel: {MODEL}\noutput: out\nsteps:\n  - score: {{}}\n", "1:6", "name"),
    (f"model: {MODEL}\noutput:\nsteps:\n  - prune: {{fraction: 0.3}}\n", "2:8", "output"),
    (f"model: {MODEL}\noutput: out\nsteps:\n  - prune: {{fraction}}\n", "4:21", "steps.0.fraction"),
    (f"model: {MODEL}\noutput: out\nsteps:\n  - score: {{method: }}\n", "4:20", "steps.0.method"),
    ("model:\noutput: out\nsteps:\n  - score: {}\n", "1:7", "model"),
    (f"model: {MODEL}\noutput: ''\nsteps:\n  - score: {{}}\n", "2:9", "output"),
])
def test_an_empty_value_where_one_is_needed_is_a_located_problem(tmp_path, text, where, key):
    path = _write(tmp_path, text)
    res = runner.invoke(app, ["run", str(path), "--check"])
    _refused(res, f"{path}:{where}: {key}: ", "1 problem(s)")


# --------------------------------------------------------------------------- 2. step orders
def test_every_step_order_a_run_refuses_is_found_by_check_and_before_the_model_loads(tmp_path):
    """`run --check` called convert_mla -> prune -> convert_gqa valid; the run refused it later."""
    path = _write(tmp_path, f"model: {MODEL}\noutput: {tmp_path / 'out'}\nsteps:\n"
                            "  - convert_mla: {kv_cache: 0.5}\n  - prune: {fraction: 0.3}\n"
                            "  - convert_gqa: {kv_heads: 1}\n  - convert_mla: {kv_cache: 0.5}\n"
                            "  - score: {method: magnitude, output: s.json}\n  - score: {method: gradient}\n"
                            "  - heal: {max_steps: 1}\n  - eval: {}\n")
    for extra in (["--check"], []):
        res = runner.invoke(app, ["run", str(path), *extra])
        _refused(res, "4 problem(s)",
                 f"{path}:5:12: steps.1: prune after convert_mla is not supported (the attention is latent now)",
                 f"{path}:6:18: steps.2: convert_gqa after convert_mla is not supported",
                 f"{path}:7:18: steps.3: convert_mla after convert_mla is not supported",
                 f"{path}:8:12: steps.4: score with method magnitude after convert_mla is not supported")
    assert not (tmp_path / "out").exists()


def test_a_heal_before_any_step_that_changes_the_model_is_a_located_problem(tmp_path):
    """A recipe's heal distils towards the recipe's model: as the first rewriting step it distilled the
    model into itself (a loss of 0) for minutes and wrote a copy; `heal M --teacher M` is refused."""
    path = _write(tmp_path, f"model: {MODEL}\noutput: {tmp_path / 'out'}\nsteps:\n"
                            "  - score: {method: magnitude}\n  - heal: {max_steps: 1}\n  - prune: {fraction: 0.3}\n")
    for extra in (["--check"], []):
        _refused(runner.invoke(app, ["run", str(path), *extra]), "1 problem(s)",
                 f"{path}:5:11: steps.1: heal before any prune, convert_gqa or convert_mla step distils")
    assert not (tmp_path / "out").exists()
    path = _write(tmp_path, f"model: {MODEL}\noutput: out\nsteps:\n  - heal: {{max_steps: 1, lm_weight: 1}}\n")
    res = runner.invoke(app, ["run", str(path), "--check"])
    assert res.exit_code == 0, res.output  # its own LM loss: something to train
    assert "valid (1 step)" in res.stderr, res.stderr  # not '1 steps'


def test_steps_in_an_order_that_runs_are_valid(tmp_path):
    path = _write(tmp_path, f"model: {MODEL}\noutput: out\nsteps:\n  - score: {{method: magnitude}}\n"
                            "  - prune: {fraction: 0.3}\n  - convert_gqa: {kv_heads: 1}\n"
                            "  - convert_mla: {kv_cache: 0.5}\n"
                            "  - score: {method: gradient}\n  - heal: {max_steps: 1}\n  - eval: {}\n")
    res = runner.invoke(app, ["run", str(path), "--check"])
    assert res.exit_code == 0, res.output


# --------------------------------------------------------------------------- 3. text read as numbers
def test_a_head_list_is_read_as_typed_in_the_file_and_in_overrides(tmp_path):
    """YAML 1.1 reads `heads: 1:0` as the base-60 integer 60 ('must be a string, got 60') and
    `--set steps.0.heads=9:9` as 549: where the schema wants text, the text as written."""
    path = _write(tmp_path, f"name: 1:0\nmodel: {MODEL}\noutput: out\ndata: {{source: builtin:pydoc, seq_len: 16}}\n"
                            "steps:\n  - prune: {heads: 1:0, min_heads_per_layer: 1}\n"
                            "  - eval: {data: {source: 12:30}}\n")
    res = runner.invoke(app, ["run", str(path), "--check", "--json"])
    assert res.exit_code == 0, res.output
    recipe = json.loads(res.stdout)
    assert recipe["name"] == "1:0" and recipe["steps"][0] == {"step": "prune", "heads": "1:0", "min_heads_per_layer": 1}
    assert recipe["data"]["seq_len"] == 16 and recipe["steps"][1]["data"]["source"] == "12:30"
    res = runner.invoke(app, ["run", str(path), "--check", "--json", "--set", "steps.0.heads=9:9"])
    assert res.exit_code == 0 and json.loads(res.stdout)["steps"][0]["heads"] == "9:9", res.output
    res = runner.invoke(app, ["run", str(path), "--check", "--json", "--set", "steps.0.heads='2:1'"])
    assert res.exit_code == 0 and json.loads(res.stdout)["steps"][0]["heads"] == "2:1", res.output
    res = runner.invoke(app, ["run", str(path), "--check", "--json", "--set", "steps.0.min_heads_per_layer=1:0"])
    assert res.exit_code == 0 and json.loads(res.stdout)["steps"][0]["min_heads_per_layer"] == 60  # a number: YAML's


# --------------------------------------------------------------------------- 4. nowhere to write
def test_rewritten_weights_with_no_output_are_refused_up_front(tmp_path):
    """Such a recipe computed every step and wrote nothing, silently, with exit code 0."""
    path = _write(tmp_path, f"model: {MODEL}\nsteps:\n  - score: {{method: magnitude}}\n"
                            "  - prune: {fraction: 0.3}\n  - heal: {max_steps: 1}\n")
    for extra in (["--check"], []):
        res = runner.invoke(app, ["run", str(path), *extra])
        _refused(res, "1 problem(s)", f"{path}: steps.1 (prune), steps.2 (heal) rewrite the weights but the "
                 "recipe has no output: add output: (or -o DIR), or run with --dry-run")
    for extra in (["-o", str(tmp_path / "out")], ["--dry-run"]):
        res = runner.invoke(app, ["run", str(path), "--check", *extra])
        assert res.exit_code == 0, res.output
    scores_only = _write(tmp_path, f"model: {MODEL}\nsteps:\n  - score: {{method: magnitude}}\n  - eval: {{}}\n")
    assert runner.invoke(app, ["run", str(scores_only), "--check"]).exit_code == 0


def test_a_dry_run_runs_every_step_and_writes_nothing(tmp_path):
    src = save_tiny("llama", tmp_path / "src")
    work = tmp_path / "work"
    work.mkdir()
    path = _write(work, f"model: {src}\noutput: {work / 'out'}\nsteps:\n"
                        f"  - score: {{method: magnitude, output: {work / 's.json'}}}\n"
                        "  - prune: {heads: 1:0, unit: head}\n")
    res = runner.invoke(app, ["run", str(path), "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["dry_run"] is True and summary["output"] is None
    assert [r["heads"] for r in summary["steps"]] == [12, 12, 11]
    assert "dry run: nothing written" in res.stderr
    assert sorted(p.name for p in work.iterdir()) == ["r.yaml"]


def test_the_builtin_demo_recipe_validates():
    with resources.as_file(resources.files("headtool") / "builtin_recipes" / "demo.yaml") as path:
        res = runner.invoke(app, ["run", str(path), "--check"])
    assert res.exit_code == 0, res.output


# --------------------------------------------------------------------------- 5. a score step's document
def test_a_score_steps_document_follows_the_file_rules_of_score_o(tmp_path):
    """`headtool score -o` refuses a file inside the input model folder or over an input file before it
    scores; a recipe's score step wrote its document there (into the model folder, over the data file)
    once the scoring was done."""
    model = tmp_path / "model"
    model.mkdir()
    data = tmp_path / "d.txt"
    data.write_text("some text " * 50)
    path = _write(tmp_path, f"model: {model}\ndata: {{source: {data}}}\nsteps:\n"
                            f"  - score: {{output: {model / 's.json'}}}\n"
                            f"  - score: {{output: {data}}}\n"
                            f"  - score: {{output: {tmp_path / 'no' / 's.json'}}}\n"
                            f"  - score: {{output: {tmp_path / 'fine.json'}}}\n")
    for extra in (["--check"], []):
        res = runner.invoke(app, ["run", str(path), *extra])
        _refused(res, "3 problem(s)", f"{path}:4:21: steps.0.output: {model / 's.json'}: lies inside the input "
                 "model folder", f"{path}:5:21: steps.1.output: {data}: is an input of this command",
                 f"{path}:6:21: steps.2.output: {tmp_path / 'no' / 's.json'}: folder")
    assert sorted(p.name for p in model.iterdir()) == [] and data.read_text() == "some text " * 50
    assert runner.invoke(app, ["run", str(path), "--check", "--dry-run"]).exit_code == 0  # nothing is written


def test_a_bad_shard_size_is_refused_before_any_step_runs(tmp_path):
    """`--shard-size lots` is a usage error of every command before it works; a recipe's `shard_size: lots`
    passed `run --check` and failed when the output was written, after every step had run."""
    path = _write(tmp_path, f"model: {MODEL}\noutput: {tmp_path / 'out'}\nshard_size: lots\nsteps:\n"
                            "  - prune: {heads: '1:0'}\n")
    for extra in (["--check"], []):
        res = runner.invoke(app, ["run", str(path), *extra])
        _refused(res, "1 problem(s)", f"{path}:3:13: shard_size: must be a size such as 5GB, 500MB or a number "
                 "of bytes, got 'lots'")
    for good in ("500MB", "1000000"):
        res = runner.invoke(app, ["run", str(path), "--check", "--set", f"shard_size={good}"])
        assert res.exit_code == 0, res.output


# --------------------------------------------------------------------------- 6. results nothing reads
def test_a_score_step_whose_scores_nothing_reads_is_a_located_problem(tmp_path):
    """A prune with heads: (or scores:, or its own method:) right after a score step chose its heads
    without the scores, which were dropped silently after minutes of scoring; so were the scores of a
    score step replaced by another, rebuilt away by a conversion or left at the end, with no document."""
    path = _write(tmp_path, f"model: {MODEL}\noutput: {tmp_path / 'out'}\nsteps:\n"
                            "  - score: {method: gradient}\n  - prune: {heads: '1:0'}\n"          # 4, 5
                            "  - score: {method: magnitude}\n  - score: {method: gradient}\n"      # 6, 7
                            "  - prune: {fraction: 0.2, method: magnitude}\n"                      # 8
                            "  - score: {method: magnitude}\n  - convert_gqa: {kv_heads: 1}\n"     # 9, 10
                            "  - score: {method: magnitude}\n  - eval: {}\n")                      # 11, 12
    for extra in (["--check"], []):
        _refused(runner.invoke(app, ["run", str(path), *extra]), "4 problem(s)",
                 f"{path}:4:12: steps.0: the score step's scores are read by nothing: steps.1 (prune) removes the "
                 "heads its heads: lists;",
                 f"{path}:6:12: steps.2: the score step's scores are read by nothing: steps.3 (score) replaces them",
                 f"{path}:7:12: steps.3: the score step's scores are read by nothing: steps.4 (prune) scores the "
                 "heads itself (its method:)",
                 f"{path}:9:12: steps.5: the score step's scores are read by nothing: steps.6 (convert_gqa) rebuilds")
    assert not (tmp_path / "out").exists()
    # one left unread at the end still gives its objective and baseline loss in the summary: a warning
    ended = _write(tmp_path, f"model: {MODEL}\nsteps:\n  - score: {{method: magnitude}}\n  - eval: {{}}\n")
    res = runner.invoke(app, ["run", str(ended), "--check"])
    assert res.exit_code == 0, res.output
    assert (f"warning: {ended}:3:12: steps.0: the score step's scores are read by nothing: no prune after it "
            "takes them; give it output: FILE to keep its document, or leave the step out") in " ".join(res.stderr.split())
    ok = _write(tmp_path, f"model: {MODEL}\noutput: {tmp_path / 'out'}\nsteps:\n"
                          "  - score: {method: gradient}\n  - eval: {}\n  - prune: {fraction: 0.2}\n"
                          f"  - score: {{method: magnitude, output: {tmp_path / 's.json'}}}\n"
                          "  - prune: {heads: '1:0'}\n"
                          f"  - score: {{method: magnitude, output: {tmp_path / 't.json'}}}\n")
    res = runner.invoke(app, ["run", str(ok), "--check"])
    assert res.exit_code == 0, res.output


def test_a_steps_own_data_block_that_nothing_reads_is_a_located_problem(tmp_path):
    """As the commands refuse data options nothing reads: a prune that removes listed heads without a refit
    and a score step with method magnitude (random: all but seed) took their own data block and ignored
    it. The recipe's top-level data block, shared by the steps, stays accepted."""
    path = _write(tmp_path, f"model: {MODEL}\noutput: {tmp_path / 'out'}\n"
                            "data: {source: builtin:pydoc, max_samples: 4}\nsteps:\n"
                            "  - prune: {heads: '1:0', data: {max_samples: 8}}\n"                         # 5
                            f"  - score: {{method: magnitude, output: {tmp_path / 'a.json'}, data: {{seq_len: 8}}, "
                            "objective: kl}\n"                                                            # 6
                            f"  - score: {{method: random, output: {tmp_path / 'b.json'}, "
                            "data: {seed: 3, max_samples: 2}}\n")                                       # 7
    for extra in (["--check"], []):
        res = runner.invoke(app, ["run", str(path), *extra])
        _refused(res, "4 problem(s)",
                 f"{path}:5:33: steps.0.data: a prune that removes the heads its heads: lists reads no data "
                 "without compensate",
                 "steps.1.data: seq_len: method magnitude reads no data",
                 "steps.1.objective: method magnitude has no objective",
                 "steps.2.data: max_samples: method random reads only seed")
    ok = _write(tmp_path, f"model: {MODEL}\noutput: {tmp_path / 'out'}\n"
                          "data: {source: builtin:pydoc, max_samples: 4}\nsteps:\n"
                          "  - prune: {heads: '1:0'}\n"
                          "  - prune: {heads: '1:0', compensate: true, data: {max_samples: 8}}\n"
                          f"  - score: {{method: random, output: {tmp_path / 'b.json'}, data: {{seed: 3}}}}\n"
                          f"  - score: {{method: magnitude, output: {tmp_path / 'c.json'}}}\n")
    res = runner.invoke(app, ["run", str(ok), "--check"])
    assert res.exit_code == 0, res.output


def test_a_score_document_inside_the_runs_output_folder_is_refused_up_front(tmp_path):
    """A score step writing into the output folder (its document beside the model) ran every step, then had
    the run refused ('this non-empty folder holds no model'), the document left there; with --overwrite of a
    model folder the final model's folder replaced it: the document was deleted without a word."""
    out = tmp_path / "out"
    out.mkdir()
    path = _write(tmp_path, f"model: {MODEL}\noutput: {out}\noverwrite: true\nsteps:\n"
                            f"  - score: {{method: magnitude, output: {out / 's.json'}}}\n  - prune: {{fraction: 0.3}}\n")
    for extra in (["--check"], []):
        _refused(runner.invoke(app, ["run", str(path), *extra]), "1 problem(s)",
                 f"{path}:5:40: steps.0.output: {out / 's.json'}: lies inside the recipe's output folder {out}, "
                 "which the final model replaces; write the document elsewhere")
    other = tmp_path / "other"
    other.mkdir()
    path = _write(tmp_path, f"model: {MODEL}\nsteps:\n  - score: {{method: magnitude, output: {other / 's.json'}}}\n"
                            "  - prune: {fraction: 0.3}\n")
    _refused(runner.invoke(app, ["run", str(path), "--check", "-o", str(other)]), "lies inside the recipe's output")
    assert runner.invoke(app, ["run", str(path), "--check", "-o", str(out)]).exit_code == 0
    assert runner.invoke(app, ["run", str(path), "--check", "--dry-run"]).exit_code == 0
    assert list(out.iterdir()) == [] and list(other.iterdir()) == []


def test_two_score_steps_writing_one_file_is_a_located_problem(tmp_path):
    """Two score steps with the same output: the second document replaced the first, which was lost."""
    path = _write(tmp_path, f"model: {MODEL}\noutput: {tmp_path / 'out'}\nsteps:\n"
                            f"  - score: {{method: magnitude, output: {tmp_path / 's.json'}}}\n  - prune: {{fraction: 0.3}}\n"
                            f"  - score: {{method: gradient, output: {tmp_path}/./s.json}}\n")
    _refused(runner.invoke(app, ["run", str(path), "--check"]), "1 problem(s)",
             f"{path}:6:39: steps.2.output: {tmp_path}/./s.json: steps.0 writes its document there too")
