"""Stability at high asynchrony: SAO for 1,000 learner steps with max staleness 8, next to GRPO and PPO.

Each configuration runs the real pipeline (see experiments/common.py) on a stationary stream (the first
phase of the benchmark scenario, long enough to outlast the run; divided by the group size for GRPO,
so a collapse cannot hide behind a drift) with small batches (8 trajectories, one policy version
each), all tasks published up front, and an agent with 8 tasks in flight that runs up to 8 versions
ahead of the learner (`versions_ahead`, AReaL's eta), so trajectories up to 8 versions old are
trained on. A run stops once the learner has logged `--steps` steps (or at its
time cap). Writes <out>/stability.json and .png: per learner step the windowed reward, clipped
fraction, KL (k3) and entropy; per run the staleness reached, skipped (non-finite) updates and a
collapse verdict: a non-finite update, entropy collapse (common.collapsed) or the windowed reward
halving on the stationary stream.

    .venv/bin/python -m experiments.stability              # 1,000 steps each
    .venv/bin/python -m experiments.stability --quick      # CI (< 1 min): outputs produced and well-formed
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

STALENESS = 8
GROUP = 8
SERIES = ("learner/clip_frac", "learner/kl_k3", "learner/entropy")


def algorithms() -> list[c.Algo]:
    value = ["advantage.estimator=gae", "value.warmup_steps=5"]
    return [c.Algo("sao", "sao", 1, value, "strict double-side clip, value model"),
            c.Algo("ppo", "ppo", 1, value, "one-sided clip, value model"),
            c.Algo("grpo", "ppo", GROUP, ["advantage.estimator=grpo", f"advantage.group_size={GROUP}"],
                   f"groups of {GROUP}")]


@dataclass
class Mode:
    steps: int
    tasks: int  # tasks of the stationary stream for single rollout (divided by n for groups of n)
    max_seconds: float
    agents: int
    window: int
    batch: int = 8  # trajectories per learner step (one policy version each)
    concurrency: int = 8  # tasks in flight per agent
    algos: list[str] = field(default_factory=lambda: ["sao", "ppo", "grpo"])
    pretrain: list[str] = field(default_factory=list)
    learner: list[str] = field(default_factory=lambda: [f"batch.max_staleness={STALENESS}", "batch.tokens=1048576",
                                                         "threads=1"])

    def learner_sets(self) -> list[str]:
        return [*self.learner, f"batch.max_trajectories={self.batch}"]

    def agent_sets(self, group_size: int) -> list[str]:
        """Each version gets one batch of trajectories from the agents together, `STALENESS` versions ahead."""
        share = max(1, self.batch // (group_size * self.agents))
        return [f"concurrency={self.concurrency}", f"tasks_per_version={share}", f"versions_ahead={STALENESS}"]


MODES = {
    "full": Mode(1000, tasks=16_000, max_seconds=550.0, agents=1, window=64),
    "quick": Mode(2, tasks=200, max_seconds=40.0, agents=1, window=8, algos=["sao"],
                  pretrain=["steps=20", "eval_every=0"]),
}


def stationary(base: dict, tasks: int) -> dict:
    """The base scenario's first phase alone, `tasks` long."""
    raw = c.scale_scenario(base, 1.0, 0)
    raw["phases"] = raw["phases"][:1]
    raw["phases"][0]["duration_tasks"] = max(1, tasks)
    return raw


def step_series(learner: pd.DataFrame, traj: pd.DataFrame, window: int, points: int = 200) -> dict[str, list]:
    """Per learner step (thinned to `points`): the windowed online reward of the trajectories finished
    by that step's time, and the step's clip fraction, KL and entropy."""
    if not len(learner):
        return {"step": []}
    lr = learner.sort_values("step")
    idx = np.unique(np.linspace(0, len(lr) - 1, min(points, len(lr))).astype(int))
    sub = lr.iloc[idx]
    out: dict[str, list] = {"step": sub["step"].astype(int).tolist()}
    w = c.ad.windowed_reward(traj["reward"].to_numpy(float), window) if len(traj) else np.zeros(0)
    k = np.searchsorted(traj["finished_at"].to_numpy(float), sub["time"].to_numpy(float), side="right")
    out["reward"] = [float(w[i - 1]) if i else None for i in k]
    for name in SERIES:
        if name in sub:
            out[name.split("/")[-1]] = pd.to_numeric(sub[name], errors="coerce").tolist()
    return out


