"""Running a suite's arms: each (arm, drift, seed) run through the harness, written to its run file and reused
when one with the same settings is there; drifts from one concept share their pre-drift simulation
(`run_branches`); the pilot's admissibility check."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from experiments.arms import Arm, arms
from experiments.common import init_sha256, reusable_run
from experiments.common_start import (
    post_drift_stream,
    reference_arm,
    start_dir,
    start_settings,
    train_common_start,
)
from experiments.compute import critic_share, prefix_compute, step_costs
from experiments.harness import (
    Result,
    SimConfig,
    by_phase,
    phase_prefix,
    scenario_stream,
    simulate,
    simulate_branches,
    summary,
)
from experiments.harness.admission import UNIFORM_DROPPED
from experiments.parallel import run_parallel
from experiments.suite_config import Plan, drift_scenario, lr_of, post_of, sim_config, split_threads
from learner.config import LearnerConfig
from simulator.scenario import Scenario
from streamer.wire.config import load_config
from streamer.wire.schema import DriftEvent, Task

STEP_KEYS = ("step", "version", "skipped", "n", "n_tokens", "sim_time", "staleness_mean", "staleness_max",
             "learner/ess_frac", "learner/policy_loss", "learner/value_loss", "learner/clip_frac",
             "learner/clip_frac_low", "learner/clip_frac_high", "learner/kl_k1", "learner/kl_k3", "learner/kl_ref",
             "learner/ratio_max", "learner/entropy", "learner/grad_norm", "learner/value_warmup",
             "learner/explained_variance")


def post_drift(traj: pd.DataFrame) -> pd.DataFrame:
    """The drift phase's trajectories in stream order (task seq, then group member)."""
    return traj[traj["phase"] == 1].sort_values(["seq", "member"]).reset_index(drop=True)


def pre_key(drift: dict) -> str:
    """What names a drift's pre-drift tasks in a suite with shared pre-drift phases: its family and first concept."""
    return f"{drift['family']}.{drift['from']}"


def drift_stream(plan: Plan, drift: dict, seed: int, group_size: int) -> tuple[list[Task | DriftEvent], Scenario]:
    """The drift's task stream for an arm with groups of `group_size` (`phase_prefix`). With `plan.shared_pre`, its
    pre-drift tasks are named by `pre_key`, not by the drift: drifts from one concept then start with the same tasks
    (the same rollout seeds) and `run_branches` simulates them once."""
    scn = drift_scenario(plan, drift)
    stream = scenario_stream(scn, seed)
    if plan.shared_pre:
        stream = [msgspec.structs.replace(m, task_id=f"{pre_key(drift)}-{seed}-{m.seq}")
                  if isinstance(m, Task) and m.phase == 0 else m for m in stream]
    return phase_prefix(stream, group_size), scn


def common_start(plan: Plan, drift: dict, seed: int, init: str, out_dir: Path, log=print) -> dict[str, Any]:
    """The checkpoint every arm starts `drift` from (`experiments.common_start`): trained once per pre-drift concept
    and seed, reused after."""
    ref = plan.reference or reference_arm(plan.common_start)
    stream, scn = drift_stream(plan, drift, seed, 1)
    sim = sim_config(plan, ref, seed)
    settings = start_settings(ref, plan.pre, pre_key(drift), seed, json.loads(json.dumps(
        dataclasses.asdict(sim), default=json_default)), learner_sets(plan, ref), init)
    return train_common_start(start_dir(out_dir, pre_key(drift), seed), settings, sim, stream, scn.rate, log)


def run_branches(plan: Plan, arm: Arm, drifts: list[dict], seed: int, init: str, out_dir: Path,
                 log=print) -> list[dict[str, Any]]:
    """One run of `arm` on each drift (same seed), written to its run file; several drifts that start with the same
    tasks share their simulation of those (`simulate_branches`), each run's result the same as alone. With
    `plan.common_start`, each run is the post-drift phase alone from the drift's common checkpoint."""
    streams, scns = zip(*(drift_stream(plan, d, seed, arm.group_size) for d in drifts))
    sim, sets = sim_config(plan, arm, seed), run_settings(plan, arm, drifts[0], seed)["learner_sets"]
    for d, stream in zip(drifts, streams):
        log(f"[suite] {d['name']} {arm.name} seed {seed}: {len(stream)} stream items, sim {sim}")
    if plan.common_start:
        results = [simulate(sim, init, post_drift_stream(s), sets, [], scn.rate, log,
                            start_from=str(start_dir(out_dir, pre_key(d), seed))) for d, s, scn in
                   zip(drifts, streams, scns)]
    elif len(drifts) == 1:
        results = [simulate(sim, init, streams[0], sets, [], scns[0].rate, log)]
    else:
        results = simulate_branches(sim, init, list(streams), sets, [], scns[0].rate, log)
    return [write_run(plan, arm, d, seed, init, out_dir, res, sim.threads) for d, res in zip(drifts, results)]


