"""The main run's plan from a suite's pilot (issue 15, items 2-4): each `pilot:` placeholder's rule applied to the
pilot's JSON alone, and what the 2-hour budget allows.

Reads one pilot directory per point of the lr grid (`python -m experiments.suite --pilot --lr X --out DIR`; the run
files in DIR/runs written with the pilot's settings, of the arms that ran every drift and pilot seed) and writes
main_plan.json:
- lr: per arm, the suite's lr rule (`suite.choose_lr`) over the grid points the arm ran;
- post_rollouts: the suite's rule (`suite.post_rollouts_rule`) on SAO and GRPO, each at its chosen lr;
- seeds: the power calculation. The primary outcome is the post-drift AUC (equal rollouts) averaged over the
  suite's drifts, paired on the seed; sd_d is the SD over pilot seeds of its paired difference (arm - SAO), each arm
  at its chosen lr; n = ceil((3 sd_d / delta)^2), at least `minimum`, delta = 10% of SAO's mean. `budget_seeds`
  is how many seeds fit the budget at the pilot's measured CPU per rollout; when n is larger, the plan takes the
  budget's seeds and states the difference it can detect at 3 standard errors, 3 sd_d / sqrt(n);
and beside it pilot-lr-<lr>.json: each grid point's outcomes (`suite.combine`), which experiments/suite_report.py draws.
With --budget-only (a later version that keeps its lr, lengths and n, on other code or another machine): only the
budget, the suite's own post-drift lengths priced at this pilot's CPU per rollout and its n capped by the seeds that
fit (`seeds_in_budget`).

    .venv/bin/python -m experiments.suite_plan --suite experiments/suites/drift_v1.yaml \
        --init runs/cache/warmstart-XXXX --pilots 2e-4=runs/bench/suite-lr-2e-4 4e-4=runs/bench/suite-lr-4e-4 \
        --frozen docs/results/suite_pilot/v1.1 --out docs/results/suite_pilot/main_plan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from experiments import stats
from experiments.arms import arm as arm_named
from experiments.suite_analysis import choose_lr, combine, post_rollouts_rule, seed_differences
from experiments.suite_config import Plan, has_own_lr, load_plan, lr_of, post_of, split_threads
from experiments.suite_runs import finished_run, run_path


def seeds_rule(runs: pd.DataFrame, ref: str, k_sigma: float = 3.0, rel: float = 0.10, minimum: int = 5
               ) -> dict[str, Any]:
    """The power calculation on pilot runs at each arm's chosen lr: sd_d per arm, delta and the seeds n."""
    delta = rel * float(runs[runs["arm"] == ref].groupby("seed")["auc_equal_rollouts"].mean().mean())
    per_arm = {}
    for arm in sorted(set(runs["arm"]) - {ref}):
        d = seed_differences(runs, "auc_equal_rollouts", arm, ref).to_numpy()
        sd = stats.sample_sd(d)
        if sd is None:
            raise ValueError(f"seeds rule: arm {arm!r} has {len(d)} paired pilot seed(s) with {ref!r}; the power "
                             "calculation needs the SD of at least 2")
        per_arm[arm] = {"paired_differences": d.round(5).tolist(), "mean": float(d.mean()), "sd": sd,
                        "n": stats.seeds_for(sd, delta, k_sigma, minimum)}
    worst = max(per_arm, key=lambda a: per_arm[a]["sd"])
    return {"k_sigma": k_sigma, "delta": delta, "delta_rel": rel, "minimum": minimum, "per_arm": per_arm,
            "largest_sd_arm": worst, "n": per_arm[worst]["n"]}


def cpu_per_rollout(run_files: list[Path]) -> pd.DataFrame:
    """Measured CPU seconds per rollout of each (arm, drift): the run files' summaries (one thread per run)."""
    rows = []
    for f in run_files:
        r = json.loads(f.read_text())
        s = r["summary"]
        rows.append({"arm": r["arm"], "drift": r["drift"], "cpu_s": s["cpu_s"], "rollouts": s["trajectories"],
                     "threads": r["sim"]["threads"]})
    df = pd.DataFrame(rows)
    df["cpu_per_rollout"] = df["cpu_s"] / df["rollouts"]
    return df.groupby(["arm", "drift"], as_index=False)["cpu_per_rollout"].mean()


