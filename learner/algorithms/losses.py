"""Policy losses: one pure function per algorithm over `[B, T]` tensors, picked by name.

Every function takes the learner's log-probs `logp` (with grad), the behaviour log-probs
`old_logp`, per-token `advantages` and the trained-token `mask`, and returns
`(loss, metrics)`: a scalar tensor and a dict of detached python floats.

Shared metric names (fractions are over trained tokens):
  clip_frac_low / clip_frac_high: tokens whose gradient the lower / upper bound cuts (for CISPO,
    whose gradient is never cut, the tokens whose IS weight the bound caps);
  ratio_mean, ratio_max; kl_k1 = E[log mu - log pi], kl_k3 = E[r - 1 - log r] (Schulman's
  estimators of KL(mu || pi) from samples of mu, http://joschu.net/blog/kl-approx.html);
  ess_frac = (sum r)^2 / (n sum r^2), the effective sample size of the per-token importance weights
  over the n trained tokens (Kish), as a fraction: 1 on-policy; a fall predicts collapse in
  asynchronous RL (with spikes of the gradient norm).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from learner.algorithms.masked import aggregate, check_shapes, masked_mean

LOG_RATIO_CAP = 20.0  # exp(20) ~ 5e8: keeps r finite when a token's log-prob collapses


def _log_ratio(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    lr = torch.where(mask.bool(), logp - ref_logp, torch.zeros_like(logp))
    return lr.clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)


def _frac(flags: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(flags.float(), mask))


def _stats(loss: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
           cut_low: torch.Tensor, cut_high: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        lr = _log_ratio(logp.detach(), old_logp, mask)
        r = lr.exp()
        m = mask.bool()
        return {
            "loss": float(loss.detach()),
            "clip_frac_low": _frac(cut_low, mask),
            "clip_frac_high": _frac(cut_high, mask),
            "clip_frac": _frac(cut_low | cut_high, mask),
            "ratio_mean": float(masked_mean(r, mask)),
            "ratio_max": float(r[m].max()) if m.any() else 1.0,
            "kl_k1": float(masked_mean(-lr, mask)),
            "kl_k3": float(masked_mean(r - 1.0 - lr, mask)),
            "ess_frac": _ess_frac(r[m]) if m.any() else 1.0,
            "n_tokens": float(m.sum()),
        }


def _ess_frac(r: torch.Tensor) -> float:
    """(sum r)^2 / (n sum r^2), in float64 and at most 1: in float32 a batch of ratios near 1 rounded it to
    1.00000003, above the bound Cauchy-Schwarz sets."""
    r = r.double()
    return min(float(r.sum() ** 2 / (r.numel() * (r ** 2).sum())), 1.0)


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float):
    """PPO's max(-A r, -A clip(r)) written out: (per-token loss, cut_low, cut_high).

    For A > 0 the clip binds only above 1 + eps_high; for A < 0 only below 1 - eps_low; a bound
    that binds replaces r by a constant, so that token carries no gradient.
    """
    cut_high = (adv > 0) & (ratio > 1.0 + eps_high)
    cut_low = (adv < 0) & (ratio < 1.0 - eps_low)
    clipped = ratio.detach().clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.where(cut_low | cut_high, -adv * clipped, -adv * ratio)
    return per_token, cut_low, cut_high


def sao_loss(logp, old_logp, advantages, mask, *, agg="token_mean", eps_low=0.2, eps_high=0.2):
    """SAO: strict double-side token-level clip. A token contributes r·A only while
    1 - eps_low <= r <= 1 + eps_high, whatever the sign of A: L = -Σ 1[r in band]·r·A / N.
    Unlike PPO it passes no gradient for A > 0, r < 1 - eps_low, and none for A < 0, r -> inf.
    (Single-rollout Asynchronous Optimization; the band is the trust region of
    https://arxiv.org/abs/1707.06347 applied as a hard token mask.)"""
    r = _log_ratio(logp, old_logp, mask).exp()
    cut_low, cut_high = r < 1.0 - eps_low, r > 1.0 + eps_high
    per_token = torch.where(cut_low | cut_high, torch.zeros_like(r), -r * advantages)
    loss = aggregate(per_token, mask, agg)
    return loss, _stats(loss, logp, old_logp, mask, cut_low, cut_high)


def ppo_loss(logp, old_logp, advantages, mask, *, agg="token_mean", eps_low=0.2, eps_high=0.2):
    """PPO clipped surrogate, one-sided: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)).
    https://arxiv.org/abs/1707.06347"""
    r = _log_ratio(logp, old_logp, mask).exp()
    per_token, cut_low, cut_high = _clipped_surrogate(r, advantages, eps_low, eps_high)
    loss = aggregate(per_token, mask, agg)
    return loss, _stats(loss, logp, old_logp, mask, cut_low, cut_high)


def dual_clip_loss(logp, old_logp, advantages, mask, *, agg="token_mean", eps_low=0.2,
                   eps_high=0.2, clip_c=3.0):
    """Dual-clip PPO: for A < 0 the loss is also capped at -A·clip_c, so r > clip_c passes no
    gradient (counted in clip_frac_high). https://arxiv.org/abs/1912.09729"""
    if clip_c <= 1.0:
        raise ValueError(f"clip_c: must be > 1, got {clip_c}")
    r = _log_ratio(logp, old_logp, mask).exp()
    per_token, cut_low, cut_high = _clipped_surrogate(r, advantages, eps_low, eps_high)
    dual = (advantages < 0) & (r > clip_c)
    per_token = torch.where(dual, -advantages * clip_c, per_token)
    loss = aggregate(per_token, mask, agg)
    return loss, _stats(loss, logp, old_logp, mask, cut_low, cut_high | dual)


def dapo_loss(logp, old_logp, advantages, mask, *, agg="token_mean", eps_low=0.2, eps_high=0.28):
    """DAPO: PPO with clip-higher (eps_high > eps_low) and token-level mean.
    https://arxiv.org/abs/2503.14476"""
    return ppo_loss(logp, old_logp, advantages, mask, agg=agg, eps_low=eps_low, eps_high=eps_high)


def gspo_loss(logp, old_logp, advantages, mask, *, agg="seq_mean_token_mean", eps_low=3e-4,
              eps_high=4e-4):
    """GSPO: sequence-level ratio s = exp(mean_t log r_t), clipped per sequence. Written in the
    GSPO-token form s_t = sg(s)·pi_t/sg(pi_t), whose value is s and whose gradient per token is
    s·∇log pi_t, so per-token advantages work too. https://arxiv.org/abs/2507.18071"""
    lr = _log_ratio(logp, old_logp, mask)
    log_s = masked_mean(lr, mask, dim=-1)  # [B]
    s_tok = torch.exp(log_s.detach()[:, None] + logp - logp.detach())  # [B, T], value s
    s = log_s.detach().exp()[:, None].expand_as(logp)
    cut_high = (advantages > 0) & (s > 1.0 + eps_high)
    cut_low = (advantages < 0) & (s < 1.0 - eps_low)
    clipped = s.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.where(cut_low | cut_high, -advantages * clipped, -advantages * s_tok)
    loss = aggregate(per_token, mask, agg)
    return loss, _stats(loss, logp, old_logp, mask, cut_low, cut_high)


def cispo_loss(logp, old_logp, advantages, mask, *, agg="token_mean", eps_low=1.0, eps_high=0.28):
    """CISPO: L = -sg(clip(r, 1-eps_low, 1+eps_high))·A·log pi. The IS weight is clipped and
    stop-gradient, so every token keeps its gradient (clip fractions count capped weights).
    eps_low = 1 leaves the weight unbounded below. https://arxiv.org/abs/2506.13585"""
    r = _log_ratio(logp, old_logp, mask).exp().detach()
    w = r.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = -w * advantages * logp
    loss = aggregate(per_token, mask, agg)
    return loss, _stats(loss, logp, old_logp, mask, r < 1.0 - eps_low, r > 1.0 + eps_high)


def decoupled_ppo_loss(logp, old_logp, advantages, mask, *, prox_logp=None, agg="token_mean",
                       eps_low=0.2, eps_high=0.2, behav_cap=5.0):
    """Decoupled PPO (AReaL): clip r = pi/pi_prox around the proximal policy the learner
    recomputes, and weight each token by the behaviour importance weight w = pi_prox/mu.
    As in AReaL, tokens with w > behav_cap are dropped (weight 0), not truncated.
    https://arxiv.org/abs/2505.24298"""
    if prox_logp is None:
        raise ValueError("decoupled_ppo: prox_logp is required (the proximal policy's log-probs)")
    check_shapes(logp=logp, prox_logp=prox_logp)
    r = _log_ratio(logp, prox_logp, mask).exp()
    per_token, cut_low, cut_high = _clipped_surrogate(r, advantages, eps_low, eps_high)
    w = _log_ratio(prox_logp, old_logp, mask).exp().detach()
    keep = w <= behav_cap
    per_token = torch.where(keep, per_token * w, torch.zeros_like(per_token))
    loss = aggregate(per_token, mask, agg)
    stats = _stats(loss, logp, old_logp, mask, cut_low, cut_high)
    stats["behav_drop_frac"] = _frac(~keep, mask)
    stats["behav_weight_mean"] = float(masked_mean(w, mask))
    return loss, stats


LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]

POLICY_LOSSES: dict[str, LossFn] = {
    "sao": sao_loss,
    "ppo": ppo_loss,
    "dual_clip": dual_clip_loss,
    "dapo": dapo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "decoupled_ppo": decoupled_ppo_loss,
}


def policy_loss(name: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, **params) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss `name` (a key of POLICY_LOSSES) with its keyword parameters (agg, eps_low, ...).
    `agg=None` or an absent `agg` uses the algorithm's own default aggregation."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"loss: unknown policy loss '{name}' (choose one of {', '.join(POLICY_LOSSES)})")
    check_shapes(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    params = {k: v for k, v in params.items() if not (k == "agg" and v is None)}
    fn = POLICY_LOSSES[name]
    known = loss_params(name)
    for k in params:
        if k not in known:
            raise ValueError(f"loss '{name}': unknown parameter '{k}' (known: {', '.join(known)})")
    return fn(logp, old_logp.detach(), advantages.detach(), mask, **params)


def loss_params(name: str) -> dict[str, object]:
    """The keyword parameters of loss `name` with their defaults (None where required)."""
    sig = inspect.signature(POLICY_LOSSES[name])
    return {p.name: (None if p.default is p.empty else p.default)
            for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY}
