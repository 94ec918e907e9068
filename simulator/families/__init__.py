"""Task families by name: `FAMILIES["arith"]`, `get_family(name)`; `family_of(task)` for any task, a recorded
stream's verified tasks included."""

from __future__ import annotations

from simulator.families.arith import Arith
from simulator.families.base import Family
from simulator.families.formats import Formats
from simulator.families.strings import Strings
from simulator.families.tools import Tools
from simulator.families.verified import Verified
from streamer.wire.schema import Task

FAMILIES: dict[str, Family] = {f.name: f for f in (Arith(), Strings(), Formats(), Tools())}
VERIFIED = Verified()


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown family '{name}' (known: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def family_of(task: Task) -> Family:
    """The family that runs and scores `task`: a spec naming a verifier is a recorded stream's task, whatever its
    family tag; any other task belongs to the simulator family of its name."""
    return VERIFIED if "verifier" in task.spec else get_family(task.family)


def check_task_spec(task: Task) -> None:
    """The task's spec is one its family runs (a verified task's reference too, where it is the regex pattern);
    raises ValueError naming the field."""
    family = family_of(task)
    if family is VERIFIED:
        VERIFIED.check_spec(task.spec, task.answer)
    else:
        family.check_spec(task.spec)
