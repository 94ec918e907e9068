"""`make_engine(name, model_or_dir, tokenizer)`: the one place engine names are resolved."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from transformers import Qwen3MoeForCausalLM

from learner.engines.base import Engine
from learner.models.policy import load_policy
from learner.models.tokenizer import load_tokenizer


def _torch(model, tokenizer):
    """The fast path for the tiny Qwen3-MoE, the generic KV-cache sampler for any other causal LM."""
    from learner.engines.torch_sampler import CachedSampler, TorchSampler

    return (TorchSampler if isinstance(model, Qwen3MoeForCausalLM) else CachedSampler)(model, tokenizer)


def _hf(model, tokenizer):
    from learner.engines.hf_engine import HFEngine

    return HFEngine(model, tokenizer)


def _vllm(model, tokenizer):
    from learner.engines.vllm import VLLMEngine  # from_policy raises VLLMUnavailable (names the extra) without vllm

    return VLLMEngine.from_policy(model, tokenizer)


ENGINES: dict[str, Callable[[Any, Any], Engine]] = {
    "torch": _torch, "hf": _hf, "vllm": _vllm,
}


def make_engine(name: str, model: Any, tokenizer: Any = None) -> Engine:
    """`model` is a causal LM or a model directory (whose tokenizer is used if none is given)."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine '{name}' (known: {', '.join(ENGINES)})")
    if isinstance(model, (str, Path)):
        path = Path(model)
        if tokenizer is None:
            tokenizer = load_tokenizer(path)
        model = load_policy(path)
    return ENGINES[name](model, tokenizer)
