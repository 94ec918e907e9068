"""Next-token choice from [B, V] logits: temperature, nucleus (top-p), greedy; seeded."""

from __future__ import annotations

import torch


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (HF TopPLogitsWarper's rule); others -inf."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum <= (1 - top_p)
    drop[..., -1] = False  # always keep the most likely token
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (token [B], model log-prob at T=1 [B], log-prob under the sampling distribution [B])."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    if temperature == 0:
        token = logits.argmax(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1), torch.zeros_like(token, dtype=logp.dtype)
    if temperature == 1.0 and top_p >= 1.0:
        sample_logp = logp
    else:
        sample_logp = torch.log_softmax(top_p_filter(logits / temperature, top_p), dim=-1)
    token = torch.multinomial(sample_logp.exp(), 1, generator=generator).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1), sample_logp.gather(-1, token[:, None]).squeeze(-1)
