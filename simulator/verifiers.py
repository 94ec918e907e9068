"""Verifiers of recorded task streams: (answer, reference, parameters) -> reward in [0, 1].

Built in: `exact`, `normalized_exact`, `regex`, `numeric`, `json_field`, `multiple_choice`. A user verifier is a
Python function `f(answer: str, reference: str, params: dict) -> float` published by an installed package under
the entry-point group `sao_lab.verifiers` and enabled by name in the run's config (`agent.verifiers`, or
`sao replay --verifier NAME`). A stream row only names a verifier: no code or import path is ever taken from a
message. `score` never raises: a verifier that fails or returns something other than a number in [0, 1] scores 0.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from typing import Any

from simulator.plugins import PluginError, Registry

log = logging.getLogger("simulator.verifiers")

GROUP = "sao_lab.verifiers"
Verifier = Callable[[str, str, dict[str, Any]], float]
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


VerifierError = PluginError  # its field: `verifier`, `params` or `params.<key>`


def exact(answer: str, reference: str, params: dict[str, Any]) -> float:
    return float(answer.strip() == reference.strip())


def normalize(text: str) -> str:
    """Case-folded, whitespace collapsed, surrounding punctuation and quotes removed."""
    return " ".join(text.casefold().split()).strip(" .,;:!?\"'`")


def normalized_exact(answer: str, reference: str, params: dict[str, Any]) -> float:
    return float(normalize(answer) == normalize(reference))


def regex(answer: str, reference: str, params: dict[str, Any]) -> float:
    """The stripped answer fully matches `pattern` (default: the reference as a pattern)."""
    flags = re.IGNORECASE if params.get("ignore_case") else 0
    return float(re.fullmatch(params.get("pattern", reference), answer.strip(), flags) is not None)


def numeric(answer: str, reference: str, params: dict[str, Any]) -> float:
    """The last number in the answer is within abs_tol (default 0) or rel_tol (default 1e-9) of the reference."""
    found = _NUMBER.findall(answer.replace(",", ""))
    if not found:
        return 0.0
    got, want = float(found[-1]), float(reference)
    tol = max(float(params.get("abs_tol", 0.0)), float(params.get("rel_tol", 1e-9)) * abs(want))
    return float(math.isfinite(got) and abs(got - want) <= tol)


def _first_json(text: str) -> Any:
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start < 0:
        raise ValueError("no JSON object in the answer")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def json_field(answer: str, reference: str, params: dict[str, Any]) -> float:
    """The first JSON value in the answer has, at the dotted path `field`, the reference (compared as JSON when
    the reference parses as JSON, else as text)."""
    try:
        value = _first_json(answer)
        for key in str(params["field"]).split("."):
            value = value[int(key)] if isinstance(value, list) else value[key]
    except (ValueError, KeyError, IndexError, TypeError):
        return 0.0
    try:
        want = json.loads(reference)
    except ValueError:
        want = reference
    return float(value == want or (isinstance(want, str) and str(value) == want))


def multiple_choice(answer: str, reference: str, params: dict[str, Any]) -> float:
    """The choice the answer names ("B", "(B)", "B.", "answer: B"; the last such mention) equals the reference."""
    choices = [str(c) for c in params.get("choices", ["A", "B", "C", "D"])]
    alternatives = "|".join(re.escape(c) for c in sorted(choices, key=len, reverse=True))
    named = re.findall(rf"(?<![A-Za-z0-9])({alternatives})(?![A-Za-z0-9])", answer)
    return float(bool(named) and named[-1] == reference.strip())


BUILTIN: dict[str, Verifier] = {f.__name__: f for f in (exact, normalized_exact, regex, numeric, json_field,
                                                        multiple_choice)}
PARAMS: dict[str, set[str]] = {"exact": set(), "normalized_exact": set(), "regex": {"pattern", "ignore_case"},
                               "numeric": {"abs_tol", "rel_tol"}, "json_field": {"field"},
                               "multiple_choice": {"choices"}}
REQUIRED: dict[str, set[str]] = {"json_field": {"field"}}
REGISTRY = Registry("verifier", GROUP, "verifier", BUILTIN)
enable, known = REGISTRY.enable, REGISTRY.known


def check(name: object, params: object) -> None:
    """Raise VerifierError naming what is wrong with a row's verifier and parameters."""
    REGISTRY.check_name(name)
    if not isinstance(params, dict):
        raise VerifierError("params", f"params: expected an object, got {type(params).__name__}")
    if name in BUILTIN:
        extra = set(params) - PARAMS[name]
        if extra:
            raise VerifierError("params", f"params: {name} takes {sorted(PARAMS[name]) or 'no parameters'}, "
                                f"not {sorted(extra)}")
        missing = REQUIRED.get(name, set()) - set(params)
        if missing:
            raise VerifierError("params", f"params: {name} needs {sorted(missing)}")
        if name == "regex":
            try:
                re.compile(str(params.get("pattern", "")))
            except re.error as e:
                raise VerifierError("params.pattern", f"params.pattern: not a regular expression: {e}") from None


def score(name: str, answer: str, reference: str, params: dict[str, Any]) -> float:
    fn = REGISTRY.get(name)
    if fn is None:
        return 0.0
    try:
        value = float(fn(answer, reference, params))
    except Exception as e:  # a user verifier's bug must not stop the agent: the answer scores 0
        log.warning("verifier %s raised %r: scored 0", name, e)
        return 0.0
    return value if 0.0 <= value <= 1.0 else 0.0
