"""The value model V_phi: a copy of the policy backbone with a fresh scalar head, its own weights.

Saved as its own directory: `config.json` (the backbone's Qwen3-MoE config plus
`"sao_model": "value"`), `model.safetensors` with keys `backbone.*` and `head.*`. The backbone is
the base model class of the policy's config (Qwen3-MoE here; the megatron backend also builds
GLM-4-MoE critics this way), but `load` reads Qwen3-MoE configs only.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import MODEL_MAPPING, PretrainedConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

VALUE_MARK = "value"


class ValueModel(nn.Module):
    def __init__(self, config: PretrainedConfig, head_std: float | None = None) -> None:
        super().__init__()
        self.config = config
        self.backbone = MODEL_MAPPING[type(config)](config)  # the policy's base model class (Qwen3MoeModel, ...)
        self.head = nn.Linear(config.hidden_size, 1)
        self.reset_head(head_std)

    def reset_head(self, std: float | None = None) -> None:
        # Small random head: values start near 0 yet differ per position (a zero head makes parity tests vacuous).
        nn.init.normal_(self.head.weight, std=std if std is not None else self.config.initializer_range)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy: Qwen3MoeForCausalLM, seed: int | None = 0) -> "ValueModel":
        """Backbone weights copied (not shared) from `policy`; the head is new."""
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            vm = cls(copy.deepcopy(policy.config))
        vm.backbone.load_state_dict(policy.model.state_dict())
        return vm.to(dtype=torch.float32).eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] values; position t scores the prefix ending at (and including) token t."""
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        return self.head(h).squeeze(-1)

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
        config = Qwen3MoeConfig.from_dict(raw)
        config._attn_implementation = attn
        vm = cls(config)
        vm.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
        return vm.to(dtype=torch.float32).eval()
