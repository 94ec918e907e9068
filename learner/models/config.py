"""Typed configuration of the tiny MoE policy, mapped onto a transformers `Qwen3MoeConfig`.

Defaults follow CALIBRATION.md: 4 layers, hidden 128, 4 query / 2 KV heads, 8 experts top-2,
expert width 256, tied embeddings (~3.4M parameters, ~1.0M active per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from transformers import Qwen3MoeConfig

from learner.models.tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclass
class ModelConfig:
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4  # query heads; head_dim = hidden_size // num_heads
    num_kv_heads: int = 2  # grouped-query attention
    num_experts: int = 8
    experts_per_token: int = 2  # top-k routing
    expert_width: int = 256  # moe_intermediate_size
    norm_topk_prob: bool = True  # renormalise the top-k gate weights to sum to 1 (Qwen3-MoE checkpoints do)
    max_positions: int = 1024  # rope table size: prompt + response + tool observations
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_embeddings: bool = True
    # Router load-balancing loss (Switch-style). transformers adds it to `loss` only when the forward is
    # called with labels AND output_router_logits=True; our helpers never do, so the trainer adds
    # `router_aux_loss_coef * load_balancing_loss(...)` explicitly if it wants one (0 disables).
    router_aux_loss_coef: float = 0.001
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"  # both fp32 exact to ~1e-6

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"ModelConfig.hidden_size={self.hidden_size} "
                             f"is not a multiple of num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads={self.num_heads} "
                             f"is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"ModelConfig.experts_per_token={self.experts_per_token} "
                             f"must be in 1..num_experts={self.num_experts}")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"ModelConfig.attn_implementation={self.attn_implementation!r}: use 'sdpa' or 'eager'")


def to_hf_config(cfg: ModelConfig, vocab_size: int) -> Qwen3MoeConfig:
    """The transformers config for `cfg` over a vocabulary of `vocab_size` tokens (float32)."""
    hf = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.expert_width,  # unused: every layer is sparse (decoder_sparse_step=1)
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_theta=cfg.rope_theta,
        decoder_sparse_step=1,
        moe_intermediate_size=cfg.expert_width,
        num_experts_per_tok=cfg.experts_per_token,
        num_experts=cfg.num_experts,
        norm_topk_prob=cfg.norm_topk_prob,
        output_router_logits=False,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        dtype="float32",
    )
    hf._attn_implementation = cfg.attn_implementation
    return hf


def from_hf_config(hf: Qwen3MoeConfig) -> ModelConfig:
    """The inverse of `to_hf_config` (the vocabulary size lives in `hf.vocab_size`)."""
    return ModelConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads, num_experts=hf.num_experts, experts_per_token=hf.num_experts_per_tok,
        expert_width=hf.moe_intermediate_size, norm_topk_prob=hf.norm_topk_prob,
        max_positions=hf.max_position_embeddings, rope_theta=hf.rope_theta, rms_norm_eps=hf.rms_norm_eps,
        init_std=hf.initializer_range, tie_embeddings=hf.tie_word_embeddings,
        router_aux_loss_coef=hf.router_aux_loss_coef,
        attn_implementation=getattr(hf, "_attn_implementation", None) or "sdpa",
    )

