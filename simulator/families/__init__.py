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
