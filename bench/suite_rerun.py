"""A suite invocation checked against earlier runs of the same plan: equal results, and the time each kind of arm took.

The harness is deterministic per seed, so code that should not change a result (a faster learner path, say) must
reproduce every earlier run file (its steps, post-drift rewards, by-phase table and recoveries), and the
invocation's suite.json must pool to the committed result. Run walls are compared by kind of arm (SAO-like, group,
frozen) and by seed: a change that speeds up one kind shows against the others, which also carry the machine's own
speed.

    .venv/bin/python bench/suite_rerun.py runs/bench/suite-v1.4-full7 --ref runs/bench/suite-v1.4-cr \\
        runs/bench/suite-v1.4-s4 runs/bench/suite-v1.4-s5 runs/bench/suite-v1.4-s6 \\
        --pooled docs/bench/suite_main/v1.4/seeds-0-6.json --out docs/bench/suite_main/v1.4/seeds-0-6-one-run.json
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


def compare_runs(new_dir: Path, ref_dirs: list[Path]) -> dict[str, Any]:
    """Every run file of `new_dir`/runs against the file of that name in one of `ref_dirs`/runs."""
    refs = {p.name: p for d in ref_dirs for p in (d / "runs").glob("*.json")}
    walls: dict[str, dict[str, float]] = {}  # per kind of arm, then per seed
    equal, unequal, missing = 0, [], []
    for path in sorted((new_dir / "runs").glob("*.json")):
        if path.name not in refs:
            missing.append(path.name)
            continue
        new, old = json.loads(path.read_text()), json.loads(refs[path.name].read_text())
        if all(json_equal(new[k], old[k]) for k in RESULT_KEYS):
            equal += 1
        else:
            unequal.append(path.name)
        for key in (kind(new["arm"]), f"seed {new['seed']}"):
            w = walls.setdefault(key, {"runs": 0, "run_wall_s_new": 0.0, "run_wall_s_old": 0.0})
            w["runs"] += 1
            w["run_wall_s_new"] += new["summary"]["wall_s"]
            w["run_wall_s_old"] += old["summary"]["wall_s"]
    for w in walls.values():
        w["ratio"] = round(w["run_wall_s_new"] / w["run_wall_s_old"], 4)
        w["run_wall_s_new"], w["run_wall_s_old"] = round(w["run_wall_s_new"], 1), round(w["run_wall_s_old"], 1)
    return {"runs": equal + len(unequal) + len(missing), "equal_to_ref_runs": equal, "unequal": unequal,
            "without_ref": missing, **dict(sorted(walls.items()))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("new", type=Path, help="the invocation's --out (runs/ and suite.json)")
    p.add_argument("--ref", type=Path, nargs="+", required=True, help="--out folders of the earlier runs")
    p.add_argument("--pooled", type=Path, help="the committed suite.json the invocation's must equal in "
                   + ", ".join(SUITE_KEYS))
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    result = compare_runs(a.new, a.ref)
    suite = json.loads((a.new / "suite.json").read_text())
    result.update(wall_s=suite["wall_s"], git_commit=suite["git_commit"], ref=[str(d) for d in a.ref])
    if a.pooled:
        ref = json.loads(a.pooled.read_text())
        result["pooled"] = str(a.pooled)
        result["pooled_equal"] = {k: json_equal(suite[k], ref[k]) for k in SUITE_KEYS}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if not result["unequal"] and all(result.get("pooled_equal", {}).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
