"""Writing a sharded version into the weight store: each rank its own shard, then one commit.

The format and what its announced sha256 covers are in `streamer.transport.weights` (`model-0000i-of-0000N.
safetensors` + `model.safetensors.index.json`, `weights_digest`). A version is written in three moves, by ranks that
share the store's directory (as they share `checkpoint.dir`):

    staging = begin(store, version)                       # rank 0: an empty `.v000123.tmp<pid>` in the store
    write_shard(staging, i, n, plan, tensors, chunk_bytes) # each writing rank, into `staging`, shard i of n
    pv = commit(store, staging, version, step, n, side)    # rank 0, once every shard is written (a barrier)

`write_shard` streams the tensors into a rank-local temporary file (`.model-....part<pid>`), hashing each
manifest chunk as it goes: the header is written first from the `plan` (name, dtype, shape of each tensor), then each
tensor's bytes as the iterator yields it, so a rank holds one converted tensor at a time, never its whole shard.
The file is renamed to its shard name once complete, beside a small `.model-....json` (its manifest entry and
tensor names) that `commit` reads: the index, the manifest (shards, index, config and tokenizer files), policy.json,
then the rename of the staging directory to `v000123`. Readers never see a version before that rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import msgspec

from streamer.transport.weights import (
    INDEX_FILE,
    Manifest,
    ManifestFile,
    WeightStore,
    install,
    manifest_entry,
    shard_name,
    side_files,
    weights_digest,
)
from streamer.wire.schema import PolicyVersion

_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
           "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}

Plan = list[tuple[str, Any, tuple[int, ...]]]  # (tensor name, torch dtype, shape) in the order they are written


class ChunkHasher:
    """The sha256 of a stream, whole and by `chunk_bytes` chunks (a `ManifestFile`), fed in pieces of any size."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes, self.size, self.chunks = chunk_bytes, 0, []
        self.whole, self.part, self.fill = hashlib.sha256(), hashlib.sha256(), 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.whole.update(view)
        self.size += len(view)
        while len(view):
            take = min(self.chunk_bytes - self.fill, len(view))
            self.part.update(view[:take])
            self.fill, view = self.fill + take, view[take:]
            if self.fill == self.chunk_bytes:
                self.chunks.append(self.part.hexdigest())
                self.part, self.fill = hashlib.sha256(), 0

    def entry(self, name: str) -> ManifestFile:
        chunks = self.chunks + ([self.part.hexdigest()] if self.fill else [])
        return ManifestFile(name=name, size=self.size, sha256=self.whole.hexdigest(), chunks=chunks)


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"weight shards: dtype {dtype} has no safetensors name")
    return _DTYPES[name]


def header(plan: Plan) -> bytes:
    """The safetensors header of `plan` (8-byte length, JSON, padded with spaces to 8 bytes), tensors back to back
    in plan order."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in plan:
        n = dtype.itemsize * _numel(shape)
        meta[name] = {"dtype": _dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, plan: Plan, tensors: Iterable[tuple[str, Any]], chunk_bytes: int) -> ManifestFile:
    """Stream `tensors` (name, CPU tensor: exactly `plan`, in its order) into the safetensors file `path`; its
    manifest entry. Each tensor's bytes go to the file as they are (no copy of the shard is ever assembled)."""
    import torch

    hasher = ChunkHasher(chunk_bytes)
    it: Iterator[tuple[str, Any]] = iter(tensors)
    with open(path, "wb") as f:
        head = header(plan)
        f.write(head)
        hasher.update(head)
        for name, dtype, shape in plan:
            got, t = next(it, (None, None))
            if got != name or t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"weight shards: {path.name} planned {name} {dtype} {tuple(shape)}, got {got} "
                                 f"{None if t is None else (t.dtype, tuple(t.shape))}")
            raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(raw)
            hasher.update(raw)
        if next(it, None) is not None:
            raise ValueError(f"weight shards: {path.name}: more tensors than planned")
    return hasher.entry(path.name)


def begin(store: WeightStore, version: int) -> Path:
    """An empty staging directory for `version` inside the store (rank 0)."""
    staging = store.root / f".{store.path_of(version).name}.tmp{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _sidecar(staging: Path, name: str) -> Path:
    return staging / f".{name.removesuffix('.safetensors')}.json"


def write_shard(staging: Path, index: int, count: int, plan: Plan, tensors: Iterable[tuple[str, Any]],
                chunk_bytes: int) -> ManifestFile:
    """Shard `index` of `count` into `staging`: streamed to a rank-local temporary file, renamed when complete,
    its manifest entry and tensor names beside it for `commit`."""
    name = shard_name(index, count)
    tmp = staging / f".{name}.part{os.getpid()}"
    try:
        entry = write_safetensors(tmp, plan, tensors, chunk_bytes)
        os.replace(tmp, staging / name)
    finally:
        tmp.unlink(missing_ok=True)
    entry = ManifestFile(name=name, size=entry.size, sha256=entry.sha256, chunks=entry.chunks)
    total = sum(dtype.itemsize * _numel(shape) for _, dtype, shape in plan)
    side = {"entry": msgspec.to_builtins(entry), "tensors": [n for n, _, _ in plan], "bytes": total}
    _sidecar(staging, name).write_text(json.dumps(side))
    return entry


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def commit(store: WeightStore, staging: Path, version: int, step: int, count: int,
           side_files_from: str | Path | None = None) -> PolicyVersion:
    """After every shard is in `staging` (rank 0): the index, side files, manifest and policy.json, then the rename
    to the version's directory; the version's announcement (its sha256: `weights_digest`)."""
    entries, weight_map, total = [], {}, 0
    for i in range(count):
        name = shard_name(i, count)
        side_file = _sidecar(staging, name)
        if not (staging / name).is_file() or not side_file.is_file():
            raise FileNotFoundError(f"weight shards: {staging / name} was not written (is the store shared by "
                                    f"every rank?)")
        side = json.loads(side_file.read_text())
        side_file.unlink()
        entries.append(msgspec.convert(side["entry"], ManifestFile))
        for tensor in side["tensors"]:
            if weight_map.setdefault(tensor, name) != name:
                raise ValueError(f"weight shards: tensor {tensor} is in {weight_map[tensor]} and {name}")
        total += side["bytes"]
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                       indent=2).encode()
    (staging / INDEX_FILE).write_bytes(index)
    entries.append(manifest_entry(INDEX_FILE, index, store.chunk_bytes))
    weights = [e.name for e in entries]
    files = list(entries)
    for src in side_files(side_files_from) if side_files_from else ():
        shutil.copyfile(src, staging / src.name)
        files.append(manifest_entry(src.name, (staging / src.name).read_bytes(), store.chunk_bytes))
    final = store.path_of(version)
    uri = f"{store.base_uri}/{final.name}" if store.base_uri else str(final.resolve())
    pv = PolicyVersion(version=version, uri=uri, sha256=weights_digest(entries), step=step, created_at=time.time())
    manifest = Manifest(version=version, step=step, sha256=pv.sha256, chunk_bytes=store.chunk_bytes, files=files,
                        weights=weights)
    return install(staging, final, manifest, pv)


def abort(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)
