"""`headtool eval --speed`: prefill/decode throughput, KV-cache bytes from the cache tensors, bad input."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from headtool.cli.app import app
from headtool.model.info import kv_cache_bytes_per_token
from headtool.arch import adapter_for
from headtool.measure.speed import SpeedSpec, cache_bytes, measure_models
from headtool.errors import UsageError
from tiny_models import save_tiny, sample_ids, tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def two_llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("speed")
    return save_tiny("llama", root / "kv2"), save_tiny("llama", root / "kv1", num_key_value_heads=1)


def test_measure_models_counts_the_cache_exactly():
    a, b = tiny_model("llama"), tiny_model("llama", num_key_value_heads=1)
    spec = SpeedSpec(batch=2, context=20, new_tokens=3, repeats=2, warmup=0)
    ids = sample_ids("llama", batch=2, seq=20)
    res = measure_models([("kv2", a, True), ("kv1", b, True)], ids, spec)
    for r, m in zip(res, (a, b)):
        per_token = kv_cache_bytes_per_token(adapter_for(m.config).geometry(m.config), torch.float32)
        assert r["kv_cache_bytes"] == per_token * 2 * (20 + 3)
        assert r["kv_cache_tokens"] == 23
        assert len(r["prefill_s_runs"]) == len(r["decode_s_runs"]) == 2
        assert r["prefill_tokens_per_s"] == pytest.approx(40 / r["prefill_s"])
        assert r["decode_tokens_per_s"] == pytest.approx(6 / r["decode_s"])
        assert r["decode_s"] == pytest.approx(sum(r["decode_s_runs"]) / 2, abs=1e-5)  # median of two
    assert res[0]["ratio"]["kv_cache_bytes"] == 1.0
    assert res[1]["ratio"]["kv_cache_bytes"] == 0.5


def test_cache_bytes_of_legacy_tuples():
    k = torch.zeros(1, 2, 5, 8)
    assert cache_bytes(((k, k), (k, k))) == (4 * k.numel() * 4, 0)


def test_encoder_gets_prefill_only():
    m = tiny_model("bert")
    res = measure_models([("bert", m, False)], sample_ids("bert", batch=1, seq=16),
                         SpeedSpec(batch=1, context=16, new_tokens=2, repeats=1, warmup=0))
    assert res[0]["prefill_tokens_per_s"] > 0 and res[0]["decode_tokens_per_s"] is None
    assert res[0]["kv_cache_bytes"] is None


@pytest.mark.parametrize("field,value", [("batch", 0), ("context", 0), ("new_tokens", 0), ("repeats", 0),
                                         ("warmup", -1)])
def test_speed_spec_rejects_bad_values(field, value):
    with pytest.raises(UsageError, match="--" + field.replace("_", "-")):
        SpeedSpec(**{field: value}).check()


def test_eval_speed_cli(two_llamas):
    a, b = two_llamas
    res = runner.invoke(app, ["eval", str(a), str(b), "--speed", "--batch", "2", "--context", "24",
                              "--new-tokens", "3", "--repeats", "1", "--warmup", "1", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["format"] == "headtool.speed/1"
    assert doc["settings"]["context"] == 24 and doc["settings"]["repeats"] == 1
    r0, r1 = doc["results"]
    assert r0["model"] == str(a) and r0["ratio"]["prefill_tokens_per_s"] == 1.0
    assert r1["total_kv_heads"] == 3 and r1["ratio"]["kv_cache_bytes"] == 0.5
    assert r1["kv_cache_bytes"] == r1["kv_cache_bytes_per_token"] * 2 * 27
    assert r0["decode_tokens_per_s"] > 0 and "peak_memory_delta_bytes" in r0
    assert "decode tok/s" in res.stderr and "0.500x" in res.stderr


@pytest.mark.parametrize("extra,message", [
    (["--speed", "--context", "200"], "exceeds the model's 128 positions"),
    (["--speed", "--repeats", "0"], "--repeats must be at least 1"),
    (["--batch", "2"], "--batch only applies with --speed"),
    (["--batch", "2", "--context", "64"], "--batch, --context only apply with --speed"),
])
def test_eval_speed_bad_input_exits_2(two_llamas, extra, message):
    res = runner.invoke(app, ["eval", str(two_llamas[0]), *extra])
    assert res.exit_code == 2, res.output
    assert message in res.stderr


LOSS_OPTIONS = ["--batch-size", "16", "--seq-len", "8", "--max-samples", "1", "--objective", "mlm",
                "--skip-samples", "99999", "--num-tokens", "3", "--split", "train", "--text-column", "t"]


def test_eval_speed_refuses_the_loss_options_it_would_ignore(two_llamas):
    """--speed times generation on tokens of --data: the loss evaluation's options were accepted and
    silently ignored (a normal speed table, exit 0); now one line names each of them, before any work."""
    res = runner.invoke(app, ["eval", str(two_llamas[0]), "--speed", *LOSS_OPTIONS])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "without --speed" in lines[0], res.stderr
    for flag in LOSS_OPTIONS[::2]:
        assert flag in lines[0], (flag, lines[0])
    assert "use --batch instead of --batch-size, --context instead of --seq-len" in lines[0]


@pytest.mark.parametrize("extra,message", [
    (["--batch-size", "16"], "--batch-size only applies without --speed (the loss evaluation); with --speed use "
                             "--batch instead of --batch-size"),
    (["--seq-len", "128"], "--seq-len only applies without --speed"),  # typed, even at its default
    (["--objective", "auto", "--max-samples", "1"], "--objective, --max-samples only apply without --speed"),
])
def test_eval_speed_names_each_loss_option_given(two_llamas, extra, message):
    res = runner.invoke(app, ["eval", str(two_llamas[0]), "--speed", *extra])
    assert res.exit_code == 2 and message in res.stderr, res.output


def test_eval_speed_reads_data_and_seed(two_llamas):
    """--data and --seed choose the timed tokens: accepted with --speed and recorded."""
    res = runner.invoke(app, ["eval", str(two_llamas[0]), "--speed", "--data", "builtin:licenses", "--seed", "3",
                              "--context", "16", "--new-tokens", "2", "--repeats", "1", "--warmup", "0", "--json"])
    assert res.exit_code == 0, res.output
    settings = json.loads(res.stdout)["settings"]
    assert settings["source"] == "builtin:licenses" and settings["seed"] == 3


def test_eval_help_states_the_speed_defaults_the_measurement_uses():
    """--batch/--context/... say their defaults from SpeedSpec itself (one place), torch-free."""
    import dataclasses

    r = runner.invoke(app, ["eval", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    options = [ln for ln in r.output.splitlines() if ln.lstrip("│ ").startswith("--")]
    for f in dataclasses.fields(SpeedSpec):
        line = next(ln for ln in options if ln.lstrip("│ ").startswith(f"--{f.name.replace('_', '-')} "))
        assert f"(default {f.default})" in " ".join(line.split()), line
