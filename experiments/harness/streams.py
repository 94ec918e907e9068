"""Task streams of a harness run: a scenario's stream, its per-phase prefix for groups, the tasks streams share."""

from __future__ import annotations

import math

import msgspec

from simulator.generator import generate
from simulator.scenario import Scenario
from streamer.wire.schema import DriftEvent, Task


def phase_prefix(stream: list[Task | DriftEvent], n: int) -> list[Task | DriftEvent]:
    """The first ceil(k / n) tasks of each phase (k its tasks), drift events kept: with groups of n, every phase
    takes the same number of rollouts as with single rollouts, and its tasks are a prefix of theirs."""
    if n == 1:
        return list(stream)
    per_phase: dict[int, int] = {}
    for m in stream:
        if isinstance(m, Task):
            per_phase[m.phase] = per_phase.get(m.phase, 0) + 1
    seen: dict[int, int] = {}
    out: list[Task | DriftEvent] = []
    for m in stream:
        if isinstance(m, Task):
            seen[m.phase] = seen.get(m.phase, 0) + 1
            if seen[m.phase] > math.ceil(per_phase[m.phase] / n):
                continue
        out.append(m)
    return out


def scenario_stream(scn: Scenario, seed: int, limit: int | None = None) -> list[Task | DriftEvent]:
    return list(generate(scn, seed=seed, t0=0.0, limit=limit))


def shared_tasks(streams: list[list[Task | DriftEvent]]) -> int:
    """How many tasks every stream starts with, equal in every field."""
    enc = [[msgspec.json.encode(m) for m in s if isinstance(m, Task)] for s in streams]
    return next((i for i, same in enumerate(zip(*enc)) if len(set(same)) > 1), min(map(len, enc)))

