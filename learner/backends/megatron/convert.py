"""HF Qwen3-MoE state dicts <-> megatron-core GPTModel state dicts (lossless both ways).

Only tensors are moved, never recomputed: every conversion is a slice, a concatenation or a
rename, so HF -> megatron -> HF returns bit-identical tensors. With expert parallelism each rank
holds experts [ep_rank * n_local, (ep_rank + 1) * n_local) under local indices 0..n_local-1;
`megatron_to_hf` of one rank gives the dense weights plus that rank's experts, and
`gather_experts` joins the ranks' experts into one full HF state dict.

Mapped architecture: Qwen3MoeForCausalLM only (see `model.check_supported`).

Layout facts (megatron-core 0.16, local spec):
  linear_qkv.weight [G * (Q/G + 2) * D, H]: for each KV group g, the Q/G query heads of g, then
    k_g, then v_g (D = head_dim, G = KV heads, Q = query heads); HF keeps q, k, v apart.
  linear_fc1.weight [2F, H] = cat(gate_proj, up_proj): megatron's GLU is act(chunk 0) * chunk 1.
  tied embeddings: megatron has no output_layer.weight; HF's lm_head.weight is the embedding.
"""

from __future__ import annotations

import torch

from learner.backends.megatron.model import head_dim

_LAYER_RENAMES = {  # megatron suffix -> HF suffix, both under their layer prefix
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}


def local_expert_range(num_experts: int, ep_rank: int, ep_size: int) -> range:
    if num_experts % ep_size:
        raise ValueError(f"expert_parallel={ep_size} does not divide num_experts={num_experts}")
    n = num_experts // ep_size
    return range(ep_rank * n, (ep_rank + 1) * n)


def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf_cfg) -> torch.Tensor:
    d, g = head_dim(hf_cfg), hf_cfg.num_key_value_heads
    h = q.shape[-1]
    q = q.reshape(g, -1, d, h)  # [G, Q/G, D, H]: query heads of a group are consecutive in HF
    qkv = torch.cat([q, k.reshape(g, 1, d, h), v.reshape(g, 1, d, h)], dim=1)
    return qkv.reshape(-1, h)


def _qkv_to_hf(qkv: torch.Tensor, hf_cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, g = head_dim(hf_cfg), hf_cfg.num_key_value_heads
    per = hf_cfg.num_attention_heads // g
    h = qkv.shape[-1]
    x = qkv.reshape(g, per + 2, d, h)
    return (x[:, :per].reshape(-1, h).clone(), x[:, per].reshape(-1, h).clone(),
            x[:, per + 1].reshape(-1, h).clone())


def hf_to_megatron(hf_sd: dict[str, torch.Tensor], hf_cfg, ep_rank: int = 0, ep_size: int = 1,
                   prefix: str = "model.", with_output: bool = True) -> dict[str, torch.Tensor]:
    """Megatron parameter names -> tensors for this EP rank.

    `prefix` is where the HF backbone lives ("model." for the policy, "backbone." for H2's value
    model); `with_output=False` skips the final norm and output layer (value-model backbone)."""
    out: dict[str, torch.Tensor] = {}
    get = _getter(hf_sd)
    out["embedding.word_embeddings.weight"] = get(f"{prefix}embed_tokens.weight")
    experts = local_expert_range(hf_cfg.num_experts, ep_rank, ep_size)
    for i in range(hf_cfg.num_hidden_layers):
        hp, mp = f"{prefix}layers.{i}.", f"decoder.layers.{i}."
        for m_suf, h_suf in _LAYER_RENAMES.items():
            out[mp + m_suf] = get(hp + h_suf)
        out[mp + "self_attention.linear_qkv.weight"] = _qkv_to_megatron(
            get(hp + "self_attn.q_proj.weight"), get(hp + "self_attn.k_proj.weight"),
            get(hp + "self_attn.v_proj.weight"), hf_cfg)
        for local, e in enumerate(experts):
            he, me = f"{hp}mlp.experts.{e}.", f"{mp}mlp.experts.local_experts.{local}."
            out[me + "linear_fc1.weight"] = torch.cat([get(he + "gate_proj.weight"),
                                                        get(he + "up_proj.weight")], dim=0)
            out[me + "linear_fc2.weight"] = get(he + "down_proj.weight")
    if with_output:
        out["decoder.final_layernorm.weight"] = get(f"{prefix}norm.weight")
        if not hf_cfg.tie_word_embeddings:
            out["output_layer.weight"] = get("lm_head.weight")
    return out


def megatron_to_hf(m_sd: dict[str, torch.Tensor], hf_cfg, ep_rank: int = 0, ep_size: int = 1,
                   prefix: str = "model.", with_output: bool = True) -> dict[str, torch.Tensor]:
    """The inverse of `hf_to_megatron`: HF names -> tensors (dense + this rank's experts)."""
    out: dict[str, torch.Tensor] = {}
    get = _getter(m_sd)
    out[f"{prefix}embed_tokens.weight"] = get("embedding.word_embeddings.weight")
    experts = local_expert_range(hf_cfg.num_experts, ep_rank, ep_size)
    for i in range(hf_cfg.num_hidden_layers):
        hp, mp = f"{prefix}layers.{i}.", f"decoder.layers.{i}."
        for m_suf, h_suf in _LAYER_RENAMES.items():
            out[hp + h_suf] = get(mp + m_suf)
        q, k, v = _qkv_to_hf(get(mp + "self_attention.linear_qkv.weight"), hf_cfg)
        out[hp + "self_attn.q_proj.weight"], out[hp + "self_attn.k_proj.weight"] = q, k
        out[hp + "self_attn.v_proj.weight"] = v
        for local, e in enumerate(experts):
            he, me = f"{hp}mlp.experts.{e}.", f"{mp}mlp.experts.local_experts.{local}."
            gate, up = get(me + "linear_fc1.weight").chunk(2, dim=0)
            out[he + "gate_proj.weight"], out[he + "up_proj.weight"] = gate.clone(), up.clone()
            out[he + "down_proj.weight"] = get(me + "linear_fc2.weight")
    if with_output:
        out[f"{prefix}norm.weight"] = get("decoder.final_layernorm.weight")
        out["lm_head.weight"] = (get("embedding.word_embeddings.weight")
                                 if hf_cfg.tie_word_embeddings else get("output_layer.weight"))
    return out


def _getter(sd: dict[str, torch.Tensor]):
    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise KeyError(f"state dict: missing '{name}' (have e.g. {sorted(sd)[:3]})")
        return sd[name].detach()
    return get


def is_expert_key(hf_name: str) -> bool:
    return ".mlp.experts." in hf_name


def gather_experts(local_hf_sd: dict[str, torch.Tensor], hf_cfg, ep_group) -> dict[str, torch.Tensor]:
    """Join every EP rank's experts into one full HF state dict (a collective over `ep_group`).

    Expert tensors travel with `all_gather` in a fixed key order (no pickled objects)."""
    import torch.distributed as dist

    ep_size = dist.get_world_size(ep_group)
    if ep_size == 1:
        return dict(local_hf_sd)
    ep_rank = dist.get_rank(ep_group)
    n_local = hf_cfg.num_experts // ep_size
    out = {k: v for k, v in local_hf_sd.items() if not is_expert_key(k)}
    mine = local_expert_range(hf_cfg.num_experts, ep_rank, ep_size)
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
