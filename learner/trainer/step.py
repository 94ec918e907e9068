"""One learner update on one batch: values, advantages, clipped value loss, policy loss, guarded step.

Alignment: every `[B, T]` tensor is indexed by token. The policy's log-prob of token t comes from
the logits at t-1 (`learner.models.scoring`); the value of the state in which token t was chosen is
the value model's output at t-1 (the prefix before t), which is what GAE and the critic use here.
Log-probs and entropies (the policy loss, decoupled PPO's proximal policy) are taken at each
trajectory's sampling temperature (`Batch.temperature`), so the ratio is 1 on-policy.

A non-finite loss or gradient norm anywhere in the batch skips the whole update (both models), so
non-finite values never reach the weights. The weights change only in the optimizer steps at the end of `update`:
an exception before them leaves the weights and the optimizers as they were, one during them is a `HalfApplied`.

Over several ranks (`shard`, see learner.trainer.ranks) the references are computed on the whole
batch, each rank back-propagates its own rows weighted against the whole batch's token count, and
metrics, gradients and the clip are reduced over the ranks before the finite check (gradients and clip by the
backend's `clip_grads`, see learner.backends.base), so every rank takes the same decision.

With `loss.kl_coef > 0` the policy loss also carries kl_coef · agg(kl_penalty(pi, ref)) (or agg(forward_kl), from
both models' whole next-token distributions, with `loss.kl_type=forward`), a KL penalty to
the frozen initial policy (`Models.reference`, verl's use_kl_loss), aggregated and micro-batch weighted
like the policy loss; `kl_ref` reports its masked per-token mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from learner.algorithms import (
    FULL_KL_TYPES,
    aggregate,
    forward_kl,
    group_advantages,
    kl_penalty,
    loss_params,
    place_reward,
    policy_loss,
    sao_actor_advantages,
    sao_returns,
    value_loss,
)
from learner.algorithms.masked import masked_mean
from learner.algorithms.shaping import shaped_rewards
from learner.config import LearnerConfig
from learner.models.lora import trainable
from learner.models.memory import autocast
from learner.models.scoring import (
    logprobs_and_entropy,
    next_token_logprobs,
    predictor_positions,
    token_logprobs,
    values,
)
from learner.trainer.batching import Batch, group_key
from learner.trainer.ranks import Shard
from streamer.wire.reductions import reduction


@dataclass
class Models:
    policy: torch.nn.Module
    policy_opt: torch.optim.Optimizer
    value: torch.nn.Module | None = None
    value_opt: torch.optim.Optimizer | None = None
    reference: torch.nn.Module | None = None  # frozen initial policy for the KL penalty (loss.kl_coef > 0), else None
    # the learner.backends.base.Backend holding these models (its gradient clip, export, ranks);
    # None: plain torch in this process (build_optimizers alone, e.g. a benchmark of the step)
    backend: object | None = None

    def clip_grads(self, model: torch.nn.Module, max_norm: float) -> float:
        """The global gradient norm of `model` (before clipping), its gradients clipped to `max_norm`."""
        if self.backend is not None:
            return self.backend.clip_grads(model, max_norm)
        return clip_grad_norm(model, max_norm)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """One process: torch's clip by the global L2 norm of all gradients; returns that norm."""
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def build_optimizers(cfg: LearnerConfig, policy: torch.nn.Module, value: torch.nn.Module | None,
                     backend: object | None = None) -> Models:
    """AdamW over `policy` (and `value`) in this process; `backend`: the Backend the Models belong to."""
    o = cfg.optim

    def adamw(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
        # fused: one kernel over all parameters; torch's default per-tensor loop took 53 of 585 ms of a CPU step
        # only what takes gradients: with LoRA the adapters alone hold AdamW state
        return torch.optim.AdamW(trainable(model), lr=lr, betas=tuple(o.betas), weight_decay=o.weight_decay,
                                 fused=True)

    return Models(policy, adamw(policy, o.lr), value, adamw(value, o.value_lr) if value is not None else None,
                  backend=backend)


def state_values(value_model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """[B, T]: V(tokens < t), the value of the state in which token t was generated; 0 off the loss mask (every use
    is masked), so the value forward's last layer runs on those states alone."""
    v = values(value_model, batch.input_ids, batch.attention_mask, at=predictor_positions(batch.loss_mask))
    return F.pad(v[:, :-1].float(), (1, 0))  # float32 under bf16 autocast too: the losses and GAE read it


def _compute(cfg: LearnerConfig, batch: Batch):
    """The context of the forwards: bf16 autocast under learner.precision=bfloat16 (learner.models.memory)."""
    return autocast(cfg.precision, batch.input_ids.device.type)


def _micro(batch: Batch, size: int, by_length: bool = True, tokens: int = 0):
    """Row ranges of at most `size` rows; on a batch sorted by length (`by_length`), a range also closes before a
    row more than twice as long as its first, so each micro-batch (cut to its own width) is at least half tokens.
    `tokens` > 0 (batch.micro_tokens): instead of `size`, a range closes before a row that would take its rows x its
    longest row past `tokens` (a row longer than that goes alone).
    `by_length` False: by `size` alone, for one rank's shard (each rank's forwards are collectives with the other
    ranks', expert parallelism: every rank must cut its rows, as many on each, into as many micro-batches)."""
    lengths = batch.attention_mask.sum(-1).tolist()
    start, width = 0, 0
    for i, n in enumerate(lengths):
        width = max(width, n)
        full = (i - start + 1) * width > tokens if tokens and by_length else i - start >= size
        if i > start and (full or by_length and n > 2 * max(lengths[start], 1)):
            yield start, i
            start, width = i, n
    if lengths:
        yield start, len(lengths)


def _cuts(cfg: LearnerConfig, batch: Batch, by_length: bool = True):
    """`batch`'s micro-batches as learner.batch sets them (micro_tokens, else micro_batch rows)."""
    return _micro(batch, cfg.batch.micro_batch, by_length, cfg.batch.micro_tokens)


def _join_rows(parts, width: int) -> torch.Tensor:
    """Micro-batch outputs ([b, t, ...], each cut to its own width t), padded with zeros to `width` and stacked in
    row order."""
    return torch.cat([F.pad(out, (0, 0) * (out.dim() - 2) + (0, width - out.shape[1])) for out in parts])


def _per_micro(cfg: LearnerConfig, batch: Batch, fn) -> torch.Tensor:
    """`fn` over each micro-batch (cut to its own width), padded back with zeros to the batch's `[B, T]`."""
    with _compute(cfg, batch):
        return _join_rows((fn(batch.rows(i, j)).float() for i, j in _cuts(cfg, batch)), batch.input_ids.shape[1])


def _denom(mask: torch.Tensor, agg: str) -> float:
    """The aggregation's normaliser, so micro-batch losses sum to the full-batch loss."""
    return float(mask.sum()) if agg == "token_mean" else float(mask.bool().any(-1).sum())


def _old_values(batch: Batch, state_v: torch.Tensor) -> torch.Tensor:
    """The critic's values of `batch`'s states as fixed references: detached, 0 off the loss mask."""
    return torch.where(batch.loss_mask.bool(), state_v.detach(), torch.zeros_like(state_v))


def rewards(cfg: LearnerConfig, batch: Batch) -> torch.Tensor:
    """[B] the rewards the advantages are computed from: the trajectories' own, plus DAPO's soft overlong punishment
    of their generated tokens with advantage.overlong (learner.algorithms.shaping)."""
    return shaped_rewards(batch.rewards, batch.loss_mask, cfg.advantage.overlong)


def _returns(cfg: LearnerConfig, batch: Batch, old_v: torch.Tensor) -> torch.Tensor:
    """Critic targets from the old values: each row's own, so a micro-batch's are the batch's rows."""
    mask = batch.loss_mask
    return sao_returns(place_reward(rewards(cfg, batch), mask), old_v, mask, cfg.advantage.gamma,
                       cfg.advantage.lam_critic)


def _advantages(cfg: LearnerConfig, batch: Batch, old_v: torch.Tensor) -> torch.Tensor:
    """Actor advantages from the old values (whitened over the whole `batch` when advantage.batch_norm)."""
    a, mask = cfg.advantage, batch.loss_mask
    return sao_actor_advantages(place_reward(rewards(cfg, batch), mask), old_v, mask, a.gamma, a.lam_actor,
                                a.adaptive_alpha, a.batch_norm)


def critic_refs(cfg: LearnerConfig, batch: Batch, state_v: torch.Tensor) -> dict[str, torch.Tensor]:
    """The critic's references from its values of `batch`'s states: old_values, returns and advantages."""
    old_v = _old_values(batch, state_v)
    return {"old_values": old_v, "returns": _returns(cfg, batch, old_v), "advantages": _advantages(cfg, batch, old_v)}


@torch.no_grad()
def prepare(cfg: LearnerConfig, models: Models, batch: Batch, values_from_update: bool = False,
            train_policy: bool = True) -> dict[str, torch.Tensor]:
    """Advantages, critic targets and the fixed references of this batch (no gradient).

    `values_from_update`: leave the critic's references to the first `update` on this batch, whose value forward
    (with gradient, same weights) gives the same values: one value forward fewer a batch. One process only.
    `train_policy` False (a critic-only batch): no policy references (prox_logp, ref_logp), which only the policy
    loss reads."""
    out = {}
    if cfg.uses_value_model:
        if not values_from_update:
            out.update(critic_refs(cfg, batch, _per_micro(cfg, batch, lambda b: state_values(models.value, b))))
    else:
        groups = [group_key(t) for t in batch.trajectories]
        out["advantages"] = group_advantages(cfg.advantage.estimator, rewards(cfg, batch), groups, batch.loss_mask,
                                             cfg.advantage.batch_norm)
    if not train_policy:
        return out
    if cfg.loss.name == "decoupled_ppo":  # AReaL's proximal policy: the learner's weights before this update
        out["prox_logp"] = _per_micro(cfg, batch, lambda b: token_logprobs(models.policy, b.input_ids,
                                                                          b.attention_mask, b.temperature,
                                                                          b.loss_mask))
    if cfg.loss.kl_coef > 0:  # the frozen reference policy, at each trajectory's sampling temperature
        if models.reference is None:
            raise ValueError("loss.kl_coef > 0 needs Models.reference "
                             "(build the models with learner.train.build_models)")
        score = next_token_logprobs if cfg.loss.kl_type in FULL_KL_TYPES else token_logprobs
        out["ref_logp"] = _per_micro(cfg, batch, lambda b: score(models.reference, b.input_ids, b.attention_mask,
                                                                 b.temperature, b.loss_mask))
    return out


def _accumulate(total: dict[str, float], metrics: dict[str, float], w: float, empty: bool = False) -> None:
    """Micro-batch metrics into the batch's, by each metric's declared reduction (streamer.wire.reductions):
    max, sum, or a mean weighted by the micro-batch's share `w`."""
    for k, v in metrics.items():
        how = reduction(f"learner/{k}")
        if how == "max":  # an all-padding micro-batch (they come last) keeps the max
            total[k] = v if k not in total else total[k] if empty else max(total[k], v)
        elif how == "sum":
            total[k] = total.get(k, 0.0) + v
        else:
            total[k] = total.get(k, 0.0) + w * v


def value_backward(cfg: LearnerConfig, models: Models, batch: Batch, ref: dict, norm: float | None = None,
                   scale: float = 1.0) -> dict[str, float]:
    """`norm`: the whole batch's normaliser when `batch` is one rank's rows; `scale`: the ranks (W).
    Without ref["old_values"] (`prepare(..., values_from_update=True)`), this forward's values are the references:
    each micro-batch's returns come from its own rows, and the batch's advantages are added after the last."""
    agg, total, scored = cfg.value.agg, {}, []
    full = _denom(batch.loss_mask, agg) if norm is None else norm
    for i, j in _cuts(cfg, batch, by_length=norm is None):  # a shard (norm given): by size
        mb = batch.rows(i, j)
        mask, cols = mb.loss_mask, slice(0, mb.input_ids.shape[1])
        w = scale * _denom(mask, agg) / max(full, 1.0)
        with _compute(cfg, mb):
            v = state_values(models.value, mb)
        if "old_values" in ref:
            old_v, ret = ref["old_values"][i:j, cols], ref["returns"][i:j, cols]
        else:
            old_v = _old_values(mb, v)
            ret = _returns(cfg, mb, old_v)
            scored.append((old_v, ret))
        loss, m = value_loss(v, old_v, ret, mask, cfg.value.value_clip, agg)
        (loss * w).backward()
        _accumulate(total, m, w, not mask.any())
    if scored:
        T = batch.input_ids.shape[1]
        old_v, ret = _join_rows((o for o, _ in scored), T), _join_rows((r for _, r in scored), T)
        ref.update(old_values=old_v, returns=ret, advantages=_advantages(cfg, batch, old_v))
    return total


def policy_agg(cfg: LearnerConfig) -> str:
    return cfg.loss.params().get("agg") or loss_params(cfg.loss.name)["agg"]


def policy_backward(cfg: LearnerConfig, models: Models, batch: Batch, ref: dict, norm: float | None = None,
                    scale: float = 1.0) -> dict[str, float]:
    params, agg = cfg.loss.params(), policy_agg(cfg)
    total, full = {}, _denom(batch.loss_mask, agg) if norm is None else norm
    whole = "ref_logp" in ref and cfg.loss.kl_type in FULL_KL_TYPES  # the forward KL reads pi's [b, t, V]
    for i, j in _cuts(cfg, batch, by_length=norm is None):  # a shard (norm given): by size
        mb = batch.rows(i, j)
        mask, cols = mb.loss_mask, slice(0, mb.input_ids.shape[1])
        w = scale * _denom(mask, agg) / max(full, 1.0)
        with _compute(cfg, mb):
            logp, ent, *dist = logprobs_and_entropy(models.policy, mb.input_ids, mb.attention_mask, mb.temperature,
                                                    whole, mask)
        extra = {"prox_logp": ref["prox_logp"][i:j, cols]} if "prox_logp" in ref else {}
        loss, m = policy_loss(cfg.loss.name, logp, mb.old_logp, ref["advantages"][i:j, cols], mask, **params, **extra)
        if "ref_logp" in ref:
            kl = (forward_kl(dist[0], ref["ref_logp"][i:j, cols], mask) if whole else
                  kl_penalty(logp, ref["ref_logp"][i:j, cols], mask, cfg.loss.kl_type))
            loss = loss + cfg.loss.kl_coef * aggregate(kl, mask, agg)
            m["loss"] = float(loss.detach())
            m["kl_ref"] = float(masked_mean(kl.detach(), mask))
        (loss * w).backward()
        m["entropy"] = float(masked_mean(ent.detach(), mask))
        _accumulate(total, m, w, not mask.any())
    return total


def shard_batch(batch: Batch, ref: dict[str, torch.Tensor], shard: Shard) -> tuple[Batch, dict[str, torch.Tensor]]:
    """This rank's rows of the batch and its references; padding rows get a zero loss mask."""
    idx, real = shard.index.to(batch.loss_mask.device), shard.real.to(batch.loss_mask.device)
    mask = batch.loss_mask[idx] * real[:, None].to(batch.loss_mask.dtype)
    temp = None if batch.temperature is None else batch.temperature[idx]
    local = Batch(batch.input_ids[idx], batch.attention_mask[idx], mask, batch.old_logp[idx], batch.rewards[idx],
                  [batch.trajectories[i] for i in shard.index.tolist()] if batch.trajectories else [], temp)
    return local, {k: v[idx] for k, v in ref.items()}


def _identity(m: dict[str, float]) -> dict[str, float]:
    return m


def update(cfg: LearnerConfig, models: Models, batch: Batch, ref: dict, train_policy: bool,
           shard: Shard | None = None) -> tuple[dict[str, float], bool]:
    """One optimizer step of the critic (if any) and, unless warming up, the policy.

    With `shard`, this rank trains on its rows of `batch` (every rank calls this with the same
    batch). Returns (metrics, applied); applied is False when a loss or gradient was non-finite."""
    opts = [o for o in (models.policy_opt, models.value_opt) if o is not None]
    for o in opts:
        o.zero_grad(set_to_none=True)
    norms: dict[str, float | None] = {"value": None, "policy": None}
    scale, reduce = 1.0, _identity
    if shard is not None:
        if models.value is not None and "old_values" not in ref:
            raise ValueError("update with shard: the critic's references must come from prepare "
                             "(values_from_update=False), since each rank scores only its rows")
        norms = {"value": _denom(batch.loss_mask, cfg.value.agg), "policy": _denom(batch.loss_mask, policy_agg(cfg))}
        scale, reduce = float(shard.world), shard.reduce
        batch, ref = shard_batch(batch, ref, shard)
    metrics: dict[str, float] = {}
    finite = True
    # at pipeline parallelism the backend runs each backward through its schedule (same losses and weights)
    scheduled = getattr(models.backend, "scheduled_backward", None) if getattr(models.backend, "pipelined", False) \
        else None
    if models.value is not None:
        backward = value_backward if scheduled is None else lambda *a: scheduled("value", *a)
        metrics.update(reduce(backward(cfg, models, batch, ref, norms["value"], scale)))
        metrics["value_grad_norm"] = models.clip_grads(models.value, cfg.optim.grad_clip)
        finite &= all(map(_finite, (metrics["value_loss"], metrics["value_grad_norm"])))
    if train_policy and finite:
        backward = policy_backward if scheduled is None else lambda *a: scheduled("policy", *a)
        pm = reduce(backward(cfg, models, batch, ref, norms["policy"], scale))
        metrics.update({("policy_loss" if k == "loss" else k): v for k, v in pm.items()})
        metrics["grad_norm"] = models.clip_grads(models.policy, cfg.optim.grad_clip)
        finite &= all(map(_finite, (metrics["policy_loss"], metrics["grad_norm"])))
    if not finite:
        for o in opts:
            o.zero_grad(set_to_none=True)
        return metrics, False
    try:
        if models.value_opt is not None:
            models.value_opt.step()
        if train_policy:
            models.policy_opt.step()
    except Exception as e:
        raise HalfApplied(f"an optimizer step failed part way ({type(e).__name__}: {e})") from e
    return metrics, True


class HalfApplied(RuntimeError):
    """A batch failed after some of its updates reached the weights: only a restart from the checkpoint undoes
    them (learner.trainer.quarantine)."""


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")
