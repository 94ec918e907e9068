"""An off-policy regime that can hurt (issue 15, item 5), in the simulated harness on a stationary stream.

The staleness bound eta in {0, 4, 16, 64} and the gradient updates per batch in {1, 4}: each configuration lets
generation run eta versions ahead of the learner (max_in_flight = (eta + 1) x batch rollouts, so staleness up to eta
is reached, not only allowed) and trains every batch `updates` times. Per learner step it logs the effective sample
size of the importance weights (learner/ess_frac: (sum r)^2 / (n sum r^2) over the scored tokens), KL(behaviour ||
learner) (k3), the clipped fractions on each side, entropy and gradient norm.

Each run is written to <out>/runs/ when it finishes and reused by a later invocation with the same settings, so a
long stability test can be run in pieces.

`--sweep`: every (eta, updates) for each arm, one seed, a short run: what the regime does to KL, clipping and ESS.
`--stability`: the 1,000-step stability test in the harshest configuration (`--eta 64 --updates 4` by default), on
3 seeds per arm. Collapse: a non-finite update, an entropy collapse (the last tenth of policy steps below 10% of the
first tenth's entropy: streamer.runs.stability.collapsed) or the reward halving on the stationary stream (the mean
of the last `window` trajectories below half that of the first `window` after the first 10% of the run).

The stream is the drift suite's warm-start mixture at its pre-drift concepts (experiments/suites/*.yaml), one phase,
so a fall of the reward is the learner's doing, not a drift. Each arm runs at its lr from the suite's main_plan.json
(`--plan`) or at `--lr`.

    .venv/bin/python -m experiments.offpolicy --suite experiments/suites/drift_v1.yaml --sweep --steps 200
    .venv/bin/python -m experiments.offpolicy --suite experiments/suites/drift_v1.yaml --stability --steps 1000 \
        --seeds 0,1,2
    .venv/bin/python -m experiments.offpolicy --suite experiments/suites/drift_v1.yaml --quick      # outputs only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from bench.common import pyplot
from experiments import stats
from experiments.arms import Arm, arms
from experiments.common import init_sha256, reusable_run
from experiments.harness import SimConfig, phase_prefix, scenario_stream, simulate, summary
from experiments.parallel import run_parallel
from experiments.suite_config import Plan, build_init, load_plan, split_threads
from experiments.suite_runs import STEP_KEYS, json_default
from simulator.scenario import Scenario, validate_scenario
from streamer.runs.stability import collapsed, policy_events
from streamer.wire.config import load_config

ETAS = (0, 4, 16, 64)
UPDATES = (1, 4)
ARMS = ("sao", "ppo", "sao_no_strict_clip", "grpo")


@dataclasses.dataclass(frozen=True)
class Regime:
    eta: int
    updates: int


def stationary_scenario(plan: Plan, rollouts: int, families: list[str]) -> Scenario:
    """One phase of `rollouts` tasks: the suite's warm-start families (those named) at their pre-drift concepts."""
    phase = plan.warm_start["phases"][0]
    fams = {f: w for f, w in plan.warm_start["warm_start"]["families"].items() if f in families}
    raw = {"name": f"{plan.name}-stationary", "rate": plan.scenario["rate"], "arrival": plan.scenario["arrival"],
           "options": plan.scenario.get("options", {}),
           "phases": [{"name": "stationary", "duration_tasks": rollouts, "families": fams,
                       "concepts": {f: phase["concepts"][f] for f in fams}}]}
    scn = load_config(Scenario, None, [], base=raw)
    validate_scenario(scn, "offpolicy stationary stream")
    return scn


def regime_sim(plan: Plan, arm: Arm, regime: Regime, seed: int, batch: int) -> SimConfig:
    in_flight = max((regime.eta + 1) * batch, arm.group_size)
    base = {**plan.harness, **arm.sim, "batch": batch, "eta": regime.eta, "max_in_flight": in_flight,
            "group_size": arm.group_size, "seed": seed}
    return load_config(SimConfig, None, [], base=base)


def reward_halved(reward: np.ndarray, window: int) -> bool:
    """The reward's last `window` mean below half its first `window` mean after the first 10% (the warm-up)."""
    start = len(reward) // 10
    if len(reward) < start + 2 * window:
        return False
    first, last = reward[start:start + window].mean(), reward[-window:].mean()
    return bool(first > 0 and last < 0.5 * first)


