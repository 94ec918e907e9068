"""HF Qwen3-MoE / GLM-4-MoE state dicts <-> megatron-core GPTModel state dicts (lossless both ways).

Only tensors are moved, never recomputed: every conversion is a slice, a concatenation or a
rename, so HF -> megatron -> HF returns bit-identical tensors. With expert parallelism each rank
holds routed experts [ep_rank * n_local, (ep_rank + 1) * n_local) under local indices
0..n_local-1; dense layers and shared experts are replicated on every rank. `megatron_to_hf` of
one rank gives the replicated weights plus that rank's experts, and `gather_experts` joins the
ranks' experts into one full HF state dict (publishing does not: `export.PolicyShard` converts a rank's own
part, tensor by tensor, through the same table).

One table (`_mapping`) lists every tensor of a model as (kind, megatron name, HF names); both
directions walk it. Mapped architectures: see `model.check_supported`.

Layout facts (megatron-core 0.16, local spec):
  linear_qkv.weight [G * (Q/G + 2) * D, H]: for each KV group g, the Q/G query heads of g, then
    k_g, then v_g (D = head_dim, G = KV heads, Q = query heads); HF keeps q, k, v apart.
    linear_qkv.bias (GLM attention_bias) has the same row layout.
  linear_fc1.weight [2F, H] = cat(gate_proj, up_proj): megatron's GLU is act(chunk 0) * chunk 1;
    the same for routed experts, shared experts (mlp.shared_experts.*) and dense MLPs (mlp.*).
  GLM router bias: HF buffer mlp.gate.e_score_correction_bias <-> megatron buffer mlp.router.expert_bias.
  tied embeddings: megatron has no output_layer.weight; HF's lm_head.weight is the embedding.
"""

from __future__ import annotations

import torch

from learner.backends.megatron.model import head_dim, is_glm4_moe, moe_layer_pattern, num_experts, qk_norm, qkv_bias

RENAME, GLU, QKV = "rename", "glu", "qkv"  # 1 HF tensor; cat(gate, up); per-KV-group q, k, v
# the last pipeline stage's copy of a tied embedding (megatron's output_layer.weight there): loaded from the HF
# embedding, never exported (the first stage's embedding is the HF tensor)
TIED = "tied"

