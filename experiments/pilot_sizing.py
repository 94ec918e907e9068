"""The suite's pilot sized to a wall-clock budget on a bigger machine (issue 15, item 7; bench/gpu_check.sh).

A timing pilot first: SAO and GRPO on every drift of the suite, `--timing-rollouts` pre- and post-drift rollouts each,
`--jobs` runs at once (one thread each); their CPU per rollout prices every arm's pilot (3 pilot seeds x every
drift x the pilot's phase lengths; an arm not timed is priced as GRPO when it runs groups, else as SAO:
`suite_plan.seed_cost`). Then the pilot itself with the arms that fit `--budget-s`, SAO and GRPO first (the
post_rollouts rule needs both), the others in the suite's order. Its JSON is `python -m experiments.suite --pilot`'s.

The harness runs the tiny model on CPU threads (the torch backend has no CUDA path): on a GPU machine the pilot runs
on its CPU cores, many runs at once; the GPU itself is not used.

    .venv/bin/python -m experiments.pilot_sizing --suite experiments/suites/drift_v1.yaml --budget-s 480 \
        --out runs/bench/gpu_pilot
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from experiments.arms import arms
from experiments.suite_analysis import combine, post_rollouts_rule
from experiments.suite_config import Plan, build_init, load_plan
from experiments.suite_plan import cpu_per_rollout, seed_cost
from experiments.suite_runs import run_all, run_path

TIMED = ("sao", "grpo")


def predicted_wall_s(run_cpu_s: list[float], jobs: int) -> float:
    """A bound on the wall time of runs spread over `jobs` workers, each taking the next free one: the even share of
    the total plus the longest run (the last to start may begin when the others are nearly done)."""
    return sum(run_cpu_s) / jobs + max(run_cpu_s, default=0.0)


def fit_arms(per_run_cpu_s: dict[str, list[float]], order: list[str], budget_s: float, jobs: int) -> list[str]:
    """The longest prefix of `order` whose runs (their CPU seconds per arm) fit `budget_s` on `jobs` workers."""
    chosen: list[str] = []
    for arm in order:
        runs = [c for a in [*chosen, arm] for c in per_run_cpu_s[a]]
        if predicted_wall_s(runs, jobs) > budget_s:
            break
        chosen.append(arm)
    return chosen


def timing_pilot(plan: Plan, init: str, rollouts: int, jobs: int, out: Path) -> Any:
    """CPU seconds per rollout of SAO and GRPO on every drift (`suite_plan.cpu_per_rollout`), at one thread a run."""
    short = dataclasses.replace(plan, arms=arms(list(TIMED)), seeds=plan.pilot_seeds[:1], pre=rollouts, post=rollouts)
    todo = [(arm, drift, seed) for drift in short.drifts for seed in short.seeds for arm in short.arms]
    run_all(short, todo, init, out, jobs)
    return cpu_per_rollout([run_path(out, arm, drift, seed) for arm, drift, seed in todo])


def per_run_cost(plan: Plan, cost: Any) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Each arm's pilot runs' CPU seconds (one per drift and pilot seed) and the arm each was priced as."""
    runs: dict[str, list[float]] = {}
    priced_as: dict[str, str] = {}
    for drift in plan.drifts:  # seed_cost over one drift at a time gives a run's cost
        one = dataclasses.replace(plan, drifts=[drift])
        c = seed_cost(one, cost, {drift["name"]: plan.pilot_post})
        priced_as = c["priced_as"]
        for arm, cpu in c["per_arm_cpu_s"].items():
            runs.setdefault(arm, []).extend([cpu] * len(plan.pilot_seeds))
    return runs, priced_as


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", required=True)
    p.add_argument("--init", help="warm-start policy directory (default: the suite's own, built and cached)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="wall seconds for the timing pilot and the pilot together (the warm start apart)")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--timing-rollouts", type=int, default=128, help="pre- and post-drift rollouts of a timing run")
    p.add_argument("--lr", type=float, help="every trained arm at this lr (default: the suite's lr)")
    p.add_argument("--out", default="runs/bench/gpu_pilot")
    a = p.parse_args(argv)
    plan = load_plan(a.suite)
    plan = dataclasses.replace(plan, harness={**plan.harness, "threads": 1}, seeds=plan.pilot_seeds,
                               post=plan.pilot_post, **({"lr": a.lr} if a.lr is not None else {}))
    out, t0 = Path(a.out), time.monotonic()
    init = a.init or str(build_init(plan))
    t_init = time.monotonic()
    cost = timing_pilot(plan, init, a.timing_rollouts, a.jobs, out / "timing")
    t_timing = time.monotonic()
    runs, priced_as = per_run_cost(plan, cost)
    order = [*TIMED, *[x.name for x in plan.arms if x.name not in TIMED]]
    chosen = fit_arms(runs, order, a.budget_s - (t_timing - t_init), a.jobs)
    print(f"[pilot_sizing] timing pilot {t_timing - t_init:.0f} s; arms that fit {a.budget_s:.0f} s on {a.jobs} "
          f"jobs: {chosen}")
    plan = dataclasses.replace(plan, arms=arms(chosen))
    todo = [(arm, drift, seed) for seed in plan.seeds for drift in plan.drifts for arm in plan.arms]
    combined = combine(plan, run_all(plan, todo, init, out, a.jobs)) if todo else {}
    t_end = time.monotonic()
    if {"sao", "grpo"} <= set(chosen):
        combined["post_rollouts_rule"] = post_rollouts_rule(combined["per_drift_arm"], plan.pilot_post)
    sizing = {"jobs": a.jobs, "budget_s": a.budget_s, "warm_start_s": round(t_init - t0, 1),
              "timing_s": round(t_timing - t_init, 1), "pilot_s": round(t_end - t_timing, 1),
              "timing_plus_pilot_s": round(t_end - t_init, 1),
              "cpu_per_rollout": cost.to_dict("records"), "priced_as": priced_as, "arms": chosen,
              "predicted_pilot_s": round(predicted_wall_s([c for arm in chosen for c in runs[arm]], a.jobs), 1)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "pilot.json").write_text(json.dumps({**combined, "sizing": sizing}, indent=1, default=str))
    print(json.dumps(sizing | {"cpu_per_rollout": len(sizing["cpu_per_rollout"])}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
