"""The torch backend's compute options for bigger models: bf16 forwards over fp32 weights (`learner.precision`)
and HF gradient checkpointing (`learner.gradient_checkpointing`).

bfloat16 is autocast, as TRL/accelerate's `bf16=True` and verl's FSDP mixed precision: the weights, their
gradients and AdamW's state stay float32 (the master weights); matmuls and attention run in bfloat16 inside the
forwards (`autocast`), and the log-softmax, losses and values are taken in float32 (`learner.models.scoring`
returns float32 logits, the trainer float32 values). On a CPU without native bf16 instructions (avx512_bf16,
amx_bf16) torch emulates it: it computes, slower than float32 (`native_bf16`; bench/real_model.py measures it).

Gradient checkpointing is HF's (`gradient_checkpointing_enable`), non-reentrant: torch's recommended variant, which
gives gradients to LoRA adapters behind frozen embeddings without `enable_input_require_grads`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from learner.models.value import ValueHead, ValueModel
from streamer.wire.config import ConfigError

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 arithmetic on x86


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """The context the forwards run in: bfloat16 autocast, or nothing for float32."""
    if precision == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


def learner_device(choice: str) -> torch.device:
    """`learner.device`: auto takes the GPU torch sees first, else the CPU; cuda without a GPU is refused."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("LearnerConfig.device: cuda, but torch sees no GPU here (a CPU build of torch, or no "
                          "device); set learner.device=cpu or auto")
    gpu = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    return torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse bfloat16 where `device` cannot compute it (a ConfigError naming learner.precision)."""
    if precision == "float32":
        return
    if device.type == "cuda":
        if not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
            raise ConfigError("LearnerConfig.precision: bfloat16 needs a GPU with bf16 (Ampere or newer); this one "
                              "has none: set learner.precision=float32")
        return
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = F.linear(torch.ones(2, 4, device=device), torch.ones(3, 4, device=device))
    except RuntimeError as e:
        raise ConfigError(f"LearnerConfig.precision: bfloat16 autocast fails on {device.type} ({e}); set "
                          f"learner.precision=float32") from None
    if out.dtype != torch.bfloat16:
        raise ConfigError(f"LearnerConfig.precision: autocast on {device.type} does not compute in bfloat16 here; "
                          f"set learner.precision=float32")


def native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether this x86 CPU has bf16 instructions; None where /proc/cpuinfo cannot tell."""
    try:
        flags = next((ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return None
    return any(f in flags.split() for f in BF16_FLAGS) if flags else None


def enable_checkpointing(model: nn.Module | None) -> None:
    """HF gradient checkpointing on `model` (a policy or a ValueModel's backbone); a ValueHead runs on the policy's
    backbone, checkpointed with the policy. Recomputation happens in train mode only (HF's rule)."""
    if model is None or isinstance(model, ValueHead):
        return
    target = model.backbone if isinstance(model, ValueModel) else model
    if not getattr(target, "supports_gradient_checkpointing", False):
        raise ConfigError(f"LearnerConfig.gradient_checkpointing: {type(target).__name__} does not support HF "
                          f"gradient checkpointing; set learner.gradient_checkpointing=false")
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def checkpointing(body: nn.Module | None) -> bool:
    """Whether HF gradient checkpointing is on for this backbone."""
    return bool(getattr(body, "gradient_checkpointing", False))
