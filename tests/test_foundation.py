"""Adapters, head gates, loading and `info` on tiny models of every family."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from headtool.arch import adapter_for, supported_families
from headtool.cli.app import app
from headtool.errors import UsageError
from headtool.measure.gates import head_gates
from headtool.model.loading import load_model
from headtool.model.info import model_info
from tiny_models import ALL, FAMILIES, GQA, logits_of, sample_ids, save_tiny, tiny_model

runner = CliRunner()

EXPECTED_KV = {f: 4 for f in ALL} | {f: 2 for f in GQA} | {"gemma": 1}


def _zero_head_columns(model, layer: int, head: int):
    """Zero head `head`'s input columns of layer `layer`'s output projection, by hand."""
    m = copy.deepcopy(model)
    a = adapter_for(m.config)
    hd = a.geometry(m.config)[layer].head_dim
    w = a.o_proj_module(m, layer).weight
    with torch.no_grad():
        if a.conv1d:  # Conv1D stores [in, out]
            w[head * hd:(head + 1) * hd, :] = 0
        else:
            w[:, head * hd:(head + 1) * hd] = 0
    return m


@pytest.mark.parametrize("family", ALL)
def test_gate_zero_equals_zeroed_columns(family):
    model = tiny_model(family)
    a = adapter_for(model.config)
    ids = sample_ids(family)
    base = logits_of(model, ids)
    for layer, head in [(0, 1), (2, 3)]:
        with head_gates(model, a) as gates:
            gates.set(layer, head, 0.0)
            gated = logits_of(model, ids)
        zeroed = logits_of(_zero_head_columns(model, layer, head), ids)
        assert (gated - zeroed).abs().max().item() <= 1e-5
        assert (gated - base).abs().max().item() > 1e-2  # the head matters: the test can fail


@pytest.mark.parametrize("family", ALL)
def test_gates_one_change_nothing_and_hooks_are_removed(family):
    model = tiny_model(family)
    a = adapter_for(model.config)
    ids = sample_ids(family)
    base = logits_of(model, ids)
    with head_gates(model, a) as gates:
        assert (logits_of(model, ids) - base).abs().max().item() == 0.0
        gates.fill_(0.5)
    assert (logits_of(model, ids) - base).abs().max().item() == 0.0
    for i in range(a.num_layers(model.config)):
        assert not a.o_proj_module(model, i)._forward_pre_hooks


def test_hooks_are_removed_on_exception():
    model = tiny_model("llama")
    a = adapter_for(model.config)
    with pytest.raises(RuntimeError):
        with head_gates(model, a) as gates:
            gates.fill_(0.0)
            raise RuntimeError("boom")
    assert all(not a.o_proj_module(model, i)._forward_pre_hooks for i in range(3))


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_per_example_gates_and_gradients(family):
    model = tiny_model(family)
    a = adapter_for(model.config)
    ids = sample_ids(family, batch=2)
    with head_gates(model, a, batch_size=2, requires_grad=True) as gates:
        with torch.no_grad():
            gates.values[1][1, 2] = 0.0  # gate head 2 of layer 1 for the second example only
        out = logits_of(model, ids)
        with torch.no_grad():
            gates.values[1].fill_(1.0)
        loss = model(input_ids=ids).logits.sum()
        loss.backward()
        assert gates.values[0].grad is not None and gates.values[0].grad.shape == (2, 4)
    full = logits_of(model, ids)
    assert torch.allclose(out[0], full[0], atol=1e-6)
    assert not torch.allclose(out[1], full[1], atol=1e-3)


@pytest.mark.parametrize("family", ALL)
def test_info_reports_the_right_numbers(family, tmp_path):
    folder = save_tiny(family, tmp_path / family)
    res = runner.invoke(app, ["info", str(folder), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["ref"] == str(folder)  # the model as typed, beside the resolved path
    assert info["family"] == adapter_for(tiny_model(family).config).family
    assert info["num_layers"] == 3
    assert info["num_heads"] == 4
    assert info["num_kv_heads"] == EXPECTED_KV[family]
    assert info["head_dim"] == 8
    assert info["hidden_size"] == 32
    model = tiny_model(family)
    assert info["params"] == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    # q, k, v, o weights (+ biases where present) of 3 layers
    assert info["attention_params"] >= 3 * (2 * 32 * 32 + 2 * 32 * 8 * EXPECTED_KV[family])
    # fp32; an encoder keeps no KV cache (n/a, as eval --speed says)
    # (gemma2, gemma3_text: the one global layer; the two sliding-window layers are stated apart)
    assert info["kv_cache_bytes_per_token"] == (None if family in ("bert", "roberta") else
                                                (1 if family in ("gemma2", "gemma3_text") else 3)
                                                * 2 * EXPECTED_KV[family] * 8 * 4)
    for key in ("model_type", "family", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
                "params", "attention_params", "kv_cache_bytes_per_token"):
        assert key in info


def test_info_table_goes_to_stderr_only(tmp_path):
    folder = save_tiny("llama", tmp_path / "m")
    res = runner.invoke(app, ["info", str(folder)])
    assert res.exit_code == 0
    assert res.stdout == ""
    assert "query heads" in res.stderr


def test_unsupported_family_names_the_supported_ones(tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("t5", d_model=32, num_layers=1, num_heads=2, d_kv=8, d_ff=32, vocab_size=50)
    cfg.save_pretrained(tmp_path / "t5")
    res = runner.invoke(app, ["info", str(tmp_path / "t5")])
    assert res.exit_code == 2
    line = res.stderr.strip()
    assert "\n" not in line and "unsupported model family 't5'" in line and "llama" in line
    with pytest.raises(UsageError):
        adapter_for(cfg)
    assert "gpt2" in supported_families()


@pytest.mark.parametrize("ref,needle", [
    ("/no/such/model", "model not found"),
    ("./missing-folder", "model not found"),
    ("some-org/some-model", "hub is offline"),
])
def test_bad_model_references(ref, needle):
    res = runner.invoke(app, ["info", ref])
    assert res.exit_code == 2
    assert needle in res.stderr and "Traceback" not in res.stderr


def test_folder_without_config_and_file_that_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "x.txt").write_text("hello")
    for ref, needle in [(tmp_path / "empty", "no config.json"), (tmp_path / "x.txt", "not a model")]:
        res = runner.invoke(app, ["info", str(ref)])
        assert res.exit_code == 2 and needle in res.stderr


def test_dtype_and_device_options(tmp_path):
    folder = save_tiny("qwen2", tmp_path / "m")
    lm = load_model(str(folder), dtype="bfloat16", device="cpu")
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    assert model_info(lm.model, lm.adapter)["kv_cache_bytes_per_token"] == 3 * 2 * 2 * 8 * 2
    for opt, val in [("--dtype", "float8"), ("--device", "tpu")]:
        res = runner.invoke(app, ["info", str(folder), opt, val])
        assert res.exit_code == 2, res.output


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_fingerprint_is_stable_across_dtypes_and_changes_with_weights(tmp_path, family):
    """float16 too: its values rounded twice (to float16, then bfloat16) gave another fingerprint, and
    `prune --scores` refused scores made at --dtype float16 as made for another model."""
    folder = save_tiny(family, tmp_path / "m")
    a = load_model(str(folder), dtype="float32")
    assert a.fingerprint == load_model(str(folder), dtype="bfloat16").fingerprint
    assert a.fingerprint == load_model(str(folder), dtype="float16").fingerprint
    if family != "llama":
        return
    scores = tmp_path / "s16.json"
    res = runner.invoke(app, ["score", str(folder), "--dtype", "float16", "--data", "builtin:pydoc",
                              "--seq-len", "16", "--max-samples", "2", "-o", str(scores)])
    assert res.exit_code == 0, res.output
    for extra in ([], ["--streaming"]):
        res = runner.invoke(app, ["prune", str(folder), "--scores", str(scores), "--fraction", "0.25",
                                  "-o", str(tmp_path / f"p{len(extra)}"), *extra])
        assert res.exit_code == 0, res.output
    other = save_tiny("llama", tmp_path / "o", seed=5)
    assert load_model(str(other)).fingerprint != a.fingerprint


def test_loading_never_modifies_the_input(tmp_path):
    import hashlib

    folder = save_tiny("gpt2", tmp_path / "m")

    def digest():
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}

    before = digest()
    runner.invoke(app, ["info", str(folder), "--json"])
    assert digest() == before


def test_version_and_help():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and "headtool" in res.stdout
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0 and "info" in res.stdout


def test_command_help_is_prose_that_the_terminal_wraps():
    """typer keeps every line break of a docstring: each paragraph is joined into one line (so a
    wide terminal does not show the source's ragged 100-column lines cut at 80), while example
    lines and indented lines stay lines of their own."""
    from headtool.cli.app import reflow_help

    doc = """First line.

    A paragraph written
    over three
    lines.

    Example: headtool a b
    --c d
    Example: headtool e
    Examples:
      headtool f
      headtool g
    """
    assert reflow_help(doc) == ("First line.\n\nA paragraph written over three lines.\n\n"
                                "Example: headtool a b --c d\nExample: headtool e\nExamples:\n  headtool f\n"
                                "  headtool g")
    res = runner.invoke(app, ["prune", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    assert ("Without --scores or --heads the heads are scored now on --data (default auto: builtin:pydoc mixed with "
            "text sampled from the model") in res.stdout
    assert "\n   headtool prune m --heads" in res.stdout  # an indented example keeps its line


def test_flags_show_no_value_type_and_still_switch():
    """typer 0.29 prints `<bool>` beside every on/off flag (as if --json took a value); headtool's
    help shows flags bare, on the top level and every command, and the flags still parse."""
    from headtool.cli.app import app as typer_app

    names = [""] + [c.name or c.callback.__name__.replace("_", "-") for c in typer_app.registered_commands]
    for name in names:
        res = runner.invoke(app, [*name.split(), "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0, name
        assert "<bool>" not in res.stdout, name
        assert "--help" in res.stdout
    res = runner.invoke(app, ["info", "smollm2-135m", "--json"])
    assert res.exit_code == 0 and res.stdout.lstrip().startswith("{")


def test_typer_is_a_pinned_version_and_its_usage_errors_pass_through():
    """cli/app.py reaches into typer: the installed version must be in the range pyproject pins
    (the range the CLI tests ran with), and a click usage error raised by typer's own parser (an
    unknown option) must reach click's handling, exit 2, not headtool's 'internal error'."""
    import re
    from pathlib import Path

    import typer
    from packaging.specifiers import SpecifierSet

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    spec = re.search(r'"typer\s*([^"]*)"', pyproject).group(1)
    assert "<" in spec and ">=" in spec, spec  # a range, not an open-ended floor
    assert SpecifierSet(spec).contains(typer.__version__), (typer.__version__, spec)
    res = runner.invoke(app, ["info", "somewhere", "--no-such-option"])
    assert res.exit_code == 2 and "No such option" in res.output and "internal error" not in res.output, res.output
    # one line, as every other user mistake (click drew a box of several)
    for args, words in ((["info", "somewhere", "--no-such-option"], "No such option"),
                        (["prune", "m", "--fraction", "abc", "-o", "x"], "--fraction"),
                        (["prune"], "Missing argument"), (["prunee", "m"], "prune")):
        res = runner.invoke(app, args)
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines


def test_every_adapter_has_a_tiny_model():
    """The registry's adapters against the tiny models the tests build: an adapter added without
    a tiny model (so never run through the equivalence tests) fails here, and so does a tiny
    model of a type the registry does not list."""
    from tiny_models import tiny_config

    from headtool.arch.families import ALL_ADAPTERS

    covered = {f: adapter_for(tiny_config(f)) for f in FAMILIES}
    assert {a.family for a in covered.values()} == {a.family for a in ALL_ADAPTERS}
    assert set(FAMILIES) <= set(supported_families())
    assert all(f in a.model_types for f, a in covered.items()), {f: a.family for f, a in covered.items()}


def test_fingerprint_of_a_large_tensor_samples_in_range():
    """float32 linspace rounds n-1 up to n past 2**24 elements (an IndexError on real embeddings)."""
    from headtool.model.fingerprint import tensor_sample

    t = torch.zeros(28_311_552 // 64, 64)
    assert len(tensor_sample(t)) == 256 * 2


def test_a_cache_location_that_is_a_file_is_one_line(tmp_path):
    """It exited 1 with a bare 'Not a directory' naming neither the cache nor HEADTOOL_CACHE."""
    folder = save_tiny("llama", tmp_path / "m")
    blocker = tmp_path / "cachefile"
    blocker.write_text("not a folder")
    res = runner.invoke(app, ["eval", str(folder), "--data", "self:2", "--seq-len", "8"],
                        env={"HEADTOOL_CACHE": str(blocker)})
    assert res.exit_code == 2 and "HEADTOOL_CACHE" in res.stderr and "internal error" not in res.stderr, res.output
    assert len(res.stderr.strip().splitlines()) == 1
