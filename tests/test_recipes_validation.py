"""A broken recipe lists all its problems at once, with YAML locations; --set overrides values."""
from __future__ import annotations

import pytest

from headtool.errors import UsageError
from headtool.workflows.recipe_schema import apply_overrides, load_recipe, validate

BROKEN = """\
name: broken
model: ./no-such-model
dtype: float64
colour: red
data: {source: builtin:pydoc, seq_len: 1}
steps:
  - score: {method: gradient, objectiv: kl}
  - prune: {fraction: 1.5}
  - step: convert_gqa
    merge: mean,bogus
  - eval: {data: {source: missing.txt}}
  - frobnicate: {}
"""


def _problems(tmp_path, text, overrides=()):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    r = load_recipe(p)
    apply_overrides(r, list(overrides))
    with pytest.raises(UsageError) as e:
        validate(r)
    return str(e.value), p


def test_every_problem_is_listed_with_its_location(tmp_path):
    msg, p = _problems(tmp_path, BROKEN)
    expected = [
        (3, "dtype: must be one of"), (4, "colour: unknown key"), (5, "data.seq_len: must be an integer >= 2"),
        (2, "model: not found"), (7, "steps.0.objectiv: unknown key"), (8, "steps.1.fraction: must be a number in (0, 1)"),
        (10, "steps.2.merge"), (9, "steps.2.kv_heads: required"), (11, "steps.3.data.source: file not found"),
        (12, "unknown step 'frobnicate'"),
    ]
    assert f"has {len(expected)} problem(s)" in msg
    for line, text in expected:
        assert any(f"{p}:{line}:" in row and text in row for row in msg.splitlines()), (line, text, msg)


def test_overrides_fix_and_break_values(tmp_path):
    text = "model: smollm2-135m\nsteps:\n  - prune: {fraction: 0.3}\n"
    p = tmp_path / "ok.yaml"
    p.write_text(text)
    r = load_recipe(p)
    apply_overrides(r, ["steps.0.fraction=0.4", "seed=3"])
    validate(r)
    assert r.steps[0]["fraction"] == 0.4 and r.values["seed"] == 3
    msg, _ = _problems(tmp_path, text, ["steps.0.fraction=2"])
    assert "--set steps.0.fraction: steps.0.fraction: must be a number in (0, 1), got 2" in msg


@pytest.mark.parametrize("bad,needle", [
    (["steps.5.fraction=0.1"], "no item '5'"),
    (["fraction"], "use KEY=VALUE"),
])
def test_bad_overrides(tmp_path, bad, needle):
    p = tmp_path / "ok.yaml"
    p.write_text("model: smollm2-135m\nsteps:\n  - prune: {fraction: 0.3}\n")
    r = load_recipe(p)
    with pytest.raises(UsageError, match=needle):
        apply_overrides(r, bad)


