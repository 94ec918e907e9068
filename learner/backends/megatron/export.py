"""Publishing the policy (and checkpointing either model) by shard: this rank's own part of the HF state, converted
one tensor at a time.

The full-gather export (`MegatronLearner.policy_state_dict`, `export_hf_policy`) all-gathers every expert, every
tensor-parallel slice and every pipeline stage onto every rank and builds a full HF model on each. Publishing a
version does not (`learner.trainer.publish_shards`), nor does a checkpoint (`ckpt_shards.py`, which walks the same
way over the weights and the AdamW moments): each rank writes the tensors it owns, whole, into its own shard file,
and no rank ever holds more than one whole tensor beyond its own slices.

    dense tensors    (embedding, attention, norms, routers and their bias, shared experts, dense MLPs, final norm,
                     output layer) of this rank's pipeline stage: written by the ranks of data-parallel rank 0;
                     entry i of the stage's list by TP rank i % TP, which gathers the TP slices (`tp.merge`) of a
                     split tensor from its TP group (one `gather` to it, the others send their slice)
    routed experts   this EP rank's experts on its stage: written by the ranks of expert-data-parallel rank 0;
                     entry j by expert-TP rank j % ETP, as above over the expert-TP group
    other ranks      (data-parallel copies) nothing

The ranks of one TP group walk the same list in the same order (dense first, then experts: a group never waits on
another group's collective), so the gathers pair up; a rank walks the whole list even past its last tensor
(`write_safetensors` asks for one tensor more than planned, which runs the rest of the walk). Each tensor is what
`convert.megatron_to_hf` gives (the same slices, concatenations and renames) in the training dtype, so the shards
merged equal the full gather bit for bit at fp32 (bf16 training: the same bf16 values the gather would upcast). A
tied lm_head is left out, as the weight store leaves it out of a whole model (it is the embedding), and so is a
last stage's copy of it. `plan()` gives names, dtypes and shapes without converting anything (the conversion run on
meta tensors); `tensors()` converts one entry at a time, in the plan's order, and counts what it builds (`stats`).
"""

from __future__ import annotations

from typing import Iterator

import torch

from learner.backends.megatron import convert, tp

Plan = list[tuple[str, torch.dtype, tuple[int, ...]]]
Entry = tuple[str, str, tuple[str, ...]]  # convert's (kind, megatron name, HF names)


def value_entries(hf_cfg, layout: dict[str, int], stage) -> list[Entry]:
    """The critic's entries: its backbone (megatron names under `backbone.`, HF under `backbone.`) and, on the last
    stage, the head (its norm is the HF backbone's final norm)."""
    out = [(k, "backbone." + m, hs) for k, m, hs in convert.hf_mapping(hf_cfg, layout["ep_rank"], layout["ep"],
                                                                       "backbone.", False, stage)]
    if stage is None or stage.last:
        out += [(convert.RENAME, "value_head.norm.weight", ("backbone.norm.weight",)),
                (convert.RENAME, "value_head.head.weight", ("head.weight",)),
                (convert.RENAME, "value_head.head.bias", ("head.bias",))]
    return out


def is_writer(layout: dict[str, int]) -> bool:
    """Whether this rank writes a shard: it holds the dense tensors of replica 0, or experts of expert replica 0."""
    return layout["dp_rank"] == 0 or layout["edp_rank"] == 0


def walk(entries: list[Entry], params: dict[str, torch.Tensor],
         layout: dict[str, int]) -> list[tuple[Entry, int, bool]]:
    """(entry, the TP (expert: expert-TP) rank that writes it, expert) in the order every rank of a TP group visits
    them: dense entries first (replica 0 only), then experts (expert replica 0 only), each widest dtype first
    (safetensors' own order keeps every tensor aligned), else the mapping's order."""
    entries = [e for e in entries if e[0] != convert.TIED]
    out = []
    for expert, size, mine in ((False, layout["tp"], layout["dp_rank"] == 0),
                               (True, layout["etp"], layout["edp_rank"] == 0)):
        part = [e for e in entries if convert.is_expert_key(e[2][0]) == expert] if mine else []
        part.sort(key=lambda e: -params[e[1]].dtype.itemsize)
        out += [(e, i % size, expert) for i, e in enumerate(part)]
    return out


