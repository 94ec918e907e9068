"""Text rules every family shares: the alphabet, answer cleaning and the verdict type.

The alphabet and the tool-call markup are the embedded character model's (`streamer.wire.alphabet`, which the
char tokenizer `learner/models/tokenizer.py` reads too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamer.wire.alphabet import ALPHABET, MARKUP

MAX_ANSWER_CHARS = 64  # far above any reference answer (<= 12); longer text is rejected unread

_ALPHABET_SET = frozenset(ALPHABET)


@dataclass(frozen=True)
class Verdict:
    reward: float
    parts: dict[str, float] = field(default_factory=dict)
    success: bool = False


def in_alphabet(text: str) -> bool:
    return all(c in _ALPHABET_SET for c in text)


def to_text(answer: object) -> str | None:
    """Any agent output as str: bytes are decoded leniently (invalid UTF-8 becomes U+FFFD)."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, (bytes, bytearray, memoryview)):
        return bytes(answer).decode("utf-8", errors="replace")
    return None


def clean_answer(answer: object) -> tuple[str | None, dict[str, float]]:
    """The stripped answer, or None and the reason it is unusable (a reward-0 breakdown)."""
    text = to_text(answer)
    if text is None:
        return None, {"invalid_type": 1.0}
    if len(text) > MAX_ANSWER_CHARS:
        return None, {"too_long": 1.0}
    text = text.strip()
    if not text:
        return None, {"empty": 1.0}
    if any(m in text for m in MARKUP):
        return None, {"markup": 1.0}
    if not in_alphabet(text):
        return None, {"bad_chars": 1.0}
    return text, {}


def rejected(reason: dict[str, float]) -> Verdict:
    return Verdict(0.0, {"correct": 0.0, **reason}, False)


def tagged(prompt: str, concept: str, tag: bool) -> str:
    """The prompt with the concept named in front (warm start only; drifted streams hide it)."""
    return f"{concept}:{prompt}" if tag else prompt
