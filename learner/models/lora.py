"""LoRA adapters on the policy (`learner.policy.lora`, the `lora` extra: peft).

`add_lora` injects peft's LoRA layers into the HF model in place and returns that same HF model (not peft's
wrapper), so the trainer, the scoring and the checkpoints see the module they know: its base weights are frozen,
only `lora_A`/`lora_B` train, and its state dict names them (`...q_proj.base_layer.weight`,
`...q_proj.lora_A.default.weight`), which is what a checkpoint saves and loads.

Versions are published as merged weights (`merged_state_dict`: W + B·A·alpha/r under the plain HF names), so an
agent loads a LoRA-trained version exactly as any other: agents are unchanged, a version is as large as the model.
"""

from __future__ import annotations

import torch
from torch import nn

ADAPTER = "default"  # peft's name of the one adapter


def has_lora(model: nn.Module) -> bool:
    return any(hasattr(m, "lora_A") for m in model.modules())


def add_lora(model: nn.Module, r: int, alpha: float, dropout: float, target_modules: list[str]) -> nn.Module:
    """`model` with LoRA layers of rank `r` on the linear layers named `target_modules`; every other weight frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("learner.policy.lora needs peft: pip install -e '.[lora]'") from None
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = sorted(set(target_modules) - names)
    if missing:
        raise ValueError(f"learner.policy.lora.target_modules: {missing} name no linear layer of this "
                         f"{type(model).__name__} (its linear layers: {sorted(names)})")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules))
    return get_peft_model(model, config).get_base_model()


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The HF state dict of `model` with each adapter merged into its base weight (the model is not changed):
    what an agent loads. Without adapters: `model.state_dict()`."""
    state = model.state_dict()
    if not has_lora(model):
        return state
    deltas = {f"{name}.weight": m.get_delta_weight(ADAPTER).detach()
              for name, m in model.named_modules() if hasattr(m, "lora_A") and ADAPTER in m.lora_A}
    merged = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        merged[key] = value + deltas[key] if key in deltas else value
    return merged


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer steps: those that take gradients (with LoRA, the adapters alone)."""
    return [p for p in model.parameters() if p.requires_grad]
