"""Simulated tool latency: in real agentic RL environment time dominates, and asynchrony overlaps it."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Literal


@dataclass
class LatencyConfig:
    kind: Literal["const", "exp", "lognormal", "pareto"] = "const"
    mean_s: float = 0.002  # mean seconds per tool call (const: every call)
    sigma: float = 1.0  # lognormal shape: larger is longer-tailed
    alpha: float = 1.5  # pareto tail index (> 1 for a finite mean): smaller is longer-tailed
    max_s: float = 30.0  # cap on one call
    sleep: bool = True  # False: report the latency without sleeping (tests, offline scoring)

    def validate(self) -> None:
        for name in ("mean_s", "sigma", "alpha", "max_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"latency.{name}: {getattr(self, name)} is not a finite number")
        if self.mean_s < 0 or self.max_s < 0:
            raise ValueError("latency.mean_s and latency.max_s must be >= 0")
        if self.kind == "pareto" and self.alpha <= 1:
            raise ValueError("latency.alpha: pareto needs alpha > 1 for a finite mean")
        if self.kind == "lognormal" and self.sigma <= 0:
            raise ValueError("latency.sigma: must be > 0")


TASK_MAX_S = 30.0  # the longest one tool call may take when a task message sets its own latency


def latency_from_dict(d: dict[str, Any] | None, cap_s: float = TASK_MAX_S) -> LatencyConfig | None:
    """A task's own latency spec (from its message), its cap no higher than `cap_s`: a task never decides how long
    an agent sleeps (a replayed row with mean_s=1e6 and max_s=1e9 would pin its partition's commit)."""
    if not d:
        return None
    if not isinstance(d, dict):
        raise ValueError(f"latency: expected a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - set(LatencyConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"latency: unknown field(s) {unknown}")
    cfg = LatencyConfig(**d)
    cfg.validate()
    cfg.max_s = min(cfg.max_s, cap_s)
    return cfg


def sample_latency(cfg: LatencyConfig, rng: random.Random) -> float:
    """One call's latency; every kind has mean `mean_s` (before the cap)."""
    m = cfg.mean_s
    if m == 0:
        return 0.0
    if cfg.kind == "const":
        x = m
    elif cfg.kind == "exp":
        x = rng.expovariate(1.0 / m)
    elif cfg.kind == "lognormal":
        # E[exp(N(mu, s^2))] = exp(mu + s^2/2) = m  =>  mu = ln m - s^2/2
        x = rng.lognormvariate(math.log(m) - cfg.sigma ** 2 / 2, cfg.sigma)
    else:
        # Pareto(x_min, a) has mean a x_min / (a - 1) = m
        x = m * (cfg.alpha - 1) / cfg.alpha * rng.paretovariate(cfg.alpha)
    return min(x, cfg.max_s)
