"""A suite invocation checked against earlier runs of the same plan: equal results, and the time each kind of arm took.

The harness is deterministic per seed, so code that should not change a result (a faster learner path, say) must
reproduce every earlier run file (its steps, post-drift rewards, by-phase table and recoveries), and the
invocation's suite.json must pool to the committed result. Run walls are compared by kind of arm (SAO-like, group,
frozen) and by seed: a change that speeds up one kind shows against the others, which also carry the machine's own
speed. Without --ref, the invocation's run walls alone (e.g. a replicate from other weights, whose results are
meant to differ). With --combine, the walls files of several invocations on disjoint seeds (a main run in parts)
summed into the whole run's: its wall, its run walls by seed and kind of arm, against the 2-hour budget.

    .venv/bin/python -m experiments.suite_rerun runs/bench/suite-v1.4-full7 --ref runs/bench/suite-v1.4-cr \\
        runs/bench/suite-v1.4-s4 runs/bench/suite-v1.4-s5 runs/bench/suite-v1.4-s6 \\
        --pooled docs/results/suite_main/v1.4/seeds-0-6.json --out docs/results/suite_main/v1.4/seeds-0-6-one-run.json
    .venv/bin/python -m experiments.suite_rerun runs/bench/replicate-456 --out runs/bench/replicate-456/walls.json
    .venv/bin/python -m experiments.suite_rerun --combine docs/results/suite_main/v1.5/walls-seed-0.json \\
        docs/results/suite_main/v1.5/walls-seed-1.json docs/results/suite_main/v1.5/walls-seeds-2-6.json \\
        --against docs/results/suite_main/v1.4/replicate-85e9cc/walls.json --out docs/results/suite_main/v1.5/walls.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from experiments.arms import arms
from experiments.common import json_equal

BUDGET_S = 7200  # issue 15: the full suite in <= 2 h on a 2-core machine
RESULT_KEYS = ("steps", "post_drift", "by_phase", "recoveries")  # what a run file says about the run itself
SUITE_KEYS = ("runs", "per_drift_arm", "pooled")  # what a suite.json says about its runs together


def kind(arm: str) -> str:
    a = arms([arm])[0]
    return "group" if a.group_size > 1 else "frozen" if a.sim.get("train") is False else "sao_like"


def run_walls(runs: list[dict]) -> dict[str, dict[str, Any]]:
    """Run files' walls and learner steps summed by kind of arm and by seed (with --jobs 2 two runs share the two
    cores: a sum of run walls, not the invocation's wall), and where the walls went: the harness's sections
    (generate, train, load) summed, each run's shared pre-drift part already split between its branches."""
    walls: dict[str, dict[str, Any]] = {}
    for run in runs:
        sections = {name: sec["wall_s"] for name, sec in run["summary"].get("sections", {}).items()}
        for key in (kind(run["arm"]), f"seed {run['seed']}"):
            _add_walls(walls.setdefault(key, _no_walls()), {"runs": 1, "run_wall_s": run["summary"]["wall_s"],
                                                            "learner_steps": run["summary"].get("learner_steps", 0),
                                                            "section_wall_s": sections})
    return {k: _rounded(w) for k, w in sorted(walls.items())}


def _no_walls() -> dict[str, Any]:
    return {"runs": 0, "run_wall_s": 0.0, "learner_steps": 0, "section_wall_s": {}}


def _add_walls(total: dict[str, Any], w: dict[str, Any]) -> None:
    for k in ("runs", "run_wall_s", "learner_steps"):
        total[k] += w[k]
    for name, v in w.get("section_wall_s", {}).items():
        total["section_wall_s"][name] = total["section_wall_s"].get(name, 0.0) + v


def _rounded(w: dict[str, Any]) -> dict[str, Any]:
    return {**w, "run_wall_s": round(w["run_wall_s"], 1),
            "section_wall_s": {n: round(v, 1) for n, v in sorted(w["section_wall_s"].items())}}


def read_runs(folder: Path) -> dict[str, dict]:
    """The run files of a suite invocation's --out, by file name."""
    return {p.name: json.loads(p.read_text()) for p in sorted((folder / "runs").glob("*.json"))}


def compare_runs(new_dir: Path, ref_dirs: list[Path]) -> dict[str, Any]:
    """Every run file of `new_dir`/runs against the file of that name in one of `ref_dirs`/runs."""
    new = read_runs(new_dir)
    old = {name: run for d in ref_dirs for name, run in read_runs(d).items() if name in new}
    unequal = [n for n in new if n in old and not all(json_equal(new[n][k], old[n][k]) for k in RESULT_KEYS)]
    walls_new, walls_old = run_walls([new[n] for n in old]), run_walls(list(old.values()))
    walls = {k: {"runs": w["runs"], "run_wall_s_new": w["run_wall_s"], "run_wall_s_old": walls_old[k]["run_wall_s"],
                 "ratio": round(w["run_wall_s"] / walls_old[k]["run_wall_s"], 4),
                 "learner_steps_new": w["learner_steps"], "learner_steps_old": walls_old[k]["learner_steps"],
                 "section_ratio": {n: round(v / walls_old[k]["section_wall_s"][n], 4)
                                   for n, v in w["section_wall_s"].items() if walls_old[k]["section_wall_s"].get(n)}}
             for k, w in walls_new.items()}
    return {"runs": len(new), "equal_to_ref_runs": len(old) - len(unequal), "unequal": unequal,
            "without_ref": [n for n in new if n not in old], **walls}


