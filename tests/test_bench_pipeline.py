"""bench/pipeline.py's figures on a hand-made run directory (no pipeline runs here; tests/test_bench_smoke.py
runs its --quick mode)."""

from __future__ import annotations

import json

import pytest

from bench import pipeline as bp
from streamer.runs import artifacts as art
from streamer.wire.schema import LearnerEvent, Trajectory


def traj(i: int, t: float) -> Trajectory:
    return Trajectory(traj_id=f"t{i}", task_id=f"k{i}", family="arith", concept="add", phase=0, prompt_len=2,
                      tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -0.5, -0.5], reward=1.0,
                      success=True, policy_version=0, agent_id="a0", created_at=t - 0.5, finished_at=t)


def make_run(run):
    w = art.RunWriter(run, config={"up": {"learner": []}}, flush_seconds=1e9, writer_id="tap")
    for i in range(10):
        w.trajectory(traj(i, float(i)))
    # (step, critic-only, skipped, perf/step_s, updates applied, trajectories trained); 1,000 tokens a step
    steps = [(1, 1.0, False, 0.5, 1, [0, 1]), (2, 0.0, False, 10.0, 1, [2, 3]), (3, 0.0, False, 1.0, 2, [4, 5]),
             (4, 0.0, True, 1.0, 0, [6]), (5, 0.0, False, 1.0, 1, [7])]
    for step, warm, skipped, step_s, updates, tasks in steps:
        w.learner_event(LearnerEvent(step=step, version=step, time=10.0 + step, n_trajectories=len(tasks),
                                     n_tokens=1000, task_ids=[f"k{i}" for i in tasks], skipped=skipped,
                                     metrics={"learner/value_warmup": warm, "perf/step_s": step_s,
                                              "perf/idle_s": 0.5, "learner/updates_applied": float(updates)}))
    w.close()


def test_figures_of_a_hand_made_run(tmp_path):
    make_run(tmp_path)
    r = bp.run_figures(tmp_path, isolated_tps=2000.0, fixed_batch_tps=3000.0)
    f, p = r["figures"], r["pipeline"]
    # counted: steps 3 (2 updates) and 5; not 1 (critic-only, first), 2 (first policy step), 4 (skipped):
    # (1000 x 2 + 1000) tokens / (1 + 1) s = 1500 tokens/s, 0.75 of 2000
    assert p["learner_tokens_per_s"] == pytest.approx(1500.0) and p["steps_counted"] == 2
    assert f["tokens_per_s_ratio"] == pytest.approx(0.75) and f["tokens_per_s_ratio_fixed_batch"] == pytest.approx(0.5)
    # trained: 2 + 2 + 2 + 1 of applied steps (step 4 skipped) = 7 of 10; the filled rows agree
    assert f["trained_fraction"] == pytest.approx(0.7) and p["trajectories_trained"] == 7
    assert p["trained_rows_fraction"] == pytest.approx(0.7)
    assert f["learner_steps_per_1000_trajectories"] == pytest.approx(500.0)
    assert f["policy_steps_per_1000_trajectories"] == pytest.approx(300.0)  # steps 2, 3, 5
    assert f["learner_busy_share"] == pytest.approx(art.summarize(tmp_path)["learner_busy_share"])
    goals = bp.goals(f)
    assert goals["tokens_per_s_ratio"]["met"] and not goals["trained_fraction"]["met"]
    assert len(r["series"]["t"]) == 5 and r["series"]["trained"][-1] == 7
    result = {**r, "goals": goals, "mode": "quick", "seconds": 1.0, "machine": {"cpus": 2},
              "isolated": {"tokens_per_s": 2000.0, "threads": 1}}
    assert bp.plot(result, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_thread_count_of_the_pipelines_learner(tmp_path):
    def with_config(cfg):
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        return tmp_path

    (tmp_path / "config.yaml").write_text("learner:\n  threads: 3\n  optim: {lr: 1.0}\n")
    assert bp.pipeline_threads(with_config({"up": {}, "plan": {"learner_threads": 1}}), "") == (
        3, "config.yaml: learner.threads")
    (tmp_path / "config.yaml").unlink()
    assert bp.pipeline_threads(with_config({"up": {}, "plan": {"learner_threads": 1}}), "")[0] == 1
    line = "resource plan for 2 cores: learner 2 thread(s), 1 agent(s) x 1 thread(s)"
    assert bp.pipeline_threads(with_config({"up": {}}), line + "\n") == (2, "sao up output: " + line)
    assert bp.pipeline_threads(with_config({"up": {}}), "run x: 2 agents, loss sao") == (None, "unknown")