def seed_cost(plan: Plan, cost: pd.DataFrame, post: dict[str, int]) -> dict[str, Any]:
    """CPU seconds of one main seed (every arm, every drift) at the pilot's CPU per rollout; an arm without its own
    measurement is priced as GRPO when it runs groups, else as SAO."""
    table = cost.set_index(["arm", "drift"])["cpu_per_rollout"]
    per_arm, priced_as = {}, {}
    for a in plan.arms:
        arm = a.name
        src = arm if (arm, plan.drifts[0]["name"]) in table.index else "grpo" if a.group_size > 1 else "sao"
        priced_as[arm] = src
        per_arm[arm] = sum(float(table[(src, d["name"])]) * (plan.pre + post[d["name"]]) for d in plan.drifts)
    return {"per_arm_cpu_s": per_arm, "priced_as": priced_as, "cpu_s": sum(per_arm.values())}


def budget_seeds(seed_cpu_s: float, budget_s: float, cores: int) -> int:
    """Seeds whose runs fit `budget_s` of wall time on `cores` cores, the runs spread evenly over them."""
    return int(budget_s * cores // seed_cpu_s)


def seeds_in_budget(plan: Plan, files: list[Path], post: dict[str, int], n_rule: int, budget_s: float,
                    cores: int) -> dict[str, Any]:
    """The seeds rule's `n_rule` capped by the seeds that fit `budget_s` on `cores` cores, each seed priced at the
    CPU per rollout of the run `files` (`seed_cost`) with the post-drift lengths `post`."""
    cost = seed_cost(plan, cpu_per_rollout(files), post)
    fit = budget_seeds(cost["cpu_s"], budget_s, cores)
    n = min(n_rule, fit)
    return {"seed_cost": cost, "budget_s": budget_s, "cores": cores, "budget_seeds": fit, "main_seeds": n,
            "capped_by_budget": n < n_rule, "predicted_wall_s": n * cost["cpu_s"] / cores}


def trained_arms(plan: Plan) -> list[str]:
    """The arms with a learning rate of their own (`suite.has_own_lr`)."""
    return [a.name for a in plan.arms if has_own_lr(a)]


def with_grid_edges(choice: dict[str, dict]) -> dict[str, dict]:
    """Marks a choice at the smallest or largest lr its arm ran: the best lr may lie outside the points run."""
    for c in choice.values():
        ran = sorted(c["auc_equal_rollouts_by_lr"])
        c["at_grid_edge"] = len(ran) < 2 or c["lr"] in (ran[0], ran[-1])
    return choice


def pilot_runs(plan: Plan, directory: Path, lr: float, init: str, jobs: int) -> list[dict]:
    """The run files in `directory` written with the pilot's settings at `lr` (`suite.finished_run`): stale files
    from an earlier version of the suite are left out."""
    p = split_threads(dataclasses.replace(plan, seeds=plan.pilot_seeds, post=plan.pilot_post, lr=lr), jobs)
    found = (finished_run(p, arm_named(name), d, s, init, directory) for name in trained_arms(plan)
             for d in p.drifts for s in p.seeds)
    return [r for r in found if r is not None]


def complete(runs: list[dict], n_cells: int) -> list[dict]:
    """The runs of the arms that ran every (drift, seed) cell of the pilot."""
    count: dict[str, int] = {}
    for r in runs:
        count[r["arm"]] = count.get(r["arm"], 0) + 1
    return [r for r in runs if count[r["arm"]] == n_cells]


def suite_choices(plan: Plan) -> tuple[dict[str, dict], dict[str, dict]]:
    """The suite's own lr per trained arm and post-drift rollouts per drift, in main_plan.json's shape (what
    `--budget-only` keeps)."""
    lr = {name: {"lr": lr_of(plan, arm_named(name)), "from_suite": True} for name in trained_arms(plan)}
    post = {d["name"]: {"post_rollouts": post_of(plan, d), "from_suite": True} for d in plan.drifts}
    return lr, post


def pilot_choices(plan: Plan, pilots: list[dict]) -> tuple[dict[str, dict], dict[str, dict]]:
    """The lr rule over the grid points each arm ran (an arm the pilot did not cover inherits SAO's lr, and says
    so) and the post-drift rule on SAO and GRPO, each at its chosen lr."""
    lr = with_grid_edges(choose_lr(pilots))
    for name in trained_arms(plan):
        lr.setdefault(name, {"lr": lr["sao"]["lr"], "auc_equal_rollouts_by_lr": {}, "not_in_pilot": True})
    at_lr = [e for pl in pilots for e in pl["per_drift_arm"]
             if e["arm"] in ("sao", "grpo") and lr[e["arm"]]["lr"] == pl["lr"]]
    return lr, post_rollouts_rule(at_lr, plan.pilot_post)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", required=True)
    p.add_argument("--pilots", nargs="+", required=True, metavar="LR=DIR",
                   help="the pilot's directory at each lr grid point "
                   "(python -m experiments.suite --pilot --lr LR --out DIR)")
    p.add_argument("--init", required=True, help="the warm start the pilot ran from")
    p.add_argument("--jobs", type=int, default=2, help="the --jobs the pilot ran with (its runs' threads)")
    p.add_argument("--frozen", help="a directory with frozen-arm run files (e.g. the admissibility check's) to price "
                   "the frozen control")
    p.add_argument("--budget-s", type=float, default=7200.0)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--budget-only", action="store_true",
                   help="keep the suite's filled lr, post-drift lengths and main seeds' count (the seeds rule's n); "
                        "only price them at this pilot's CPU per rollout and cap the seeds by the budget")
    p.add_argument("--n-rule", type=int, help="with --budget-only: the seeds rule's n to cap (default: the suite's "
                   "main seeds; a suite whose seeds the budget already capped names the rule's n here)")
    p.add_argument("--out", default="runs/bench/suite/main_plan.json")
    a = p.parse_args(argv)
    if a.n_rule is not None and not a.budget_only:
        p.error("--n-rule goes with --budget-only (otherwise the pilot's power calculation sets n)")
    if a.n_rule is not None and a.n_rule < 1:
        p.error(f"--n-rule must be at least 1, got {a.n_rule}")
    plan = load_plan(a.suite)
    cells = len(plan.drifts) * len(plan.pilot_seeds)
    pilots, files = [], []
    for item in a.pilots:
        lr, directory = item.split("=", 1)
        runs = complete(pilot_runs(plan, Path(directory), float(lr), a.init, a.jobs), cells)
        pilots.append({**combine(plan, runs), "lr": float(lr)})
        files += [run_path(Path(directory), arm_named(r["arm"]), {"name": r["drift"]}, r["seed"]) for r in runs]
    files += sorted(Path(a.frozen).glob("runs/*-frozen-*.json")) if a.frozen else []
    lr, post = suite_choices(plan) if a.budget_only else pilot_choices(plan, pilots)
    chosen = pd.DataFrame([r for pl in pilots for r in pl["runs"] if lr[r["arm"]]["lr"] == pl["lr"]])
    rule = seeds_rule(chosen, "sao")
    n_rule = (len(plan.seeds) if a.n_rule is None else a.n_rule) if a.budget_only else rule["n"]
    budget = seeds_in_budget(plan, files, {k: v["post_rollouts"] for k, v in post.items()}, n_rule, a.budget_s,
                             a.cores)
    sd = rule["per_arm"][rule["largest_sd_arm"]]["sd"]
    n = budget["main_seeds"]
    result = {"suite": plan.name, "version": plan.version, "pilots": a.pilots, "init": a.init,
              "budget_only": a.budget_only,
              "arms_in_pilot": {str(pl["lr"]): sorted({r["arm"] for r in pl["runs"]}) for pl in pilots},
              "lr": lr, "post_rollouts": post, "seeds_rule": rule, "n_rule": n_rule, **budget,
              "detectable_difference_3se": 3 * sd / math.sqrt(n) if n else None}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for pilot, item in zip(pilots, a.pilots):  # each grid point's outcomes, for experiments/suite_report.py
        pilot_out = {**pilot, "pilot": True, "runs_dir": str(Path(item.split("=", 1)[1]) / "runs")}
        (out.parent / f"pilot-lr-{pilot['lr']:g}.json").write_text(json.dumps(pilot_out, indent=1, default=str))
    print(json.dumps({k: result[k] for k in ("arms_in_pilot", "main_seeds", "budget_seeds", "capped_by_budget",
                                             "detectable_difference_3se", "predicted_wall_s")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
