"""Per-token KL penalty to a frozen reference policy (verl's `use_kl_loss`, `kl_loss_type`).

Estimates KL(pi || ref) from tokens sampled from (approximately) pi, per token:
  k1: log pi - log ref                              (unbiased, high variance, can be negative)
  k3: exp(ref - pi) - (ref - pi) - 1                 (Schulman's low-variance estimator, >= 0;
                                                     verl's `low_var_kl`, http://joschu.net/blog/kl-approx.html)
k3 clamps the log ratio to [-20, 20] before the exp and the result to [-10, 10], as verl does.
Masked-out tokens are 0 (an inf/NaN there does not leak in); aggregate with `aggregate`.
"""

from __future__ import annotations

import torch

KL_TYPES: tuple[str, ...] = ("k1", "k3")
KL_LOG_RATIO_CAP = 20.0
KL_CAP = 10.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """[B, T] per-token penalty; gradient flows through `logp` only (`ref_logp` is a constant)."""
    if logp.shape != ref_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"kl_penalty: shapes differ: logp {tuple(logp.shape)}, ref_logp {tuple(ref_logp.shape)}, "
                         f"mask {tuple(mask.shape)}")
    m = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    diff = torch.where(m, ref_logp.detach() - logp, zero)  # log ref - log pi
    if kind == "k1":
        out = -diff
    elif kind == "k3":
        d = diff.clamp(-KL_LOG_RATIO_CAP, KL_LOG_RATIO_CAP)
        out = (torch.exp(d) - d - 1.0).clamp(-KL_CAP, KL_CAP)
    else:
        raise ValueError(f"kind: unknown KL estimator '{kind}' (choose one of {', '.join(KL_TYPES)})")
    return torch.where(m, out, zero)
