"""Asynchronous SAO against three synchronous baselines (issue 15, item 6), in the simulated harness with the task
stream in real time.

The same drift of the suite (experiments/suites/*.yaml, `--drift`), the same warm start, tasks arriving at `--rate` per
simulated second, tool calls with the suite's long-tailed latency and a learner step of `--learner-step-s`
simulated seconds. Modes (experiments.harness.MODES): async (eta from the suite, up to max_in_flight rollouts running);
sync (a round of `batch` rollouts, then the learner's step; what `sao up --sync` does); sync_one_step (the next round
generates while the learner trains on the last: one step off-policy); sync_overprovision (rounds of batch x 1.25,
the first `batch` to finish trained, the stragglers dropped). Every run: trained trajectories per simulated second,
the staleness of what was trained, the post-drift success against simulated time (by finish time), and the time
from the drift's arrival until the 64-window success first reaches 0.7 (censored at the run's end).

All times are simulated seconds: the comparison is as good as the harness's generation speed, latency and learner
step, which the JSON records.

    .venv/bin/python -m experiments.sync_baselines --suite experiments/suites/drift_v1.yaml --seeds 0,1,2
    .venv/bin/python -m experiments.sync_baselines --suite experiments/suites/drift_v1.yaml --quick   # outputs only
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
from experiments.arms import arm as get_arm
from experiments.harness import MODES, scenario_stream, simulate
from experiments.parallel import run_parallel
from experiments.suite_config import build_init, drift_scenario, load_plan, pick_drifts, sim_config, split_threads
from experiments.suite_runs import json_default

THRESHOLD = 0.7


def time_to(post: pd.DataFrame, drift_at: float, threshold: float, window: int) -> tuple[float, bool]:
    """Simulated seconds from the drift's arrival until the `window`-mean success of the post-drift trajectories,
    in the order they finished, first reaches `threshold`; not reached: the last finish, censored."""
    post = post.sort_values("finished_at")
    n, hit = stats.samples_to(post["success"].to_numpy(float), threshold, window)
    if not len(post):
        return 0.0, False
    at = post["finished_at"].iloc[n - 1] if hit else post["finished_at"].iloc[-1]
    return float(at - drift_at), hit


def run_mode(plan, drift: dict, mode: str, seed: int, init: str, rate: float, step_s: float, lr: float,
             window: int) -> dict[str, Any]:
    sao = get_arm("sao")
    scn = drift_scenario(plan, drift)
    stream = scenario_stream(scn, seed)
    eta = MODES[mode] if MODES[mode] is not None else plan.harness["eta"]
    sim = dataclasses.replace(sim_config(plan, sao, seed), mode=mode, eta=eta, rate=rate, learner_step_s=step_s)
    res = simulate(sim, init, stream, [*sao.learner, f"optim.lr={lr}"], [], scn.rate, log=lambda *_: None)
    t = res.trajectories
    trained = t[t["status"] == "trained"]
    drift_at = float(t[t["phase"] == 1]["started_at"].min()) if (t["phase"] == 1).any() else float("nan")
    post = t[t["phase"] == 1]
    secs, hit = time_to(post, drift_at, THRESHOLD, window)
    fin = t.sort_values("finished_at")
    curve = stats.window_means(fin["success"].astype(float), window)  # curve[i] ends at fin's row i + window - 1
    keep = np.linspace(window - 1, len(fin) - 1, min(400, max(len(fin) - window + 1, 1))).astype(int)
    return {"mode": mode, "seed": seed, "eta": eta, "sim": dataclasses.asdict(sim), "sim_s": float(res.sim_s),
            "trajectories": int(len(t)), "trained": int(len(trained)),
            "trained_per_sim_s": float(len(trained) / max(res.sim_s, 1e-9)),
            "dropped": {k: int(v) for k, v in t["status"].value_counts().items() if k != "trained"},
            "staleness_at_train": {str(k): int(v) for k, v in trained["staleness_at_train"].value_counts().items()},
            "learner_steps": int(len(res.steps)), "drift_at_s": drift_at,
            f"s_to_{THRESHOLD}": secs, f"reached_{THRESHOLD}": hit,
            "post_auc": float(post["reward"].mean()) if len(post) else float("nan"),
            "curve": {"t": fin["finished_at"].to_numpy()[keep].round(2).tolist(),
                      "success": curve[keep - (window - 1)].round(4).tolist()}}


def per_mode(runs: list[dict]) -> list[dict]:
    out = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        rs = [r for r in runs if r["mode"] == mode]
        times, hits = [r[f"s_to_{THRESHOLD}"] for r in rs], [r[f"reached_{THRESHOLD}"] for r in rs]
        out.append({"mode": mode, "seeds": len(rs),
                    "trained_per_sim_s": float(np.mean([r["trained_per_sim_s"] for r in rs])),
                    "trained_per_sim_s_by_seed": [round(r["trained_per_sim_s"], 2) for r in rs],
                    "post_auc": float(np.mean([r["post_auc"] for r in rs])),
                    f"km_median_s_to_{THRESHOLD}": stats.km_median(times, hits), "censored": hits.count(False)})
    return out


def figure(runs: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colours = dict(zip(MODES, ("tab:blue", "tab:red", "tab:orange", "tab:green")))
    for r in runs:
        ax.plot(r["curve"]["t"], r["curve"]["success"], color=colours[r["mode"]], lw=0.9, alpha=0.8,
                label=r["mode"] if r["seed"] == runs[0]["seed"] else None)
        ax.axvline(r["drift_at_s"], color=colours[r["mode"]], lw=0.5, ls=":")
    ax.set_xlabel("simulated seconds (by finish time; dotted: the drift's first rollout)")
    ax.set_ylabel("success (64-window)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", required=True)
    p.add_argument("--drift", default="tool_args", help="a drift of the suite (tool drifts have the latency tail)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rate", type=float, default=24.0, help="task arrivals per simulated second")
    p.add_argument("--learner-step-s", type=float, default=2.0, help="simulated seconds of one learner step")
    p.add_argument("--pre", type=int, default=1024)
    p.add_argument("--post", type=int, default=2048)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--threads", type=int, help="torch threads (default: the suite's harness.threads)")
    p.add_argument("--quick", action="store_true", help="outputs only: a few hundred rollouts, one seed")
    p.add_argument("--init", help="warm start (default: the suite's own, built and cached)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, in separate processes (threads shared out)")
    p.add_argument("--out", default="runs/bench/sync_baselines")
    a = p.parse_args(argv)
    plan = load_plan(a.suite)
    seeds = [0] if a.quick else [int(s) for s in a.seeds.split(",")]
    pre, post, window = (64, 128, 16) if a.quick else (a.pre, a.post, plan.window)
    harness = {**plan.harness, "batch": 16, "max_in_flight": 64} if a.quick else dict(plan.harness)
    harness["threads"] = a.threads or harness["threads"]
    plan = dataclasses.replace(plan, pre=pre, post=post, window=window, harness=harness)
    drift = pick_drifts(plan.drifts, [a.drift])[0]
    init = a.init or str(build_init(plan))
    out, t0 = Path(a.out), time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    plan = split_threads(plan, a.jobs)
    calls = [(plan, drift, mode, seed, init, a.rate, a.learner_step_s, a.lr, window)
             for seed in seeds for mode in a.modes.split(",")]
    print(f"[sync_baselines] {len(calls)} runs, {a.jobs} at a time", flush=True)
    runs = run_parallel(run_mode, calls, a.jobs)
    summary = per_mode(runs)
    result = {"suite": plan.name, "drift": drift, "init": init, "rate": a.rate, "learner_step_s": a.learner_step_s,
              "pre": pre, "post": post, "lr": a.lr, "window": window, "threshold": THRESHOLD,
              "wall_s": round(time.monotonic() - t0, 1), "per_mode": summary, "runs": runs}
    (out / "sync_baselines.json").write_text(json.dumps(result, indent=1, default=json_default))
    figure(runs, out / "sync_baselines.png")
    print(json.dumps(summary, indent=1, default=json_default))
    return 0


if __name__ == "__main__":
    sys.exit(main())