def run_regime(plan: Plan, arm: Arm, regime: Regime, seed: int, steps: int, batch: int, lr: float,
               families: list[str], init: str, window: int) -> dict[str, Any]:
    scn = stationary_scenario(plan, steps * batch, families)
    stream = phase_prefix(scenario_stream(scn, seed), arm.group_size)
    sim = regime_sim(plan, arm, regime, seed, batch)
    learner = [*arm.learner, f"optim.lr={lr}", f"optim.updates_per_batch={regime.updates}"]
    name = f"{arm.name} eta{regime.eta} x{regime.updates} s{seed}"
    res = simulate(sim, init, stream, learner, [], scn.rate,  # progress every 30 s: a 1,000-step run takes 20+ min
                   log=lambda line: print(f"[offpolicy {name}, {steps} steps] {line}", flush=True))
    traj = res.trajectories.sort_values(["seq", "member"])
    steps_df = res.steps[[k for k in STEP_KEYS if k in res.steps]] if len(res.steps) else res.steps
    verdict = collapsed(traj, res.steps, window)
    halved = reward_halved(traj["reward"].to_numpy(float), window)
    pol = policy_events(steps_df)

    def q(key: str, fn) -> float | None:
        return float(fn(pol[key].dropna())) if key in pol and pol[key].notna().any() else None

    return {"arm": arm.name, "eta": regime.eta, "updates": regime.updates, "seed": seed, "lr": lr, "batch": batch,
            "summary": summary(res, sim.threads), "collapsed": bool(verdict["collapsed"] or halved),
            "reward_halved": halved, **{k: v for k, v in verdict.items() if k != "collapsed"},
            "staleness_mean": q("staleness_mean", np.mean), "staleness_max": q("staleness_max", np.max),
            "kl_k3_median": q("learner/kl_k3", np.median), "clip_frac_mean": q("learner/clip_frac", np.mean),
            "clip_frac_low_mean": q("learner/clip_frac_low", np.mean),
            "clip_frac_high_mean": q("learner/clip_frac_high", np.mean),
            "ess_frac_median": q("learner/ess_frac", np.median), "ess_frac_min": q("learner/ess_frac", np.min),
            "grad_norm_max": q("learner/grad_norm", np.max),
            "steps": steps_df.to_dict("records"), "reward": traj["reward"].astype(float).round(4).tolist()}


def finished_or_run(out: Path, plan: Plan, arm: Arm, regime: Regime, seed: int, steps: int, batch: int, lr: float,
                    families: list[str], init: str, window: int) -> dict[str, Any]:
    """`run_regime`'s result from its file in `out`/runs when that was written with these settings (an interrupted
    stability test resumes run by run), else the run, written there."""
    settings = {"arm": arm.name, "eta": regime.eta, "updates": regime.updates, "seed": seed, "steps": steps,
                "batch": batch, "lr": lr, "families": families, "init": init, "init_sha256": init_sha256(init),
                "window": window, "harness": plan.harness}
    path = out / "runs" / f"{arm.name}-eta{regime.eta}-x{regime.updates}-s{seed}-{steps}steps.json"
    done = reusable_run(path, {"settings": json.loads(json.dumps(settings, default=json_default))})
    if done is not None:
        return done
    run = {**run_regime(plan, arm, regime, seed, steps, batch, lr, families, init, window), "settings": settings}
    text = json.dumps(run, default=json_default)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return json.loads(text)  # the same JSON types whether reused or run


