"""AdamW with its state sharded over the data-parallel ranks (ZeRO stage 1), on CPU and GPU alike.

megatron-core 0.16's DistributedOptimizer does not run on CPU: it accepts only parameters whose type() is
torch.cuda.{Float,Half,BFloat16}Tensor (distrib_optimizer.py, _build_model_and_main_param_groups raises otherwise),
its mixed-precision base allocates `found_inf` with device="cuda", and it needs megatron's DDP grad buffers. So the
backend shards the optimizer itself:

  buckets   the parameters of one kind (dense: replicated over the data-parallel group; experts: over the
            expert-data-parallel group) and dtype become views into one flat buffer, padded to a multiple of the
            group's size D; rank r owns the contiguous slice r of D.
  step      gradients are already reduced and clipped (`grads.reduce_and_clip`, unchanged); each rank runs torch's
            AdamW on its slice only (the slice is a view: the update lands in the model's weights), then the
            slices are all-gathered into every rank's buffer.
AdamW is elementwise, so the result is the unsharded AdamW's, element for element; each rank keeps 2/D of the
moments (exp_avg, exp_avg_sq) instead of 2 copies of every weight. The state dict is this rank's slices; checkpoints
save the moments whole in HF naming instead (reshard.py), so they resume sharded or not, at any layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from learner.backends.megatron.grads import is_expert_param


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor  # [D * per] every parameter of the bucket, as views
    group: object
    size: int
    rank: int
    per: int  # elements each rank owns

    def owned(self) -> torch.Tensor:
        return self.flat[self.rank * self.per:(self.rank + 1) * self.per]


def _bucket(params: list[torch.nn.Parameter], group) -> _Bucket:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    n = sum(p.numel() for p in params)
    per = -(-n // size)
    flat = torch.zeros(per * size, dtype=params[0].dtype, device=params[0].device)
    offsets, off = [], 0
    for p in params:
        flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
        p.data = flat[off:off + p.numel()].view_as(p)  # the weight now lives in the flat buffer
        offsets.append(off)
        off += p.numel()
    return _Bucket(params, offsets, flat, group, size, rank, per)


class ShardedAdamW(torch.optim.AdamW):
    """torch AdamW over this rank's slices of the model's weights (see the module docstring)."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], lr: float, betas=(0.9, 0.999),
                 weight_decay: float = 0.0, eps: float = 1e-8):
        from megatron.core import parallel_state as ps

        groups = {False: ps.get_data_parallel_group(), True: ps.get_expert_data_parallel_group()}
        kinds: dict[tuple[bool, torch.dtype], list[torch.nn.Parameter]] = {}
        for name, p in named_params:
            kinds.setdefault((is_expert_param(name), p.dtype), []).append(p)
        self.buckets = [_bucket(ps_, groups[expert]) for (expert, _), ps_ in sorted(kinds.items(), key=str)]
        self.model_params = [p for b in self.buckets for p in b.params]
        # the owned slices, as parameters sharing the buckets' storage
        super().__init__([torch.nn.Parameter(b.owned(), requires_grad=True) for b in self.buckets], lr=lr,
                         betas=tuple(betas), weight_decay=weight_decay, eps=eps)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
        super().zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self, closure=None):
        masters = self.param_groups[0]["params"]
        for b, m in zip(self.buckets, masters):
            m.grad = self._owned_grad(b)
        loss = super().step(closure)
        for b in self.buckets:
            if b.size > 1:
                mine = b.owned().clone()
                dist.all_gather(list(b.flat.split(b.per)), mine, group=b.group)
        return loss

    @staticmethod
    def _owned_grad(b: _Bucket) -> torch.Tensor:
        lo_own = b.rank * b.per
        g = torch.zeros(b.per, dtype=b.flat.dtype, device=b.flat.device)
        for p, off in zip(b.params, b.offsets):
            lo, hi = max(off, lo_own), min(off + p.numel(), lo_own + b.per)
            if lo < hi and p.grad is not None:
                g[lo - lo_own:hi - lo_own] = p.grad.reshape(-1)[lo - off:hi - off]
        return g


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors this rank holds (moments; step counters included)."""
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
