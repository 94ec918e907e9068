"""Suite 2.x's stability grid read for collapse (issue 49, item 6; experiments/suites/drift_v2_stability.yaml).

A run collapses against its start when its final window's reward is below half its start success (the common
checkpoint's, the same for every arm), and against the frozen policy when it is below half the frozen arm's final
reward on the same (drift, seed); both are reported. A cell (arm x eta x updates per batch x lr factor) collapses by
either measure when at least `quorum` of its seeds do.

    .venv/bin/python -m experiments.suite_collapse runs/v2stab/*/suite.json \
        --out docs/results/suite_main/v2.1/stability.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

CELL = re.compile(r"^(?P<arm>[^@]+)@eta(?P<eta>\d+)-u(?P<updates>\d+)-lrx(?P<lr_factor>[\d.]+)$")


def cell_of(name: str) -> dict[str, Any]:
    m = CELL.match(name)
    if not m:
        raise ValueError(f"arm {name!r} is not a stability cell (<arm>@eta<e>-u<u>-lrx<f>)")
    return {"arm": m["arm"], "eta": int(m["eta"]), "updates": int(m["updates"]), "lr_factor": float(m["lr_factor"])}


def collapse_table(runs: list[dict], frozen: str = "frozen", ratio: float = 0.5, quorum: int = 2) -> list[dict]:
    """One row per cell: its seeds' mean final, start and frozen final rewards, how many of them collapsed by each
    measure, and whether the cell did."""
    frozen_final = {(r["drift"], r["seed"]): r["final_reward"] for r in runs if r["arm"] == frozen}
    cells: dict[str, list[dict]] = {}
    for r in runs:
        if r["arm"] != frozen:
            cells.setdefault(r["arm"], []).append(r)
    rows = []
    for name, rs in cells.items():
        missing = [(r["drift"], r["seed"]) for r in rs if (r["drift"], r["seed"]) not in frozen_final]
        if missing:
            raise ValueError(f"{name}: no {frozen} run at (drift, seed) {missing[:3]}")
        final = np.array([r["final_reward"] for r in rs])
        start = np.array([r["start_success"] for r in rs])
        ref = np.array([frozen_final[(r["drift"], r["seed"])] for r in rs])
        vs_start, vs_frozen = int((final < ratio * start).sum()), int((final < ratio * ref).sum())
        rows.append({**cell_of(name), "seeds": len(rs), "final": float(final.mean()), "start": float(start.mean()),
                     "frozen_final": float(ref.mean()), "collapsed_vs_start": vs_start,
                     "collapsed_vs_frozen": vs_frozen, "cell_collapsed_vs_start": vs_start >= quorum,
                     "cell_collapsed_vs_frozen": vs_frozen >= quorum})
    return sorted(rows, key=lambda x: (x["arm"], x["eta"], x["updates"], x["lr_factor"]))


def markdown(rows: list[dict]) -> str:
    head = "| arm | eta | updates | lr x | seeds | start | final | frozen final | collapsed vs start | vs frozen |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['eta']} | {r['updates']} | {r['lr_factor']:g} | {r['seeds']} | "
                     f"{r['start']:.3f} | {r['final']:.3f} | {r['frozen_final']:.3f} | "
                     f"{r['collapsed_vs_start']}/{r['seeds']} | {r['collapsed_vs_frozen']}/{r['seeds']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("suite_json", nargs="+", help="suite.json files of the grid's parts (their runs together)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    results = [json.loads(Path(f).read_text()) for f in a.suite_json]
    rows = collapse_table([r for res in results for r in res["runs"]])
    out = {"suite_version": results[0]["suite_version"], "from": a.suite_json, "ratio": 0.5, "quorum": 2,
           "provisional": any(res.get("provisional") for res in results), "cells": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    Path(a.out).with_suffix(".md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
