"""DAPO as in its paper (issue 49, item 1): the soft overlong punishment (learner.algorithms.shaping) and its effect on
the advantages through the learner's own `prepare`, its config's refusals, the suite's count of rollouts dropped by
dynamic sampling, and the outcome at equal post-drift learner steps (experiments.suite_runs, suite_analysis). Every
expected number is worked out by hand in the comments."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from experiments.arms import Arm, arms
from experiments.harness import Harness, SimConfig, scenario_stream
from experiments.harness.admission import UNIFORM_DROPPED
from experiments.suite_analysis import combine, equal_steps, run_outcomes
from experiments.suite_config import load_plan
from experiments.suite_runs import post_drift, post_drift_learner_steps
from learner.algorithms.shaping import OverlongConfig, overlong_penalty
from learner.config import LearnerConfig
from learner.models.tokenizer import BOS_ID
from learner.train import build_models
from learner.trainer.batching import collate
from learner.trainer.step import prepare, rewards
from learner.trainer.synthetic import TINY_OVERRIDES
from simulator.scenario import load_scenario
from streamer.wire.config import ConfigError, load_config
from streamer.wire.schema import Trajectory

SUITE = Path(__file__).resolve().parent.parent / "experiments" / "suites" / "drift_v1.yaml"
OVERLONG = ("advantage.overlong.max_tokens=32", "advantage.overlong.buffer=8")  # L_max 32, L_cache 8
GRPO = ("loss.name=ppo", "advantage.estimator=grpo")
# the arms of item 3 (experiments/arms.py is another engineer's: these are the lists handed over, checked to load)
PAPER_ARMS = {
    "dapo_paper": ("loss.name=dapo", "advantage.estimator=grpo", "loss.kl_coef=0", "loss.agg=token_mean",
                   "advantage.dynamic_sampling=true", *OVERLONG),
    "grpo_no_kl": (*GRPO, "loss.kl_coef=0"),
    "grpo_clip_higher": (*GRPO, "loss.eps_high=0.28"),
    "grpo_dynamic_sampling": (*GRPO, "advantage.dynamic_sampling=true"),
    "grpo_overlong": (*GRPO, *OVERLONG),
}


def test_soft_overlong_punishment_by_hand():
    # L_max - L_cache = 24: 20 -> 0; 24 -> 0; 25 -> (24 - 25)/8 = -0.125; 28 -> (24 - 28)/8 = -0.5;
    # 32 -> (24 - 32)/8 = -1; 33 (past L_max) -> -1
    got = overlong_penalty(torch.tensor([20, 24, 25, 28, 32, 33]), max_tokens=32, buffer=8)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.5, -1.0, -1.0]
    # verl's penalty_factor scales it; max_tokens 0 is off
    assert overlong_penalty(torch.tensor([28, 40]), 32, 8, penalty=0.5).tolist() == [-0.25, -0.5]
    assert overlong_penalty(torch.tensor([28, 4000]), 0, 0).tolist() == [0.0, 0.0]


def _member(i: int, n_gen: int, reward: float) -> Trajectory:
    """A member of group g (4 members): a 2-token prompt, then `n_gen` generated tokens."""
    return Trajectory(traj_id=f"t{i}", task_id="g", family="arith", concept="a", group_id="g", group_size=4,
                      prompt_len=2, tokens=[BOS_ID, 10] + [11] * n_gen, loss_mask=[0, 0] + [1] * n_gen,
                      logprobs=[0.0, 0.0] + [-1.0] * n_gen, reward=reward)


def _cfg(*sets: str) -> LearnerConfig:
    return load_config(LearnerConfig, None, [*TINY_OVERRIDES, "threads=1", "loss.kl_coef=0",
                                             "advantage.group_size=4", *sets])


def test_overlong_shaping_moves_the_grpo_advantages_of_a_group():
    # task rewards [1, 1, 0, 0], generated lengths [20, 28, 28, 32]: punishments [0, -0.5, -0.5, -1], shaped rewards
    # [1, 0.5, -0.5, -1]: mean 0, unbiased std sqrt((1 + .25 + .25 + 1)/3) = sqrt(5/6) = 0.912871, so advantages
    # [1.095445, 0.547723, -0.547723, -1.095445]. Unshaped: mean 0.5, std sqrt(4 x 0.25 / 3) = 0.577350, +-0.866025
    batch = collate([_member(i, n, r) for i, (n, r) in enumerate([(20, 1.0), (28, 1.0), (28, 0.0), (32, 0.0)])])
    shaped_cfg, plain_cfg = _cfg(*GRPO, *OVERLONG), _cfg(*GRPO)
    assert rewards(shaped_cfg, batch).tolist() == [1.0, 0.5, -0.5, -1.0]
    for cfg, want in ((shaped_cfg, [1.095445, 0.547723, -0.547723, -1.095445]),
                      (plain_cfg, [0.866025, 0.866025, -0.866025, -0.866025])):
        adv = prepare(cfg, build_models(cfg), batch)["advantages"]
        m = batch.loss_mask.bool()
        per_row = [adv[i][m[i]] for i in range(4)]
        assert [float(a[0]) for a in per_row] == pytest.approx(want, abs=2e-6)  # eps 1e-6 in the std
        assert all((a == a[0]).all() for a in per_row) and (adv[~m] == 0).all()  # every generated token, only them
    # the GAE path reads the same shaped rewards (its returns and advantages place them on the last token)
    assert rewards(_cfg(*OVERLONG), batch).tolist() == [1.0, 0.5, -0.5, -1.0]


def test_overlong_settings_refused_naming_the_field():
    for sets, field in ((["advantage.overlong.max_tokens=32", "advantage.overlong.buffer=40"], "buffer"),
                        (["advantage.overlong.buffer=8"], "buffer"),  # a buffer without max_tokens (off)
                        (["advantage.overlong.max_tokens=32"], "buffer"),  # on, but no buffer to grow over
                        (["advantage.overlong.max_tokens=-1"], "max_tokens"),
                        ([*OVERLONG, "advantage.overlong.penalty=-1"], "penalty")):
        with pytest.raises(ConfigError, match=rf"advantage\.overlong\.{field}:"):
            load_config(LearnerConfig, None, sets)
    with pytest.raises(ConfigError, match=r"advantage\.overlong\.buffer: 40 must be in \[0, max_tokens 32\]"):
        OverlongConfig(max_tokens=32, buffer=40)


def test_the_paper_arms_load():
    for name, sets in PAPER_ARMS.items():
        cfg = load_config(LearnerConfig, None, list(sets))
        assert cfg.advantage.estimator == "grpo", name
    paper = load_config(LearnerConfig, None, list(PAPER_ARMS["dapo_paper"]))
    assert paper.loss.kl_coef == 0 and paper.loss.params() == {"agg": "token_mean"}  # dapo: eps 0.2 / 0.28
    assert paper.advantage.dynamic_sampling and paper.advantage.overlong == OverlongConfig(32, 8, 1.0)
    Arm("dapo_paper", PAPER_ARMS["dapo_paper"], 8, note="DAPO as in its paper")


def test_post_drift_learner_steps_by_hand():
    traj = pd.DataFrame({"seq": [0, 1, 2, 2, 3, 4, 4], "member": [0, 0, 0, 1, 0, 0, 1],
                         "phase": [0, 0, 1, 1, 1, 1, 1], "started_at": [0.0, 1.0, 2.0, 2.0, 3.0, 5.0, 5.0]})
    steps = pd.DataFrame({"sim_time": [1.5, 2.0, 2.5, 4.0, 5.0, 6.0]})
    post = post_drift(traj)
    # the first post-drift rollout starts at 2.0, after the steps at 1.5 and 2.0 (a step at a start precedes it):
    # at 2.0 -> 0 post-drift steps, at 3.0 -> 1 (2.5), at 5.0 -> 3 (2.5, 4.0, 5.0); the run's: 4 (2.5 .. 6.0)
    at, total = post_drift_learner_steps(post, steps, 0.0)
    assert at.tolist() == [0, 0, 1, 3, 3] and total == 4
    # steps that take 0.5 s complete at 2.0, 2.5, 3.0, 4.5, 5.5, 6.5: at 2.0 -> 0, 3.0 -> 2, 5.0 -> 3; the run's 5
    at, total = post_drift_learner_steps(post, steps, 0.5)
    assert at.tolist() == [0, 0, 2, 3, 3] and total == 5


def _run(arm: str, reward: list[float], step: list[int], post_steps: int, train: bool = True, dropped: int = 0):
    n = len(reward)
    return {"drift": "d", "seed": 0, "arm": arm, "init_sha256": "aa", "sim": {"train": train},
            "summary": {"learner_steps": post_steps, "trained": n, "trajectories": n},
            "post_drift": {"reward": reward, "success": reward, "n_gen": [2] * n, "learner_step": step},
            "post_drift_learner_steps": post_steps, "post_drift_dropped_uniform": dropped}


def test_auc_at_equal_learner_steps_by_hand():
    # grpo takes 5 post-drift steps, dapo 2 (2 rollouts of a uniform group dropped), frozen none (it never trains:
    # aside). K = 2: grpo's rollouts started within 2 steps are its first 4, rewards [0, 0, 1, 1] -> 0.5; dapo's are
    # all 6, [0, 1, 0, 1, 1, 1] -> 4/6; frozen's all 6, [0, 0, 0, 1, 0, 0] -> 1/6. At equal rollouts (6) grpo has 4/6
    runs = [_run("grpo", [0, 0, 1, 1, 1, 1], [0, 0, 1, 2, 3, 4], 5),
            _run("dapo", [0, 1, 0, 1, 1, 1], [0, 0, 0, 1, 1, 2], 2, dropped=2),
            _run("frozen", [0, 0, 0, 1, 0, 0], [0] * 6, 0, train=False)]
    assert equal_steps(runs) == 2
    plan = dataclasses.replace(load_plan(SUITE, quick=True), window=2, arms=arms(["grpo", "dapo", "frozen"]))
    out = combine(plan, runs)
    by_arm = {r["arm"]: r for r in out["runs"]}
    assert by_arm["grpo"]["auc_equal_steps"] == pytest.approx(0.5)
    assert by_arm["dapo"]["auc_equal_steps"] == pytest.approx(4 / 6)
    assert by_arm["frozen"]["auc_equal_steps"] == pytest.approx(1 / 6)
    assert [by_arm[a]["equal_steps_rollouts"] for a in ("grpo", "dapo", "frozen")] == [4, 6, 6]
    assert by_arm["grpo"]["auc_equal_rollouts"] == pytest.approx(4 / 6) and by_arm["grpo"]["equal_steps_n"] == 2
    assert by_arm["dapo"]["post_drift_dropped_uniform"] == 2 and by_arm["grpo"]["post_drift_learner_steps"] == 5
    pooled = {e["arm"]: e for e in out["pooled"]}  # compared like the other outcomes, against the reference arm
    assert pooled["dapo"]["auc_equal_steps"] == pytest.approx(4 / 6) and "auc_equal_steps_minus_grpo" in pooled["dapo"]
    # a run file written before the count existed: no auc_equal_steps for its (drift, seed), nothing else changes
    old = [{k: v for k, v in r.items() if k != "post_drift_learner_steps"} for r in runs]
    assert equal_steps(old) is None and "auc_equal_steps" not in combine(plan, old)["runs"][0]
    assert math.isnan(run_outcomes(pd.DataFrame({"reward": [], "success": [], "n_gen": [], "learner_step": []}),
                                   2, 0, 0, 2)["auc_equal_steps"])


def test_rows_of_groups_dropped_by_dynamic_sampling_are_marked(tiny_policy_dir):
    # a random policy fails nearly every task: most groups have all-equal rewards and dynamic sampling drops them
    sim = SimConfig(batch=8, eta=2, group_size=4, max_in_flight=32, seed=0)
    h = Harness(sim, str(tiny_policy_dir), [*PAPER_ARMS["grpo_dynamic_sampling"]], ["max_new_tokens=6"])
    res = h.run(scenario_stream(load_scenario("smoke"), 0, 24), 20.0, log=lambda *_: None)
    t = res.trajectories
    dropped = t[t["status"] == UNIFORM_DROPPED]
    assert len(dropped) == h.trainer.batcher.dropped_uniform > 0
    for _, g in dropped.groupby("task_id"):
        assert len(g) == 4 and g["reward"].nunique() == 1  # whole groups, each of one reward
    assert (t["status"] == "buffered").sum() == res.counts["unused_at_end"]  # no dropped row left as buffered
