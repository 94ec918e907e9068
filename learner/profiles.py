"""Optimizer profiles: the learner's defaults for the model it trains.

`toy` is `LearnerConfig`'s own defaults, tuned on the embedded ~3M-parameter policy (experiments/online.py,
docs/results/). `pretrained` is for a pretrained language model given with `sao up --model DIR`, from the
anchors' published defaults:
  - verl's PPO trainer (verl/trainer/config/ppo_trainer.yaml, generated reference `_generated_ppo_trainer.yaml`):
    actor optim.lr 1e-6, critic optim.lr 1e-5, grad_clip 1.0 for both, weight_decay 0.01, a constant learning
    rate (lr_warmup_steps_ratio 0.0), kl_loss_coef 0.001 with kl_loss_type low_var_kl (our k3);
  - TRL's GRPOConfig: learning_rate 1e-6 ("replaces that of transformers.TrainingArguments"), beta (KL) 0.04.
The critic-only warm-up stays 5 steps in both: the value head starts at random whatever the backbone (verl's
critic_warmup is 0, but its critic is not read before its first update in an online stream either).

Which profile: `learner.profile` (auto, toy, pretrained). auto: toy without --model, and toy for a --model of
fewer than PRETRAINED_MIN_PARAMS parameters (the toy models `sao toy-model` builds start at random and learn at
the toy rates); pretrained otherwise. A key the user sets (config file or --set) wins over the profile; a learning
rate unusual for the model's size is warned about (`warnings_for`), never silently changed.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

ProfileName = Literal["auto", "toy", "pretrained"]
PRETRAINED_MIN_PARAMS = 10_000_000  # the embedded policy has 3.4M, `sao toy-model`'s ~0.1M, SmolLM2 135M
LARGE_PARAMS = 50_000_000  # from this size up, a toy-sized learning rate is warned about
MAX_LR_LARGE, MAX_VALUE_LR_LARGE = 1e-4, 1e-3
# LoRA adapters train at about 10x a full-weight rate (PEFT's and TRL's LoRA examples use 1e-4 to 2e-4; verl's LoRA
# recipe raises the actor's lr from 1e-6 to 3e-5): warned above this
MAX_LR_LORA = 5e-4


@dataclass(frozen=True)
class Profile:
    """Learner settings one profile gives; each field names its key in LearnerConfig (section.key)."""

    name: str
    optim_lr: float
    optim_value_lr: float
    optim_weight_decay: float
    optim_grad_clip: float
    loss_kl_coef: float
    value_warmup_steps: int
    # published versions kept in the weight store; None: the learner's own default (32, or 4 over http). A
    # pretrained model's merged version is its full size (540 MB for SmolLM2-135M): 32 of them filled a disk
    io_keep_versions: int | None = None

    def settings(self) -> dict[str, float | int]:
        """{'optim.lr': 1e-6, ...}: the profile as learner keys (those it leaves to the learner left out)."""
        return {f.name.replace("_", ".", 1): getattr(self, f.name) for f in fields(self)
                if f.name != "name" and getattr(self, f.name) is not None}

    def describe(self) -> str:
        s = self.settings()
        return (f"lr {s['optim.lr']:g}, value_lr {s['optim.value_lr']:g}, weight_decay {s['optim.weight_decay']:g}, "
                f"grad_clip {s['optim.grad_clip']:g}, kl_coef {s['loss.kl_coef']:g}, "
                f"critic warm-up {s['value.warmup_steps']} steps"
                + (f", {s['io.keep_versions']} versions kept" if "io.keep_versions" in s else ""))


TOY = Profile("toy", optim_lr=2e-4, optim_value_lr=1e-3, optim_weight_decay=0.0, optim_grad_clip=1.0,
              loss_kl_coef=0.1, value_warmup_steps=5)
PRETRAINED = Profile("pretrained", optim_lr=1e-6, optim_value_lr=1e-5, optim_weight_decay=0.01, optim_grad_clip=1.0,
                     loss_kl_coef=0.001, value_warmup_steps=5, io_keep_versions=4)
PROFILES = {p.name: p for p in (TOY, PRETRAINED)}


def count_parameters(model_dir: str | Path) -> int | None:
    """Parameters of an HF directory from its safetensors headers (no weights read); None when it has none."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for d in info["shape"]:
                    n *= d
                total += n
    return total


def _size(params: int | None) -> str:
    return "size unknown: no safetensors" if params is None else f"{params / 1e6:.1f}M parameters"


def choose(requested: ProfileName, model: str, params: int | None) -> tuple[Profile, str]:
    """(profile, why) for `learner.profile` = `requested`, the --model directory ("" for the embedded model)."""
    if requested != "auto":
        return PROFILES[requested], f"learner.profile={requested} given"
    if not model:
        return TOY, "no --model: the embedded tiny policy"
    if params is not None and params < PRETRAINED_MIN_PARAMS:
        return TOY, f"--model {model} given, but {_size(params)} (< {PRETRAINED_MIN_PARAMS / 1e6:g}M: a toy model)"
    return PRETRAINED, f"--model {model} given ({_size(params)})"


def apply(learner, profile: Profile, given: set[str]) -> None:
    """Set the profile's keys on `learner` (a LearnerConfig) except those in `given` (learner keys the user set,
    'optim.lr')."""
    for key, value in profile.settings().items():
        if key not in given:
            section, name = key.split(".")
            setattr(getattr(learner, section), name, value)


def warnings_for(learner, params: int | None) -> list[str]:
    """Settings unusual for a model of `params` parameters (they are applied: the user may mean them)."""
    if params is None or params < LARGE_PARAMS:
        return []
    out, lora = [], learner.policy.lora.r > 0
    for key, value, limit in (("optim.lr", learner.optim.lr, MAX_LR_LORA if lora else MAX_LR_LARGE),
                              ("optim.value_lr", learner.optim.value_lr, MAX_VALUE_LR_LARGE)):
        if value > limit:
            usual = "LoRA adapters at 1e-4 to 2e-4" if lora and key == "optim.lr" else "such models at 1e-6 to 1e-5"
            out.append(f"warning: {key}={value:g} is unusual for a model of {_size(params)} (> {limit:g}; verl and "
                       f"TRL train {usual}): a pretrained model's reward can fall instead of rise")
    return out


def _params(model: str) -> int | None:
    return count_parameters(model) if model and Path(model).is_dir() else None


def resolve(learner, model: str, given: set[str]) -> Profile:
    """Choose the profile for `learner` (a LearnerConfig; its `profile` field is the request) and the --model
    directory ("" for the embedded model), and apply it but for the `given` learner keys."""
    profile, _ = choose(learner.profile, model, _params(model))
    apply(learner, profile, given)
    return profile


def explain(learner, model: str) -> list[str]:
    """What `sao up` prints once `resolve` ran: the profile and why, the keys whose value is not the profile's
    (the user's), and the warnings."""
    params = _params(model)
    profile, why = choose(learner.profile, model, params)
    lines = [f"profile {profile.name}: {why}; {profile.describe()}"]
    for key, value in profile.settings().items():
        section, name = key.split(".")
        yours = getattr(getattr(learner, section), name)
        if yours != value:
            lines.append(f"      {key}={yours}: yours, kept (the profile's: {value})")
    return lines + [f"      {w}" for w in warnings_for(learner, params)]
