"""Read and write safetensors checkpoints one tensor at a time (no model, no whole shard in memory).

A safetensors file is an 8-byte header length, a JSON header (dtype, shape, byte offsets of
every tensor), then the raw bytes. Since the header needs only dtypes and shapes, it can be
written from a plan before any tensor exists; tensors are then produced and written one by
one, so peak memory stays near the largest single tensor whatever the shard size.
"""
from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from ..errors import UsageError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
# the other one-value-per-element dtypes of safetensors, where this torch has them (float8 since
# 2.1, uint16/32/64 since 2.3, float8_e8m0fnu since 2.7): read, written and copied through like
# the rest. Sub-byte formats (F4, F6_*) have no such torch dtype and stay unreadable.
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2", "float8_e5m2"),
                     ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("F8_E8M0", "float8_e8m0fnu"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if isinstance(getattr(torch, _attr, None), torch.dtype):
        DTYPES[_name] = getattr(torch, _attr)
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ALIGN = 8  # header padded so that tensor data starts 8-byte aligned


@dataclass(frozen=True)
class TensorEntry:
    """Where a tensor lives in a checkpoint and what it looks like."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = -1  # absolute byte offset of the data in `file` (-1: not from a header)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


def _check_entry(path: Path, name: str, entry) -> None:
    """One tensor of a header: a dtype headtool reads, a shape and byte offsets that agree."""
    ok = (isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
          and isinstance(entry.get("shape"), list) and all(isinstance(s, int) and s >= 0 for s in entry["shape"])
          and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
          and all(isinstance(o, int) and o >= 0 for o in entry["data_offsets"]))
    if not ok:
        raise UsageError(f"{path}: corrupt safetensors header (tensor {name!r} lacks a dtype, shape or offsets)")
    if entry["dtype"] not in DTYPES:
        raise UsageError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which headtool cannot read "
                         f"(it reads {', '.join(DTYPES)})")
    start, stop = entry["data_offsets"]
    if stop - start != TensorEntry(name, "", entry["dtype"], tuple(entry["shape"])).nbytes:
        raise UsageError(f"{path}: corrupt safetensors header (tensor {name!r}: {stop - start} bytes for "
                         f"{entry['dtype']}{entry['shape']})")


def read_header(path: str | os.PathLike) -> dict:
    """The JSON header of a safetensors file; a corrupt or truncated file is a UsageError."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise UsageError(f"{p}: not a safetensors file (truncated header)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 * 2**20):
            raise UsageError(f"{p}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"{p}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise UsageError(f"{p}: corrupt safetensors header (not a JSON object)")
    for name, v in header.items():
        if name != "__metadata__":
            _check_entry(p, name, v)
    end = 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if end > size:
        raise UsageError(f"{p}: truncated safetensors file ({size} bytes, header promises {end})")
    return header


def checkpoint_index(folder: str | os.PathLike) -> dict[str, TensorEntry]:
    """Every tensor of a (possibly sharded) safetensors checkpoint folder, in file order."""
    folder = Path(folder)
    idx_file = folder / "model.safetensors.index.json"
    if idx_file.exists():
        try:
            weight_map = json.loads(idx_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise UsageError(f"{idx_file}: not a safetensors index ({e})") from e
        files = list(dict.fromkeys(weight_map.values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise UsageError(f"{folder}: no safetensors weights (model.safetensors or its index)")
    out: dict[str, TensorEntry] = {}
    for fname in files:
        fpath = folder / fname
        if not fpath.exists():
            raise UsageError(f"{folder}: shard {fname} named in the index is missing")
        header = read_header(fpath)
        with open(fpath, "rb") as f:
            start = 8 + struct.unpack("<Q", f.read(8))[0]
        items = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                       key=lambda kv: kv[1]["data_offsets"][0])
        for k, v in items:
            out[k] = TensorEntry(k, fname, v["dtype"], tuple(v["shape"]), start + v["data_offsets"][0])
    return out


class LazyCheckpoint:
    """Reads single tensors from a checkpoint folder on demand.

    Plain positioned reads rather than a memory map: mapped pages stay resident (and count in
    the process's memory) long after a tensor is written out, reads are freed with the tensor.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.index = checkpoint_index(folder)
        self._fds: dict[str, int] = {}

    def keys(self) -> list[str]:
        return list(self.index)

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def _fd(self, e: TensorEntry) -> int:
        if e.file not in self._fds:
            self._fds[e.file] = os.open(self.folder / e.file, os.O_RDONLY)
        return self._fds[e.file]

    def elements(self, key: str, positions: Iterable[int]) -> torch.Tensor:
        """Chosen flat elements of `key`, one small read each (a fingerprint samples 256 values
        of every tensor: reading whole tensors for that would read the checkpoint twice)."""
        e = self.index[key]
        size = torch.empty((), dtype=DTYPES[e.dtype]).element_size()
        fd, chunks = self._fd(e), []
        for p in positions:
            b = os.pread(fd, size, e.offset + p * size)
            if len(b) != size:
                raise UsageError(f"{self.folder / e.file}: truncated while reading {key}")
            chunks.append(b)
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=DTYPES[e.dtype]) if chunks \
            else torch.empty(0, dtype=DTYPES[e.dtype])

    def __getitem__(self, key: str) -> torch.Tensor:
        e = self.index[key]
        fd = self._fd(e)
        buf = bytearray(e.nbytes)
        view, done = memoryview(buf), 0
        while done < e.nbytes:
            n = os.preadv(fd, [view[done:]], e.offset + done)
            if n <= 0:
                raise UsageError(f"{self.folder / e.file}: truncated while reading {key}")
            done += n
        if not buf:
            return torch.empty(e.shape, dtype=DTYPES[e.dtype])
        return torch.frombuffer(buf, dtype=DTYPES[e.dtype]).reshape(e.shape)

    def raw(self, key: str) -> RawTensor:
        """`key` as a pass-through handle (bytes copied file to file by the writer)."""
        e = self.index[key]
        return RawTensor(self.folder / e.file, e)

    def get_many(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        return {k: self[k] for k in keys}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def _header_bytes(entries: list[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str] | None) -> tuple[bytes, list[int]]:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    sizes = []
    for name, dtype, shape in entries:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=DTYPES[dtype]).element_size()
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        sizes.append(nbytes)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw, sizes


def tensor_bytes(t: torch.Tensor):
    """The raw bytes of `t` as a buffer (a view, no copy, for contiguous CPU tensors)."""
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclass(frozen=True)
class RawTensor:
    """A tensor passed through unchanged: its bytes are copied file to file, never loaded."""

    path: Path
    entry: TensorEntry


def copy_raw(dst, raw: RawTensor, chunk: int = 64 * 2**20) -> None:
    """Copy a tensor's bytes from its source file into `dst` (kernel copy where available)."""
    with open(raw.path, "rb") as src:
        left, off = raw.entry.nbytes, raw.entry.offset
        dst.flush()
        while left > 0:
            n = min(chunk, left)
            try:
                done = os.copy_file_range(src.fileno(), dst.fileno(), n, off)
            except (AttributeError, OSError):
                src.seek(off)
                done = dst.write(src.read(n))
            if done <= 0:
                raise UsageError(f"{raw.path}: truncated while copying {raw.entry.name}")
            left -= done
            off += done


def write_streaming(path: str | os.PathLike, entries: list[tuple[str, str, tuple[int, ...]]],
                    produce: Callable[[str], torch.Tensor], metadata: Mapping[str, str] | None = None,
                    fsync: bool = True) -> int:
    """Write one safetensors file whose tensors `produce(name)` makes one at a time; returns bytes.

    fsync=False leaves the flush to disk to the caller (write_checkpoint_streaming overlaps it
    with the next shard)."""
    head, sizes = _header_bytes(entries, metadata)
    written = len(head)
    with open(path, "wb") as f:
        f.write(head)
        for (name, dtype, shape), nbytes in zip(entries, sizes):
            t = produce(name)
            if isinstance(t, RawTensor):
                if t.entry.dtype != dtype or tuple(t.entry.shape) != tuple(shape):
                    raise RuntimeError(f"{name}: passed through as {t.entry.dtype}{t.entry.shape}, planned {dtype}{shape}")
                copy_raw(f, t)
                written += nbytes
                continue
            if tuple(t.shape) != tuple(shape) or DTYPE_NAMES.get(t.dtype) != dtype:
                raise RuntimeError(f"{name}: produced {DTYPE_NAMES.get(t.dtype)}{tuple(t.shape)}, "
                                   f"planned {dtype}{tuple(shape)}")
            data = tensor_bytes(t)
            assert len(data) == nbytes
            f.write(data)
            f.flush()
            written += nbytes
            del t, data
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return written


def fsync_path(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plan_shards(entries: list[tuple[str, str, tuple[int, ...]]], shard_bytes: int) -> list[list[tuple[str, str, tuple[int, ...]]]]:
    """Split tensors, in order, into shards of at most `shard_bytes` (a larger tensor gets its own)."""
    shards: list[list] = [[]]
    size = 0
    for e in entries:
        _, sizes = _header_bytes([e], None)
        if shards[-1] and size + sizes[0] > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += sizes[0]
    return shards


def shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_checkpoint_streaming(folder: str | os.PathLike, entries: list[tuple[str, str, tuple[int, ...]]],
                               produce: Callable[[str], torch.Tensor], shard_bytes: int,
                               metadata: Mapping[str, str] | None = None) -> list[str]:
    """Write a sharded checkpoint (with index when sharded) into `folder`; returns file names.

    Each finished shard is flushed to disk in a background thread while the next one is
    written (fsync releases the GIL); all flushes are done before this returns."""
    folder = Path(folder)
    shards = plan_shards(entries, shard_bytes)
    names = shard_names(len(shards))
    total = params = 0
    weight_map = {}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="headtool-fsync") as pool:
        flushes = []
        for fname, shard in zip(names, shards):
            write_streaming(folder / fname, shard, produce, metadata={"format": "pt", **(metadata or {})},
                            fsync=False)
            flushes.append(pool.submit(fsync_path, folder / fname))
            for name, dtype, shape in shard:
                weight_map[name] = fname
                total += TensorEntry(name, fname, dtype, shape).nbytes
                params += math.prod(shape)
        for done in flushes:
            done.result()
    if len(names) > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_parameters": params, "total_size": total}, "weight_map": weight_map}, indent=2))
        names.append("model.safetensors.index.json")
    return names
