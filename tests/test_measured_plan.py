"""The measured resource plan (streamer/launch/resources.py, streamer/launch/plan_measure.py): the choice on
hand-computed timings, a real measurement of a toy model (learner step and generation) and its cache, `sao up`'s
config filled from it, and the fixed rule kept without --model or with agents given."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from learner.config import LearnerConfig
from learner.models.toy import build_toy_model
from streamer.launch.plan_measure import measure
from streamer.launch.resources import Timings, choose_plan, plan_resources, seconds_on, version_seconds
from streamer.launch.run_config import load_run_config
from streamer.launch.up import parse_args

# learner 10 s per version on 1 thread, 5.5 s on 2 (serial fraction 2 * 5.5 / 10 - 1 = 0.1); one agent generating
# the batch: 2 s on 1 thread, 1 s on 2 (no serial part)
T = Timings(learner_s=(10.0, 5.5), agents_s=(2.0, 1.0))


def test_amdahl_through_the_one_and_two_thread_times():
    assert seconds_on(10.0, 5.5, 4) == pytest.approx(10 * (0.1 + 0.9 / 4))  # 3.25
    assert seconds_on(2.0, 1.0, 3) == pytest.approx(2 / 3)
    assert seconds_on(4.0, 5.0, 2) == 4.0  # slower on 2 threads (a noisy machine): serial, clamped


def test_two_cores_go_to_the_learner_when_it_is_the_bottleneck():
    # rule (learner 1, 1 agent x 1): max(10, 2, (10 + 2) / 2) = 10 s per version
    assert version_seconds(T, 2, 1, 1, 1, staleness=2) == pytest.approx(10.0)
    # learner 2, agent 1 x 1: the agent's core is shared: max(5.5, 2, (5.5 * 2 + 2 * 1) / 2 = 6.5) = 6.5 s;
    # learner 2, 2 agents x 1 ties at 6.5 s with one more thread: the fewest threads win
    plan, secs = choose_plan(2, T, staleness=2)
    assert (plan.learner_threads, plan.agents, plan.agent_threads, secs) == (2, 1, 1, pytest.approx(6.5))
    assert plan.eval is False and plan.cores == 2


def test_four_cores_split_by_the_estimate():
    t = Timings(learner_s=(10.0, 5.5), agents_s=(8.0, 4.0))
    # learner 3 threads: 10 * (0.1 + 0.9 / 3) = 4 s; agents 1 x 2 threads: 4 s; core-seconds (4 * 3 + 4 * 2) / 4 = 5
    # 2 agents x 1 thread also give 5 s with as many threads (5): fewer agents win; learner 4: 3.25 s but
    # (3.25 * 4 + 4 * 2) / 4 = 5.25; rule (2, 2 x 1): max(5.5, 4, (11 + 8) / 4) = 5.5
    plan, secs = choose_plan(4, t, staleness=2)
    assert (plan.learner_threads, plan.agents, plan.agent_threads, secs) == (3, 1, 2, pytest.approx(5.0))
    rule = plan_resources(4)
    assert version_seconds(t, 4, rule.learner_threads, rule.agents, rule.agent_threads, 2) == pytest.approx(5.5)


def test_synchronous_runs_add_the_two_sides():
    # staleness 0: learner and agents alternate, each may use every core: 5.5 + 1 (2 threads or 2 agents x 1 tie at
    # 4 threads; fewer agents win); learner 2 + one agent of 1 thread: 5.5 + 2 = 7.5
    plan, secs = choose_plan(2, T, staleness=0)
    assert (plan.learner_threads, plan.agents, plan.agent_threads, secs) == (2, 1, 2, pytest.approx(6.5))


def test_bad_timings_are_refused():
    with pytest.raises(Exception, match="finite and > 0"):
        choose_plan(2, Timings((0.0, 1.0), (1.0, 1.0)), staleness=2)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    return build_toy_model("qwen3", ["one plus two is three", "four minus one is three"] * 20,
                           tmp_path_factory.mktemp("toy") / "model", vocab_size=300)


def test_a_toy_model_measured_for_real_and_the_cache_reused(toy, tmp_path):
    t, path, cached = measure(toy, LearnerConfig(), "torch", batch=4, new_tokens=4, cores=2, cache_dir=tmp_path)
    figures = [*t.learner_s, *t.agents_s]
    assert not cached and path.is_file() and all(math.isfinite(x) and x > 0 for x in figures)
    written = path.read_text()
    again, path2, cached2 = measure(toy, LearnerConfig(), "torch", batch=4, new_tokens=4, cores=2, cache_dir=tmp_path)
    assert cached2 and path2 == path and again == t and path.read_text() == written
    _, other, cached3 = measure(toy, LearnerConfig(), "torch", batch=4, new_tokens=4, cores=3, cache_dir=tmp_path)
    assert other != path and not cached3  # per cores (and batch shape, model, learner settings)


def test_sao_up_with_a_model_takes_the_measured_plan(toy, tmp_path, capsys):
    launch = {"model": str(toy), "runs_dir": str(tmp_path), "run": "m", "cores": 2, "batch": 4}
    cfg = load_run_config(None, ["agent.max_new_tokens=4"], launch, measure=True)
    out = capsys.readouterr().out
    assert "resource timings (measured:" in out and "measured plan: learner" in out
    saved = json.loads((tmp_path / "m" / "resource_plan.json").read_text())
    up, plan = cfg.launch, cfg.launch.plan()
    chosen = saved["chosen"]
    assert (plan.learner_threads, plan.agents, plan.agent_threads) == (
        chosen["learner_threads"], chosen["agents"], chosen["agent_threads"])
    assert (up.learner_threads, up.agents, up.agent_threads) == (plan.learner_threads, plan.agents, plan.agent_threads)
    assert cfg.learner.threads == plan.learner_threads and cfg.agent.threads == plan.agent_threads
    assert cfg.agent.tasks_per_version == math.ceil(4 / plan.agents)  # admission derived again from the plan
    assert saved["fixed_rule"]["learner_threads"] == 1 and saved["timings"]["learner_s"][0] > 0
    load_run_config(None, ["agent.max_new_tokens=4"], {**launch, "run": "m2"}, measure=True)
    assert "resource timings (cached:" in capsys.readouterr().out


def test_the_fixed_rule_without_a_model_or_with_agents_given(toy, tmp_path):
    cfg = parse_args(["--run", "r", "--cores", "2", "--runs-dir", str(tmp_path)])  # `make up`: no measurement
    assert cfg.launch.plan() == plan_resources(2) and (cfg.launch.learner_threads, cfg.launch.agent_threads) == (0, 0)
    assert cfg.learner.threads == 1 and cfg.agent.threads == 1
    cfg = load_run_config(None, [], {"model": str(toy), "runs_dir": str(tmp_path), "run": "a", "cores": 2,
                                     "agents": 1}, measure=True)
    assert cfg.launch.plan() == plan_resources(2, agents=1)
    assert not (tmp_path / "a" / "resource_plan.json").exists() and not list(tmp_path.glob("cache/resource-*"))
    fixed = load_run_config(None, ["launch.learner_threads=2"], {"cores": 2})
    assert (fixed.learner.threads, fixed.launch.plan().agents, fixed.agent.threads) == (2, 1, 1)
