"""Reference engine: transformers `generate`, log-probs from its raw logits and its processed scores."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from learner.engines.base import Engine, Generation, check_prompts, check_sampling, load_into, resolve_stop
from learner.models.tokenizer import Tokenizer


class HFEngine(Engine):
    def __init__(self, model: PreTrainedModel, tokenizer: Tokenizer | None = None, version: int = 0) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.version = version

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        load_into(self.model, state_dict)
        self._bump(version)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 stop: list[str] | list[int] | None = None, seed: int | None = None) -> list[Generation]:
        check_prompts(prompts, self.model.config.vocab_size)
        check_sampling(max_new_tokens, temperature, top_p)
        spec = resolve_stop(stop, self.tokenizer, self.eos_id)
        B, P = len(prompts), max(len(p) for p in prompts)
        pad = self.model.config.pad_token_id or 0
        ids = torch.full((B, P), pad, dtype=torch.long)
        mask = torch.zeros(B, P, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: generate() derives positions from the mask
            ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, P - len(p):] = 1
        greedy = temperature == 0
        stop_ids = sorted(spec.token_ids | ({spec.eos_id} - {None}))
        # HF's default top_k=50 off
        sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": 0}
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
                do_sample=not greedy, **sampling, eos_token_id=stop_ids or None, pad_token_id=pad,
                output_logits=True, output_scores=True,
                return_dict_in_generate=True, use_cache=True,
            )
        new = out.sequences[:, P:]
        steps = new.shape[1]
        picked = new[:, :, None]
        logp = torch.stack([torch.log_softmax(x.float(), -1) for x in out.logits], 1).gather(-1, picked).squeeze(-1)
        if greedy:
            slp = torch.zeros_like(logp)
        else:
            slp = torch.stack([torch.log_softmax(x.float(), -1) for x in out.scores], 1).gather(-1, picked).squeeze(-1)
        results = []
        for i in range(B):
            row = new[i, :steps].tolist()
            n, reason = spec.truncate(row, self.tokenizer)
            text = self.tokenizer.decode(row[:n]) if self.tokenizer is not None else ""
            results.append(Generation(row[:n], logp[i, :n].tolist(), slp[i, :n].tolist(), reason, self.version, text))
        return results
