"""The suite's pilot sized to a wall-clock budget (experiments/pilot_sizing.py): the fit by hand, the outputs end to
end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest

from experiments.pilot_sizing import fit_arms, main, per_run_cost, predicted_wall_s
from experiments.suite_config import load_plan

SUITE = Path(__file__).resolve().parent.parent / "experiments" / "suites" / "drift_v1.yaml"


def test_predicted_wall_is_the_even_share_plus_the_longest_run():
    assert predicted_wall_s([100, 100, 50, 50], jobs=2) == 300 / 2 + 100
    assert predicted_wall_s([], jobs=4) == 0.0


def test_arms_are_taken_in_order_while_their_runs_fit():
    runs = {"sao": [100, 100], "grpo": [50, 50], "ppo": [100]}
    order = ["sao", "grpo", "ppo"]
    assert fit_arms(runs, order, budget_s=160, jobs=2) == []  # 200/2 + 100 = 200
    assert fit_arms(runs, order, budget_s=200, jobs=2) == ["sao"]  # with grpo 300/2 + 100 = 250
    assert fit_arms(runs, order, budget_s=250, jobs=2) == ["sao", "grpo"]  # with ppo 400/2 + 100 = 300
    assert fit_arms(runs, order, budget_s=300, jobs=2) == order


def test_each_pilot_run_is_priced_at_its_drift_cost_and_untimed_arms_as_sao_or_grpo():
    plan = load_plan(SUITE)
    plan = dataclasses.replace(plan, drifts=plan.drifts[:2], arms=[a for a in plan.arms if a.name in
                                                                  ("sao", "grpo", "cispo", "ppo")])
    d1, d2 = (d["name"] for d in plan.drifts)
    cost = pd.DataFrame([{"arm": "sao", "drift": d1, "cpu_per_rollout": 0.01},
                         {"arm": "sao", "drift": d2, "cpu_per_rollout": 0.02},
                         {"arm": "grpo", "drift": d1, "cpu_per_rollout": 0.005},
                         {"arm": "grpo", "drift": d2, "cpu_per_rollout": 0.004}])
    runs, priced_as = per_run_cost(plan, cost)
    n = plan.pre + plan.pilot_post  # 1024 + 4096 rollouts a pilot run
    assert runs["sao"] == pytest.approx([0.01 * n] * 3 + [0.02 * n] * 3)  # 3 pilot seeds a drift
    assert runs["cispo"] == pytest.approx([0.005 * n] * 3 + [0.004 * n] * 3)
    assert priced_as == {"sao": "sao", "grpo": "grpo", "cispo": "grpo", "ppo": "sao"}


def test_a_budget_too_small_for_any_arm_writes_the_timing_and_no_pilot(tiny_policy_dir, tmp_path):
    assert main(["--suite", str(SUITE), "--init", str(tiny_policy_dir), "--budget-s", "0", "--jobs", "2",
                 "--timing-rollouts", "8", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "pilot.json").read_text())
    sizing = out["sizing"]
    assert sizing["arms"] == [] and "per_drift_arm" not in out
    timed = {(r["arm"], r["drift"]) for r in sizing["cpu_per_rollout"]}
    assert len(timed) == 2 * 7 and all(r["cpu_per_rollout"] > 0 for r in sizing["cpu_per_rollout"])
    assert len(list((tmp_path / "timing" / "runs").glob("*.json"))) == 14
