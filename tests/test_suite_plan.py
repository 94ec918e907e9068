"""The main run's plan from the pilot (experiments/suite_plan.py): the power calculation and the budget, by hand."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from experiments.arms import arms
from experiments.suite_analysis import seed_differences
from experiments.suite_config import load_plan
from experiments.suite_plan import (
    budget_seeds,
    complete,
    seed_cost,
    seeds_in_budget,
    seeds_rule,
    suite_choices,
    trained_arms,
    with_grid_edges,
)

SUITE = Path(__file__).resolve().parent.parent / "experiments" / "suites" / "drift_v1.yaml"


def pilot_runs() -> pd.DataFrame:
    # two drifts x three seeds; SAO's pooled mean per seed: 0.5, 0.6, 0.7 (mean 0.6, delta = 0.06)
    auc = {"sao": {1: (0.4, 0.6), 2: (0.5, 0.7), 3: (0.6, 0.8)},
           "grpo": {1: (0.3, 0.5), 2: (0.5, 0.5), 3: (0.6, 0.6)},  # pooled 0.4, 0.5, 0.6: differences -0.1 each
           "ppo": {1: (0.4, 0.6), 2: (0.5, 0.7), 3: (0.9, 0.9)}}  # differences 0, 0, +0.2
    return pd.DataFrame([{"arm": a, "seed": s, "drift": d, "auc_equal_rollouts": x}
                         for a, by_seed in auc.items() for s, pair in by_seed.items() for d, x in zip("ab", pair)])


def test_pooled_paired_differences_by_hand():
    runs = pilot_runs()
    assert seed_differences(runs, "auc_equal_rollouts", "grpo", "sao").tolist() == pytest.approx([-0.1, -0.1, -0.1])
    assert seed_differences(runs, "auc_equal_rollouts", "ppo", "sao").tolist() == pytest.approx([0.0, 0.0, 0.2])


def test_seeds_rule_by_hand():
    rule = seeds_rule(pilot_runs(), "sao")
    assert rule["delta"] == pytest.approx(0.06)
    assert rule["per_arm"]["grpo"]["sd"] == pytest.approx(0.0, abs=1e-12)
    assert rule["per_arm"]["grpo"]["n"] == 5  # no spread: the minimum
    # ppo: sd of (0, 0, 0.2) = 0.11547; (3 x 0.11547 / 0.06)^2 = 33.33 -> 34
    assert rule["per_arm"]["ppo"]["sd"] == pytest.approx(0.2 / math.sqrt(3))
    assert rule["largest_sd_arm"] == "ppo" and rule["n"] == 34


def test_seeds_rule_refuses_one_pilot_seed():
    one_seed = pilot_runs().query("seed == 1")
    with pytest.raises(ValueError, match="'grpo' has 1 paired pilot seed"):
        seeds_rule(one_seed, "sao")


def test_budget_and_seed_cost_by_hand():
    plan = load_plan(SUITE)
    plan = dataclasses.replace(plan, arms=arms(["sao", "grpo", "frozen", "eta0", "gspo"]), drifts=plan.drifts[:2],
                               pre=100)
    a, b = (d["name"] for d in plan.drifts)
    cost = pd.DataFrame([{"arm": "sao", "drift": a, "cpu_per_rollout": 0.01},
                         {"arm": "sao", "drift": b, "cpu_per_rollout": 0.02},
                         {"arm": "grpo", "drift": a, "cpu_per_rollout": 0.005},
                         {"arm": "grpo", "drift": b, "cpu_per_rollout": 0.005},
                         {"arm": "frozen", "drift": a, "cpu_per_rollout": 0.001},
                         {"arm": "frozen", "drift": b, "cpu_per_rollout": 0.001}])
    out = seed_cost(plan, cost, {a: 900, b: 400})  # 1000 and 500 rollouts per run
    assert out["per_arm_cpu_s"] == pytest.approx({"sao": 20.0, "grpo": 7.5, "frozen": 1.5, "eta0": 20.0, "gspo": 7.5})
    assert out["priced_as"]["eta0"] == "sao" and out["priced_as"]["gspo"] == "grpo"  # no pilot of their own
    assert out["cpu_s"] == pytest.approx(56.5)
    assert budget_seeds(56.5, budget_s=100.0, cores=2) == 3  # 200 CPU-s / 56.5 per seed


def test_seeds_in_budget_prices_run_files_by_hand(tmp_path):
    plan = load_plan(SUITE)
    plan = dataclasses.replace(plan, arms=arms(["sao", "grpo", "eta0"]), drifts=plan.drifts[:2], pre=100)
    a, b = (d["name"] for d in plan.drifts)
    files = []
    for arm, drift, cpu_s, rollouts in [("sao", a, 10.0, 1000), ("sao", b, 6.0, 300),  # 0.01 and 0.02 per rollout
                                        ("grpo", a, 5.0, 1000), ("grpo", b, 3.0, 600)]:  # 0.005 each
        f = tmp_path / f"{drift}-{arm}.json"
        f.write_text(json.dumps({"arm": arm, "drift": drift, "sim": {"threads": 1},
                                 "summary": {"cpu_s": cpu_s, "trajectories": rollouts}}))
        files.append(f)
    # a seed: sao 0.01 x 1000 + 0.02 x 500 = 20, eta0 priced as sao 20, grpo 0.005 x 1500 = 7.5; 47.5 CPU-s
    out = seeds_in_budget(plan, files, {a: 900, b: 400}, n_rule=7, budget_s=100.0, cores=2)
    assert out["seed_cost"]["cpu_s"] == pytest.approx(47.5)
    assert out["budget_seeds"] == 4 and out["main_seeds"] == 4 and out["capped_by_budget"]  # 200 / 47.5 = 4.2
    assert out["predicted_wall_s"] == pytest.approx(4 * 47.5 / 2)
    assert seeds_in_budget(plan, files, {a: 900, b: 400}, n_rule=3, budget_s=100.0, cores=2)["main_seeds"] == 3


def test_budget_only_keeps_the_suites_own_lr_and_lengths():
    plan = load_plan(SUITE)
    plan = dataclasses.replace(plan, arms=arms(["sao", "grpo", "eta0", "frozen"]), drifts=plan.drifts[:2],
                               lr={"sao": 4e-4, "grpo": 5e-5}, post={plan.drifts[0]["name"]: 900,
                                                                    plan.drifts[1]["name"]: 400})
    lr, post = suite_choices(plan)
    assert lr == {"sao": {"lr": 4e-4, "from_suite": True}, "grpo": {"lr": 5e-5, "from_suite": True}}  # own lr only
    assert [v["post_rollouts"] for v in post.values()] == [900, 400]
    assert list(post) == [d["name"] for d in plan.drifts]


def test_an_arm_missing_a_cell_is_left_out():
    runs = [{"arm": "sao"}, {"arm": "sao"}, {"arm": "ppo"}]
    assert complete(runs, 2) == runs[:2]


def test_a_choice_at_the_end_of_the_points_run_is_flagged():
    choice = with_grid_edges({"sao": {"lr": 2e-4, "auc_equal_rollouts_by_lr": {1e-4: 0.4, 2e-4: 0.5, 4e-4: 0.45}},
                              "grpo": {"lr": 4e-4, "auc_equal_rollouts_by_lr": {2e-4: 0.35, 4e-4: 0.36}}})
    assert not choice["sao"]["at_grid_edge"] and choice["grpo"]["at_grid_edge"]
    assert trained_arms(load_plan(SUITE)) == ["sao", "ppo", "sao_no_warmup", "sao_coupled_lambda",
                                              "sao_no_strict_clip", "grpo", "dapo", "dr_grpo", "gspo", "cispo"]
