"""The equal-compute view of suite 2.0 (issue 49, item 5): what each post-drift prefix of a run cost, in token
forwards of the policy, the critic's forward and backward charged.

A generated token costs one forward. A learner step costs 3 forwards (forward and backward) per token it trained, per
update: the policy's (none in a critic-only warm-up step), plus the critic's at L_v / L_p of the policy's for a critic
of L_v of the policy's L_p blocks. The compute of a run's first i post-drift rollouts (in stream order) is their
generated tokens plus the steps completed before the i-th started.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from learner.config import LearnerConfig

FORWARD_BACKWARD = 3.0


def critic_share(cfg: LearnerConfig, init: str) -> float:
    """L_v / L_p of the run's critic (0 without one): value.layers of the policy's blocks, or all of them."""
    if not cfg.uses_value_model:
        return 0.0
    blocks = json.loads((Path(init) / "config.json").read_text())["num_hidden_layers"]
    if cfg.value.kind == "head":
        return 0.0  # a head on the policy's backbone: no second backbone to run
    return min(cfg.value.layers or blocks, blocks) / blocks


def step_costs(steps: pd.DataFrame, share: float, updates: int) -> np.ndarray:
    """Each learner step's compute, in the order of `steps`."""
    if not len(steps):
        return np.zeros(0)
    tokens = steps["n_tokens"].to_numpy(float)
    warm = steps["learner/value_warmup"].fillna(0).to_numpy(float) if "learner/value_warmup" in steps else 0.0
    return FORWARD_BACKWARD * tokens * updates * ((1.0 - warm) + share)


def prefix_compute(n_gen: np.ndarray, steps_before: np.ndarray, post_step_costs: np.ndarray) -> np.ndarray:
    """The compute of every post-drift prefix: its generated tokens, and the first `steps_before[i]` post-drift steps'
    costs for the prefix ending at rollout i."""
    paid = np.concatenate([[0.0], np.cumsum(post_step_costs)])
    return np.cumsum(np.asarray(n_gen, float)) + paid[np.asarray(steps_before, int)]
