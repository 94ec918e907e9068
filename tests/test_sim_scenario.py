"""Scenarios: shipped files load, validation names file/phase/field, determinism, drift schedules."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from simulator.drift import sigmoid_p
from simulator.generator import generate
from simulator.scenario import Phase, Scenario, ScenarioError, load_scenario, validate_scenario
from streamer.wire.schema import DriftEvent, Task, to_dict

GOOD = """
name: t
rate: 10
phases:
  - name: a
    duration_tasks: 50
    families: {arith: 1, string: 1}
    concepts: {arith: add10, string: reverse}
  - name: b
    schedule: gradual
    duration_tasks: 50
    width: 5
    concepts: {arith: sub10}
"""


def _tasks(stream):
    return [m for m in stream if isinstance(m, Task)]


def _write(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("name", ["default", "benchmark"])
def test_shipped_scenarios_load_and_cover_their_drifts(name):
    scn = load_scenario(name)
    events = [m for m in generate(scn, t0=0.0) if isinstance(m, DriftEvent)]
    assert [e.at_seq for e in events] == sorted(e.at_seq for e in events)
    schedules = {e.schedule for e in events}
    if name == "benchmark":
        assert schedules == {"abrupt", "gradual", "recurring", "incremental"}
        assert any(e.prev_concepts["tool"].split("/")[0] != e.concepts["tool"].split("/")[0] for e in events)
    else:
        assert len(events) == 3
    # the warm-start mixture gives every drift target some probability (drift recoverable by RL)
    for e in events:
        for fam, concept in e.concepts.items():
            if concept != e.prev_concepts.get(fam):
                seen = scn.warm_start.mixture[fam]
                if fam == "tool":  # a new world changes facts only: tool use (tool name, arguments) carries over
                    concept, seen = concept.rsplit("/", 1)[0], {c.rsplit("/", 1)[0]: w for c, w in seen.items()}
                assert seen.get(concept, 0) > 0, (e.name, fam, concept)


@pytest.mark.parametrize("patch, where", [
    (("width: 5", "width: 0"), "phase 1 ('b') field 'width'"),
    (("width: 5", "width: wide"), "phase 1 ('b') field 'width'"),
    (("concepts: {arith: sub10}", "concepts: {arith: pow10}"), "phase 1 ('b') field 'concepts.arith'"),
    (("concepts: {arith: sub10}", "concepts: {chess: e4}"), "phase 1 ('b') field 'concepts.chess'"),
    (("    width: 5", "    widht: 5"), "phase 1 ('b') field 'widht': unknown"),
    (("schedule: gradual", "schedule: sudden"), "phase 1 ('b') field 'schedule'"),
    (("duration_tasks: 50\n    width", "duration_s: 5\n    duration_tasks: 50\n    width"),
     "phase 1 ('b') field 'duration_tasks': set exactly one"),
    (("families: {arith: 1, string: 1}", "families: {arith: 1, string: 1, format: 1}"),
     "phase 0 ('a') field 'concepts': no concept given yet for families ['format']"),
    (("rate: 10", "rate: 0\nphases_x: 1"), "unknown field 'phases_x'"),
])
def test_validation_errors_name_file_phase_and_field(tmp_path, patch, where):
    path = _write(tmp_path, GOOD.replace(*patch))
    with pytest.raises(ScenarioError) as e:
        load_scenario(path)
    assert str(path) in str(e.value) and where in str(e.value), str(e.value)


def test_duration_in_seconds_needs_a_rate(tmp_path):
    text = GOOD.replace("rate: 10", "rate: 0").replace("duration_tasks: 50\n    families",
                                                       "duration_s: 5\n    families")
    with pytest.raises(ScenarioError, match=r"phase 0 \('a'\) field 'duration_s': needs the scenario's rate"):
        load_scenario(_write(tmp_path, text))


def test_same_seed_same_stream_other_seed_other_stream(tmp_path):
    scn = load_scenario(_write(tmp_path, GOOD))
    a, b = list(generate(scn, seed=3, t0=0.0)), list(generate(scn, seed=3, t0=0.0))
    assert [to_dict(m) for m in a] == [to_dict(m) for m in b]
    c = _tasks(generate(scn, seed=4, t0=0.0))
    assert [t.prompt for t in _tasks(a)] != [t.prompt for t in c]


def test_same_seed_in_another_process(tmp_path):
    """Env and verifier state must rebuild from the Task alone: another process gives the same tasks."""
    out = tmp_path / "o.jsonl"
    path = _write(tmp_path, GOOD.replace("arith: 1, string: 1", "arith: 1, string: 1, tool: 1").replace(
        "string: reverse}", "string: reverse, tool: find/key/3}"))
    subprocess.run([sys.executable, "-m", "streamer.launch.cli", "simulate", "--scenario", str(path), "--out", str(out),
                    "--seed", "9"], check=True, capture_output=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    here = list(generate(load_scenario(path), seed=9, t0=0.0))
    assert len(rows) == len(here) and any(r.get("family") == "tool" for r in rows)
    for row, msg in zip(rows, here):
        mine = to_dict(msg)
        for key in ("task_id", "prompt", "answer", "spec", "concept", "concepts"):
            assert row.get(key) == mine.get(key)


def _phase_scenario(phase: Phase, duration: int = 20) -> Scenario:
    first = Phase(name="a", duration_tasks=duration, families={"format": 1.0}, concepts={"format": "brackets"})
    scn = Scenario(name="g", phases=[first, phase])
    validate_scenario(scn)
    return scn


def test_gradual_mixing_follows_the_sigmoid():
    n, width, center = 8000, 400.0, 4000.0
    scn = _phase_scenario(Phase(name="b", schedule="gradual", duration_tasks=n, width=width, center=center,
                                concepts={"format": "parens"}))
    new = [t.concept == "parens" for t in _tasks(generate(scn, seed=1, t0=0.0)) if t.phase == 1]
    assert len(new) == n
    window = 500
    for start in range(0, n, window):
        # expected share: the sigmoid averaged over the window's positions
        p = sum(sigmoid_p(x, center, width) for x in range(start, start + window)) / window
        observed = sum(new[start:start + window]) / window
        sd = math.sqrt(max(p * (1 - p), 1e-4) / window)
        assert abs(observed - p) <= 4 * sd + 0.002, (start, observed, p)
    assert sigmoid_p(center, center, width) == 0.5


def test_recurring_alternates_blocks_and_emits_events():
    scn = _phase_scenario(Phase(name="r", schedule="recurring", duration_tasks=100, period=25,
                                concepts={"format": "parens"}))
    stream = list(generate(scn, seed=0, t0=0.0))
    tasks = [t for t in _tasks(stream) if t.phase == 1]
    blocks = [{t.concept for t in tasks[i:i + 25]} for i in range(0, 100, 25)]
    assert blocks == [{"parens"}, {"brackets"}, {"parens"}, {"brackets"}]
    events = [m for m in stream if isinstance(m, DriftEvent)]
    assert [(e.name, e.at_seq, e.concepts["format"]) for e in events] == [
        ("r", 20, "parens"), ("r#1", 45, "brackets"), ("r#2", 70, "parens"), ("r#3", 95, "brackets")]


def test_incremental_steps_through_the_list():
    scn = _phase_scenario(Phase(name="i", schedule="incremental", duration_tasks=90,
                                concepts={"format": ["parens", "braces", "bars"]}))
    tasks = [t for t in _tasks(generate(scn, seed=0, t0=0.0)) if t.phase == 1]
    assert [t.concept for t in tasks] == ["parens"] * 30 + ["braces"] * 30 + ["bars"] * 30


def test_timestamps_follow_the_rate():
    scn = load_scenario("default")
    tasks = _tasks(generate(scn, seed=0, t0=100.0, limit=2000))
    gaps = [b.created_at - a.created_at for a, b in zip(tasks, tasks[1:])]
    # poisson arrivals at 20/s: mean gap 0.05 s; the mean of 1999 gaps has sd 0.05/sqrt(1999) ~ 0.0011
    assert min(gaps) > 0 and abs(sum(gaps) / len(gaps) - 0.05) < 0.005
    assert tasks[0].created_at > 100.0
