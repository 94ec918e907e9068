"""Gradient reduction over data parallelism with expert parallelism, without Megatron's DDP.

Objective: the mean over the W data-parallel ranks of each rank's local loss, L = (1/W) sum_r L_r
(megatron's convention). After a local backward of L_r:
  dense parameter (replicated on all W ranks): its grad is dL_r/dtheta; dL/dtheta = (1/W) sum_r,
    an all-reduce over the data-parallel group divided by W.
  expert parameter (one copy per expert-data-parallel group of W / EP ranks): the alltoall's
    backward already brought every rank's tokens' contributions, so its local grad is
    sum over the EP ranks of dL_r/dtheta; the remaining sum is over the expert-data-parallel
    group, and the divisor is again W (not the size of that group).
Megatron's DDP applies the same factors (gradient_scaling_factor = 1/W for both kinds).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


def allreduce_grads(named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
    """In place: every grad becomes d((1/W) sum_r L_r)/dtheta (see the module docstring)."""
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    groups = {False: ps.get_data_parallel_group(), True: ps.get_expert_data_parallel_group()}
    for expert in (False, True):
        grads = [p.grad for n, p in named_params if p.grad is not None and is_expert_param(n) == expert]
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective per kind
        if dist.get_world_size(groups[expert]) > 1:
            dist.all_reduce(flat, group=groups[expert])
        flat.div_(world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def global_grad_norm(named_params: list[tuple[str, torch.nn.Parameter]]) -> float:
    """L2 norm of the full model's gradient (each expert counted once), after `allreduce_grads`."""
    from megatron.core import parallel_state as ps

    dense = sum(float(p.grad.double().pow(2).sum()) for n, p in named_params
                if p.grad is not None and not is_expert_param(n))
    device = named_params[0][1].device  # NCCL reduces device tensors only
    expert = torch.tensor([sum(float(p.grad.double().pow(2).sum()) for n, p in named_params
                               if p.grad is not None and is_expert_param(n))],
                          dtype=torch.float64, device=device)
    if ps.get_expert_model_parallel_world_size() > 1:
        dist.all_reduce(expert, group=ps.get_expert_model_parallel_group())
    return math.sqrt(dense + float(expert))


def clip_grads(named_params: list[tuple[str, torch.nn.Parameter]], max_norm: float) -> float:
    """Scale all grads so the global norm is at most `max_norm` (as torch's clip_grad_norm_)."""
    norm = global_grad_norm(named_params)
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for _, p in named_params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def reduce_and_clip(module: torch.nn.Module, max_norm: float | None) -> float:
    """`allreduce_grads`, then clip to `max_norm` (None: no clip); returns the global norm."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    allreduce_grads(named)
    return clip_grads(named, max_norm) if max_norm else global_grad_norm(named)
