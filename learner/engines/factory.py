"""`make_engine(name, model_or_dir, tokenizer)`: the one place engine names are resolved."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from transformers import Qwen3MoeForCausalLM

from learner.engines.base import Engine
from learner.models.policy import load_policy
from learner.models.tokenizer import CharTokenizer


def _torch(model, tokenizer):
    from learner.engines.torch_sampler import TorchSampler

    return TorchSampler(model, tokenizer)


def _hf(model, tokenizer):
    from learner.engines.hf_engine import HFEngine

    return HFEngine(model, tokenizer)


def _vllm(model, tokenizer):
    from learner.engines.vllm import VLLMEngine  # from_policy raises VLLMUnavailable (names the extra) without vllm

    return VLLMEngine.from_policy(model, tokenizer)


ENGINES: dict[str, Callable[[Qwen3MoeForCausalLM, CharTokenizer | None], Engine]] = {
    "torch": _torch, "hf": _hf, "vllm": _vllm,
}


def make_engine(name: str, model: Qwen3MoeForCausalLM | str | Path, tokenizer: CharTokenizer | None = None) -> Engine:
    """`model` is a policy or a saved policy directory (its `sao_tokenizer.json` is used if no tokenizer is given)."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine '{name}' (known: {', '.join(ENGINES)})")
    if isinstance(model, (str, Path)):
        path = Path(model)
        if tokenizer is None and (path / "sao_tokenizer.json").is_file():
            tokenizer = CharTokenizer.load(path)
        model = load_policy(path)
    return ENGINES[name](model, tokenizer)
