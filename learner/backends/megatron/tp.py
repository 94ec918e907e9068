"""Tensor-parallel slices of megatron tensors: split a full (EP-local) megatron state dict by TP rank, merge it back.

`convert` maps HF <-> full megatron tensors; this module cuts those by tensor-parallel rank the way megatron-core's
local spec holds them (and back). Dense tensors are cut over the TP group, routed experts over the expert-TP group
(ETP: 1 keeps experts whole); shared experts and dense MLPs follow TP, as megatron-core builds them.

  vocab-parallel embedding, output layer   rows (vocabulary) in TP contiguous blocks
  linear_qkv weight and bias               rows: megatron's per-KV-group layout makes each rank's groups one block
  linear_fc1 (SwiGLU, [gate; up])          rank r holds [gate block r; up block r] (megatron's GLU chunks the
                                           local output in two, so the gate and up blocks stay paired)
  linear_proj, linear_fc2 (row-parallel)   columns in TP contiguous blocks
  norms, routers, router bias              replicated (whole on every rank)
Every cut is a slice and every merge a concatenation: split then merge is bit-identical.
"""

from __future__ import annotations

import torch

from learner.backends.megatron.grads import is_expert_param

_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")
_COLS = ("linear_proj.weight", "linear_fc2.weight")


def rule(name: str) -> tuple[int, bool] | None:
    """(split dim, is SwiGLU fc1) of megatron tensor `name`, or None when it is replicated over TP."""
    if name.endswith(_ROWS):
        return 0, False
    if name.endswith("linear_fc1.weight"):
        return 0, True
    if name.endswith(_COLS):
        return 1, False
    return None


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """TP rank `rank`'s slice of the full tensor `name` (itself when replicated or size 1)."""
    r = rule(name)
    if r is None or size == 1:
        return full
    dim, glu = r
    if full.shape[dim] % (2 * size if glu else size):
        raise ValueError(f"tensor parallelism {size} does not divide '{name}' dim {dim} of shape "
                         f"{tuple(full.shape)}")
    if glu:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]]).contiguous()
    return full.chunk(size, dim=dim)[rank].contiguous()


def merge(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of `shard` over every rank's part (in TP rank order)."""
    r = rule(name)
    if r is None or len(parts) == 1:
        return parts[0]
    dim, glu = r
    if glu:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(parts, dim=dim)


def _rank_size(name: str, lay: dict[str, int]) -> tuple[int, int]:
    return (lay["etp_rank"], lay["etp"]) if is_expert_param(name) else (lay["tp_rank"], lay["tp"])


def shard_state(full: dict[str, torch.Tensor], lay: dict[str, int]) -> dict[str, torch.Tensor]:
    """This rank's slices (layout `lay`, as `parallel.layout()`) of a full EP-local megatron state dict."""
    return {n: shard(n, t, *_rank_size(n, lay)) for n, t in full.items()}


def gather_state(local: dict[str, torch.Tensor], lay: dict[str, int]) -> dict[str, torch.Tensor]:
    """The full EP-local megatron state dict from every TP (experts: expert-TP) rank's slices; a collective over
    the TP and expert-TP groups, one all_gather per split tensor in name order (no pickled objects)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = dict(local)
    for name in sorted(local):
        expert = is_expert_param(name)
        size = lay["etp"] if expert else lay["tp"]
        if size == 1 or rule(name) is None:
            continue
        group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
        t = local[name].contiguous()
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t, group=group)
        out[name] = merge(name, parts)
    return out
