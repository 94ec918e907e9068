"""Drift schedules as pure functions of the position `x` inside a phase (tasks or simulated seconds).

- abrupt: the new concept from the first task of the phase;
- gradual: the new concept with probability sigmoid((x - center) / width), the previous one otherwise;
- recurring: blocks of `period` alternate new, previous, new, ...;
- incremental: a list of concepts visited in equal steps over the phase.
"""

from __future__ import annotations

import math
import random
from typing import Any

from simulator.scenario import Phase


def sigmoid_p(x: float, center: float, width: float) -> float:
    z = (x - center) / width
    return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0


def center_of(phase: Phase) -> float:
    return phase.duration / 2 if phase.center is None else phase.center


def block_of(phase: Phase, x: float) -> int:
    """Index of the sub-concept block at x: recurring blocks, incremental steps; 0 otherwise."""
    if phase.schedule == "recurring":
        return int(x // phase.period)
    if phase.schedule == "incremental":
        n = n_steps(phase)
        return min(int(x * n / phase.duration), n - 1)
    return 0


def n_steps(phase: Phase) -> int:
    return max([len(c) for c in phase.concepts.values() if isinstance(c, list)] or [1])


def step_concept(target: Any, step: int) -> str:
    return target[min(step, len(target) - 1)] if isinstance(target, list) else target


def block_concepts(phase: Phase, prev: dict[str, str], block: int) -> dict[str, str]:
    """The concepts rewarded in one block (gradual: the target concepts)."""
    new = {**prev, **{f: step_concept(c, block) for f, c in phase.concepts.items()}}
    if phase.schedule == "recurring" and block % 2 == 1:
        return dict(prev)
    return new


def final_concepts(phase: Phase, prev: dict[str, str]) -> dict[str, str]:
    """What the next phase drifts from: the target concepts (the last step, for incremental)."""
    return {**prev, **{f: step_concept(c, 10 ** 9) for f, c in phase.concepts.items()}}


def concept_for(phase: Phase, prev: dict[str, str], family: str, x: float, rng: random.Random) -> str:
    target = block_concepts(phase, prev, block_of(phase, x))[family]
    if phase.schedule != "gradual" or target == prev.get(family, target):
        return target
    return target if rng.random() < sigmoid_p(x, center_of(phase), phase.width) else prev[family]
