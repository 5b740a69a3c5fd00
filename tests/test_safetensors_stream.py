"""Tensor-by-tensor safetensors writing: same tensors as safetensors' own writer, sharding, corruption."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from headtool.errors import UsageError
from headtool.io.safetensors_stream import (LazyCheckpoint, checkpoint_index, read_header,
    write_checkpoint_streaming)
from headtool.io.sizes import parse_size
from tiny_models import checkpoint_tensors, tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_streamed_copy_is_identical_and_sharded(tmp_path, dtype):
    tiny_model("llama").to(dtype).save_pretrained(tmp_path / "src")
    lc = LazyCheckpoint(tmp_path / "src")
    entries = [(e.name, e.dtype, e.shape) for e in checkpoint_index(tmp_path / "src").values()]
    (tmp_path / "out").mkdir()
    names = write_checkpoint_streaming(tmp_path / "out", entries, lambda n: lc[n], shard_bytes=20_000)
    assert len(names) > 2 and names[-1] == "model.safetensors.index.json"
    index = json.loads((tmp_path / "out" / names[-1]).read_text())
    assert set(index["weight_map"]) == {e[0] for e in entries}
    a, b = checkpoint_tensors(tmp_path / "out"), load_file(tmp_path / "src" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in b)
    assert checkpoint_index(tmp_path / "out").keys() == checkpoint_index(tmp_path / "src").keys()


def test_corrupt_and_truncated_files_are_usage_errors(tmp_path):
    tiny_model("gpt2").save_pretrained(tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError, match="truncated"):
        read_header(f)
    f.write_bytes(b"\x05\x00")
    with pytest.raises(UsageError, match="truncated header"):
        read_header(f)
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!}")
    with pytest.raises(UsageError, match="corrupt"):
        read_header(f)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(123) == 123
    with pytest.raises(UsageError):
        parse_size("lots")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_element_reads_match_the_whole_tensor_and_the_fingerprint(tmp_path, dtype):
    """The streaming fingerprint reads only sampled elements; they must be the loaded tensor's."""
    from headtool.model.fingerprint import model_fingerprint
    from headtool.surgery.streaming import open_checkpoint

    model = tiny_model("llama").to(dtype)
    model.save_pretrained(tmp_path / "m")
    lc = LazyCheckpoint(tmp_path / "m")
    for key in lc.keys():
        flat = lc[key].reshape(-1)
        positions = [0, flat.numel() - 1, flat.numel() // 3]
        assert torch.equal(lc.elements(key, positions), flat[positions])
    assert open_checkpoint(str(tmp_path / "m")).fingerprint == model_fingerprint(model.float())