def test_not_yaml_and_missing(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: [unclosed\n")
    with pytest.raises(UsageError, match="not valid YAML"):
        load_recipe(p)
    with pytest.raises(UsageError, match="recipe not found"):
        load_recipe(tmp_path / "nope.yaml")
    p.write_text("- just\n- a list\n")
    with pytest.raises(UsageError, match="a recipe is a mapping"):
        load_recipe(p)


def test_the_demo_description_says_what_its_steps_do():
    """`headtool demo` prints the builtin recipe's description: one part per step, each stating
    the step as configured (it once promised one query head per KV group while the prune step
    removed 20% of query heads over all layers)."""
    from importlib import resources

    with resources.as_file(resources.files("headtool") / "builtin_recipes" / "demo.yaml") as path:
        recipe = load_recipe(path)
    parts = [p.strip() for p in recipe.values["description"].split(" -> ")]
    assert len(parts) == len(recipe.steps), parts
    for part, step in zip(parts, recipe.steps):
        name = step["step"]
        assert part.split()[0] == {"convert_gqa": "merge", "convert_mla": "convert"}.get(name, name), part
        if name == "score":
            assert f"({step['method']})" in part
        elif name == "prune":
            assert f"{step['fraction']:.0%} of query heads" in part, part
            assert ("over all layers" in part) == (step.get("scope", "global") == "global"), part
            assert ("one query head per KV group" in part) == (step.get("unit") == "query"), part
            assert ("any single head" in part) == (step.get("unit") == "head"), part
            assert "compensated)" in part if step.get("compensate") else "compensated" not in part, part
        elif name == "convert_gqa":
            assert f"to {step['kv_heads']} KV head" in part and f"({step['merge']})" in part, part
        elif name == "convert_mla":
            from fractions import Fraction

            assert f"latent attention at {Fraction(step['kv_cache']).limit_denominator(16)} of the KV cache" in part
        elif name == "eval":
            data = step.get("data") or {}
            assert ("held-out" in part) == bool(data.get("skip_samples")), part
            assert data.get("source", recipe.values["data"]["source"]) in part, part
    assert f"calibrated on {recipe.values['data']['source']}" in parts[-1]


def test_a_step_is_checked_as_its_command_checks_it_before_the_model_loads(tmp_path):
    """Combinations of keys a schema of single keys cannot see (a margin with nothing compared, a bad
    anchor) are the command's own usage errors, listed with the step's location by `run` and
    `run --check`, before the model loads."""
    from typer.testing import CliRunner

    from headtool.cli import app

    p = tmp_path / "r.yaml"
    p.write_text("model: smollm2-135m\ndata: {source: builtin:pydoc, max_samples: 4}\nsteps:\n"
                 "  - prune: {fraction: 0.3, normalize: layer, allocation_margin: 1}\n"
                 "  - prune: {fraction: 0.1, compensate: true, anchor: sideways}\n"
                 "  - prune: {fraction: 0.1, compensate: true, normalize: 'layer,none', allocation_margin: 1}\n")
    out = str(tmp_path / "out")
    for args in (["run", str(p), "--check", "-o", out], ["run", str(p), "-o", out]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and "has 2 problem(s)" in r.stderr, r.output
        assert f"{p}:4:" in r.stderr and "steps.0 (prune): --allocation-margin weighs a comparison" in r.stderr
        assert f"{p}:5:" in r.stderr and "steps.1 (prune): --anchor 'sideways'" in r.stderr
        assert "Traceback" not in r.output and not (tmp_path / "out").exists()


def test_options_nothing_reads_are_refused_in_a_recipe_step_as_on_the_command_line(tmp_path):
    """A refit's options without the refit, and --eval-samples without --eval-data, are the commands'
    usage errors (they were silently ignored): a recipe step shares the request, so `run --check` lists
    each such step before the model loads."""
    from typer.testing import CliRunner

    from headtool.cli import app

    p = tmp_path / "r.yaml"
    p.write_text("model: smollm2-135m\ndata: {source: builtin:pydoc, max_samples: 4}\nsteps:\n"
                 "  - prune: {fraction: 0.3, damping: 0.5, anchor: 2}\n"
                 "  - convert_gqa: {kv_heads: 1, merge: mean, anchor: 2}\n"
                 "  - prune: {fraction: 0.1, eval_samples: 3}\n"
                 "  - convert_mla: {kv_rank: 4, refit: false, anchor: 0, eval_samples: 2}\n")
    r = CliRunner().invoke(app, ["run", str(p), "--check", "-o", str(tmp_path / "out")])
    assert r.exit_code == 2 and "has 4 problem(s)" in r.stderr, r.output
    assert f"{p}:4:" in r.stderr and "steps.0 (prune): --damping, --anchor only apply to the refit" in r.stderr
    assert f"{p}:5:" in r.stderr and "steps.1 (convert_gqa): --anchor only applies to the output-projection refit" \
        in r.stderr
    assert f"{p}:6:" in r.stderr and "steps.2 (prune): --eval-samples only applies with --eval-data" in r.stderr
    assert f"{p}:7:" in r.stderr and "steps.3 (convert_mla): --anchor only applies" in r.stderr


def test_options_read_in_some_combinations_stay_accepted_there():
    """Where the code reads them, they are not refused: --heldout-data picks where a --normalize list is
    compared without --compensate; convert-mla's --damping also regularizes the latent factorization;
    convert-gqa's held-out blocks judge any merge that calibrates (similarity grouping, a data merge)."""
    from headtool.surgery.merging import DATA_METHODS
    from headtool.workflows.requests import MERGE_METHODS, ConvertRequest, LatentRequest, PruneRequest

    PruneRequest("m", fraction=0.25, normalize="layer,none", heldout_data="builtin:licenses").validate()
    PruneRequest("m", fraction=0.25, compensate=True, damping=0.5, anchor="2", heldout_samples=2,
                 eval_samples=3, eval_data="builtin:licenses").validate()
    LatentRequest("m", kv_rank=4, refit=False, damping=0.1).validate()
    ConvertRequest("m", 1, merge="mean", grouping="similarity", heldout_samples=2).validate()
    ConvertRequest("m", 1, merge="mean", refit=True, anchor="2", damping=0.1).validate()
    ConvertRequest("m", 1, merge="aligned", heldout_data="builtin:licenses").validate()
    # what ConvertRequest.reads_data calls a merge that reads data is the merging code's own list
    assert set(MERGE_METHODS) - {"mean"} == set(DATA_METHODS)
    with pytest.raises(UsageError, match="--damping only applies to the output-projection refit"):
        ConvertRequest("m", 1, merge="aligned", damping=0.1).validate()
    with pytest.raises(UsageError, match="--heldout-samples only applies to a conversion that calibrates: --merge "
                                         "mean with contiguous grouping reads no data"):
        ConvertRequest("m", 1, merge="mean", heldout_samples=2).validate()


def test_a_prune_step_with_scores_and_heads_is_refused_as_on_the_command_line(tmp_path):
    """`headtool prune --scores S --heads H` is a usage error; a recipe step with both removed the listed
    heads and never read the scores, silently."""
    from typer.testing import CliRunner

    from headtool.cli import app

    scores = tmp_path / "s.json"
    scores.write_text("{}")
    p = tmp_path / "r.yaml"
    p.write_text(f"model: smollm2-135m\noutput: {tmp_path / 'out'}\nsteps:\n"
                 f"  - prune: {{heads: '1:0', scores: {scores}}}\n")
    r = CliRunner().invoke(app, ["run", str(p), "--check"])
    assert r.exit_code == 2 and "has 1 problem(s)" in r.stderr, r.output
    assert f"{p}:4:" in r.stderr and "steps.0 (prune): give either --scores or --heads, not both" in r.stderr


def test_a_data_block_of_a_conversion_that_reads_no_data_is_refused_as_on_the_command_line(tmp_path):
    """`headtool convert-gqa --merge mean --max-samples 8` refuses data options that a mean merge of
    contiguous groups never reads; a recipe step's own data block was accepted and ignored. The
    recipe's top-level data block, which other steps share, stays accepted."""
    from typer.testing import CliRunner

    from headtool.cli import app

    p = tmp_path / "r.yaml"
    p.write_text(f"model: smollm2-135m\noutput: {tmp_path / 'out'}\ndata: {{source: builtin:pydoc, max_samples: 4}}\n"
                 "steps:\n  - convert_gqa: {kv_heads: 1, merge: mean, data: {max_samples: 8}}\n"
                 "  - convert_gqa: {kv_heads: 1, merge: mean}\n"
                 "  - convert_gqa: {kv_heads: 1, merge: mean, grouping: similarity, data: {max_samples: 8}}\n")
    r = CliRunner().invoke(app, ["run", str(p), "--check"])
    assert r.exit_code == 2 and "has 1 problem(s)" in r.stderr, r.output
    assert f"{p}:5:" in r.stderr and "steps.0.data: merge mean with contiguous grouping reads no data" in r.stderr


def test_a_command_option_a_step_does_not_take_says_where_it_goes(tmp_path):
    """`output`, `overwrite`, `dry_run`, `streaming` or `resume` in a step were each an "unknown key" whose
    list of known keys left them out, though the command takes them: the message now says why a step
    does not (the declared `why`: a whole-recipe key, or one only a command run has)."""
    p = tmp_path / "r.yaml"
    p.write_text("model: smollm2-135m\noutput: out\nsteps:\n"
                 "  - prune: {fraction: 0.3, output: x, overwrite: true, dry_run: true, streaming: true}\n"
                 "  - heal: {max_steps: 1, resume: true, colour: red}\n")
    r = load_recipe(p)
    with pytest.raises(UsageError) as e:
        validate(r)
    msg = str(e.value)
    assert "has 6 problem(s)" in msg, msg
    assert "steps.0.output: not a key of a step: a whole-recipe key: give output at the top of the recipe" in msg
    assert "steps.0.overwrite: not a key of a step: a recipe writes its final model once" in msg
    assert "steps.0.dry_run: not a key of a step: a recipe's steps always run: `headtool run --dry-run`" in msg
    assert "steps.0.streaming: not a key of a step: a recipe keeps the model in memory" in msg
    assert "steps.1.resume: not a key of a step: a recipe heals in memory" in msg
    assert "steps.1.colour: unknown key" in msg


def test_an_inclusive_upper_bound_is_checked_with_the_option():
    """`max` (inclusive) beside `above`: (0, 1] for --self-top-p, where 1 is allowed and 1.5 is not."""
    from headtool.data.sources import DataSpec
    from headtool.optionspec import check

    check(DataSpec(self_top_p=1.0))
    with pytest.raises(UsageError, match=r"--self-top-p must be a number in \(0, 1\], got 1.5"):
        check(DataSpec(self_top_p=1.5))


def test_an_override_of_a_whole_block_is_where_its_problems_are_and_fills_an_empty_key(tmp_path):
    """`--set 'data={..., seq_len: 1}'` was reported at the file's line of the seq_len it replaced (16 there,
    valid); `--set data.seq_len=16` over an empty `data:` was refused as 'data is not a mapping or list'."""
    p = tmp_path / "r.yaml"
    p.write_text("model: smollm2-135m\ndata: {source: builtin:pydoc, seq_len: 16}\nsteps:\n  - prune: {fraction: 0.3}\n")
    msg, _ = _problems(tmp_path, p.read_text(), ["data={source: builtin:pydoc, seq_len: 1}"])
    assert "--set data: data.seq_len: must be an integer >= 2, got 1" in msg and f"{p}:2:" not in msg, msg
    p.write_text("model: smollm2-135m\ndata:\nsteps:\n  - prune: {fraction: 0.3}\n")
    r = load_recipe(p)
    apply_overrides(r, ["data.seq_len=16", " data.batch_size = 2"])
    validate(r)
    assert r.values["data"] == {"seq_len": 16, "batch_size": 2}
    assert r.where("data.batch_size") == "--set data.batch_size"


def test_an_override_with_a_list_is_the_list_as_in_the_file(tmp_path):
    """`merge: [mean, fit]` in the file is a list of merges; `--set steps.0.merge=[mean,aligned]` was taken as
    the text '[mean,aligned]' (the text typed, kept for scalars YAML 1.1 misreads) and refused."""
    p = tmp_path / "r.yaml"
    p.write_text("model: smollm2-135m\noutput: out\nsteps:\n  - convert_gqa: {kv_heads: 1, merge: [mean, fit]}\n")
    r = load_recipe(p)
    validate(r)
    apply_overrides(r, ["steps.0.merge=[mean,aligned]", "steps.0.kv_heads=2"])
    validate(r)
    assert r.steps[0]["merge"] == ["mean", "aligned"] and r.steps[0]["kv_heads"] == 2
