"""The family interface: seeded task sampling, verification and demonstration of one task kind."""

from __future__ import annotations

import random
from typing import Any, Protocol

from simulator.text import Verdict
from streamer.wire.schema import Task


class Family(Protocol):
    name: str
    multi_turn: bool

    def check_concept(self, concept: str) -> None:
        """Raise ValueError (saying what is allowed) if `concept` is not one of this family's."""

    def check_spec(self, spec: dict[str, Any]) -> None:
        """Raise ValueError naming the key if `spec` cannot drive the environment and verifier."""

    def sample(self, rng: random.Random, concept: str, options: dict[str, Any], tag: bool = False
               ) -> tuple[str, str, dict[str, Any]]:
        """(prompt, reference answer, spec) of a fresh task of `concept`."""

    def verify(self, task: Task, answer: object) -> Verdict:
        """Score a final answer; never raises, whatever `answer` is."""

    def demonstrate(self, task: Task) -> str:
        """What an ideal agent generates for `task` (observations included for multi-turn families)."""


def need(spec: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in spec:
        raise ValueError(f"spec.{key}: missing")
    value = spec[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ValueError(f"spec.{key}: expected {names}, got {type(value).__name__}")
    return value


def option(options: dict[str, Any], key: str, default: Any) -> Any:
    return options.get(key, default) if options else default