def _split(name: str, expert: bool, layout: dict[str, int]) -> int:
    """The number of TP slices tensor `name` is cut into (1: whole on every rank of its group)."""
    size = layout["etp"] if expert else layout["tp"]
    return 1 if tp.rule(name) is None else size


def _my_rank(expert: bool, layout: dict[str, int]) -> int:
    return layout["etp_rank"] if expert else layout["tp_rank"]


def _whole(name: str, t: torch.Tensor, owner: int, expert: bool, layout: dict[str, int]) -> torch.Tensor | None:
    """Tensor `name` whole on its TP group's rank `owner`, None on the others (a collective over the group when
    the tensor is cut; nothing to do otherwise)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mine, size = owner == _my_rank(expert, layout), _split(name, expert, layout)
    if size == 1:
        return t if mine else None
    group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(size)] if mine else None
    dist.gather(t.contiguous(), parts, dst=dist.get_global_rank(group, owner), group=group)
    return tp.merge(name, parts) if mine else None


class PolicyShard:
    """One rank's part of the policy in HF format (a `learner.trainer.publish_shards.HFShard`): `params` are this
    rank's megatron tensors (its TP slices, its experts, its stage's layers; or tensors named and shaped as them,
    its AdamW moments), `shard` (index or -1, count); `entries` another model's (`value_entries`)."""

    def __init__(self, params: dict[str, torch.Tensor], hf_cfg, layout: dict[str, int], stage,
                 shard: tuple[int, int], entries: list[Entry] | None = None) -> None:
        self.index, self.count = shard
        self.params, self.hf_cfg, self.layout = params, hf_cfg, layout
        if entries is None:  # the policy's
            entries = convert.hf_mapping(hf_cfg, layout["ep_rank"], layout["ep"], stage=stage)
        self.walk = walk(entries, params, layout) if self.index >= 0 else []
        self.stats = {"tensors": 0, "expert_tensors": 0, "bytes": 0, "peak_bytes": 0}

    def _meta(self, m: str, expert: bool) -> torch.Tensor:
        return tp.merge(m, [self.params[m].to("meta")] * _split(m, expert, self.layout))

    def plan(self) -> Plan:
        out: Plan = []
        for (kind, m, hs), owner, expert in self.walk:
            if owner == _my_rank(expert, self.layout):
                out += [(h, t.dtype, tuple(t.shape)) for h, t in zip(hs, convert.to_hf(kind, self._meta(m, expert),
                                                                                          self.hf_cfg))]
        return out

    def whole_bytes(self) -> int:
        """The largest whole megatron tensor of this rank's walk (what one entry may hold at once)."""
        sizes = [self._meta(m, ex).numel() * self.params[m].element_size() for (_, m, _), _, ex in self.walk]
        return max(sizes, default=0)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) in `plan()`'s order; one entry's tensors alive at a time (a rename is the parameter
        itself, counted in `peak_bytes` all the same). Walks every entry, joining the gathers of those it does
        not write."""
        s = self.stats
        for (kind, m, hs), owner, expert in self.walk:
            whole = _whole(m, self.params[m], owner, expert, self.layout)
            if whole is None:
                continue
            outs = convert.to_hf(kind, whole, self.hf_cfg)
            held = sum(t.numel() * t.element_size() for t in outs)
            s["tensors"] += len(outs)
            s["expert_tensors"] += sum(convert.is_expert_key(h) for h in hs)
            s["bytes"] += held
            gathered = whole is not self.params[m] and kind != convert.RENAME  # held beside its HF tensors
            s["peak_bytes"] = max(s["peak_bytes"], held + (whole.numel() * whole.element_size() if gathered else 0))
            yield from zip(hs, outs)
            del outs, whole
