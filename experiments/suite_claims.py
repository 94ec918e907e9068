"""Suite 2's verdicts from one suite.json (issue 49, items 2, 5 and 8): every arm against the reference, and each
claim of the design from the factorial's cell pairs, by the hierarchical bootstrap over seeds and drifts with Holm's
correction (experiments.suite_stats). A verdict is `holds`, `does not` or `not separable at this power`.

A claim says cell A beats cell B in each of its pairs (experiments/arms.py's table); a pair holds when B - A is below
0 after Holm's correction across the 12 pairs at that eta. The claim holds when all 4 of its pairs hold, does not
when any of them separates the other way, and is not separable otherwise.

Each outcome named (`--outcome`, the suite file's views; the first is the primary) gets its own verdicts, Holm's
correction within it; an arm without a finite value of the outcome in every run (one its runs did not record) is
left out of that view.

    .venv/bin/python -m experiments.suite_claims runs/v2fact/suite.json --factorial \
        --out docs/results/suite_main/v2.1/factorial_claims.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from experiments.suite_stats import DOES_NOT, HOLDS, NOT_SEPARABLE, diff_matrix, hierarchical_bootstrap, holm, verdict

# the suite file's views (drift_v2.yaml, analysis.views), the primary first
VIEWS = ("auc_equal_rollouts", "auc_equal_tokens", "auc_equal_steps", "auc_equal_compute")
N_BOOT = 10_000
CLAIM_PAIRS = {
    "single rollout beats groups": [("single_value_strict", "group4_value_strict"),
                                    ("single_value_oneside", "group4_value_oneside"),
                                    ("single_base_strict", "group4_base_strict"),
                                    ("single_base_oneside", "group4_base_oneside")],
    "a value model beats a group baseline": [("group4_value_strict", "group4_base_strict"),
                                             ("group4_value_oneside", "group4_base_oneside"),
                                             ("single_value_strict", "single_base_strict"),
                                             ("single_value_oneside", "single_base_oneside")],
    "the strict double-side clip beats the one-side clip": [("single_value_strict", "single_value_oneside"),
                                                            ("single_base_strict", "single_base_oneside"),
                                                            ("group4_value_strict", "group4_value_oneside"),
                                                            ("group4_base_strict", "group4_base_oneside")],
}


def compared(runs: list[dict], pairs: list[tuple[str, str]], outcome: str, n_boot: int) -> dict[str, dict]:
    """Each (better, worse) pair's worse - better, its interval, Holm's p across the pairs and the verdict on
    'worse is below better'."""
    drifts = sorted({r["drift"] for r in runs})
    found = {f"{b} vs {w}": hierarchical_bootstrap(diff_matrix(runs, w, b, outcome, drifts), n_boot)
             for b, w in pairs}
    adjusted = holm({k: v["p"] for k, v in found.items()})
    return {k: {**v, "holm_p": adjusted[k], "verdict": verdict(v, adjusted[k])} for k, v in found.items()}


def measured(runs: list[dict], outcome: str) -> set[str]:
    """The arms with a finite `outcome` in every run."""
    def finite(r):
        return isinstance(r.get(outcome), (int, float)) and math.isfinite(r[outcome])
    return {a for a in {r["arm"] for r in runs} if all(finite(r) for r in runs if r["arm"] == a)}


def arm_verdicts(result: dict, outcome: str = "auc_equal_rollouts", n_boot: int = N_BOOT) -> dict[str, dict]:
    """Every arm with the outcome against the reference arm (`reference_arm`): is it below it?"""
    ref, have = result["reference_arm"], measured(result["runs"], outcome)
    arms = [a for a in dict.fromkeys(r["arm"] for r in result["runs"]) if a != ref and a in have]
    return compared(result["runs"], [(ref, a) for a in arms], outcome, n_boot)


def claim_of(pairs: dict[str, dict]) -> str:
    verdicts = [p["verdict"] for p in pairs.values()]
    if DOES_NOT in verdicts:
        return DOES_NOT
    return HOLDS if all(v == HOLDS for v in verdicts) else NOT_SEPARABLE


def claim_verdicts(result: dict, eta: int, outcome: str = "auc_equal_rollouts", n_boot: int = N_BOOT) -> dict:
    """The three claims at one eta, from the factorial's cells f_<cell>_eta<eta>."""
    cell = {c: f"f_{c}_eta{eta}" for pairs in CLAIM_PAIRS.values() for pair in pairs for c in pair}
    every = [(cell[b], cell[w]) for pairs in CLAIM_PAIRS.values() for b, w in pairs]
    found = compared(result["runs"], every, outcome, n_boot)
    out = {}
    for claim, pairs in CLAIM_PAIRS.items():
        mine = {f"{cell[b]} vs {cell[w]}": found[f"{cell[b]} vs {cell[w]}"] for b, w in pairs}
        out[claim] = {"verdict": claim_of(mine), "pairs": mine}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("suite_json")
    p.add_argument("--factorial", action="store_true", help="the claims from the factorial's cells, at eta 0 and 4")
    p.add_argument("--outcome", nargs="+", default=list(VIEWS), help="the primary outcome first")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    result = json.loads(Path(a.suite_json).read_text())
    out: dict[str, Any] = {"suite": result["suite"], "suite_version": result["suite_version"],
                           "outcomes": a.outcome, "n_boot": N_BOOT, "from": a.suite_json,
                           "provisional": result.get("provisional")}
    if a.factorial:
        out["claims"] = {o: {f"eta{eta}": claim_verdicts(result, eta, o) for eta in (4, 0)} for o in a.outcome}
    else:
        out["reference_arm"] = result["reference_arm"]
        out["arms"] = {o: arm_verdicts(result, o) for o in a.outcome}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    primary = out["claims"][a.outcome[0]] if a.factorial else out["arms"][a.outcome[0]]
    print(json.dumps(primary if a.factorial else {k: v["verdict"] for k, v in primary.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
