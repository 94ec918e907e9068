"""Modular arithmetic with a hidden operator: `3#5=`; the concept (`add10`, `mul7`, ...) says what `#` means.

Drift changes the operator semantics and the modulus while the prompt stays the same, so the
right answer after a drift is one the warm-start mixture already gives some probability.
"""

from __future__ import annotations

import random
import re
from typing import Any

from simulator.families.base import need, option
from simulator.text import Verdict, clean_answer, rejected, tagged
from streamer.wire.schema import Task

OPS = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "max": lambda a, b: max(a, b),
    "min": lambda a, b: min(a, b),
    "absdiff": lambda a, b: abs(a - b),
}
_CONCEPT = re.compile(r"^(" + "|".join(OPS) + r")(\d{1,2})$")


def parse_concept(concept: str) -> tuple[str, int]:
    m = _CONCEPT.match(concept) if isinstance(concept, str) else None
    if not m or not 2 <= int(m.group(2)) <= 99:
        raise ValueError(f"arith concept '{concept}': expected <op><modulus>, op in {sorted(OPS)}, "
                         "modulus 2..99 (e.g. add10)")
    return m.group(1), int(m.group(2))


def solve(op: str, mod: int, a: int, b: int) -> str:
    return str(OPS[op](a, b) % mod)


class Arith:
    name = "arith"
    multi_turn = False

    def check_concept(self, concept: str) -> None:
        parse_concept(concept)

    def check_spec(self, spec: dict[str, Any]) -> None:
        op = need(spec, "op", str)
        if op not in OPS:
            raise ValueError(f"spec.op: '{op}' not in {sorted(OPS)}")
        if not 2 <= need(spec, "mod", int) <= 99:
            raise ValueError("spec.mod: outside 2..99")
        for key in ("a", "b"):
            if not 0 <= need(spec, key, int) <= 999:
                raise ValueError(f"spec.{key}: outside 0..999")

    def sample(self, rng: random.Random, concept: str, options: dict[str, Any], tag: bool = False):
        op, mod = parse_concept(concept)
        hi = int(option(options, "max_operand", 9))
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        prompt = tagged(f"{a}#{b}=", concept, tag)
        return prompt, solve(op, mod, a, b), {"op": op, "mod": mod, "a": a, "b": b}

    def verify(self, task: Task, answer: object) -> Verdict:
        text, why = clean_answer(answer)
        if text is None:
            return rejected(why)
        s = task.spec
        ok = text == solve(s["op"], s["mod"], s["a"], s["b"])
        return Verdict(float(ok), {"correct": float(ok), "numeric": float(text.isdigit())}, ok)

    def demonstrate(self, task: Task) -> str:
        s = task.spec
        return solve(s["op"], s["mod"], s["a"], s["b"])
