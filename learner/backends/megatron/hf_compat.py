"""HF-call-compatible wrappers, so the trainer's step code drives megatron models as is.

`learner.models.scoring` calls a policy as `model(input_ids=, attention_mask=, position_ids=,
use_cache=, output_router_logits=).logits` and a critic as `value_model(ids, mask, positions)`;
these wrappers answer those calls with megatron GPTModels. Gradients are reduced over the ranks
before clipping by the backend (`MegatronBackend.clip_grads`), not by these modules.

At pipeline parallelism (`pp` > 1) a call runs through megatron-core's schedule without a graph (the trainer's
`prepare`: critic values, proximal log-probs), every stage getting the last stage's output; a forward with
gradients must go through the schedule with its loss (`pipeline_step`), so it is refused here.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from learner.backends.megatron import pipeline
from learner.backends.megatron.model import position_ids, run


class HFCompatPolicy(torch.nn.Module):
    def __init__(self, gpt: torch.nn.Module, device: torch.device, tp: int = 1, pp: int = 1):
        super().__init__()
        self.gpt, self.device, self.tp, self.pp = gpt, device, tp, pp

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **_ignored) -> SimpleNamespace:
        ids, mask, pos = _inputs(self.device, input_ids, attention_mask, position_ids)
        if self.pp > 1:
            _no_grad("policy")
            return SimpleNamespace(logits=pipeline.forward(self.gpt, ids, mask, self.tp, key="logits"))
        return SimpleNamespace(logits=run(self.gpt, ids, mask, pos))


class HFCompatValue(torch.nn.Module):
    def __init__(self, value_model: torch.nn.Module, device: torch.device, tp: int = 1, pp: int = 1):
        super().__init__()
        self.vm, self.device, self.tp, self.pp = value_model, device, tp, pp

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        ids, mask, pos = _inputs(self.device, input_ids, attention_mask, position_ids)
        if self.pp > 1:
            _no_grad("critic")
            return pipeline.forward(self.vm, ids, mask, self.tp, values=True)
        return run(self.vm, ids, mask, pos)


def _no_grad(which: str) -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(f"the megatron {which} at pipeline_parallel > 1: a forward with gradients runs through "
                           f"the schedule with its loss (MegatronBackend.scheduled_backward), not through this call")


def _inputs(device: torch.device, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, positions) on `device`; the mask defaults to all ones, positions to the mask's."""
    ids = input_ids.to(device)
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(device)
    return ids, mask, positions.to(device) if positions is not None else position_ids(mask)
