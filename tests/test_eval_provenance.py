"""What a written model was fitted on: every writing command records the blocks it read
(headtool.json `data_read`), and `headtool eval` starts after them and marks in-domain figures.
Before, `headtool prune ... --compensate -o p && headtool eval m p` evaluated on the very blocks
the refit was fitted to (SmolLM2, 25% of heads: 1.081x there against 1.104x on the next blocks)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from headtool.cli.app import app
from headtool.data.batches import make_batches
from headtool.data.sources import DataSpec
from headtool.io.provenance import folder_record, merged, read_entries
from headtool.workflows.data_plan import ALLOCATION_BLOCKS, evaluation_cut
from tiny_models import save_tiny, tokenizer_for

runner = CliRunner()
BLOCKS = ["--seq-len", "16", "--batch-size", "2"]


@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    p = tmp_path_factory.mktemp("prose") / "prose.txt"
    p.write_text("\n\n".join(f"Paragraph {i}: the river ran past mill number {i * 7} and the "
                             f"miller counted {i * 13} sacks of grain before the evening bell." for i in range(200)))
    return p


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """A tiny llama pruned with a refit on 8 builtin:pydoc blocks (and its allocation chosen between
    layer and none on 64 blocks of text sampled from it), reporting on 2 blocks of builtin:licenses."""
    root = tmp_path_factory.mktemp("prov")
    src = save_tiny("llama", root / "src", num_hidden_layers=4, num_key_value_heads=4)
    out = root / "p"
    res = runner.invoke(app, ["prune", str(src), "--fraction", "0.25", "--compensate", "--data", "builtin:pydoc",
                              "--max-samples", "8", *BLOCKS, "--normalize", "layer,none", "--eval-data", "builtin:licenses",
                              "--eval-samples", "2", "-o", str(out)])
    assert res.exit_code == 0, res.output
    return src, out


def _fitted(folder, source: str) -> int:
    return next(e["blocks"] for e in folder_record(folder) if e["source"] == source and e["role"] == "fit")


def _eval(*args):
    res = runner.invoke(app, ["eval", *map(str, args), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout), res.stderr


def test_prune_records_the_blocks_it_fitted_on_and_those_it_only_evaluated(pruned):
    _, out = pruned
    record = folder_record(out)
    fit = [e for e in record if e["role"] == "fit"]
    assert {e["source"] for e in fit} == {"builtin:pydoc", "self"}  # calibration; the allocation's choice
    assert _fitted(out, "builtin:pydoc") == 8 and _fitted(out, "self") == ALLOCATION_BLOCKS
    assert all(e["seq_len"] == 16 and e["seed"] == 0 for e in fit)
    assert [(e["source"], e["blocks"]) for e in record if e["role"] == "eval"] == [("builtin:licenses", 2)]


def test_eval_starts_after_the_fitted_blocks_and_marks_the_in_domain_model(pruned):
    src, out = pruned
    n = _fitted(out, "builtin:pydoc")
    doc, err = _eval(src, out, "--data", "builtin:pydoc", "--max-samples", "4", *BLOCKS)
    assert doc["data"]["skip_samples"] == n
    assert f"starting after the first {n} blocks of builtin:pydoc" in err
    original, compressed = doc["results"]
    assert original["in_domain"] is None and original["fitted_on"] is None  # no record: not a headtool output
    assert compressed["in_domain"] is True and sorted(compressed["fitted_on"]) == ["builtin:pydoc", "self"]
    # exactly the blocks an explicit --skip-samples gives
    same, _ = _eval(src, out, "--data", "builtin:pydoc", "--max-samples", "4", "--skip-samples", n, *BLOCKS)
    assert [r["loss"] for r in same["results"]] == [r["loss"] for r in doc["results"]]
    table = runner.invoke(app, ["eval", str(src), str(out), "--data", "builtin:pydoc", "--max-samples", "4", *BLOCKS],
                          env={"COLUMNS": "200"})
    shown = " ".join(table.stderr.split())  # (the console may wrap the lines)
    assert f"after its first {n}" in shown and "* fitted on builtin:pydoc's domain" in shown


@pytest.mark.parametrize("skip", [3, 0])
def test_an_explicit_skip_inside_the_fitted_blocks_is_kept_and_warned_about(pruned, skip):
    """--skip-samples 0 typed was read as the default: the blocks started after the fitted ones all the same."""
    src, out = pruned
    n = _fitted(out, "builtin:pydoc")
    doc, err = _eval(src, out, "--data", "builtin:pydoc", "--max-samples", "2", "--skip-samples", skip, *BLOCKS)
    assert doc["data"]["skip_samples"] == skip and "starting after" not in err
    assert "flatters" in err and f"--skip-samples {n} starts after them" in err


def test_another_block_length_cannot_be_skipped_exactly_and_says_so(pruned):
    src, out = pruned
    doc, err = _eval(src, out, "--data", "builtin:pydoc", "--max-samples", "2", "--seq-len", "24")
    assert doc["data"]["skip_samples"] == 0
    assert "another --seq-len or --seed" in err
    assert doc["results"][1]["in_domain"] is True


def test_text_the_model_was_only_evaluated_on_or_never_saw_is_not_skipped_nor_in_domain(pruned, prose):
    src, out = pruned
    for data in ("builtin:licenses", str(prose)):
        doc, err = _eval(src, out, "--data", data, "--max-samples", "2", *BLOCKS)
        assert doc["data"]["skip_samples"] == 0 and doc["results"][1]["in_domain"] is False
        assert "fitted on" not in err


def test_a_mixture_part_is_skipped_exactly_past_the_blocks_the_mixture_read(tmp_path, prose):
    src = save_tiny("llama", tmp_path / "src", num_hidden_layers=2)
    out = tmp_path / "p"
    mixture = f"builtin:pydoc+{prose}*2"
    res = runner.invoke(app, ["prune", str(src), "--fraction", "0.25", "--compensate", "--normalize", "layer",
                              "--data", mixture, "--max-samples", "9", *BLOCKS, "-o", str(out)])
    assert res.exit_code == 0, res.output
    doc, _ = _eval(src, out, "--data", str(prose), "--max-samples", "6", *BLOCKS)
    skip = doc["data"]["skip_samples"]
    assert skip > 0 and doc["results"][1]["in_domain"] is True
    tok = tokenizer_for("llama")
    read = next(e["blocks"] for e in folder_record(out) if e["source"] == mixture)
    assert read >= 9
    fitted = make_batches(DataSpec(source=mixture, max_samples=read, seq_len=16), tok, "plain")
    evaluated = make_batches(DataSpec(source=str(prose), max_samples=6, seq_len=16, skip_samples=skip), tok, "plain")
    seen = {tuple(r.tolist()) for b in fitted for r in b["input_ids"]}
    rows = [tuple(r.tolist()) for b in evaluated for r in b["input_ids"]]
    assert rows and not seen & set(rows)
    # one block earlier would overlap: the cut is tight, not just safe
    earlier = make_batches(DataSpec(source=str(prose), max_samples=1, seq_len=16, skip_samples=skip - 1), tok, "plain")
    assert tuple(earlier.batches[0]["input_ids"][0].tolist()) in seen


def test_a_chain_of_commands_inherits_what_its_input_was_fitted_on(pruned, prose, tmp_path):
    _, out = pruned
    gqa = tmp_path / "gqa"
    res = runner.invoke(app, ["convert-gqa", str(out), "--kv-heads", "1", "--merge", "fit", "--data", str(prose),
                              "--max-samples", "4", *BLOCKS, "-o", str(gqa)])
    assert res.exit_code == 0, res.output
    record = folder_record(gqa)
    assert {e["source"] for e in record if e["role"] == "fit"} == {"builtin:pydoc", "self", str(prose)}
    assert json.loads((gqa / "headtool.json").read_text())["data_read"] == record


def test_a_recipe_records_its_fitting_steps_and_its_eval_steps_apart(tmp_path):
    src = save_tiny("llama", tmp_path / "src", num_hidden_layers=2)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""model: {src}
output: {tmp_path / 'out'}
data: {{source: builtin:pydoc, max_samples: 6, seq_len: 16, batch_size: 2}}
steps:
  - step: prune
    fraction: 0.25
    compensate: true
    normalize: layer
  - step: eval
    data: {{source: builtin:licenses, max_samples: 2, seq_len: 16}}
""")
    res = runner.invoke(app, ["run", str(recipe)])
    assert res.exit_code == 0, res.output
    record = folder_record(tmp_path / "out")
    assert {(e["source"], e["role"]) for e in record if not e.get("part")} == {("builtin:pydoc", "fit"),
                                                                              ("builtin:licenses", "eval")}


