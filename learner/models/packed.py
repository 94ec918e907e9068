"""The warm start's loss over packed tokens: the HF Qwen3-MoE forward without padding, on the model's own weights.

`packed_loss` computes the token-mean cross-entropy of a batch whose sequences are concatenated
(`PackedBatch`), so every linear and MoE expert runs once per batch on all its tokens; only
attention is padded, per group of similar lengths (split where they pad least). It equals the HF
forward's loss and gradients on a right-padded batch (`make_batch`, `lm_loss`: the reference, tested
against it) and runs faster on CPU, where a step is mostly many passes over small tensors besides the
matmuls: gathers with index_select (backward index_add, not index_put), q, k and v as one matmul and q
and k normed and rotated together, each expert's gate and up as one matmul, and RMSNorm and the experts
as autograd Functions whose backwards take fewer passes than autograd's (bench/warmstart_step.py).
The last layer runs its attention output and MoE on the scored tokens only (the others' last-layer outputs feed
nothing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from learner.models.tokenizer import Tokenizer


def make_batch(tok: Tokenizer, items: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, ...]:
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


def group_sizes(lens: list[int], groups: int) -> list[int]:
    """Sizes of `groups` consecutive runs of the ascending `lens` (fewer if there are fewer lengths) with the fewest
    padding slots in all, each run padded to its longest: dynamic programming over where the runs end."""
    n, big = len(lens), 1 << 40  # big: more slots than any batch has
    first, last = torch.arange(n)[:, None], torch.arange(n)[None]
    slots = torch.where(first <= last, (last - first + 1) * torch.tensor(lens), big)  # the run lens[first..last]
    fewest = torch.tensor([0] + [big] * n)  # [j]: fewest slots of lens[:j] in the runs so far
    starts = []  # per run added: [last] where the run ending at `last` starts
    for _ in range(min(groups, n)):
        total, start = (fewest[:-1, None] + slots).min(0)
        fewest = torch.cat([torch.tensor([big]), total])
        starts.append(start)
    sizes, j = [], n
    for start in reversed(starts):
        sizes.append(j - int(start[j - 1]))
        j -= sizes[-1]
    return sizes[::-1]


class PackedBatch:
    """A batch's tokens concatenated without padding, with the indices `packed_loss` needs.

    Sequences are sorted by length and split into `groups` runs with the fewest padding slots (`group_sizes`);
    attention runs per group, right-padded to the group's longest sequence. Padding slots hold a copy of token 0:
    the causal mask keeps every real query off them and their outputs are dropped, so they change no output and
    get no gradient."""

    def __init__(self, items: list[tuple[list[int], list[int]]], groups: int) -> None:
        items = sorted(items, key=lambda x: len(x[0]))
        lens = [len(ids) for ids, _ in items]
        self._pack(torch.tensor([t for ids, _ in items for t in ids], dtype=torch.long), lens, groups)
        starts = torch.tensor([0] + lens[:-1]).cumsum(0)
        scored = torch.tensor([x for _, m in items for x in m], dtype=torch.bool)
        scored[starts] = False  # a sequence's first token has no prediction before it
        self.pred = scored.nonzero().flatten() - 1  # token j predicts token j + 1 of the same sequence
        self.target = self.ids[self.pred + 1]

    def _pack(self, ids: torch.Tensor, lens: list[int], groups: int) -> None:
        """`ids`: the sequences of ascending lengths `lens`, concatenated."""
        self.ids = ids  # [N]
        self.pos = torch.cat([torch.arange(n) for n in lens])  # position within its sequence
        starts = torch.tensor([0] + lens[:-1]).cumsum(0)
        sizes = group_sizes(lens, groups)
        index, slots, self.groups = [], [], []  # per group: rows and padded length
        for gstarts, glens in zip(starts.split(sizes), torch.tensor(lens).split(sizes)):
            T = int(glens[-1])
            real = torch.arange(T)[None] < glens[:, None]  # [b, T]
            index.append(torch.where(real, gstarts[:, None] + torch.arange(T), 0).flatten())
            slots.append(real.flatten())
            self.groups.append((len(glens), T))
        self.gather = torch.cat(index)  # every group's padded layout, from the packed tokens
        self.real = torch.cat(slots).nonzero().flatten()  # the packed tokens' slots in that layout, in order


class PaddedPack(PackedBatch):
    """The real tokens of a padded `[B, T]` batch (`attention_mask` 1 = real, either padding side), packed; `unpack`
    puts per-token rows of the kept tokens back in place. Positions count the real tokens of a row, as
    `position_ids_from_mask`. `at` ([B, T] bool): the positions whose outputs are wanted (default: every real token);
    `keep` holds their packed indices."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, groups: int,
                 at: torch.Tensor | None = None) -> None:
        B, T = input_ids.shape
        mask = attention_mask.bool()
        lens = mask.sum(-1)
        order = lens.argsort(stable=True)
        self.slot = (order[:, None] * T + torch.arange(T))[mask[order]]  # [N] in [B * T]
        self.shape = (B, T)
        self._pack(input_ids.flatten().index_select(0, self.slot), lens[order].tolist(), groups)
        if at is None:
            self.keep = torch.arange(len(self.slot))
        else:
            self.keep = at.bool().flatten().index_select(0, self.slot).nonzero().flatten()

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[K, ...] per kept token -> [B, T, ...], zeros elsewhere (differentiable)."""
        out = x.new_zeros(self.shape[0] * self.shape[1], *x.shape[1:]).index_copy(0, self.slot[self.keep], x)
        return out.view(*self.shape, *x.shape[1:])


class RMSNorm(torch.autograd.Function):
    """`F.rms_norm` (the HF forward's arithmetic: x * rsqrt(mean(x^2) + eps) * weight) with a hand-written backward:
    on CPU autograd differentiates the decomposed norm, twice as many passes over the tokens. `weight` may have more
    dimensions than one (one row per head); its gradient is summed to its shape."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        xhat = x * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        return weight * xhat

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        xhat, rstd, weight = ctx.saved_tensors
        prod = grad * xhat  # summed over the tokens: the weight's gradient
        d = xhat.shape[-1]
        per_row = torch.block_diag(*weight.reshape(-1, 1, d)).t() / d  # [weight.numel(), rows]
        dot = (prod.reshape(-1, weight.numel()) @ per_row).view(rstd.shape)  # mean(grad * weight * xhat) by a matmul
        dx = (grad * weight).addcmul_(xhat, dot, value=-1).mul_(rstd)
        return dx, prod.sum_to_size(weight.shape), None


def _swiglu_backward(grad: torch.Tensor, gate_up: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    """The gradient of silu(gate) * up with respect to gate_up (gate and up side by side; act = silu(gate)),
    both halves written into one tensor."""
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.empty_like(gate_up)
    d_gate, d_up = out.chunk(2, dim=-1)
    torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
    torch.mul(grad, act, out=d_up)
    return out


class Experts(torch.autograd.Function):
    """Each expert's down(silu(gate x) * up x) on its block of rows of `x` (`counts[e]` rows, in expert order), gate
    and up as one matmul. The experts write their outputs into one tensor and, in backward, their input gradients
    into one: autograd would join both with a cat, and its graph would hold a dozen nodes per expert. `weights`:
    gate, up and down of each expert in turn; an expert without rows gets no gradient (None, as autograd gives).
    Backward reuses forward's joined gate and up."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: list[int], *weights: torch.Tensor) -> torch.Tensor:
        y = x.new_empty(x.shape[0], weights[2].shape[0])  # [rows, hidden]: down's outputs
        saved = []
        for e, (xe, ye) in enumerate(zip(x.split(counts), y.split(counts))):
            gate, up, down = weights[3 * e:3 * e + 3]
            w_gate_up = torch.cat([gate, up])
            gate_up = F.linear(xe, w_gate_up)
            act = F.silu(gate_up[:, :gate.shape[0]])
            hidden = act * gate_up[:, gate.shape[0]:]
            torch.mm(hidden, down.t(), out=ye)
            saved += [w_gate_up, down, gate_up, act, hidden]
        ctx.counts = counts
        ctx.save_for_backward(x, *saved)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *saved = ctx.saved_tensors
        counts = ctx.counts
        dx, d_weights = torch.empty_like(x), []
        for e, (xe, ge, dxe) in enumerate(zip(x.split(counts), grad.split(counts), dx.split(counts))):
            w_gate_up, down, gate_up, act, hidden = saved[5 * e:5 * e + 5]
            d_gate_up = _swiglu_backward(ge @ down, gate_up, act)
            torch.mm(d_gate_up, w_gate_up, out=dxe)
            d_weights += [*(d_gate_up.t() @ xe).chunk(2), ge.t() @ hidden] if counts[e] else [None] * 3
        return dx, None, *d_weights


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin: rotate_half(x) * sin is the halves swapped (a roll, whose backward is
    one roll back) times sin with its first half negated."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def packed_loss(model, batch: PackedBatch) -> torch.Tensor:
    """Token-mean cross-entropy of the scored tokens: the HF Qwen3-MoE forward (`lm_loss`), computed on the
    packed tokens with the model's own parameters (gradients reach them)."""
    body = model.model
    x = _layers(body, batch, keep=batch.pred)
    logits = F.linear(RMSNorm.apply(x, body.norm.weight, body.config.rms_norm_eps), model.lm_head.weight)
    return F.cross_entropy(logits, batch.target)


def packable(body) -> bool:
    """Whether `_layers` computes this backbone's forward: Qwen3-MoE-style layers, every one sparse, no attention bias
    or dropout, rotary positions. Other models take the HF forward."""
    cfg = getattr(body, "config", None)
    layers = getattr(body, "layers", None)
    if cfg is None or layers is None or not hasattr(body, "rotary_emb") or getattr(cfg, "attention_dropout", 0) != 0:
        return False
    if getattr(cfg, "model_type", None) != "qwen3_moe" or getattr(cfg, "use_sliding_window", False):
        return False
    if any(hasattr(m, "lora_A") for m in body.modules()):  # peft's LoRA layers: `_layers` reads the bare weights
        return False
    return all(hasattr(layer.mlp, "experts") and layer.self_attn.q_proj.bias is None for layer in layers)


def packed_states(body, input_ids: torch.Tensor, attention_mask: torch.Tensor, groups: int = 2,
                  at: torch.Tensor | None = None) -> tuple[torch.Tensor, PaddedPack]:
    """The backbone's last hidden states (after its final norm) at the real tokens of a padded batch, packed ([K, H]),
    and the packing that puts them back (`PaddedPack.unpack`): the HF forward's `last_hidden_state` at those tokens.
    `at` ([B, T] bool): only those positions (default: every real token); the last layer's attention output and
    MoE then run on them alone."""
    pack = PaddedPack(input_ids, attention_mask, groups, at)
    x = _layers(body, pack, keep=pack.keep)
    return RMSNorm.apply(x, body.norm.weight, body.config.rms_norm_eps), pack


def _layers(body, batch: PackedBatch, keep: torch.Tensor) -> torch.Tensor:
    """[len(keep), H]: the residual stream after the backbone's last layer (before its final norm) at the packed
    tokens `keep`: the last layer's attention reads every token, its output and MoE run on `keep` alone."""
    if not packable(body):
        raise ValueError("packed forward: the backbone must be Qwen3-MoE with every layer a sparse MoE layer, no "
                         "attention bias, dropout or sliding window")
    cfg = body.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d, eps = cfg.hidden_size // hq, cfg.rms_norm_eps
    rope = body.rotary_emb
    freqs = batch.pos[:, None].float() * rope.inv_freq.float()
    cos = (torch.cat([freqs, freqs], dim=-1).cos() * rope.attention_scaling)[:, None]
    sin = freqs.sin() * rope.attention_scaling
    signed_sin = torch.cat([-sin, sin], dim=-1)[:, None]
    x = body.embed_tokens(batch.ids)  # [N, H]
    n = x.shape[0]
    for i, layer in enumerate(body.layers):
        att, moe = layer.self_attn, layer.mlp
        h = RMSNorm.apply(x, layer.input_layernorm.weight, eps)
        w_qkv = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
        qk, v = F.linear(h, w_qkv).view(n, hq + 2 * hkv, d).split([hq + hkv, hkv], dim=1)
        w_qk = torch.cat([att.q_norm.weight.expand(hq, d), att.k_norm.weight.expand(hkv, d)])  # per head
        qk = _rotate(RMSNorm.apply(qk, w_qk, eps), cos, signed_sin)
        qkv = torch.cat([qk, v], dim=1)  # [N, hq + 2 hkv, d]
        padded = qkv.index_select(0, batch.gather)  # backward: index_add, not index_put
        outs = []
        for (b, T), g in zip(batch.groups, padded.split([b * T for b, T in batch.groups])):
            q, k, v = g.view(b, T, -1, d).split([hq, hkv, hkv], dim=2)  # split before the transpose: no copy back
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                               scale=d ** -0.5, enable_gqa=hq != hkv)  # [b, heads, T, d]
            outs.append(o.transpose(1, 2).reshape(b * T, hq * d))
        real = batch.real
        if i == len(body.layers) - 1:
            x, real = x.index_select(0, keep), real.index_select(0, keep)
        x = x + F.linear(torch.cat(outs).index_select(0, real), att.o_proj.weight)
        h = RMSNorm.apply(x, layer.post_attention_layernorm.weight, eps)
        probs = torch.softmax(F.linear(h, moe.gate.weight), dim=-1, dtype=torch.float)
        weights, chosen = probs.topk(moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        order = chosen.flatten().argsort(stable=True)  # (token, slot) pairs grouped by expert
        token = order // moe.top_k
        counts = torch.bincount(chosen.flatten(), minlength=moe.num_experts).tolist()
        experts = [w for ex in moe.experts for w in (ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight)]
        y = Experts.apply(h.index_select(0, token), counts, *experts)  # one gather for all experts: one scatter back
        y = y * weights.flatten().index_select(0, order).to(h.dtype).unsqueeze(-1)
        x = x.index_add(0, token, y)
    return x