def measure(algo: str, launched: dict, mode: Mode) -> dict:
    traj, learner, _ = c.read_run(launched["run_dir"])
    lrn = learner.sort_values("step").iloc[:mode.steps] if len(learner) else learner
    pre = traj[traj["finished_at"] <= lrn["time"].max()] if len(lrn) and len(traj) else traj
    hist = c.ad.staleness_from_histograms(json.loads(s) for s in lrn["staleness"]) if len(lrn) else np.zeros(0)
    col = c.ad.collapsed(pre, lrn, mode.window)
    # the stream is stationary, so a reward that halves is a collapse here (not a drift)
    f0, f1 = col["first_window_reward"], col["last_window_reward"]
    reward_drop = bool(len(pre) >= 2 * mode.window and f0 > 0.05 and f1 < 0.5 * f0)
    return {"algo": algo, **launched, "learner_steps": int(len(lrn)), "reached_steps": bool(len(lrn) >= mode.steps),
            "trajectories": int(len(pre)), "gen_tokens": int(pre["n_gen_tokens"].sum()) if len(pre) else 0,
            "staleness": c.ad.staleness_stats(hist), "learner_counts": c.ad.learner_counts(lrn),
            "staleness_share_over_4": float((hist > 4).mean()) if hist.size else None,
            "auc": c.ad.auc(pre["reward"].to_numpy(float), mode.window) if len(pre) else None,
            "masked": c.ad.masked_fraction(lrn), **col, "reward_drop": reward_drop,
            "collapsed": bool(col["collapsed"] or reward_drop),
            "series": step_series(lrn, pre, mode.window)}


def markdown(result: dict) -> str:
    """The result as a Markdown table, every figure read from `result`."""
    f = c.fmt
    lines = ["| config | learner steps | trajectories | staleness mean / p99 / max | share > 4 | clipped | "
             "entropy first -> last | KL k3 max | AUC | collapsed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        st = r["staleness"]
        lines.append(f"| {r['algo']} | {r['learner_steps']} | {r['trajectories']} | "
                     f"{f(st['mean'])} / {f(st['p99'])} / {f(st['max'])} | "
                     f"{f(r['staleness_share_over_4'], '{:.1%}')} | {f(r['masked'].get('clip_frac'), '{:.2%}')} | "
                     f"{f(r['entropy_first'])} -> {f(r['entropy_last'])} | {f(r['kl_k3_max'])} | {f(r['auc'])} | "
                     f"{r['collapsed']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> Path:
    plt = pyplot()
    panels = [("reward", "windowed reward"), ("clip_frac", "clipped fraction"), ("kl_k3", "KL (k3)"),
              ("entropy", "entropy")]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4))
    for ax, (key, label) in zip(axes, panels):
        for r in rows:
            s = r["series"]
            if key in s:
                ax.plot(s["step"], [np.nan if v is None else v for v in s[key]], label=r["algo"], lw=1.2)
        ax.set(xlabel="learner step", title=label)
    axes[0].legend(fontsize=8)
    return save_figure(fig, path, title)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="one tiny SAO run (< 5 min): outputs only, what CI runs")
    p.add_argument("--steps", type=int, help="learner steps of each run")
    p.add_argument("--algos", help="comma-separated subset of sao,ppo,grpo")
    p.add_argument("--max-seconds", type=float)
    p.add_argument("--out", default="runs/bench/stability")
    args = p.parse_args(argv)
    name = "quick" if args.quick else "full"
    mode = MODES[name]
    mode.steps = args.steps or mode.steps
    mode.max_seconds = args.max_seconds or mode.max_seconds
    if args.algos:
        mode.algos = args.algos.split(",")
    out, t0, machine_before = Path(args.out), time.monotonic(), machine()
    base_path = c.snapshot_base()
    base = c.base_scenario(base_path)
    rows = []
    for a in [a for a in algorithms() if a.name in mode.algos]:
        scn = c.write_scenario(stationary(base, mode.tasks // a.group_size),
                               out / "scenarios" / f"g{a.group_size}.yaml")
        print(f"[stability] {a.name}: {mode.steps} steps at max staleness {STALENESS}", flush=True)
        r = c.launch(a, f"stab-{a.name}", scn, out / "runs", c.Budget(learner_steps=mode.steps,
                     max_seconds=mode.max_seconds), mode.pretrain, base_path, agents=mode.agents,
                     extra_sets=mode.learner_sets(), agent_sets=mode.agent_sets(a.group_size))
        rows.append(measure(a.name, r, mode))
    png = plot(rows, out / "stability.png", f"stability ({name}): max staleness {STALENESS}, {mode.steps} steps")
    result = {"bench": "stability", "mode": name,
              "command": " ".join(["python -m experiments.stability", *(argv if argv is not None else sys.argv[1:])]),
              "machine_before": machine_before, "machine_after": machine(), "wall_s": time.monotonic() - t0,
              "settings": asdict(mode), "base_scenario": str(base_path), "max_staleness": STALENESS,
              "algos": c.asdicts(algorithms()),
              "runs": rows, "png": str(png)}
    save_json(result, out / "stability.json")
    (out / "stability.md").write_text(markdown(result) + "\n")
    for r in rows:
        print(f"{r['algo']:>5}: {r['learner_steps']} steps, staleness {r['staleness']}, collapsed {r['collapsed']}, "
              f"auc {r['auc']}, stopped: {r['stopped']}")
    print(f"wrote {out / 'stability.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
