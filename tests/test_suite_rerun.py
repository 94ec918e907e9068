"""experiments/suite_rerun.py: a suite invocation against earlier run files, on hand-made run folders."""

from __future__ import annotations

import json

import pytest

from experiments.suite_rerun import compare_runs, main, seeds_label


def write_run(folder, name, arm, wall, reward, steps=0, sections=None):
    sections = {k: {"wall_s": v, "cpu_s": v} for k, v in (sections or {}).items()}
    run = {"arm": arm, "seed": int(name[-6]), "summary": {"wall_s": wall, "learner_steps": steps, "sections": sections},
           "steps": [{"step": 1}], "by_phase": [],
           "recoveries": [], "post_drift": {"reward": [reward]}}
    (folder / "runs").mkdir(parents=True, exist_ok=True)
    (folder / "runs" / name).write_text(json.dumps(run))


def test_runs_compared_by_result_and_timed_by_kind_of_arm(tmp_path):
    new, old = tmp_path / "new", tmp_path / "old"
    write_run(new, "a-sao-s0.json", "sao", 9.0, 0.5, 7, {"generate": 3.0, "train": 6.0})
    write_run(old, "a-sao-s0.json", "sao", 10.0, 0.5, 7, {"generate": 2.0, "train": 8.0})
    write_run(new, "a-ppo-s0.json", "ppo", 3.0, 0.25, 2, {"generate": 1.0, "train": 2.0})
    write_run(old, "a-ppo-s0.json", "ppo", 2.0, 0.75, 3, {"generate": 1.0, "train": 1.0})  # another result: unequal
    write_run(new, "a-grpo-s0.json", "grpo", 4.0, 0.5)
    write_run(old, "a-grpo-s0.json", "grpo", 5.0, 0.5)
    write_run(new, "b-frozen-s0.json", "frozen", 1.0, 0.0)  # no earlier run of that name
    got = compare_runs(new, [old])
    assert (got["runs"], got["equal_to_ref_runs"], got["unequal"], got["without_ref"]) == (
        4, 2, ["a-ppo-s0.json"], ["b-frozen-s0.json"])
    # sections summed over sao and ppo: generate 4 against 3, train 8 against 9
    assert got["sao_like"] == {"runs": 2, "run_wall_s_new": 12.0, "run_wall_s_old": 12.0, "ratio": 1.0,
                               "learner_steps_new": 9, "learner_steps_old": 10,
                               "section_ratio": {"generate": round(4 / 3, 4), "train": round(8 / 9, 4)}}
    assert got["group"] == {"runs": 1, "run_wall_s_new": 4.0, "run_wall_s_old": 5.0, "ratio": 0.8,
                            "learner_steps_new": 0, "learner_steps_old": 0, "section_ratio": {}}
    assert got["seed 0"]["run_wall_s_new"] == 16.0 and got["seed 0"]["ratio"] == round(16 / 17, 4)
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
    write_run(new, "a-sao-s0.json", "sao", 9.0, 0.5, steps=10, sections={"generate": 3.0, "train": 5.5})
    write_run(new, "b-sao-s1.json", "sao", 11.5, 0.5, steps=12, sections={"generate": 4.25, "train": 7.0})
    write_run(new, "a-grpo-s1.json", "grpo", 4.0, 0.5, steps=3, sections={"generate": 1.0, "train": 2.5})
    write_run(new, "a-frozen-s0.json", "frozen", 1.0, 0.0, sections={"generate": 0.75})
    (new / "pilot.json").write_text(json.dumps({"wall_s": 13.0, "git_commit": "abc"}))  # a pilot's folder
    assert main([str(new), "--out", str(tmp_path / "w.json")]) == 0
    got = json.loads((tmp_path / "w.json").read_text())
    assert got["runs"] == 4 and got["wall_s"] == 13.0 and got["ref"] == []
    assert got["sao_like"] == {"runs": 2, "run_wall_s": 20.5, "learner_steps": 22,
                               "section_wall_s": {"generate": 7.2, "train": 12.5}}  # 7.25 rounded to even
    assert got["group"] == {"runs": 1, "run_wall_s": 4.0, "learner_steps": 3,
                            "section_wall_s": {"generate": 1.0, "train": 2.5}}
    assert got["frozen"] == {"runs": 1, "run_wall_s": 1.0, "learner_steps": 0, "section_wall_s": {"generate": 0.8}}
    assert got["seed 0"] == {"runs": 2, "run_wall_s": 10.0, "learner_steps": 10,
                             "section_wall_s": {"generate": 3.8, "train": 5.5}}  # 3.75
    assert got["seed 1"] == {"runs": 2, "run_wall_s": 15.5, "learner_steps": 15,
                             "section_wall_s": {"generate": 5.2, "train": 9.5}}  # 5.25 to even
    (new / "pilot.json").unlink()
    with pytest.raises(SystemExit, match="no suite.json or pilot.json"):
        main([str(new), "--out", str(tmp_path / "w.json")])


