"""Task families by name: `FAMILIES["arith"]`, `get_family(name)`."""

from __future__ import annotations

from simulator.families.arith import Arith
from simulator.families.base import Family
from simulator.families.formats import Formats
from simulator.families.strings import Strings
from simulator.families.tools import Tools

FAMILIES: dict[str, Family] = {f.name: f for f in (Arith(), Strings(), Formats(), Tools())}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown family '{name}' (known: {', '.join(FAMILIES)})")
    return FAMILIES[name]
