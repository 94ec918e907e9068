"""The task stream of a scenario: `generate(scn, seed)` yields Task and DriftEvent messages in order.

Time is simulated when the scenario has a rate (created_at = t0 + arrival clock), so a seed gives
the same stream, timestamps included; the caller decides whether to pace it in real time.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator

from simulator.drift import block_concepts, block_of, concept_for, final_concepts
from simulator.families import FAMILIES
from simulator.latency import LatencyConfig
from simulator.scenario import Phase, Scenario
from streamer.wire.schema import DriftEvent, Task


@dataclasses.dataclass
class _Clock:
    rate: float
    arrival: str
    t: float = 0.0

    def tick(self, rng: random.Random) -> float:
        if self.rate > 0:
            self.t += rng.expovariate(self.rate) if self.arrival == "poisson" else 1.0 / self.rate
        return self.t


def _drift_event(phase: Phase, index: int, prev_index: int, name: str, families: dict[str, float],
                 concepts: dict[str, str], prev: dict[str, str], seq: int, at: float) -> DriftEvent:
    return DriftEvent(phase=index, prev_phase=prev_index, name=name, schedule=phase.schedule,
                      families=sorted(f for f, w in families.items() if w > 0), concepts=dict(concepts),
                      prev_concepts=dict(prev), at_seq=seq, time=at)


def generate(scn: Scenario, seed: int | None = None, t0: float | None = None,
             limit: int | None = None) -> Iterator[Task | DriftEvent]:
    """Tasks of every phase in order, a DriftEvent before the first task of each later phase (and of each
    recurring block or incremental step, with phase == prev_phase). `limit` caps the number of tasks."""
    seed = scn.seed if seed is None else seed
    rng = random.Random(seed)
    t0 = time.time() if t0 is None else t0
    clock = _Clock(scn.rate, scn.arrival)
    # only a non-default latency travels in tool specs (the env's default is LatencyConfig())
    latency = dataclasses.asdict(scn.latency) if scn.latency != LatencyConfig() else None
    weights: dict[str, float] = {}
    prev: dict[str, str] = {}
    seq = 0
    for index, phase in enumerate(scn.phases):
        weights = phase.families or weights
        fams = [f for f, w in weights.items() if w > 0]
        wts = [weights[f] for f in fams]
        start_t, k, block = clock.t, 0, 0
        if index > 0:
            yield _drift_event(phase, index, index - 1, phase.name, weights, block_concepts(phase, prev, 0),
                               prev, seq, t0 + clock.t)
        while limit is None or seq < limit:
            x = k if phase.duration_tasks else clock.t - start_t
            if x >= phase.duration:
                break
            b = block_of(phase, x)
            if b != block:
                yield _drift_event(phase, index, index, f"{phase.name}#{b}", weights,
                                   block_concepts(phase, prev, b), block_concepts(phase, prev, block),
                                   seq, t0 + clock.t)
                block = b
            family = rng.choices(fams, wts)[0]
            concept = concept_for(phase, prev, family, x, rng) if index > 0 else block_concepts(phase, prev, 0)[family]
            prompt, answer, spec = FAMILIES[family].sample(rng, concept, scn.options.get(family, {}))
            if latency and FAMILIES[family].multi_turn:
                spec["latency"] = latency
            stamp = t0 + clock.tick(rng) if scn.rate > 0 else time.time()
            yield Task(task_id=f"{scn.name}-{seed}-{seq}", family=family, concept=concept, phase=index,
                       prompt=prompt, answer=answer, spec=spec, seq=seq, created_at=stamp)
            seq += 1
            k += 1
        prev = final_concepts(phase, prev)
        if limit is not None and seq >= limit:
            return
