"""Algorithms under drift: SAO against its ablations and the GRPO family on the benchmark scenario.

Every configuration runs the real pipeline (`sao up`, see experiments/common.py) from the same warm start
(learner.pretrain on simulator/scenarios/benchmark.yaml, cached) with the same budget of generated
tokens, for several seeds, and the script writes <out>/drift_algorithms.json (every run, the table
with mean and 95% interval over seeds, the curves) and <out>/drift_algorithms.png (windowed online
reward, mean with its band over seeds, drift events marked).

Budget: the scenario is benchmark.yaml with every phase scaled by `scale` for single-rollout
configurations and by `scale / n` for groups of n (and its rate divided by n), so every
configuration meets each drift after the same number of rollouts; tasks are published at that rate
(`sao up --realtime`) so the stream keeps its order across the task topic's partitions. A run stops
once its trajectories hold `--tokens` generated tokens (or the scenario ends, or `max_seconds`), and
every metric is computed on the prefix of trajectories (in finish order) within the smallest total
any run reached, so all runs are compared at one token budget.

    .venv/bin/python -m experiments.drift_algorithms                 # full table: 9 configurations x 3 seeds
    .venv/bin/python -m experiments.drift_algorithms --quick         # CI (~2 min): outputs produced and well-formed
    .venv/bin/python -m experiments.drift_algorithms --algos sao,grpo --seeds 0,1 --resume
    .venv/bin/python -m experiments.drift_algorithms --quick --algos all --seeds 0,1,2   # every config, tiny stream
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.common import machine, save_json
from experiments import common as c

GROUP = 8
VALUE = ["advantage.estimator=gae"]


def algorithms(warmup: int) -> list[c.Algo]:
    """The configurations of the table. The coupled-lambda ablation sets lam_actor = lam_critic = 0.95
    (the usual PPO setting: the critic then learns biased GAE targets instead of Monte-Carlo returns)."""
    group = ["advantage.estimator=grpo", f"advantage.group_size={GROUP}"]
    return [
        c.Algo("sao", "sao", 1, VALUE + [f"value.warmup_steps={warmup}"], "single rollout, value model, strict clip"),
        c.Algo("ppo", "ppo", 1, VALUE + [f"value.warmup_steps={warmup}"], "one-sided clip (ablation of the clip)"),
        c.Algo("sao-no-warmup", "sao", 1, VALUE + ["value.warmup_steps=0"], "no critic warm-up"),
        c.Algo("sao-coupled-lam", "sao", 1, VALUE + [f"value.warmup_steps={warmup}", "advantage.lam_actor=0.95",
                                                     "advantage.lam_critic=0.95"], "lam_actor = lam_critic = 0.95"),
        c.Algo("grpo", "ppo", GROUP, group, f"groups of {GROUP}, (R - mean)/std, PPO clip"),
        c.Algo("dapo", "dapo", GROUP, group + ["advantage.dynamic_sampling=true"], "clip-higher, dynamic sampling"),
        c.Algo("dr_grpo", "ppo", GROUP, ["advantage.estimator=dr_grpo", f"advantage.group_size={GROUP}"],
               "R - mean, no std"),
        c.Algo("gspo", "gspo", GROUP, group, "sequence-level ratio"),
        c.Algo("cispo", "cispo", GROUP, group, "clipped stop-gradient IS weight"),
    ]


@dataclass
class Mode:
    algos: list[str]
    seeds: list[int]
    scale: float  # phase lengths of benchmark.yaml times this (single rollout)
    rate: float  # tasks/s published (single rollout; rate / n for groups of n): the stream keeps its order
    tokens: int  # generated-token budget of a run
    max_seconds: float  # safety cap of a run
    window: int  # W of the adaptation metrics (trajectories)
    pretrain: list[str] = field(default_factory=list)
    warmup: int = 5  # critic-only steps of the configurations with a warm-up
    learner: list[str] = field(default_factory=lambda: ["batch.tokens=1024", "threads=1"])
    agent: list[str] = field(default_factory=lambda: ["concurrency=8"])  # tasks in flight per agent


ALL = [a.name for a in algorithms(0)]
MODES = {
    "full": Mode(ALL, [0, 1, 2], scale=0.05, rate=14.0, tokens=22_000, max_seconds=170.0, window=32),
    "quick": Mode(["sao", "grpo"], [0], scale=0.01, rate=20.0, tokens=400, max_seconds=40.0, window=8,
                  pretrain=["steps=20", "eval_every=0"], warmup=1),
}


def scenarios(mode: Mode, seed: int, out: Path, sizes: set[int], base_path: Path) -> dict[int, Path]:
    base = c.base_scenario(base_path)
    return {g: c.write_scenario(c.scale_scenario(base, mode.scale / g, seed, rate=mode.rate / g),
                                out / "scenarios" / f"s{seed}-g{g}.yaml") for g in sorted(sizes)}


def drift_marks(mode: Mode, base_path: Path) -> list[tuple[float, str]]:
    """Rollouts at which each phase starts (the same for every group size by construction)."""
    phases = c.scale_scenario(c.base_scenario(base_path), mode.scale, 0)["phases"]
    at, out = 0, []
    for p in phases:
        if at:
            out.append((float(at), f"{p['name']} ({p.get('schedule', 'abrupt')})"))
        at += p["duration_tasks"]
    return out


def run_all(mode: Mode, out: Path, resume: bool, base: Path, log=print) -> list[dict]:
    algos = [a for a in algorithms(mode.warmup) if a.name in mode.algos]
    runs_dir, done = out / "runs", []
    for seed in mode.seeds:
        scn = scenarios(mode, seed, out, {a.group_size for a in algos}, base)
        for a in algos:
            name = f"{a.name}-s{seed}".replace("_", "-")
            kept = runs_dir / name / "bench_launch.json"
            if resume and kept.is_file() and (runs_dir / name / "summary.json").is_file():
                log(f"[drift] {name}: kept (--resume)")
                done.append(json.loads(kept.read_text()))
                continue
            log(f"[drift] {name}: loss {a.loss}, group {a.group_size}, sets {a.sets}")
            budget = c.Budget(gen_tokens=mode.tokens, max_seconds=mode.max_seconds)
            r = c.launch(a, name, scn[a.group_size], runs_dir, budget, mode.pretrain, base, seed=seed,
                         extra_sets=mode.learner, realtime=True, evaluate=True, agent_sets=mode.agent)
            done.append({"algo": a.name, "seed": seed, **r})
            save_json(done[-1], kept)
    return done


def measure(runs: list[dict], mode: Mode) -> tuple[list[dict], int, dict]:
    """Per-run metrics at the common token budget, and the curves on a common grid."""
    data = {r["run_dir"]: c.read_run(r["run_dir"]) for r in runs}
    totals = [int(t["n_gen_tokens"].sum()) if len(t) else 0 for t, _, _ in data.values()]
    budget = min([mode.tokens] + [t for t in totals if t > 0])
    rows, curves = [], {}
    prefixes = {k: c.token_prefix(t, budget) for k, (t, _, _) in data.items()}
    n_grid = max(1, min(len(p) for p in prefixes.values()))
    grid = np.unique(np.linspace(1, n_grid, min(n_grid, 200)).astype(int))
    for r, total in zip(runs, totals):
        traj, learner, drift = data[r["run_dir"]]
        pre = prefixes[r["run_dir"]]
        lrn = learner[learner["time"] <= pre["finished_at"].max()] if len(pre) and len(learner) else learner
        final = {f"{f}/{k}": float(g["reward"].to_numpy(float)[-mode.window:].mean())
                 for (f, k), g in pre.groupby(["family", "concept"])} if len(pre) else {}
        forget = c.ad.forgetting(pre, drift, mode.window).to_dict(orient="records") if len(pre) and drift else []
        rows.append({**r, "gen_tokens_total": total, "trajectories_in_budget": int(len(pre)),
                     "learner_steps_in_budget": int(len(lrn)),
                     "auc": c.ad.auc(pre["reward"].to_numpy(float), mode.window) if len(pre) else None,
                     "recovery": c.ad.recovery_by_kind(pre, lrn, drift, mode.window), "final_reward_per_concept": final,
                     "forgetting": forget,
                     "forgetting_mean": c.ad.forgetting_mean(forget),
                     "masked": c.ad.masked_fraction(lrn), "learner_counts": c.ad.learner_counts(lrn),
                     **c.ad.collapsed(pre, lrn, mode.window)})
        curves.setdefault(r["algo"], []).append(c.curve(pre, grid, mode.window))
    return rows, budget, {"x": grid.tolist(), "per_algo": curves}


def table(rows: list[dict]) -> dict[str, dict]:
    """Mean and 95% interval over seeds of every figure, per configuration."""
    out: dict[str, dict] = {}
    for algo in dict.fromkeys(r["algo"] for r in rows):
        rs = [r for r in rows if r["algo"] == algo]
        t = {"runs": len(rs), "collapsed_runs": sum(bool(r["collapsed"]) for r in rs),
             "auc": c.mean_ci([r["auc"] for r in rs]),
             "forgetting": c.mean_ci([r["forgetting_mean"] for r in rs]),
             "masked_fraction": c.mean_ci([r["masked"].get("clip_frac") for r in rs]),
             "masked_low": c.mean_ci([r["masked"].get("clip_frac_low") for r in rs]),
             "masked_high": c.mean_ci([r["masked"].get("clip_frac_high") for r in rs])}
        for kind in sorted({k for r in rs for k in r["recovery"]}):
            per = [r["recovery"].get(kind) or {} for r in rs]
            # censored recoveries are counted, never averaged: the median is over recovered records only
            t[f"recovery_median/{kind}"] = c.mean_ci([p.get("median_trajectories") for p in per])
            t[f"recovery_counts/{kind}"] = {s: sum(p.get("by_status", {}).get(s, 0) for p in per)
                                            for s in c.ad.STATUSES}
        for concept in sorted({k for r in rs for k in r["final_reward_per_concept"]}):
            t[f"final_reward/{concept}"] = c.mean_ci([r["final_reward_per_concept"].get(concept) for r in rs])
        out[algo] = t
    return out


def markdown(tab: dict[str, dict]) -> str:
    """The headline columns as a Markdown table: mean [95% interval] over seeds; a recovery cell is
    'recovered/drifted (family, event) records over the seeds, med: mean over seeds of each run's
    median recovery in trajectories of the family' (recovered records only: censored ones are counted)."""
    kinds = sorted({k.split("/", 1)[1] for t in tab.values() for k in t if k.startswith("recovery_counts/")})
    cols = ["auc"] + [f"recovery/{k}" for k in kinds] + ["forgetting", "masked_fraction"]
    lines = ["| config | " + " | ".join(cols) + " | collapsed |", "|" + "---|" * (len(cols) + 2)]
    for algo, t in tab.items():
        cells = [_recovery_cell(t, k.split("/", 1)[1]) if k.startswith("recovery/") else _cell(t.get(k)) for k in cols]
        lines.append(f"| {algo} | " + " | ".join(cells) + f" | {t['collapsed_runs']}/{t['runs']} |")
    return "\n".join(lines)


