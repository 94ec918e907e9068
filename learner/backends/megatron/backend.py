"""The megatron backend: a `MegatronLearner` behind the trainer's `learner.backends.base.Backend` interface.

The trainer's step code drives the learner's GPTModels through the HF-call wrappers (`hf_compat`) and steps the
learner's own AdamWs. What differs from the torch backend: gradients are all-reduced over data and expert
parallelism before the clip (`grads.reduce_and_clip`), weights leave and come back in HF format through the
learner's converters (exporting gathers the experts: a collective; a published version is written by shard, each
rank its own part, `export_shard`), every rank is one member of a `RankGroup`,
and shutting down leaves the process group (`parallel.shutdown`).

The learner is handed in built (learner.backends.megatron.learner.megatron_backend builds both), so this module
needs only the learner's methods, not its module.
"""

from __future__ import annotations

import os

import torch

from learner.backends.base import Backend
from learner.backends.megatron import ckpt_shards, grads, parallel, pipeline_step, reshard
from learner.backends.megatron.hf_compat import HFCompatPolicy, HFCompatValue
from learner.trainer.ranks import RankGroup
from learner.trainer.step import Models
from streamer.wire.config import ConfigError


class MegatronBackend(Backend):
    """The Backend over a MegatronLearner `lrn` (built on every rank)."""

    def __init__(self, lrn) -> None:
        self.lrn = lrn
        self.device, self.hf_config = lrn.device, lrn.hf_config
        self.group = RankGroup(lrn.device, dp=(lrn.layout["dp_rank"], lrn.layout["dp"]))
        tp_pp = lrn.layout["tp"], lrn.layout["pp"]
        self.pipelined = tp_pp[1] > 1  # the trainer's backward passes go through `scheduled_backward`
        value = HFCompatValue(lrn.value, lrn.device, *tp_pp) if lrn.value is not None else None
        self.models = Models(HFCompatPolicy(lrn.policy, lrn.device, *tp_pp), lrn.opt, value,
                             lrn.value_opt if value is not None else None, backend=self)

    def scheduled_backward(self, kind: str, cfg, models: Models, batch, ref: dict, norm, scale: float) -> dict:
        """learner.trainer.step's value_backward / policy_backward at pipeline parallelism (pipeline_step)."""
        model = self.lrn.value if kind == "value" else self.lrn.policy
        model.train()
        return pipeline_step.scheduled_backward(kind, cfg, model, batch, ref, norm, scale, self.lrn.layout["tp"])

    def clip_grads(self, model: torch.nn.Module, max_norm: float) -> float:
        return float(grads.reduce_and_clip(model, max_norm))

    def export_hf(self, name: str) -> torch.nn.Module:
        return self.lrn.export_hf_policy() if name == "policy" else self.lrn.export_hf_value()

    def export_shard(self, name: str):
        return self.lrn.policy_shard() if name == "policy" else None

    def hf_target(self, name: str) -> torch.nn.Module:
        return self.lrn.empty_hf_policy() if name == "policy" else self.lrn.empty_hf_value()

    def import_hf(self, name: str, model: torch.nn.Module) -> None:
        if name == "policy":
            self.lrn.load_hf_policy(model)
        else:
            self.lrn.load_hf_value(model)

    def import_optimizer(self, name: str, file, meta: dict) -> None:
        """The AdamW state of a checkpoint written before checkpoints went by shard (one HF-named file, reshard.py)."""
        reshard.load(self.lrn, name, file, meta)

    checkpoints_by_shard = True  # the trainer calls these instead of export_hf

    def save_shards(self, directory, names: list[str]) -> None:
        """Each rank's part of the weights and AdamW moments into a checkpoint directory (ckpt_shards)."""
        ckpt_shards.save(self.lrn, directory, names, self.group.leader)

    def load_shards(self, directory, names: list[str]) -> None:
        ckpt_shards.load(self.lrn, directory, names)

    def layout(self) -> dict:
        o = self.lrn.options
        # the keys earlier checkpoints lack appear only when set (their optimizer files hold other shapes)
        extra = {k: getattr(o, k) for k in ("tensor_parallel", "pipeline_parallel") if getattr(o, k) != 1}
        extra.update({"shard_optimizer": True} if o.shard_optimizer else {})
        return {"backend": "megatron", "world_size": self.group.world, "expert_parallel": o.expert_parallel, **extra}

    def shutdown(self) -> None:
        parallel.shutdown()


def check_expert_parallel(expert_parallel: int, num_experts: int, source: str) -> None:
    """ConfigError unless `expert_parallel` divides the world size (torchrun's WORLD_SIZE) and the experts of the
    policy read from `source`; checked before joining the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % expert_parallel:
        raise ConfigError(f"LearnerConfig.backend.expert_parallel: {expert_parallel} does not divide the world "
                          f"size {world}; launch a multiple of it (--nproc / torchrun --nproc_per_node)")
    if num_experts % expert_parallel:
        raise ConfigError(f"LearnerConfig.backend.expert_parallel: {expert_parallel} does not divide the "
                          f"{num_experts} experts of the policy ({source}); use a divisor of it")
