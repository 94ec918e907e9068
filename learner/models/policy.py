"""The policy: a tiny `Qwen3MoeForCausalLM` built from `ModelConfig`, or any HF causal LM loaded from a directory.

A saved directory holds `config.json`, `generation_config.json`, `model.safetensors` (no pickle)
and, when a tokenizer is given, `sao_tokenizer.json`; `transformers.AutoModelForCausalLM
.from_pretrained(dir)` loads it as is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

from learner.models.config import ModelConfig, to_hf_config
from learner.models.tokenizer import CharTokenizer, Tokenizer, save_hf_tokenizer


def build_policy(cfg: ModelConfig | None = None, vocab_size: int | None = None,
                 seed: int | None = 0) -> Qwen3MoeForCausalLM:
    """A freshly initialised fp32 policy; `vocab_size` defaults to the char tokenizer's."""
    cfg = cfg or ModelConfig()
    vocab_size = vocab_size or CharTokenizer().vocab_size
    hf = to_hf_config(cfg, vocab_size)
    if seed is None:
        model = Qwen3MoeForCausalLM(hf)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3MoeForCausalLM(hf)
    return model.float().eval()


def save_policy(model: torch.nn.Module, path: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save(path)
        if isinstance(tokenizer, CharTokenizer):
            save_hf_tokenizer(tokenizer, path)  # so AutoTokenizer.from_pretrained(path) works too
    return path


def load_policy(path: str | Path, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """Any `AutoModelForCausalLM` directory, in float32 (the embedded tiny model is one)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a policy directory (no config.json)")
    if "sao_model" in json.loads((path / "config.json").read_text()):
        raise ValueError(f"{path}: this is a value-model directory; load it with ValueModel.load")
    _refuse_adapters_only(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    except ValueError as e:  # an architecture transformers does not know as a causal LM
        raise ValueError(f"{path}: not loadable as a causal LM by transformers: {e}") from None
    return model.eval()


def _refuse_adapters_only(path: Path) -> None:
    """An adapter-only version (learner.models.lora) is no model: loaded as one, its base would be random."""
    from safetensors import safe_open

    from learner.models.lora import BASE_DIGEST

    file = path / "model.safetensors"
    if file.is_file():
        with safe_open(str(file), "pt") as f:
            if BASE_DIGEST in f.keys():
                raise ValueError(f"{path}: a version of LoRA adapters alone (policy.lora.publish=adapters): start "
                                 "from the base model (--model, the learner's io.init) and load this version on it")


def count_params(model: torch.nn.Module) -> int:
    """Unique parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
