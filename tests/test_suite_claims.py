"""Suite 2.0's verdicts from a suite.json (experiments/suite_claims.py) on hand-made runs of known differences."""

from __future__ import annotations

from experiments.suite_claims import CLAIM_PAIRS, arm_verdicts, claim_verdicts
from experiments.suite_stats import DOES_NOT, HOLDS, NOT_SEPARABLE

SEEDS, DRIFTS = (0, 1, 2), ("a", "b")


def runs_of(auc: dict[str, float]) -> list[dict]:
    """Every arm's runs on 3 seeds x 2 drifts, each at its arm's AUC plus a (seed, drift) effect all arms share (so
    the paired differences are exactly the arms' differences)."""
    return [{"arm": arm, "seed": s, "drift": d, "auc_equal_rollouts": x + 0.01 * s + 0.02 * (d == "b")}
            for arm, x in auc.items() for s in SEEDS for d in DRIFTS]


def test_each_arm_against_the_reference_by_hand():
    result = {"reference_arm": "sao", "runs": runs_of({"sao": 0.5, "grpo": 0.4, "eta0": 0.6, "ppo": 0.5})}
    out = arm_verdicts(result, n_boot=2000)
    # constant differences: every resample's mean is the difference itself, so p is 0 (or 1 at a difference of 0)
    assert {k: (round(v["mean"], 12), v["p"], v["verdict"]) for k, v in out.items()} == {
        "sao vs grpo": (-0.1, 0.0, HOLDS), "sao vs eta0": (0.1, 0.0, DOES_NOT), "sao vs ppo": (0.0, 1.0, NOT_SEPARABLE)}
    assert out["sao vs ppo"]["holm_p"] == 1.0 and out["sao vs grpo"]["holm_p"] == 0.0


def test_a_claim_holds_when_each_of_its_pairs_holds_and_not_when_one_goes_the_other_way():
    # single beats group4 by 0.1 in every cell; the value model beats the baseline by 0.05 with groups, loses by 0.05
    # with single rollouts; the clip makes no difference
    auc = {}
    for rollout, r in (("single", 0.1), ("group4", 0.0)):
        for baseline in ("value", "base"):
            bonus = {"group4": {"value": 0.05, "base": 0.0}, "single": {"value": 0.0, "base": 0.05}}
            b = bonus[rollout][baseline]
            for clip in ("strict", "oneside"):
                auc[f"f_{rollout}_{baseline}_{clip}_eta4"] = 0.4 + r + b
    out = claim_verdicts({"runs": runs_of(auc)}, eta=4, n_boot=2000)
    assert [out[c]["verdict"] for c in CLAIM_PAIRS] == [HOLDS, DOES_NOT, NOT_SEPARABLE]
    # single/base 0.4 + 0.1 + 0.05 against group4/base 0.4: worse - better = -0.15
    single = out["single rollout beats groups"]["pairs"]["f_single_base_strict_eta4 vs f_group4_base_strict_eta4"]
    assert round(single["mean"], 12) == -0.15 and single["verdict"] == HOLDS
    value = out["a value model beats a group baseline"]["pairs"]
    pair = value["f_single_value_strict_eta4 vs f_single_base_strict_eta4"]
    assert round(pair["mean"], 12) == 0.05 and pair["verdict"] == DOES_NOT


def test_an_arm_without_the_outcome_in_every_run_is_left_out_of_that_view_only():
    runs = runs_of({"sao": 0.5, "grpo": 0.4, "frozen": 0.3})
    for r in runs:
        r["auc_equal_steps"] = float("nan") if r["arm"] == "frozen" else r["auc_equal_rollouts"]
    result = {"reference_arm": "sao", "runs": runs}
    assert set(arm_verdicts(result, "auc_equal_steps", n_boot=200)) == {"sao vs grpo"}
    assert set(arm_verdicts(result, n_boot=200)) == {"sao vs grpo", "sao vs frozen"}


def test_one_seed_never_separates_however_large_the_difference():
    runs = [r for r in runs_of({"sao": 0.5, "grpo": 0.1}) if r["seed"] == 0]
    out = arm_verdicts({"reference_arm": "sao", "runs": runs}, n_boot=200)
    assert out["sao vs grpo"]["mean"] == -0.4 and out["sao vs grpo"]["verdict"] == NOT_SEPARABLE
