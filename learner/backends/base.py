"""The backend interface: what the generic trainer (learner.trainer) asks of the machinery that holds the models.

A backend holds the policy (and critic) and their optimizers, as `learner.trainer.step.Models` whose modules
answer learner.models.scoring's HF-style calls, so the trainer's step code runs on them unchanged. The trainer
reaches the backend as `Models.backend` and calls it for what differs between backends: where batches go, how
gradients are reduced and clipped, how weights leave (publication, checkpoints; by shard where a backend splits the
model over ranks) and come back (resume), the ranks, the checkpoint layout and the shutdown.

Imports point one way: learner.backends uses learner.trainer's pieces (Models, RankGroup, the one-process clip);
learner.trainer never imports learner.backends, it calls whatever object implements `Backend`.
Implementations: `learner.backends.torch.TorchBackend` (one process, the default) and
`learner.backends.megatron.backend.MegatronBackend`; `learner.backends.make_backend` picks one by
`cfg.backend.name`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from learner.trainer.ranks import RankGroup
from learner.trainer.step import Models


class Backend(Protocol):
    models: Models  # the trainable modules and their optimizers; models.backend is this backend
    device: torch.device  # where the trainer puts its batches
    group: RankGroup | None  # the ranks (rank, world; the leader reads, publishes, writes); None: one process
    hf_config: Any  # the policy's HF config (vocabulary size, positions: what admission checks tokens against)

    def clip_grads(self, model: torch.nn.Module, max_norm: float) -> float:
        """Reduce `model`'s gradients over the ranks, clip them to `max_norm` by their global L2 norm; return that
        norm (before clipping)."""

    def export_hf(self, name: str) -> torch.nn.Module:
        """The HF-format "policy" or "value" holding the current weights, to publish or save. A collective over
        the ranks: every rank calls it."""

    def export_shard(self, name: str) -> Any:
        """This rank's own part of "policy" in HF format, to publish a version by shard without any rank holding
        the whole model (a `learner.trainer.publish_shards.HFShard`), or None: publish the whole `export_hf`. A
        collective where the backend needs one to say which ranks write (megatron)."""
        return None

    def hf_target(self, name: str) -> torch.nn.Module:
        """An HF-format "policy" or "value" to load a checkpoint's weights into, then hand to `import_hf`."""

    def import_hf(self, name: str, model: torch.nn.Module) -> None:
        """Take `model`'s weights (an `hf_target` after loading) as the current weights of "policy" or "value"."""

    def layout(self) -> dict:
        """How the weights and optimizer state are split ({"backend", "world_size", "expert_parallel"}); saved
        with each checkpoint, which resumes only under the same layout, unless the backend reads optimizer state
        in HF naming, which any layout of it resumes: `import_optimizer(name, file, meta)` (megatron's checkpoints
        written before they went by shard: reshard.py). A backend
        with `checkpoints_by_shard` = True writes and reads checkpoints itself, each rank its part:
        `save_shards(directory, names)` and `load_shards(directory, names)`, both collectives (megatron:
        ckpt_shards.py); the trainer then writes only its own state beside them.

        At pipeline parallelism a backend sets `pipelined` = True and runs the trainer's backward passes itself:
        `scheduled_backward(kind, cfg, models, batch, ref, norm, scale)`, kind "value" or "policy", as
        learner.trainer.step's value_backward and policy_backward (megatron: pipeline_step.py)."""

    def shutdown(self) -> None:
        """Leave the ranks' process group, if any."""
