"""Gradient reduction over data, tensor and expert parallelism, without Megatron's DDP.

Objective: the mean over the D data-parallel replicas of each replica's loss, L = (1/D) sum_d L_d
(megatron's convention; the TP ranks of one replica compute the same L_d). After a local backward:
  TP-replicated weight under sequence parallelism (norms, routers: each TP rank saw only its slice of
    the sequence), and q/k norms (shared by the heads, each TP rank holds some heads): partial sums,
    summed over the TP group first (megatron's finalize_model_grads does the same).
  dense parameter (one copy per data-parallel replica): its grad is dL_d/dtheta; dL/dtheta = (1/D) sum_d,
    an all-reduce over the data-parallel group divided by D.
  expert parameter (one copy per expert-data-parallel group): the alltoall's backward already brought
    every token's contribution from its EP group, so the remaining sum is over the expert-data-parallel
    group, and the divisor is again D (not the size of that group).
  tied embedding under pipeline parallelism: the first stage's embedding and the last stage's copy
    (output_layer, attribute `shared_embedding`) each hold part of the gradient: summed over megatron's
    embedding group, so both copies take the same step.
Megatron's DDP applies the same factors (gradient_scaling_factor = 1/D for both kinds).
The global norm counts every weight once: a TP-split weight's slices on all TP ranks, a replicated
one on TP rank 0 (megatron's `param_is_not_tensor_parallel_duplicate`), experts over EP x ETP, each pipeline
stage its own layers (the last stage's copy of a tied embedding, attribute `shared`, not counted).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


def _tp_partial(name: str, p: torch.nn.Parameter) -> bool:
    return bool(getattr(p, "sequence_parallel", False)) or "q_layernorm" in name or "k_layernorm" in name


def _allreduce_flat(grads: list[torch.Tensor], group, div: float = 1.0) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one collective per kind
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    if div != 1.0:
        flat.div_(div)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def allreduce_grads(named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
    """In place: every grad becomes d((1/D) sum_d L_d)/dtheta (see the module docstring)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        _allreduce_flat([p.grad for n, p in named_params if p.grad is not None and _tp_partial(n, p)],
                        ps.get_tensor_model_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
        _allreduce_flat([p.grad for _, p in named_params if p.grad is not None
                         and getattr(p, "shared_embedding", False)], ps.get_embedding_group())
    dp = ps.get_data_parallel_world_size()
    groups = {False: ps.get_data_parallel_group(), True: ps.get_expert_data_parallel_group()}
    for expert in (False, True):
        _allreduce_flat([p.grad for n, p in named_params if p.grad is not None and is_expert_param(n) == expert],
                        groups[expert], float(dp))


def _counted(name: str, p: torch.nn.Parameter, tp_rank: int, etp_rank: int) -> bool:
    if getattr(p, "shared", False):
        return False
    if getattr(p, "tensor_model_parallel", False):
        return True
    return (etp_rank if is_expert_param(name) else tp_rank) == 0


def global_grad_norm(named_params: list[tuple[str, torch.nn.Parameter]]) -> float:
    """L2 norm of the full model's gradient (each weight counted once), after `allreduce_grads`."""
    from megatron.core import parallel_state as ps

    tp_rank, etp_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    device = named_params[0][1].device  # NCCL reduces device tensors only
    sq = torch.zeros(2, dtype=torch.float64, device=device)  # dense, expert
    for n, p in named_params:
        if p.grad is not None and _counted(n, p, tp_rank, etp_rank):
            sq[int(is_expert_param(n))] += p.grad.double().pow(2).sum()
    groups = (ps.get_model_parallel_group(), ps.get_expert_tensor_model_pipeline_parallel_group())
    for i, group in enumerate(groups):
        if dist.get_world_size(group) > 1:
            part = sq[i:i + 1].clone()
            dist.all_reduce(part, group=group)
            sq[i] = part[0]
    return math.sqrt(float(sq.sum()))


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
