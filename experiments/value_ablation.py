"""Ablation of SAO's value-model designs on the default scenario's first drift (format and string rule).

Runs `experiments/online.py`'s in-process loop (real engine, environments, learner step; sampling one step behind)
on the first 5,400 tasks of the default scenario (phase 0 and the rule-and-format drift) for: the defaults
(5 critic-only warm-up steps, fixed λ_actor 0.95), no critic warm-up, the length-adaptive λ (α 0.05, which gives
λ = 0 for answers of 20 tokens or fewer, most of this project's).
Writes JSON (per configuration: reward of the new concepts by position, recoveries, first-step policy loss) and
a PNG.

    .venv/bin/python -m experiments.value_ablation --init runs/cache/warmstart-XXXX [--jobs 2]
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.common import machine, pyplot, save_figure, save_json

CONFIGS = {
    "default (warm-up 5, λ 0.95)": [],
    "no critic warm-up": ["value.warmup_steps=0", "value.rewarm_steps=0"],
    "adaptive λ (α 0.05)": ["advantage.adaptive_alpha=0.05"],
}
TASKS = 5400  # phase 0 (1,400) and the rule-and-format phase (4,000) of the default scenario
NEW = {"format": "parens", "string": "sort"}


def one(name: str, sets: list[str], init: str, seed: int) -> dict:
    from experiments.online import online_run
    from streamer.runs.adaptation import drift_recoveries

    traj, steps, drifts = online_run(init, "default", sets, [], seed=seed, threads=1, limit=TASKS,
                                     log=lambda line: print(f"[{name}] {line}", flush=True))
    rec = drift_recoveries(traj, drifts, steps)
    rec = rec[rec["status"] != "unaffected"]
    curves = {}
    for fam, con in NEW.items():
        r = traj[(traj["family"] == fam) & (traj["concept"] == con)]["reward"]
        curves[f"{fam}/{con}"] = [float(r.iloc[i:i + 100].mean()) for i in range(0, len(r), 100)]
    first_policy = steps[steps.get("learner/value_warmup", 0) == 0].head(1)
    return {"name": name, "sets": sets, "seed": seed, "curves_per_100": curves,
            "recoveries": rec[["family", "concept", "status", "pre_level", "initial_level", "trajectories"]]
            .to_dict("records"),
            "mean_reward_phase1": float(traj[traj["phase"] == 1]["reward"].mean()),
            "first_policy_step_loss": float(first_policy["learner/policy_loss"].iloc[0]) if len(first_policy) else None,
            "explained_var_last10": float(steps["learner/explained_variance"].tail(10).mean())
            if "learner/explained_variance" in steps else None}


def plot(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(NEW), figsize=(11, 3.6), sharey=True)
    for ax, key in zip(axes, [f"{f}/{c}" for f, c in NEW.items()]):
        for r in rows:
            ys = r["curves_per_100"][key]
            ax.plot([100 * (i + 1) for i in range(len(ys))], ys, marker=".", label=r["name"])
        ax.set_title(f"new concept {key} after the drift")
        ax.set_xlabel("its trajectories")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("mean reward per 100")
    axes[0].legend(fontsize=7)
    return save_figure(fig, path, "value-model designs (experiments/value_ablation.py)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init", required=True, help="the default scenario's warm-start directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default="runs/bench/value_ablation")
    a = p.parse_args(argv)
    out = Path(a.out)
    with ProcessPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(one, CONFIGS, CONFIGS.values(), [a.init] * len(CONFIGS), [a.seed] * len(CONFIGS)))
    png = plot(rows, out / "value_ablation.png")
    command = " ".join(["python -m experiments.value_ablation", *(argv or sys.argv[1:])])
    save_json({"bench": "value_ablation", "command": command,
               "machine": machine(), "tasks": TASKS, "png": str(png), "runs": rows}, out / "value_ablation.json")
    for r in rows:
        print(f"{r['name']:28s} phase-1 reward {r['mean_reward_phase1']:.3f} "
              + " ".join(f"{x['family']}:{x['status']}@{x['trajectories']}" for x in r["recoveries"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
