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
    for bad in ("lots", "infGB", "nanMB", "0", "-5", "0GB"):  # infGB was an OverflowError (internal error)
        with pytest.raises(UsageError):
            parse_size(bad)


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


# --------------------------------------------------------------------------- dtypes beyond float/int
def write_by_hand(path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file from its parts (8-byte length, JSON header, raw bytes), so that dtypes
    torch's own writer would not produce (or that do not exist) can be written."""
    import struct

    header, body = {}, b""
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(data)]}
        body += data
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


NEWER = {  # safetensors name -> (torch dtype name, bytes per element)
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "F8_E8M0": ("float8_e8m0fnu", 1),
    "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8),
}


def test_float8_and_unsigned_tensors_are_read_and_written_byte_for_byte(tmp_path):
    (tmp_path / "src").mkdir()
    data = {f"t.{name.lower()}": (name, [2, 3], bytes(range(7, 7 + 6 * size))) for name, (_, size) in NEWER.items()}
    write_by_hand(tmp_path / "src" / "model.safetensors", data)
    lc = LazyCheckpoint(tmp_path / "src")
    theirs = load_file(tmp_path / "src" / "model.safetensors")  # safetensors' own reader agrees
    for key, (name, shape, raw) in data.items():
        t = lc[key]
        assert t.dtype == getattr(torch, NEWER[name][0]) == theirs[key].dtype and list(t.shape) == shape
        assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == raw
        assert lc.elements(key, [5]).view(torch.uint8).numpy().tobytes() == raw[5 * NEWER[name][1]:]
    entries = [(e.name, e.dtype, e.shape) for e in checkpoint_index(tmp_path / "src").values()]
    keys = list(data)
    (tmp_path / "out").mkdir()
    # half passed through file to file, half produced as tensors
    write_checkpoint_streaming(tmp_path / "out", entries, lambda n: lc.raw(n) if keys.index(n) % 2 else lc[n],
                               shard_bytes=10**9)
    out = LazyCheckpoint(tmp_path / "out")
    assert {k: out[k].reshape(-1).view(torch.uint8).numpy().tobytes() for k in keys} == \
        {k: raw for k, (_, _, raw) in data.items()}


@pytest.mark.parametrize("dtype, shape, nbytes", [("F6_E3M2", [8], 6), ("F4", [8], 4), ("Q7", [2], 2)])
def test_a_dtype_headtool_cannot_read_is_one_line_naming_the_tensor(tmp_path, dtype, shape, nbytes):
    write_by_hand(tmp_path / "model.safetensors", {"ok": ("F32", [1], bytes(4)),
                                                    "odd.weight": (dtype, shape, bytes(nbytes))})
    with pytest.raises(UsageError, match=rf"tensor 'odd.weight' has dtype {dtype}, which headtool cannot read") as e:
        checkpoint_index(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("entry", [{"dtype": "F32", "shape": [2]}, {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]},
                                   {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, ["F32"]])
def test_header_entries_that_do_not_add_up_are_usage_errors(tmp_path, entry):
    import struct

    raw = json.dumps({"x": entry}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(UsageError, match="corrupt safetensors header"):
        read_header(tmp_path / "model.safetensors")


def _checkpoint_with(tmp_path, extra: dict[str, tuple[str, list[int], bytes]], fp8_key: str | None = None):
    """A tiny llama folder whose safetensors file also holds `extra` (and `fp8_key` as F8_E4M3)."""
    import struct

    from tiny_models import save_tiny

    folder = save_tiny("llama", tmp_path / "m")
    f = folder / "model.safetensors"
    blob = f.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    tensors = {}
    for k, v in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = v["data_offsets"]
        tensors[k] = (v["dtype"], v["shape"], blob[8 + n + a:8 + n + b])
    if fp8_key:
        t = torch.frombuffer(bytearray(tensors[fp8_key][2]), dtype=torch.float32).to(torch.float8_e4m3fn)
        tensors[fp8_key] = ("F8_E4M3", tensors[fp8_key][1], t.view(torch.uint8).numpy().tobytes())
    write_by_hand(f, {**tensors, **extra})
    return folder


def test_streaming_prune_copies_float8_and_unsigned_tensors_through(tmp_path):
    """The CLI path that reads safetensors headers itself: these dtypes work, copied byte for byte
    (and a float8 projection is sliced like any other)."""
    from typer.testing import CliRunner

    from headtool.cli.app import app

    extra = {f"extra.{name.lower()}": (name, [3], bytes(range(1, 1 + 3 * size))) for name, (_, size) in NEWER.items()}
    k = "model.layers.1.self_attn.k_proj.weight"
    folder = _checkpoint_with(tmp_path, extra, fp8_key=k)
    r = CliRunner().invoke(app, ["prune", str(folder), "--streaming", "--heads", "1:0,1", "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.stderr
    src, out = LazyCheckpoint(folder), LazyCheckpoint(tmp_path / "out")
    for key, (_, _, raw) in extra.items():
        assert out[key].reshape(-1).view(torch.uint8).numpy().tobytes() == raw
    # layer 1 loses KV group 0 (query heads 0, 1): its k_proj keeps KV head 1's rows, still float8
    assert out[k].dtype == torch.float8_e4m3fn
    assert torch.equal(out[k].view(torch.uint8), src[k][8:].view(torch.uint8))


@pytest.mark.parametrize("command", [["prune", "--heads", "1:0,1"], ["convert-gqa", "--kv-heads", "1", "--merge", "mean"]])
def test_streaming_a_dtype_headtool_cannot_read_is_exit_2(tmp_path, command):
    from typer.testing import CliRunner

    from headtool.cli.app import app

    folder = _checkpoint_with(tmp_path, {"extra.f6": ("F6_E3M2", [8], bytes(6))})
    r = CliRunner().invoke(app, [command[0], str(folder), "--streaming", *command[1:], "-o", str(tmp_path / "out")])
    assert r.exit_code == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "'extra.f6' has dtype F6_E3M2" in lines[0] and "internal error" not in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_streaming_refuses_a_quantized_checkpoint(tmp_path):
    """Float8 weights of a quantized checkpoint come with scale tensors streaming would not slice."""
    from typer.testing import CliRunner

    from headtool.cli.app import app

    folder = _checkpoint_with(tmp_path, {"model.layers.1.self_attn.k_proj.weight_scale_inv": ("F32", [1], bytes(4))},
                              fp8_key="model.layers.1.self_attn.k_proj.weight")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [8, 8]}
    (folder / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["prune", str(folder), "--streaming", "--heads", "1:0,1", "-o", str(tmp_path / "out")])
    assert r.exit_code == 2 and "quantized checkpoint (fp8)" in r.stderr, r.stderr
