"""Publishing the policy by shard: this rank's own part of the HF state, converted one tensor at a time.

The full-gather export (`MegatronLearner.policy_state_dict`, still what checkpoints use) all-gathers every expert
onto every rank and builds a full HF model on each. Publishing a version does not: the ranks of one expert-parallel
group (those of expert-data-parallel rank 0) write one shard each, `learner.trainer.publish_shards`:

    EP rank i      the routed experts it holds (`convert.local_expert_range`), shard i of EP
    EP rank 0      also every dense and replicated tensor (embedding, attention, norms, routers and their bias,
                   shared experts, dense MLPs, final norm, output layer): identical on every rank
    other ranks    (data-parallel copies of those experts) nothing

Each tensor is what `convert.megatron_to_hf` gives (the same slices, concatenations and renames) in the training
dtype, so the shards merged equal the full gather bit for bit at fp32 (bf16 training: the same bf16 values the
gather would upcast). A tied lm_head is left out, as the weight store leaves it out of a whole model (it is the
embedding). `plan()` gives names, dtypes and shapes without converting anything (the conversion run on meta
tensors); `tensors()` converts one mapping entry at a time, in the plan's order, and counts what it builds
(`stats`: expert tensors, bytes, the most bytes held at once).
"""

from __future__ import annotations

from typing import Iterator

import torch

from learner.backends.megatron import convert

Plan = list[tuple[str, torch.dtype, tuple[int, ...]]]


def shard_of(ep_rank: int, ep_size: int, expert_dp_rank: int) -> tuple[int, int]:
    """(this rank's shard index, or -1 if it writes none; the number of shards)."""
    return (ep_rank if expert_dp_rank == 0 else -1), ep_size


class PolicyShard:
    """One rank's part of the policy in HF format (a `learner.trainer.publish_shards.HFShard`)."""

    def __init__(self, params: dict[str, torch.Tensor], hf_cfg, ep_rank: int, ep_size: int,
                 expert_dp_rank: int = 0) -> None:
        self.index, self.count = shard_of(ep_rank, ep_size, expert_dp_rank)
        self.params, self.hf_cfg = params, hf_cfg
        entries = [] if self.index < 0 else [
            (kind, m, hs) for kind, m, hs in convert.hf_mapping(hf_cfg, ep_rank, ep_size)
            if ep_rank == 0 or convert.is_expert_key(hs[0])]
        # the widest dtype first (safetensors' own order keeps every tensor aligned), else the mapping's order
        self.entries = sorted(entries, key=lambda e: -params[e[1]].dtype.itemsize)
        self.stats = {"tensors": 0, "expert_tensors": 0, "bytes": 0, "peak_bytes": 0}

    def plan(self) -> Plan:
        out: Plan = []
        for kind, m, hs in self.entries:
            for h, t in zip(hs, convert.to_hf(kind, self.params[m].to("meta"), self.hf_cfg)):
                out.append((h, t.dtype, tuple(t.shape)))
        return out

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) in `plan()`'s order; one entry's tensors alive at a time (a rename is the parameter
        itself, counted in `peak_bytes` all the same)."""
        s = self.stats
        for kind, m, hs in self.entries:
            outs = convert.to_hf(kind, self.params[m], self.hf_cfg)
            held = sum(t.numel() * t.element_size() for t in outs)
            s["tensors"] += len(outs)
            s["expert_tensors"] += sum(convert.is_expert_key(h) for h in hs)
            s["bytes"] += held
            s["peak_bytes"] = max(s["peak_bytes"], held)
            yield from zip(hs, outs)
            del outs
