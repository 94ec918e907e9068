"""The harness validation (experiments/harness_validation.py): the scenario a run ran, and the pooled comparison on
hand-made per-run results."""

import json
import shutil

import pandas as pd
import pytest

from experiments.harness_validation import main, majority, pool, ran_scenario, same_batches
from simulator.scenario import SCENARIO_DIR


def run(name, cells, st_real, st_harness, rec_real, rec_harness):
    return {"run": name, "reward_cells": [{"phase": 0, "family": f, "real": r, "harness": h, "abs_diff": abs(r - h)}
                                          for f, r, h in cells],
            "staleness_real": st_real, "staleness_harness": st_harness,
            "recovery_real": rec_real, "recovery_harness": rec_harness}


def test_same_batches_counts_the_steps_that_trained_the_same_tasks():
    real = pd.DataFrame({"task_id": ["a", "b", "c", "d", "e"], "learner_step": [0.0, 0.0, 1.0, 1.0, None]})
    sim = pd.DataFrame({"task_id": ["a", "b", "c", "d", "e"], "trained_step": [0, 0, 1, 2, -1],
                        "status": ["trained", "trained", "trained", "trained", "stale"]})
    # step 0: {a, b} both; step 1: {c, d} against {c}; the replay has a step 2 the run lacks
    assert same_batches(real, sim) == {"steps_real": 2, "steps_harness": 3, "identical_task_sets": 1}


def test_majority_names_the_most_common_status_and_calls_a_tie_mixed():
    assert majority(["recovered", "censored", "recovered"]) == "recovered"
    assert majority(["recovered", "censored"]) == "mixed"
    assert majority(["censored"]) == "censored"


def test_pool_compares_the_means_of_the_runs():
    r1 = run("s0", [("arith", 0.6, 0.5), ("string", 0.4, 0.7)], {"0": 0.5, "1": 0.5}, {"0": 1.0},
             {"a": "recovered", "b": "censored"}, {"a": "recovered", "b": "recovered"})
    r2 = run("s1", [("arith", 0.8, 0.8), ("string", 0.6, 0.3)], {"0": 1.0}, {"0": 0.5, "2": 0.5},
             {"a": "recovered", "b": "recovered"}, {"a": "censored", "b": "recovered"})
    out = pool([r1, r2])
    cells = {c["family"]: c for c in out["reward_cells"]}
    # arith: real (0.6 + 0.8) / 2 = 0.7, harness (0.5 + 0.8) / 2 = 0.65; string: 0.5 and 0.5
    assert cells["arith"]["real"] == pytest.approx(0.7) and cells["arith"]["harness"] == pytest.approx(0.65)
    assert cells["string"]["abs_diff"] == pytest.approx(0.0)
    assert out["reward_abs_diff_max"] == pytest.approx(0.05)
    assert out["checks"]["reward_cells_within_tol"]
    # mean histograms: real {0: .75, 1: .25}, harness {0: .75, 2: .25}; TV = (0 + .25 + .25) / 2 = 0.25 <= 0.25
    assert out["staleness_tv"] == pytest.approx(0.25)
    assert out["checks"]["staleness_tv_within_tol"]
    # real: a recovered twice, b one each (mixed); harness: a one each (mixed), b recovered twice
    assert out["recovery_real"] == {"a": "recovered", "b": "mixed"}
    assert out["recovery_harness"] == {"a": "mixed", "b": "recovered"}
    assert not out["checks"]["recovery_status_same"] and not out["agree"]
    assert out["runs"] == ["s0", "s1"] and len(out["per_run"]) == 2
    # harness - real per run: arith -0.1, 0.0 (mean -0.05, sd 0.0707, t(0.975, 1) 12.706 x 0.0707 / sqrt 2 = 0.6353)
    bias = {b["family"]: b for b in out["bias"]}
    assert (bias["arith"]["mean"], bias["arith"]["low"], bias["arith"]["high"], bias["arith"]["n"]) == \
        pytest.approx((-0.05, -0.6853, 0.5853, 2), abs=1e-4)
    assert bias["string"]["mean"] == pytest.approx(0.0) and bias["string"]["sd"] == pytest.approx(0.42426, abs=1e-5)


def test_from_pools_the_runs_of_earlier_outputs(tmp_path):
    r1 = run("s0", [("arith", 0.6, 0.5)], {"1": 1.0}, {"1": 1.0}, {"a": "recovered"}, {"a": "recovered"})
    r2 = run("s1", [("arith", 0.8, 0.8)], {"1": 1.0}, {"1": 1.0}, {"a": "recovered"}, {"a": "recovered"})
    r3 = run("s2", [("arith", 0.4, 0.6)], {"1": 1.0}, {"1": 1.0}, {"a": "recovered"}, {"a": "recovered"})
    r3["same_batches"] = {"steps_real": 4, "steps_harness": 4, "identical_task_sets": 3}
    assert pool([r1, r3])["same_batches"] == {"runs": 1, "steps_real": 4, "steps_harness": 4,
                                              "identical_task_sets": 3}
    (tmp_path / "a.json").write_text(json.dumps(pool([r1, r2])))
    (tmp_path / "b.json").write_text(json.dumps(pool([r3])))
    assert main(["--from", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "o.json")]) == 0
    out = json.loads((tmp_path / "o.json").read_text())
    # real (0.6 + 0.8 + 0.4) / 3 = 0.6, harness (0.5 + 0.8 + 0.6) / 3 = 0.6333; diffs -0.1, 0, +0.2
    assert out["same_batches"]["runs"] == 1  # s2 alone reports it
    assert out["runs"] == ["s0", "s1", "s2"] and out["reward_cells"][0]["abs_diff"] == pytest.approx(0.03333, abs=1e-5)
    assert out["bias"][0]["mean"] == pytest.approx(0.03333, abs=1e-5) and out["bias"][0]["n"] == 3
    with pytest.raises(SystemExit):
        main(["--from", str(tmp_path / "a.json"), "--pooled", "--out", str(tmp_path / "o.json")])


def test_a_run_is_replayed_on_the_scenario_it_ran(tmp_path):
    cfg = {"launch": {"scenario": "smoke"}}  # smoke: phases of 128 and 1,000 tasks, one drift at task 128
    event = {"phase": 1, "prev_phase": 0, "name": "d", "schedule": "abrupt", "families": ["format"], "concepts": {}}
    (tmp_path / "drift.jsonl").write_text(json.dumps({**event, "at_seq": 128}) + "\n")
    scn, source = ran_scenario(tmp_path, cfg)
    assert source == "smoke" and [ph.duration_tasks for ph in scn.phases] == [128, 1000]
    (tmp_path / "drift.jsonl").write_text(json.dumps({**event, "at_seq": 200}) + "\n")  # the file was edited since
    with pytest.raises(ValueError, match=r"drifts came at tasks \[200\], but the phases of smoke start at \[128\]"):
        ran_scenario(tmp_path, cfg)
    edited = tmp_path / "then.yaml"
    edited.write_text((SCENARIO_DIR / "smoke.yaml").read_text().replace("duration_tasks: 128", "duration_tasks: 200"))
    assert ran_scenario(tmp_path, cfg, str(edited))[1] == str(edited)  # --scenario: the file as it was
    shutil.copyfile(edited, tmp_path / "scenario.yaml")  # the copy `sao up` now writes wins over both
    assert ran_scenario(tmp_path, cfg, "smoke")[1] == str(tmp_path / "scenario.yaml")
