"""A suite's result replicated from another warm start: do its conclusions hold, and how far do single runs move?

Compares two suite.json files of one plan (suite version, arms, drifts, seeds) whose runs started from different
warm-start weights (another build: another CPU builds other bits, docs/results/suite_main/v1.4/warm_start_builds.json).
Per arm: the pooled difference to the reference arm in each, with both intervals (bootstrap and t), and whether the
replicate reaches the same verdict (the sign of the mean, and whether the interval excludes 0). Per run (drift, arm,
seed): the replicate's outcome minus the original's, against the original's spread over seeds of one drift and arm.
With --new-version the replicate may be a later version of the suite (drift_v1 1.5 against 1.4, say): do the
conclusions survive its changes. With --common-seeds the two may hold different seeds (a version whose budget took 5
of the other's 7, say): the verdicts are each file's own pooled intervals, the run shifts over the seeds both hold.

    .venv/bin/python -m experiments.suite_replicate docs/results/suite_main/v1.4/seeds-0-6.json \
        runs/bench/suite-v1.4-b/suite.json --out docs/results/suite_main/v1.4/replicate-b.json
    .venv/bin/python -m experiments.suite_replicate docs/results/suite_main/v1.4/replicate-85e9cc/seeds-0-6.json \
        docs/results/suite_main/v1.5/seeds-0-6.json --new-version --out docs/results/suite_main/v1.5/against-1.4.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from experiments.common import differing
from experiments.stats import sample_sd, verdict

PLAN_KEYS = ("suite", "suite_version", "reference_arm", "window", "lr")


def same_plan(a: dict, b: dict, new_version: bool = False, common_seeds: bool = False) -> None:
    """Refuse two results that differ in anything but their runs' weights and outcomes (and the suite version, with
    `new_version`; the seeds, with `common_seeds`, as long as some are shared)."""
    diff = differing(a, b, [k for k in PLAN_KEYS if not (new_version and k == "suite_version")])
    keys = [{(r["drift"], r["arm"], r["seed"]) for r in x["runs"]} for x in (a, b)]
    if common_seeds:
        if not keys[0] & keys[1]:
            diff.append("runs (no (drift, arm, seed) in both)")
        keys = [{k[:2] for k in x} for x in keys]
    if keys[0] != keys[1]:
        diff.append(f"runs ({len(keys[0] ^ keys[1])} (drift, arm{'' if common_seeds else ', seed'}) in one only)")
    if diff:
        raise ValueError(f"not one plan: they differ in {', '.join(diff)}")


def arm_verdicts(a: dict, b: dict, outcome: str) -> list[dict[str, Any]]:
    ref, rows = a["reference_arm"], []
    b_arms = {p["arm"]: p for p in b["pooled"]}
    for pa in a["pooled"]:
        if pa["arm"] == ref:
            continue
        pb, row = b_arms[pa["arm"]], {"arm": pa["arm"]}
        for kind in ("", "_t"):
            key = f"{outcome}_minus_{ref}{kind}"
            va, vb = verdict(pa[key]), verdict(pb[key])
            row[f"interval{kind or '_bootstrap'}"] = {
                "original": [round(pa[key][k], 4) for k in ("mean", "low", "high")],
                "replicate": [round(pb[key][k], 4) for k in ("mean", "low", "high")],
                "verdicts": va + vb, "same_verdict": va == vb,
                "same_sign": bool(np.sign(pa[key]["mean"]) == np.sign(pb[key]["mean"]))}
        rows.append(row)
    return rows


def run_shifts(a: dict, b: dict, outcome: str) -> dict[str, Any]:
    """Replicate minus original, run by run, per arm; beside it the original's SD over seeds (per drift and arm,
    averaged over drifts): how much of a seed's spread a rebuilt warm start moves a run."""
    ra = {(r["drift"], r["arm"], r["seed"]): r[outcome] for r in a["runs"]}
    rb = {(r["drift"], r["arm"], r["seed"]): r[outcome] for r in b["runs"]}
    out = {}
    for arm in sorted({k[1] for k in ra}):
        every = [k for k in ra if k[1] == arm]
        keys = [k for k in every if k in rb]
        d = np.array([rb[k] - ra[k] for k in keys])
        drifts = sorted({k[0] for k in every})
        seed_sds = [sample_sd([ra[k] for k in every if k[0] == dr]) for dr in drifts]
        seed_sd = None if None in seed_sds else float(np.mean(seed_sds))
        out[arm] = {"runs": len(keys), "mean": round(float(d.mean()), 4), "sd": _round(sample_sd(d)),
                    "max_abs": round(float(np.abs(d).max()), 4), "original_sd_over_seeds": _round(seed_sd)}
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def compare(a: dict, b: dict, outcome: str = "auc_equal_rollouts", new_version: bool = False,
            common_seeds: bool = False) -> dict[str, Any]:
    same_plan(a, b, new_version, common_seeds)
    arms = arm_verdicts(a, b, outcome)
    b_arms = {p["arm"]: p for p in b["pooled"]}
    pooled = {p["arm"]: [round(p[outcome], 4), round(b_arms[p["arm"]][outcome], 4)] for p in a["pooled"]}
    return {"outcome": outcome, "init_sha256": [a.get("init_sha256"), b.get("init_sha256")],
            "suite_version": [a.get("suite_version"), b.get("suite_version")],
            "pooled_original_replicate": pooled, "arms": arms,
            "same_verdicts": {kind: sum(r[kind]["same_verdict"] for r in arms)
                              for kind in ("interval_bootstrap", "interval_t")},
            "of_arms": len(arms), "run_shifts": run_shifts(a, b, outcome)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("original", type=Path, help="a suite.json (e.g. the committed pooled result)")
    p.add_argument("replicate", type=Path, help="a suite.json of the same plan from other warm-start weights")
    p.add_argument("--new-version", action="store_true", help="the replicate may be another version of the suite")
    p.add_argument("--common-seeds", action="store_true",
                   help="the two may hold different seeds: run shifts over the seeds both hold")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    orig, rep = (json.loads(f.read_text()) for f in (a.original, a.replicate))
    result = {"original": str(a.original), "replicate": str(a.replicate),
              **{o: compare(orig, rep, o, a.new_version, a.common_seeds)
                 for o in ("auc_equal_rollouts", "auc_equal_tokens")}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    r = result["auc_equal_rollouts"]
    print(f"same verdict: bootstrap {r['same_verdicts']['interval_bootstrap']}/{r['of_arms']}, "
          f"t {r['same_verdicts']['interval_t']}/{r['of_arms']} arms -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
