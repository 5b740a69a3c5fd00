"""`--streaming` prune and convert-gqa write the headtool.json the in-memory path writes (same tensors,
same record). Before, the streamed copy lacked `data_read` (and prune's num_kv_heads / num_heads /
summary, convert-gqa's kept_heads / kv_groups / summary): a compensated prune re-written by `prune
--streaming --heads ""` lost what it was fitted on, and `eval` scored it on its own calibration blocks
(0.980x, unmarked) where the in-memory copy was scored after them (1.020x, marked in-domain)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from headtool.cli.app import app
from tiny_models import save_tiny

runner = CliRunner()
BLOCKS = ["--seq-len", "16", "--batch-size", "2"]
FIT_BLOCKS = 6
#: what legitimately differs between a streamed and an in-memory write: how it was written, how long it took
TIMINGS = ("elapsed_s", "seconds")


def _ok(*args) -> str:
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res.stdout


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    """A tiny llama pruned with a refit on FIT_BLOCKS builtin:pydoc blocks: its headtool.json records them."""
    root = tmp_path_factory.mktemp("streamprov")
    src = save_tiny("llama", root / "src")
    _ok("prune", src, "--fraction", "0.25", "--compensate", "--data", "builtin:pydoc", "--max-samples", FIT_BLOCKS,
        *BLOCKS, "-o", root / "fit")
    return root / "fit"


def _meta(folder: Path) -> dict:
    return json.loads((folder / "headtool.json").read_text())


def _result(doc):
    """The document without how it was written (`streaming`) and its timings."""
    if isinstance(doc, dict):
        return {k: _result(v) for k, v in doc.items() if k not in ("streaming", *TIMINGS)}
    return [_result(v) for v in doc] if isinstance(doc, list) else doc


def _both(command: list, tmp: Path) -> tuple[dict, dict]:
    """headtool.json of `command` written in memory and streamed."""
    _ok(*command, "-o", tmp / "memory")
    _ok(*command, "-o", tmp / "streamed", "--streaming")
    return _meta(tmp / "memory"), _meta(tmp / "streamed")


def _assert_same_record(memory: dict, streamed: dict) -> None:
    assert set(streamed) == set(memory), set(streamed) ^ set(memory)
    assert streamed["streaming"] is True and memory["streaming"] is False
    assert _result(streamed) == _result(memory)
    inherited = _meta(Path(streamed["source"]["path"]))["data_read"]
    assert inherited and all(e in streamed["data_read"] for e in inherited)  # carried forward from the input


@pytest.mark.parametrize("how", ["nothing", "heads", "scores"])
def test_streamed_prune_records_what_the_in_memory_prune_records(fitted, tmp_path, how):
    if how == "scores":  # scored on data: the document's reads count as fitted on, as in memory
        doc = tmp_path / "scores.json"
        _ok("score", fitted, "--data", "builtin:licenses", "--max-samples", "2", *BLOCKS, "-o", doc)
        chosen = ["--scores", doc, "--num-heads", "2"]
    else:
        chosen = ["--heads", "" if how == "nothing" else "0:0,1"]
    memory, streamed = _both(["prune", fitted, *chosen], tmp_path)
    _assert_same_record(memory, streamed)
    for key in ("data_read", "num_kv_heads", "num_heads", "summary", "kept_heads"):
        assert streamed[key], key
    if how == "scores":
        assert {e["source"] for e in streamed["data_read"]} == {"builtin:pydoc", "builtin:licenses"}


def test_streamed_convert_gqa_records_what_the_in_memory_conversion_records(fitted, tmp_path):
    memory, streamed = _both(["convert-gqa", fitted, "--kv-heads", "1", "--merge", "mean"], tmp_path)
    _assert_same_record(memory, streamed)
    for key in ("data_read", "kept_heads", "kv_groups", "num_kv_heads", "summary"):
        assert streamed[key], key


@pytest.mark.parametrize("command", [["prune", "--heads", ""], ["convert-gqa", "--kv-heads", "1", "--merge", "mean"]],
                         ids=["prune", "convert-gqa"])
def test_eval_of_a_streamed_copy_skips_and_marks_the_fitted_blocks_as_in_memory(fitted, tmp_path, command):
    memory, streamed = _both([command[0], fitted, *command[1:]], tmp_path)
    docs = {}
    for mode in ("memory", "streamed"):
        out = _ok("eval", tmp_path / mode, "--data", "builtin:pydoc", "--max-samples", "2", *BLOCKS, "--json")
        docs[mode] = json.loads(out)
    assert docs["streamed"]["data"]["skip_samples"] == docs["memory"]["data"]["skip_samples"] == FIT_BLOCKS
    (mine,), (theirs,) = docs["streamed"]["results"], docs["memory"]["results"]
    assert mine["in_domain"] is theirs["in_domain"] is True
    assert mine["fitted_on"] == theirs["fitted_on"] == ["builtin:pydoc"]
    assert mine["loss"] == theirs["loss"]
