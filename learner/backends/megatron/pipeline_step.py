"""The trainer's critic and policy backward passes at pipeline parallelism (`sao learn`, backend.pipeline_parallel > 1).

learner.trainer.step's `value_backward` and `policy_backward` call a model and take the loss micro-batch by
micro-batch; at PP a micro-batch's forward runs across the stages and its loss on the last one only, so `update`
hands both passes to the backend (`MegatronBackend.scheduled_backward`), which runs them through megatron-core's
1F1B schedule (`pipeline.run`) with the trainer's own losses, weights and metrics:

    micro-batches  ceil(B / batch.micro_batch) of equal rows (the schedule's point-to-point shapes are fixed), the
                   batch padded with copies of its first row under a zero loss mask (batch.micro_tokens unused)
    weights        a micro-batch's loss times scale x its share of the batch's normaliser (`step._denom`), as
                   `policy_backward` weighs it; the schedule's division by the number of micro-batches is undone
                   (`pipeline.run`)
    metrics        `step._accumulate` of the micro-batches' on the last stage, then sent to the other stages

The references (advantages, old values, returns, prox_logp) come from `prepare`, whose forwards without a graph
the HF-call wrappers run through the schedule (`hf_compat`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from learner.algorithms import policy_loss, value_loss
from learner.algorithms.masked import masked_mean
from learner.backends.megatron import pipeline
from learner.models.scoring import entropy_from_logits
from learner.trainer.batching import Batch


def padded_rows(n: int, size: int) -> tuple[int, torch.Tensor]:
    """(micro-batches, row index): `n` rows in ceil(n / size) micro-batches of equal rows, the missing rows filled
    with row 0 (their loss mask is zeroed by the caller)."""
    micro = -(-n // max(size, 1))
    per = -(-n // micro)
    return micro, torch.cat([torch.arange(n), torch.zeros(micro * per - n, dtype=torch.long)])


def _value_loss(cfg):
    def loss_fn(v: torch.Tensor, mb: dict):
        state_v = F.pad(v[:, :-1].float(), (1, 0))  # V(tokens < t), as step.state_values
        return value_loss(state_v, mb["old_values"], mb["returns"], mb["loss_mask"], cfg.value.value_clip,
                          cfg.value.agg)
    return loss_fn


def _policy_loss(cfg):
    params = cfg.loss.params()

    def loss_fn(logp: torch.Tensor, mb: dict):
        extra = {"prox_logp": mb["prox_logp"]} if "prox_logp" in mb else {}
        loss, m = policy_loss(cfg.loss.name, logp, mb["old_logp"], mb["advantages"], mb["loss_mask"], **params,
                              **extra)
        with torch.no_grad():
            ent = entropy_from_logits(mb["logits"], mb["attention_mask"], mb.get("temperature"))
        m["entropy"] = float(masked_mean(ent, mb["loss_mask"]))
        return loss, m
    return loss_fn


def scheduled_backward(kind: str, cfg, model: torch.nn.Module, batch: Batch, ref: dict, norm: float | None,
                       scale: float, tp: int) -> dict[str, float]:
    """`value_backward` ("value") or `policy_backward` ("policy") of learner.trainer.step through the schedule;
    the batch's metrics on every stage."""
    from learner.trainer.step import _accumulate, _denom, policy_agg

    agg = cfg.value.agg if kind == "value" else policy_agg(cfg)
    full = _denom(batch.loss_mask, agg) if norm is None else norm
    n, idx = padded_rows(batch.input_ids.shape[0], cfg.batch.micro_batch)
    real = (torch.arange(idx.shape[0]) < batch.input_ids.shape[0]).to(batch.loss_mask.dtype)
    data = {"input_ids": batch.input_ids[idx], "attention_mask": batch.attention_mask[idx],
            "loss_mask": batch.loss_mask[idx] * real[:, None], "old_logp": batch.old_logp[idx],
            **{k: v[idx] for k, v in ref.items()}}
    if batch.temperature is not None:
        data["temperature"] = batch.temperature[idx]
    mbs = pipeline.micro_batches(data, n, tp)
    for mb in mbs:
        mb["weight"] = scale * _denom(mb["loss_mask"], agg) / max(full, 1.0)
    loss_fn = _value_loss(cfg) if kind == "value" else _policy_loss(cfg)
    out = pipeline.run(model, mbs, loss_fn, forward_only=False, values=kind == "value")
    total: dict[str, float] = {}
    for r, mb in zip(out, mbs):
        _accumulate(total, r["stats"], mb["weight"], not mb["loss_mask"].any())
    return pipeline.share_stats(total if out else None)
