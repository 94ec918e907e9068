"""One learner update on one batch: values, advantages, clipped value loss, policy loss, guarded step.

Alignment: every `[B, T]` tensor is indexed by token. The policy's log-prob of token t comes from
the logits at t-1 (`learner.models.scoring`); the value of the state in which token t was chosen is
the value model's output at t-1 (the prefix before t), which is what GAE and the critic use here.

A non-finite loss or gradient norm anywhere in the batch skips the whole update (both models), so
non-finite values never reach the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from learner.algorithms import group_advantages, loss_params, place_reward, policy_loss, sao_advantages, value_loss
from learner.algorithms.masked import masked_mean
from learner.config import LearnerConfig
from learner.models.scoring import logprobs_and_entropy, token_logprobs, values
from learner.trainer.batching import Batch, group_key


@dataclass
class Models:
    policy: torch.nn.Module
    policy_opt: torch.optim.Optimizer
    value: torch.nn.Module | None = None
    value_opt: torch.optim.Optimizer | None = None


def build_optimizers(cfg: LearnerConfig, policy: torch.nn.Module, value: torch.nn.Module | None) -> Models:
    o = cfg.optim
    popt = torch.optim.AdamW(policy.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    vopt = (torch.optim.AdamW(value.parameters(), lr=o.value_lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
            if value is not None else None)
    return Models(policy, popt, value, vopt)


def state_values(value_model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """[B, T]: V(tokens < t), the value of the state in which token t was generated."""
    v = values(value_model, batch.input_ids, batch.attention_mask)
    return F.pad(v[:, :-1], (1, 0))


def _micro(batch: Batch, size: int):
    for i in range(0, batch.input_ids.shape[0], size):
        yield i, min(i + size, batch.input_ids.shape[0])


def _denom(mask: torch.Tensor, agg: str) -> float:
    """The aggregation's normaliser, so micro-batch losses sum to the full-batch loss."""
    return float(mask.sum()) if agg == "token_mean" else float(mask.bool().any(-1).sum())


@torch.no_grad()
def prepare(cfg: LearnerConfig, models: Models, batch: Batch) -> dict[str, torch.Tensor]:
    """Advantages, critic targets and the fixed references of this batch (no gradient)."""
    a, mask, out = cfg.advantage, batch.loss_mask, {}
    if cfg.uses_value_model:
        old_v = torch.cat([state_values(models.value, batch.rows(i, j)) for i, j in _micro(batch, cfg.batch.micro_batch)])
        old_v = torch.where(mask.bool(), old_v, torch.zeros_like(old_v))
        rewards = place_reward(batch.rewards, mask)
        adv, ret = sao_advantages(rewards, old_v, mask, a.gamma, a.lam_actor, a.lam_critic, a.adaptive_alpha,
                                  a.batch_norm)
        out.update(old_values=old_v, returns=ret)
    else:
        groups = [group_key(t) for t in batch.trajectories]
        adv = group_advantages(a.estimator, batch.rewards, groups, mask, a.batch_norm)
    out["advantages"] = adv
    if cfg.loss.name == "decoupled_ppo":  # AReaL's proximal policy: the learner's weights before this update
        out["prox_logp"] = torch.cat([token_logprobs(models.policy, b.input_ids, b.attention_mask)
                                      for b in (batch.rows(i, j) for i, j in _micro(batch, cfg.batch.micro_batch))])
    return out


def _accumulate(total: dict[str, float], metrics: dict[str, float], w: float) -> None:
    for k, v in metrics.items():
        if k.endswith("_max"):
            total[k] = max(total.get(k, v), v)
        elif k == "n_tokens":
            total[k] = total.get(k, 0.0) + v
        else:
            total[k] = total.get(k, 0.0) + w * v


def value_backward(cfg: LearnerConfig, models: Models, batch: Batch, ref: dict) -> dict[str, float]:
    agg, total, full = cfg.value.agg, {}, _denom(batch.loss_mask, cfg.value.agg)
    for i, j in _micro(batch, cfg.batch.micro_batch):
        mb, mask = batch.rows(i, j), batch.loss_mask[i:j]
        w = _denom(mask, agg) / max(full, 1.0)
        v = state_values(models.value, mb)
        loss, m = value_loss(v, ref["old_values"][i:j], ref["returns"][i:j], mask, cfg.value.value_clip, agg)
        (loss * w).backward()
        _accumulate(total, m, w)
    return total


def policy_backward(cfg: LearnerConfig, models: Models, batch: Batch, ref: dict) -> dict[str, float]:
    params = cfg.loss.params()
    agg = params.get("agg") or loss_params(cfg.loss.name)["agg"]
    total, full = {}, _denom(batch.loss_mask, agg)
    for i, j in _micro(batch, cfg.batch.micro_batch):
        mb, mask = batch.rows(i, j), batch.loss_mask[i:j]
        w = _denom(mask, agg) / max(full, 1.0)
        logp, ent = logprobs_and_entropy(models.policy, mb.input_ids, mb.attention_mask)
        extra = {"prox_logp": ref["prox_logp"][i:j]} if "prox_logp" in ref else {}
        loss, m = policy_loss(cfg.loss.name, logp, mb.old_logp, ref["advantages"][i:j], mask, **params, **extra)
        (loss * w).backward()
        m["entropy"] = float(masked_mean(ent.detach(), mask))
        _accumulate(total, m, w)
    return total


def _grad_norm(model: torch.nn.Module, clip: float) -> float:
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))


def update(cfg: LearnerConfig, models: Models, batch: Batch, ref: dict, train_policy: bool) -> tuple[dict[str, float], bool]:
    """One optimizer step of the critic (if any) and, unless warming up, the policy.

    Returns (metrics, applied); applied is False when a loss or gradient was non-finite."""
    opts = [o for o in (models.policy_opt, models.value_opt) if o is not None]
    for o in opts:
        o.zero_grad(set_to_none=True)
    metrics: dict[str, float] = {}
    finite = True
    if models.value is not None:
        metrics.update(value_backward(cfg, models, batch, ref))
        metrics["value_grad_norm"] = _grad_norm(models.value, cfg.optim.grad_clip)
        finite &= all(map(_finite, (metrics["value_loss"], metrics["value_grad_norm"])))
    if train_policy and finite:
        pm = policy_backward(cfg, models, batch, ref)
        metrics.update({("policy_loss" if k == "loss" else k): v for k, v in pm.items()})
        metrics["grad_norm"] = _grad_norm(models.policy, cfg.optim.grad_clip)
        finite &= all(map(_finite, (metrics["policy_loss"], metrics["grad_norm"])))
    if not finite:
        for o in opts:
            o.zero_grad(set_to_none=True)
        return metrics, False
    if models.value_opt is not None:
        models.value_opt.step()
    if train_policy:
        models.policy_opt.step()
    return metrics, True


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")
