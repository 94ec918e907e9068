"""Tasks of a recorded stream, scored by the verifier their row names (`simulator.verifiers`).

The row's tags give the task its family and concept (for per-tag analysis), so this family is chosen by the
spec, not by name: a task whose spec holds `verifier` is verified here whatever its family tag
(`simulator.families.family_of`). It cannot sample tasks (only streams have them); its demonstration is the
reference, for a supervised warm start from a stream's demonstrations.
"""

from __future__ import annotations

import random
from typing import Any

from simulator import tool_envs, verifiers
from simulator.plugins import PluginError
from simulator.text import MARKUP, Verdict, rejected, to_text
from streamer.wire.schema import Task

MAX_ANSWER_CHARS = 4096  # longer final answers are scored 0 unread


class Verified:
    name = "verified"
    multi_turn = False

    def check_concept(self, concept: str) -> None:
        if not concept:
            raise ValueError("verified concept: empty")

    def check_spec(self, spec: dict[str, Any], reference: str | None = None) -> None:
        """`reference`: the task's answer, checked too where the verifier reads it as a pattern (`regex`)."""
        try:
            verifiers.check(spec.get("verifier"), spec.get("params", {}), reference)
            if spec.get("tools") is not None:
                tool_envs.check(spec["tools"])
        except PluginError as e:
            raise ValueError(f"spec.{e.field}: {e}") from None
        if not isinstance(spec.get("tags", {}), dict):
            raise ValueError("spec.tags: expected an object")

    def sample(self, rng: random.Random, concept: str, options: dict[str, Any], tag: bool = False):
        raise ValueError("verified tasks come from a recorded stream (sao replay), not from a scenario")

    def verify(self, task: Task, answer: object) -> Verdict:
        text = to_text(answer)
        if text is None:
            return rejected({"invalid_type": 1.0})
        if len(text) > MAX_ANSWER_CHARS:
            return rejected({"too_long": 1.0})
        if any(m in text for m in MARKUP):
            return rejected({"markup": 1.0})
        try:
            reward = verifiers.score(task.spec["verifier"], text, task.answer, task.spec.get("params", {}))
        except verifiers.VerifierTimeout as e:  # a ValueError: the agent dead-letters the task with this reason
            raise verifiers.VerifierTimeout(f"task {task.task_id}: {e}; scored 0, task dead-lettered") from None
        return Verdict(reward, {"correct": reward}, reward >= 1.0)

    def demonstrate(self, task: Task) -> str:
        return task.answer
