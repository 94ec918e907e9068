"""Policy/value losses and advantage estimators: pure tensor functions, picked by name."""

from learner.algorithms.advantages import (
    BATCH_ESTIMATORS,
    GROUP_ESTIMATORS,
    NEEDS_GROUPS,
    adaptive_lambda,
    dr_grpo,
    gae,
    group_advantages,
    grpo,
    place_reward,
    reinforce_pp,
    rloo,
    sao_actor_advantages,
    sao_advantages,
    sao_returns,
)
from learner.algorithms.kl import FULL_KL_TYPES, KL_TYPES, forward_kl, kl_penalty
from learner.algorithms.losses import POLICY_LOSSES, loss_params, policy_loss
from learner.algorithms.masked import AGGS, aggregate, masked_mean, masked_whiten
from learner.algorithms.value import explained_variance, value_loss

__all__ = [
    "AGGS", "BATCH_ESTIMATORS", "FULL_KL_TYPES", "GROUP_ESTIMATORS", "KL_TYPES", "NEEDS_GROUPS", "POLICY_LOSSES",
    "adaptive_lambda", "aggregate", "dr_grpo", "explained_variance", "forward_kl", "gae", "group_advantages", "grpo",
    "kl_penalty", "loss_params", "masked_mean", "masked_whiten", "place_reward", "policy_loss", "reinforce_pp", "rloo",
    "sao_actor_advantages", "sao_advantages", "sao_returns", "value_loss",
]
