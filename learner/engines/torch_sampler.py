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

    @property
    def eos_id(self) -> int | None:
        eos = self.model.config.eos_token_id
        return eos[0] if isinstance(eos, list) else eos

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
        next_pos = valid.sum(-1, keepdim=True)  # [B, 1]: position of the first generated token
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        stop_ids = torch.tensor(sorted(spec.token_ids | ({spec.eos_id} - {None})), dtype=torch.long)
        toks, lps, slps = [], [], []
        ends: list[int | None] = [None] * B
        reasons = ["length"] * B
        all_valid = torch.ones(B, 1, dtype=torch.bool)
        for step in range(max_new_tokens):
            token, lp, slp = sample_next(logits, temperature, top_p, gen)
            toks.append(token), lps.append(lp), slps.append(slp)
            hits = torch.isin(token, stop_ids).nonzero().flatten().tolist() if not spec.strings else range(B)
            for i in hits:
                if ends[i] is None:
                    generated = torch.stack(toks, 1)[i].tolist() if spec.strings else [int(token[i])]
                    reason = spec.reason_at(generated, self.tokenizer)
                    if reason is not None:
                        ends[i], reasons[i] = step + 1, reason
            if all(e is not None for e in ends) or step == max_new_tokens - 1:
                break
            logits = forward_step(pw, cache, token[:, None], next_pos, all_valid, rope)
            next_pos = next_pos + 1
        tok_t, lp_t, slp_t = torch.stack(toks, 1).tolist(), torch.stack(lps, 1).tolist(), torch.stack(slps, 1).tolist()
        out = []
        for i in range(B):
            n = ends[i] if ends[i] is not None else len(tok_t[i])
            text = self.tokenizer.decode(tok_t[i][:n]) if self.tokenizer is not None else ""
            out.append(Generation(tok_t[i][:n], lp_t[i][:n], slp_t[i][:n], reasons[i], self.version, text))
        return out
