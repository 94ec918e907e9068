"""The default backend: the HF policy (and critic) trained as they are, in this one process, on `learner.device`
(auto: the GPU torch sees first, else the CPU).

The trainer's step drives the HF modules directly; AdamW (`learner.trainer.step.build_optimizers`) steps them and
torch's `clip_grad_norm_` clips them. Export and import are the live modules themselves: a checkpoint loads in
place. `learner.precision` (checked against the device here, applied by the step's forwards) and
`learner.gradient_checkpointing` take effect here (learner.models.memory). With `loss.kl_coef > 0` the backend also
keeps a frozen copy of the initial policy as the KL reference (never checkpointed: a resumed run rebuilds it from
io.init).
"""

from __future__ import annotations

import copy

import torch

from learner.backends.base import Backend
from learner.config import LearnerConfig
from learner.models.lora import BaseOf, has_lora
from learner.models.memory import check_precision, enable_checkpointing, learner_device
from learner.trainer.step import build_optimizers, clip_grad_norm

LAYOUT = {"backend": "torch", "world_size": 1, "expert_parallel": 1}


class TorchBackend(Backend):
    """The Backend over HF modules in one process."""

    def __init__(self, cfg: LearnerConfig, policy: torch.nn.Module, value: torch.nn.Module | None) -> None:
        self.device = learner_device(cfg.device)
        self.group = None
        self.hf_config = policy.config
        check_precision(cfg.precision, self.device)
        policy.to(self.device)
        if value is not None:
            value.to(self.device)
        self.models = build_optimizers(cfg, policy, value, backend=self)
        if cfg.loss.kl_coef > 0:  # with LoRA the base is the initial policy: the same modules, adapters off
            self.models.reference = BaseOf(policy) if has_lora(policy) else frozen_copy(policy)
        if cfg.gradient_checkpointing:  # after the reference's copy: it never trains, so never recomputes
            enable_checkpointing(policy)
            enable_checkpointing(value)

    def clip_grads(self, model: torch.nn.Module, max_norm: float) -> float:
        return clip_grad_norm(model, max_norm)

    def export_hf(self, name: str) -> torch.nn.Module:
        return self._live(name)

    def hf_target(self, name: str) -> torch.nn.Module:
        return self._live(name)

    def import_hf(self, name: str, model: torch.nn.Module) -> None:
        live = self._live(name)
        if model is not live:
            live.load_state_dict(model.state_dict())

    def layout(self) -> dict:
        return dict(LAYOUT)

    def shutdown(self) -> None:
        pass

    def _live(self, name: str) -> torch.nn.Module:
        model = {"policy": self.models.policy, "value": self.models.value}[name]
        if model is None:
            raise KeyError(f"TorchBackend: no {name} model (the loss has no critic)")
        return model


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` in eval mode with no gradients (the KL penalty's reference)."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref
