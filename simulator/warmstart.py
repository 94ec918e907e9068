"""Warm-start data: demonstrations of a scenario's concept mixture, for the supervised warm start.

Drift must be recoverable by RL: right after a drift the new behaviour needs some probability
under the pre-drift policy. So the warm start covers several concepts per family (the scenario's
`warm_start.mixture`, e.g. 70/20/10) with prompts that usually do not name the concept; the tag
is shown with probability 1 - tag_dropout, which teaches each concept cleanly while the untagged
prompt (the one drifted streams use) keeps the mixture (CALIBRATION.md: tag dropout recovers fastest).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from simulator.families import FAMILIES
from simulator.families.tools import TOOLS, parse_concept
from simulator.scenario import Scenario, load_scenario, resolve_path
from streamer.wire.schema import Task

_OBS = re.compile(r"(<obs>.*?</obs>)", re.S)


@dataclass
class Demo:
    task: Task
    text: str  # what the agent should generate, observations included


def warm_families(scn: Scenario) -> dict[str, float]:
    return {f: w for f, w in (scn.warm_start.families or scn.phases[0].families).items() if w > 0}


def mixture(scn: Scenario, family: str) -> dict[str, float]:
    """The family's warm-start concept weights (phase 0's concept alone when the scenario gives none)."""
    mix = scn.warm_start.mixture.get(family)
    return dict(mix) if mix else {scn.phases[0].concepts[family]: 1.0}


def _wrong_tool(rng: random.Random, right: str, candidates: list[str]) -> str:
    others = [t for t in candidates if t != right] or [t for t in TOOLS if t != right]
    return rng.choice(others)


def demos(scn: Scenario, seed: int = 0, tagged: bool | None = None,
          concepts: dict[str, str] | None = None) -> Iterator[Demo]:
    """An endless seeded stream of demonstrations. `concepts` pins each family to one concept (evaluation);
    `tagged` forces the tag on or off (default: shown with probability 1 - tag_dropout)."""
    rng = random.Random(seed)
    fams = warm_families(scn)
    names, weights = list(fams), list(fams.values())
    mixes = {f: mixture(scn, f) for f in names}
    tool_names = sorted({parse_concept(c)[0] for c in mixes.get("tool", {})})
    ws = scn.warm_start
    n = 0
    while True:
        family = rng.choices(names, weights)[0]
        mix = mixes[family]
        concept = concepts[family] if concepts else rng.choices(list(mix), list(mix.values()))[0]
        tag = rng.random() >= ws.tag_dropout if tagged is None else tagged
        prompt, answer, spec = FAMILIES[family].sample(rng, concept, scn.options.get(family, {}), tag=tag)
        task = Task(task_id=f"warm-{seed}-{n}", family=family, concept=concept, prompt=prompt, answer=answer,
                    spec=spec)
        if family == "tool" and rng.random() < ws.error_demo:
            text = FAMILIES["tool"].demonstrate(task, wrong_tool=_wrong_tool(rng, spec["tool"], tool_names))
        else:
            text = FAMILIES[family].demonstrate(task)
        n += 1
        yield Demo(task, text)


def segments(text: str) -> list[tuple[str, bool]]:
    """Split a demonstration into (text, generated-by-the-agent) pieces: observations are the environment's."""
    return [(part, not part.startswith("<obs>")) for part in _OBS.split(text) if part]


def held_out_tasks(scn: Scenario, concepts: dict[str, str], n: int, seed: int) -> list[Task]:
    """`n` untagged tasks (as drifted streams show them) of the given concepts, from a held-out seed (10,000 +
    `seed`: the warm start trains on small seeds): the warm start's evaluation and the evaluator's held-out set."""
    stream = demos(scn, seed=10_000 + seed, tagged=False, concepts=concepts)
    return [next(stream).task for _ in range(n)]


def scenario_texts(n: int = 4000) -> list[str]:
    """Prompts and demonstrations of the default scenario's warm-start mixture (`n` demonstrations): texts to train
    a toy model's tokenizer on (`sao toy-model`, `learner.models.toy`)."""
    stream = demos(load_scenario(resolve_path("default")), seed=0)
    return [s for d in (next(stream) for _ in range(n)) for s in (d.task.prompt, d.text)]
