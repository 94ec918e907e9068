"""Models: tokenizers, the tiny Qwen3-MoE policy (or any HF causal LM), value model, per-token scoring helpers."""

from learner.models.config import ModelConfig, from_hf_config, to_hf_config
from learner.models.policy import build_policy, count_params, load_policy, save_policy
from learner.models.scoring import (
    entropy_from_logits,
    expert_counts,
    load_balancing_loss,
    logprobs_and_entropy,
    logprobs_from_logits,
    policy_logits,
    position_ids_from_mask,
    router_logits,
    token_entropy,
    token_logprobs,
    values,
)
from learner.models.tokenizer import CharTokenizer, HFTokenizer, hf_tokenizer, load_tokenizer, save_hf_tokenizer
from learner.models.value import ValueModel

__all__ = [
    "CharTokenizer", "HFTokenizer", "ModelConfig", "ValueModel", "build_policy", "count_params", "entropy_from_logits",
    "expert_counts", "from_hf_config", "hf_tokenizer", "save_hf_tokenizer", "load_balancing_loss", "load_policy",
    "load_tokenizer", "logprobs_and_entropy",
    "logprobs_from_logits", "policy_logits", "position_ids_from_mask", "router_logits", "save_policy",
    "to_hf_config", "token_entropy", "token_logprobs", "values",
]
