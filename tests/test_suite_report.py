"""experiments/suite_report.py: what the figure's title says, on hand-made results."""

from __future__ import annotations

from experiments.suite_report import figure_title


def _result(seeds, **extra):
    return {"suite": "drift_v1", "pooled": [{"arm": "sao", "seeds": len(seeds)}],
            "runs": [{"arm": a, "drift": "d", "seed": s} for s in seeds for a in ("sao", "grpo")], **extra}


def test_the_title_says_when_the_curves_hold_fewer_seeds_than_the_pool():
    result = _result([0, 1, 2, 3, 4, 5, 6])
    assert figure_title(result, result["runs"]) == "drift_v1: seeds per cell 7"
    assert figure_title(result, [r for r in result["runs"] if r["seed"] >= 4]) == (
        "drift_v1: seeds per cell 7; curves: seeds 4, 5, 6 only (the others' run files not given)")
    pilot = _result([9], pilot=True, provisional=True)
    assert figure_title(pilot, pilot["runs"]) == "drift_v1: PILOT, seeds per cell 1 (provisional values used)"
