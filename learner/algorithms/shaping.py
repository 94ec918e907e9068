"""Reward shaping before the advantages: DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476, eq. 13).

With a response cap L_max and a buffer L_cache, a response of |y| generated tokens gets

    R_length(y) = 0                                  |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                = -1                                 |y| > L_max

times `penalty` (verl's overlong_buffer.penalty_factor, 1.0 by default), added to the task reward: the penalty grows
linearly from 0 to -penalty over the buffer, so a truncated answer is told apart from a wrong one that ended. verl's
DAPO reward manager computes min(-(|y| - (L_max - L_cache)) / L_cache * penalty_factor, 0), the same for |y| <= L_max
(its responses never pass L_max). |y| is the trajectory's generated tokens (its loss mask; observations excluded).
The learner adds it where it turns rewards into advantages (learner.trainer.step); dynamic sampling
(advantage.dynamic_sampling) looks at the task reward alone, as DAPO's filter on accuracy does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamer.wire.config import ConfigError


@dataclass
class OverlongConfig:
    """LearnerConfig.advantage.overlong. max_tokens 0: off (buffer must then be 0)."""

    max_tokens: int = 0  # L_max: the generated tokens an episode can hold (its truncation point)
    buffer: int = 0  # L_cache: the last tokens before max_tokens over which the penalty grows (1..max_tokens)
    penalty: float = 1.0  # the penalty at max_tokens and beyond (verl's penalty_factor)

    def __post_init__(self) -> None:  # runs in load_config too (msgspec builds the dataclass): refused there
        where = "advantage.overlong"  # load_config prefixes "LearnerConfig: " and appends the path
        if self.max_tokens < 0:
            raise ConfigError(f"{where}.max_tokens: {self.max_tokens} must be >= 0 (0: off)")
        if not 0 <= self.buffer <= self.max_tokens:
            raise ConfigError(f"{where}.buffer: {self.buffer} must be in [0, max_tokens {self.max_tokens}] (max_tokens "
                              "0: off)")
        if self.max_tokens and not self.buffer:
            raise ConfigError(f"{where}.buffer: 0 with max_tokens {self.max_tokens}: set a buffer of 1..max_tokens")
        if not self.penalty >= 0:
            raise ConfigError(f"{where}.penalty: {self.penalty} must be >= 0")

    @property
    def on(self) -> bool:
        return self.max_tokens > 0


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """[B] generated-token counts -> [B] soft overlong punishment (eq. 13 above), float32; all 0 when max_tokens is
    0."""
    if max_tokens <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    soft = ((max_tokens - buffer) - lengths.float()) / buffer
    return soft.clamp(min=-1.0, max=0.0) * penalty


def shaped_rewards(rewards: torch.Tensor, mask: torch.Tensor, cfg: OverlongConfig) -> torch.Tensor:
    """[B] task rewards plus the overlong punishment of each row's generated tokens (`mask` [B, T], 1 on them)."""
    if not cfg.on:
        return rewards
    return rewards + overlong_penalty(mask.sum(-1), cfg.max_tokens, cfg.buffer, cfg.penalty).to(rewards.dtype)
