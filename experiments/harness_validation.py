"""The simulated harness against the real pipeline (issue 15, item 1): one `sao up` run replayed in the harness.

Reads a finished `sao up` run directory (config.yaml, trajectories.parquet, learner.parquet, summary.json) and runs
the harness on the same scenario (the run's scenario.yaml, or `--scenario` for a run from before `sao up` kept one:
checked against the run's drift positions; the first pooled validation replayed two runs on the default scenario as
edited after they ran), seed, warm start, learner settings and agent sampling settings, with the
asynchrony calibrated from the run itself: generation speed = the run's median generated tokens per second of a
rollout, learner step = the run's median step time, the agents' admission (tasks per version, versions ahead; at
most tasks per version x (versions ahead + 1) x agents in flight), tool latency = the scenario's. Then compares,
with tolerances fixed here before any comparison was run:
- reward: the mean reward of every (phase, family) cell within 0.10 of the real run's;
- staleness: the total variation distance between the trained trajectories' staleness histograms <= 0.25;
- recovery: the same status (recovered / no drop / unaffected / censored) for every (drift, family).
The harness is not the pipeline (one process, a simulated clock), so agreement is expected in what the learner
sees, not in timing.

`--pooled` (the second validation, written before it was run, after the first one on seed 0 missed two of its
three tolerances while the real seeds differed from each other by up to 0.151 in a cell): every run given is replayed
on its own seed and calibration as above, and the same three tolerances are applied to what the seeds share: the
mean reward of each (phase, family) cell over the runs, the mean of the runs' staleness histograms, and the status
each (drift, family) has in most runs (a tie reads as "mixed"). The per-run comparisons are kept beside it, and
each cell's harness - pipeline difference over the runs with its 95% t interval (`bias`): an interval that excludes 0
is a bias of the harness, one that holds 0 a difference the runs cannot tell from noise.

The fourth validation (a replication, written and committed before it was run, after the third missed the reward
tolerance in one cell, string in phase 1, by 0.007): three new seeds of `sao up` (3, 4, 5) on the same 24,800-task
default scenario, replayed with `--pooled`; the same three tolerances, unchanged, on their own pool (a new sample,
not added to the third's). Beside it, `--from` pools the per-run results of both JSON files (no replay) for every
cell's difference over the six seeds and its t interval.

    .venv/bin/python -m experiments.harness_validation runs/default-seed0 \
        --others runs/default-seed1 runs/default-seed2 runs/default-seed-1 --out docs/results/harness_validation.json
    .venv/bin/python -m experiments.harness_validation runs/default-seed0 runs/default-seed1 runs/default-seed2 \
        --pooled --scenario docs/results/runs/default/2026-12-02-19400-tasks/scenario.yaml --jobs 2 \
        --out docs/results/harness_validation_pooled.json
    .venv/bin/python -m experiments.harness_validation runs/v2/default-seed3 runs/v2/default-seed4 \
        runs/v2/default-seed5 --pooled --jobs 2 --out docs/results/harness_validation_replication.json
    .venv/bin/python -m experiments.harness_validation --from docs/results/harness_validation_pooled_24800.json \
        docs/results/harness_validation_replication.json --out docs/results/harness_validation_six_seeds.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from experiments.harness import SimConfig, scenario_stream, simulate, summary
from experiments.parallel import run_parallel
from experiments.stats import t_interval
from simulator.latency import LatencyConfig
from simulator.scenario import Scenario, load_scenario
from streamer.runs.readers import read_drift

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


def same_batches(real: pd.DataFrame, sim_t: pd.DataFrame) -> dict[str, int]:
    """Learner steps of the run and of the replay, and how many of the run's steps trained on exactly the same tasks
    in the replay's step of that number: whether the harness reproduces the pipeline's data flow, not only its
    rewards."""
    pipe = real[real["learner_step"].notna()].groupby("learner_step")["task_id"].apply(frozenset)
    harn = sim_t[sim_t["status"] == "trained"].groupby("trained_step")["task_id"].apply(frozenset)
    same = sum(int(harn.get(k) == tasks) for k, tasks in pipe.items())
    return {"steps_real": int(len(pipe)), "steps_harness": int(len(harn)), "identical_task_sets": same}


def cell_rows(cells: pd.DataFrame) -> list[dict[str, Any]]:
    """A (phase, family)-indexed table of reward cells as JSON rows."""
    return [{"phase": int(p), "family": f, **{k: float(v) for k, v in row.items()}} for (p, f), row in cells.iterrows()]


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


def ran_scenario(run_dir: Path, cfg: dict, given: str | None = None) -> tuple[Scenario, str]:
    """The scenario the run ran: its copy in the run directory (`sao up` writes scenario.yaml), else `given` (a run
    from before that copy), else the name in its config.yaml, which may have been edited since: checked against the
    task positions of the drifts the run recorded (drift.jsonl)."""
    copy = run_dir / "scenario.yaml"
    source = str(copy) if copy.exists() else given or cfg["launch"]["scenario"]
    scn = load_scenario(source)
    if all(ph.duration_tasks for ph in scn.phases):
        ran = [ev.at_seq for ev in read_drift(run_dir)]
        starts = list(itertools.accumulate(ph.duration_tasks for ph in scn.phases))[:-1]
        if ran != starts:
            raise ValueError(f"{run_dir}: its drifts came at tasks {ran}, but the phases of {source} start at "
                             f"{starts}: not the scenario this run ran (give that one with --scenario)")
    return scn, source


def validate(run_dir: Path, scenario: str | None = None) -> dict[str, Any]:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    real = pd.read_parquet(run_dir / "trajectories.parquet")
    scn, source = ran_scenario(run_dir, cfg, scenario)
    sim = calibrate(run_dir, cfg, real, scn)
    stream = scenario_stream(scn, cfg["launch"]["seed"])
    agent_sets = [f"{k}={cfg['agent'][k]}" for k in AGENT_KEYS]
    loss = cfg["learner"]["loss"]
    learner_sets = [f"loss.{k}={loss[k]}" for k in ("kl_type", "kl_coef") if k in loss]  # the run's anchor
    res = simulate(sim, cfg["learner"]["io"]["init"], stream, learner_sets, agent_sets, scn.rate)
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
    return {"run": str(run_dir), "scenario": source, "sim": {**sim.__dict__, "latency": sim.latency.__dict__},
            "tolerances": {"reward_abs": REWARD_TOL, "staleness_tv": STALENESS_TV_TOL},
            "checks": checks, "agree": all(checks.values()),
            "reward_cells": cell_rows(cells),
            "reward_abs_diff_max": float(cells["abs_diff"].max()),
            "staleness_real": {str(k): float(v) for k, v in st_real.items()},
            "staleness_harness": {str(k): float(v) for k, v in st_sim.items()}, "staleness_tv": tv,
            "recovery_real": rec_real, "recovery_harness": rec_sim,
            "trajectories": {"real": int(len(real)), "harness": int(len(sim_t))},
            "same_batches": same_batches(real, sim_t),
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


def majority(values: list[str]) -> str:
    """The value most runs have; "mixed" when the most common ones tie."""
    counts = Counter(values).most_common()
    return counts[0][0] if len(counts) == 1 or counts[0][1] > counts[1][1] else "mixed"


def total_same_batches(results: list[dict[str, Any]]) -> dict[str, int] | None:
    """`same_batches` summed over the runs that report it (results written before it existed do not)."""
    have = [r["same_batches"] for r in results if "same_batches" in r]
    if not have:
        return None
    return {"runs": len(have), **{k: sum(h[k] for h in have) for k in have[0]}}


def pool(results: list[dict[str, Any]]) -> dict[str, Any]:
    """`validate`'s results of several seeds compared on what they share, with the same tolerances: mean reward per
    cell over the runs, the mean staleness histogram, the majority recovery status."""
    per_run = pd.DataFrame([c for r in results for c in r["reward_cells"]])
    per_run["diff"] = per_run["harness"] - per_run["real"]
    by_cell = per_run.groupby(["phase", "family"])
    cells = by_cell[["real", "harness"]].mean()
    cells["abs_diff"] = (cells["real"] - cells["harness"]).abs()
    bias = [{"phase": int(p), "family": f, **t_interval(g["diff"])} for (p, f), g in by_cell]
    hist = {side: pd.DataFrame([r[f"staleness_{side}"] for r in results]).fillna(0.0).mean()
            for side in ("real", "harness")}
    tv = total_variation(hist["real"], hist["harness"])
    rec = {side: {k: majority([r[f"recovery_{side}"].get(k, "absent") for r in results])
                  for k in results[0]["recovery_real"]} for side in ("real", "harness")}
    checks = {"reward_cells_within_tol": bool((cells["abs_diff"] <= REWARD_TOL).all()),
              "staleness_tv_within_tol": tv <= STALENESS_TV_TOL,
              "recovery_status_same": all(rec["real"][k] == rec["harness"][k] for k in rec["real"])}
    return {"runs": [r["run"] for r in results], "tolerances": {"reward_abs": REWARD_TOL,
                                                                "staleness_tv": STALENESS_TV_TOL},
            "checks": checks, "agree": all(checks.values()),
            "reward_cells": cell_rows(cells),
            "reward_abs_diff_max": float(cells["abs_diff"].max()),
            "staleness_real": hist["real"].to_dict(), "staleness_harness": hist["harness"].to_dict(),
            "staleness_tv": tv, "recovery_real": rec["real"], "recovery_harness": rec["harness"],
            "bias": bias, "same_batches": total_same_batches(results), "per_run": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="*", help="the real run (with --pooled: every seed's run)")
    p.add_argument("--others", nargs="*", default=[], help="other real runs of the scenario (other seeds): the "
                   "pipeline's own spread, reported next to the harness's differences")
    p.add_argument("--pooled", action="store_true", help="replay every run given and compare their means")
    p.add_argument("--scenario", help="the scenario file the runs ran, for runs without their own scenario.yaml")
    p.add_argument("--jobs", type=int, default=1, help="--pooled: replays at once (one thread each)")
    p.add_argument("--from", dest="from_json", nargs="+", default=[], metavar="JSON",
                   help="pool the per-run results of earlier --pooled outputs (no replay)")
    p.add_argument("--out", default="runs/bench/harness_validation.json")
    a = p.parse_args(argv)
    if a.from_json:
        if a.run_dir or a.pooled:
            p.error("--from pools earlier outputs: give no run_dir and no --pooled")
        result = pool([r for f in a.from_json for r in json.loads(Path(f).read_text())["per_run"]])
    elif not a.run_dir:
        p.error("give a run_dir, or --from")
    elif a.pooled:
        result = pool(run_parallel(validate, [(Path(r), a.scenario) for r in a.run_dir], a.jobs))
    elif len(a.run_dir) > 1:
        p.error("one run_dir (the others go after --others), or several with --pooled")
    else:
        result = validate(Path(a.run_dir[0]), a.scenario)
        result["real_spread"] = real_spread(Path(a.run_dir[0]), [Path(o) for o in a.others])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: result[k] for k in ("checks", "agree", "reward_abs_diff_max", "staleness_real",
                                             "staleness_harness", "staleness_tv")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
