"""Per-token KL penalty to a frozen reference policy (verl's `use_kl_loss`, `kl_loss_type`).

`kl_penalty` estimates KL(pi || ref) from tokens sampled from (approximately) pi, per token:
  k1: log pi - log ref                              (unbiased, high variance, can be negative)
  k3: exp(ref - pi) - (ref - pi) - 1                 (Schulman's low-variance estimator, >= 0;
                                                     verl's `low_var_kl`, http://joschu.net/blog/kl-approx.html)
k3 clamps the log ratio to [-20, 20] before the exp and the result to [-10, 10], as verl does.
`forward_kl` ("forward") is exact, over the whole next-token distribution: KL(ref || pi) = sum_v ref(v) (log ref(v) -
log pi(v)). Both k1 and k3 only see the sampled token, so a token pi no longer samples gets no gradient from them; the
forward KL pulls every token the reference gives mass back toward it (a small vocabulary's cost: [B, T, V] log-probs).
Masked-out tokens are 0 (an inf/NaN there does not leak in); aggregate with `aggregate`.
"""

from __future__ import annotations

import torch

KL_TYPES: tuple[str, ...] = ("k1", "k3", "forward")
FULL_KL_TYPES: tuple[str, ...] = ("forward",)  # these read [B, T, V] log-probs, not the sampled tokens' [B, T]
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
    elif kind in FULL_KL_TYPES:
        raise ValueError(f"kind: '{kind}' needs the whole next-token distribution: use forward_kl")
    else:
        raise ValueError(f"kind: unknown KL estimator '{kind}' (choose one of {', '.join(KL_TYPES)})")
    return torch.where(m, out, zero)


def forward_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] KL(ref || pi) of each token's next-token distribution from [B, T, V] log-probs of pi and ref;
    gradient flows through `logp` only."""
    if logp.dim() != 3 or logp.shape != ref_logp.shape or logp.shape[:2] != mask.shape:
        raise ValueError(f"forward_kl: expected [B, T, V] log-probs and a [B, T] mask, got logp {tuple(logp.shape)}, "
                         f"ref_logp {tuple(ref_logp.shape)}, mask {tuple(mask.shape)}")
    m = mask.bool()
    ref = ref_logp.detach()
    per_v = torch.where(ref > -torch.inf, ref.exp() * (ref - logp), torch.zeros_like(logp))  # 0 log 0 = 0
    return torch.where(m, per_v.sum(-1), torch.zeros((), dtype=logp.dtype, device=logp.device))
