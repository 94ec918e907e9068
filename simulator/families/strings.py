"""String transformations with a hidden rule: `t:kqzd=`; the concept (reverse, sort, rotl, ...) is the rule."""

from __future__ import annotations

import random
import string
from typing import Any

from simulator.families.base import need, option
from simulator.text import Verdict, clean_answer, rejected, tagged
from streamer.wire.schema import Task

RULES = {
    "reverse": lambda w: w[::-1],
    "sort": lambda w: "".join(sorted(w)),
    "rotl": lambda w: w[1:] + w[:1],
    "rotr": lambda w: w[-1:] + w[:-1],
    "swap": lambda w: "".join(w[i + 1] + w[i] if i + 1 < len(w) else w[i] for i in range(0, len(w), 2)),
    "double": lambda w: "".join(c + c for c in w[:6]),
}
LETTERS = string.ascii_lowercase


def check_rule(concept: str) -> None:
    if concept not in RULES:
        raise ValueError(f"string concept '{concept}': expected one of {sorted(RULES)}")


class Strings:
    name = "string"
    multi_turn = False

    def check_concept(self, concept: str) -> None:
        check_rule(concept)

    def check_spec(self, spec: dict[str, Any]) -> None:
        check_rule(need(spec, "rule", str))
        word = need(spec, "word", str)
        if not 1 <= len(word) <= 12 or any(c not in LETTERS for c in word):
            raise ValueError("spec.word: expected 1..12 lowercase letters")

    def sample(self, rng: random.Random, concept: str, options: dict[str, Any], tag: bool = False):
        check_rule(concept)
        lo, hi = int(option(options, "min_len", 3)), int(option(options, "max_len", 6))
        letters = str(option(options, "letters", LETTERS[:12]))
        word = "".join(rng.choice(letters) for _ in range(rng.randint(lo, hi)))
        return tagged(f"t:{word}=", concept, tag), RULES[concept](word), {"rule": concept, "word": word}

    def verify(self, task: Task, answer: object) -> Verdict:
        text, why = clean_answer(answer)
        if text is None:
            return rejected(why)
        ok = text == RULES[task.spec["rule"]](task.spec["word"])
        return Verdict(float(ok), {"correct": float(ok), "length_ok": float(len(text) == len(task.answer))}, ok)

    def demonstrate(self, task: Task) -> str:
        return RULES[task.spec["rule"]](task.spec["word"])
