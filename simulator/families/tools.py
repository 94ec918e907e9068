"""The agentic tool family: `age of kiv?` is answered by calling a lookup tool, reading its observation, answering.

Concept `<tool>/<argfmt>/<world>` (e.g. `look/plain/0`): the tool's name, the argument format it
accepts and the world whose facts it returns. Drift renames the tool, changes the argument format
or the world's facts (so memorised answers fail while tool use keeps working). Wrong calls get an
error observation that shows the available tool's usage, so an agent that reads errors recovers.
The episode logic lives in `simulator.env`; this module holds the world, call parsing and scoring.
"""

from __future__ import annotations

import random
import re
from functools import lru_cache
from typing import Any

from simulator.families.base import need, option
from simulator.text import Verdict, clean_answer, rejected, tagged
from streamer.wire.schema import Task

TOOLS = ("look", "find", "get", "ask", "query", "fetch")
ARG_FORMATS = {"plain": "{}", "key": "k={}", "quoted": "'{}'"}
N_ENTITIES = 64
_CALL = re.compile(r"^\s*([a-z_]{1,16})\((.{0,24})\)\s*$", re.S)
_NAME = re.compile(r"^[a-z]{3}$")


def parse_concept(concept: str) -> tuple[str, str, int]:
    parts = concept.split("/") if isinstance(concept, str) else []
    if len(parts) != 3 or parts[0] not in TOOLS or parts[1] not in ARG_FORMATS or not parts[2].isdigit():
        raise ValueError(f"tool concept '{concept}': expected <tool>/<argfmt>/<world>, tool in {list(TOOLS)}, "
                         f"argfmt in {list(ARG_FORMATS)}, world an integer (e.g. look/plain/0)")
    return parts[0], parts[1], int(parts[2])


@lru_cache(maxsize=64)
def entity_names() -> tuple[str, ...]:
    rng = random.Random("sao-tool-names")
    names: set[str] = set()
    while len(names) < N_ENTITIES:
        names.add(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") + rng.choice("bdfgklmnprstvz"))
    return tuple(sorted(names))


@lru_cache(maxsize=64)
def world_facts(world: int) -> dict[str, str]:
    """Deterministic in any process: string seeds do not depend on PYTHONHASHSEED."""
    rng = random.Random(f"sao-tool-world-{world}")
    return {name: str(rng.randint(10, 99)) for name in entity_names()}


def usage(tool: str, argfmt: str) -> str:
    return f"{tool}({ARG_FORMATS[argfmt].format('x')})"


def tag_of(tool: str, argfmt: str) -> str:
    """The short concept tag of warm-start prompts: the world is not named (tool use must find the facts)."""
    return tool if argfmt == "plain" else f"{tool}/{argfmt}"


def format_call(tool: str, argfmt: str, name: str) -> str:
    return f"<call>{tool}({ARG_FORMATS[argfmt].format(name)})</call>"


def observe(spec: dict[str, Any], call_text: str) -> tuple[str, bool]:
    """The observation for the inside of one `<call>...</call>` and whether the call was valid."""
    tool, argfmt = spec["tool"], spec["argfmt"]
    m = _CALL.match(call_text)
    if not m:
        return f"error: tools: {usage(tool, argfmt)}", False
    name, arg = m.group(1), m.group(2)
    if name != tool:
        return f"error: tools: {usage(tool, argfmt)}", False
    template = ARG_FORMATS[argfmt]
    prefix, suffix = template.split("{}")
    if not (arg.startswith(prefix) and arg.endswith(suffix) and len(arg) > len(prefix) + len(suffix)):
        return f"error: use {usage(tool, argfmt)}", False
    key = arg[len(prefix):len(arg) - len(suffix)]
    value = world_facts(spec["world"]).get(key) if _NAME.match(key) else None
    if value is None:
        return "error: not found", False
    return value, True


class Tools:
    name = "tool"
    multi_turn = True

    def check_concept(self, concept: str) -> None:
        parse_concept(concept)

    def check_spec(self, spec: dict[str, Any]) -> None:
        if need(spec, "tool", str) not in TOOLS:
            raise ValueError(f"spec.tool: expected one of {list(TOOLS)}")
        if need(spec, "argfmt", str) not in ARG_FORMATS:
            raise ValueError(f"spec.argfmt: expected one of {list(ARG_FORMATS)}")
        need(spec, "world", int)
        if need(spec, "name", str) not in world_facts(spec["world"]):
            raise ValueError("spec.name: not an entity of the world")
        if not 1 <= need(spec, "max_turns", int) <= 16:
            raise ValueError("spec.max_turns: outside 1..16")
        if not 0.0 <= need(spec, "error_penalty", (int, float)) <= 1.0:
            raise ValueError("spec.error_penalty: outside 0..1")

    def sample(self, rng: random.Random, concept: str, options: dict[str, Any], tag: bool = False):
        tool, argfmt, world = parse_concept(concept)
        name = rng.choice(entity_names())
        spec = {"tool": tool, "argfmt": argfmt, "world": world, "name": name,
                "max_turns": int(option(options, "max_turns", 3)),
                "error_penalty": float(option(options, "error_penalty", 0.25))}
        return tagged(f"age of {name}?", tag_of(tool, argfmt), tag), world_facts(world)[name], spec

    def verify(self, task: Task, answer: object) -> Verdict:
        """Scores the final answer alone; `simulator.env` adds the per-error penalty of the episode."""
        text, why = clean_answer(answer)
        if text is None:
            return rejected(why)
        ok = text == world_facts(task.spec["world"])[task.spec["name"]]
        return Verdict(float(ok), {"correct": float(ok)}, ok)

    def demonstrate(self, task: Task, wrong_tool: str | None = None) -> str:
        """The ideal episode; with `wrong_tool`, one that first calls it, reads the error and retries."""
        s = task.spec
        steps = []
        if wrong_tool is not None and wrong_tool != s["tool"]:
            call = format_call(wrong_tool, s["argfmt"], s["name"])
            steps.append(f"{call}<obs>{observe(s, call[6:-7])[0]}</obs>")
        call = format_call(s["tool"], s["argfmt"], s["name"])
        value = observe(s, call[6:-7])[0]
        return "".join(steps) + f"{call}<obs>{value}</obs>{value}"


def episode_reward(correct: bool, n_errors: int, penalty: float) -> float:
    return max(0.0, 1.0 - penalty * n_errors) if correct else 0.0
