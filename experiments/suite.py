"""Run a pre-registered drift suite (experiments/suites/*.yaml) through the simulated harness: arms x drifts x seeds.

Writes <out>/runs/<drift>-<arm>-s<seed>.json (summary, by-phase table, recoveries, step metrics, outcomes) and
<out>/suite.json (every run's outcomes and, per drift and arm, Kaplan-Meier medians of samples-to-threshold and
paired bootstrap intervals against the reference arm). A run that used a `pilot:` placeholder's provisional value
says so (`provisional: true`). A run file already in <out>/runs written with the same settings (`run_settings`) is
reused, not rerun: an interrupted suite resumes, and a pilot grows arm by arm.

The policy every arm starts from is the suite's own warm start (`learner.pretrain` on the suite's `warm_start`
section, cached under runs/cache; `--init DIR` uses another). `--admissibility` runs the pilot's first check alone:
the frozen arm's post-drift start of every drift on the pilot seeds, against `admissible_start`. `--pool` pools the
suite.json files of invocations on disjoint seeds (seeds accumulate across sessions; `pool_results` says what they
must share). A suite file may extend another (`extends:`, `read_suite`): drift_v1_5.yaml is 1.4 with its own learner
overrides and shared pre-drift phases (`run_branches`).

    .venv/bin/python -m experiments.suite --suite experiments/suites/drift_v1.yaml --quick
    .venv/bin/python -m experiments.suite --suite experiments/suites/drift_v1.yaml --admissibility \
        --out docs/results/suite_pilot
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import git_commit, machine
from experiments.suite_analysis import choose_lr, combine, pool_results, post_rollouts_rule
from experiments.suite_config import build_init, load_plan, main_seeds, pick_arms, pick_drifts, warm_start_note
from experiments.suite_runs import admissibility, json_default, run_all
from learner.pretrain import kernels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", required=True)
    p.add_argument("--init", help="warm-start policy directory (default: the suite's own, built and cached)")
    p.add_argument("--quick", action="store_true", help="the suite's quick section: outputs only, no result")
    p.add_argument("--admissibility", action="store_true", help="the pilot's admissibility check alone")
    p.add_argument("--pilot", action="store_true", help="the pilot: its seeds and post-drift length, pilot.json "
                   "with the post_rollouts rule applied")
    p.add_argument("--arms", default="", help="comma-separated arms instead of the suite's (e.g. the pilot's)")
    p.add_argument("--drifts", default="", help="comma-separated drifts instead of the suite's")
    p.add_argument("--seeds", default="", help="comma-separated main seeds instead of the suite's (e.g. the n the "
                   "power rule asks where the budget took fewer); never the pilot's")
    p.add_argument("--choose-lr", nargs="+", metavar="PILOT_JSON", help="apply the lr rule to pilot.json files "
                   "(one lr each) and write <out>/lr_choice.json")
    p.add_argument("--pool", nargs="+", metavar="SUITE_JSON", help="pool suite.json files of earlier invocations on "
                   "disjoint seeds (same suite version, warm start, lr, arms, drifts) into <out>/suite.json; runs "
                   "nothing")
    p.add_argument("--lr", type=float, help="every trained arm at this lr (a point of the suite's lr_grid)")
    p.add_argument("--set", dest="learner_sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a learner override for every arm, outside the plan (e.g. value.layers=1 to pilot a cheaper "
                   "critic): its runs and result are marked provisional")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, in separate processes; each gets "
                   "max(1, harness.threads // jobs) threads (the results of a run do not depend on its process)")
    p.add_argument("--out", default="runs/bench/suite")
    p.add_argument("--reuse", nargs="+", default=[], metavar="DIR", help="--out directories of other invocations "
                   "whose runs with the same settings stand for this one's (e.g. the main file's for the factorial)")
    a = p.parse_args(argv)
    plan = load_plan(a.suite, a.quick)
    out, t0 = Path(a.out), time.monotonic()
    if a.choose_lr:
        pilots = [json.loads(Path(f).read_text()) for f in a.choose_lr]
        result = {"rule": "per arm, argmax over lr_grid of the mean post-drift AUC (equal rollouts) on the pilot "
                  "seeds; ties: the smaller", "pilots": a.choose_lr, "per_arm": choose_lr(pilots)}
        _write(out / "lr_choice.json", result, result["per_arm"])
        return 0
    if a.pool:
        result = pool_results([json.loads(Path(f).read_text()) for f in a.pool], a.pool)
        _write(out / "suite.json", result, result["pooled"])
        return 0
    a.init = a.init or str(build_init(plan))
    note = None if a.quick else warm_start_note(plan, a.init)
    if note:
        print(f"[suite] note: {note}")
    if a.admissibility:
        result = {**admissibility(plan, a.init, out, a.jobs), "wall_s": round(time.monotonic() - t0, 1)}
        _write(out / "admissibility.json", result, result["per_drift"])
        return 0
    if a.pilot:
        plan = dataclasses.replace(plan, seeds=plan.pilot_seeds, post=plan.pilot_post)
    if a.arms:
        plan = dataclasses.replace(plan, arms=pick_arms(plan.arms, a.arms.split(",")))
    if a.drifts:
        plan = dataclasses.replace(plan, drifts=pick_drifts(plan.drifts, a.drifts.split(",")))
    if a.seeds:
        plan = dataclasses.replace(plan, seeds=main_seeds(a.seeds, plan.pilot_seeds, a.pilot))
    if a.lr is not None:  # one value of the lr grid (the pilot's lr choice): every trained arm at it
        plan = dataclasses.replace(plan, lr=a.lr, provisional=[p for p in plan.provisional if p != "lr"] + ["lr grid"])
    if a.learner_sets:
        plan = dataclasses.replace(plan, learner_sets=tuple(a.learner_sets),
                                   provisional=plan.provisional + [f"--set {x}" for x in a.learner_sets])
    # seed by seed: an interrupted suite leaves whole seeds (every drift and arm, the pairing unit) in <out>/runs
    todo = [(arm, drift, seed) for seed in plan.seeds for drift in plan.drifts for arm in plan.arms]
    runs = run_all(plan, todo, a.init, out, a.jobs, [Path(d) for d in a.reuse])
    combined = {**combine(plan, runs), "wall_s": round(time.monotonic() - t0, 1), "init": a.init,
                "suite_file": str(a.suite), "pilot": a.pilot, "lr": plan.lr, "git_commit": git_commit(),
                "warm_start_note": note, "machine": {**machine(), **kernels()}}  # what the walls were measured on
    if a.pilot:
        combined["post_rollouts_rule"] = post_rollouts_rule(combined["per_drift_arm"], plan.pilot_post)
    _write(out / ("pilot.json" if a.pilot else "suite.json"), combined, combined["per_drift_arm"])
    return 0


def _write(path: Path, result: dict, shown: Any) -> None:
    """`result` as JSON at `path`, and its `shown` part printed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=json_default))
    print(json.dumps(shown, indent=1, default=json_default))


if __name__ == "__main__":
    sys.exit(main())
