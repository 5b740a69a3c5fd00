"""A local --data file is the same source however its path is written: `data_read` records its
resolved path (and a digest of its content) beside the path as typed, and `eval` and recipes compare
on that. Before, `eval --data ./a.txt` (or an absolute path, or the path from another folder) of a
model fitted on `--data a.txt` evaluated on the fitting blocks, unmarked; and an unrelated a.txt in
another folder was skipped and marked as if it were the fitted text."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from headtool.cli.app import app
from headtool.data.sources import DataSpec
from headtool.io.provenance import folder_record
from headtool.workflows.data_plan import evaluation_cut
from tiny_models import save_tiny

runner = CliRunner()
BLOCKS = ["--seq-len", "16", "--batch-size", "2"]


def _text(word: str) -> str:
    return "\n\n".join(f"{word} {i}: the {word} counted {i * 7} stones by the river before the bell "
                       f"rang {i * 3} times." for i in range(120))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A tiny llama pruned with a refit on the mixture a.txt*3+b.txt (8 blocks: 6 of a.txt), run from
    the folder holding the texts, as the audit did."""
    root = tmp_path_factory.mktemp("paths")
    data = root / "data"
    data.mkdir()
    (data / "a.txt").write_text(_text("miller"))
    (data / "b.txt").write_text(_text("baker"))
    other = root / "other"
    other.mkdir()
    (other / "a.txt").write_text(_text("sailor"))  # the same name, another text
    src = save_tiny("llama", root / "src", num_hidden_layers=2)
    out = root / "pmix"
    mp = pytest.MonkeyPatch()
    mp.chdir(data)
    try:
        res = runner.invoke(app, ["prune", str(src), "--data", "a.txt*3+b.txt", "--max-samples", "8",
                                  "--fraction", "0.25", "--compensate", "--unit", "head", "--normalize", "layer",
                                  *BLOCKS, "-o", str(out)])
    finally:
        mp.undo()
    assert res.exit_code == 0, res.output
    return root, src, out


def _eval(src, out, data: str) -> dict:
    res = runner.invoke(app, ["eval", str(src), str(out), "--data", data, "--max-samples", "4", *BLOCKS, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_the_record_names_the_file_by_its_resolved_path_beside_the_path_as_typed(fitted):
    root, _, out = fitted
    part = next(e for e in folder_record(out) if e["source"] == "a.txt" and e.get("part"))
    assert part["blocks"] == 6 and part["source_path"] == str((root / "data" / "a.txt").resolve())
    assert part["source_sha256"]


@pytest.mark.parametrize("where, typed", [("data", "a.txt"), ("data", "./a.txt"), ("root", "data/a.txt"),
                                          ("root", "ABS")])
def test_eval_skips_and_marks_the_fitted_file_however_its_path_is_written(fitted, monkeypatch, where, typed):
    root, src, out = fitted
    monkeypatch.chdir(root / "data" if where == "data" else root)
    data = str((root / "data" / "a.txt").resolve()) if typed == "ABS" else typed
    doc = _eval(src, out, data)
    assert doc["data"]["skip_samples"] == 6
    assert doc["results"][1]["in_domain"] is True and doc["results"][0]["in_domain"] is None


@pytest.mark.parametrize("where", ["other", "root"])
def test_an_unrelated_file_of_the_same_name_is_neither_skipped_nor_marked(fitted, monkeypatch, where):
    root, src, out = fitted
    monkeypatch.chdir(root / "other" if where == "other" else root)
    doc = _eval(src, out, "a.txt" if where == "other" else "other/a.txt")
    assert doc["data"]["skip_samples"] == 0 and doc["results"][1]["in_domain"] is False


def test_a_copy_of_the_fitted_text_elsewhere_is_the_fitted_text(fitted, tmp_path, monkeypatch):
    root, src, out = fitted
    (tmp_path / "a.txt").write_bytes((root / "data" / "a.txt").read_bytes())
    monkeypatch.chdir(tmp_path)
    doc = _eval(src, out, "a.txt")
    assert doc["data"]["skip_samples"] == 6 and doc["results"][1]["in_domain"] is True


def test_an_old_record_without_the_path_still_matches_by_the_string(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    old = [{"source": "a.txt", "seq_len": 16, "seed": 0, "role": "fit", "blocks": 5}]
    cut = evaluation_cut(DataSpec(source="a.txt", seq_len=16), {"m": old})
    assert cut.spec.skip_samples == 5 and cut.in_domain == {"m": True}
    typed_otherwise = evaluation_cut(DataSpec(source="./a.txt", seq_len=16), {"m": old})
    assert typed_otherwise.spec.skip_samples == 0 and typed_otherwise.in_domain == {"m": False}  # as before


def test_a_recipe_eval_step_starts_after_the_blocks_read_under_another_spelling(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text(_text("miller"))
    src = save_tiny("llama", tmp_path / "src", num_hidden_layers=2)
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""model: {src}
data: {{source: a.txt, max_samples: 5, seq_len: 16, batch_size: 2}}
steps:
  - step: prune
    fraction: 0.25
    compensate: true
    normalize: layer
  - step: eval
    data: {{source: {tmp_path / 'a.txt'}, max_samples: 2, seq_len: 16}}
""")
    res = runner.invoke(app, ["run", str(recipe), "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    row = next(r for r in json.loads(res.stdout)["steps"] if r["step"] == "eval")
    assert row.get("skip_samples", 0) >= 5 and row.get("in_domain", True) is True


def test_one_command_knows_its_data_file_however_each_option_writes_it(tmp_path, monkeypatch):
    """--eval-data / --heldout-data naming the --data file another way (./a.txt, its absolute path) are the
    calibration's source: their blocks start after the calibration's (they started at block 0, inside
    it); a same-named file in another folder is another source."""
    from headtool.workflows.data_plan import eval_spec, heldout_spec, part_blocks

    (tmp_path / "a.txt").write_text(_text("miller"))
    (tmp_path / "b.txt").write_text(_text("baker"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.txt").write_text(_text("sailor"))
    monkeypatch.chdir(tmp_path)
    spec = DataSpec(source="a.txt", max_samples=8)
    for written in ("./a.txt", str(tmp_path / "a.txt")):
        assert eval_spec(spec, written, 4, used=10)[1] == 10, written
        assert heldout_spec(spec, written, 4, used=8).skip_samples == 8, written
        assert part_blocks(DataSpec(source="a.txt*3+b.txt", max_samples=8), written, 8) == 6, written
    assert eval_spec(spec, "other/a.txt", 4, used=10)[1] == 0
    assert heldout_spec(spec, "other/a.txt", 4, used=8).skip_samples == 0
