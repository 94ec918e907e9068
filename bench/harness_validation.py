"""The simulated harness against the real pipeline (issue 15, item 1): one `sao up` run replayed in the harness.

Reads a finished `sao up` run directory (config.yaml, trajectories.parquet, learner.parquet, summary.json) and runs
the harness on the same scenario, seed, warm start, learner settings and agent sampling settings, with the
asynchrony calibrated from the run itself: generation speed = the run's median generated tokens per second of a
rollout, learner step = the run's median step time, the agents' admission (tasks per version, versions ahead; at
most tasks per version x (versions ahead + 1) x agents in flight), tool latency = the scenario's. Then compares,
with tolerances fixed here before any comparison was run:
- reward: the mean reward of every (phase, family) cell within 0.10 of the real run's;
- staleness: the total variation distance between the trained trajectories' staleness histograms <= 0.25;
- recovery: the same status (recovered / no drop / unaffected / censored) for every (drift, family).
The harness is not the pipeline (one process, a simulated clock), so agreement is expected in what the learner
sees, not in timing.

    .venv/bin/python bench/harness_validation.py runs/default-seed0 --others runs/default-seed1 runs/default-seed2 \
        runs/default-seed-1 --out docs/bench/harness_validation.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/harness_validation.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from bench.harness import SimConfig, scenario_stream, simulate, summary  # noqa: E402
from simulator.latency import LatencyConfig  # noqa: E402
from simulator.scenario import Scenario, load_scenario  # noqa: E402

REWARD_TOL = 0.10
STALENESS_TV_TOL = 0.25
AGENT_KEYS = ("max_new_tokens", "max_turns", "temperature", "top_p")


def reward_cells(t: pd.DataFrame) -> pd.Series:
    return t.groupby(["phase", "family"])["reward"].mean()


def staleness_hist(s: pd.Series) -> pd.Series:
    return s.astype(int).value_counts(normalize=True).sort_index()


def total_variation(p: pd.Series, q: pd.Series) -> float:
    keys = p.index.union(q.index)
    return 0.5 * float((p.reindex(keys, fill_value=0) - q.reindex(keys, fill_value=0)).abs().sum())


def statuses(recoveries: list[dict] | pd.DataFrame) -> dict[str, str]:
    rows = recoveries.to_dict("records") if isinstance(recoveries, pd.DataFrame) else recoveries
    return {f"{r['name']}/{r['family']}": r["status"] for r in rows}


def calibrate(run_dir: Path, cfg: dict, t: pd.DataFrame, scn: Scenario) -> SimConfig:
    """The harness settings of the run: its trajectories `t`, learner table, admission and scenario `scn`."""
    steps = pd.read_parquet(run_dir / "learner.parquet")
    up, agent, learner = cfg["launch"], cfg["agent"], cfg["learner"]
    agents = max(1, json.loads((run_dir / "config.json").read_text())["plan"]["agents"])
    return SimConfig(batch=learner["batch"]["max_trajectories"], eta=learner["batch"]["max_staleness"],
                     max_in_flight=agent["tasks_per_version"] * (agent["versions_ahead"] + 1) * agents,
                     tasks_per_version=agent["tasks_per_version"] * agents, versions_ahead=agent["versions_ahead"],
                     gen_tokens_per_s=float((t["n_gen_tokens"] / t["gen_seconds"]).median()),
                     learner_step_s=float(steps["perf/step_s"].median()),
                     latency=LatencyConfig(**{**scn.latency.__dict__, "sleep": False}), threads=1, seed=up["seed"])


def validate(run_dir: Path) -> dict[str, Any]:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    real = pd.read_parquet(run_dir / "trajectories.parquet")
    scn = load_scenario(cfg["launch"]["scenario"])
    sim = calibrate(run_dir, cfg, real, scn)
    stream = scenario_stream(scn, cfg["launch"]["seed"])
    agent_sets = [f"{k}={cfg['agent'][k]}" for k in AGENT_KEYS]
    res = simulate(sim, cfg["learner"]["io"]["init"], stream, [], agent_sets, scn.rate)
    sim_t = res.trajectories
    cells = pd.DataFrame({"real": reward_cells(real), "harness": reward_cells(sim_t)})
    cells["abs_diff"] = (cells["real"] - cells["harness"]).abs()
    trained_real = real[real["learner_step"].notna()]
    st_real = staleness_hist(trained_real["learner_version"] - trained_real["policy_version"])
    st_sim = staleness_hist(sim_t[sim_t["status"] == "trained"]["staleness_at_train"])
    tv = total_variation(st_real, st_sim)
    rec_real = statuses(json.loads((run_dir / "summary.json").read_text())["recoveries"])
    rec_sim = statuses(res.recoveries)
    same = {k: rec_real.get(k) == rec_sim.get(k) for k in rec_real}
    checks = {"reward_cells_within_tol": bool((cells["abs_diff"] <= REWARD_TOL).all()),
              "staleness_tv_within_tol": tv <= STALENESS_TV_TOL, "recovery_status_same": all(same.values())}
    return {"run": str(run_dir), "sim": {**sim.__dict__, "latency": sim.latency.__dict__},
            "tolerances": {"reward_abs": REWARD_TOL, "staleness_tv": STALENESS_TV_TOL},
            "checks": checks, "agree": all(checks.values()),
            "reward_cells": [{"phase": int(p), "family": f, **{k: float(v) for k, v in row.items()}}
                             for (p, f), row in cells.iterrows()],
            "reward_abs_diff_max": float(cells["abs_diff"].max()),
            "staleness_real": {str(k): float(v) for k, v in st_real.items()},
            "staleness_harness": {str(k): float(v) for k, v in st_sim.items()}, "staleness_tv": tv,
            "recovery_real": rec_real, "recovery_harness": rec_sim,
            "trajectories": {"real": int(len(real)), "harness": int(len(sim_t))},
            "harness_summary": summary(res, sim.threads)}


def real_spread(run_dir: Path, others: list[Path]) -> list[dict[str, Any]]:
    """The same comparisons between the real run and other real runs of the scenario (other seeds): the spread the
    pipeline itself shows, to read the harness's differences against."""
    cells = reward_cells(pd.read_parquet(run_dir / "trajectories.parquet"))
    rec = statuses(json.loads((run_dir / "summary.json").read_text())["recoveries"])
    out = []
    for other in others:
        diff = (cells - reward_cells(pd.read_parquet(other / "trajectories.parquet"))).abs()
        rec_o = statuses(json.loads((other / "summary.json").read_text())["recoveries"])
        out.append({"run": str(other), "reward_abs_diff_max": float(diff.max()),
                    "cells_over_tol": int((diff > REWARD_TOL).sum()),
                    "recovery_status_differs": sorted(k for k in rec if rec[k] != rec_o.get(k))})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--others", nargs="*", default=[], help="other real runs of the scenario (other seeds): the "
                   "pipeline's own spread, reported next to the harness's differences")
    p.add_argument("--out", default="runs/bench/harness_validation.json")
    a = p.parse_args(argv)
    result = validate(Path(a.run_dir))
    result["real_spread"] = real_spread(Path(a.run_dir), [Path(o) for o in a.others])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: result[k] for k in ("checks", "agree", "reward_abs_diff_max", "staleness_real",
                                             "staleness_harness", "staleness_tv")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
