"""HF-call-compatible wrappers, so the torch trainer's step code drives megatron models as is.

`learner.models.scoring` calls a policy as `model(input_ids=, attention_mask=, position_ids=,
use_cache=, output_router_logits=).logits` and a critic as `value_model(ids, mask, positions)`;
these wrappers answer those calls with megatron GPTModels. The one thing the torch step must do
differently is the gradient reduction before clipping: call `reduce_and_clip_grads(max_norm)`
on the wrapper instead of `torch.nn.utils.clip_grad_norm_` (`clip_grad_norm` below does that
for either kind of model).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from learner.backends.megatron import grads
from learner.backends.megatron.learner import attention_mask_4d, position_ids


class _Reducing(torch.nn.Module):
    def reduce_and_clip_grads(self, max_norm: float | None) -> float:
        """All-reduce grads over data/expert parallelism, then clip by the global norm."""
        return grads.reduce_and_clip(self, max_norm)


class HFCompatPolicy(_Reducing):
    def __init__(self, gpt: torch.nn.Module, device: torch.device):
        super().__init__()
        self.gpt, self.device = gpt, device

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **_ignored) -> SimpleNamespace:
        ids = input_ids.to(self.device)
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(self.device)
        pos = position_ids.to(self.device) if position_ids is not None else _positions(mask)
        return SimpleNamespace(logits=self.gpt(ids, pos, attention_mask_4d(mask)).float())


class HFCompatValue(_Reducing):
    def __init__(self, value_model: torch.nn.Module, device: torch.device):
        super().__init__()
        self.vm, self.device = value_model, device

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        ids = input_ids.to(self.device)
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(self.device)
        pos = position_ids.to(self.device) if position_ids is not None else _positions(mask)
        return self.vm(ids, pos, attention_mask_4d(mask)).float()


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return position_ids(mask)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Gradient norm after clipping for a torch model or a megatron wrapper (which reduces first)."""
    reduce = getattr(model, "reduce_and_clip_grads", None)
    if reduce is not None:
        return float(reduce(max_norm))
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
