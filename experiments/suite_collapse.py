"""Suite 2.x's stability grid read for collapse (issue 49, item 6; experiments/suites/drift_v2_stability.yaml).

A run collapses against its start when its final window's reward is below half its start success (the common
checkpoint's, the same for every arm), and against the frozen policy when it is below half the frozen arm's final
reward on the same (drift, seed); both are reported. A cell (arm x eta x updates per batch x lr factor) collapses by
either measure when at least `quorum` of its seeds do.

    .venv/bin/python -m experiments.suite_collapse docs/results/suite_main/v2.1/stability/*.json \
        --out docs/results/suite_main/v2.1/stability.json   # and stability.md, stability.png
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


def plot(rows: list[dict], path: Path) -> Path:
    """One panel per (updates per batch, lr factor): each arm's cell finals (mean of its seeds) against eta, a filled
    marker where the cell collapsed against its start, with the start and the collapse line (half of it) drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["updates"], r["lr_factor"]) for r in rows})
    arms, etas = sorted({r["arm"] for r in rows}), sorted({r["eta"] for r in rows})
    fig, axes = plt.subplots(2, (len(panels) + 1) // 2, figsize=(4 * ((len(panels) + 1) // 2), 7), squeeze=False)
    for ax, (updates, lr_factor) in zip(axes.flat, panels):
        cell = [r for r in rows if (r["updates"], r["lr_factor"]) == (updates, lr_factor)]
        for i, a in enumerate(arms):
            by_eta = {r["eta"]: r for r in cell if r["arm"] == a}
            present = [e for e in etas if e in by_eta]
            xs = [etas.index(e) + (i - len(arms) / 2) * 0.03 for e in present]  # arms side by side at each eta
            ys = [by_eta[e]["final"] for e in present]
            line, = ax.plot(xs, ys, marker="o", mfc="none", lw=1.0, label=a)
            hit = [(x, y) for x, y, e in zip(xs, ys, present) if by_eta[e]["cell_collapsed_vs_start"]]
            if hit:
                ax.plot(*zip(*hit), "o", color=line.get_color())
        start = float(np.mean([r["start"] for r in cell]))
        ax.axhline(start, color="grey", ls=":", lw=0.8)
        ax.axhline(0.5 * start, color="black", ls="--", lw=0.8)
        ax.set_xticks(range(len(etas)), [f"eta {e}" for e in etas], fontsize=8)
        ax.set_ylim(-0.02, 1)
        ax.set_title(f"{updates} update(s) a batch, lr x{lr_factor:g}", fontsize=9)
        ax.set_ylabel("final reward (mean of seeds)", fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("stability grid: cell finals; filled = collapsed against the start (dashed: half the start)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    plot(rows, Path(a.out).with_suffix(".png"))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
