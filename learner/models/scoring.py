"""Per-token quantities the trainer and the warm start need: log-probs, entropies, values.

Shapes: `input_ids`, `attention_mask` are [B, T] (1 = real token, either padding side works:
positions are counted from the mask); every output is [B, T] aligned with the input tokens,
so `out[:, t]` belongs to token t. Padded positions hold 0.

`scored` ([B, T], e.g. the loss mask): the tokens whose log-probs or entropies are wanted; the others get 0 too, and
the packed forward runs its last layer's attention output and MoE on their predecessors alone (the trainer scores
only generated tokens: most of a batch's tokens are prompt and tool output, which only feed attention).

Sampling temperature: an agent that samples at T records log-probs of softmax(logits / T), so the
learner must score at the same T or the ratio pi/mu is far from 1 even on-policy (and the strict
clip drops those tokens). Every log-prob/entropy function here takes an optional `temperature`, a
float or a [B] tensor (one per trajectory), and divides the logits by it before the log-softmax,
as verl does. Top-p is not applied here (verl neither): see `learner.trainer.batching`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from learner.models.memory import checkpointing
from learner.models.packed import packable, packed_states
from learner.models.value import ValueHead, ValueModel

Temperature = torch.Tensor | float | None  # None or 1.0: the model's own distribution


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over the real tokens of each row, so left padding does not shift RoPE positions."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _check(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected [B, T], got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} "
                         f"does not match input_ids {tuple(input_ids.shape)}")
    return attention_mask


def policy_logits(model: PreTrainedModel, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None = None, at: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, V] fp32 logits; logits[:, t] predicts token t+1 (0 at padding for a packable model, `_packed`).
    `at` ([B, T] bool): the positions whose logits are wanted, 0 elsewhere (default: all)."""
    mask = _check(input_ids, attention_mask)
    if _packed(getattr(model, "model", None), mask):
        h, pack = packed_states(model.model, input_ids, mask, at=at)
        return pack.unpack(model.lm_head(h)).float()
    logits = hf_policy_logits(model, input_ids, mask)
    return logits if at is None else torch.where(at.bool()[..., None], logits, torch.zeros_like(logits))


def hf_policy_logits(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The HF forward's logits: the reference `policy_logits` equals (tested), and the path of every other model."""
    # MoE models take output_router_logits (off: we never want them here); others may not accept the keyword
    moe = {"output_router_logits": False} if hasattr(getattr(model, "config", None), "output_router_logits") else {}
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False, **moe)
    return out.logits.float()


def _packed(body, mask: torch.Tensor) -> bool:
    """Score with `learner.models.packed` (the same forward without padding: 1.6x less CPU for the tiny model's
    forward and backward on a padded micro-batch) on CPU, when the backbone allows it and every row has a token. On
    a GPU the HF forward stays (its fused kernels; the packing's indices are built on the CPU), and so it does under
    bf16 autocast (the packed kernels are float32) and with gradient checkpointing (the HF layers recompute)."""
    return (body is not None and mask.device.type == "cpu" and packable(body) and not checkpointing(body)
            and not torch.is_autocast_enabled("cpu") and bool(mask.bool().any(-1).all()))


def predictor_positions(scored: torch.Tensor | None) -> torch.Tensor | None:
    """[B, T] bool: the positions whose outputs predict the `scored` tokens (position t - 1 for token t)."""
    return None if scored is None else F.pad(scored[:, 1:], (0, 1)).bool()


def _shift(per_pred: torch.Tensor, mask: torch.Tensor, scored: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T-1, ...] quantities of predictions 0..T-2 -> [B, T, ...] aligned with tokens 1..T-1 (token 0 gets 0),
    0 at tokens not `scored` (default: every one)."""
    extra = per_pred.dim() - 2
    out = F.pad(per_pred, (0, 0) * extra + (1, 0))
    # Token t is scored only if it and the token before it are real (the first real token has no context).
    prev_real = F.pad(mask[:, :-1], (1, 0)).bool()
    keep = mask.bool() & prev_real & (True if scored is None else scored.bool())
    keep = keep.reshape(*mask.shape, *[1] * extra)
    return torch.where(keep, out, torch.zeros_like(out))


def scale_logits(logits: torch.Tensor, temperature: Temperature) -> torch.Tensor:
    """[B, T', V] logits / temperature (a float, or a [B] tensor: one per row); T must be > 0."""
    t = _divisor(temperature, logits)
    return logits if t is None else logits / t


def _divisor(temperature: Temperature, logits: torch.Tensor) -> torch.Tensor | None:
    """The temperature, checked and shaped to broadcast over [B, T', V]; None when it is 1 everywhere."""
    if temperature is None or (not torch.is_tensor(temperature) and temperature == 1.0):
        return None
    t = torch.as_tensor(temperature, dtype=logits.dtype, device=logits.device)
    if t.dim() > 1 or (t.dim() == 1 and t.shape[0] != logits.shape[0]) or not bool((t > 0).all()):
        raise ValueError(f"temperature: expected a float or [{logits.shape[0]}] values, all > 0, got {temperature!r}")
    if bool((t == 1).all()):  # the usual case: no [B, T, V] copy
        return None
    return t[:, None, None] if t.dim() == 1 else t


def _log_softmax(logits: torch.Tensor, temperature: Temperature) -> torch.Tensor:
    """Log-probs of predictions 0..T-2 at `temperature`."""
    return torch.log_softmax(scale_logits(logits[:, :-1].float(), temperature), dim=-1)


def _picked(logp: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T-1]: each next token's log-prob from the [B, T-1, V] log-probs of predictions 0..T-2."""
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1)


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor,
                         temperature: Temperature = None, scored: torch.Tensor | None = None) -> torch.Tensor:
    return _shift(_picked(_log_softmax(logits, temperature), input_ids), mask, scored)


