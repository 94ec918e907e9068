"""Advantage estimators: GAE over generated tokens (value model), group-normalised outcomes, batch-normalised ones.

Token tensors are `[B, T]`; `mask` is 1 on generated (trained) tokens. A multi-turn trajectory
has gaps in the mask where the environment's observation tokens lie: GAE skips them, so the
"next value" of a generated token is the value at the next generated token, and the return of
the last generated token is its own reward. The outcome reward of a trajectory sits on its last
generated token (`place_reward`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from learner.algorithms.masked import check_shapes, masked_whiten


def place_reward(reward: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] scalar rewards -> [B, T] token rewards on each row's last masked position."""
    if reward.shape != mask.shape[:1]:
        raise ValueError(f"reward: shape {tuple(reward.shape)} != batch size ({mask.shape[0]},)")
    m = mask.bool()
    if not m.any(dim=-1).all():
        raise ValueError("mask: a row has no generated token to carry its reward")
    t = mask.shape[1]
    last = (torch.arange(t, device=mask.device) * m).argmax(dim=-1)  # [B]
    out = torch.zeros(mask.shape, dtype=reward.dtype, device=reward.device)
    out[torch.arange(mask.shape[0]), last] = reward
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float | torch.Tensor = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the masked tokens (https://arxiv.org/abs/1506.02438).

    delta_t = r_t + gamma·V_next - V_t, A_t = delta_t + gamma·lam·A_next, where "next" is the
    next masked position (V, A = 0 after the last). Rewards at masked-out positions are ignored.
    `lam` is a float or a [B] tensor (per-sequence lambda). Returns (advantages, returns =
    advantages + values), both 0 at masked-out positions.
    """
    check_shapes(rewards=rewards, values=values, mask=mask)
    b, t = rewards.shape
    lam_b = torch.as_tensor(lam, dtype=values.dtype, device=values.device).expand(b)
    rewards, values, m = rewards.detach(), values.detach(), mask.bool()
    adv = torch.zeros_like(values)
    next_v = torch.zeros(b, dtype=values.dtype, device=values.device)
    next_a = torch.zeros_like(next_v)
    for i in range(t - 1, -1, -1):  # [B] carries, held across masked-out gaps
        delta = rewards[:, i] + gamma * next_v - values[:, i]
        a = delta + gamma * lam_b * next_a
        on = m[:, i]
        adv[:, i] = torch.where(on, a, torch.zeros_like(a))
        next_v = torch.where(on, values[:, i], next_v)
        next_a = torch.where(on, a, next_a)
    returns = torch.where(m, adv + values, torch.zeros_like(adv))
    return adv, returns


def adaptive_lambda(mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """Length-adaptive lambda per sequence: 1 - 1/(alpha·L), L = generated tokens, clamped to
    [0, 1] (VAPO, https://arxiv.org/abs/2504.05118). Long answers get lambda near 1 (less bias),
    short ones lean on the critic."""
    if alpha <= 0:
        raise ValueError(f"alpha: must be > 0, got {alpha}")
    length = mask.to(torch.float32).sum(dim=-1).clamp(min=1.0)
    return (1.0 - 1.0 / (alpha * length)).clamp(0.0, 1.0)


def sao_actor_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                         lam_actor: float = 0.95, alpha: float | None = None, normalize: bool = False
                         ) -> torch.Tensor:
    """The actor's half of `sao_advantages`: GAE with lam_actor (or the length-adaptive lambda when `alpha` is
    set), whitened over the batch when `normalize`."""
    lam = adaptive_lambda(mask, alpha) if alpha is not None else lam_actor
    adv, _ = gae(rewards, values, mask, gamma, lam)
    return masked_whiten(adv, mask) if normalize else adv


def sao_returns(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                lam_critic: float = 1.0) -> torch.Tensor:
    """The critic's half of `sao_advantages`: GAE(lam_critic) returns, each row's own (1.0 = Monte-Carlo)."""
    return gae(rewards, values, mask, gamma, lam_critic)[1]


def sao_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   gamma: float = 1.0, lam_actor: float = 0.95, lam_critic: float = 1.0,
                   alpha: float | None = None, normalize: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled-lambda GAE (VAPO/VC-PPO): actor advantages with lam_actor (or the length-adaptive
    lambda when `alpha` is set), critic targets with lam_critic (1.0 = Monte-Carlo returns).
    `normalize` whitens the advantages over the batch (there is no group in single rollout).
    Returns (advantages, returns)."""
    return (sao_actor_advantages(rewards, values, mask, gamma, lam_actor, alpha, normalize),
            sao_returns(rewards, values, mask, gamma, lam_critic))


def _group_index(groups: Sequence[Hashable] | torch.Tensor, n: int) -> torch.Tensor:
    keys = groups.tolist() if isinstance(groups, torch.Tensor) else list(groups)
    if len(keys) != n:
        raise ValueError(f"groups: {len(keys)} ids for {n} rewards")
    ids: dict[Hashable, int] = {}
    return torch.tensor([ids.setdefault(k, len(ids)) for k in keys], dtype=torch.long)


def _group_stats(rewards: torch.Tensor, groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element (group mean, group unbiased std, group size)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a [N] tensor, got shape {tuple(rewards.shape)}")
    idx = _group_index(groups, rewards.shape[0]).to(rewards.device)
    k = int(idx.max()) + 1 if idx.numel() else 0
    size = torch.zeros(k, dtype=rewards.dtype, device=rewards.device).index_add_(0, idx, torch.ones_like(rewards))
    total = torch.zeros_like(size).index_add_(0, idx, rewards)
    mean = total / size
    sq = torch.zeros_like(size).index_add_(0, idx, (rewards - mean[idx]) ** 2)
    std = (sq / (size - 1).clamp(min=1.0)).sqrt()
    return mean[idx], std[idx], size[idx]


def grpo(rewards: torch.Tensor, groups, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (R - group mean) / (group std + eps). https://arxiv.org/abs/2402.03300"""
    mean, std, _ = _group_stats(rewards, groups)
    return (rewards - mean) / (std + eps)


def dr_grpo(rewards: torch.Tensor, groups) -> torch.Tensor:
    """Dr. GRPO: R - group mean, no std division. https://arxiv.org/abs/2503.20783"""
    mean, _, _ = _group_stats(rewards, groups)
    return rewards - mean


def rloo(rewards: torch.Tensor, groups) -> torch.Tensor:
    """RLOO: R_i - mean of the other members = n/(n-1)·(R_i - mean); 0 for a group of one.
    https://arxiv.org/abs/2402.14740"""
    mean, _, size = _group_stats(rewards, groups)
    return torch.where(size > 1, (rewards - mean) * size / (size - 1).clamp(min=1.0),
                       torch.zeros_like(rewards))


def reinforce_pp(rewards: torch.Tensor, groups=None, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ (https://arxiv.org/abs/2501.03262) for single rollouts, no critic, no group: (R - batch mean) /
    (batch population std + eps); 0 for a constant-reward batch. `groups` is ignored: the baseline is the batch's.

    The variant: OpenRLHF's `reinforce` (not `reinforce_baseline`, which first subtracts each prompt's group mean and
    so needs n > 1) takes the token returns (the outcome reward, gamma 1) and whitens them over every action token of
    the batch: mean and population variance token-weighted, x rsqrt(var clamped at 1e-8). Here each trajectory counts
    once (as GRPO's group statistics do), + eps on the std; the two agree when responses are equally long, and
    advantage.batch_norm=true adds the token-weighted whitening on top. The KL is the loss's (loss.kl_coef), not
    folded into the reward."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a [N] tensor, got shape {tuple(rewards.shape)}")
    r = rewards.double()  # a constant batch centres to exact zeros (a float32 mean can be an ulp off, / eps blows up)
    centred = r - r.mean()
    return (centred / (centred.pow(2).mean().sqrt() + eps)).to(rewards.dtype)


# the critic-free outcome estimators `group_advantages` picks from; all but BATCH_ESTIMATORS' baselines are a group's
GROUP_ESTIMATORS = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "reinforce_pp": reinforce_pp}
BATCH_ESTIMATORS = ("reinforce_pp",)  # baseline over the whole batch: no groups needed (any group_size rollouts)
NEEDS_GROUPS = tuple(n for n in GROUP_ESTIMATORS if n not in BATCH_ESTIMATORS)  # batches take whole groups


def group_advantages(name: str, rewards: torch.Tensor, groups, mask: torch.Tensor,
                     normalize: bool = False) -> torch.Tensor:
    """Outcome advantages of estimator `name` (GROUP_ESTIMATORS), broadcast to the [B, T] generated tokens."""
    if name not in GROUP_ESTIMATORS:
        raise ValueError(f"advantage: unknown group estimator '{name}' (choose one of {', '.join(GROUP_ESTIMATORS)})")
    adv = GROUP_ESTIMATORS[name](rewards, groups)
    full = adv[:, None].expand(mask.shape)
    tok = torch.where(mask.bool(), full, torch.zeros_like(full))
    return masked_whiten(tok, mask) if normalize else tok
