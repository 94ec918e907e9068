"""An example user verifier for `sao replay` / `sao up --stream`, published as the entry point `wrapped`."""

from __future__ import annotations

OPEN = {"[": "]", "(": ")", "{": "}", "<": ">"}


def wrapped(answer: str, reference: str, params: dict) -> float:
    """1 for the reference exactly; `partial` (default 0.5) for its content in the wrong brackets; else 0."""
    answer, reference = answer.strip(), reference.strip()
    if answer == reference:
        return 1.0
    inner = reference[1:-1]
    if len(answer) == len(reference) and answer[0] in OPEN and answer[-1] == OPEN[answer[0]] and answer[1:-1] == inner:
        return float(params.get("partial", 0.5))
    return 0.0