def figure(runs: list[dict], path: Path, window: int) -> Path:
    """Per run: windowed reward, ESS fraction and KL (k3) against the learner step."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    arms_ = list(dict.fromkeys(r["arm"] for r in runs))  # one colour map per arm, a shade per run of it
    maps = [plt.get_cmap(m) for m in ("Blues", "Reds", "Greens", "Purples", "Oranges", "Greys")]
    count = {a: sum(r["arm"] == a for r in runs) for a in arms_}
    seen = dict.fromkeys(arms_, 0)
    for r in runs:
        label = f"{r['arm']} eta{r['eta']} x{r['updates']} s{r['seed']}"
        colour = maps[arms_.index(r["arm"]) % len(maps)](0.45 + 0.5 * seen[r["arm"]] / max(1, count[r["arm"]] - 1))
        seen[r["arm"]] += 1
        if len(r["reward"]) >= window:
            axes[0].plot(stats.window_means(r["reward"], window), color=colour, lw=0.8, label=label)
        st = pd.DataFrame(r["steps"])
        for ax, key in ((axes[1], "learner/ess_frac"), (axes[2], "learner/kl_k3")):
            if key in st:
                ax.plot(st["step"], st[key], color=colour, lw=0.8)
    for ax, (title, x) in zip(axes, (("reward (window %d)" % window, "trajectories"), ("ESS / tokens", "step"),
                                     ("KL(behaviour || learner), k3", "step"))):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(x, fontsize=8)
    axes[2].set_yscale("symlog", linthresh=1e-4)
    axes[0].legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def arm_lrs(plan_json: str | None, lr: float | None, names: list[str]) -> dict[str, float]:
    if lr is not None:
        return {n: lr for n in names}
    if not plan_json:
        raise ValueError("give --lr or --plan (a suite's main_plan.json with an lr per arm)")
    chosen = json.loads(Path(plan_json).read_text())["lr"]
    missing = [n for n in names if n not in chosen]
    if missing:
        raise ValueError(f"{plan_json} has no lr for {missing}")
    return {n: float(chosen[n]["lr"]) for n in names}


def table(runs: list[dict]) -> pd.DataFrame:
    keys = ("arm", "eta", "updates", "seed", "lr", "collapsed", "reward_halved", "first_window_reward",
            "last_window_reward", "entropy_first", "entropy_last", "staleness_mean", "staleness_max", "kl_k3_median",
            "kl_k3_max", "clip_frac_low_mean", "clip_frac_high_mean", "ess_frac_median", "ess_frac_min",
            "grad_norm_max")
    return pd.DataFrame([{k: r.get(k) for k in keys} for r in runs])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", required=True)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sweep", action="store_true", help="every (eta, updates), one seed per arm")
    mode.add_argument("--stability", action="store_true", help="one (eta, updates), --seeds, --steps long")
    mode.add_argument("--quick", action="store_true", help="outputs only: two arms, two regimes, a few steps")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--eta", type=int, default=64, help="--stability's staleness bound")
    p.add_argument("--updates", type=int, default=4, help="--stability's updates per batch")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=1000, help="learner steps per run (the stream: steps x batch)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--families", default="arith,string,format,tool")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--plan", help="main_plan.json (experiments/suite_plan.py): each arm's lr")
    p.add_argument("--lr", type=float, help="every arm at this lr instead")
    p.add_argument("--init", help="warm start (default: the suite's own, built and cached)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, in separate processes (threads shared out)")
    p.add_argument("--out", default="runs/bench/offpolicy")
    a = p.parse_args(argv)
    plan = load_plan(a.suite)
    names = a.arms.split(",")
    if a.quick:
        names, a.steps, a.batch, a.window, a.lr = ["sao", "grpo"], 9, 8, 16, a.lr or 2e-4  # 5 critic warm-up steps
        regimes, seeds = [Regime(0, 1), Regime(4, 2)], [0]
    elif a.sweep:
        regimes, seeds = [Regime(e, u) for e in ETAS for u in UPDATES], [int(a.seeds.split(",")[0])]
    else:
        regimes, seeds = [Regime(a.eta, a.updates)], [int(s) for s in a.seeds.split(",")]
    lrs = arm_lrs(a.plan, a.lr, names)
    init = a.init or str(build_init(plan))
    out, t0 = Path(a.out), time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    plan = split_threads(plan, a.jobs)
    calls = [(out, plan, arm, regime, seed, a.steps, a.batch, lrs[arm.name], a.families.split(","), init, a.window)
             for arm in arms(names) for regime in regimes for seed in seeds]
    print(f"[offpolicy] {len(calls)} runs, {a.jobs} at a time (finished ones in {out / 'runs'} reused)", flush=True)
    runs = run_parallel(finished_or_run, calls, a.jobs)
    name = "quick" if a.quick else "sweep" if a.sweep else f"stability-eta{a.eta}-x{a.updates}"
    tab = table(runs)
    result = {"mode": name, "suite": plan.name, "init": init, "steps": a.steps, "batch": a.batch,
              "families": a.families, "window": a.window, "wall_s": round(time.monotonic() - t0, 1),  # this call's
              # the runs' own, whenever they ran (a resumed test reuses run files):
              "runs_wall_s": round(sum(r["summary"]["wall_s"] for r in runs), 1),
              "runs_cpu_s": round(sum(r["summary"]["cpu_s"] for r in runs), 1),
              "table": tab.to_dict("records"), "runs": runs}
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=json_default))
    figure(runs, out / f"{name}.png", a.window)
    print(tab.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
