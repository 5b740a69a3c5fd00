"""A step's options live once, in its request dataclass (headtool.workflows.requests): the CLI
and the recipe schema are derived from it. These tests read the real Typer commands and the real
recipe schema and compare them, option by option, so that they cannot drift apart again."""
from __future__ import annotations

import dataclasses

import pytest
import typer.main

from headtool.cli import app
from headtool.data.sources import DataSpec
from headtool.model.placement import LoadOptions
from headtool.optionspec import CLI_ONLY, RECIPE, STEP, options_of, problem
from headtool.workflows import requests
from headtool.workflows.recipe_runner import build_request
from headtool.workflows.recipe_schema import (
    DATA_KEYS,
    STEP_KEYS,
    STEP_REQUESTS,
    TOP_KEYS,
    Recipe,
    step_options,
    validate,
)

COMMAND_OF_STEP = {"score": "score", "prune": "prune", "convert_gqa": "convert-gqa",
                   "convert_mla": "convert-mla", "eval": "eval",
                   "heal": "heal"}
# command-line options that are not options of a step, and why recipes have no key for them
NOT_STEP_OPTIONS = {
    "json_out": "how the command prints its result (`headtool run --json` prints the recipe's)",
    "plot": "a picture of the score heatmap; a recipe's score document can be plotted by `headtool inspect`",
    "speed": "eval --speed times models on disk; a recipe's eval step measures loss",
    "batch": "eval --speed", "context": "eval --speed", "new_tokens": "eval --speed", "repeats": "eval --speed",
    "warmup": "eval --speed",
}
MODEL_OPTIONS = {o.name: o for o in options_of(LoadOptions)}  # --dtype ... and the recipe's top-level keys


def _cli_params(command: str) -> dict:
    group = typer.main.get_command(app)
    cmd = group.commands[command]
    return {p.name: p for p in cmd.params if p.name != "help"}


def _required_step_keys(step: str) -> dict:
    return {k: 2 for k, o in step_options(step).items() if o.required}


@pytest.mark.parametrize("step", sorted(STEP_REQUESTS))
def test_every_cli_option_of_a_step_is_a_recipe_key_with_the_same_default(step):
    cls, nested = STEP_REQUESTS[step]
    declared = {o.name: o for o in options_of(cls)} | {o.name: o for c in nested.values() for o in options_of(c)}
    data_opts = {o.name: o for o in options_of(DataSpec)}
    recipe = Recipe("r.yaml", {"model": "m", "steps": []})
    built = build_request(recipe, {"step": step, **_required_step_keys(step)})
    for name, param in _cli_params(COMMAND_OF_STEP[step]).items():
        if name in declared:
            opt = declared[name]
            if opt.where == STEP:
                assert name in STEP_KEYS[step], f"{step}: --{name} is no recipe key"
                if not opt.required:
                    value = getattr(built, name) if hasattr(built, name) else getattr(built.opts, name)
                    cli_default = tuple(param.default) if isinstance(param.default, list) else param.default
                    assert cli_default == opt.default == value, (step, name, cli_default, opt.default, value)
            elif opt.where == RECIPE:
                assert name in TOP_KEYS or opt.meta["positional"] or name in ("teacher",), (step, name)
            else:
                assert opt.where == CLI_ONLY and opt.meta["why"], f"{step}: --{name} says not why it is CLI-only"
        elif name in data_opts:
            assert name in DATA_KEYS
            if name != "source":  # each command picks its default source; recipes take the recipe's
                assert param.default == data_opts[name].default == getattr(built.data, name), (step, name)
        elif name in MODEL_OPTIONS:
            assert name in TOP_KEYS and param.default == MODEL_OPTIONS[name].default, (step, name)
        else:
            assert name in NOT_STEP_OPTIONS, f"{step}: --{name} is declared outside its request dataclass"


@pytest.mark.parametrize("step", sorted(STEP_REQUESTS))
def test_every_recipe_key_of_a_step_is_a_cli_option(step):
    params = _cli_params(COMMAND_OF_STEP[step])
    for key in STEP_KEYS[step]:
        if key in ("data", "eval_data") and key not in params:
            continue  # the data options (--data, --max-samples, ...) / a source string on the CLI
        assert key in params, f"recipe key {step}.{key} has no command-line option"


def test_the_methods_the_code_supports_are_accepted_by_both():
    from headtool.measure.objectives import OBJECTIVES
    from headtool.measure.scoring import METHODS
    from headtool.surgery.latent import RANK_ALLOCATIONS
    from headtool.surgery.merging import GROUPINGS
    from headtool.surgery.merging import METHODS as MERGES
    from headtool.surgery.selection import UNITS
    from headtool.train.healing import TRAIN_MODES

    assert set(requests.SCORE_METHODS) == set(METHODS)
    assert set(requests.MERGE_METHODS) == set(MERGES)
    assert set(requests.GROUPINGS) == set(GROUPINGS)
    assert set(requests.PRUNE_UNITS) == {"auto", *UNITS}
    assert set(requests.OBJECTIVES) == {"auto", *OBJECTIVES}
    assert set(requests.RANK_ALLOCATIONS) == set(RANK_ALLOCATIONS)
    for step, key, values in [("score", "method", METHODS), ("prune", "method", METHODS),
                              ("convert_gqa", "merge", MERGES), ("convert_gqa", "grouping", GROUPINGS),
                              ("heal", "train", TRAIN_MODES), ("score", "objective", requests.OBJECTIVES),
                              ("convert_mla", "rank_allocation", RANK_ALLOCATIONS), ("prune", "unit", requests.PRUNE_UNITS),
                              ("score", "normalize", ("auto", "layer", "none"))]:
        opt = step_options(step)[key]
        for v in values:
            assert STEP_KEYS[step][key](v) is None, (step, key, v)  # the recipe schema
            assert problem(opt, v) is None  # the CLI's check of the same request
    assert STEP_KEYS["convert_gqa"]["merge"](["mean", "fit"]) is None
    assert STEP_KEYS["convert_gqa"]["merge"]("mean,aligned") is None
    assert STEP_KEYS["score"]["method"]("nope") is not None


