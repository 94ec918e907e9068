"""The simulated online-learning harness (experiments/harness.py), the drift suite (experiments/suites/drift_v1.yaml,
experiments/arms.py, experiments/suite.py) and its statistics (experiments/stats.py), on the real engine and learner
with a tiny random policy."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import pandas as pd
import pytest

from experiments import stats
from experiments.arms import ARMS, arms
from experiments.common import init_sha256, mean_ci, reusable_run
from experiments.harness import (
    Harness,
    SimConfig,
    arrival_times,
    finish_time,
    phase_prefix,
    scenario_stream,
    shared_tasks,
    simulate,
    simulate_branches,
)
from experiments.offpolicy import main as offpolicy_main
from experiments.suite import main as suite_main
from experiments.suite_analysis import choose_lr, combine, pool_results, pooled, post_rollouts_rule
from experiments.suite_config import (
    drift_options,
    drift_scenario,
    lay_over,
    load_plan,
    lr_of,
    main_seeds,
    pick_drifts,
    post_of,
    read_lr,
    resolve,
    sim_config,
    split_threads,
    warm_start_note,
    warm_start_scenario,
)
from experiments.suite_report import report as suite_report
from experiments.suite_runs import drift_stream, finished_run, run_path, run_settings
from experiments.sync_baselines import main as sync_main
from simulator.scenario import Scenario, load_scenario, validate_scenario
from streamer.wire.config import load_config
from streamer.wire.schema import DriftEvent, Task

SUITE = Path(__file__).resolve().parent.parent / "experiments" / "suites" / "drift_v1.yaml"
SUITE_1_5 = SUITE.with_name("drift_v1_5.yaml")
AGENT = ["max_new_tokens=6"]  # a random policy writes garbage: keep its answers short


def smoke_stream(n_tasks: int, seed: int = 0):
    return scenario_stream(load_scenario("smoke"), seed, n_tasks)


def run(policy, sim: SimConfig, n_tasks: int = 48, learner=()):
    return simulate(sim, str(policy), smoke_stream(n_tasks, sim.seed), list(learner), AGENT, 20.0, log=lambda *_: None)


# ---------------------------------------------------------------------------------------------- pure functions

def test_finish_time_adds_generation_and_tool_latency():
    # 50 tokens at 100 tokens/s = 0.5 s, plus 2.5 s of tool calls, from t = 1
    assert finish_time(1.0, 50, 2.5, 100.0) == pytest.approx(4.0)
    assert finish_time(1.0, 50, 9.0, 100.0) > finish_time(1.0, 50, 2.5, 100.0)


def test_arrival_times_rescale_the_stream():
    tasks = [Task(task_id=str(i), family="format", concept="parens", prompt="p", answer="a", created_at=t)
             for i, t in enumerate([0.5, 1.0, 2.0])]
    assert arrival_times(tasks, 20.0, 0.0) == [0.0, 0.0, 0.0]
    assert arrival_times(tasks, 20.0, 10.0) == pytest.approx([1.0, 2.0, 4.0])  # half the rate: twice the times
    assert arrival_times(tasks, 0.0, 4.0) == pytest.approx([0.0, 0.25, 0.5])


def test_phase_prefix_keeps_the_first_tasks_of_each_phase():
    def task(i, phase):
        return Task(task_id=f"t{i}", family="format", concept="c", prompt="p", answer="a", phase=phase, seq=i)
    drift = DriftEvent(phase=1, prev_phase=0, name="d", schedule="abrupt", families=["format"],
                       concepts={"format": "c"}, at_seq=5)
    stream = [task(i, 0) for i in range(5)] + [drift] + [task(i, 1) for i in range(5, 8)]
    kept = phase_prefix(stream, 2)  # ceil(5/2) = 3 and ceil(3/2) = 2
    assert [m.task_id if isinstance(m, Task) else "drift" for m in kept] == ["t0", "t1", "t2", "drift", "t5", "t6"]
    assert phase_prefix(stream, 1) == stream


def test_stats_hand_computed():
    # windows of 2 over 0,1,0,1,1: means .5,.5,.5,1 -> 0.8 first reached by the window ending at index 4: 5 samples
    assert stats.window_means([0, 1, 0, 1, 1], 2).tolist() == [0.5, 0.5, 0.5, 1.0]
    assert stats.window_means([1], 2).size == 0
    assert stats.samples_to([0, 1, 0, 1, 1], 0.8, 2) == (5, True)
    assert stats.samples_to([0, 1, 0, 1, 0], 0.8, 2) == (5, False)  # censored at what was observed
    # times 2, 3 (censored), 4, 5: S(2) = 3/4, S(4) = 3/4 * 1/2 = 3/8 -> median 4
    assert stats.km_curve([2, 3, 4, 5], [True, False, True, True]) == [(2.0, 0.75), (4.0, 0.375), (5.0, 0.0)]
    assert stats.km_median([2, 3, 4, 5], [True, False, True, True]) == 4.0
    assert stats.km_median([2, 9, 9], [True, False, False]) is None  # S never reaches 0.5: a censored median
    b = stats.paired_bootstrap([0.1, 0.1, 0.1])
    assert (b["mean"], b["low"], b["high"], b["n"]) == pytest.approx((0.1, 0.1, 0.1, 3))
    assert stats.seeds_for(0.02, 0.05) == 5  # (3 * 0.02 / 0.05)^2 = 1.44 -> the minimum 5
    assert stats.seeds_for(0.05, 0.05) == 9  # (3 * 1)^2
    # 0.1, 0.2, 0.3: mean 0.2, sd 0.1, half width t(0.975, 2) 4.303 x 0.1 / sqrt(3) = 0.24843
    t = stats.t_interval([0.1, 0.2, 0.3])
    assert (t["mean"], t["sd"], t["low"], t["high"], t["n"]) == pytest.approx((0.2, 0.1, -0.04843, 0.44843, 3),
                                                                                 abs=1e-5)
    assert stats.t975(30) == pytest.approx(2.0423, abs=1e-3)  # the expansion beyond the table (tables: 2.0423)
    with pytest.raises(ValueError, match="df must be >= 1"):
        stats.t975(0)
    assert stats.sample_sd([0.1, 0.2, 0.3]) == pytest.approx(0.1) and stats.sample_sd([0.1]) is None


def test_mean_ci_uses_the_t_quantile_of_its_df():
    # 3 values: the t interval above, 0.2 +- 0.24843
    ci = mean_ci([0.1, 0.2, None, 0.3])
    assert (ci["mean"], ci["lo"], ci["hi"], ci["n"]) == pytest.approx((0.2, -0.04843, 0.44843, 3), abs=1e-5)
    # six 0s and six 1s: sd sqrt(3 / 11) = 0.52223, se 0.150756; t(0.975, 11) 2.201 (the expansion 2.1990), not
    # the 2.131 of df 15 that a sparse table would round to: half width 0.3315
    ci = mean_ci([0.0] * 6 + [1.0] * 6)
    assert ci["hi"] - ci["mean"] == pytest.approx(2.1990 * 0.150756, abs=2e-4)
    assert mean_ci([0.7]) == {"mean": 0.7, "lo": 0.7, "hi": 0.7, "n": 1}


# ---------------------------------------------------------------------------------------------- the simulation

def test_same_seed_same_trajectories(tiny_policy_dir):
    sim = SimConfig(batch=8, eta=2, max_in_flight=16, seed=3)
    a, b = run(tiny_policy_dir, sim), run(tiny_policy_dir, sim)
    cols = ["traj_id", "reward", "policy_version", "n_gen", "finished_at", "status", "trained_step"]
    assert len(a.trajectories) == 48 and len(a.steps) >= 3
    assert a.trajectories[cols].equals(b.trajectories[cols])
    assert a.steps["learner/policy_loss"].fillna(0).tolist() == b.steps["learner/policy_loss"].fillna(0).tolist()
    ess = a.steps["learner/ess_frac"].dropna()  # none during the critic's warm-up (no policy step)
    assert len(ess) and ((ess > 0) & (ess <= 1.0 + 1e-9)).all()


def test_branches_of_a_shared_start_equal_their_runs_alone(tiny_policy_dir):
    a = smoke_stream(48)
    own = [m for m in smoke_stream(60, seed=1) if isinstance(m, Task)][30:54]  # other tasks after the first 24
    b = [m for m in a if isinstance(m, Task)][:24] + own
    assert shared_tasks([a, b]) == 24 and shared_tasks([a, a[:5]]) == 5
    sim = SimConfig(batch=8, eta=2, max_in_flight=16, seed=3)
    trunk = Harness(sim, str(tiny_policy_dir), [], AGENT)
    trunk.start(a, 20.0)
    assert trunk.advance(lambda *_: None, before_task=24)  # stopped before the tick that would start task 24
    assert 0 < trunk.started_tasks <= 24 < trunk.started_tasks + trunk._admissible(trunk.events[0].time)
    branched = simulate_branches(sim, str(tiny_policy_dir), [a, b], [], AGENT, 20.0, log=lambda *_: None)
    for stream, got in zip((a, b), branched):
        alone = simulate(sim, str(tiny_policy_dir), stream, [], AGENT, 20.0, log=lambda *_: None)
        assert len(got.steps) >= 4
        pd.testing.assert_frame_equal(got.trajectories, alone.trajectories)
        timing = [c for c in alone.steps if c == "wall_step_s" or c.startswith("perf/")]
        assert timing and got.steps.columns.tolist() == alone.steps.columns.tolist()
        pd.testing.assert_frame_equal(got.steps.drop(columns=timing), alone.steps.drop(columns=timing))
    assert branched[0].trajectories["task_id"].tolist() != branched[1].trajectories["task_id"].tolist()
    with pytest.raises(ValueError, match="no task of their own"):
        simulate_branches(sim, str(tiny_policy_dir), [a, a[:30]], [], AGENT, 20.0)
    with pytest.raises(ValueError, match="only async"):
        simulate_branches(dataclasses.replace(sim, mode="sync", eta=0), str(tiny_policy_dir), [a, b])


def test_staleness_bound_and_finish_order(tiny_policy_dir):
    eta = 1
    res = run(tiny_policy_dir, SimConfig(batch=8, eta=eta, max_in_flight=32, seed=0), n_tasks=64)
    t = res.trajectories
    trained = t[t["status"] == "trained"]
    assert len(trained) and (trained["staleness_at_train"] <= eta).all()
    stale = t[t["status"] == "stale"]  # dropped on joining the buffer, or when their batch was trained
    assert (stale[["staleness", "staleness_at_train"]].max(axis=1) > eta).all()
    assert (t["status"] == "stale").any()  # 32 in flight against batches of 8: some go past eta
    # a rollout finishes after its generation and its tool calls, joins when it finishes, and single rollouts are
    # trained in the order they joined
    assert (t["finished_at"] - t["started_at"] - t["gen_s"] - t["env_s"]).abs().max() < 1e-9
    assert (t["joined_at"] == t["finished_at"]).all()
    order = trained.sort_values(["joined_at", "seq"])["trained_step"].tolist()
    assert order == sorted(order)


def test_groups_join_and_go_stale_as_a_unit(tiny_policy_dir):
    n = 4
    sim = SimConfig(batch=8, eta=1, group_size=n, max_in_flight=32, seed=0)
    res = run(tiny_policy_dir, sim, n_tasks=24, learner=["loss.name=ppo", "advantage.estimator=grpo"])
    t = res.trajectories
    assert len(t) == 24 * n
    for _, g in t.groupby("task_id"):
        assert len(g) == n
        assert (g["joined_at"] == g["finished_at"].max()).all()  # the group joins when its last member finishes
        assert g["status"].nunique() == 1 and g["trained_step"].nunique() == 1  # trained or dropped together
        assert g["policy_version"].nunique() == 1
    assert (t["status"] == "trained").any()


def rounds(t):
    """Rollouts grouped by their start time: a synchronous baseline starts one round at a time."""
    return [g for _, g in t.sort_values("started_at").groupby("started_at")]


def test_sync_waits_for_the_round_and_the_learner(tiny_policy_dir):
    res = run(tiny_policy_dir, SimConfig(batch=8, eta=0, mode="sync", learner_step_s=1.0, seed=0), n_tasks=32)
    t = res.trajectories
    assert [len(g) for g in rounds(t)] == [8, 8, 8, 8] and (t["status"] == "trained").all()
    assert (t["staleness_at_train"] == 0).all()
    for prev, nxt in zip(rounds(t), rounds(t)[1:]):  # the round's last rollout, then the learner's step
        assert nxt["started_at"].iloc[0] >= prev["finished_at"].max() + 1.0 - 1e-9
        assert (nxt["policy_version"] == prev["policy_version"].iloc[0] + 1).all()


def test_sync_one_step_overlaps_the_step_with_the_next_round(tiny_policy_dir):
    res = run(tiny_policy_dir, SimConfig(batch=8, eta=1, mode="sync_one_step", learner_step_s=100.0, seed=0),
              n_tasks=32)
    t = res.trajectories
    r = rounds(t)
    assert [len(g) for g in r] == [8, 8, 8, 8]
    # round 2 starts when round 1 has finished, though the learner is busy for 100 s with round 1's step
    assert r[1]["started_at"].iloc[0] < r[0]["finished_at"].max() + 100.0
    trained = t[t["status"] == "trained"]
    assert set(trained["staleness_at_train"]) == {0, 1} and (trained["staleness_at_train"] <= 1).all()


def test_sync_overprovision_trains_the_first_batch_and_drops_the_stragglers(tiny_policy_dir):
    sim = SimConfig(batch=8, eta=0, mode="sync_overprovision", overprovision=0.5, seed=0)
    assert sim.round_size() == 12
    t = run(tiny_policy_dir, sim, n_tasks=36).trajectories
    for g in rounds(t):
        assert len(g) == 12 and (g["status"] == "trained").sum() == 8
        assert (g["status"] == "straggler dropped").sum() == 4
        done = g[g["status"] == "trained"]["finished_at"].max()  # the 8 trained are the first 8 to finish
        assert (g[g["status"] == "straggler dropped"]["finished_at"] >= done).all()
    with pytest.raises(ValueError, match="mode sync trains at staleness 0"):
        SimConfig(mode="sync", eta=4).validate()
    with pytest.raises(ValueError, match="mode 'lockstep'"):
        SimConfig(mode="lockstep").validate()


def test_learner_paced_admission_starts_tasks_per_version(tiny_policy_dir):
    sim = SimConfig(batch=8, eta=2, max_in_flight=64, tasks_per_version=8, versions_ahead=1, learner_step_s=1.0,
                    seed=0)
    t = run(tiny_policy_dir, sim, n_tasks=48).trajectories.sort_values(["started_at", "seq"])
    started = pd.Series(range(1, len(t) + 1), index=t.index)
    # by the time version v is what rollouts start with, at most (v + 1 + versions_ahead) x 8 tasks have started
    assert (started <= (t["policy_version"] + 2) * 8).all()
    assert (started == (t["policy_version"] + 2) * 8).any()  # and the bound is reached
    free = run(tiny_policy_dir, dataclasses.replace(sim, tasks_per_version=0), n_tasks=48).trajectories
    assert (free["policy_version"] == 0).all()  # unpaced: all 48 start at once, before any step


def test_frozen_arm_never_steps(tiny_policy_dir):
    res = run(tiny_policy_dir, SimConfig(batch=8, max_in_flight=16, train=False), n_tasks=24)
    assert len(res.steps) == 0 and (res.trajectories["policy_version"] == 0).all()


# ---------------------------------------------------------------------------------------------- the suite

def test_suite_file_names_seven_drifts_and_every_arm():
    plan = load_plan(SUITE)
    assert len(plan.drifts) >= 7 and {a.name for a in plan.arms} == set(ARMS)
    kinds = {d["kind"] for d in plan.drifts}
    for k in ("arithmetic operator A->B", "arithmetic operator A->C", "string rule A->B", "string rule A->C",
              "answer format", "tool rename", "tool argument format"):
        assert k in kinds
    for d in plan.drifts:  # every drift's concepts exist in simulator/families
        phases = drift_scenario(plan, d).phases
        assert [p.concepts for p in phases] == [{d["family"]: d["from"]}, {d["family"]: d["to"]}]
    # 1.2 filled the pilot's placeholders; 1.4 runs the rule's n = 7 seeds (in parts) from a one-thread warm start
    assert plan.provisional == [] and plan.seeds == list(range(7)) and plan.version == "1.4"
    assert "threads=1" in plan.pretrain_sets and re.fullmatch("[0-9a-f]{64}", plan.warm_start_sha256)
    post = {d["name"]: post_of(plan, d) for d in plan.drifts}
    assert post["tool_rename"] == 2560 and post["arith_op_ab"] == 4608
    assert [p.duration_tasks for p in drift_scenario(plan, plan.drifts[-1]).phases] == [1024, 4608]
    assert lr_of(plan, arms(["dapo"])[0]) == 5e-5 and lr_of(plan, arms(["eta0"])[0]) == lr_of(plan, arms(["sao"])[0])
    assert {a.group_size for a in arms(["grpo", "dapo", "dr_grpo", "gspo", "cispo"])} == {8}
    with pytest.raises(ValueError, match="unknown arm"):
        arms(["sao", "reinforce"])


def test_the_suite_warm_start_trains_every_family_at_its_pre_drift_concept():
    plan = load_plan(SUITE)
    phase = plan.warm_start["phases"][0]
    assert phase["concepts"] == {"arith": "add7", "string": "reverse", "format": "brackets", "tool": "look/plain/0"}
    assert plan.warm_start["warm_start"]["mixture"]["tool"]["look/key/0"] > 0  # the argument-format drift's target
    assert "pretrain" not in plan.warm_start["warm_start"] and plan.pretrain_sets  # overrides kept apart
    validate_scenario(load_config(Scenario, None, [], base=plan.warm_start), "suite warm start")
    clash = [{"name": "a", "family": "arith", "from": "add7"}, {"name": "b", "family": "arith", "from": "sub7"}]
    with pytest.raises(ValueError, match="drift b starts family arith from sub7, another drift from add7"):
        warm_start_scenario("s", {}, {}, clash)


def test_main_seeds_never_take_a_pilot_seed():
    assert main_seeds("0,1,2,3,4,5,6", [1001, 1002, 1003], pilot=False) == [0, 1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match=r"\[1002\] are pilot seeds"):
        main_seeds("0,1002", [1001, 1002, 1003], pilot=False)
    with pytest.raises(ValueError, match="--seeds with --pilot"):
        main_seeds("0", [1001], pilot=True)


def test_a_placeholder_resolves_to_its_filled_value_else_to_its_provisional_one():
    used: list[str] = []
    assert resolve({"pilot": {"provisional": 2}}, "a", used) == 2 and used == ["a"]
    assert resolve({"pilot": {"provisional": 2}, "filled": {"x": 5}}, "b", used) == {"x": 5} and used == ["a"]
    assert resolve(7, "c", used) == 7 and used == ["a"]
    plan = dataclasses.replace(load_plan(SUITE), post={"x": 5})
    with pytest.raises(ValueError, match="no post_rollouts for drift y"):
        post_of(plan, {"name": "y"})


def test_a_drift_lays_its_own_options_over_the_suite_options():
    suite = {"tool": {"max_turns": 3, "error_penalty": 0.75}, "arith": {"max_operand": 6}}
    drift = {"name": "t", "options": {"tool": {"max_turns": 1}, "format": {"x": 2}}}
    assert drift_options(suite, drift) == {"tool": {"max_turns": 1, "error_penalty": 0.75},
                                           "arith": {"max_operand": 6}, "format": {"x": 2}}
    assert suite["tool"]["max_turns"] == 3  # the suite's own options are not changed
    plan = load_plan(SUITE)
    tool_args = pick_drifts(plan.drifts, ["tool_args"])[0]
    assert drift_scenario(plan, tool_args).options["tool"] == {"max_turns": 1, "error_penalty": 0.75}
    with pytest.raises(ValueError, match=r"unknown drift\(s\) \['nope'\]"):
        pick_drifts(plan.drifts, ["tool_args", "nope"])


def test_pooled_outcomes_by_hand():
    cells = {"sao": {(1, "a"): 0.4, (1, "b"): 0.6, (2, "a"): 0.5, (2, "b"): 0.7},
             "grpo": {(1, "a"): 0.3, (1, "b"): 0.5, (2, "a"): 0.5, (2, "b"): 0.3}}
    table = pd.DataFrame([{"arm": a, "seed": s, "drift": d, "auc_equal_rollouts": x, "auc_equal_tokens": x,
                           "final_reward": x} for a, m in cells.items() for (s, d), x in m.items()])
    sao, grpo = pooled(table, "sao")
    assert sao["auc_equal_rollouts"] == pytest.approx(0.55) and grpo["auc_equal_rollouts"] == pytest.approx(0.4)
    diff = grpo["auc_equal_rollouts_minus_sao"]  # per seed: (-0.1 - 0.1) / 2 = -0.1 and (0 - 0.4) / 2 = -0.2
    assert (diff["mean"], diff["low"], diff["high"], diff["n"]) == pytest.approx((-0.15, -0.2, -0.1, 2))
    t = grpo["auc_equal_rollouts_minus_sao_t"]  # sd 0.0707; t(0.975, 1) 12.706 x 0.0707 / sqrt 2 = 0.6353
    assert (t["mean"], t["sd"], t["low"], t["high"]) == pytest.approx((-0.15, 0.07071, -0.7853, 0.4853), abs=1e-4)


def test_each_arm_runs_at_its_own_lr_and_the_controls_at_saos():
    plan = dataclasses.replace(load_plan(SUITE), lr=read_lr({"sao": "2e-4", "grpo": 4e-4}))
    assert [lr_of(plan, a) for a in arms(["sao", "grpo", "eta0", "frozen"])] == [2e-4, 4e-4, 2e-4, 2e-4]
    with pytest.raises(ValueError, match="no lr for arm ppo"):
        lr_of(plan, arms(["ppo"])[0])
    assert lr_of(dataclasses.replace(plan, lr=1e-4), arms(["ppo"])[0]) == 1e-4


def _weights(tmp_path, name: str, data: bytes) -> str:
    """A warm-start directory holding only the weights file `init_sha256` reads."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "model.safetensors").write_bytes(data)
    return str(tmp_path / name)


