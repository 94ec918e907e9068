"""The project's own batched samplers: left-padded prompts, a KV cache, finished rows dropped as they end.

`BatchedSampler` is the decode loop (sampling, stop conditions, compaction); two model paths feed it:
- `TorchSampler`, the tiny Qwen3-MoE's fast path: `learner.models.fast` over a snapshot of the HF
  policy's weights (taken at construction and at every `load_state_dict`, so the trainer may keep
  updating its own copy in place), a preallocated cache, a compact MoE forward;
- `CachedSampler`, any HF causal LM: its own forward with a `DynamicCache` (slower per token than the
  fast path on the tiny model, but architecture-agnostic; vLLM serves real models on GPUs).
`make_engine("torch", model)` picks the fast path when the model is a `Qwen3MoeForCausalLM`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from transformers import DynamicCache, Qwen3MoeForCausalLM

from learner.engines.base import Engine, Generation, check_prompts, check_sampling, load_into, resolve_stop
from learner.engines.sampling import sample_next
from learner.models.fast import KVCache, forward_step, pack_weights, rope_table


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] ids and the [B, P] mask of real tokens, prompts aligned to the right."""
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, P), pad, dtype=torch.long)
    valid = torch.zeros(B, P, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[i, P - len(p):] = True
    return ids, valid


class BatchedSampler(Engine):
    def __init__(self, model: Any, tokenizer: Any = None, version: int = 0) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.version = version

    @abstractmethod
    def _prefill(self, ids: torch.Tensor, valid: torch.Tensor, max_new_tokens: int) -> tuple[Any, torch.Tensor]:
        """Run the padded prompts; returns the cache state and the [B, V] logits of each last prompt token."""

    @abstractmethod
    def _decode(self, state: Any, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Feed one [b] token per live row at positions [b, 1]; returns [b, V] logits."""

    @abstractmethod
    def _select(self, state: Any, rows: torch.Tensor) -> Any:
        """Keep only these cache rows."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 stop: list[str] | list[int] | None = None, seed: int | None = None) -> list[Generation]:
        check_prompts(prompts, self.model.config.vocab_size)
        check_sampling(max_new_tokens, temperature, top_p)
        spec = resolve_stop(stop, self.tokenizer, self.eos_id)
        B = len(prompts)
        state, logits, valid = self._prefill_shared(prompts, max_new_tokens)
        next_pos = valid.sum(-1, keepdim=True)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        stop_ids = torch.tensor(sorted(spec.token_ids | ({spec.eos_id} - {None})), dtype=torch.long)
        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        slps: list[list[float]] = [[] for _ in range(B)]
        reasons: list[str | None] = [None] * B
        alive = list(range(B))  # cache row j holds prompt alive[j]
        for step in range(max_new_tokens):
            token, lp, slp = sample_next(logits, temperature, top_p, gen)
            for i, t, a, b in zip(alive, token.tolist(), lp.tolist(), slp.tolist()):
                if reasons[i] is None:  # finished rows ride along until the next compaction; ignore them
                    toks[i].append(t), lps[i].append(a), slps[i].append(b)
            candidates = alive if spec.strings else [
                alive[j] for j in torch.isin(token, stop_ids).nonzero().flatten().tolist()]
            for i in candidates:
                if reasons[i] is None:
                    reasons[i] = spec.reason_at(toks[i], self.tokenizer)
            keep = [j for j, i in enumerate(alive) if reasons[i] is None]
            if not keep or step == max_new_tokens - 1:
                break
            if len(keep) <= len(alive) // 2:  # drop finished rows once they are half the batch
                idx = torch.tensor(keep)
                state = self._select(state, idx)
                token, next_pos, alive = token[idx], next_pos[idx], [alive[j] for j in keep]
            logits = self._decode(state, token, next_pos)
            next_pos = next_pos + 1
        out = []
        for i in range(B):
            text = self.tokenizer.decode(toks[i]) if self.tokenizer is not None else ""
            out.append(Generation(toks[i], lps[i], slps[i], reasons[i] or "length", self.version, text))
        return out

    def _prefill_shared(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """`_prefill` once per distinct prompt (a GRPO group's n rollouts share theirs, as a prefix cache would), its
        cache rows and logits then copied to every row of that prompt; returns the state, [B, V] logits and the
        [B, P] real-token mask."""
        first: dict[tuple[int, ...], int] = {}
        row_of = [first.setdefault(tuple(p), len(first)) for p in prompts]
        ids, valid = left_pad([list(p) for p in first], self.model.config.pad_token_id or 0)
        state, logits = self._prefill(ids, valid, max_new_tokens)
        if len(first) == len(prompts):
            return state, logits, valid
        rows = torch.tensor(row_of)
        return self._select(state, rows), logits[rows], valid[rows]


class TorchSampler(BatchedSampler):
    """The tiny Qwen3-MoE's fast path (`learner.models.fast`)."""

    def __init__(self, model: Qwen3MoeForCausalLM, tokenizer: Any = None, version: int = 0) -> None:
        super().__init__(model, tokenizer, version)
        self._packed = pack_weights(model)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        load_into(self.model, state_dict)
        self._packed = pack_weights(self.model)
        self._bump(version)

    def _prefill(self, ids, valid, max_new_tokens):
        pw, (B, P) = self._packed, ids.shape
        cache = KVCache(pw, B, P + max_new_tokens)
        rope = rope_table(pw, P + max_new_tokens)
        logits = forward_step(pw, cache, ids, (valid.long().cumsum(-1) - 1).clamp(min=0), valid, rope)
        return (cache, rope), logits

    def _decode(self, state, token, pos):
        cache, rope = state
        return forward_step(self._packed, cache, token[:, None], pos, torch.ones(len(token), 1, dtype=torch.bool),
                            rope)

    def _select(self, state, rows):
        state[0].select_rows(rows)
        return state


class CachedSampler(BatchedSampler):
    """Any HF causal LM: its own forward, a `DynamicCache` and an attention mask that grows with the sequence."""

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        load_into(self.model, state_dict)
        self._bump(version)

    def _forward(self, cache: DynamicCache, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask.long(), position_ids=pos, past_key_values=cache,
                         use_cache=True)
        return out.logits[:, -1].float()

    def _prefill(self, ids, valid, max_new_tokens):
        cache = DynamicCache()
        logits = self._forward(cache, ids, valid, (valid.long().cumsum(-1) - 1).clamp(min=0))
        return [cache, valid], logits

    def _decode(self, state, token, pos):
        state[1] = torch.cat([state[1], torch.ones(len(token), 1, dtype=torch.bool)], dim=1)
        return self._forward(state[0], token[:, None], state[1], pos)

    def _select(self, state, rows):
        cache, mask = state
        cache.batch_select_indices(rows)
        return [cache, mask[rows]]
