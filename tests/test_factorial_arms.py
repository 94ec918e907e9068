"""The factorial of issue 49, item 2 (experiments/arms.py): the reinforce_pp estimator (single rollouts, no critic),
gae over groups of n in the harness, and the factorial's arms. Numbers computed by hand."""

from __future__ import annotations

import pytest
import torch

from experiments.arms import ARMS, SUITE2_ARMS, arm, arms, factorial_arms
from experiments.harness import Harness, SimConfig, scenario_stream
from learner.algorithms import GROUP_ESTIMATORS, NEEDS_GROUPS, group_advantages, reinforce_pp
from learner.config import LearnerConfig
from learner.train import build_models
from learner.trainer.batching import collate
from learner.trainer.loop import Trainer
from learner.trainer.step import prepare
from learner.trainer.synthetic import synthetic_trajectories
from simulator.scenario import load_scenario
from streamer.wire.config import ConfigError, load_config

AGENT = ["max_new_tokens=6"]  # a random policy writes garbage: keep its answers short


# ------------------------------------------------------------------------------------------- the estimator

def test_reinforce_pp_is_the_batch_normalised_reward():
    # rewards [1, 0, 0, 1]: mean 0.5, population std 0.5 -> (R - 0.5) / 0.5 = +-1 (up to eps)
    assert reinforce_pp(torch.tensor([1.0, 0.0, 0.0, 1.0])).tolist() == pytest.approx([1, -1, -1, 1], abs=1e-5)
    # [2, 0, 1]: mean 1, population std sqrt(2/3) -> +-sqrt(3/2) = 1.2247, 0
    assert reinforce_pp(torch.tensor([2.0, 0.0, 1.0])).tolist() == pytest.approx([1.5 ** 0.5, -1.5 ** 0.5, 0],
                                                                                  abs=1e-5)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 0], [1, 1, 1]])
    tok = group_advantages("reinforce_pp", torch.tensor([1.0, 0.0, 0.0, 1.0]), ["a", "b", "c", "d"], mask)
    want = torch.tensor([[1, 1, 0], [0, -1, -1], [-1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    assert torch.allclose(tok, want, atol=1e-5)
    # the groups do not matter: the baseline is the whole batch's
    same = group_advantages("reinforce_pp", torch.tensor([1.0, 0.0, 0.0, 1.0]), ["a", "a", "a", "a"], mask)
    assert torch.equal(tok, same)


def test_reinforce_pp_constant_batch_is_zero():
    for rewards in ([0.3] * 7, [1.0] * 4, [0.0], [0.1] * 64):  # 0.3 x 7 in float32: the mean is an ulp off
        adv = reinforce_pp(torch.tensor(rewards))
        assert torch.isfinite(adv).all() and adv.abs().max() == 0
    tok = group_advantages("reinforce_pp", torch.tensor([0.3] * 3), [0, 1, 2], torch.ones(3, 4))
    assert tok.abs().max() == 0


def test_registry():
    assert "reinforce_pp" in GROUP_ESTIMATORS and "reinforce_pp" not in NEEDS_GROUPS
    assert set(NEEDS_GROUPS) == {"grpo", "dr_grpo", "rloo"}


# ------------------------------------------------------------------------------------------- the config

def learner_cfg(*sets):
    return load_config(LearnerConfig, None, list(sets))


def test_config_accepts_reinforce_pp_without_groups_and_builds_no_critic(tiny_policy_dir):
    cfg = learner_cfg(f"io.init={tiny_policy_dir}", "advantage.estimator=reinforce_pp", "advantage.group_size=1",
                      "loss.kl_coef=0")
    assert not cfg.uses_value_model
    models = build_models(cfg)
    assert models.value is None and models.value_opt is None
    # its batches take single trajectories whatever advantage.group_size says (8 by default): no group to wait for
    trainer = Trainer(learner_cfg(f"io.init={tiny_policy_dir}", "advantage.estimator=reinforce_pp",
                                  "loss.kl_coef=0"), models, source=None)
    assert trainer.batcher.group_size is None and not trainer.grouped
    # a group estimator still needs groups, and whole groups in a sync batch
    with pytest.raises(ConfigError, match="advantage.group_size"):
        learner_cfg("advantage.estimator=grpo", "advantage.group_size=1")
    with pytest.raises(ConfigError, match="sync_batch 10"):
        learner_cfg("advantage.estimator=rloo", "advantage.group_size=4", "batch.sync=true", "batch.sync_batch=10")
    learner_cfg("advantage.estimator=reinforce_pp", "batch.sync=true", "batch.sync_batch=10")  # no groups: any size
    learner_cfg("advantage.estimator=gae", "advantage.group_size=1")


def test_trainer_steps_reinforce_pp_on_single_rollouts(tiny_policy_dir):
    cfg = learner_cfg(f"io.init={tiny_policy_dir}", "advantage.estimator=reinforce_pp", "loss.kl_coef=0")
    models = build_models(cfg)
    trajs = synthetic_trajectories(models.policy, 8, seed=1)  # single rollouts, random 0/1 rewards
    rewards = torch.tensor([t.reward for t in trajs])
    assert 0 < rewards.sum() < 8  # both kinds, so the advantages are not all 0
    batch = collate(trajs)
    adv = prepare(cfg, models, batch)["advantages"]
    want = (rewards - rewards.mean()) / rewards.std(unbiased=False)  # by hand: +-1 around the batch mean, / std
    assert torch.allclose(adv, want[:, None] * batch.loss_mask, atol=1e-5)
    event = Trainer(cfg, models, source=None).train_on(trajs)
    assert event is not None and event.metrics["learner/policy_steps"] == 1 and event.metrics["learner/grad_norm"] > 0
    assert "learner/value_loss" not in event.metrics


# ------------------------------------------------------------------------------------------- the harness

def simulate(policy, sim: SimConfig, learner: list[str], n_tasks: int = 24):
    h = Harness(sim, str(policy), learner, AGENT)
    res = h.run(scenario_stream(load_scenario("smoke"), sim.seed, n_tasks), 20.0, log=lambda *_: None)
    return h, res


def test_harness_trains_reinforce_pp_single_rollouts_without_a_critic(tiny_policy_dir):
    a = arm("f_single_base_strict_eta4")
    h, res = simulate(tiny_policy_dir, SimConfig(batch=8, eta=4, max_in_flight=16, seed=0, group_size=a.group_size),
                      list(a.learner))
    assert h.models.value is None and h.cfg.advantage.estimator == "reinforce_pp"
    assert len(res.steps) > 0 and (res.trajectories["status"] == "trained").any()
    assert "learner/value_loss" not in res.steps.columns and (res.steps["learner/value_warmup"] == 0).all()
    assert res.steps["learner/policy_loss"].notna().all() and res.steps["learner/policy_steps"].iloc[-1] > 0


def test_harness_trains_gae_over_groups(tiny_policy_dir):
    n = 2
    sim = SimConfig(batch=8, eta=1, group_size=n, max_in_flight=16, seed=0)
    h, res = simulate(tiny_policy_dir, sim, ["loss.name=sao", "advantage.estimator=gae", "value.warmup_steps=1"])
    t = res.trajectories
    assert h.models.value is not None and len(t) == 24 * n and (t.groupby("task_id").size() == n).all()
    assert len(res.steps) > 0 and res.steps["learner/value_loss"].notna().all()
    assert res.steps["learner/policy_steps"].iloc[-1] > 0  # past the critic's warm-up step
    assert (t["status"] == "trained").any()
    # a group estimator without groups is still refused
    with pytest.raises(ValueError, match="needs groups"):
        Harness(SimConfig(batch=8, max_in_flight=16), str(tiny_policy_dir), ["advantage.estimator=grpo"], AGENT)


# ------------------------------------------------------------------------------------------- the arms

def test_factorial_arms():
    cells = factorial_arms()
    assert len(cells) == 16 and len({a.name for a in cells}) == 16
    assert all(SUITE2_ARMS[a.name] == a for a in cells) and arms([a.name for a in cells]) == cells
    assert {a.sim["eta"] for a in cells} == {0, 4}
    # the corners are the existing sao and GRPO (at n = 4) arms
    sao, grpo = arm("f_single_value_strict_eta4"), arm("f_group4_base_oneside_eta4")
    assert set(sao.learner) == set(ARMS["sao"].learner) and sao.group_size == 1
    assert set(grpo.learner) == set(ARMS["grpo"].learner) and grpo.group_size == 4
    assert set(arm("f_single_base_oneside_eta0").learner) == {"loss.name=ppo", "advantage.estimator=reinforce_pp"}
    assert arm("f_group4_value_strict_eta0").group_size == 4 and arm("f_group4_value_strict_eta0").sim == {"eta": 0}
    assert [a.name for a in factorial_arms(etas=(2,), n=8)][-1] == "f_group8_base_oneside_eta2"
    assert arm("rloo_n2").group_size == 2 and arm("rloo_n4").group_size == 4
    assert "advantage.estimator=rloo" in arm("rloo_n2").learner and "loss.name=ppo" in arm("rloo_n4").learner
    # the drift suite's arms are unchanged, and every arm's overrides make a valid LearnerConfig
    assert len(ARMS) == 12 and not set(ARMS) & set(SUITE2_ARMS)
    for a in SUITE2_ARMS.values():
        sets = [*a.learner, *([f"advantage.group_size={a.group_size}"] if a.group_size > 1 else [])]
        learner_cfg(*sets)