def test_a_run_file_from_before_a_new_sim_field_is_still_that_run(tmp_path):
    plan = load_plan(SUITE, quick=True)
    sao, drift = arms(["sao"])[0], plan.drifts[0]
    w = _weights(tmp_path, "w", b"weights")
    settings = run_settings(plan, sao, drift, 0)
    old = {**settings, "init": w, "init_sha256": hashlib.sha256(b"weights").hexdigest(),
           "sim": {k: v for k, v in settings["sim"].items() if k not in ("mode", "overprovision")}}
    path = run_path(tmp_path, sao, drift, 0)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(old))
    assert finished_run(plan, sao, drift, 0, w, tmp_path) == old  # the field's default is what it ran with
    assert finished_run(plan, sao, drift, 0, _weights(tmp_path, "another-init", b"weights"), tmp_path) is None
    path.write_text(json.dumps({**old, "sim": {**old["sim"], "mode": "sync"}}))
    assert finished_run(plan, sao, drift, 0, w, tmp_path) is None


def test_a_learner_set_outside_the_plan_is_in_every_runs_settings(tmp_path):
    plan = load_plan(SUITE, quick=True)
    sao, drift = arms(["sao"])[0], plan.drifts[0]
    w = _weights(tmp_path, "w", b"weights")
    shallow = dataclasses.replace(plan, learner_sets=("value.layers=1",))  # what `--set value.layers=1` runs
    base = run_settings(plan, sao, drift, 0)
    assert run_settings(shallow, sao, drift, 0)["learner_sets"] == [*base["learner_sets"], "value.layers=1"]
    run = {**base, "init": w, "init_sha256": init_sha256(w)}
    path = run_path(tmp_path, sao, drift, 0)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(run))
    assert finished_run(plan, sao, drift, 0, w, tmp_path) == run
    assert finished_run(shallow, sao, drift, 0, w, tmp_path) is None  # the plan's run is not the --set one


