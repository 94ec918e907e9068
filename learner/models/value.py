"""The value model V_phi: a copy of the policy backbone with a fresh scalar head, its own weights (`ValueModel`),
or a scalar head on the policy's own backbone (`ValueHead`, `learner.value.kind: head`).

Any HF causal LM's backbone serves (`AutoModel` of the policy's config: the tiny Qwen3-MoE, a Qwen3
dense, a GLM-4-MoE, ...). Saved as its own directory: `config.json` (the backbone's HF config plus
`"sao_model": "value"`), `model.safetensors` with keys `backbone.*` and `head.*`.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel

VALUE_MARK = "value"


class ValueModel(nn.Module):
    def __init__(self, config: PretrainedConfig, head_std: float | None = None) -> None:
        super().__init__()
        self.config = config
        self.backbone = AutoModel.from_config(config)
        self.head = nn.Linear(config.hidden_size, 1)
        self.reset_head(head_std)

    def reset_head(self, std: float | None = None) -> None:
        # Small random head: values start near 0 yet differ per position (a zero head makes parity tests vacuous).
        nn.init.normal_(self.head.weight, std=std if std is not None else self.config.initializer_range)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy: PreTrainedModel, seed: int | None = 0, layers: int | None = None) -> "ValueModel":
        """Backbone weights copied (not shared) from `policy`; the head is new. `layers`: only the first `layers`
        blocks of the policy's backbone (a cheaper critic; its final norm is the policy's); None: all of them."""
        config = copy.deepcopy(policy.config)
        if layers is not None:
            if not 1 <= layers <= config.num_hidden_layers:
                raise ValueError(f"value.layers: {layers}, the policy has {config.num_hidden_layers} layers "
                                 f"(choose 1..{config.num_hidden_layers}, or null for all)")
            config.num_hidden_layers = layers
            if isinstance(getattr(config, "layer_types", None), list):
                config.layer_types = config.layer_types[:layers]
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            vm = cls(config)
        kept = {k: v for k, v in policy.base_model.state_dict().items()
                if not k.startswith("layers.") or int(k.split(".")[1]) < config.num_hidden_layers}
        vm.backbone.load_state_dict(kept)
        return vm.to(dtype=torch.float32).eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] values; position t scores the prefix ending at (and including) token t."""
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        return self.score(h)

    def score(self, h: torch.Tensor) -> torch.Tensor:
        """Values from the backbone's last hidden states ([..., H] -> [...])."""
        return self.head(h).squeeze(-1)

    def backbone_grad(self) -> contextlib.AbstractContextManager:
        """The context a forward of the backbone runs in (its own weights: with gradients)."""
        return contextlib.nullcontext()

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = self.config.to_dict()
        cfg["sao_model"] = VALUE_MARK
        (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt", "sao_model": VALUE_MARK})
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ValueModel":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path}: not a value-model directory (no config.json)")
        raw = json.loads(cfg_file.read_text())
        if raw.pop("sao_model", None) != VALUE_MARK:
            raise ValueError(f"{cfg_file}: not a value model (missing \"sao_model\": \"value\"); is it a policy dir?")
        attn = raw.pop("_attn_implementation", None) or "sdpa"
        config = AutoConfig.for_model(**raw)
        config._attn_implementation = attn
        vm = cls(config)
        vm.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
        return vm.to(dtype=torch.float32).eval()


class ValueHead(nn.Module):
    """A scalar head on the policy's backbone: no second backbone, no optimizer state but the head's.

    The backbone is the policy's own module, reached through the policy and not registered here, so `parameters()`
    and `state_dict()` (the critic's optimizer, its checkpoint) hold the head alone. `detach_backbone`: the backbone's
    forward runs without gradients and the value loss trains the head alone; otherwise its gradient also reaches the
    backbone's parameters, which the policy's optimizer steps (with the policy loss's) in the same update."""

    def __init__(self, policy: nn.Module, detach_backbone: bool = True, seed: int | None = 0) -> None:
        super().__init__()
        self._policy = [policy]  # a list: not a submodule
        self.config = policy.config
        self.detach_backbone = detach_backbone
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            self.head = nn.Linear(policy.config.hidden_size, 1)
            nn.init.normal_(self.head.weight, std=policy.config.initializer_range)  # as ValueModel's fresh head
            nn.init.zeros_(self.head.bias)

    @property
    def backbone(self) -> nn.Module:
        return self._policy[0].base_model

    def backbone_grad(self) -> contextlib.AbstractContextManager:
        return torch.no_grad() if self.detach_backbone else contextlib.nullcontext()

    def score(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h).squeeze(-1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] values; position t scores the prefix ending at (and including) token t."""
        with self.backbone_grad():
            h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).last_hidden_state
        return self.score(h)
