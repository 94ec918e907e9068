"""A suite's outcomes and their analysis: each run's outcomes at the (drift, seed)'s common budgets, per (drift, arm)
Kaplan-Meier medians and paired bootstrap intervals, the drifts pooled per arm, suite.json files of disjoint seeds
pooled, and the pilot's rules (post_rollouts, lr)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from experiments import stats
from experiments.common import differing
from experiments.suite_config import Plan


def run_outcomes(post: pd.DataFrame, window: int, n_rollouts: int, n_tokens: int,
                 n_steps: int | None = None, sim_s: float | None = None,
                 compute: float | None = None) -> dict[str, Any]:
    """One run's outcomes at the (drift, seed)'s common budgets: `n_rollouts` trajectories, `n_tokens` tokens, and
    (where `n_steps` is given and `post` has each trajectory's `learner_step`, the post-drift learner steps taken
    before it started) the trajectories started within `n_steps` post-drift learner steps: auc_equal_steps."""
    reward, success = post["reward"].to_numpy(float), post["success"].to_numpy(float)
    in_tokens = int(np.searchsorted(np.cumsum(post["n_gen"].to_numpy()), n_tokens, side="right"))
    out = {"auc_equal_rollouts": float(reward[:n_rollouts].mean()) if n_rollouts else math.nan,
           "auc_equal_tokens": float(reward[:in_tokens].mean()) if in_tokens else math.nan,
           "equal_rollouts_n": n_rollouts, "equal_tokens_n": in_tokens,
           "final_reward": float(reward[-window:].mean()) if len(reward) else math.nan,
           "start_success": float(success[:window].mean()) if len(success) else math.nan}
    if n_steps is not None and "learner_step" in post:
        within = post["learner_step"].to_numpy() <= n_steps
        out.update(auc_equal_steps=float(reward[within].mean()) if within.any() else math.nan,
                   equal_steps_n=n_steps, equal_steps_rollouts=int(within.sum()))
    for thr in (0.7, 0.8):
        n, hit = stats.samples_to(success, thr, window)
        out[f"samples_to_{thr}"], out[f"reached_{thr}"] = n, hit
    if sim_s is not None and "finished_s" in post:
        out.update(sim_time_outcomes(post, window, sim_s))
    if compute is not None and "compute" in post:
        within = post["compute"].to_numpy(float) <= compute * (1 + 1e-9)
        out.update(auc_equal_compute=float(reward[within].mean()) if within.any() else math.nan,
                   equal_compute=compute, equal_compute_rollouts=int(within.sum()))
    return out


def sim_time_outcomes(post: pd.DataFrame, window: int, sim_s: float) -> dict[str, Any]:
    """Adaptation in simulated time (the straggler regime): the mean reward of the rollouts finished within `sim_s`
    simulated s of the drift (the (drift, seed)'s shortest post-drift span), and the simulated s until the
    `window`-mean success, in finishing order, first reaches 0.7 (censored: the run's last finish)."""
    done = post.sort_values("finished_s", kind="stable")
    finished, reward = done["finished_s"].to_numpy(float), done["reward"].to_numpy(float)
    within = finished <= sim_s + 1e-9
    n, hit = stats.samples_to(done["success"].to_numpy(float), 0.7, window)
    return {"auc_equal_sim_time": float(reward[within].mean()) if within.any() else math.nan,
            "equal_sim_s": sim_s, "sim_s_to_0.7": float(finished[n - 1]) if n else math.nan,
            "reached_0.7_sim": hit}


def combine(plan: Plan, runs: list[dict]) -> dict[str, Any]:
    """Outcomes at equal budgets per (drift, seed) (`runs` rows), then `summarise`. Every run must come from one warm
    start."""
    weights = {r.get("init_sha256") for r in runs}
    if len(weights) > 1:
        raise ValueError(f"suite {plan.name}: the runs started from {len(weights)} different warm-start weights "
                         f"(init_sha256 {sorted(map(str, weights))}): their outcomes are not comparable")
    rows = []
    for (drift, seed), group in _by(runs, ("drift", "seed")).items():
        n_roll = min(len(r["post_drift"]["reward"]) for r in group)
        n_tok = min(sum(r["post_drift"]["n_gen"]) for r in group)
        n_steps = equal_steps(group)
        spans = [max(r["post_drift"]["finished_s"]) for r in group if r["post_drift"].get("finished_s")]
        sim_s = min(spans) if len(spans) == len(group) else None
        totals = [r["post_drift"]["compute"][-1] for r in group if r["post_drift"].get("compute")
                  and r.get("sim", {}).get("train", True)]  # the frozen control, which trains nothing, aside
        compute = min(totals) if totals and all("compute" in r["post_drift"] for r in group) else None
        for r in group:
            post = pd.DataFrame(r["post_drift"])
            rows.append({"drift": drift, "seed": seed, "arm": r["arm"],
                         **run_outcomes(post, plan.window, n_roll, n_tok, n_steps, sim_s, compute),
                         "learner_steps": r["summary"]["learner_steps"],
                         "trained_frac": r["summary"]["trained"] / max(r["summary"]["trajectories"], 1),
                         **{k: r[k] for k in ("post_drift_learner_steps", "post_drift_dropped_uniform") if k in r}})
    ref = "sao" if "sao" in {a.name for a in plan.arms} else plan.arms[0].name
    return {"suite": plan.name, "suite_version": plan.version, "provisional": bool(plan.provisional),
            "provisional_values": plan.provisional, "init_sha256": next(iter(weights), None), "reference_arm": ref,
            "window": plan.window, **summarise(rows, ref)}


def equal_steps(group: list[dict]) -> int | None:
    """K of auc_equal_steps: the fewest post-drift learner steps of the (drift, seed)'s runs that train (the frozen
    control, which takes none, aside); None where one of them has no count (a run file written before it existed)."""
    counts = [r.get("post_drift_learner_steps") for r in group if r.get("sim", {}).get("train", True)]
    return None if not counts or None in counts else int(min(counts))


def outcomes_of(table: pd.DataFrame) -> tuple[str, ...]:
    """OUTCOMES, and auc_equal_steps where every run has it (run files written before it existed have not)."""
    return OUTCOMES + tuple(k for k in STEP_OUTCOMES if k in table and table[k].notna().all())


def summarise(rows: list[dict], ref: str) -> dict[str, Any]:
    """Per (drift, arm): Kaplan-Meier medians of samples to each threshold and paired bootstrap intervals of
    (arm - `ref`) over seeds; per arm, the drifts pooled (`pooled`)."""
    table = pd.DataFrame(rows)
    per_arm = []
    for (drift, arm), g in table.groupby(["drift", "arm"], sort=False):
        entry: dict[str, Any] = {"drift": drift, "arm": arm, "seeds": int(len(g))}
        for thr in (0.7, 0.8):
            t, e = g[f"samples_to_{thr}"].to_numpy(), g[f"reached_{thr}"].to_numpy(bool)
            entry[f"km_median_samples_to_{thr}"] = stats.km_median(t, e)
            entry[f"censored_{thr}"] = int((~e).sum())
        base = table[(table["drift"] == drift) & (table["arm"] == ref)].set_index("seed")
        mine = g.set_index("seed")
        for k in outcomes_of(table):
            entry[k] = float(mine[k].mean())
            if arm != ref:
                common = mine.index.intersection(base.index)
                entry[f"{k}_minus_{ref}"] = stats.paired_bootstrap((mine.loc[common, k] - base.loc[common, k]).values)
        per_arm.append(entry)
    return {"runs": rows, "per_drift_arm": per_arm, "pooled": pooled(table, ref)}


# what every suite.json pooled by `pool_results` must share: one suite version, warm start, lr, arms and drifts
POOL_SAME = ("suite", "suite_version", "init_sha256", "reference_arm", "window", "lr", "pilot", "provisional",
             "provisional_values")


def pool_results(results: list[dict], names: list[str]) -> dict[str, Any]:
    """suite.json files of earlier invocations on disjoint seeds, pooled into one result (`summarise` over all their
    runs): seeds run in different sessions accumulate. Refused, naming the file and field, where they differ in
    anything but their seeds (`POOL_SAME`, and each seed's (arm, drift) runs), or share a seed."""
    first = results[0]
    for name, r in zip(names, results):
        for k in POOL_SAME:
            if k not in r:
                raise ValueError(f"--pool {name}: no '{k}' (a suite.json of an older experiments.suite?)")
        if diff := differing(r, first, POOL_SAME):
            raise ValueError(f"--pool {name}: {diff[0]} {r[diff[0]]!r} differs from {names[0]}'s {first[diff[0]]!r}")
    cells = {(row["arm"], row["drift"]) for row in first["runs"]}
    seen: dict[int, str] = {}
    for name, r in zip(names, results):
        for seed, rows in _by(r["runs"], ("seed",)).items():
            if seed[0] in seen:
                raise ValueError(f"--pool {name}: seed {seed[0]} is also in {seen[seed[0]]}")
            seen[seed[0]] = name
            if {(row["arm"], row["drift"]) for row in rows} != cells:
                raise ValueError(f"--pool {name}: seed {seed[0]} ran other arms or drifts than {names[0]}")
    rows = [row for r in results for row in r["runs"]]
    return {**{k: first[k] for k in POOL_SAME}, "pooled_from": names,
            "git_commits": [r.get("git_commit") for r in results], **summarise(rows, first["reference_arm"])}


OUTCOMES = ("auc_equal_rollouts", "auc_equal_tokens", "final_reward")
# where every run has them (newer run files): at equal post-drift learner steps (an arm whose groups are dropped takes
# fewer), at equal simulated time after the drift (the straggler regime) and at equal compute (experiments.compute)
STEP_OUTCOMES = ("auc_equal_steps", "auc_equal_sim_time", "auc_equal_compute")


def seed_differences(table: pd.DataFrame, outcome: str, arm: str, ref: str) -> pd.Series:
    """Per seed, `outcome` averaged over the drifts both arms ran on that seed, `arm` minus `ref`."""
    wide = table.pivot_table(index=["seed", "drift"], columns="arm", values=outcome)
    both = wide[[arm, ref]].dropna().groupby(level="seed").mean()
    return both[arm] - both[ref]


def pooled(table: pd.DataFrame, ref: str) -> list[dict[str, Any]]:
    """Per arm, each outcome averaged over the drifts of a seed, then over seeds; against `ref`, the paired
    bootstrap over seeds of the per-seed difference (`seed_differences`), and its t interval (`_t`: with its SD, the
    difference n seeds detect at 3 standard errors, 3 sd / sqrt(n))."""
    out = []
    for arm, g in table.groupby("arm", sort=False):
        entry: dict[str, Any] = {"arm": arm, "seeds": int(g["seed"].nunique()), "drifts": int(g["drift"].nunique())}
        for k in outcomes_of(table):
            entry[k] = float(g.groupby("seed")[k].mean().mean())
            if arm != ref:
                diffs = seed_differences(table, k, arm, ref).values
                entry[f"{k}_minus_{ref}"] = stats.paired_bootstrap(diffs)
                entry[f"{k}_minus_{ref}_t"] = stats.t_interval(diffs)
        out.append(entry)
    return out


def post_rollouts_rule(per_drift_arm: list[dict], pilot_post: int, quantum: int = 512) -> dict[str, dict]:
    """drift_v1's post_rollouts rule on the pilot: 1.3 x the slower arm's Kaplan-Meier median samples-to-80%,
    rounded up to a multiple of `quantum`; a censored median gives `pilot_post` and a flag."""
    out: dict[str, dict] = {}
    for e in per_drift_arm:
        d = out.setdefault(e["drift"], {"medians": {}, "flagged": False})
        d["medians"][e["arm"]] = e["km_median_samples_to_0.8"]
    for d in out.values():
        medians = list(d["medians"].values())
        if any(m is None for m in medians):
            d["post_rollouts"], d["flagged"] = pilot_post, True
        else:
            d["post_rollouts"] = quantum * math.ceil(1.3 * max(medians) / quantum)
    return out


def choose_lr(pilots: list[dict]) -> dict[str, dict]:
    """drift_v1's lr rule on pilot results (`pilot.json` of one lr each): per arm, the lr with the highest mean
    post-drift AUC at equal rollouts over every (drift, seed) run; ties go to the smaller lr."""
    auc: dict[str, dict[float, float]] = {}
    for pilot in pilots:
        lr = pilot["lr"]
        for arm, g in pd.DataFrame(pilot["runs"]).groupby("arm"):
            auc.setdefault(arm, {})[lr] = float(g["auc_equal_rollouts"].mean())
    return {arm: {"lr": min(by_lr, key=lambda lr: (-by_lr[lr], lr)), "auc_equal_rollouts_by_lr": by_lr}
            for arm, by_lr in auc.items()}


def _by(runs: list[dict], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in runs:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out