def test_a_rebuilt_warm_start_with_other_bits_is_neither_reused_nor_combined(tmp_path):
    plan = load_plan(SUITE, quick=True)
    sao, drift = arms(["sao"])[0], plan.drifts[0]
    w = _weights(tmp_path, "w", b"first build")
    run = {**run_settings(plan, sao, drift, 0), "init": w, "init_sha256": init_sha256(w)}
    path = run_path(tmp_path, sao, drift, 0)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(run))
    init_sha256.cache_clear()
    (Path(w) / "model.safetensors").write_bytes(b"second build")  # the same path and config, other weights
    assert finished_run(plan, sao, drift, 0, w, tmp_path) is None
    post = {"reward": [1.0], "success": [1.0], "n_gen": [3]}
    summary = {"learner_steps": 1, "trained": 1, "trajectories": 1}
    runs = [{"drift": "d", "seed": 0, "arm": a, "post_drift": post, "summary": summary, "init_sha256": sha}
            for a, sha in (("sao", "aa"), ("grpo", "bb"))]
    with pytest.raises(ValueError, match="2 different warm-start weights"):
        combine(plan, runs)
    assert warm_start_note(dataclasses.replace(plan, warm_start_sha256=init_sha256(w)), w) is None
    note = warm_start_note(dataclasses.replace(plan, warm_start_sha256="0" * 64), w)
    assert f"{w} has sha256 {init_sha256(w)[:12]}..., not" in note and "(000000000000...;" in note
    (Path(w) / "pretrain.json").write_text(json.dumps({"kernels": {"cpu": "AMD EPYC", "cpu_capability": "AVX512"}}))
    note = warm_start_note(dataclasses.replace(plan, warm_start_sha256="0" * 64), w)
    assert f"{init_sha256(w)[:12]}..., built on AMD EPYC (AVX512), not" in note
    init_sha256.cache_clear()


