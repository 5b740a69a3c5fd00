"""`--streaming` prune and convert-gqa write the headtool.json the in-memory path writes (same tensors,
same record). Before, the streamed copy lacked `data_read` (and prune's num_kv_heads / num_heads /
summary, convert-gqa's kept_heads / kv_groups / summary): a compensated prune re-written by `prune
--streaming --heads ""` lost what it was fitted on, and `eval` scored it on its own calibration blocks
(0.980x, unmarked) where the in-memory copy was scored after them (1.020x, marked in-domain)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
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


COMMANDS = [["prune", "--heads", "0:0,1"], ["convert-gqa", "--kv-heads", "1", "--merge", "mean"]]


def _summary_section(folder: Path) -> str:
    card = (folder / "README.md").read_text()
    assert "## Summary" in card, card
    return card.split("## Summary", 1)[1]


@pytest.mark.parametrize("command", COMMANDS, ids=["prune", "convert-gqa"])
def test_a_streamed_copy_has_the_in_memory_card_table(fitted, tmp_path, command):
    """The streamed model card lacked the summary table the in-memory card has."""
    _both([command[0], fitted, *command[1:]], tmp_path)
    assert _summary_section(tmp_path / "streamed") == _summary_section(tmp_path / "memory")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("command", COMMANDS, ids=["prune", "convert-gqa"])
def test_streaming_casts_to_dtype_as_loading_does(fitted, tmp_path, command, dtype):
    """--dtype was ignored with --streaming (a float32 copy came out); now the streamed tensors, config
    and record equal the in-memory copy loaded in that dtype."""
    from tiny_models import checkpoint_tensors

    memory, streamed = _both([command[0], fitted, *command[1:], "--dtype", dtype], tmp_path)
    if dtype == "float16":  # the in-memory source fingerprint is of the float16 copy (double rounding to bf16)
        memory["source"].pop("fingerprint"), streamed["source"].pop("fingerprint")
    _assert_same_record(memory, streamed)
    a, b = checkpoint_tensors(tmp_path / "streamed"), checkpoint_tensors(tmp_path / "memory")
    assert a.keys() == b.keys()
    assert {str(t.dtype) for t in a.values() if t.is_floating_point()} == {f"torch.{dtype}"}
    assert all(a[k].dtype == b[k].dtype and (a[k] == b[k]).all() for k in a), \
        [k for k in a if a[k].dtype != b[k].dtype or not (a[k] == b[k]).all()]
    ca, cb = (json.loads((tmp_path / m / "config.json").read_text()) for m in ("streamed", "memory"))
    assert ca.get("dtype") == cb.get("dtype") == dtype
    assert {k: v for k, v in ca.items() if k != "transformers_version"} == \
        {k: v for k, v in cb.items() if k != "transformers_version"}


@pytest.mark.parametrize("option", [["--device-map", "auto"], ["--device", "cpu"], ["--sequential"],
                                    ["--device-map", "auto", "--max-memory", "cpu=1GB"]])
@pytest.mark.parametrize("command", COMMANDS, ids=["prune", "convert-gqa"])
def test_streaming_refuses_options_that_place_a_model(fitted, tmp_path, command, option):
    """They were accepted and did nothing: --streaming builds no model."""
    out = tmp_path / "out"
    res = runner.invoke(app, [command[0], str(fitted), *command[1:], *option, "--streaming", "-o", str(out)])
    assert res.exit_code == 2, res.output
    assert option[0] in res.stderr and "--streaming" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("config_dtype", [True, False], ids=["config-names-it", "weights-only"])
def test_a_bfloat16_checkpoint_streams_with_the_figures_loading_gives(tmp_path, config_dtype):
    """--dtype auto: the weightless model of a streamed bf16 checkpoint was float32, so its record said
    twice the KV cache bytes and parameters' dtype the in-memory copy (loaded in bf16) says."""
    from tiny_models import tiny_model

    model = tiny_model("llama").to(torch.bfloat16)
    if not config_dtype:
        model.config.dtype = None
    src = tmp_path / "bf16"
    model.save_pretrained(src)
    if not config_dtype:  # transformers writes the dtype anyway: take it out, loading then reads the weights
        cfg = json.loads((src / "config.json").read_text())
        cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
        (src / "config.json").write_text(json.dumps(cfg))
    memory, streamed = _both(["prune", src, "--heads", "0:0,1"], tmp_path)
    assert set(streamed) == set(memory)
    assert _result({**streamed, "data_read": None}) == _result({**memory, "data_read": None})
    assert streamed["summary"]["totals"]["kv_cache_bytes_per_token"] == {"before": 192, "after": 160}  # 2 bytes each


def test_streamed_convert_gqa_json_is_the_in_memory_summary(fitted, tmp_path):
    """`convert-gqa --streaming --json` printed only {path, config_kind, files}; the in-memory --json
    prints the conversion's summary (figures before and after, KV heads, the merge): the same now."""
    command = ["convert-gqa", fitted, "--kv-heads", "1", "--merge", "mean", "--json"]
    docs = {mode: json.loads(_ok(*command, "-o", tmp_path / mode, *(["--streaming"] if mode == "streamed" else [])))
            for mode in ("memory", "streamed")}
    memory, streamed = docs["memory"], docs["streamed"]
    assert set(streamed) == set(memory), set(streamed) ^ set(memory)
    assert streamed["path"] == str(tmp_path / "streamed") and memory["path"] == str(tmp_path / "memory")
    assert streamed["config_kind"] == memory["config_kind"]
    same = ("before", "after", "kv_cache_reduction", "num_kv_heads_before", "num_kv_heads_after", "chosen", "merge",
            "kv_heads", "grouping", "eval_before", "eval_data")
    assert {k: streamed[k] for k in same} == {k: memory[k] for k in same}
    assert [r["method"] for r in streamed["results"]] == ["mean"]
    assert streamed["before"]["kv_cache_bytes_per_token"] > streamed["after"]["kv_cache_bytes_per_token"]
