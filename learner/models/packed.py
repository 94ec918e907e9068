"""The warm start's loss over packed tokens: the HF Qwen3-MoE forward without padding, on the model's own weights.

`packed_loss` computes the token-mean cross-entropy of a batch whose sequences are concatenated
(`PackedBatch`), so every linear and MoE expert runs once per batch on all its tokens; only
attention is padded, per group of similar lengths. It equals the HF forward's loss and gradients
on a right-padded batch (`make_batch`, `lm_loss`: the reference, tested against it) and runs faster
on CPU: gathers with index_select (backward index_add, not index_put), each expert's gate and up
as one matmul.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from learner.models.tokenizer import CharTokenizer


def make_batch(tok: CharTokenizer, items: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, ...]:
    T = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), T), tok.pad_id, dtype=torch.long)
    mask = torch.zeros(len(items), T, dtype=torch.long)
    attn = torch.zeros(len(items), T, dtype=torch.long)
    for i, (x, m) in enumerate(items):
        ids[i, :len(x)], mask[i, :len(m)], attn[i, :len(x)] = torch.tensor(x), torch.tensor(m), 1
    return ids, mask, attn


def lm_loss(model, ids: torch.Tensor, mask: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The reference: the HF forward on a right-padded batch (`make_batch`). Training uses `packed_loss`."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # [B, T-1, V] predicts ids[:, 1:]
    target, m = ids[:, 1:], mask[:, 1:].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="none")
    return (nll * m.reshape(-1)).sum() / m.sum().clamp(min=1)


class PackedBatch:
    """A batch's tokens concatenated without padding, with the indices `packed_loss` needs.

    Sequences are sorted by length and split into `groups`; attention runs per group, right-padded
    to the group's longest sequence (a causal mask then keeps every real query off the padding)."""

    def __init__(self, items: list[tuple[list[int], list[int]]], groups: int) -> None:
        items = sorted(items, key=lambda x: len(x[0]))
        lens = [len(ids) for ids, _ in items]
        self.ids = torch.tensor([t for ids, _ in items for t in ids], dtype=torch.long)  # [N]
        self.pos = torch.cat([torch.arange(n) for n in lens])  # position within its sequence
        n = len(self.ids)
        starts = torch.tensor([0] + lens[:-1]).cumsum(0)
        scored = torch.tensor([x for _, m in items for x in m], dtype=torch.bool)
        scored[starts] = False  # a sequence's first token has no prediction before it
        self.pred = scored.nonzero().flatten() - 1  # token j predicts token j + 1 of the same sequence
        self.target = self.ids[self.pred + 1]
        size = math.ceil(len(items) / groups)
        index, self.groups = [], []  # per group: rows, padded length, its real slots (row-major)
        for g in range(0, len(items), size):
            glens = torch.tensor(lens[g:g + size])
            T = int(glens.max())
            real = torch.arange(T)[None] < glens[:, None]  # [b, T]
            index.append(torch.where(real, starts[g:g + size, None] + torch.arange(T), n).flatten())  # n: padding
            self.groups.append((len(glens), T, real.flatten().nonzero().flatten()))
        self.gather = torch.cat(index)  # every group's padded layout, from the packed tokens plus a zero row


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _expert(ex, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x), with gate and up as one matmul (fewer, larger products run faster on CPU)."""
    gate, up = F.linear(x, torch.cat([ex.gate_proj.weight, ex.up_proj.weight])).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, ex.down_proj.weight)


def packed_loss(model, batch: PackedBatch) -> torch.Tensor:
    """Token-mean cross-entropy of the scored tokens: the HF Qwen3-MoE forward (`lm_loss`), computed on the
    packed tokens with the model's own parameters (gradients reach them)."""
    cfg, body = model.config, model.model
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d, eps = cfg.hidden_size // hq, cfg.rms_norm_eps
    rope = body.rotary_emb
    freqs = batch.pos[:, None].float() * rope.inv_freq.float()
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = (emb.cos() * rope.attention_scaling)[:, None], (emb.sin() * rope.attention_scaling)[:, None]
    x = body.embed_tokens(batch.ids)  # [N, H]
    n = x.shape[0]
    for layer in body.layers:
        att, moe = layer.self_attn, layer.mlp
        if not hasattr(moe, "experts") or att.q_proj.bias is not None:
            raise ValueError("packed_loss: every layer must be a sparse MoE layer without attention bias")
        h = _rms(x, layer.input_layernorm.weight, eps)
        q = _rotate(_rms(F.linear(h, att.q_proj.weight).view(n, hq, d), att.q_norm.weight, eps), cos, sin)
        k = _rotate(_rms(F.linear(h, att.k_proj.weight).view(n, hkv, d), att.k_norm.weight, eps), cos, sin)
        v = F.linear(h, att.v_proj.weight).view(n, hkv, d)
        qkv = torch.cat([q, k, v], dim=1)  # [N, hq + 2 hkv, d]
        padded = F.pad(qkv, (0, 0, 0, 0, 0, 1)).index_select(0, batch.gather)  # backward: index_add, not index_put
        outs = []
        for (b, T, real), g in zip(batch.groups, padded.split([b * T for b, T, _ in batch.groups])):
            g = g.view(b, T, -1, d).transpose(1, 2)  # [b, heads, T, d]
            o = F.scaled_dot_product_attention(g[:, :hq], g[:, hq:hq + hkv], g[:, hq + hkv:hq + 2 * hkv],
                                               is_causal=True, scale=d ** -0.5, enable_gqa=hq != hkv)
            outs.append(o.transpose(1, 2).reshape(b * T, hq * d).index_select(0, real))
        x = x + F.linear(torch.cat(outs), att.o_proj.weight)
        h = _rms(x, layer.post_attention_layernorm.weight, eps)
        probs = torch.softmax(F.linear(h, moe.gate.weight), dim=-1, dtype=torch.float)
        weights, chosen = probs.topk(moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        order = chosen.flatten().argsort(stable=True)  # (token, slot) pairs grouped by expert
        token = order // moe.top_k
        counts = torch.bincount(chosen.flatten(), minlength=moe.num_experts).tolist()
        parts = [_expert(ex, xe)  # one gather for all experts, split: one scatter in backward
                 for ex, xe, count in zip(moe.experts, h.index_select(0, token).split(counts), counts) if count]
        y = torch.cat(parts) * weights.flatten().index_select(0, order).to(h.dtype).unsqueeze(-1)
        x = x + torch.zeros_like(h).index_add(0, token, y)
    logits = F.linear(_rms(x.index_select(0, batch.pred), body.norm.weight, eps), model.lm_head.weight)
    return F.cross_entropy(logits, batch.target)
