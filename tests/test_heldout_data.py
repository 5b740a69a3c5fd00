"""--heldout-data and --anchor: refits chosen on another source, through the CLI and recipes."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from headtool.cli import app
from tiny_models import save_tiny

runner = CliRunner()
COMMON = ["--data", "builtin:pydoc", "--max-samples", "8", "--seq-len", "16", "--batch-size", "2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("heldout")
    src = save_tiny("llama", root / "src")
    other = root / "other.txt"
    other.write_text(" ".join(f"word{i % 97} number {i} and the cat sat on the mat {i * 7 % 13}." for i in range(3000)))
    return root, src, other


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_prune_chooses_each_refit_on_the_other_source(setup, tmp_path):
    _, src, other = setup
    r = _run("prune", src, *COMMON, "--fraction", 0.25, "--compensate", "--heldout-data", other,
             "--anchor", "auto", "--anchor-power", "0", "-o", tmp_path / "out", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["options"]["heldout_data"] == str(other) and doc["options"]["anchor"] == "auto"
    assert doc["compensation"]
    for rec in doc["compensation"]:
        assert "heldout_rel_error_before" in rec and set(rec["heldout_rel_errors"]) == \
            {"0", "0.01", "0.1", "1", "10", "inf"}
        best = min(rec["heldout_rel_errors"].values())
        assert rec["heldout_rel_error_after"] == pytest.approx(best)
        assert (rec["anchor"] is None) == (not rec["kept"])
    card = (tmp_path / "out" / "README.md").read_text()
    assert "anchor" in card


def test_anchor_inf_is_no_refit(setup, tmp_path):
    """An infinitely strong pull toward the unrefit weights keeps them: the bytes of a plain prune."""
    _, src, _ = setup
    a = _run("prune", src, *COMMON, "--fraction", 0.25, "--compensate", "--anchor", "inf",
             "--choose-in-layer", "scores", "--unit", "query", "-o", tmp_path / "a")  # the plain prune's unit
    b = _run("prune", src, *COMMON, "--fraction", 0.25, "-o", tmp_path / "b")
    assert a.exit_code == 0 and b.exit_code == 0, (a.stderr, b.stderr)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_convert_and_the_recipe_step_take_the_same_heldout_source(setup, tmp_path):
    root, src, other = setup
    cli = _run("convert-gqa", src, "--kv-heads", 1, "--merge", "fit", *COMMON, "--heldout-data", other,
               "--heldout-samples", 4, "--anchor", "0,0.1,inf", "-o", tmp_path / "cli", "--json")
    assert cli.exit_code == 0, cli.stderr
    doc = json.loads(cli.stdout)
    assert doc["heldout_data"]["source"] == str(other)
    refit = doc["results"][0]["refit"]
    assert all(set(r.get("heldout_rel_errors", {"0": 0, "0.1": 0, "inf": 0})) == {"0", "0.1", "inf"}
               for r in refit)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {src}\ndata: {{source: 'builtin:pydoc', max_samples: 8, seq_len: 16, batch_size: 2}}\n"
                      f"steps:\n  - convert_gqa: {{kv_heads: 1, merge: fit, heldout_data: {{source: '{other}'}}, "
                      "heldout_samples: 4, anchor: '0,0.1,inf'}\n")
    rec = _run("run", recipe, "-o", tmp_path / "rec")
    assert rec.exit_code == 0, rec.stderr
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == \
        (tmp_path / "rec" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("value", ["-1", "sideways", ",", "0.1,,inf", "0.1,"])  # an empty item: a typo
def test_a_bad_anchor_is_one_line(setup, tmp_path, value):
    _, src, _ = setup
    r = _run("prune", src, *COMMON, "--fraction", 0.25, "--compensate", "--anchor", value, "-o", tmp_path / "x")
    assert r.exit_code == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--anchor" in errors[0], r.stderr
    assert not (tmp_path / "x").exists()


def test_the_cli_default_anchor_is_the_library_default():
    import math

    from headtool.surgery.compensation import ANCHOR_GRID, DEFAULT_ANCHOR
    from headtool.workflows.requests import ANCHOR_GRID as CLI_GRID
    from headtool.workflows.requests import ConvertRequest, PruneRequest, parse_anchor

    assert parse_anchor(PruneRequest("m").anchor) == parse_anchor(ConvertRequest("m", 1).anchor) == DEFAULT_ANCHOR
    assert CLI_GRID == ANCHOR_GRID and math.isinf(parse_anchor("auto")[-1])


@pytest.mark.parametrize("command,extra", [("convert-mla", ["--kv-rank", "4"]), ("convert-gqa", ["--kv-heads", "1"]),
                                           ("convert-gqa", ["--kv-heads", "1", "--heldout-data", "SHORT"])])
def test_a_calibration_that_reads_all_of_data_leaves_no_held_out_blocks(setup, tmp_path, command, extra):
    """--data with fewer blocks than the calibration asks: the held-out blocks (after the calibration's)
    were refused as '--skip-samples 6 leaves no data ... lower --skip-samples', an option nobody gave,
    after a 'using 6' warning (two lines). One line now saying what ran out and what to do."""
    _, src, _ = setup
    short = tmp_path / "short.txt"
    short.write_text("the cat sat on the mat and the dog lay by the door " * 2)
    args = [a if a != "SHORT" else str(short) for a in extra]
    r = _run(command, src, *args, "--data", short, "--seq-len", 4, "-o", tmp_path / "out")
    assert r.exit_code == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "the calibration reads every one, so none are left for the held-out blocks" in lines[0], lines
    assert "--skip-samples" not in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command,extra", [("convert-gqa", ["--kv-heads", "1", "--max-samples", "8"]),
                                           ("convert-mla", ["--kv-rank", "4", "--max-samples", "11", "--no-refit"])])
def test_eval_data_of_the_same_source_with_nothing_left(setup, tmp_path, command, extra):
    """--eval-data on --data's source starts after the calibration (and held-out) blocks: where they read all
    of it, the refusal named '--skip-samples 6', which nobody gave, after a warning; one line now."""
    _, src, _ = setup
    short = tmp_path / "short.txt"
    short.write_text("the cat sat on the mat and the dog lay by the door " * 2)
    r = _run(command, src, *extra, "--data", short, "--seq-len", 4, "--eval-data", short, "-o", tmp_path / "out")
    assert r.exit_code == 2, r.stderr
    assert "warning" not in r.stderr and "--skip-samples" not in r.stderr, r.stderr
    assert "so none are left to evaluate on" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