def next_token_logprobs_from_logits(logits: torch.Tensor, mask: torch.Tensor, temperature: Temperature = None,
                                    scored: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, V]: the whole distribution token t was drawn from (same alignment and zeros as `logprobs_from_logits`)."""
    return _shift(_log_softmax(logits, temperature), mask, scored)


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor, temperature: Temperature = None,
                        scored: torch.Tensor | None = None) -> torch.Tensor:
    return _shift(_entropy(_log_softmax(logits, temperature)), mask, scored)


def token_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   temperature: Temperature = None, scored: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T]: log pi_T(token t | tokens < t) (T = `temperature`, default 1); 0 at the first real token, at padding
    and at tokens not `scored`."""
    mask = _check(input_ids, attention_mask)
    logits = policy_logits(model, input_ids, mask, predictor_positions(scored))
    return logprobs_from_logits(logits, input_ids, mask, temperature, scored)


def token_entropy(model: PreTrainedModel, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None = None, temperature: Temperature = None) -> torch.Tensor:
    """[B, T]: entropy of the distribution that token t was drawn from (same alignment as token_logprobs)."""
    mask = _check(input_ids, attention_mask)
    return entropy_from_logits(policy_logits(model, input_ids, mask), mask, temperature)


def next_token_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        temperature: Temperature = None, scored: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, V]: log pi_T(v | tokens < t) for every v (the forward KL's input; 0 where token_logprobs is 0)."""
    mask = _check(input_ids, attention_mask)
    logits = policy_logits(model, input_ids, mask, predictor_positions(scored))
    return next_token_logprobs_from_logits(logits, mask, temperature, scored)


def logprobs_and_entropy(model: PreTrainedModel, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor | None = None, temperature: Temperature = None,
                         full: bool = False, scored: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Both from one forward pass and one log-softmax (the trainer's usual call); `full`: also `next_token_logprobs`,
    from the same."""
    mask = _check(input_ids, attention_mask)
    logp = _log_softmax(policy_logits(model, input_ids, mask, predictor_positions(scored)), temperature)
    out = (_shift(_picked(logp, input_ids), mask, scored), _shift(_entropy(logp), mask, scored))
    return out + (_shift(logp, mask, scored),) if full else out


def values(value_model: ValueModel | ValueHead, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
           at: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T]: V(prefix ending at token t); 0 at padding and, given `at` ([B, T] bool), at positions not in it (the
    packed forward's last layer then runs on those positions alone)."""
    mask = _check(input_ids, attention_mask)
    if isinstance(value_model, (ValueModel, ValueHead)) and _packed(value_model.backbone, mask):
        with value_model.backbone_grad():
            h, pack = packed_states(value_model.backbone, input_ids, mask, at=at)
        return pack.unpack(value_model.score(h))
    v = value_model(input_ids, mask, position_ids_from_mask(mask))
    keep = mask.bool() if at is None else mask.bool() & at.bool()
    return torch.where(keep, v, torch.zeros_like(v))


def router_logits(model: nn.Module, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per MoE layer, the [B*T, E] router logits of one forward (hooked, so it works for policy and value)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    mask = _check(input_ids, attention_mask)
    found: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: found.append(out[1]))
             for m in model.modules() if isinstance(m, Qwen3MoeSparseMoeBlock)]
    try:
        backbone = model.backbone if isinstance(model, ValueModel) else model.base_model
        backbone(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return found


def expert_counts(router: list[torch.Tensor], top_k: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[L, E] number of (real) tokens routed to each expert in each layer."""
    counts = []
    for logits in router:
        sel = logits.topk(top_k, dim=-1).indices  # softmax is monotone: same choice as the block's
        if attention_mask is not None:
            sel = sel[attention_mask.reshape(-1).bool()]
        counts.append(torch.bincount(sel.reshape(-1), minlength=logits.shape[-1]))
    return torch.stack(counts)


def load_balancing_loss(router: list[torch.Tensor], top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch/Qwen3-MoE auxiliary loss E * sum_e f_e * P_e over real tokens (transformers' formula)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return load_balancing_loss_func(tuple(router), router[0].shape[-1], top_k, attention_mask)
