"""Megatron checkpoints written and read by shard: no rank gathers the model to save it or reads it whole to resume.

Each rank writes, into the checkpoint's temporary directory (shared by the ranks, as `checkpoint.dir` is), its own
part of each model's weights and of each AdamW moment, in HF naming, as publishing writes a version
(`export.PolicyShard`: its experts, its stage's layers, every TP-th dense tensor gathered to it alone):

    <model>.weights.<i>-of-<n>.safetensors       the weights (model: policy, value)
    <model>.exp_avg.<i>-of-<n>.safetensors       AdamW's first moment (none before the first step)
    <model>.exp_avg_sq.<i>-of-<n>.safetensors    its second moment
    optim_<model>.hf.json                        AdamW's step and settings (rank 0; reshard.meta_of)

The trainer seals the directory (a sha256 per file) and renames it as any checkpoint. On resume each rank opens the
shard files lazily (`ShardedFiles`: names from the headers) and reads only the tensors its layout needs, cut as the
weights are cut (`hf_to_megatron`, `tp.shard_state`, its ZeRO slice): any TP, PP, EP and world size resumes it, as
the layout-free format of reshard.py, which a checkpoint written before this still uses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from learner.backends.megatron import reshard
from learner.backends.megatron.model import megatron_params

_CHUNK = 1 << 30  # the manifest chunk the writer hashes in; the checkpoint's seal hashes each whole file anyway


def shard_file(directory: Path, name: str, kind: str, index: int, count: int) -> Path:
    return directory / f"{name}.{kind}.{index + 1:05d}-of-{count:05d}.safetensors"


def _write(path: Path, shard) -> None:
    """`shard`'s tensors into `path`; on a failure the walk still runs to its end (its gathers pair up with the
    other ranks'), then the error is raised."""
    from streamer.transport.weight_shards import write_safetensors

    tensors = shard.tensors()
    try:
        write_safetensors(path, shard.plan(), tensors, _CHUNK)
    except BaseException:
        for _ in tensors:
            pass
        raise


def save(lrn, directory: Path, names: list[str], leader: bool) -> None:
    """Every rank's part of `names`' weights and AdamW moments into `directory`; a collective over the world."""
    for name in names:
        module, opt = reshard._module_opt(lrn, name)
        moments, step = reshard.whole_moments(module, opt)
        for kind, tensors in [("weights", megatron_params(module)), *(moments.items() if step else [])]:
            shard = lrn.shard_of(name, tensors)
            if shard.index >= 0:
                _write(shard_file(directory, name, kind, shard.index, shard.count), shard)
        if leader:
            (directory / f"optim_{name}.hf.json").write_text(json.dumps(reshard.meta_of(opt, step)))


class ShardedFiles(Mapping):
    """HF name -> tensor over the files `<stem>.*-of-*.safetensors` of a directory, each read when asked for."""

    def __init__(self, directory: Path, stem: str) -> None:
        from safetensors import safe_open

        self.files = {f: safe_open(str(f), framework="pt") for f in sorted(Path(directory).glob(f"{stem}.*-of-*"))}
        self.where = {k: f for f, h in self.files.items() for k in h.keys()}

    def __getitem__(self, k: str):
        return self.files[self.where[k]].get_tensor(k)

    def __contains__(self, k) -> bool:
        return k in self.where

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def load(lrn, directory: Path, names: list[str]) -> None:
    """`names`' weights and AdamW state from a checkpoint written by `save`, cut for this rank's layout."""
    for name in names:
        weights = ShardedFiles(directory, f"{name}.weights")
        if not weights:
            raise FileNotFoundError(f"{directory}: no {name}.weights shards; was it saved with a value model?")
        lrn.load_hf_tensors(name, weights)
        meta = json.loads((Path(directory) / f"optim_{name}.hf.json").read_text())
        reshard.load_from(lrn, name, {mom: ShardedFiles(directory, f"{name}.{mom}") for mom in reshard.MOMENTS},
                          meta)
