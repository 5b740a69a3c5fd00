"""Streaming surgery (no model built) writes the same tensors as the in-memory path."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from headtool.io.output import write_output
from headtool.surgery.merging import convert_model
from headtool.model.loading import load_model
from headtool.surgery.pruning import prune
from headtool.surgery.selection import Selection
from headtool.surgery.streaming import open_checkpoint, stream_convert_mean, stream_prune
from tiny_models import checkpoint_tensors, logits_of, sample_ids, save_tiny

KEPT = {"uniform": [[0, 1], [0, 1], [0, 1]], "ragged": [[0, 1, 2, 3], [1, 3], [0, 2]]}


@pytest.mark.parametrize("family,layout", [("llama", "uniform"), ("llama", "ragged"), ("gpt2", "ragged"),
                                           ("phi3", "uniform"), ("qwen2", "ragged"), ("gpt_neox", "uniform")])
def test_stream_prune_matches_in_memory(family, layout, tmp_path):
    src = save_tiny(family, tmp_path / "src")
    kept = KEPT[layout]
    if family in ("llama", "phi3", "qwen2") and layout == "ragged":
        kept = [[0, 1, 2, 3], [0, 2], [1, 3]]  # keep KV groups equal in size
    ck = open_checkpoint(str(src))
    meta = {"operation": "prune", "kept_heads": kept}
    streamed = stream_prune(ck, kept, tmp_path / "streamed", meta=meta, shard_size=30_000)
    lm = load_model(str(src), dtype="float32", device="cpu")
    assert ck.fingerprint == lm.fingerprint  # a score document of the model also fits the checkpoint
    reference = lm.model
    original = copy.deepcopy(reference)
    prune(lm, Selection.from_kept(lm.geometry, [tuple(k) for k in kept]))
    memory = write_output(tmp_path / "memory", model=lm.model, tokenizer=lm.tokenizer, source=lm, meta=meta)
    a, b = checkpoint_tensors(tmp_path / "streamed"), checkpoint_tensors(tmp_path / "memory")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    ca = json.loads((tmp_path / "streamed" / "config.json").read_text())
    cb = json.loads((tmp_path / "memory" / "config.json").read_text())
    assert {k: v for k, v in ca.items() if k != "transformers_version"} == \
        {k: v for k, v in cb.items() if k != "transformers_version"}
    assert streamed["config_kind"] == memory["config_kind"]
    if (family, layout) == ("llama", "uniform"):
        assert streamed["config_kind"] == "standard"
    if layout == "ragged":
        assert streamed["config_kind"] == "headtool-remote-code"
    assert len(list((tmp_path / "streamed").glob("*.safetensors"))) > 1
    # reloads and computes what the in-memory result computes
    ids = sample_ids(family)
    re = load_model(str(tmp_path / "streamed"), dtype="float32", device="cpu")
    assert (logits_of(re.model, ids) - logits_of(lm.model, ids)).abs().max() <= 1e-5
    del original


@pytest.mark.parametrize("family", ["llama", "phi3", "qwen2"])
def test_stream_convert_mean_matches_in_memory(family, tmp_path):
    src = save_tiny(family, tmp_path / "src")
    ck = open_checkpoint(str(src))
    stream_convert_mean(ck, 1, tmp_path / "streamed", meta={"operation": "convert-gqa"})
    lm = load_model(str(src), dtype="float32", device="cpu")
    conv = convert_model(lm.model, lm.adapter, 1, method="mean")
    write_output(tmp_path / "memory", model=conv.model, tokenizer=lm.tokenizer, source=lm, meta={})
    a, b = checkpoint_tensors(tmp_path / "streamed"), checkpoint_tensors(tmp_path / "memory")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "streamed" / "config.json").read_text())["num_key_value_heads"] == 1


def test_streaming_refuses_hub_ids_and_missing_weights(tmp_path):
    from headtool.errors import UsageError

    with pytest.raises(UsageError):
        open_checkpoint("org/model")
    src = save_tiny("llama", tmp_path / "src")
    (src / "model.safetensors").unlink()
    with pytest.raises(UsageError, match="no safetensors"):
        open_checkpoint(str(src))
