"""The policy and the value model as megatron-core GPTModels with MoE and expert parallelism.

Mapped HF architecture: `Qwen3MoeForCausalLM` (transformers 4.57), every layer sparse
(`decoder_sparse_step=1`, no `mlp_only_layers`), no shared experts, no attention bias, no
sliding window, no rope scaling. Others (Mixtral, Qwen2-MoE with its shared expert, GLM4-MoE,
DeepSeek-V3) are NOT mapped: `check_supported` names the field that is not.

Qwen3-MoE numerics and their megatron-core settings:
  RMSNorm(eps) on every norm incl. per-head q/k norms -> normalization="RMSNorm",
    layernorm_epsilon=eps, qk_layernorm=True (local spec: torch.nn.RMSNorm)
  rope (rotate-half, base theta) -> position_embedding_type="rope", rotary_base=theta,
    rotary_interleaved=False
  SwiGLU experts -> gated_linear_unit=True, activation_func=silu (fc1 = [gate; up])
  router softmax -> top-k -> renormalise (norm_topk_prob=True) -> moe_router_score_function=
    "softmax", moe_router_pre_softmax=False: top-k on the logits then softmax over those k, which
    equals softmax over all experts renormalised over the chosen k (the partition function
    cancels). norm_topk_prob=False -> pre_softmax=True (softmax, top-k, no renormalisation).
  no load-balancing loss in the forward (aux loss 0, type "none"), dropless (no capacity).
The value model is the same backbone built with post_process=False (no final norm, no output
layer) plus `ValueHead`: final RMSNorm (HF `model.norm`) and a scalar linear head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from learner.backends.megatron import cpu_compat


def check_supported(hf_cfg) -> None:
    """Raise ValueError naming the first HF config field this backend does not map."""
    arch = getattr(hf_cfg, "model_type", None)
    if arch != "qwen3_moe":
        raise ValueError(f"megatron backend: model_type '{arch}' is not mapped (only qwen3_moe)")
    bad = {
        "attention_bias": bool(getattr(hf_cfg, "attention_bias", False)),
        "use_sliding_window": bool(getattr(hf_cfg, "use_sliding_window", False)),
        "rope_scaling": getattr(hf_cfg, "rope_scaling", None) not in (None, {}),
        "mlp_only_layers": bool(getattr(hf_cfg, "mlp_only_layers", None)),
        "decoder_sparse_step": getattr(hf_cfg, "decoder_sparse_step", 1) != 1,
        "hidden_act": getattr(hf_cfg, "hidden_act", "silu") != "silu",
    }
    for field, is_bad in bad.items():
        if is_bad:
            raise ValueError(f"megatron backend: qwen3_moe config field '{field}' = "
                             f"{getattr(hf_cfg, field)!r} is not supported")
    if hf_cfg.num_experts_per_tok == 1 and hf_cfg.norm_topk_prob:
        # HF: gate weight 1.0; megatron refuses top-1 without pre-softmax (which would give p_max)
        raise ValueError("megatron backend: num_experts_per_tok = 1 with norm_topk_prob = True is not "
                         "supported (megatron-core refuses top-1 routing after the softmax); use >= 2 experts "
                         "per token")


def head_dim(hf_cfg) -> int:
    return getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads


def transformer_config(hf_cfg, dtype: torch.dtype = torch.float32):
    """The megatron TransformerConfig equivalent to a Qwen3-MoE HF config."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_supported(hf_cfg)
    from megatron.core import parallel_state as ps

    return TransformerConfig(
        num_layers=hf_cfg.num_hidden_layers,
        hidden_size=hf_cfg.hidden_size,
        num_attention_heads=hf_cfg.num_attention_heads,
        num_query_groups=hf_cfg.num_key_value_heads,
        kv_channels=head_dim(hf_cfg),
        ffn_hidden_size=hf_cfg.moe_intermediate_size,
        moe_ffn_hidden_size=hf_cfg.moe_intermediate_size,
        num_moe_experts=hf_cfg.num_experts,
        moe_router_topk=hf_cfg.num_experts_per_tok,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not hf_cfg.norm_topk_prob,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",  # HF computes the routing softmax in fp32
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        normalization="RMSNorm",
        layernorm_epsilon=hf_cfg.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_cfg, "attention_dropout", 0.0)),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=cpu_compat.needed(),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        init_method_std=getattr(hf_cfg, "initializer_range", 0.02),
    )


def build_gpt(hf_cfg, post_process: bool = True, dtype: torch.dtype = torch.float32):
    """A megatron GPTModel for `hf_cfg` on this rank (holding its EP share of the experts).

    `post_process=False` drops the final norm and output layer: the value model's backbone."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cpu_compat.apply()
    cfg = transformer_config(hf_cfg, dtype)
    spec = get_gpt_layer_local_spec(num_experts=hf_cfg.num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=hf_cfg.vocab_size,
        max_sequence_length=hf_cfg.max_position_embeddings,
        pre_process=True,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(hf_cfg.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=hf_cfg.rope_theta,  # float: no truncation of e.g. 1e6 or 5e5
    )
    # Megatron-LM casts through Float16Module; the local spec's torch norms are built in fp32.
    return model.to(dtype=dtype)


def positions(input_ids: torch.Tensor) -> torch.Tensor:
    b, t = input_ids.shape
    return torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)


def attention_mask_4d(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] 1 = real token -> megatron's [B, 1, T, T] bool, True = may NOT attend.

    Causal and key padding together, so either padding side works."""
    t = mask.shape[1]
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=mask.device), diagonal=1)
    return causal[None, None] | ~mask.bool()[:, None, None, :]


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)  # as learner.models.scoring


def megatron_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """[B, T, V] fp32 logits of a megatron policy."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    return model(input_ids, position_ids(mask), attention_mask_4d(mask)).float()


class ValueHead(torch.nn.Module):
    """Final RMSNorm + scalar head on top of the backbone's last hidden states."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.head = torch.nn.Linear(hidden, 1, bias=True, dtype=dtype)

    def forward(self, hidden_sbh: torch.Tensor) -> torch.Tensor:
        # [S, B, H] (megatron layout) -> [B, S]
        return self.head(self.norm(hidden_sbh)).squeeze(-1).transpose(0, 1)


class MegatronValueModel(torch.nn.Module):
    """Critic: GPT backbone (post_process=False) + ValueHead; `forward(ids, pos, mask) -> [B, T]`."""

    def __init__(self, hf_cfg, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.backbone = build_gpt(hf_cfg, post_process=False, dtype=dtype)
        self.value_head = ValueHead(hf_cfg.hidden_size, hf_cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        pos = positions(input_ids) if position_ids is None else position_ids
        return self.value_head(self.backbone(input_ids, pos, attention_mask=attention_mask))