def _cell(v) -> str:
    if not isinstance(v, dict) or v.get("mean") is None or v["mean"] != v["mean"]:
        return "-"
    return f"{v['mean']:.3g} [{v['lo']:.3g}, {v['hi']:.3g}]" if v["n"] > 1 else f"{v['mean']:.3g}"


def _recovery_cell(t: dict, kind: str) -> str:
    n = t.get(f"recovery_counts/{kind}")
    if not n:
        return "-"
    drifted = sum(n.values()) - n["unaffected"]
    return f"{n['recovered']}/{drifted}, med {_cell(t.get(f'recovery_median/{kind}'))}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="2 tiny runs (< 5 min): outputs only, what CI runs")
    p.add_argument("--algos", help=f"'all' or a comma-separated subset of {','.join(ALL)}")
    p.add_argument("--seeds", help="comma-separated seeds")
    p.add_argument("--tokens", type=int, help="generated-token budget of a run")
    p.add_argument("--max-seconds", type=float, help="safety cap of a run")
    p.add_argument("--out", default="runs/bench/drift_algorithms")
    p.add_argument("--resume", action="store_true", help="keep runs that already have a summary.json")
    args = p.parse_args(argv)
    mode_name = "quick" if args.quick else "full"
    mode = MODES[mode_name]
    if args.algos == "all":
        args.algos = ",".join(ALL)
    if args.algos:
        unknown = set(args.algos.split(",")) - set(ALL)
        if unknown:
            p.error(f"--algos: unknown {', '.join(sorted(unknown))} (known: {', '.join(ALL)})")
        mode.algos = args.algos.split(",")
    if args.seeds:
        mode.seeds = [int(s) for s in args.seeds.split(",")]
    mode.tokens = args.tokens or mode.tokens
    mode.max_seconds = args.max_seconds or mode.max_seconds
    out = Path(args.out)
    t0, machine_before = time.monotonic(), machine()
    base = c.snapshot_base()
    runs = run_all(mode, out, args.resume, base)
    rows, budget, curves = measure(runs, mode)
    tab = table(rows)
    series = {a: (np.asarray(curves["x"]), *c.band(cs)) for a, cs in curves["per_algo"].items()}
    png = c.plot_bands(series, out / "drift_algorithms.png",
                       f"Online reward under drift ({mode_name}; {len(mode.seeds)} seed(s); {budget} generated tokens)",
                       "trajectories (rollouts)", f"windowed reward (W={mode.window})", drift_marks(mode, base))
    result = {"bench": "drift_algorithms", "mode": mode_name,
              "command": " ".join(["python -m experiments.drift_algorithms",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "machine_before": machine_before, "machine_after": machine(),
              "wall_s": time.monotonic() - t0, "runs_wall_s": sum(r.get("wall_s") or 0.0 for r in runs),
              "settings": asdict(mode), "token_budget": budget,
              "budget_note": "phases scaled by scale/group_size; runs stop at the token budget; metrics on the "
                             "prefix within the smallest total any run reached",
              "algos": c.asdicts(a for a in algorithms(mode.warmup) if a.name in mode.algos),
              "drift_marks": [{"x": x, "label": s} for x, s in drift_marks(mode, base)],
              "base_scenario": str(base),
              "table": tab, "runs": rows,
              "curves": {"x": curves["x"], **{a: dict(zip(("mean", "lo", "hi"), (v.tolist() for v in s[1:])))
                                              for a, s in series.items()}},
              "png": str(png)}
    save_json(result, out / "drift_algorithms.json")
    (out / "drift_algorithms.md").write_text(markdown(tab) + "\n")
    print(markdown(tab))
    print(f"wrote {out / 'drift_algorithms.json'} and {png} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
