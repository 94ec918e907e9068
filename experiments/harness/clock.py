"""The simulated clock: when a task arrives, when a rollout finishes, and the order of events at one time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamer.wire.schema import Task


def arrival_times(tasks: list[Task], scenario_rate: float, rate: float) -> list[float]:
    """Simulated arrival of each task: its stream time rescaled to `rate` (0: all present at time 0)."""
    if rate <= 0:
        return [0.0] * len(tasks)
    if scenario_rate > 0:
        return [t.created_at * scenario_rate / rate for t in tasks]
    return [i / rate for i in range(len(tasks))]


def finish_time(start: float, gen_tokens: int, env_seconds: float, gen_tokens_per_s: float) -> float:
    return start + gen_tokens / gen_tokens_per_s + env_seconds


@dataclass(order=True)
class Event:
    time: float
    order: int  # joins before publications before ticks at one time, then FIFO
    seq: int
    kind: str = field(compare=False)
    payload: Any = field(compare=False, default=None)


ORDER = {"join": 0, "publish": 1, "tick": 2}