def write_run(plan: Plan, arm: Arm, drift: dict, seed: int, init: str, out_dir: Path, res: Result,
              threads: int) -> dict[str, Any]:
    """The run's file: its settings, summary, by-phase table, recoveries, learner steps and post-drift rewards, with
    each post-drift rollout's learner steps before its start (`post_drift_learner_steps`), its finish in simulated s
    after the first post-drift start and its prefix's compute (experiments.compute); and the post-drift rollouts that
    DAPO's dynamic sampling dropped (their groups' rewards all equal: no learner step trained on them)."""
    settings = run_settings(plan, arm, drift, seed)
    if plan.common_start:
        meta = json.loads((start_dir(out_dir, pre_key(drift), seed) / "start.json").read_text())
        settings["common_start"] = {k: v for k, v in meta.items() if k != "settings"}
    steps = res.steps[[k for k in STEP_KEYS if k in res.steps]] if len(res.steps) else res.steps
    post = post_drift(res.trajectories)
    at_start, post_steps = post_drift_learner_steps(post, res.steps, settings["sim"]["learner_step_s"])
    cfg = load_config(LearnerConfig, None, settings["learner_sets"])
    costs = step_costs(res.steps.sort_values("sim_time") if len(res.steps) else res.steps, critic_share(cfg, init),
                       cfg.optim.updates_per_batch)
    compute = prefix_compute(post["n_gen"].to_numpy(), at_start, costs[len(costs) - post_steps:])
    run = {"suite": plan.name, "arm": arm.name, "drift": drift["name"], "seed": seed, "init": init,
           "init_sha256": init_sha256(init),
           "provisional": bool(plan.provisional), "provisional_values": plan.provisional,
           **settings, "summary": summary(res, threads),
           "by_phase": by_phase(res.trajectories), "recoveries": res.recoveries.to_dict("records"),
           "steps": steps.to_dict("records"),
           "post_drift": {"reward": post["reward"].tolist(), "success": post["success"].astype(float).tolist(),
                          "n_gen": post["n_gen"].astype(int).tolist(), "learner_step": at_start.tolist(),
                          "finished_s": (post["finished_at"] - post["started_at"].min()).round(4).tolist(),
                          "compute": compute.round(1).tolist()},
           "post_drift_learner_steps": post_steps,
           "post_drift_dropped_uniform": int((post["status"] == UNIFORM_DROPPED).sum())}
    path = run_path(out_dir, arm, drift, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run, indent=1, default=json_default))
    return run


def post_drift_learner_steps(post: pd.DataFrame, steps: pd.DataFrame, learner_step_s: float) -> tuple[np.ndarray, int]:
    """Per post-drift trajectory (`post_drift`'s rows), the learner steps completed after the first post-drift rollout
    started and before it started; and the run's post-drift learner steps (all those completed after that first
    start). A step completes at its sim_time + learner_step_s, when its version is published; at one time the harness
    runs steps and publications before admissions (harness.clock.ORDER), so a step at a rollout's start precedes it."""
    started = post["started_at"].to_numpy(float)
    if not len(started):
        return np.zeros(0, dtype=int), 0
    done = np.sort(steps["sim_time"].to_numpy(float) + learner_step_s) if len(steps) else np.zeros(0)
    first = int(np.searchsorted(done, started.min(), side="right"))
    return np.searchsorted(done, started, side="right") - first, len(done) - first


def run_path(out_dir: Path, arm: Arm, drift: dict, seed: int) -> Path:
    return out_dir / "runs" / f"{drift['name']}-{arm.name}-s{seed}.json"


def run_settings(plan: Plan, arm: Arm, drift: dict, seed: int) -> dict[str, Any]:
    """What a run's result depends on besides its init: a run file with the same is that run (`finished_run`)."""
    sim = dataclasses.asdict(sim_config(plan, arm, seed))
    sets = learner_sets(plan, arm)
    return {"drift_def": drift, "pre": plan.pre, "post": post_of(plan, drift),
            "learner_sets": sets,
            "sim": json.loads(json.dumps(sim, default=json_default)),
            **({"shared_pre_drift": True} if plan.shared_pre else {}),
            **({"common_start_arm": plan.common_start} if plan.common_start else {})}


def learner_sets(plan: Plan, arm: Arm) -> list[str]:
    return [*arm.learner, f"optim.lr={lr_of(plan, arm)}", *plan.learner, *plan.learner_sets]


def finished_run(plan: Plan, arm: Arm, drift: dict, seed: int, init: str, out_dir: Path) -> dict | None:
    """The run's file in `out_dir` when it was written with these very settings, else None."""
    return reusable_run(run_path(out_dir, arm, drift, seed), *_wanted(plan, arm, drift, seed, init))


def _wanted(plan: Plan, arm: Arm, drift: dict, seed: int, init: str):
    """What a run file must hold to be this run, and how an older file is completed first: a SimConfig field added
    after the file was written had its default then."""
    defaults = json.loads(json.dumps(dataclasses.asdict(SimConfig()), default=json_default))
    want = {"init": init, "init_sha256": init_sha256(init), **run_settings(plan, arm, drift, seed)}
    return want, lambda run: {**run, "sim": {**defaults, **run.get("sim", {})}}


