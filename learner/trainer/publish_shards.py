"""Publishing a version by shard over the ranks (the megatron backend): no rank holds the whole model.

Every rank calls `publish_sharded` (a collective), with its backend's `export_shard("policy")` (an `HFShard`: its
own part of the HF state, converted tensor by tensor); the leader also passes its `DirectoryPublisher`, whose store
the ranks share (as they share `checkpoint.dir`: each writes into it). The moves
(`streamer.transport.weight_shards`):

    leader        an empty staging directory for the version in the store; its path and the manifest's chunk size
                  go to every rank
    each writer   its shard streamed into the staging directory (a rank-local temporary file, renamed when
                  complete); non-finite weights refuse the version, as `DirectoryPublisher.publish` does
    all ranks     agree that every shard was written (`RankGroup.all_true`, a barrier); if one failed, the leader
                  removes the staging directory and every rank raises
    leader        the index, config.json, the tokenizer, the manifest and policy.json, the rename to `v000123`;
                  then it prunes and announces the version (its sha256: the digest of the shards and index)

A broadcast hook on the publisher is not called for a sharded version (the leader never holds the whole state
dict); agents in the broadcast group pull it from the weight server.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch

from learner.trainer.ranks import RankGroup
from streamer.transport import weight_shards
from streamer.wire.schema import PolicyVersion

log = logging.getLogger(__name__)
_WARNED: set[int] = set()  # publishers told once that their broadcast hook is not used


class HFShard(Protocol):
    index: int  # this rank's shard (0-based), or -1: it writes none
    count: int  # shards in the version

    def plan(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(HF name, dtype, shape) of each tensor of the shard, in the order `tensors` yields them."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor), converted as they are asked for."""


def _finite(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in tensors:
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise FloatingPointError(f"parameter {name} holds non-finite values: refusing to publish it")
        yield name, t


def publish_sharded(publisher: Any, shard: HFShard, hf_config: Any, version: int, step: int,
                    group: RankGroup) -> PolicyVersion | None:
    """Write version `version` by shard and, on the leader, commit and announce it; the announcement on the leader,
    None elsewhere. `publisher`: the leader's `DirectoryPublisher` (None on the other ranks)."""
    staging = ""
    if group.leader:
        staging = str(weight_shards.begin(publisher.store, version).resolve())
    staging_dir = Path(group.share_text(staging))
    chunk_bytes = group.share_int(publisher.store.chunk_bytes if group.leader else 0)
    error = ""
    if shard.index >= 0:
        try:
            weight_shards.write_shard(staging_dir, shard.index, shard.count, shard.plan(), _finite(shard.tensors()),
                                      chunk_bytes)
        except (OSError, ValueError, FloatingPointError) as e:
            error = f"rank {group.rank}, shard {shard.index + 1} of {shard.count}: {type(e).__name__}: {e}"
            log.error("publishing v%d: %s", version, error)
    if not group.all_true(not error):
        if group.leader:
            weight_shards.abort(staging_dir)
        raise RuntimeError(f"publishing v{version} by shard failed ({error or 'on another rank'}); nothing was "
                           f"published")
    pv, error = None, ""
    if group.leader:
        try:
            with tempfile.TemporaryDirectory() as side:  # config.json + tokenizer travel with the weights
                hf_config.save_pretrained(side)
                publisher.tokenizer.save(side)
                pv = weight_shards.commit(publisher.store, staging_dir, version, step, shard.count, side)
        except (OSError, ValueError) as e:
            weight_shards.abort(staging_dir)
            error = f"the commit on rank 0: {type(e).__name__}: {e}"
    if not group.all_true(not error):  # every rank stops together rather than wait at the next collective
        raise RuntimeError(f"publishing v{version} by shard failed ({error or 'on rank 0'}); nothing was published")
    if pv is not None:
        if getattr(publisher, "broadcast", None) is not None and id(publisher) not in _WARNED:
            _WARNED.add(id(publisher))
            log.warning("io.weights_transport=broadcast: versions published by shard are not broadcast (rank 0 "
                        "never holds the whole model); agents pull them from the weight server")
        publisher.store.prune(publisher.keep)
        if publisher.announcer is not None:
            publisher.announcer(pv)
    return pv