def write_walls(path, wall, seeds, kinds, commit="abc"):
    """A walls file as suite_rerun.py writes it without --ref: `seeds` {seed: (runs, wall, steps)}, `kinds` the same."""
    walls = {"runs": sum(r for r, _, _ in seeds.values()), "wall_s": wall, "git_commit": commit, "ref": []}
    for key, (runs, w, steps) in [*((f"seed {s}", v) for s, v in seeds.items()), *kinds.items()]:
        walls[key] = {"runs": runs, "run_wall_s": w, "learner_steps": steps,
                      "section_wall_s": {"generate": w / 4, "train": w / 2}}
    path.write_text(json.dumps(walls))
    return path


def test_walls_of_parts_on_disjoint_seeds_sum_to_the_whole_run(tmp_path):
    a = write_walls(tmp_path / "walls-seed-0.json", 1000.5, {0: (3, 1900.0, 50)},
                    {"sao_like": (2, 1500.0, 50), "frozen": (1, 400.0, 0)}, commit="c0")
    b = write_walls(tmp_path / "walls-seeds-1-2.json", 6500.0, {1: (3, 2000.25, 40), 2: (3, 2100.0, 45)},
                    {"sao_like": (4, 3300.0, 60), "group": (2, 800.25, 25)}, commit="c1")
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps({"wall_s": 10000.0, "run_wall_s": 12000.0}))
    out = tmp_path / "walls.json"
    assert main(["--combine", str(a), str(b), "--against", str(prev), "--what", "two parts", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["parts"] == {"seed 0": "walls-seed-0.json", "seeds 1-2": "walls-seeds-1-2.json"}
    assert got["invocation_walls_s"] == {"seed 0": 1000.5, "seeds 1-2": 6500.0}
    assert got["git_commits"] == {"seed 0": "c0", "seeds 1-2": "c1"}
    assert got["wall_s"] == 7500.5 and got["budget_s"] == 7200 and got["over_budget_s"] == 300.5
    assert got["run_walls_s"] == {"seed 0": 1900.0, "seed 1": 2000.2, "seed 2": 2100.0}  # 2000.25 rounded to even
    assert got["run_wall_s"] == 6000.2  # 1900 + 2000.25 + 2100 = 6000.25
    assert got["by_kind"] == {
        "frozen": {"runs": 1, "run_wall_s": 400.0, "learner_steps": 0,
                   "section_wall_s": {"generate": 100.0, "train": 200.0}},
        "group": {"runs": 2, "run_wall_s": 800.2, "learner_steps": 25,
                  "section_wall_s": {"generate": 200.1, "train": 400.1}},  # 200.0625 and 400.125
        "sao_like": {"runs": 6, "run_wall_s": 4800.0, "learner_steps": 110,
                     "section_wall_s": {"generate": 1200.0, "train": 2400.0}}}  # 375 + 825, 750 + 1650
    assert got["ratio_wall"] == 0.75 and got["ratio_run_wall"] == 0.5 and got["what"] == "two parts"


def test_combining_parts_that_share_a_seed_is_refused(tmp_path):
    a = write_walls(tmp_path / "a.json", 10.0, {0: (1, 5.0, 1)}, {"sao_like": (1, 5.0, 1)})
    b = write_walls(tmp_path / "b.json", 10.0, {0: (1, 5.0, 1), 1: (1, 5.0, 1)}, {"sao_like": (2, 10.0, 2)})
    with pytest.raises(ValueError, match="b.json: seed 0 is also in .*a.json"):
        main(["--combine", str(a), str(b), "--out", str(tmp_path / "w.json")])
    with pytest.raises(SystemExit):  # neither an invocation nor --combine
        main(["--out", str(tmp_path / "w.json")])


def test_seed_labels():
    assert [seeds_label(s) for s in ([0], [2, 3, 4, 5, 6], [3, 1])] == ["seed 0", "seeds 2-6", "seeds 1, 3"]
