"""experiments/suite_replicate.py: a suite's conclusions against a replicate from other warm-start weights."""

import json

import pytest

from experiments.stats import verdict
from experiments.suite_replicate import compare, main


def _interval(mean, low, high):
    return {"mean": mean, "low": low, "high": high, "n": 2}


def _result(sha, grpo_boot, grpo_t, runs):
    pooled = [{"arm": "sao", "auc_equal_rollouts": 0.5},
              {"arm": "grpo", "auc_equal_rollouts": 0.4, "auc_equal_rollouts_minus_sao": grpo_boot,
               "auc_equal_rollouts_minus_sao_t": grpo_t}]
    return {"suite": "s", "suite_version": "1", "reference_arm": "sao", "window": 64, "lr": 1e-4,
            "init_sha256": sha, "pooled": pooled,
            "runs": [{"drift": d, "arm": a, "seed": s, "auc_equal_rollouts": v} for (d, a, s), v in runs.items()]}


RUNS_A = {("d", "sao", 0): 0.5, ("d", "sao", 1): 0.7, ("d", "grpo", 0): 0.3, ("d", "grpo", 1): 0.5}
RUNS_B = {("d", "sao", 0): 0.6, ("d", "sao", 1): 0.6, ("d", "grpo", 0): 0.3, ("d", "grpo", 1): 0.45}


def test_verdict_reads_which_side_of_zero_the_interval_lies():
    assert verdict(_interval(-0.1, -0.2, -0.01)) == "-"
    assert verdict(_interval(0.1, 0.01, 0.2)) == "+"
    assert verdict(_interval(-0.1, -0.2, 0.0)) == "0"


def test_one_seed_separates_nothing():
    # one seed: the bootstrap resamples the one difference, so its interval is the point and excludes 0
    assert verdict({"mean": -0.1, "low": -0.1, "high": -0.1, "n": 1}) == "0"


def test_a_replicate_with_one_verdict_kept_and_one_lost():
    a = _result("aa", _interval(-0.2, -0.3, -0.1), _interval(-0.2, -0.4, -0.05), RUNS_A)
    b = _result("bb", _interval(-0.1, -0.2, -0.02), _interval(-0.1, -0.3, 0.1), RUNS_B)
    r = compare(a, b)
    grpo = r["arms"][0]
    assert grpo["interval_bootstrap"]["verdicts"] == "--" and grpo["interval_bootstrap"]["same_verdict"]
    assert grpo["interval_t"]["verdicts"] == "-0" and not grpo["interval_t"]["same_verdict"]
    assert grpo["interval_t"]["same_sign"]
    assert r["same_verdicts"] == {"interval_bootstrap": 1, "interval_t": 0} and r["of_arms"] == 1
    assert r["init_sha256"] == ["aa", "bb"]
    # per run: sao moved +0.1 and -0.1 (mean 0, sd 0.1414, max 0.1); original SD over its 2 seeds: 0.1414
    sao = r["run_shifts"]["sao"]
    assert sao == {"runs": 2, "mean": 0.0, "sd": 0.1414, "max_abs": 0.1, "original_sd_over_seeds": 0.1414}
    assert r["run_shifts"]["grpo"]["mean"] == -0.025 and r["run_shifts"]["grpo"]["max_abs"] == 0.05


def test_results_of_two_plans_are_refused_naming_what_differs():
    a = _result("aa", _interval(-0.2, -0.3, -0.1), _interval(-0.2, -0.4, -0.05), RUNS_A)
    b = {**_result("bb", _interval(-0.1, -0.2, -0.02), _interval(-0.1, -0.3, 0.1), {**RUNS_B, ("e", "sao", 0): 0.1}),
         "lr": 2e-4}
    with pytest.raises(ValueError, match=r"differ in lr, runs \(1 \(drift, arm, seed\) in one only\)"):
        compare(a, b)


def test_a_later_suite_version_is_compared_only_when_asked():
    a = _result("aa", _interval(-0.2, -0.3, -0.1), _interval(-0.2, -0.4, -0.05), RUNS_A)
    b = {**_result("aa", _interval(-0.1, -0.2, -0.02), _interval(-0.1, -0.3, 0.1), RUNS_B), "suite_version": "1.5"}
    with pytest.raises(ValueError, match=r"differ in suite_version$"):
        compare(a, b)
    r = compare(a, b, new_version=True)
    assert r["suite_version"] == ["1", "1.5"] and r["same_verdicts"] == {"interval_bootstrap": 1, "interval_t": 0}
    with pytest.raises(ValueError, match=r"differ in lr$"):
        compare(a, {**b, "lr": 2e-4}, new_version=True)


def test_results_on_different_seeds_compare_the_runs_both_hold_when_asked():
    a = _result("aa", _interval(-0.2, -0.3, -0.1), _interval(-0.2, -0.4, -0.05), RUNS_A)
    b = _result("bb", _interval(-0.1, -0.2, -0.02), _interval(-0.1, -0.3, 0.1),
                {k: v for k, v in RUNS_B.items() if k[2] == 0})  # seed 0 alone
    with pytest.raises(ValueError, match=r"runs \(2 \(drift, arm, seed\) in one only\)"):
        compare(a, b)
    r = compare(a, b, common_seeds=True)
    assert r["same_verdicts"] == {"interval_bootstrap": 1, "interval_t": 0}  # each file's own pooled intervals
    sao = r["run_shifts"]["sao"]  # seed 0: 0.6 - 0.5; the original's SD over both its seeds
    assert sao["runs"] == 1 and sao["mean"] == 0.1 and sao["original_sd_over_seeds"] == 0.1414
    assert sao["sd"] is None  # one common run: no SD (not NaN, which JSON cannot hold)
    json.dumps(r, allow_nan=False)
    assert r["run_shifts"]["grpo"]["mean"] == 0.0
    other = _result("bb", _interval(-0.1, -0.2, -0.02), _interval(-0.1, -0.3, 0.1), {("d", "sao", 5): 0.6})
    no_common = r"runs \(no \(drift, arm, seed\) in both\), runs \(1 \(drift, arm\) in one only"
    with pytest.raises(ValueError, match=no_common):
        compare(a, other, common_seeds=True)


def test_main_writes_both_aucs(tmp_path):
    a = _result("aa", _interval(-0.2, -0.3, -0.1), _interval(-0.2, -0.4, -0.05), RUNS_A)
    b = _result("bb", _interval(-0.1, -0.2, -0.02), _interval(-0.1, -0.3, 0.1), RUNS_B)
    for x in (a, b):  # the same numbers at equal tokens
        for p in x["pooled"]:
            p.update({k.replace("rollouts", "tokens"): v for k, v in p.items() if "rollouts" in k})
        for run in x["runs"]:
            run["auc_equal_tokens"] = run["auc_equal_rollouts"]
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "r.json")]) == 0
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["auc_equal_tokens"]["arms"] == out["auc_equal_rollouts"]["arms"]
    assert out["auc_equal_rollouts"]["pooled_original_replicate"] == {"sao": [0.5, 0.5], "grpo": [0.4, 0.4]}
