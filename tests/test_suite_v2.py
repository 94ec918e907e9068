"""Suite 2.0's pieces (issue 49): its files, the equal-budget tuning search, tuned points and the stability grid
applied to arms, and adaptation in simulated time; every expected value worked out by hand."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from experiments.arms import arm, setting_of
from experiments.common import init_sha256
from experiments.compute import critic_share, prefix_compute, step_costs
from experiments.suite_analysis import sim_time_outcomes
from experiments.suite_config import apply_tuned, grid_arms, load_plan
from experiments.suite_runs import run_path
from experiments.suite_tune import (
    Tuning,
    edge_check,
    fill,
    grid_edges,
    grid_ends,
    label,
    read_tuning,
    tune_arm,
    variant,
)
from learner.config import LearnerConfig
from streamer.wire.config import load_config

SUITES = Path(__file__).resolve().parent.parent / "experiments" / "suites"
TUNING = Tuning(seeds=[1001], drifts=["d"], post=64, budget=12, lr=[1e-4, 2e-4, 4e-4, 8e-4], group_sizes=[2, 4, 8, 16],
                kl=[0.0, 0.1], clip_scales=[0.5, 1.0, 1.5])


def test_the_suite_files_load_with_their_tuned_points_and_seeds_filled():
    main = load_plan(SUITES / "drift_v2.yaml")
    assert main.version == "2.1" and main.common_start == "sao" and len(main.drifts) == 9
    assert {"string_rule_swap", "string_rule_rotr"} <= {d["name"] for d in main.drifts}
    assert main.provisional == [] and main.seeds == list(range(20))  # docs/results/suite_pilot/v2.1/filled.json
    filled = json.loads((SUITES.parent.parent / "docs/results/suite_pilot/v2.1/filled.json").read_text())
    assert main.lr == {**main.lr, **{a: p["lr"] for a, p in filled["tuned"].items()}}
    assert main.reference.learner[-2:] == ("loss.eps_low=0.4", "loss.eps_high=0.4")  # SAO's chosen clip
    strag = load_plan(SUITES / "drift_v2_stragglers.yaml")
    assert strag.harness["learner_step_s"] == 2.0 and strag.harness["latency"]["kind"] == "pareto"
    assert [(d["name"], d["options"]["tool"]["max_turns"]) for d in strag.drifts] == [("tool_args", 3)]
    factorial, stability = load_plan(SUITES / "drift_v2_factorial.yaml"), load_plan(SUITES / "drift_v2_stability.yaml")
    assert len(factorial.arms) == 18 and len(stability.arms) == 6 * 4 * 3 * 2 + 1  # and the frozen control once
    assert [d["name"] for d in stability.drifts] == ["answer_format"]
    for plan in (strag, factorial, stability):  # a file that runs fewer drifts still starts from the suite's warm start
        assert plan.warm_start == main.warm_start and plan.common_start == "sao"


POINT = {"lr": 2e-4, "group_size": 16, "kl": 0.0, "clip": [0.1, 0.15]}


def test_a_tuned_point_sets_an_arm_and_those_that_take_it_keep_their_own_difference():
    names = ["sao", "eta0", "grpo", "f_group4_base_strict_eta4", "sao_no_strict_clip", "grpo_clip_higher"]
    tuned = {"sao": {**POINT, "group_size": 1}, "grpo": {**POINT, "lr": 1e-4}}
    takes = {"eta0": "sao", "f_group4_base_strict_eta4": "grpo", "sao_no_strict_clip": "sao",
             "grpo_clip_higher": "grpo"}
    chosen, lr = apply_tuned([arm(n) for n in names], 4e-4, tuned, takes)
    sao, eta0, grpo, cell, open_clip, higher = chosen
    assert sao.learner[-3:] == ("loss.kl_coef=0.0", "loss.eps_low=0.1", "loss.eps_high=0.15")
    assert eta0.learner == sao.learner and eta0.sim == {"eta": 0}
    assert grpo.group_size == 16 and grpo.learner[-1] == "loss.eps_high=0.15"
    # a factorial cell: grpo's point, its own n (4) and loss (sao's strict clip)
    assert cell.group_size == 4 and setting_of(cell, "loss.name", None) == "sao"
    assert setting_of(cell, "loss.eps_low", None) == "0.1"
    # the ablations keep what they ablate: SAO's point with the clip open; GRPO's point (n 16) with eps_high 0.28
    assert setting_of(open_clip, "loss.eps_low", None) == "1.0"
    assert setting_of(open_clip, "loss.eps_high", None) == "10.0"
    assert setting_of(open_clip, "loss.kl_coef", None) == "0.0" and open_clip.group_size == 1
    assert setting_of(higher, "loss.eps_high", None) == "0.28" and setting_of(higher, "loss.eps_low", None) == "0.1"
    assert higher.group_size == 16
    assert lr == {"sao": 2e-4, "eta0": 2e-4, "grpo": 1e-4, "f_group4_base_strict_eta4": 1e-4,
                  "sao_no_strict_clip": 2e-4, "grpo_clip_higher": 1e-4}


def test_the_factorial_keeps_rloo_n4_at_groups_of_four():
    plan = load_plan(SUITES / "drift_v2_factorial.yaml")
    assert {a.name: a.group_size for a in plan.arms if a.name.startswith("rloo")} == {"rloo_n2": 2, "rloo_n4": 4}


def test_the_stability_grid_names_each_cell_and_scales_its_lr():
    chosen, lr = grid_arms([arm("grpo")], {"grpo": 4e-4}, {"eta": [0, 64], "updates_per_batch": [4],
                                                          "lr_factor": [1, 2]})
    assert [a.name for a in chosen] == ["grpo@eta0-u4-lrx1", "grpo@eta0-u4-lrx2", "grpo@eta64-u4-lrx1",
                                        "grpo@eta64-u4-lrx2"]
    assert [a.sim["eta"] for a in chosen] == [0, 0, 64, 64] and chosen[0].learner[-1] == "optim.updates_per_batch=4"
    assert [lr[a.name] for a in chosen] == [4e-4, 8e-4, 4e-4, 8e-4]


def score_peaked_at(lr_best: float, n_best: int = 4, clip_best: float = 1.5):
    """A hand-made pilot score: best at lr_best, group size n_best, no KL, the clip (0.2 by default) scaled by
    clip_best."""
    def score(p: dict) -> float:
        return (-abs(math.log2(p["lr"] / lr_best)) - 0.1 * abs(math.log2(p["group_size"] / n_best))
                - p["kl"] - abs(p["clip"][1] / 0.2 - clip_best))
    return score


def test_tuning_runs_exactly_its_budget_and_finds_the_best_point_inside_the_grid():
    out = tune_arm(arm("grpo"), TUNING, score_peaked_at(4e-4), log=lambda *_: None)
    assert out["settings_run"] == 12 == len({t["setting"] for t in out["tried"]})
    # lr 4 + group size 3 new + kl 1 new + clip 2 new = 10; the clip's best (x1.5) is its grid's top: x2.0 is tried
    # (11, worse); the 1 left tries 4e-4 x 2^-1/2: worse
    assert out["chosen"] == {"lr": 4e-4, "group_size": 4, "kl": 0.0, "clip": (0.30000000000000004,
                                                                               0.30000000000000004)}
    assert out["at_grid_edge"] == {"lr": False, "group_size": False, "kl": False, "clip": False}
    assert [t["coordinate"] for t in out["tried"]] == ["lr"] * 4 + ["group_size"] * 3 + ["kl"] + ["clip"] * 3 + \
        ["lr"]
    assert [t["value"][1] for t in out["tried"] if t["coordinate"] == "clip"] == pytest.approx([0.1, 0.3, 0.4])


def test_tuning_extends_the_lr_grid_at_its_edge_and_says_so_when_the_budget_ends_there():
    out = tune_arm(arm("sao"), TUNING, score_peaked_at(0.1), log=lambda *_: None)
    lrs = [t["value"] for t in out["tried"] if t["coordinate"] == "lr"]
    # the best point is always the top end: doublings are added while more than 3 settings (kl, clip) are left
    assert lrs == pytest.approx([1e-4, 2e-4, 4e-4, 8e-4, 1.6e-3, 3.2e-3, 6.4e-3, 1.28e-2, 2.56e-2])
    assert out["at_grid_edge"]["lr"] and out["settings_run"] == 12  # the budget ended at the edge, and says so
    assert out["at_grid_edge"]["clip"]  # x1.5, the top, with no setting left to try x2.0
    assert "group_size" not in {t["coordinate"] for t in out["tried"]}
    assert label(out["chosen"]).startswith("lr0.0256-n1-kl0-")


def test_tuning_extends_the_group_size_and_the_clip_at_their_edges_but_not_below_a_group_of_two():
    # best n 32: 16 wins the grid, 32 is added (8 settings), wins, 64 is added (9, loses): 9 = 12 - 3 (kl, clip)
    out = tune_arm(arm("grpo"), TUNING, score_peaked_at(4e-4, n_best=32), log=lambda *_: None)
    sizes = [t["value"] for t in out["tried"] if t["coordinate"] == "group_size"]
    assert sizes == [2, 4, 16, 32, 64] and out["chosen"]["group_size"] == 32  # 8 ran in the lr's row
    assert not out["at_grid_edge"]["group_size"] and out["at_grid_edge"]["clip"] and out["settings_run"] == 12
    # best n 1: a group of 2 is the least there is, so the grid is not extended below it, nor is that an edge
    out = tune_arm(arm("rloo_n4"), TUNING, score_peaked_at(4e-4, n_best=1), log=lambda *_: None)
    assert out["chosen"]["group_size"] == 2 and not out["at_grid_edge"]["group_size"]
    assert grid_edges(out) == []
    # best clip x0.25: x0.5 wins the grid, x0.25 is added below it (and wins), x0.125 is added (and loses)
    out = tune_arm(arm("sao"), TUNING, score_peaked_at(4e-4, clip_best=0.25), log=lambda *_: None)
    assert [t["value"][1] for t in out["tried"] if t["coordinate"] == "clip"] == pytest.approx(
        [0.1, 0.3, 0.05, 0.025])
    assert out["chosen"]["clip"] == pytest.approx((0.05, 0.05)) and not out["at_grid_edge"]["clip"]


def test_an_arm_with_neither_groups_nor_a_critic_spends_the_same_budget_refining_its_lr():
    out = tune_arm(arm("reinforce_pp"), TUNING, score_peaked_at(4e-4 * 2 ** 0.25), log=lambda *_: None)
    assert out["settings_run"] == 12 and "group_size" not in {t["coordinate"] for t in out["tried"]}
    assert out["chosen"]["lr"] == pytest.approx(4e-4 * 2 ** 0.25)  # found by the refinement


def test_adaptation_in_simulated_time_by_hand():
    post = pd.DataFrame({"finished_s": [3.0, 1.0, 2.0, 9.0], "reward": [1.0, 0.0, 1.0, 1.0],
                         "success": [1.0, 0.0, 1.0, 1.0]})
    out = sim_time_outcomes(post, window=2, sim_s=3.0)
    # finished by 3 s: rewards 0, 1, 1 (finishing order 1 s, 2 s, 3 s); windows of 2 in that order: 0.5, 1.0 -> the
    # second window (ending at the third rollout to finish, 3 s) first reaches 0.7
    assert out == {"auc_equal_sim_time": pytest.approx(2 / 3), "equal_sim_s": 3.0, "sim_s_to_0.7": 3.0,
                   "reached_0.7_sim": True}
    never = sim_time_outcomes(post.assign(success=0.0), window=2, sim_s=3.0)
    assert never["sim_s_to_0.7"] == 9.0 and not never["reached_0.7_sim"]  # censored at the last finish


def test_compute_charges_generation_the_policys_steps_and_the_critics_share(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4}')
    def share(*sets):
        return critic_share(load_config(LearnerConfig, None, list(sets)), str(tmp_path))
    sao = ["loss.name=sao", "advantage.estimator=gae", "value.layers=2"]
    assert share(*sao) == 0.5 and share(*sao[:2]) == 1.0
    assert share("loss.name=ppo", "advantage.estimator=grpo") == 0.0
    steps = pd.DataFrame({"n_tokens": [100, 200], "learner/value_warmup": [1.0, 0.0]})
    # a warm-up step trains the critic alone: 3 x 100 x 0.5 = 150; then 3 x 200 x (1 + 0.5) = 900; twice with 2 updates
    assert step_costs(steps, 0.5, 1).tolist() == [150.0, 900.0] and step_costs(steps, 0.5, 2).tolist() == [300.0,
                                                                                                             1800.0]
    # rollouts of 10, 20, 30 generated tokens, started after 0, 1 and 2 post-drift steps
    assert prefix_compute([10, 20, 30], [0, 1, 2], [150.0, 900.0]).tolist() == [10.0, 180.0, 1110.0]


def test_filling_the_pilot_takes_each_chosen_point_and_the_seeds_its_paired_differences_ask(tmp_path):
    plan = dataclasses.replace(load_plan(SUITES / "drift_v2.yaml"), seeds=[1001, 1002, 1003])
    plan = dataclasses.replace(plan, drifts=plan.drifts[:1])
    per_seed = {"sao": [0.5, 0.5, 0.5], "grpo": [0.4, 0.45, 0.35]}
    for name, means in per_seed.items():
        point = {"lr": 4e-4, "group_size": 8 if name == "grpo" else 1, "kl": 0.0, "clip": [0.2, 0.2]}
        (tmp_path / f"tuning-{name}.json").write_text(json.dumps({"arm": name, "chosen": point}))
        for seed, m in zip(plan.seeds, means):
            path = run_path(tmp_path, variant(arm(name), point), plan.drifts[0], seed)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"post_drift": {"reward": [m - 0.1, m + 0.1]}}))
    out = fill(plan, tmp_path)
    assert out["tuned"]["grpo"]["group_size"] == 8 and out["arms_searched"] == ["grpo", "sao"]
    # differences -0.1, -0.05, -0.15: sample SD 0.05; delta = 0.1 x 0.5; n = ceil((3 x 0.05 / 0.05)^2) = 9
    rule = out["seeds_rule"]
    assert rule["per_arm"]["grpo"]["sd"] == pytest.approx(0.05) and rule["delta"] == pytest.approx(0.05)
    assert rule["n"] == 9


def test_the_refinement_skips_lrs_already_tried_and_still_fills_the_budget():
    # best at 8e-4 x 2^(3/4): the refinement moves up to 8e-4 x 2^(1/2), where 2^(-1/2) lands on 8e-4 (tried)
    out = tune_arm(arm("reinforce_pp"), TUNING, score_peaked_at(8e-4 * 2 ** 0.75), log=lambda *_: None)
    assert out["settings_run"] == 12 and len({t["setting"] for t in out["tried"]}) == 12


def test_a_run_another_arm_made_with_the_same_settings_is_borrowed_renamed_and_no_other(tmp_path):
    import torch
    from safetensors.torch import save_file

    from experiments.suite_runs import borrowed_run, run_settings

    init = tmp_path / "init"
    init.mkdir()
    save_file({"w": torch.zeros(2)}, str(init / "model.safetensors"))
    main, factorial = load_plan(SUITES / "drift_v2.yaml"), load_plan(SUITES / "drift_v2_factorial.yaml")
    drift = main.drifts[0]
    sao = next(a for a in main.arms if a.name == "sao")
    made = {"arm": "sao", "init": str(init), "init_sha256": init_sha256(str(init)),
            **json.loads(json.dumps(run_settings(main, sao, drift, 0), default=str)), "post_drift": {"reward": [1]}}
    path = run_path(tmp_path / "main", sao, drift, 0)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(made))
    twin, other = (next(a for a in factorial.arms if a.name == n)
                   for n in ("f_single_value_strict_eta4", "f_group4_value_strict_eta4"))
    got = borrowed_run(factorial, twin, drift, 0, str(init), tmp_path / "fact", [tmp_path / "main"])
    assert got["arm"] == "f_single_value_strict_eta4" and got["post_drift"] == {"reward": [1]}
    assert json.loads(run_path(tmp_path / "fact", twin, drift, 0).read_text()) == got  # written as its own file
    assert borrowed_run(factorial, other, drift, 0, str(init), tmp_path / "fact", [tmp_path / "main"]) is None
    assert borrowed_run(factorial, twin, drift, 1, str(init), tmp_path / "fact", [tmp_path / "main"]) is None


def test_the_edge_check_steps_past_each_edge_the_budget_ended_at_while_that_scores_higher():
    # dapo_paper's committed search: its clip ended at x1.5 of DAPO's own (0.2, 0.28), the top of the grid
    # (0.5, 1.0, 1.5); the search's extension steps up by the grid's last gap: x2.0 = (0.4, 0.56), x2.5 = (0.5, 0.7)
    search = json.loads((SUITES.parent.parent / "docs/results/suite_pilot/v2.1/tuning-dapo_paper.json").read_text())
    tuning = read_tuning(SUITES / "drift_v2.yaml")
    assert grid_ends(arm("dapo_paper"), search, tuning) == [("clip", pytest.approx([0.5, 1.0, 1.5]), False)]
    (row,) = edge_check([search], tuning, lambda a: lambda p: {0.42: 0.3, 0.56: 0.4, 0.7: 0.35}[round(p["clip"][1], 6)])
    assert [b["setting"] for b in row["beyond"]] == ["lr0.0008-n16-kl0-clip0.4_0.56", "lr0.0008-n16-kl0-clip0.5_0.7"]
    assert row["rerun_score"] == 0.3 and row["recorded_score"] == pytest.approx(0.3834, abs=1e-4)
    assert not row["inside"]  # x2.0 beat the chosen x1.5; x2.5 lost to x2.0, so the steps end there
    # a search that ended at the top of its lr (0.0256, after doublings) and of its clip (x1.5 of SAO's 0.2)
    score = score_peaked_at(0.1)
    (row,) = edge_check([tune_arm(arm("sao"), TUNING, score, log=lambda *_: None)], TUNING, lambda a: score)
    # chosen: -|log2(0.256)| - 0.1 x |log2(1/4)| = -2.166; lr 0.0512: -1.166, 0.1024: -0.234, 0.2048: -1.234 (lost);
    # clip x2.0 (the gap 0.5 past 1.5): 0.5 lower than the chosen, so one step
    assert [b["setting"] for b in row["beyond"]] == ["lr0.0512-n1-kl0-clip0.3_0.3", "lr0.102-n1-kl0-clip0.3_0.3",
                                                     "lr0.205-n1-kl0-clip0.3_0.3", "lr0.0256-n1-kl0-clip0.4_0.4"]
    assert row["rerun_score"] == pytest.approx(-math.log2(1 / 0.256) - 0.2)
    assert [b["score"] for b in row["beyond"]] == pytest.approx(
        [-math.log2(1 / 0.512) - 0.2, -math.log2(1.024) - 0.2, -math.log2(2.048) - 0.2, -math.log2(1 / 0.256) - 0.7])
    assert not row["inside"]