def seeds_label(seeds: list[int]) -> str:
    """"seed 0", "seeds 2-6" (consecutive) or "seeds 1, 3"."""
    s = sorted(seeds)
    if len(s) == 1:
        return f"seed {s[0]}"
    return f"seeds {s[0]}-{s[-1]}" if s == list(range(s[0], s[-1] + 1)) else "seeds " + ", ".join(map(str, s))


def combine_walls(parts: list[Path], budget_s: float = BUDGET_S, what: str = "") -> dict[str, Any]:
    """The walls files of invocations on disjoint seeds (each written by this script without --ref) as one run: the
    invocation walls summed (one after the other), run walls, learner steps and sections summed by kind of arm, run
    walls by seed."""
    out: dict[str, Any] = {"what": what, "parts": {}, "invocation_walls_s": {}, "git_commits": {}}
    totals: dict[str, dict[str, Any]] = {}
    owner: dict[str, Path] = {}
    for path in parts:
        walls = json.loads(path.read_text())
        seeds = sorted(int(k.split()[1]) for k in walls if k.startswith("seed "))
        if "wall_s" not in walls or not seeds or walls.get("ref"):
            raise ValueError(f"{path}: not the walls of one invocation (suite_rerun.py without --ref)")
        label = seeds_label(seeds)
        for seed in seeds:
            if f"seed {seed}" in owner:
                raise ValueError(f"{path}: seed {seed} is also in {owner[f'seed {seed}']}: parts must be disjoint")
            owner[f"seed {seed}"] = path
        out["parts"][label] = path.name
        out["invocation_walls_s"][label] = walls["wall_s"]
        out["git_commits"][label] = walls.get("git_commit")
        for key, w in walls.items():
            if isinstance(w, dict) and "run_wall_s" in w:
                _add_walls(totals.setdefault(key, _no_walls()), w)
    wall = round(sum(out["invocation_walls_s"].values()), 1)
    kinds = {k: _rounded(t) for k, t in sorted(totals.items()) if not k.startswith("seed ")}
    by_seed = {k: round(totals[k]["run_wall_s"], 1) for k in sorted(owner, key=lambda k: int(k.split()[1]))}
    out.update(wall_s=wall, run_walls_s=by_seed, run_wall_s=round(sum(by_seed.values()), 1),
               by_kind=kinds, budget_s=budget_s, over_budget_s=round(wall - budget_s, 1))
    return out


def against(combined: dict[str, Any], other: Path) -> dict[str, Any]:
    """Wall and run-wall ratios to another whole run's walls (e.g. the previous version on the same machine kind)."""
    ref = json.loads(other.read_text())
    ref_run_wall = ref.get("run_wall_s", ref.get("run_wall_s_seeds_0_6"))
    return {"against": {"file": str(other), "wall_s": ref["wall_s"], "run_wall_s": ref_run_wall},
            "ratio_wall": round(combined["wall_s"] / ref["wall_s"], 3),
            "ratio_run_wall": round(combined["run_wall_s"] / ref_run_wall, 3) if ref_run_wall else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("new", type=Path, nargs="?",
                   help="the invocation's --out (runs/ and suite.json, or a pilot's pilot.json)")
    p.add_argument("--ref", type=Path, nargs="*", default=[], help="--out folders of the earlier runs (none: the "
                   "invocation's run walls alone, by kind of arm and seed)")
    p.add_argument("--pooled", type=Path, help="the committed suite.json the invocation's must equal in "
                   + ", ".join(SUITE_KEYS))
    p.add_argument("--combine", type=Path, nargs="+", metavar="WALLS_JSON",
                   help="instead of an invocation: walls files of invocations on disjoint seeds, summed as one run")
    p.add_argument("--against", type=Path, help="with --combine: another whole run's walls.json to take ratios to")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="with --combine: the wall budget (default 2 h)")
    p.add_argument("--what", default="", help="with --combine: what the run was (machine, weights, invocations)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if (a.new is None) == (a.combine is None):
        p.error("give exactly one of: an invocation's --out folder, --combine WALLS_JSON...")
    if a.against and not a.combine:
        p.error("--against goes with --combine")
    if a.combine:
        result = combine_walls(a.combine, a.budget_s, a.what)
        if a.against:
            result.update(against(result, a.against))
        return _write(a.out, result, 0)
    if a.ref:
        result = compare_runs(a.new, a.ref)
    else:
        runs = read_runs(a.new)
        result = {"runs": len(runs), **run_walls(list(runs.values()))}
    found = next((f for f in (a.new / "suite.json", a.new / "pilot.json") if f.exists()), None)
    if found is None:
        raise SystemExit(f"{a.new}: no suite.json or pilot.json (not the --out of a `python -m experiments.suite` run)")
    suite = json.loads(found.read_text())
    result.update(wall_s=suite["wall_s"], git_commit=suite["git_commit"], ref=[str(d) for d in a.ref])
    if a.pooled:
        ref = json.loads(a.pooled.read_text())
        result["pooled"] = str(a.pooled)
        result["pooled_equal"] = {k: json_equal(suite[k], ref[k]) for k in SUITE_KEYS}
    return _write(a.out, result, 0 if not result.get("unequal") and all(result.get("pooled_equal", {}).values()) else 1)


def _write(path: Path, result: dict[str, Any], status: int) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