def test_the_cut_of_records_by_hand():
    infos = [{"source": "a.txt+b.txt", "seq_len": 16, "seed": 0, "samples": 6, "skip_samples": 0,
              "mixture": [{"source": "a.txt", "samples": 3, "skip_samples": 0},
                          {"source": "b.txt", "samples": 3, "skip_samples": 0}]},
             {"source": "a.txt", "seq_len": 16, "seed": 0, "samples": 2, "skip_samples": 3, "role": "eval"}]
    record = read_entries(infos)
    assert merged(record, [{"source": "a.txt", "seq_len": 16, "seed": 0, "role": "fit", "blocks": 5,
                            "part": True}]) == [
        {"source": "a.txt", "seq_len": 16, "seed": 0, "role": "eval", "blocks": 5},
        {"source": "a.txt", "seq_len": 16, "seed": 0, "role": "fit", "blocks": 5, "part": True},
        {"source": "a.txt+b.txt", "seq_len": 16, "seed": 0, "role": "fit", "blocks": 6},
        {"source": "b.txt", "seq_len": 16, "seed": 0, "role": "fit", "blocks": 3, "part": True}]
    cut = evaluation_cut(DataSpec(source="a.txt", seq_len=16), {"m": record, "base": None})
    assert cut.spec.skip_samples == 3 and cut.read_by == ("m",) and cut.in_domain == {"m": True, "base": None}
    whole = evaluation_cut(DataSpec(source="a.txt+b.txt", seq_len=16), {"m": record})
    assert whole.spec.skip_samples == 6
    other = evaluation_cut(DataSpec(source="c.txt", seq_len=16), {"m": record})
    assert other.spec.skip_samples == 0 and other.in_domain == {"m": False}


