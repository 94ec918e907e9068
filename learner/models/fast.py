"""A compact inference forward of the same Qwen3-MoE weights, with a preallocated KV cache.

The HF model stays the reference and the checkpoint format; this path exists because HF's
per-expert Python loop and dynamic cache dominate decode time for a model this small. It
reads weights packed from an HF `Qwen3MoeForCausalLM` (`pack_weights`), so it must be
repacked after the HF weights change. Parity with the HF forward is tested to 1e-5 (fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import Qwen3MoeForCausalLM

# Up to this many tokens the MoE runs densely over all experts (one matmul, no Python loop,
# E/k times the FLOPs); above it, tokens are grouped per expert. Measured on 1-2 CPU threads:
# dense wins only for a handful of tokens, the per-expert loop from ~16 on.
DENSE_MOE_MAX_TOKENS = 8


@dataclass
class LayerWeights:
    ln_attn: torch.Tensor  # [H]
    w_qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, H]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    w_o: torch.Tensor  # [H, Hq * D]
    ln_mlp: torch.Tensor  # [H]
    router: torch.Tensor  # [E, H]
    w_gate_up: torch.Tensor  # [E, 2I, H]: gate rows then up rows, per expert
    w_down: torch.Tensor  # [E, H, I]
    w_down_flat: torch.Tensor  # [E * I, H]: the dense path's single down matmul


@dataclass
class PackedWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    inv_freq: torch.Tensor  # [D / 2]
    rope_scale: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    top_k: int
    norm_topk: bool
    eps: float


@torch.no_grad()
def pack_weights(model: Qwen3MoeForCausalLM) -> PackedWeights:
    """A snapshot (copies) of the weights: later in-place updates of `model` do not leak into it."""
    cfg = model.config
    layers = []
    for layer in model.model.layers:
        att, moe = layer.self_attn, layer.mlp
        if not hasattr(moe, "experts"):
            raise ValueError("pack_weights: every layer must be sparse (decoder_sparse_step=1, no mlp_only_layers)")
        gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in moe.experts])
        down = torch.stack([e.down_proj.weight for e in moe.experts])
        layers.append(LayerWeights(
            ln_attn=layer.input_layernorm.weight.detach().clone(),
            w_qkv=torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).contiguous(),
            q_norm=att.q_norm.weight.detach().clone(), k_norm=att.k_norm.weight.detach().clone(),
            w_o=att.o_proj.weight.detach().clone(), ln_mlp=layer.post_attention_layernorm.weight.detach().clone(),
            router=moe.gate.weight.detach().clone(), w_gate_up=gate_up.contiguous(), w_down=down.contiguous(),
            w_down_flat=down.transpose(1, 2).reshape(-1, down.shape[1]).contiguous(),
        ))
        if att.q_proj.bias is not None:
            raise ValueError("pack_weights: attention_bias=True is not supported")
    rope = model.model.rotary_emb
    return PackedWeights(
        embed=model.model.embed_tokens.weight.detach().clone(), layers=layers,
        final_norm=model.model.norm.weight.detach().clone(),
        lm_head=model.lm_head.weight.detach().clone(), inv_freq=rope.inv_freq.detach().float(),
        rope_scale=float(rope.attention_scaling), num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads,
        top_k=cfg.num_experts_per_tok, norm_topk=bool(cfg.norm_topk_prob), eps=cfg.rms_norm_eps,
    )


class KVCache:
    """Per layer [B, Hkv, S, D] keys and values, plus which of the S slots hold real tokens."""

    def __init__(self, pw: PackedWeights, batch: int, slots: int) -> None:
        shape = (len(pw.layers), batch, pw.num_kv_heads, slots, pw.head_dim)
        # empty, not zeros: attention reads slots < length only, each written before (zeroing cost 2% of a run)
        self.k = torch.empty(shape, dtype=pw.embed.dtype)
        self.v = torch.empty(shape, dtype=pw.embed.dtype)
        self.valid = torch.zeros(batch, slots, dtype=torch.bool)
        self.length = 0  # slots filled so far (the same for every row: padding fills the gaps)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (finished sequences leave the batch)."""
        self.k, self.v, self.valid = self.k[:, rows], self.v[:, rows], self.valid[rows]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)  # one fused op; same fp32 values as HF Qwen3MoeRMSNorm


