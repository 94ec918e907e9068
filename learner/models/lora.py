"""LoRA adapters on the policy (`learner.policy.lora`, the `lora` extra: peft).

`add_lora` injects peft's LoRA layers into the HF model in place and returns that same HF model (not peft's
wrapper), so the trainer, the scoring and the checkpoints see the module they know: its base weights are frozen,
only `lora_A`/`lora_B` train, and its state dict names them (`...q_proj.base_layer.weight`,
`...q_proj.lora_A.default.weight`), which is what a checkpoint saves and loads.

Versions are published as merged weights by default (`merged_state_dict`: W + B·A·alpha/r under the plain HF
names), so an agent loads a LoRA-trained version exactly as any other and a version is as large as the model. With
`policy.lora.publish: adapters` a version holds the adapters alone (`adapter_state_dict`, a few MB for ~135M), and
agents started on the same base model merge them on load (`load_adapters`).
"""

from __future__ import annotations

import contextlib
import hashlib

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


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """`model` computes with its base weights alone inside (peft's switch; the adapters train again after)."""
    layers = [m for _, m in _lora_layers(model)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)


class BaseOf(nn.Module):
    """The base policy under a LoRA one without a copy: the same modules with the adapters off. The KL penalty's
    frozen reference (the initial policy: base + B·A with B = 0 at the start), for no memory."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self._policy = [policy]  # a list: not a submodule (no parameters of its own)
        self.config = policy.config

    def forward(self, **inputs):
        with torch.no_grad(), adapters_off(self._policy[0]) as base:
            return base(**inputs)


# ------------------------------------------------------------------ adapter-only versions (policy.lora.publish)
# A version of the adapters alone: per adapted layer `<layer>.lora_A`, `<layer>.lora_B`, `<layer>.lora_scaling`, and
# BASE_DIGEST, the sha256 of the frozen base weights they go on. An agent merges them onto the base it was started
# with (`load_adapters`, from `learner.engines.base.load_into`) and refuses them if its base is another.
BASE_DIGEST = "lora.base_sha256"
_SUFFIXES = (".lora_A", ".lora_B", ".lora_scaling")


def is_adapter_state(state: dict[str, torch.Tensor]) -> bool:
    return BASE_DIGEST in state


def weights_digest(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """sha256 of the named tensors (names and float32 bytes, in name order), as 32 uint8."""
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return torch.tensor(list(h.digest()), dtype=torch.uint8)


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and ADAPTER in m.lora_A]


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of a LoRA `model` and the digest of its base weights (computed once: they are frozen)."""
    layers = _lora_layers(model)
    if not layers:
        raise ValueError("policy.lora.publish=adapters: the policy has no LoRA adapters (set policy.lora.r > 0)")
    if getattr(model, "_sao_base_digest", None) is None:
        model._sao_base_digest = weights_digest({n: m.base_layer.weight for n, m in layers})
    state = {BASE_DIGEST: model._sao_base_digest}
    for name, m in layers:
        state[f"{name}.lora_A"] = m.lora_A[ADAPTER].weight.detach()
        state[f"{name}.lora_B"] = m.lora_B[ADAPTER].weight.detach()
        state[f"{name}.lora_scaling"] = torch.tensor([float(m.scaling[ADAPTER])])
    return state


def load_adapters(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Set each adapted weight of a plain HF `model` to base + B·A·scaling. The base is the model's weights when the
    first adapter version arrives, kept aside (loading a full state dict drops it); it must be the base the
    learner's adapters were trained on (BASE_DIGEST), else a ValueError says so and nothing changes."""
    layers = sorted(k[:-len(".lora_A")] for k in state if k.endswith(".lora_A"))
    unknown = sorted(k for k in state if k != BASE_DIGEST and not k.endswith(_SUFFIXES))
    try:
        weights = {n: model.get_parameter(f"{n}.weight") for n in layers}
    except AttributeError as e:
        raise ValueError(f"adapter version: a layer it adapts is not in this {type(model).__name__}: {e}") from None
    if unknown or not layers:
        raise ValueError(f"adapter version: unexpected keys {unknown[:5]} or no adapters")
    base, digest = getattr(model, "_sao_lora_base", None) or _keep_aside(weights)
    if not torch.equal(digest, state[BASE_DIGEST]):
        raise ValueError("adapter version: trained on other base weights than this model's (start the agent with "
                         "--model set to the learner's io.init, or publish merged weights: policy.lora.publish)")
    model._sao_lora_base = base, digest
    with torch.no_grad():
        for n, w in weights.items():
            delta = state[f"{n}.lora_B"].float() @ state[f"{n}.lora_A"].float() * state[f"{n}.lora_scaling"].float()
            w.copy_(base[n] + delta.to(w.dtype))


def _keep_aside(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    base = {n: w.detach().clone() for n, w in weights.items()}
    return base, weights_digest(base)


def forget_base(model: nn.Module) -> None:
    """A full state dict was loaded: the weights kept aside as the adapters' base no longer describe the model."""
    model.__dict__.pop("_sao_lora_base", None)
