"""Asynchronous against synchronous SAO on an agentic workload with long-tailed tool latency.

The same scenario (benchmark.yaml, scaled, a tool-heavy mix every phase inherits, lognormal tool latency), the same
warm start and the same generated-token budget, run twice through the real pipeline (`sao up` and
`sao up --sync`, see experiments/common.py). Writes <out>/async_vs_sync.json and .png: trajectories/s,
learner idle fraction, staleness distribution against the configured bound, and the windowed
reward reached at each wall-clock minute. Goal: async >= 3x the trained trajectories/s of sync with
every trained trajectory's staleness within `batch.max_staleness`.

    .venv/bin/python -m experiments.async_vs_sync            # < 30 min
    .venv/bin/python -m experiments.async_vs_sync --quick    # CI (~1 min): outputs produced and well-formed
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from bench.common import machine, pyplot, save_figure, save_json
from experiments import common as c

GOAL_SPEEDUP = 3.0


@dataclass
class Mode:
    scale: float
    tokens: int
    max_seconds: float
    agents: int
    window: int
    concurrency: int = 16  # tasks in flight per agent (both modes): tool calls overlap, turns share batches
    latency: dict = field(default_factory=lambda: {"kind": "lognormal", "mean_s": 0.3, "sigma": 1.5, "max_s": 10.0})
    max_staleness: int = 4
    sync_batch: int = 32
    pretrain: list[str] = field(default_factory=list)
    # no critic warm-up, so both modes make the same policy steps from the first batch on
    learner: list[str] = field(default_factory=lambda: ["batch.tokens=1048576", "threads=1", "value.warmup_steps=0"])

    def learner_sets(self) -> list[str]:
        """Both modes train on batches of `sync_batch` trajectories (one policy version each)."""
        return [*self.learner, f"batch.max_trajectories={self.sync_batch}"]

    def agent_sets(self, sync: bool) -> list[str]:
        """Async agents run at most `max_staleness` versions ahead of the learner (AReaL's eta), so
        they never generate what the learner would drop; `sao up --sync` sets 0 ahead itself."""
        ahead = [] if sync else [f"tasks_per_version={self.sync_batch // self.agents}",
                                 f"versions_ahead={self.max_staleness}"]
        return [f"concurrency={self.concurrency}", *ahead]


MODES = {
    "full": Mode(0.1, 40_000, 600.0, 2, 32),
    "quick": Mode(0.01, 300, 40.0, 2, 8, concurrency=4, pretrain=["steps=20", "eval_every=0"], sync_batch=8),
}


def scenario(mode: Mode, out: Path, base: Path) -> Path:
    raw = c.scale_scenario(c.base_scenario(base), mode.scale, 0, latency=mode.latency)
    raw["phases"][0]["families"] = {"arith": 1, "string": 1, "format": 1, "tool": 3}  # later phases inherit it
    return c.write_scenario(raw, out / "scenarios" / "async_vs_sync.yaml")


def idle_fraction(learner: pd.DataFrame) -> float | None:
    """Share of the learner's time spent waiting for data: sum idle / (sum idle + sum step), first
    event left out (its wait includes process start-up and the first rollouts)."""
    if len(learner) < 2 or "perf/idle_s" not in learner:
        return None
    ev = learner.sort_values("step").iloc[1:]
    idle, step = float(ev["perf/idle_s"].sum()), float(ev["perf/step_s"].sum())
    return idle / (idle + step) if idle + step > 0 else None


def staleness_hist(learner: pd.DataFrame) -> dict[str, int]:
    """Trained trajectories per staleness (learner version at training minus behaviour version)."""
    if not len(learner) or "staleness" not in learner:
        return {}
    v = c.ad.staleness_from_histograms(json.loads(s) for s in learner["staleness"])
    keys, counts = np.unique(v.astype(int), return_counts=True)
    return {str(k): int(n) for k, n in zip(keys, counts)}


def reward_per_minute(traj: pd.DataFrame, window: int, step_s: float = 60.0) -> list[dict]:
    """Windowed reward (last `window` trajectories) every `step_s` of wall-clock time from the first
    rollout's start (the last point at the last finish), with the trajectories finished by then."""
    if not len(traj):
        return []
    w = c.ad.windowed_reward(traj["reward"].to_numpy(float), window)
    t = traj["finished_at"].to_numpy(float) - float(traj["started_at"].min())
    marks = list(np.arange(step_s, t.max(), step_s)) + [float(t.max())]
    out = []
    for m in marks:
        k = np.searchsorted(t, m, side="right")
        if k:
            out.append({"minute": round(m / 60.0, 4), "reward": float(w[k - 1]), "trajectories": int(k)})
    return out


def measure(name: str, launched: dict, budget: int, mode: Mode) -> dict:
    traj, learner, _ = c.read_run(launched["run_dir"])
    pre = c.token_prefix(traj, budget)
    lrn = learner[learner["time"] <= pre["finished_at"].max()] if len(pre) and len(learner) else learner
    hist = staleness_hist(lrn)
    smax = max((int(k) for k in hist), default=None)
    # from the first rollout's start: tasks are all published up front, before the roles are up
    span = float(pre["finished_at"].max() - pre["started_at"].min()) if len(pre) else None
    return {"mode": name, **launched, "gen_tokens_total": int(traj["n_gen_tokens"].sum()) if len(traj) else 0,
            "trajectories_in_budget": int(len(pre)), "learner_steps_in_budget": int(len(lrn)),
            "seconds_in_budget": span,
            "trajectories_per_s": len(pre) / span if span else None,
            "trained_trajectories_in_budget": sum(hist.values()),
            "trained_per_s": sum(hist.values()) / span if span else None,
            "gen_tokens_per_s": float(pre["n_gen_tokens"].sum()) / span if span else None,
            "env_seconds_mean": float(pre["env_seconds"].mean()) if len(pre) else None,
            "env_seconds_p99": float(pre["env_seconds"].quantile(0.99)) if len(pre) else None,
            "learner_idle_fraction": idle_fraction(lrn), "staleness_histogram": hist,
            "staleness_max": smax, "staleness_within_bound": smax is not None and smax <= mode.max_staleness,
            "learner_counts": c.ad.learner_counts(lrn),
            "auc": c.ad.auc(pre["reward"].to_numpy(float), mode.window) if len(pre) else None,
            "reward_per_minute": reward_per_minute(pre, mode.window),
            "reward_curve": reward_per_minute(pre, mode.window, step_s=5.0)}


def markdown(result: dict) -> str:
    """The result as a Markdown table, every figure read from `result`."""
    f = c.fmt
    lines = ["| mode | trained trajectories/s | generated trajectories/s | generated tokens/s | learner idle | "
             "staleness max (bound) | dropped stale | AUC | stopped |", "|---|---|---|---|---|---|---|---|---|"]
    bound = result["settings"]["max_staleness"]
    for r in result["runs"]:
        lines.append(f"| {r['mode']} | {f(r['trained_per_s'])} | {f(r['trajectories_per_s'])} | "
                     f"{f(r['gen_tokens_per_s'])} | {f(r['learner_idle_fraction'], '{:.0%}')} | "
                     f"{f(r['staleness_max'], '{}')} ({bound}) | {r['learner_counts'].get('stale', 0)} | "
                     f"{f(r['auc'])} | {r['stopped']} |")
    lines.append(f"\nspeedup, async over sync: {f(result['speedup_trained_per_s'])} in trained trajectories/s, "
                 f"{f(result['speedup_trajectories_per_s'])} in generated trajectories/s (goal "
                 f"{result['goal_speedup']} in trained/s with staleness within the bound, met: {result['goal_met']}); "
                 f"budget {result['token_budget']} generated tokens")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> Path:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for r in rows:
        pts = r["reward_curve"]
        a.plot([p["minute"] for p in pts], [p["reward"] for p in pts],
               label=f"{r['mode']} ({(r['trained_per_s'] or 0):.2f} trained traj/s)")
        h = r["staleness_histogram"]
        total = max(1, sum(h.values()))
        off = -0.2 if r["mode"] == "async" else 0.2
        b.bar([int(k) + off for k in h], [n / total for n in h.values()], width=0.4, label=r["mode"])
    a.set(xlabel="wall-clock minutes from the first rollout", ylabel="windowed reward",
          title="reward reached against wall-clock time")
    b.set(xlabel="staleness (versions)", ylabel="share of trained trajectories", title="staleness")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    return save_figure(fig, path, title)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="tiny runs (< 5 min): outputs only, what CI runs")
    p.add_argument("--tokens", type=int, help="generated-token budget of each run")
    p.add_argument("--max-seconds", type=float, help="safety cap of each run")
    p.add_argument("--agents", type=int)
    p.add_argument("--concurrency", type=int, help="tasks in flight per agent")
    p.add_argument("--out", default="runs/bench/async_vs_sync")
    args = p.parse_args(argv)
    name = "quick" if args.quick else "full"
    mode = MODES[name]
    mode.tokens = args.tokens or mode.tokens
    mode.max_seconds = args.max_seconds or mode.max_seconds
    mode.agents = args.agents or mode.agents
    mode.concurrency = args.concurrency or mode.concurrency
    out, t0, machine_before = Path(args.out), time.monotonic(), machine()
    base = c.snapshot_base()
    scn = scenario(mode, out, base)
    algo = c.Algo("sao", "sao", 1, ["advantage.estimator=gae", f"batch.max_staleness={mode.max_staleness}"])
    budget = c.Budget(gen_tokens=mode.tokens, max_seconds=mode.max_seconds)
    launched = {}
    for label, sync in (("async", False), ("sync", True)):
        print(f"[async_vs_sync] {label}: {mode.agents} agents x {mode.concurrency} tasks in flight, budget "
              f"{mode.tokens} generated tokens", flush=True)
        launched[label] = c.launch(algo, label, scn, out / "runs", budget, mode.pretrain, base, agents=mode.agents,
                                   sync=sync, sync_batch=mode.sync_batch, extra_sets=mode.learner_sets(),
                                   agent_sets=mode.agent_sets(sync))
    totals = [int(c.read_run(r["run_dir"])[0]["n_gen_tokens"].sum()) for r in launched.values()]
    common = min([mode.tokens] + [t for t in totals if t > 0])
    rows = [measure(k, v, common, mode) for k, v in launched.items()]
    a, s = rows
    def ratio(key: str) -> float | None:
        return a[key] / s[key] if a[key] and s[key] else None

    speedup, trained_speedup = ratio("trajectories_per_s"), ratio("trained_per_s")
    png = plot(rows, out / "async_vs_sync.png", f"async vs sync ({name}; {mode.agents} agents x "
               f"{mode.concurrency} in flight; "
               f"{common} generated tokens; lognormal tool latency mean {mode.latency['mean_s']} s)")
    result = {"bench": "async_vs_sync", "mode": name,
              "command": " ".join(["python -m experiments.async_vs_sync",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "machine_before": machine_before, "machine_after": machine(), "wall_s": time.monotonic() - t0,
              "settings": asdict(mode), "base_scenario": str(base), "token_budget": common, "runs": rows,
              "speedup_trajectories_per_s": speedup, "speedup_trained_per_s": trained_speedup,
              "goal_speedup": GOAL_SPEEDUP, "goal_met": bool(trained_speedup is not None and trained_speedup >=
                                                            GOAL_SPEEDUP and a["staleness_within_bound"]),
              "png": str(png)}
    save_json(result, out / "async_vs_sync.json")
    (out / "async_vs_sync.md").write_text(markdown(result) + "\n")
    for r in rows:
        print(f"{r['mode']:>5}: {r['trained_per_s']} trained/s, {r['trajectories_per_s']} generated/s, "
              f"idle {r['learner_idle_fraction']}, "
              f"staleness {r['staleness_histogram']} (max {r['staleness_max']}, bound {mode.max_staleness}), "
              f"stopped: {r['stopped']}")
    print(f"speedup {trained_speedup} trained/s, {speedup} generated/s (goal {GOAL_SPEEDUP}); "
          f"wrote {out / 'async_vs_sync.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
