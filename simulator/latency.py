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
        if self.mean_s < 0 or self.max_s < 0:
            raise ValueError("latency.mean_s and latency.max_s must be >= 0")
        if self.kind == "pareto" and self.alpha <= 1:
            raise ValueError("latency.alpha: pareto needs alpha > 1 for a finite mean")
        if self.kind == "lognormal" and self.sigma <= 0:
            raise ValueError("latency.sigma: must be > 0")


def latency_from_dict(d: dict[str, Any] | None) -> LatencyConfig | None:
    if not d:
        return None
    cfg = LatencyConfig(**d)
    cfg.validate()
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
