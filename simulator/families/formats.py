"""Answer-format drift: `f:kqzd=` asks to echo the word inside the wrapper the concept requires."""

from __future__ import annotations

import random
from typing import Any

from simulator.families.base import need, option
from simulator.text import Verdict, clean_answer, rejected, tagged
from streamer.wire.schema import Task

WRAPPERS = {
    "brackets": ("[", "]"),
    "parens": ("(", ")"),
    "braces": ("{", "}"),
    "bars": ("|", "|"),
    "quotes": ("'", "'"),
    "stars": ("*", "*"),
    "colon": ("ans:", ""),
}
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def check_wrapper(concept: str) -> None:
    if concept not in WRAPPERS:
        raise ValueError(f"format concept '{concept}': expected one of {sorted(WRAPPERS)}")


def wrap(concept: str, word: str) -> str:
    left, right = WRAPPERS[concept]
    return f"{left}{word}{right}"


def unwrap_any(text: str) -> tuple[str, str | None]:
    """(content, wrapper concept) of `text`, or (text, None) when no known wrapper encloses it."""
    for concept, (left, right) in WRAPPERS.items():
        if len(text) >= len(left) + len(right) and text.startswith(left) and text.endswith(right):
            return text[len(left):len(text) - len(right)], concept
    return text, None


class Formats:
    name = "format"
    multi_turn = False

    def check_concept(self, concept: str) -> None:
        check_wrapper(concept)

    def check_spec(self, spec: dict[str, Any]) -> None:
        check_wrapper(need(spec, "wrapper", str))
        word = need(spec, "word", str)
        if not 1 <= len(word) <= 8 or any(c not in LETTERS for c in word):
            raise ValueError("spec.word: expected 1..8 lowercase letters")

    def sample(self, rng: random.Random, concept: str, options: dict[str, Any], tag: bool = False):
        check_wrapper(concept)
        lo, hi = int(option(options, "min_len", 2)), int(option(options, "max_len", 5))
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))
        # the reference answer is the content; the wrapper is what drifts (spec.wrapper)
        return tagged(f"f:{word}=", concept, tag), word, {"wrapper": concept, "word": word}

    def verify(self, task: Task, answer: object) -> Verdict:
        text, why = clean_answer(answer)
        if text is None:
            return rejected(why)
        word, wrapper = task.spec["word"], task.spec["wrapper"]
        ok = text == wrap(wrapper, word)
        content, seen = unwrap_any(text)
        parts = {"correct": float(ok), "content": float(content == word), "wrapper": float(seen == wrapper)}
        return Verdict(float(ok), parts, ok)

    def demonstrate(self, task: Task) -> str:
        return wrap(task.spec["wrapper"], task.spec["word"])
