"""Masked reductions over `[B, T]` token tensors and the three loss aggregations.

`mask` is 1 (or True) on trained tokens and 0 elsewhere (prompt, environment observations,
padding). Every reduction ignores masked-out values entirely, so padding never changes a result.
"""

from __future__ import annotations

from typing import Literal

import torch

Agg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
AGGS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    # where(), not x * mask: an inf/NaN at a padded position must not leak in as 0 * inf = NaN
    z = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return z.sum() if dim is None else z.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    n = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / n.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance of the masked entries (0 when fewer than one)."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries; masked-out entries become 0."""
    mean = masked_mean(x, mask)
    std = masked_var(x, mask).sqrt()
    out = (x - mean) / (std + eps)
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Reduce a `[B, T]` per-token loss to a scalar.

    token_mean: sum over all tokens / number of tokens (DAPO, https://arxiv.org/abs/2503.14476).
    seq_mean_token_mean: per-sequence token mean, then mean over sequences (original GRPO).
    seq_mean_token_sum: per-sequence token sum, then mean over sequences (Dr. GRPO's constant
    normaliser, https://arxiv.org/abs/2503.20783).
    Sequences with no trained token do not count in the sequence means.
    """
    if agg == "token_mean":
        return masked_mean(per_token, mask)
    seq_has = mask.bool().any(dim=-1)
    if agg == "seq_mean_token_mean":
        per_seq = masked_mean(per_token, mask, dim=-1)
    elif agg == "seq_mean_token_sum":
        per_seq = masked_sum(per_token, mask, dim=-1)
    else:
        raise ValueError(f"agg: unknown aggregation '{agg}' (choose one of {', '.join(AGGS)})")
    return masked_mean(per_seq, seq_has)


def check_shapes(**tensors: torch.Tensor | None) -> None:
    """All given tensors must share one `[B, T]` shape; the error names the odd one out."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    name0, ref = items[0]
    if ref.dim() != 2:
        raise ValueError(f"{name0}: expected a [B, T] tensor, got shape {tuple(ref.shape)}")
    for name, t in items[1:]:
        if t.shape != ref.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} != {name0} shape {tuple(ref.shape)}")
