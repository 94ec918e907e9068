"""Scenario files: YAML phases (family mix, concepts, duration, drift schedule), typed and validated.

Errors name the file, the phase (index and name) and the field, e.g.
`default.yaml: phase 2 ('sort') field 'width': gradual needs width > 0`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from simulator.families import FAMILIES
from simulator.latency import LatencyConfig
from streamer.wire.config import ConfigError, load_config

SCENARIO_DIR = Path(__file__).parent / "scenarios"
Schedule = Literal["abrupt", "gradual", "recurring", "incremental"]


class ScenarioError(ConfigError):
    pass


@dataclass
class Phase:
    name: str = ""
    schedule: Schedule = "abrupt"  # how this phase's concepts replace the previous ones
    duration_tasks: int = 0  # length in tasks, or
    duration_s: float = 0.0  # in seconds of the simulated clock (needs rate > 0)
    families: dict[str, float] = field(default_factory=dict)  # mix weights; empty: keep the previous mix
    concepts: dict[str, Any] = field(default_factory=dict)  # family -> concept; incremental: a list of steps
    width: float = 0.0  # gradual: sigmoid width, in the duration's unit
    center: float | None = None  # gradual: sigmoid midpoint from the phase start (default: half the phase)
    period: float = 0.0  # recurring: block length; blocks alternate new, previous, new, ...

    @property
    def duration(self) -> float:
        return float(self.duration_tasks or self.duration_s)


@dataclass
class WarmStart:
    families: dict[str, float] = field(default_factory=dict)  # default: phase 0's mix
    mixture: dict[str, dict[str, float]] = field(default_factory=dict)  # family -> concept -> weight
    tag_dropout: float = 0.5  # probability the concept tag is hidden in a warm-start prompt
    error_demo: float = 0.1  # tool family: fraction of demos that call a wrong tool, read the error, retry


@dataclass
class Scenario:
    name: str = "scenario"
    seed: int = 0
    rate: float = 0.0  # tasks per simulated second (0: untimed, stamped with the wall clock)
    arrival: Literal["fixed", "poisson"] = "fixed"
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # family -> sampling options
    latency: LatencyConfig = field(default_factory=LatencyConfig)  # tool latency carried in tool specs
    warm_start: WarmStart = field(default_factory=WarmStart)
    phases: list[Phase] = field(default_factory=list)


def _phase_label(raw_phases: list, i: int) -> str:
    name = raw_phases[i].get("name", "") if i < len(raw_phases) and isinstance(raw_phases[i], dict) else ""
    return f"phase {i} ('{name}')"


def _rewrite(msg: str, raw_phases: list) -> str:
    """msgspec's `- at $.phases[2].width` -> `phase 2 ('name') field 'width'`."""
    m = re.search(r"- at `\$\.phases\[(\d+)\]\.?([^`]*)`", msg)
    if not m:
        return msg
    i = int(m.group(1))
    return f"{_phase_label(raw_phases, i)} field '{m.group(2)}': {msg[:m.start()].strip()}"


def load_scenario(path: str | Path, overrides: list[str] = ()) -> Scenario:
    """A validated scenario from a YAML file (or a name under simulator/scenarios/)."""
    path = resolve_path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ScenarioError(f"{path}: {e}") from None
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: expected a mapping at the top level")
    phases = raw.get("phases", [])
    if not isinstance(phases, list):
        raise ScenarioError(f"{path}: field 'phases': expected a list of phases")
    known = {f.name for f in dataclasses.fields(Phase)}
    for i, p in enumerate(phases):
        if not isinstance(p, dict):
            raise ScenarioError(f"{path}: {_phase_label(phases, i)}: expected a mapping")
        for key in p:
            if key not in known:
                raise ScenarioError(f"{path}: {_phase_label(phases, i)} field '{key}': unknown "
                                    f"(known: {', '.join(sorted(known))})")
    try:
        scn = load_config(Scenario, None, overrides, base=raw)
    except ConfigError as e:
        raise ScenarioError(f"{path}: {_rewrite(str(e).removeprefix('Scenario: '), phases)}") from None
    validate_scenario(scn, str(path))
    return scn


def resolve_path(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists() and not p.suffix and (SCENARIO_DIR / f"{p}.yaml").exists():
        return SCENARIO_DIR / f"{p}.yaml"
    return p


def _check_weights(weights: dict[str, float], where: str) -> None:
    for fam, w in weights.items():
        if fam not in FAMILIES:
            raise ScenarioError(f"{where}.{fam}': unknown family (known: {', '.join(FAMILIES)})")
        if not w >= 0:
            raise ScenarioError(f"{where}.{fam}': weight must be >= 0, got {w}")
    if weights and sum(weights.values()) <= 0:
        raise ScenarioError(f"{where}': weights sum to 0")


def _check_concept(fam: str, concept: Any, where: str) -> None:
    if fam not in FAMILIES:
        raise ScenarioError(f"{where}': unknown family (known: {', '.join(FAMILIES)})")
    try:
        FAMILIES[fam].check_concept(concept)
    except ValueError as e:
        raise ScenarioError(f"{where}': {e}") from None


def _check_phase(scn: Scenario, i: int, p: Phase, at: str) -> None:
    if (p.duration_tasks > 0) == (p.duration_s > 0):
        raise ScenarioError(f"{at} field 'duration_tasks': set exactly one of duration_tasks, duration_s (> 0)")
    if p.duration_s > 0 and scn.rate <= 0:
        raise ScenarioError(f"{at} field 'duration_s': needs the scenario's rate > 0 (the simulated clock)")
    _check_weights(p.families, f"{at} field 'families")
    for fam, c in p.concepts.items():
        steps = c if isinstance(c, list) else [c]
        if isinstance(c, list) and (p.schedule != "incremental" or not c):
            raise ScenarioError(f"{at} field 'concepts.{fam}': a list of concepts needs schedule incremental "
                                "and at least one step")
        for step in steps:
            _check_concept(fam, step, f"{at} field 'concepts.{fam}")
    if i == 0 and p.schedule != "abrupt":
        raise ScenarioError(f"{at} field 'schedule': the first phase has nothing to drift from; use abrupt")
    if p.schedule == "gradual" and not p.width > 0:
        raise ScenarioError(f"{at} field 'width': gradual needs width > 0")
    if p.schedule == "gradual" and p.center is not None and not 0 <= p.center <= p.duration:
        raise ScenarioError(f"{at} field 'center': must lie in 0..duration ({p.duration:g})")
    if p.schedule == "recurring" and not 0 < p.period < p.duration:
        raise ScenarioError(f"{at} field 'period': recurring needs 0 < period < duration ({p.duration:g})")


def validate_scenario(scn: Scenario, where: str = "scenario") -> None:
    if not scn.phases:
        raise ScenarioError(f"{where}: field 'phases': at least one phase is needed")
    if scn.rate < 0:
        raise ScenarioError(f"{where}: field 'rate': must be >= 0")
    try:
        scn.latency.validate()
    except ValueError as e:
        raise ScenarioError(f"{where}: field {e}") from None
    for fam in scn.options:
        if fam not in FAMILIES:
            raise ScenarioError(f"{where}: field 'options.{fam}': unknown family (known: {', '.join(FAMILIES)})")
    active: set[str] = set()
    concepts: set[str] = set()
    for i, p in enumerate(scn.phases):
        at = f"{where}: phase {i} ('{p.name}')"
        _check_phase(scn, i, p, at)
        if p.families:
            active = {f for f, w in p.families.items() if w > 0}
        concepts |= set(p.concepts)
        missing = sorted(active - concepts)
        if missing:
            raise ScenarioError(f"{at} field 'concepts': no concept given yet for families {missing}")
    if not {f for f, w in scn.phases[0].families.items() if w > 0}:
        raise ScenarioError(f"{where}: phase 0 ('{scn.phases[0].name}') field 'families': needs a family mix")
    _check_warm_start(scn.warm_start, f"{where}: field 'warm_start")


def _check_warm_start(ws: WarmStart, where: str) -> None:
    _check_weights(ws.families, f"{where}.families")
    for fam, mix in ws.mixture.items():
        for concept in mix:
            _check_concept(fam, concept, f"{where}.mixture.{fam}")
        _check_weights({fam: sum(mix.values())}, f"{where}.mixture")
        if any(not w >= 0 for w in mix.values()):
            raise ScenarioError(f"{where}.mixture.{fam}': weights must be >= 0")
    for name in ("tag_dropout", "error_demo"):
        if not 0.0 <= getattr(ws, name) <= 1.0:
            raise ScenarioError(f"{where}.{name}': must lie in 0..1")