def _seed_runs(seed: int, sha: str = "aa") -> list[dict]:
    """Two arms on two drifts at one seed, rewards that differ by arm, drift and seed."""
    summary = {"learner_steps": 1, "trained": 4, "trajectories": 4}
    out = []
    for arm, base in (("sao", 0.5), ("grpo", 0.25)):
        for k, drift in enumerate(("d1", "d2")):
            r = [float((i + seed + k) % 2) * base * 2 for i in range(4)]
            out.append({"drift": drift, "seed": seed, "arm": arm, "init_sha256": sha, "summary": summary,
                        "post_drift": {"reward": r, "success": r, "n_gen": [2, 3, 2, 3]}})
    return out


def test_suites_run_on_disjoint_seeds_pool_to_the_suite_run_on_all(tmp_path):
    plan = dataclasses.replace(load_plan(SUITE, quick=True), window=2, arms=arms(["sao", "grpo"]))
    header = {"pilot": False, "lr": 4e-4}
    parts = [{**combine(plan, _seed_runs(0) + _seed_runs(1)), **header},
             {**combine(plan, _seed_runs(2)), **header, "git_commit": "abc1234"}]
    whole = combine(plan, _seed_runs(0) + _seed_runs(1) + _seed_runs(2))
    pooled_result = pool_results(parts, ["a.json", "b.json"])
    assert pooled_result["pooled"] == whole["pooled"] and pooled_result["per_drift_arm"] == whole["per_drift_arm"]
    assert pooled_result["git_commits"] == [None, "abc1234"] and pooled_result["init_sha256"] == "aa"
    assert pooled_result["pooled"][1]["seeds"] == 3
    with pytest.raises(ValueError, match="b.json: seed 0 is also in a.json"):
        pool_results([parts[0], parts[0]], ["a.json", "b.json"])
    with pytest.raises(ValueError, match=r"b.json: init_sha256 'bb' differs from a.json's 'aa'"):
        pool_results([parts[0], {**combine(plan, _seed_runs(2, "bb")), **header}], ["a.json", "b.json"])
    with pytest.raises(ValueError, match="b.json: lr 0.0002 differs"):
        pool_results([parts[0], {**parts[1], "lr": 2e-4}], ["a.json", "b.json"])
    fewer = {**parts[1], "runs": [r for r in parts[1]["runs"] if r["drift"] == "d1"]}
    with pytest.raises(ValueError, match="b.json: seed 2 ran other arms or drifts than a.json"):
        pool_results([parts[0], fewer], ["a.json", "b.json"])
    out = tmp_path / "pooled"
    for name, part in zip(("a.json", "b.json"), parts):
        (tmp_path / name).write_text(json.dumps(part))
    assert suite_main(["--suite", str(SUITE), "--pool", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                       "--out", str(out)]) == 0
    assert json.loads((out / "suite.json").read_text())["pooled"][1]["seeds"] == 3


