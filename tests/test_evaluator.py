"""`sao eval`: the held-out set (pure), and the evaluator as a real process against the embedded broker."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kafka_fixtures import TINY

from simulator.scenario import load_scenario
from streamer.agent.evaluator import held_out_set, scenario_concepts
from streamer.transport.weights import WeightStore, announce
from streamer.wire.schema import MetricPoint
from streamer.wire.topics import Topics, partitions_by_topic

# Two families, three phases: arith drifts add7 -> sub7 (gradual), string reverse -> sort -> reverse
# (recurring), format is never in phase 0's mix but comes in with phase 1; incremental lists each step.
SCENARIO = """
name: small
seed: 0
options:
  arith: {max_operand: 6}
phases:
  - name: start
    duration_tasks: 50
    families: {arith: 1, string: 1}
    concepts: {arith: add7, string: reverse}
  - name: drift
    schedule: gradual
    width: 5
    duration_tasks: 50
    families: {arith: 1, string: 1, format: 1}
    concepts: {arith: sub7, format: parens}
  - name: steps
    schedule: incremental
    duration_tasks: 50
    concepts: {string: [sort, rotl]}
"""
PAIRS = [("arith", "add7"), ("arith", "sub7"), ("format", "parens"), ("string", "reverse"), ("string", "rotl"),
         ("string", "sort")]


@pytest.fixture
def small_scenario(tmp_path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SCENARIO)
    return path


def test_held_out_set_spans_every_concept_and_is_deterministic(small_scenario):
    scn = load_scenario(small_scenario)
    assert scenario_concepts(scn) == PAIRS  # incremental steps included, sorted, no duplicates
    a, b = held_out_set(scn, 5), held_out_set(load_scenario(small_scenario), 5)
    assert list(a) == PAIRS
    for pair, tasks in a.items():
        assert len(tasks) == 5
        assert {(t.family, t.concept) for t in tasks} == {pair}
        assert [(t.task_id, t.prompt, t.answer) for t in tasks] == [(t.task_id, t.prompt, t.answer) for t in b[pair]]
        assert len({t.task_id for t in tasks}) == 5
    # a different seed draws a different set; the training stream's own seed plays no part
    c = held_out_set(scn, 5, seed=1)
    assert [t.prompt for t in c[("string", "reverse")]] != [t.prompt for t in a[("string", "reverse")]]
    # tags off: the prompt does not name the concept (as drifted streams show it)
    assert not any("sort" in t.prompt for t in a[("string", "sort")])
    with pytest.raises(ValueError, match="tasks-per-concept"):
        held_out_set(scn, 0)


def test_evaluator_skips_intermediate_versions_and_waits_out_the_interval(tiny_policy_dir, small_scenario, tmp_path):
    """In-process on the in-memory bus: the newest announced version only, and not before --min-interval."""
    from learner.models import ModelConfig, build_policy
    from streamer.agent.agent import load_engine
    from streamer.agent.evaluator import Evaluator, parse_args, settings_from_args
    from streamer.transport.memory_bus import MemoryBus
    from streamer.transport.weights import PolicyFollower
    from streamer.wire.schema import PolicyVersion

    run = "evalunit"
    s = settings_from_args(parse_args(["--run", run, "--model", str(tiny_policy_dir), "--max-new-tokens", "2",
                                       "--weights-dir", str(tmp_path / "w")]))
    assert s.temperature == 0.0 and s.group_size == 1  # greedy, one rollout per task
    bus = MemoryBus()
    bus.create_topics(partitions_by_topic(run))
    store = WeightStore(s.weights_dir)
    engine, tok = load_engine(s, store)
    tasks = held_out_set(load_scenario(small_scenario), 1)
    follower = PolicyFollower(bus.consumer({Topics(run).policy: PolicyVersion}), store)
    ev = Evaluator(engine, tok, tasks, s, follower, bus.producer(), min_interval_s=3600)
    s.poll_timeout_s = 0.0
    assert ev.evaluate_current()
    sd = build_policy(ModelConfig(**TINY), seed=1).state_dict()
    for version, step in ((1, 5), (2, 9), (3, 12)):
        announce(bus.producer(), run, store.publish(sd, version, step, side_files_from=tiny_policy_dir))
        if version == 1:
            assert not ev.step_once()  # announced, but within the interval of the last evaluation
    ev.min_interval_s = 0.0
    assert ev.step_once() and not ev.step_once()  # v3 straight away; nothing newer after it
    assert ev.stats.versions == [0, 3] and engine.version == 3
    pts = [p.msg for p in bus.consumer({Topics(run).metrics: MetricPoint}).poll(1000, 0)]
    assert [p.learner_step for p in pts] == [0] * len(PAIRS) + [12] * len(PAIRS)
    assert {(p.labels["family"], p.labels["concept"]) for p in pts[len(PAIRS):]} == set(PAIRS)
    assert all(p.count == 1 and 0.0 <= p.value <= 1.0 for p in pts)


def _read_points(cons, into: list[MetricPoint]) -> list[MetricPoint]:
    into += [p.msg for p in cons.poll(500, 0.2) if p.msg.name == "eval/reward"]
    return into


def _wait_for_step(cons, points, step: int, proc, log: Path, timeout: float) -> list[MetricPoint]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        at = [p for p in _read_points(cons, points) if p.learner_step == step]
        if {(p.labels["family"], p.labels["concept"]) for p in at} >= set(PAIRS):
            return at
        if proc.poll() is not None:
            break
    raise AssertionError(f"no eval/reward for every pair at step {step} within {timeout} s "
                         f"(exit {proc.poll()}):\n{log.read_text()[-3000:]}")


@pytest.mark.kafka
def test_evaluator_publishes_per_concept_rewards_for_each_version(kafka_bus, kafka_run, tiny_policy_dir,
                                                                  small_scenario, tmp_path):
    from learner.models import ModelConfig, build_policy

    k = 3
    t = Topics(kafka_run)
    kafka_bus.create_topics(partitions_by_topic(kafka_run))
    cons = kafka_bus.consumer({t.metrics: MetricPoint})
    store = WeightStore(tmp_path / "weights")
    log = tmp_path / "eval.log"
    cmd = [sys.executable, "-c", "import sys; from streamer.agent.evaluator import main; sys.exit(main(sys.argv[1:]))",
           "--bootstrap", kafka_bus.bootstrap, "--run", kafka_run, "--scenario", str(small_scenario),
           "--model", str(tiny_policy_dir), "--weights-dir", str(store.root), "--tasks-per-concept", str(k),
           "--min-interval", "0", "--max-new-tokens", "4", "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        points: list[MetricPoint] = []
        first = _wait_for_step(cons, points, 0, proc, log, 30)
        # a new version, trained to "step 7", published and announced like the learner does
        pv = store.publish(build_policy(ModelConfig(**TINY), seed=1).state_dict(), version=1, step=7,
                           side_files_from=tiny_policy_dir)
        announce(kafka_bus.producer(), kafka_run, pv)
        later = _wait_for_step(cons, points, 7, proc, log, 30)
        for p in first + later:
            assert 0.0 <= p.value <= 1.0 and p.count == k
        assert min(p.time for p in later) > max(p.time for p in first)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()[-2000:]
        assert "eval: 2 evaluations (versions [0, 1])" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cons.close()