_ATTENTION_RENAMES = {  # megatron suffix -> HF suffix, both under their layer prefix
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
_QK_NORM_RENAMES = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


def local_expert_range(n_experts: int, ep_rank: int, ep_size: int) -> range:
    if n_experts % ep_size:
        raise ValueError(f"expert_parallel={ep_size} does not divide num_experts={n_experts}")
    n = n_experts // ep_size
    return range(ep_rank * n, (ep_rank + 1) * n)


def _mlp(mp: str, hp: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """A SwiGLU MLP: megatron prefix `mp` (linear_fc1/2) <-> HF prefix `hp` (gate/up/down_proj)."""
    return [(GLU, mp + "linear_fc1.weight", (hp + "gate_proj.weight", hp + "up_proj.weight")),
            (RENAME, mp + "linear_fc2.weight", (hp + "down_proj.weight",))]


def _attention(hf_cfg, mp: str, hp: str) -> list[tuple[str, str, tuple[str, ...]]]:
    renames = {**_ATTENTION_RENAMES, **(_QK_NORM_RENAMES if qk_norm(hf_cfg) else {})}
    out = [(RENAME, mp + m, (hp + h,)) for m, h in renames.items()]
    for kind in ("weight", "bias") if qkv_bias(hf_cfg) else ("weight",):
        out.append((QKV, f"{mp}self_attention.linear_qkv.{kind}",
                    tuple(f"{hp}self_attn.{n}_proj.{kind}" for n in "qkv")))
    return out


def _moe(hf_cfg, mp: str, hp: str, experts: range) -> list[tuple[str, str, tuple[str, ...]]]:
    out = [(RENAME, mp + "mlp.router.weight", (hp + "mlp.gate.weight",))]
    if is_glm4_moe(hf_cfg):
        out.append((RENAME, mp + "mlp.router.expert_bias", (hp + "mlp.gate.e_score_correction_bias",)))
        out += _mlp(mp + "mlp.shared_experts.", hp + "mlp.shared_experts.")
    for local, e in enumerate(experts):
        out += _mlp(f"{mp}mlp.experts.local_experts.{local}.", f"{hp}mlp.experts.{e}.")
    return out


def _mapping(hf_cfg, ep_rank: int, ep_size: int, prefix: str, with_output: bool,
             stage=None) -> list[tuple[str, str, tuple[str, ...]]]:
    """(kind, megatron name, HF names) for every tensor this EP rank (of pipeline `stage`, a
    `pipeline.Stage`; None: the whole model) holds."""
    experts = local_expert_range(num_experts(hf_cfg), ep_rank, ep_size)
    pattern = moe_layer_pattern(hf_cfg)
    first, last = (True, True) if stage is None else (stage.first, stage.last)
    layers = range(len(pattern)) if stage is None else stage.layers
    embed = f"{prefix}embed_tokens.weight"
    out = [(RENAME, "embedding.word_embeddings.weight", (embed,))] if first else []
    for local, i in enumerate(layers):
        hp, mp = f"{prefix}layers.{i}.", f"decoder.layers.{local}."
        out += _attention(hf_cfg, mp, hp)
        out += _moe(hf_cfg, mp, hp, experts) if pattern[i] else _mlp(mp + "mlp.", hp + "mlp.")
    if with_output and last:
        out.append((RENAME, "decoder.final_layernorm.weight", (f"{prefix}norm.weight",)))
        if not hf_cfg.tie_word_embeddings:
            out.append((RENAME, "output_layer.weight", ("lm_head.weight",)))
        elif not first:
            out.append((TIED, "output_layer.weight", (embed,)))
    return out


def hf_mapping(hf_cfg, ep_rank: int = 0, ep_size: int = 1, prefix: str = "model.",
               with_output: bool = True, stage=None) -> list[tuple[str, str, tuple[str, ...]]]:
    """(kind, megatron name, HF names) of every tensor this EP rank (of pipeline `stage`; None: the whole model)
    holds (its experts, every dense tensor); a tied lm_head is not one (it is the embedding; a last stage's copy of
    it is a TIED entry)."""
    return _mapping(hf_cfg, ep_rank, ep_size, prefix, with_output, stage)


def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf_cfg) -> torch.Tensor:
    d, g = head_dim(hf_cfg), hf_cfg.num_key_value_heads
    tail = q.shape[1:]  # (H,) for the weight, () for the bias
    # [G, Q/G + 2, D, *tail]: the query heads of a group are consecutive in HF
    groups = [q.reshape(g, -1, d, *tail), k.reshape(g, 1, d, *tail), v.reshape(g, 1, d, *tail)]
    return torch.cat(groups, dim=1).reshape(-1, *tail)


def _qkv_to_hf(qkv: torch.Tensor, hf_cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, g = head_dim(hf_cfg), hf_cfg.num_key_value_heads
    per = hf_cfg.num_attention_heads // g
    tail = qkv.shape[1:]  # (H,) for the weight, () for the bias
    x = qkv.reshape(g, per + 2, d, *tail)
    return (x[:, :per].reshape(-1, *tail).clone(), x[:, per].reshape(-1, *tail).clone(),
            x[:, per + 1].reshape(-1, *tail).clone())


def _to_megatron(kind: str, hf: list[torch.Tensor], hf_cfg) -> torch.Tensor:
    if kind == GLU:
        return torch.cat(hf, dim=0)
    if kind == QKV:
        return _qkv_to_megatron(*hf, hf_cfg)
    return hf[0]


def to_hf(kind: str, m: torch.Tensor, hf_cfg) -> tuple[torch.Tensor, ...]:
    """One megatron tensor of `kind` as its HF tensors (a rename returns it as it is)."""
    if kind == GLU:
        return tuple(t.clone() for t in m.chunk(2, dim=0))
    if kind == QKV:
        return _qkv_to_hf(m, hf_cfg)
    return (m,)


def hf_to_megatron(hf_sd: dict[str, torch.Tensor], hf_cfg, ep_rank: int = 0, ep_size: int = 1,
                   prefix: str = "model.", with_output: bool = True, stage=None) -> dict[str, torch.Tensor]:
    """Megatron parameter (and router-bias buffer) names -> tensors for this EP rank.

    `prefix` is where the HF backbone lives ("model." for the policy, "backbone." for H2's value
    model); `with_output=False` skips the final norm and output layer (value-model backbone)."""
    get = _getter(hf_sd)
    return {m: _to_megatron(kind, [get(h) for h in hs], hf_cfg)
            for kind, m, hs in _mapping(hf_cfg, ep_rank, ep_size, prefix, with_output, stage)}


def megatron_to_hf(m_sd: dict[str, torch.Tensor], hf_cfg, ep_rank: int = 0, ep_size: int = 1,
                   prefix: str = "model.", with_output: bool = True, stage=None) -> dict[str, torch.Tensor]:
    """The inverse of `hf_to_megatron`: HF names -> tensors (replicated weights + this rank's experts)."""
    get = _getter(m_sd)
    out: dict[str, torch.Tensor] = {}
    for kind, m, hs in _mapping(hf_cfg, ep_rank, ep_size, prefix, with_output, stage):
        if kind != TIED:
            out.update(zip(hs, to_hf(kind, get(m), hf_cfg)))
    if with_output and hf_cfg.tie_word_embeddings and (stage is None or stage.first):
        out["lm_head.weight"] = get("embedding.word_embeddings.weight")
    return out


def _getter(sd: dict[str, torch.Tensor]):
    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise KeyError(f"state dict: missing '{name}' (have e.g. {sorted(sd)[:3]})")
        return sd[name].detach()
    return get


def is_expert_key(hf_name: str) -> bool:
    return ".mlp.experts." in hf_name  # routed experts only: shared experts are ".mlp.shared_experts."


def gather_experts(local_hf_sd: dict[str, torch.Tensor], hf_cfg, ep_group) -> dict[str, torch.Tensor]:
    """Join every EP rank's experts into one full HF state dict (a collective over `ep_group`).

    Expert tensors travel with `all_gather` in a fixed key order (no pickled objects)."""
    import torch.distributed as dist

    ep_size = dist.get_world_size(ep_group)
    if ep_size == 1:
        return dict(local_hf_sd)
    ep_rank = dist.get_rank(ep_group)
    n_experts = num_experts(hf_cfg)
    n_local = n_experts // ep_size
    out = {k: v for k, v in local_hf_sd.items() if not is_expert_key(k)}
    mine = local_expert_range(n_experts, ep_rank, ep_size)
    for key in sorted(k for k in local_hf_sd if is_expert_key(k)):
        e = int(key.split(".mlp.experts.")[1].split(".")[0])
        if e != mine.start:
            continue  # one collective per (layer, weight kind); peers are found by offset
        for offset in range(n_local):
            name = key.replace(f".mlp.experts.{e}.", f".mlp.experts.{e + offset}.")
            parts = [torch.empty_like(local_hf_sd[name]) for _ in range(ep_size)]
            dist.all_gather(parts, local_hf_sd[name].contiguous(), group=ep_group)
            for r, t in enumerate(parts):
                out[name.replace(f".mlp.experts.{e + offset}.", f".mlp.experts.{r * n_local + offset}.")] = t
    return out
