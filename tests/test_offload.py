"""--device-map auto with --max-memory caps: scoring and eval on offloaded weights give the same
numbers; commands that rewrite weights refuse offloaded ones with one line (exit 2)."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from headtool.cli.app import app
from headtool.errors import UsageError
from headtool.model.placement import has_offloaded_weights, parse_max_memory
from headtool.model.loading import load_model
from tiny_models import save_tiny

pytest.importorskip("accelerate")
runner = CliRunner()
CAP = ["--device-map", "auto", "--max-memory", "cpu=200KB"]  # a few layers on CPU, the rest on disk
ALL_ON_DISK = ["--device-map", "auto", "--max-memory", "cpu=30KB"]  # nothing fits: the embedding is on disk too
DATA = ["--data", "builtin:pydoc", "--seq-len", "16", "--max-samples", "4", "--batch-size", "2"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("offload") / "llama")


def test_capped_device_map_offloads_and_keeps_the_fingerprint(llama):
    plain = load_model(str(llama), dtype="float32", device="cpu")
    capped = load_model(str(llama), dtype="float32", device="cpu", device_map="auto", max_memory="cpu=200KB")
    assert has_offloaded_weights(capped.model) and not has_offloaded_weights(plain.model)
    assert set(capped.model.hf_device_map.values()) >= {"cpu", "disk"}
    assert capped.fingerprint == plain.fingerprint  # read from the files for the offloaded part


@pytest.mark.parametrize("method", ["gradient", "ablation"])
def test_scores_on_offloaded_weights_equal_in_memory_scores(llama, tmp_path, method):
    docs = []
    for extra in ([], CAP):
        out = tmp_path / f"s{len(docs)}.json"
        r = runner.invoke(app, ["score", str(llama), *DATA, "--method", method, "--dtype", "float32",
                                "-o", str(out), *extra])
        assert r.exit_code == 0, r.stderr
        docs.append(json.loads(out.read_text()))
    a, b = (torch.tensor(d["scores"], dtype=torch.float64) for d in docs)
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-9)
    assert docs[0]["model"]["fingerprint"] == docs[1]["model"]["fingerprint"]


def test_eval_on_offloaded_weights(llama):
    losses = []
    for extra in ([], CAP):
        r = runner.invoke(app, ["eval", str(llama), *DATA, "--dtype", "float32", "--json", *extra])
        assert r.exit_code == 0, r.stderr
        losses.append(json.loads(r.stdout)["results"][0]["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def _offloaded_and_plain(llama, tmp_path, monkeypatch, argv, out_flag=True):
    """Run argv on the plain model and with every weight on disk; (plain, offloaded) JSON results.
    Each run gets its own cache folder, so self-generated text is sampled by the model it reads."""
    docs = []
    for name, extra in (("plain", []), ("disk", ALL_ON_DISK)):
        monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / f"cache-{name}"))
        out = tmp_path / f"{name}.json"
        r = runner.invoke(app, [argv[0], str(llama), *argv[1:], "--dtype", "float32", *extra,
                                *(["-o", str(out)] if out_flag else ["--json"])])
        assert r.exit_code == 0, r.output
        docs.append(json.loads(out.read_text() if out_flag else r.stdout))
    return docs


def test_everything_on_disk_embedding_included(llama):
    capped = load_model(str(llama), dtype="float32", device="cpu", device_map="auto", max_memory="cpu=30KB")
    assert capped.model.get_input_embeddings().weight.device.type == "meta"
    assert capped.device == torch.device("cpu")  # where the forward takes its inputs, not 'meta'


@pytest.mark.parametrize("method", ["gradient", "ablation", "magnitude"])
def test_scores_with_the_embedding_on_disk(llama, tmp_path, monkeypatch, method):
    """It failed 'Cannot copy out of meta tensor': inputs went to the first parameter's device."""
    plain, disk = _offloaded_and_plain(llama, tmp_path, monkeypatch, ["score", *(DATA if method != "magnitude" else []), "--method", method])
    a, b = (torch.tensor(d["scores"], dtype=torch.float64) for d in (plain, disk))
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("data", [DATA, ["--data", "self:4", "--seq-len", "16", "--batch-size", "2"]])
def test_eval_with_the_embedding_on_disk(llama, tmp_path, monkeypatch, data):
    plain, disk = _offloaded_and_plain(llama, tmp_path, monkeypatch, ["eval", *data], out_flag=False)
    assert disk["results"][0]["loss"] == pytest.approx(plain["results"][0]["loss"], rel=1e-6)


def test_inspect_with_the_embedding_on_disk(llama, tmp_path, monkeypatch):
    plain, disk = _offloaded_and_plain(llama, tmp_path, monkeypatch, ["inspect", *DATA], out_flag=False)
    for key in ("statistics", "twins", "similarity", "kv_groups", "top_pairs"):
        a, b = (json.dumps(d[key], sort_keys=True) for d in (plain, disk))
        assert a == b, key


@pytest.mark.parametrize("command, hint", [
    (["prune", "--fraction", "0.25", "--compensate"], "--sequential"),
    (["convert-gqa", "--kv-heads", "1"], "--streaming with --merge mean"),
])
def test_rewriting_offloaded_weights_is_refused(llama, tmp_path, command, hint):
    out = tmp_path / "out"
    r = runner.invoke(app, [command[0], str(llama), *command[1:], *DATA, *CAP, "-o", str(out)])
    assert r.exit_code == 2, r.output
    assert "offloaded" in r.stderr and hint in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_heal_refuses_an_offloaded_student(llama, tmp_path):
    r = runner.invoke(app, ["heal", str(llama), "--teacher", str(llama), *DATA, *CAP, "--max-steps", "1",
                            "-o", str(tmp_path / "healed")])
    assert r.exit_code == 2 and "offloaded" in r.stderr, r.output
    assert not (tmp_path / "healed").exists()


def test_uncapped_device_map_compensated_prune_matches_the_plain_one(llama, tmp_path):
    """Nothing offloaded: --device-map auto reaches the same weights as a plain load."""
    outs = []
    for extra in ([], ["--device-map", "auto"]):
        out = tmp_path / f"p{len(outs)}"
        r = runner.invoke(app, ["prune", str(llama), *DATA, "--fraction", "0.25", "--compensate", "--dtype",
                                "float32", "-o", str(out), *extra])
        assert r.exit_code == 0, r.stderr
        outs.append(load_model(str(out), dtype="float32", device="cpu").model.state_dict())
    assert outs[0].keys() == outs[1].keys()
    for k in outs[0]:
        torch.testing.assert_close(outs[0][k], outs[1][k], rtol=1e-5, atol=1e-6)


def test_max_memory_parsing():
    assert parse_max_memory("0=70GiB, 1=70GiB,cpu=200GiB") == {0: "70GiB", 1: "70GiB", "cpu": "200GiB"}
    for bad in ("", "cpu", "gpu=1GB", "cpu=lots", "0=1GB,,cpu=2GB", "cpu=2GB,"):  # an empty item: a typo
        with pytest.raises(UsageError):
            parse_max_memory(bad)
    r = runner.invoke(app, ["eval", "x", "--max-memory", "cpu=1GB"])
    assert r.exit_code == 2 and "--device-map" in r.stderr
