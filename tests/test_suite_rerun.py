"""bench/suite_rerun.py: a suite invocation against earlier run files, on hand-made run folders."""

from __future__ import annotations

import json

import pytest

from bench.suite_rerun import compare_runs, main


def write_run(folder, name, arm, wall, reward, steps=0):
    run = {"arm": arm, "seed": int(name[-6]), "summary": {"wall_s": wall, "learner_steps": steps},
           "steps": [{"step": 1}], "by_phase": [],
           "recoveries": [], "post_drift": {"reward": [reward]}}
    (folder / "runs").mkdir(parents=True, exist_ok=True)
    (folder / "runs" / name).write_text(json.dumps(run))


def test_runs_compared_by_result_and_timed_by_kind_of_arm(tmp_path):
    new, old = tmp_path / "new", tmp_path / "old"
    write_run(new, "a-sao-s0.json", "sao", 9.0, 0.5)
    write_run(old, "a-sao-s0.json", "sao", 10.0, 0.5)
    write_run(new, "a-ppo-s0.json", "ppo", 3.0, 0.25)
    write_run(old, "a-ppo-s0.json", "ppo", 2.0, 0.75)  # another result: listed as unequal
    write_run(new, "a-grpo-s0.json", "grpo", 4.0, 0.5)
    write_run(old, "a-grpo-s0.json", "grpo", 5.0, 0.5)
    write_run(new, "b-frozen-s0.json", "frozen", 1.0, 0.0)  # no earlier run of that name
    got = compare_runs(new, [old])
    assert (got["runs"], got["equal_to_ref_runs"], got["unequal"], got["without_ref"]) == (
        4, 2, ["a-ppo-s0.json"], ["b-frozen-s0.json"])
    assert got["sao_like"] == {"runs": 2, "run_wall_s_new": 12.0, "run_wall_s_old": 12.0, "ratio": 1.0}
    assert got["group"] == {"runs": 1, "run_wall_s_new": 4.0, "run_wall_s_old": 5.0, "ratio": 0.8}
    assert got["seed 0"] == {"runs": 3, "run_wall_s_new": 16.0, "run_wall_s_old": 17.0, "ratio": round(16 / 17, 4)}
    assert "frozen" not in got


def test_exit_status_says_whether_everything_reproduced(tmp_path):
    new, old = tmp_path / "new", tmp_path / "old"
    write_run(new, "a-sao-s0.json", "sao", 9.0, 0.5)
    write_run(old, "a-sao-s0.json", "sao", 10.0, 0.5)
    suite = {"wall_s": 9.5, "git_commit": "abc", "runs": [1], "per_drift_arm": [2], "pooled": [3]}
    (new / "suite.json").write_text(json.dumps(suite))
    (tmp_path / "ref.json").write_text(json.dumps(suite))
    argv = [str(new), "--ref", str(old), "--pooled", str(tmp_path / "ref.json"), "--out", str(tmp_path / "o.json")]
    assert main(argv) == 0
    assert json.loads((tmp_path / "o.json").read_text())["pooled_equal"] == {"runs": True, "per_drift_arm": True,
                                                                             "pooled": True}
    (tmp_path / "ref.json").write_text(json.dumps({**suite, "pooled": [4]}))
    assert main(argv) == 1


def test_without_ref_the_walls_alone_by_kind_and_seed(tmp_path):
    new = tmp_path / "new"
    write_run(new, "a-sao-s0.json", "sao", 9.0, 0.5, steps=10)
    write_run(new, "b-sao-s1.json", "sao", 11.5, 0.5, steps=12)
    write_run(new, "a-grpo-s1.json", "grpo", 4.0, 0.5, steps=3)
    write_run(new, "a-frozen-s0.json", "frozen", 1.0, 0.0)
    (new / "pilot.json").write_text(json.dumps({"wall_s": 13.0, "git_commit": "abc"}))  # a pilot's folder
    assert main([str(new), "--out", str(tmp_path / "w.json")]) == 0
    got = json.loads((tmp_path / "w.json").read_text())
    assert got["runs"] == 4 and got["wall_s"] == 13.0 and got["ref"] == []
    assert got["sao_like"] == {"runs": 2, "run_wall_s": 20.5, "learner_steps": 22}
    assert got["group"] == {"runs": 1, "run_wall_s": 4.0, "learner_steps": 3}
    assert got["frozen"] == {"runs": 1, "run_wall_s": 1.0, "learner_steps": 0}
    assert got["seed 0"] == {"runs": 2, "run_wall_s": 10.0, "learner_steps": 10}
    assert got["seed 1"] == {"runs": 2, "run_wall_s": 15.5, "learner_steps": 15}
    (new / "pilot.json").unlink()
    with pytest.raises(SystemExit, match="no suite.json or pilot.json"):
        main([str(new), "--out", str(tmp_path / "w.json")])