def test_scores_read_in_an_earlier_run_count_as_fitted_on(tmp_path, prose):
    src = save_tiny("llama", tmp_path / "src", num_hidden_layers=2)
    scores = tmp_path / "scores.json"
    res = runner.invoke(app, ["score", str(src), "--data", str(prose), "--max-samples", "5", *BLOCKS,
                              "-o", str(scores)])
    assert res.exit_code == 0, res.output
    out = tmp_path / "p"
    res = runner.invoke(app, ["prune", str(src), "--scores", str(scores), "--fraction", "0.25", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert _fitted(out, str(prose)) == 5
    doc, _ = _eval(src, out, "--data", str(prose), "--max-samples", "2", *BLOCKS)
    assert doc["data"]["skip_samples"] == 5 and doc["results"][1]["fitted_on"] == [str(prose)]


def test_the_model_card_says_what_text_the_model_was_fitted_on(pruned):
    _, out = pruned
    card = (out / "README.md").read_text()
    n = _fitted(out, "builtin:pydoc")
    assert f"- fitted on `builtin:pydoc`: its first {n} blocks of 16 tokens (seed 0)" in card
    assert "- only evaluated on `builtin:licenses`: its first 2 blocks" in card


NOTE = "in-domain: the model was fitted on this text's source"


def test_a_commands_own_evaluation_on_its_calibration_source_is_marked_in_domain(tmp_path, prose):
    src = save_tiny("llama", tmp_path / "src", num_hidden_layers=2)
    common = ["--data", str(prose), "--max-samples", "4", *BLOCKS, "--eval-samples", "2"]
    for eval_data, expected in ((str(prose), True), ("builtin:licenses", False)):
        out = tmp_path / f"p{expected}"
        res = runner.invoke(app, ["prune", str(src), "--fraction", "0.25", "--compensate", "--normalize", "layer",
                                  *common, "--eval-data", eval_data, "-o", str(out), "--json"],
                            env={"COLUMNS": "250"})
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["eval_data"]["in_domain"] is expected
        assert (NOTE in " ".join(res.stderr.split())) is expected  # (the console may wrap the line)
        for name, command in (("gqa", ["convert-gqa", "--kv-heads", "1", "--merge", "fit"]),
                              ("mla", ["convert-mla", "--kv-cache", "1/2"])):
            res = runner.invoke(app, [command[0], str(src), *command[1:], *common, "--eval-data", eval_data,
                                      "-o", str(tmp_path / f"{name}{expected}"), "--json"], env={"COLUMNS": "250"})
            assert res.exit_code == 0, res.output
            assert json.loads(res.stdout)["eval_data"]["in_domain"] is expected
            assert (NOTE in " ".join(res.stderr.split())) is expected
