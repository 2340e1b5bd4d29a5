"""Memory-mapped safetensors reading and streaming writing, bfloat16 included.

The `safetensors` numpy backend has no bfloat16 and its flax backend materialises whole tensors; a 7B
checkpoint must be read slice by slice into device shards. The format is one little-endian u64 header
length, a JSON header {name: {dtype, shape, data_offsets}}, then raw bytes, so a numpy memmap gives
zero-copy views whose slices read only the pages they touch.
"""
from __future__ import annotations

import json
import os
import pathlib
import struct
import tempfile
from typing import Any, Callable, Iterable

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the path or tensor."""


class SafetensorsReader:
    """All tensors of a checkpoint directory (single file or sharded with an index), lazily mapped."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory not found: {self.directory}")
        index = self.directory / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: missing 'weight_map'")
            files = sorted(set(weight_map.values()))
        elif (self.directory / SINGLE_FILE).exists():
            files = [SINGLE_FILE]
        else:
            raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.directory}")
        self._entries: dict[str, tuple[pathlib.Path, dict[str, Any], int]] = {}
        self._maps: dict[pathlib.Path, np.memmap] = {}
        for name in files:
            path = self.directory / name
            if not path.exists():
                raise CheckpointError(f"checkpoint shard listed in the index is missing: {path}")
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            header.pop("__metadata__", None)
            for key, info in header.items():
                self._entries[key] = (path, info, 8 + size)

    def keys(self) -> list[str]:
        return sorted(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[1]["shape"])

    def _entry(self, name: str):
        if name not in self._entries:
            raise CheckpointError(f"tensor {name!r} not in checkpoint {self.directory}")
        return self._entries[name]

    def get(self, name: str) -> np.ndarray:
        """A read-only memmapped view; slicing it reads only what is sliced."""
        path, info, base = self._entry(name)
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        raw = self._maps[path][base + begin: base + end]
        return raw.view(DTYPES[info["dtype"]]).reshape(info["shape"])


def write_safetensors(
    directory: str | os.PathLike,
    tensors: Iterable[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]],
    *,
    max_shard_bytes: int = 5 * 1024**3,
    file_name: str = SINGLE_FILE,
) -> list[str]:
    """Write tensors given as (name, shape, dtype, fetch) so only one tensor is in host memory at a time.

    Shards larger checkpoints like transformers does (`model-0000i-of-0000n.safetensors` + index). Each file
    is written to a temporary name and renamed, so a crash never leaves a truncated shard under a real name.
    Another `file_name` (a PEFT adapter's) writes that one file, never sharded, and leaves any model index
    in the directory alone.
    """
    if file_name != SINGLE_FILE:
        max_shard_bytes = 2**63
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries = list(tensors)
    shards: list[list[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]]] = [[]]
    current = 0
    for entry in entries:
        nbytes = int(np.prod(entry[1], dtype=np.int64)) * np.dtype(entry[2]).itemsize
        if shards[-1] and current + nbytes > max_shard_bytes:
            shards.append([])
            current = 0
        shards[-1].append(entry)
        current += nbytes
    names = [file_name] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total = 0
    for shard_name, shard in zip(names, shards):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype, _ in shard:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = shard_name
        total += offset
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{shard_name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(struct.pack("<Q", len(blob)))
                f.write(blob)
                for name, shape, dtype, fetch in shard:
                    array = np.ascontiguousarray(fetch(), dtype=dtype)
                    if array.shape != tuple(shape):
                        raise CheckpointError(f"tensor {name!r}: fetched shape {array.shape} != declared {tuple(shape)}")
                    f.write(array.tobytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, directory / shard_name)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    index_path = directory / INDEX_FILE
    if file_name != SINGLE_FILE:
        return names
    if len(names) > 1:
        index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    elif index_path.exists():
        index_path.unlink()
    return names