def rope_table(pw: PackedWeights, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[length, D] cos and sin for positions 0..length-1 (computed once per generate call)."""
    freqs = torch.arange(length, dtype=torch.float32).unsqueeze(-1) * pw.inv_freq  # [L, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * pw.rope_scale, emb.sin() * pw.rope_scale


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def _attention(pw: PackedWeights, lw: LayerWeights, x: torch.Tensor, cos, sin, cache: KVCache, li: int,
               mask: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    hq, hkv, d = pw.num_heads, pw.num_kv_heads, pw.head_dim
    qkv = F.linear(x, lw.w_qkv).view(B, T, hq + 2 * hkv, d)
    q = _rms(qkv[:, :, :hq], lw.q_norm, pw.eps).transpose(1, 2)
    k = _rms(qkv[:, :, hq:hq + hkv], lw.k_norm, pw.eps).transpose(1, 2)
    v = qkv[:, :, hq + hkv:].transpose(1, 2)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    start, end = cache.length, cache.length + T
    cache.k[li, :, :, start:end] = k
    cache.v[li, :, :, start:end] = v
    out = F.scaled_dot_product_attention(q, cache.k[li, :, :, :end], cache.v[li, :, :, :end], attn_mask=mask,
                                         scale=d ** -0.5, enable_gqa=hq != hkv)
    return F.linear(out.transpose(1, 2).reshape(B, T, hq * d), lw.w_o)


def _moe(pw: PackedWeights, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # [N, H]
    probs = torch.softmax(F.linear(x, lw.router), dim=-1, dtype=torch.float)
    weights, chosen = probs.topk(pw.top_k, dim=-1)  # [N, k]
    if pw.norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    E, two_i, H = lw.w_gate_up.shape
    inter = two_i // 2
    if x.shape[0] <= DENSE_MOE_MAX_TOKENS:
        dense_w = torch.zeros(x.shape[0], E, dtype=x.dtype).scatter_(1, chosen, weights.to(x.dtype))
        gu = F.linear(x, lw.w_gate_up.view(E * two_i, H)).view(-1, E, two_i)
        h = F.silu(gu[..., :inter]) * gu[..., inter:] * dense_w.unsqueeze(-1)  # [N, E, I]
        return F.linear(h.reshape(-1, E * inter), lw.w_down_flat.t()).view(shape)
    out = torch.zeros_like(x)
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    token_of = order // pw.top_k
    w_sorted = weights.reshape(-1)[order].to(x.dtype).unsqueeze(-1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        idx = token_of[start:start + n]
        gu = F.linear(x[idx], lw.w_gate_up[e])
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, idx, F.linear(h, lw.w_down[e]) * w_sorted[start:start + n])
        start += n
    return out.view(shape)


@torch.no_grad()
def forward_step(pw: PackedWeights, cache: KVCache, input_ids: torch.Tensor, positions: torch.Tensor,
                 valid: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Append T tokens per row to `cache` and return the last position's [B, V] fp32 logits.

    input_ids, positions, valid: [B, T]; `valid` marks real tokens (False = padding). A padding
    query attends only to itself, so no row of the attention is empty (no NaN) and no real token
    ever sees it.
    """
    B, T = input_ids.shape
    start, end = cache.length, cache.length + T
    cache.valid[:, start:end] = valid
    if T == 1:  # decode: the one query sees every filled real slot (its own included)
        mask = (cache.valid[:, :end] | (torch.arange(end) == start)).view(B, 1, 1, end)
    else:
        causal = torch.ones(T, end, dtype=torch.bool).tril(diagonal=start)  # query i sees slots <= start + i
        own = torch.zeros(T, end, dtype=torch.bool)
        own[torch.arange(T), start + torch.arange(T)] = True
        mask = ((causal & cache.valid[:, None, :end]) | own).unsqueeze(1)  # [B, 1, T, end]
    if rope is None:
        rope = rope_table(pw, int(positions.max()) + 1)
    cos, sin = rope[0][positions].unsqueeze(1), rope[1][positions].unsqueeze(1)  # [B, 1, T, D]
    x = F.embedding(input_ids, pw.embed)
    for li, lw in enumerate(pw.layers):
        x = x + _attention(pw, lw, _rms(x, lw.ln_attn, pw.eps), cos, sin, cache, li, mask)
        x = x + _moe(pw, lw, _rms(x, lw.ln_mlp, pw.eps))
    cache.length = end
    last = _rms(x[:, -1], pw.final_norm, pw.eps)
    return F.linear(last, pw.lm_head).float()
