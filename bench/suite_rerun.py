"""A suite invocation checked against earlier runs of the same plan: equal results, and the time each kind of arm took.

The harness is deterministic per seed, so code that should not change a result (a faster learner path, say) must
reproduce every earlier run file (its steps, post-drift rewards, by-phase table and recoveries), and the
invocation's suite.json must pool to the committed result. Run walls are compared by kind of arm (SAO-like, group,
frozen) and by seed: a change that speeds up one kind shows against the others, which also carry the machine's own
speed. Without --ref, the invocation's run walls alone (e.g. a replicate from other weights, whose results are
meant to differ).

    .venv/bin/python bench/suite_rerun.py runs/bench/suite-v1.4-full7 --ref runs/bench/suite-v1.4-cr \\
        runs/bench/suite-v1.4-s4 runs/bench/suite-v1.4-s5 runs/bench/suite-v1.4-s6 \\
        --pooled docs/bench/suite_main/v1.4/seeds-0-6.json --out docs/bench/suite_main/v1.4/seeds-0-6-one-run.json
    .venv/bin/python bench/suite_rerun.py runs/bench/replicate-456 --out runs/bench/replicate-456/walls.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arms import arms  # noqa: E402
from bench.common import json_equal  # noqa: E402

RESULT_KEYS = ("steps", "post_drift", "by_phase", "recoveries")  # what a run file says about the run itself
SUITE_KEYS = ("runs", "per_drift_arm", "pooled")  # what a suite.json says about its runs together


def kind(arm: str) -> str:
    a = arms([arm])[0]
    return "group" if a.group_size > 1 else "frozen" if a.sim.get("train") is False else "sao_like"


def run_walls(runs: list[dict]) -> dict[str, dict[str, Any]]:
    """Run files' walls and learner steps summed by kind of arm and by seed (with --jobs 2 two runs share the two
    cores: a sum of run walls, not the invocation's wall)."""
    walls: dict[str, dict[str, Any]] = {}
    for run in runs:
        for key in (kind(run["arm"]), f"seed {run['seed']}"):
            w = walls.setdefault(key, {"runs": 0, "run_wall_s": 0.0, "learner_steps": 0})
            w["runs"] += 1
            w["run_wall_s"] += run["summary"]["wall_s"]
            w["learner_steps"] += run["summary"].get("learner_steps", 0)
    return {k: {**w, "run_wall_s": round(w["run_wall_s"], 1)} for k, w in sorted(walls.items())}


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
                 "ratio": round(w["run_wall_s"] / walls_old[k]["run_wall_s"], 4)} for k, w in walls_new.items()}
    return {"runs": len(new), "equal_to_ref_runs": len(old) - len(unequal), "unequal": unequal,
            "without_ref": [n for n in new if n not in old], **walls}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("new", type=Path, help="the invocation's --out (runs/ and suite.json, or a pilot's pilot.json)")
    p.add_argument("--ref", type=Path, nargs="*", default=[], help="--out folders of the earlier runs (none: the "
                   "invocation's run walls alone, by kind of arm and seed)")
    p.add_argument("--pooled", type=Path, help="the committed suite.json the invocation's must equal in "
                   + ", ".join(SUITE_KEYS))
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if a.ref:
        result = compare_runs(a.new, a.ref)
    else:
        runs = read_runs(a.new)
        result = {"runs": len(runs), **run_walls(list(runs.values()))}
    found = next((f for f in (a.new / "suite.json", a.new / "pilot.json") if f.exists()), None)
    if found is None:
        raise SystemExit(f"{a.new}: no suite.json or pilot.json (not the --out of a bench/suite.py invocation)")
    suite = json.loads(found.read_text())
    result.update(wall_s=suite["wall_s"], git_commit=suite["git_commit"], ref=[str(d) for d in a.ref])
    if a.pooled:
        ref = json.loads(a.pooled.read_text())
        result["pooled"] = str(a.pooled)
        result["pooled_equal"] = {k: json_equal(suite[k], ref[k]) for k in SUITE_KEYS}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if not result.get("unequal") and all(result.get("pooled_equal", {}).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
