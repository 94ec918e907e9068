"""Verifiers of recorded task streams: (answer, reference, parameters) -> reward in [0, 1].

Built in: `exact`, `normalized_exact`, `regex`, `numeric`, `json_field`, `multiple_choice`. A user verifier is a
Python function `f(answer: str, reference: str, params: dict) -> float` published by an installed package under
the entry-point group `sao_lab.verifiers` and enabled by name in the run's config (`agent.verifiers`, or
`sao replay --verifier NAME`). A stream row only names a verifier: no code or import path is ever taken from a
message. `score` never raises but VerifierTimeout: a verifier that fails or returns something other than a number in
[0, 1] scores 0.

Hostile rows cannot stall an agent: `regex` matches with RE2 (linear time in the answer; a pattern RE2 refuses, with
backreferences or lookarounds, is refused at validation), and every pattern a row supplies, its reference included
when it is the pattern, is checked by `check` (at most MAX_PATTERN_CHARS). Every other built-in is linear in the
answer (at most `simulator.families.verified.MAX_ANSWER_CHARS` characters) and runs in the caller's process; user
verifiers, which nothing bounds, run in a worker process under `timeout_s` (`simulator.verifier_worker`).
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections.abc import Callable
from typing import Any

import re2

from simulator.plugins import PluginError, Registry
from simulator.verifier_worker import VerifierTimeout, Worker

log = logging.getLogger("simulator.verifiers")

GROUP = "sao_lab.verifiers"
Verifier = Callable[[str, str, dict[str, Any]], float]
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


VerifierError = PluginError  # its field: `verifier`, `params`, `params.<key>` or `reference`

MAX_PATTERN_CHARS = 1000  # a regex row's pattern (params.pattern, or the reference used as the pattern)
MAX_CHOICES, MAX_CHOICE_CHARS = 64, 64  # multiple_choice's params.choices
RE2_MAX_MEM = 8 << 20  # bytes RE2 may use for one compiled pattern (RE2's default); a larger one is refused
TIMEOUT_S = 5.0  # a user verifier's limit per answer, in this process (`set_timeout`: the agent's setting)


def exact(answer: str, reference: str, params: dict[str, Any]) -> float:
    return float(answer.strip() == reference.strip())


def normalize(text: str) -> str:
    """Case-folded, whitespace collapsed, surrounding punctuation and quotes removed."""
    return " ".join(text.casefold().split()).strip(" .,;:!?\"'`")


def normalized_exact(answer: str, reference: str, params: dict[str, Any]) -> float:
    return float(normalize(answer) == normalize(reference))


def compile_pattern(pattern: str, ignore_case: bool = False) -> Any:
    """The RE2 program of a row's pattern (cached by re2); raises re2.error for a pattern RE2 refuses."""
    options = re2.Options()
    options.log_errors, options.never_capture, options.max_mem = False, True, RE2_MAX_MEM
    options.case_sensitive = not ignore_case
    return re2.compile(pattern, options)


def regex(answer: str, reference: str, params: dict[str, Any]) -> float:
    """The stripped answer fully matches `pattern` (default: the reference as a pattern), in RE2's syntax."""
    pattern = str(params.get("pattern", reference))
    if len(pattern) > MAX_PATTERN_CHARS:  # refused at validation: a message nobody validated scores 0
        return 0.0
    return float(compile_pattern(pattern, bool(params.get("ignore_case"))).fullmatch(answer.strip()) is not None)


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


def check_pattern(params: dict[str, Any], reference: str | None) -> None:
    """A regex row's pattern (params.pattern, else the reference) is one RE2 compiles, at most MAX_PATTERN_CHARS."""
    field = "params.pattern" if "pattern" in params else "reference"
    pattern = params["pattern"] if "pattern" in params else reference
    if pattern is None:
        return
    if not isinstance(pattern, str):
        raise VerifierError(field, f"{field}: expected text, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise VerifierError(field, f"{field}: a pattern of {len(pattern)} characters (at most {MAX_PATTERN_CHARS})")
    try:
        compile_pattern(pattern)
    except re2.error as e:
        msg = e.args[0].decode() if e.args and isinstance(e.args[0], bytes) else str(e)
        raise VerifierError(field, f"{field}: not a regular expression RE2 matches in linear time ({msg}; "
                                   f"backreferences and lookarounds are refused)") from None


def check_choices(params: dict[str, Any]) -> None:
    choices = params.get("choices", ["A"])
    if not isinstance(choices, list) or not 0 < len(choices) <= MAX_CHOICES or any(
            not isinstance(c, (str, int)) or len(str(c)) > MAX_CHOICE_CHARS for c in choices):
        raise VerifierError("params.choices", f"params.choices: expected a list of 1 to {MAX_CHOICES} choices of at "
                                              f"most {MAX_CHOICE_CHARS} characters")


def check(name: object, params: object, reference: str | None = None) -> None:
    """Raise VerifierError naming what is wrong with a row's verifier, parameters and (a regex row's default
    pattern) reference."""
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
            check_pattern(params, reference)
        if name == "multiple_choice":
            check_choices(params)


_worker: Worker | None = None
_worker_lock = threading.Lock()


def set_timeout(seconds: float) -> None:
    """The limit on one user verifier's answer in this process (the agent's `verifier_timeout_s`)."""
    global TIMEOUT_S
    TIMEOUT_S = float(seconds)


def _user_score(name: str, answer: str, reference: str, params: dict[str, Any]) -> float:
    """A user verifier's value, computed in the worker process (restarted when the enabled set or limit changed)."""
    global _worker
    sources = REGISTRY.sources()
    with _worker_lock:
        if _worker is None or _worker.sources != sources or _worker.timeout_s != TIMEOUT_S:
            if _worker is not None:
                _worker.close()
            _worker = Worker(sources, TIMEOUT_S)
        worker = _worker
    return worker.score(name, answer, reference, params)


def score(name: str, answer: str, reference: str, params: dict[str, Any]) -> float:
    """The answer's reward in [0, 1]; 0 for a verifier that raised, crashed or returned something else. Raises
    VerifierTimeout for a user verifier that ran past TIMEOUT_S (the caller dead-letters the task)."""
    fn = REGISTRY.get(name)
    if fn is None:
        return 0.0
    try:
        value = float(fn(answer, reference, params) if name in BUILTIN else _user_score(name, answer, reference,
                                                                                          params))
    except VerifierTimeout:
        raise
    except Exception as e:  # a user verifier's bug must not stop the agent: the answer scores 0
        log.warning("verifier %s raised %r: scored 0", name, e)
        return 0.0
    return value if 0.0 <= value <= 1.0 else 0.0
