"""How docs/results.md writes its numbers and reads its JSON (experiments.results_page): 3 decimals for rewards,
AUC and fractions, thousands separators for counts, seconds with 1 decimal, a learning rate as 4e-4, Markdown tables,
a drift's recovery as its trajectories (learner steps), and a reader that keeps the paths a section read."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path("docs/results")  # benchmarks and experiments
RUNS = Path("docs/results/runs")  # runs of `sao up`
EXAMPLES = Path("examples")
PAGE = Path("docs/results.md")
OLD = "4d013d6"  # the commit that still holds every older version
OLD_HOME = {RUNS: "docs/runs", RESULTS: "docs/bench"}  # each data root's path at OLD (RUNS first: it may move in)
YES = {True: "yes", False: "no"}
FAMILIES = ("format", "string", "tool", "arith")  # the default scenario's drifted families, in drift order


class Reader:
    """Loads JSON below a repository root and keeps the paths it read (a section's data line); a file read twice in
    one section is parsed once."""

    def __init__(self, root: Path):
        self.root, self.read, self.loaded = root, [], {}

    def __call__(self, path: Path) -> dict:
        self.read.append(path)
        if path not in self.loaded:
            self.loaded[path] = json.loads((self.root / path).read_text())
        return self.loaded[path]

    def glob(self, folder: Path, pattern: str) -> dict[str, dict]:
        return {p.name: self(p.relative_to(self.root)) for p in sorted((self.root / folder).glob(pattern))}


def f3(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def cnt(x: float) -> str:
    return f"{round(x):,}"


def sec(x: float) -> str:
    return f"{x:,.1f}"


def lr(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-")


def table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def rec(status: str, trajectories: int | None = None, learner_steps: int | None = None, **_) -> str:
    if status != "recovered":  # its status, with the trajectories it lasted when censored
        return status if trajectories is None else f"{status} ({cnt(trajectories)})"
    return cnt(trajectories) + ("" if learner_steps is None else f" ({learner_steps})")


def drift_cells(recs: list[dict] | dict) -> list[str]:
    """Each drifted family's recovery, from a summary.json's list or {"event/family": [status, n, (steps)]}."""
    if isinstance(recs, dict):
        recs = [dict(zip(("status", "trajectories", "learner_steps"), v), family=k.rsplit("/", 1)[-1])
                for k, v in recs.items()]
    by = {r["family"]: r for r in recs if r["status"] != "unaffected"}
    return [rec(**by[f]) if f in by else "—" for f in FAMILIES]


def old_path(p: Path) -> str:  # where a file or folder (no suffix) of the data roots was at OLD
    root = next(r for r in OLD_HOME if p == r or r in p.parents)
    return OLD_HOME[root] + str(p)[len(str(root)):] + ("" if p.suffix else "/")


def section(title: str, what: str, parts: list[str], data: list[Path], old: list[Path]) -> str:
    files = ", ".join(f"`{p}`" for p in dict.fromkeys(data))
    olds = ", ".join(f"`git show {OLD}:{old_path(p)}`" for p in old) or "none (first measured in this version)"
    return "\n\n".join([f"## {title}", what, *parts, f"data: {files}", f"older versions: {olds}"])
