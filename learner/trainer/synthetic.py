"""Synthetic trajectories for learner tests and benchmarks: random tokens scored by a real policy.

The behaviour log-probs are the policy's own (so r = 1 before the first update), generated tokens
may be interrupted by an "observation" gap like a tool call's, and the reward is a fixed random
0/1 per task. Nothing here is used by the trainer itself.
"""

from __future__ import annotations

import random

import torch

from learner.models.config import ModelConfig
from learner.models.scoring import token_logprobs
from learner.models.tokenizer import BOS_ID
from streamer.wire.schema import Trajectory

TINY_OVERRIDES = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1",
                  "model.num_experts=2", "model.experts_per_token=1", "model.expert_width=32"]


def tiny_model_config() -> ModelConfig:
    """A ~20k-parameter policy of the same architecture (fast enough for unit tests)."""
    return ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, num_experts=2,
                       experts_per_token=1, expert_width=32)


@torch.no_grad()
def synthetic_trajectories(policy: torch.nn.Module, n: int, seed: int = 0, version: int = 0,
                           group_size: int = 1, prefix: str = "") -> list[Trajectory]:
    """n trajectories (n/group_size tasks of group_size members each)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        task = i // group_size
        p, g = rng.randint(3, 6), rng.randint(3, 8)
        tokens = [BOS_ID] + [rng.randint(8, 40) for _ in range(p - 1 + g)]
        mask = [0] * p + [1] * g
        if g > 4:
            mask[p + 2] = 0  # an environment observation between two generated spans
        lp = token_logprobs(policy, torch.tensor([tokens]))[0].tolist()
        out.append(Trajectory(
            traj_id=f"{prefix}s{seed}-{i}", task_id=f"{prefix}task{seed}-{task}", family="arith", concept="a",
            group_id=f"{prefix}task{seed}-{task}" if group_size > 1 else "", group_size=group_size,
            prompt_len=p, tokens=tokens, loss_mask=mask, logprobs=[x if m else 0.0 for x, m in zip(lp, mask)],
            reward=float(rng.random() < 0.5), policy_version=version, policy_versions=[version]))
    return out
