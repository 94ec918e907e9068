"""The inference-engine interface every agent uses, whatever runs the model underneath.

Log-prob convention (what the trainer needs): `Generation.logprobs[i]` is log pi(token_i | prefix)
under the model's own distribution at temperature 1, no top-p: exactly what the learner recomputes
with `learner.models.token_logprobs` for the same weights, so r_t = exp(logp_learner - logprobs) is
the policy ratio. `Generation.sample_logprobs[i]` is the log-prob under the distribution actually
sampled from (temperature and top-p applied); it equals `logprobs` when temperature == 1 and
top_p == 1, and is 0.0 for greedy decoding (temperature == 0), which is deterministic. Use
`sample_logprobs` as the behaviour policy mu when sampling at temperature != 1: the learner scores
each trajectory at the temperature it carries (`learner.models.scoring`), without top-p.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

from learner.models.tokenizer import Tokenizer

FinishReason = Literal["stop", "length", "eos"]


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens only (the stop / eos token included when it ended the sequence)
    logprobs: list[float]  # model log-probs at temperature 1 (see module doc)
    sample_logprobs: list[float]  # log-probs under the sampling distribution actually used
    finish_reason: FinishReason
    version: int = 0  # policy version that generated it
    text: str = field(default="")  # decoded token_ids (specials skipped)


@dataclass
class StopSpec:
    """Stop conditions resolved against a tokenizer: token ids end at once, strings by decoded suffix."""

    eos_id: int | None
    token_ids: frozenset[int]
    strings: tuple[str, ...]  # strings that are not a single token

    def reason_for(self, token: int) -> FinishReason | None:
        if self.eos_id is not None and token == self.eos_id:
            return "eos"
        return "stop" if token in self.token_ids else None

    def reason_at(self, generated: list[int], tokenizer: Tokenizer | None) -> FinishReason | None:
        """Why generation must end after the last of `generated`, or None to go on."""
        reason = self.reason_for(generated[-1])
        if reason is None and self.strings and tokenizer is not None:
            # Every non-special token decodes to >= 1 character: the last len(s) tokens cover a suffix s.
            tail = tokenizer.decode(generated[-max(len(s) for s in self.strings):])
            if any(tail.endswith(s) for s in self.strings):
                reason = "stop"
        return reason

    def truncate(self, generated: list[int], tokenizer: Tokenizer | None) -> tuple[int, FinishReason]:
        """Length to keep of a sequence generated without early stopping, and why it ended."""
        for n in range(1, len(generated) + 1):
            reason = self.reason_at(generated[:n], tokenizer)
            if reason is not None:
                return n, reason
        return len(generated), "length"


def resolve_stop(stop: list[str] | list[int] | None, tokenizer: Tokenizer | None, eos_id: int | None) -> StopSpec:
    ids, strings = set(), []
    for item in stop or []:
        if isinstance(item, int) and not isinstance(item, bool):
            ids.add(item)
        elif isinstance(item, str):
            if tokenizer is None:
                raise ValueError(f"stop string {item!r} needs a tokenizer: pass one to the engine")
            enc = tokenizer.encode(item)
            if len(enc) == 1:
                ids.add(enc[0])
            elif not enc:
                raise ValueError("stop: empty string")
            else:
                strings.append(item)
        else:
            raise TypeError(f"stop: expected str or int items, got {type(item).__name__} ({item!r})")
    return StopSpec(eos_id=eos_id, token_ids=frozenset(ids - {eos_id}), strings=tuple(strings))


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    if not prompts:
        raise ValueError("generate: no prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty (start it with <bos>)")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"generate: prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise ValueError(f"generate: temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p={top_p} must be in (0, 1]")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file, or of an HF directory's `model.safetensors` (or its shards)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if path.is_dir() and index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(str(path / shard)).items()}
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no safetensors weights there")
    return load_file(str(file))


def load_into(model: PreTrainedModel, state_dict: dict[str, torch.Tensor]) -> None:
    """Strict load, except a tied lm_head may be absent (save_pretrained drops it). An adapter-only version
    (learner.models.lora) is merged onto the base weights instead."""
    from learner.models.lora import forget_base, is_adapter_state, load_adapters

    if is_adapter_state(state_dict):
        return load_adapters(model, state_dict)
    forget_base(model)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"load weights: missing {sorted(set(missing) - tied)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")


class Engine(ABC):
    """Batched generation from token-id prompts, with swappable weights and a version counter."""

    version: int = 0

    @abstractmethod
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 stop: list[str] | list[int] | None = None, seed: int | None = None) -> list[Generation]: ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Replace the weights in place; `version` defaults to the current one plus 1."""

    @property
    def eos_id(self) -> int | None:
        """The served model's end-of-sequence id (every engine exposes its HF config as `model.config`)."""
        eos = self.model.config.eos_token_id
        return eos[0] if isinstance(eos, list) else eos

    def load_weights(self, path: str | Path, version: int | None = None) -> None:
        self.load_state_dict(read_state_dict(path), version)

    def _bump(self, version: int | None) -> None:
        self.version = self.version + 1 if version is None else int(version)
