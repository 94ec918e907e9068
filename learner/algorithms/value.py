"""Clipped value loss for the critic, with explained variance."""

from __future__ import annotations

import torch

from learner.algorithms.masked import aggregate, check_shapes, masked_mean, masked_var


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[R - V] / Var[R] over trained tokens; 0.0 when the returns are constant."""
    with torch.no_grad():
        var_r = float(masked_var(returns, mask))
        if var_r < 1e-12:
            return 0.0
        return 1.0 - float(masked_var(returns - values, mask)) / var_r


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip: float | None = 0.2, agg: str = "token_mean"):
    """PPO-style clipped value loss: 0.5·max((V - R)², (V_old + clip(V - V_old, ±clip) - R)²).

    The clip keeps the critic from jumping far from the values the advantages were computed
    with (https://arxiv.org/abs/1707.06347, as in OpenAI baselines ppo2); clip=None disables it.
    Returns (loss, metrics) with value_loss, value_clip_frac, explained_variance, value_mean,
    return_mean.
    """
    check_shapes(values=values, old_values=old_values, returns=returns, mask=mask)
    old_values, returns = old_values.detach(), returns.detach()
    err = (values - returns) ** 2
    if clip is None:
        per_token, clipped_frac = 0.5 * err, 0.0
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns) ** 2
        per_token = 0.5 * torch.maximum(err, err_clip)
        clipped_frac = float(masked_mean((err_clip > err).float(), mask))
    loss = aggregate(per_token, mask, agg)
    metrics = {
        "value_loss": float(loss.detach()),
        "value_clip_frac": clipped_frac,
        "explained_variance": explained_variance(values.detach(), returns, mask),
        "value_mean": float(masked_mean(values.detach(), mask)),
        "return_mean": float(masked_mean(returns, mask)),
    }
    return loss, metrics