def test_keys_recipes_used_to_reject_are_accepted(tmp_path):
    """The drift issue 16 reported: each of these worked on the CLI and failed in a recipe."""
    steps = [{"step": "score", "method": "fisher", "normalize": "auto"},
             {"step": "prune", "fraction": 0.2, "choose_in_layer": "refit", "refit_layers": "all",
              "heldout_samples": 4, "compensate": True},
             {"step": "heal", "kl_weight": 0.5, "lora_rank": 4, "lora_alpha": 8.0, "weight_decay": 0.01,
              "bf16": "off", "train": "lora"}]
    validate(Recipe(str(tmp_path / "r.yaml"), {"model": str(tmp_path), "steps": steps}))


def test_defaults_that_drifted_are_one_now():
    """Calibration blocks, held-out blocks and evaluation blocks are the command's, in recipes too."""
    recipe = Recipe("r.yaml", {"model": "m", "steps": []})
    conv = build_request(recipe, {"step": "convert_gqa", "kv_heads": 1})
    prune = build_request(recipe, {"step": "prune", "fraction": 0.2, "compensate": True})
    assert conv.heldout_samples is None and conv.eval_samples == 32
    assert prune.heldout_samples == 0 and prune.eval_samples == 32
    assert requests.ConvertRequest.default_blocks == requests.CALIBRATION_BLOCKS
    assert prune.default_blocks == requests.PRUNE_CALIBRATION_BLOCKS  # --compensate's refit reads more
    assert build_request(recipe, {"step": "prune", "fraction": 0.2}).default_blocks == requests.CALIBRATION_BLOCKS
    heal = build_request(recipe, {"step": "heal"})
    assert heal.eval_samples == 16 and heal.opts == dataclasses.replace(requests.HealOptions(), seed=0)


def test_prune_help_states_the_calibration_sizes_the_request_reads():
    """`headtool prune --help`'s description names both default calibrations (it said 128 after the
    --compensate default became 256)."""
    from headtool.cli.commands.prune import prune_cmd

    words = " ".join(prune_cmd.__doc__.split())
    assert (f"{requests.CALIBRATION_BLOCKS} blocks, {requests.PRUNE_CALIBRATION_BLOCKS} with --compensate"
            in words)


def test_the_cli_rejects_what_the_recipe_rejects(tmp_path):
    """One check, two front ends: the same bad value, the same words."""
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, ["score", "x", "--normalize", "sideways"])
    assert res.exit_code == 2 and "--normalize must be one of auto, layer, geometric, none, got 'sideways'" in res.output
    assert STEP_KEYS["score"]["normalize"]("sideways") == "must be one of auto, layer, geometric, none, got 'sideways'"


def test_model_options_are_declared_once_for_every_command_and_recipes():
    """--dtype, --device, ... come from LoadOptions' fields: every command that loads a model has
    all of them with LoadOptions' defaults, and a recipe's top-level key checks what they check."""
    group = typer.main.get_command(app)
    loading = [name for name, cmd in group.commands.items() if {p.name for p in cmd.params} & set(MODEL_OPTIONS)]
    assert {"info", "inspect", "eval", "score", "prune", "convert-gqa", "convert-mla", "heal"} <= set(loading)
    for name in loading:
        params = _cli_params(name)
        for key, opt in MODEL_OPTIONS.items():
            assert params[key].default == opt.default and params[key].opts[0] == opt.flag, (name, key)
            assert TOP_KEYS[key]("float64" if key == "dtype" else 3) == problem(opt, "float64" if key == "dtype"
                                                                               else 3), key
    assert TOP_KEYS["dtype"]("float64") == "must be one of auto, float32, bfloat16, float16, got 'float64'"
    assert TOP_KEYS["dtype"]("bfloat16") is None


@pytest.mark.parametrize("command", ["prune", "convert-gqa", "convert-mla"])
def test_heldout_samples_help_states_the_default_the_code_uses(command):
    """The held-out default is max(4, calibration // 4) (data_plan.calibration_blocks, prune._data):
    the help said 'a quarter of the calibration' and left out the floor of 4 blocks."""
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    rows = [ln.replace("│", " ") for ln in res.output.splitlines()]
    start = next(i for i, ln in enumerate(rows) if ln.split()[:1] == ["--heldout-samples"])
    text = " ".join(" ".join(rows[start:start + 4]).split())
    assert "a quarter of the calibration blocks, at least 4" in text, text