def test_a_run_file_is_reused_only_with_every_setting_equal(tmp_path):
    path = tmp_path / "run.json"
    assert reusable_run(path, {"lr": 1e-4}) is None  # not written yet
    path.write_text(json.dumps({"settings": {"lr": 1e-4, "seed": 0}, "reward": [1.0]}))
    assert reusable_run(path, {"settings": {"lr": 1e-4, "seed": 0}})["reward"] == [1.0]
    assert reusable_run(path, {"settings": {"lr": 2e-4, "seed": 0}}) is None
    assert reusable_run(path, {"settings": {"lr": 1e-4}}) is None  # a setting the file has and the caller not
    filled = reusable_run(path, {"batch": 16}, fill=lambda run: {**run, "batch": 16})
    assert filled == {"settings": {"lr": 1e-4, "seed": 0}, "reward": [1.0]}  # the file as written, not the filled


def test_post_rollouts_rule_by_hand():
    per = [{"drift": "a", "arm": "sao", "km_median_samples_to_0.8": 1000},
           {"drift": "a", "arm": "grpo", "km_median_samples_to_0.8": 1500},  # 1.3 x 1500 = 1950 -> 4 x 512
           {"drift": "b", "arm": "sao", "km_median_samples_to_0.8": 300},
           {"drift": "b", "arm": "grpo", "km_median_samples_to_0.8": None}]  # censored median
    rule = post_rollouts_rule(per, pilot_post=4096)
    assert rule["a"]["post_rollouts"] == 2048 and not rule["a"]["flagged"]
    assert rule["b"]["post_rollouts"] == 4096 and rule["b"]["flagged"]
    assert load_plan(SUITE).pilot_post == 4096


