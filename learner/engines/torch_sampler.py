"""The project's own batched sampler: left-padded prompts, preallocated KV cache, compact MoE forward.

Runs `learner.models.fast` over a snapshot of the HF policy's weights (taken at construction
and at every `load_state_dict`), so the trainer may keep updating its own copy in place.
"""

from __future__ import annotations

import torch
from transformers import Qwen3MoeForCausalLM

from learner.engines.base import Engine, Generation, check_prompts, check_sampling, load_into, resolve_stop
from learner.engines.sampling import sample_next
from learner.models.fast import KVCache, forward_step, pack_weights, rope_table
from learner.models.tokenizer import CharTokenizer


class TorchSampler(Engine):
    def __init__(self, model: Qwen3MoeForCausalLM, tokenizer: CharTokenizer | None = None, version: int = 0) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.version = version
        self._packed = pack_weights(model)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        load_into(self.model, state_dict)
        self._packed = pack_weights(self.model)
        self._bump(version)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 stop: list[str] | list[int] | None = None, seed: int | None = None) -> list[Generation]:
        check_prompts(prompts, self.model.config.vocab_size)
        check_sampling(max_new_tokens, temperature, top_p)
        spec = resolve_stop(stop, self.tokenizer, self.eos_id)
        pw = self._packed
        B = len(prompts)
        cache, rope, logits, next_pos = self._prefill(prompts, max_new_tokens)
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
                cache.select_rows(idx)
                token, next_pos, alive = token[idx], next_pos[idx], [alive[j] for j in keep]
            logits = forward_step(pw, cache, token[:, None], next_pos, torch.ones(len(alive), 1, dtype=torch.bool),
                                  rope)
            next_pos = next_pos + 1
        out = []
        for i in range(B):
            text = self.tokenizer.decode(toks[i]) if self.tokenizer is not None else ""
            out.append(Generation(toks[i], lps[i], slps[i], reasons[i] or "length", self.version, text))
        return out

    def _prefill(self, prompts: list[list[int]], max_new_tokens: int):
        """Left-pad the prompts, fill a fresh cache with them; returns the cache, rope table, [B, V] logits
        of the last prompt token and the [B, 1] position of the first generated token."""
        pw = self._packed
        B, P = len(prompts), max(len(p) for p in prompts)
        pad = self.model.config.pad_token_id or 0
        ids = torch.full((B, P), pad, dtype=torch.long)
        valid = torch.zeros(B, P, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
            valid[i, P - len(p):] = True
        cache = KVCache(pw, B, P + max_new_tokens)
        rope = rope_table(pw, P + max_new_tokens)
        logits = forward_step(pw, cache, ids, (valid.long().cumsum(-1) - 1).clamp(min=0), valid, rope)
        return cache, rope, logits, valid.sum(-1, keepdim=True)