def borrowed_run(plan: Plan, arm: Arm, drift: dict, seed: int, init: str, out_dir: Path,
                 reuse: list[Path]) -> dict | None:
    """A run another arm of another invocation made with these very settings (`reuse`: its --out directories; the
    factorial's f_single_value_strict_eta4 is the main file's sao), written as this arm's run file; else None. The
    settings are all a run depends on, so it is the run this invocation would make."""
    want, fill = _wanted(plan, arm, drift, seed, init)
    for folder in reuse:
        for path in sorted((Path(folder) / "runs").glob(f"{drift['name']}-*-s{seed}.json")):
            if (run := reusable_run(path, want, fill)) is not None:
                run = {**run, "arm": arm.name, "borrowed_from": str(path)}
                out = run_path(out_dir, arm, drift, seed)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(run, default=json_default))
                return run
    return None


def run_all(plan: Plan, todo: list[tuple[Arm, dict, int]], init: str, out_dir: Path, jobs: int = 1,
            reuse: list[Path] = ()) -> list[dict]:
    """A run for every (arm, drift, seed), returned in order, `jobs` at a time in worker processes (spawned: no torch
    state is shared), the harness threads split between them; with `plan.shared_pre`, an arm's runs on drifts from
    one concept (`pre_key`) are one job (`run_branches`). A run with the same settings in `out_dir` or, under
    another arm's name, in a `reuse` directory is taken, not rerun."""
    plan = split_threads(plan, jobs)  # threads is a setting of the run (its file records it): split first
    done = {i: run for i, (arm, drift, seed) in enumerate(todo)
            if (run := finished_run(plan, arm, drift, seed, init, out_dir)) is not None}
    if done:
        print(f"[suite] {len(done)} of {len(todo)} runs already in {out_dir / 'runs'} with these settings: reused")
    borrowed = {i: run for i, (arm, drift, seed) in enumerate(todo) if i not in done and reuse
                and (run := borrowed_run(plan, arm, drift, seed, init, out_dir, reuse)) is not None}
    if borrowed:
        where = ", ".join(map(str, reuse))
        print(f"[suite] {len(borrowed)} of {len(todo)} runs made with these settings by other arms in {where}: taken")
        done.update(borrowed)
    if plan.common_start:
        starts = {(pre_key(drift), seed): (plan, drift, seed, init, out_dir)
                  for i, (_, drift, seed) in enumerate(todo) if i not in done}
        run_parallel(common_start, list(starts.values()), jobs)
    branches: dict[tuple, list[int]] = {}  # the runs simulated together (one each, unless plan.shared_pre)
    for i in (i for i in range(len(todo)) if i not in done):
        arm, drift, seed = todo[i]
        shared = plan.shared_pre and not plan.common_start
        branches.setdefault((arm.name, seed, pre_key(drift) if shared else i), []).append(i)
    groups = list(branches.values())
    results = run_parallel(run_branches, [(plan, todo[g[0]][0], [todo[i][1] for i in g], todo[g[0]][2], init, out_dir)
                                          for g in groups], jobs)
    for g, runs in zip(groups, results):
        done.update(zip(g, runs))
    return [done[i] for i in range(len(todo))]


def json_default(x: Any) -> Any:
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    if x is pd.NA:
        return None
    return str(x)


def admissibility(plan: Plan, init: str, out_dir: Path, jobs: int = 1) -> dict[str, Any]:
    """The pilot's first check: the frozen arm's post-drift start (mean success of the first `window` post-drift
    rollouts) and pre-drift reward of every drift on the pilot seeds, against `admissible_start`."""
    short = dataclasses.replace(plan, post=plan.window, common_start=None)  # the warm start's prior
    frozen = arms(["frozen"])[0]
    todo = [(frozen, drift, seed) for drift in plan.drifts for seed in plan.pilot_seeds]
    rows = []
    for run in run_all(short, todo, init, out_dir, jobs):
        pre = next(p for p in run["by_phase"] if p["phase"] == 0)
        rows.append({"drift": run["drift"], "seed": run["seed"], "pre_reward": pre["reward"],
                     "start_success": float(np.mean(run["post_drift"]["success"]))})
    low, high = plan.admissible_start
    per_drift = []
    for name, g in pd.DataFrame(rows).groupby("drift", sort=False):
        start = float(g["start_success"].mean())
        per_drift.append({"drift": name, "pre_reward": float(g["pre_reward"].mean()), "start_success": start,
                          "start_by_seed": g["start_success"].round(4).tolist(), "admissible": low <= start <= high})
    return {"suite": plan.name, "check": "admissibility", "init": init, "seeds": plan.pilot_seeds,
            "window": plan.window, "admissible_start": [low, high], "runs": rows, "per_drift": per_drift}