def test_choose_lr_by_hand():
    def pilot(lr, sao, grpo):  # two (drift, seed) runs per arm
        return {"lr": lr, "runs": [{"arm": "sao", "auc_equal_rollouts": x} for x in sao]
                + [{"arm": "grpo", "auc_equal_rollouts": x} for x in grpo]}
    pilots = [pilot(1e-4, [0.5, 0.7], [0.4, 0.4]), pilot(2e-4, [0.6, 0.8], [0.3, 0.5]),
              pilot(4e-4, [0.9, 0.1], [0.2, 0.2])]
    choice = choose_lr(pilots)
    assert choice["sao"]["lr"] == 2e-4 and choice["sao"]["auc_equal_rollouts_by_lr"][2e-4] == pytest.approx(0.7)
    assert choice["grpo"]["lr"] == 1e-4  # 0.4 at 1e-4 and 2e-4: the tie goes to the smaller lr


@pytest.mark.slow
def test_admissibility_runs_the_frozen_arm_on_the_pilot_seeds(tiny_policy_dir, tmp_path):
    assert suite_main(["--suite", str(SUITE), "--init", str(tiny_policy_dir), "--quick", "--admissibility",
                       "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "admissibility.json").read_text())
    plan = load_plan(SUITE, quick=True)
    assert [(r["drift"], r["seed"]) for r in result["runs"]] == [("answer_format", s) for s in plan.pilot_seeds]
    (entry,) = result["per_drift"]
    assert entry["admissible"] == (0.05 <= entry["start_success"] <= 0.40)
    for seed in plan.pilot_seeds:  # frozen: one policy version throughout, `window` post-drift rollouts
        run_ = json.loads((tmp_path / "runs" / f"answer_format-frozen-s{seed}.json").read_text())
        assert run_["summary"]["learner_steps"] == 0 and len(run_["post_drift"]["success"]) == plan.window


@pytest.mark.slow
def test_quick_suite_writes_well_formed_outputs(tiny_policy_dir, tmp_path):
    assert suite_main(["--suite", str(SUITE), "--init", str(tiny_policy_dir), "--quick", "--jobs", "2",
                       "--out", str(tmp_path)]) == 0  # two worker processes
    combined = json.loads((tmp_path / "suite.json").read_text())
    assert combined["provisional"] and {r["arm"] for r in combined["runs"]} == {"sao", "grpo"}
    assert combined["machine"]["cpus"] == os.cpu_count() and combined["machine"]["cpu_capability"]  # walls' machine
    for arm in ("sao", "grpo"):
        run_ = json.loads((tmp_path / "runs" / f"answer_format-{arm}-s0.json").read_text())
        assert run_["summary"]["trajectories"] == 384  # 128 + 256 rollouts, groups of 8 included
        assert [p["phase"] for p in run_["by_phase"]] == [0, 1]
        assert run_["recoveries"] and run_["recoveries"][0]["family"] == "format"
        assert run_["steps"] and {"learner/ess_frac", "learner/clip_frac", "learner/kl_k3"} <= set(run_["steps"][-1])
        assert len(run_["post_drift"]["reward"]) == 256
    entry = next(e for e in combined["per_drift_arm"] if e["arm"] == "grpo")
    assert {"low", "high", "n"} <= set(entry["auc_equal_rollouts_minus_sao"])
    shown = suite_report(tmp_path / "suite.json")  # the report: figure and tables from suite.json and the run files
    table = (tmp_path / "suite.md").read_text()
    assert Path(shown["png"]).stat().st_size > 10_000 and "| answer_format | grpo |" in table
    medians = re.findall(r"\| ([^|]*censored\)) ", table)  # a censored median is "> phase", never a number
    assert len(medians) == 4 and all(re.fullmatch(r"> 256 \(1/1 censored\)|[\d,]+ \(0/1 censored\)", m)
                                     for m in medians)
    # a second invocation finds both runs written with the same settings and reuses them; a changed setting reruns
    files = sorted((tmp_path / "runs").glob("*.json"))
    stamps = [f.stat().st_mtime_ns for f in files]
    assert suite_main(["--suite", str(SUITE), "--init", str(tiny_policy_dir), "--quick", "--jobs", "2",
                       "--out", str(tmp_path)]) == 0
    assert [f.stat().st_mtime_ns for f in files] == stamps
    assert json.loads((tmp_path / "suite.json").read_text())["runs"] == combined["runs"]
    assert suite_main(["--suite", str(SUITE), "--init", str(tiny_policy_dir), "--quick", "--arms", "sao",
                       "--lr", "1e-4", "--out", str(tmp_path)]) == 0
    rerun = json.loads((tmp_path / "runs" / "answer_format-sao-s0.json").read_text())
    assert "optim.lr=0.0001" in rerun["learner_sets"] and rerun["sim"]["threads"] == 2


def test_suite_1_5_is_1_4_with_its_three_changes():
    old, new = load_plan(SUITE), load_plan(SUITE_1_5)
    assert (new.version, new.learner, new.shared_pre) == ("1.5", ("value.layers=2", "batch.micro_batch=64"), True)
    assert (old.learner, old.shared_pre) == ((), False)
    same = ["name", "drifts", "seeds", "pre", "post", "lr", "window", "harness", "warm_start", "pretrain_sets",
            "pilot_seeds", "warm_start_sha256"]
    assert [getattr(new, k) for k in same] == [getattr(old, k) for k in same]
    assert [a.name for a in new.arms] == [a.name for a in old.arms]
    sao, drift = arms(["sao"])[0], old.drifts[0]
    assert run_settings(new, sao, drift, 0)["learner_sets"][-2:] == ["value.layers=2", "batch.micro_batch=64"]
    assert run_settings(new, sao, drift, 0)["shared_pre_drift"] and "shared_pre_drift" not in run_settings(old, sao,
                                                                                                       drift, 0)


def test_an_extending_suite_sets_part_of_a_section_and_keeps_the_rest(tmp_path):
    assert lay_over({"a": {"x": 1, "y": {"p": 1, "q": 2}}, "l": [1, 2], "v": 1},
                    {"a": {"y": {"q": 3}}, "l": [3], "w": 2}) == \
        {"a": {"x": 1, "y": {"p": 1, "q": 3}}, "l": [3], "v": 1, "w": 2}
    (tmp_path / "base.yaml").write_text(SUITE.read_text())
    (tmp_path / "eta16.yaml").write_text("extends: base.yaml\nversion: x\nharness: {eta: 16}\n")
    base, child = load_plan(tmp_path / "base.yaml"), load_plan(tmp_path / "eta16.yaml")
    assert child.harness == {**base.harness, "eta": 16} and base.harness["eta"] == 4
    assert child.harness["latency"] == base.harness["latency"] and child.version == "x"


@pytest.mark.slow  # 23-25 s on 2 cores (60 s when the machine is busy): several simulated runs
def test_drifts_from_one_concept_share_their_pre_drift_runs(tiny_policy_dir, tmp_path):
    plan = load_plan(SUITE_1_5, quick=True)
    streams = {d["name"]: drift_stream(plan, d, 0, 1)[0] for d in plan.drifts}
    tasks = {k: [m for m in v if isinstance(m, Task)] for k, v in streams.items()}
    assert shared_tasks(list(streams.values())) == 128 == plan.pre  # the whole pre-drift phase
    assert tasks["tool_rename"][0].task_id == "tool.look/plain/0-0-0" and tasks["tool_args"][128].task_id == \
        "tool_args-0-128"  # post-drift tasks keep their drift's names (their own rollout seeds)
    one_block = ["--set", "value.layers=1"]  # the tiny policy has one block
    assert suite_main(["--suite", str(SUITE_1_5), "--init", str(tiny_policy_dir), "--quick", "--jobs", "2", *one_block,
                       "--out", str(tmp_path / "shared")]) == 0
    alone = dataclasses.replace(plan, shared_pre=False, learner_sets=("value.layers=1",))
    for arm in arms(["sao", "grpo"]):
        for drift in plan.drifts:
            shared = json.loads((tmp_path / "shared" / "runs" / f"{drift['name']}-{arm.name}-s0.json").read_text())
            assert shared["shared_pre_drift"] and shared["learner_sets"][-3:] == [*plan.learner, "value.layers=1"]
            stream = drift_stream(plan, drift, 0, arm.group_size)[0]  # the same stream, simulated alone
            res = simulate(sim_config(split_threads(plan, 2), arm, 0), str(tiny_policy_dir), stream,  # 1 thread each
                           run_settings(alone, arm, drift, 0)["learner_sets"], [], 20.0, log=lambda *_: None)
            assert shared["post_drift"]["reward"] == res.trajectories.query("phase == 1").sort_values(
                ["seq", "member"])["reward"].tolist()
            assert [s_["learner/policy_loss"] for s_ in shared["steps"]] == pytest.approx(
                res.steps["learner/policy_loss"].tolist(), abs=0, nan_ok=True)


@pytest.mark.slow
def test_offpolicy_quick_reaches_its_staleness_and_logs_ess(tiny_policy_dir, tmp_path):
    assert offpolicy_main(["--suite", str(SUITE), "--init", str(tiny_policy_dir), "--quick", "--families", "format",
                           "--jobs", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "quick.json").read_text())
    assert (tmp_path / "quick.png").stat().st_size > 10_000
    rows = {(r["arm"], r["eta"], r["updates"]): r for r in result["table"]}
    assert set(rows) == {(a, e, u) for a in ("sao", "grpo") for e, u in ((0, 1), (4, 2))}
    for (_, eta, _), r in rows.items():  # eta is reached, never passed; every policy step logs its ESS
        assert r["staleness_max"] <= eta and (eta == 0 or r["staleness_max"] >= 1)
        assert 0 < r["ess_frac_min"] <= r["ess_frac_median"] <= 1
    run_ = next(r for r in result["runs"] if r["arm"] == "sao" and r["eta"] == 4)
    assert 5 < len(run_["steps"]) <= 9 and all("learner/ess_frac" in s for s in run_["steps"])  # stale ones dropped
    files = sorted((tmp_path / "runs").glob("*.json"))
    assert len(files) == 4  # one file a run: a second invocation reuses them instead of running again
    stamps = [f.stat().st_mtime_ns for f in files]
    assert offpolicy_main(["--suite", str(SUITE), "--init", str(tiny_policy_dir), "--quick", "--families", "format",
                           "--jobs", "2", "--out", str(tmp_path)]) == 0  # the same threads a run: the same settings
    assert [f.stat().st_mtime_ns for f in files] == stamps
    assert json.loads((tmp_path / "quick.json").read_text())["table"] == result["table"]


@pytest.mark.slow
def test_sync_baselines_quick_writes_every_mode(tiny_policy_dir, tmp_path):
    assert sync_main(["--suite", str(SUITE), "--init", str(tiny_policy_dir), "--quick", "--drift", "answer_format",
                      "--jobs", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "sync_baselines.json").read_text())
    assert (tmp_path / "sync_baselines.png").stat().st_size > 10_000
    runs = {r["mode"]: r for r in result["runs"]}
    assert set(runs) == {"async", "sync", "sync_one_step", "sync_overprovision"}
    assert set(runs["sync"]["staleness_at_train"]) == {"0"} and runs["sync"]["eta"] == 0
    assert runs["sync_overprovision"]["dropped"].get("straggler dropped", 0) > 0
    for r in runs.values():  # 64 + 128 rollouts arriving at 24 per simulated second: the run outlasts the arrivals
        assert r["trajectories"] == 192 and r["sim_s"] >= 191 / 24 and r["trained"] <= 192
        assert r["trained_per_sim_s"] == pytest.approx(r["trained"] / r["sim_s"])
