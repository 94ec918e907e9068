"""Run a pre-registered drift suite (experiments/suites/*.yaml) through the simulated harness: arms x drifts x seeds.

Writes <out>/runs/<drift>-<arm>-s<seed>.json (summary, by-phase table, recoveries, step metrics, outcomes) and
<out>/suite.json (every run's outcomes and, per drift and arm, Kaplan-Meier medians of samples-to-threshold and
paired bootstrap intervals against the reference arm). A run that used a `pilot:` placeholder's provisional value
says so (`provisional: true`). A run file already in <out>/runs written with the same settings (`run_settings`) is
reused, not rerun: an interrupted suite resumes, and a pilot grows arm by arm.

The policy every arm starts from is the suite's own warm start (`learner.pretrain` on the suite's `warm_start`
section, cached under runs/cache; `--init DIR` uses another). `--admissibility` runs the pilot's first check alone:
the frozen arm's post-drift start of every drift on the pilot seeds, against `admissible_start`. `--pool` pools the
suite.json files of invocations on disjoint seeds (seeds accumulate across sessions; `pool_results` says what they
must share). A suite file may extend another (`extends:`, `read_suite`): drift_v1_5.yaml is 1.4 with its own learner
overrides and shared pre-drift phases (`run_branches`).

    .venv/bin/python -m experiments.suite --suite experiments/suites/drift_v1.yaml --quick
    .venv/bin/python -m experiments.suite --suite experiments/suites/drift_v1.yaml --admissibility \
        --out docs/bench/suite_pilot
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python -m experiments.suite`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from bench.common import differing, git_commit, init_sha256, machine, reusable_run  # noqa: E402
from experiments import stats  # noqa: E402
from experiments.arms import Arm, arms  # noqa: E402
from experiments.harness import (  # noqa: E402
    Result,
    SimConfig,
    by_phase,
    phase_prefix,
    scenario_stream,
    simulate,
    simulate_branches,
    summary,
)
from experiments.parallel import run_parallel  # noqa: E402
from learner.pretrain import PretrainConfig, kernels, pretrain  # noqa: E402
from simulator.scenario import Scenario, validate_scenario  # noqa: E402
from streamer.wire.config import load_config  # noqa: E402
from streamer.wire.schema import DriftEvent, Task  # noqa: E402

STEP_KEYS = ("step", "version", "skipped", "n", "sim_time", "staleness_mean", "staleness_max", "learner/ess_frac",
             "learner/policy_loss", "learner/value_loss", "learner/clip_frac", "learner/clip_frac_low",
             "learner/clip_frac_high", "learner/kl_k1", "learner/kl_k3", "learner/kl_ref", "learner/ratio_max",
             "learner/entropy", "learner/grad_norm", "learner/value_warmup", "learner/explained_variance")


@dataclasses.dataclass
class Plan:
    """A suite resolved for one invocation: what runs, with which values, and whether any was provisional."""

    name: str
    arms: list[Arm]
    drifts: list[dict]
    seeds: list[int]
    pre: int
    post: int | dict[str, int]  # post-drift rollouts: one for every drift, or per drift (`post_of`)
    lr: float | dict[str, float]  # one for every arm, or per arm (the lr rule's choice; eta0 takes SAO's)
    window: int
    harness: dict[str, Any]
    scenario: dict[str, Any]
    provisional: list[str]  # the placeholders whose provisional value this plan uses
    warm_start: dict[str, Any]  # the scenario the suite's warm start trains on (`warm_start_scenario`)
    pretrain_sets: list[str]  # its learner.pretrain overrides
    pilot_seeds: list[int]
    pilot_post: int  # the pilot's post-drift rollouts
    admissible_start: tuple[float, float]
    warm_start_sha256: str | None = None  # the build of the warm start the suite's reported runs started from
    version: str = ""  # the suite file's version (its amendments)
    learner_sets: tuple[str, ...] = ()  # `--set`: learner overrides for every arm, outside the plan (provisional)
    learner: tuple[str, ...] = ()  # the suite's own learner overrides for every arm (`learner:`, from 1.5)
    shared_pre: bool = False  # drifts with the same pre-drift tasks simulate them once (`shared_pre_drift:`, 1.5)


def resolve(value: Any, name: str, used: list[str]) -> Any:
    """A plain value, a `pilot:` placeholder's `filled` value (its rule applied to the pilot), or else its
    provisional value (recorded in `used`)."""
    if isinstance(value, dict) and "pilot" in value:
        if "filled" in value:
            return value["filled"]
        used.append(name)
        return value["pilot"]["provisional"]
    return value


def read_suite(path: str | Path) -> dict[str, Any]:
    """A suite file's contents; with `extends: FILE` (beside it), that file's with this one's keys laid over it
    (`lay_over`: a section this file sets in part keeps the rest of that file's)."""
    raw = yaml.safe_load(Path(path).read_text())
    if "extends" in raw:
        return lay_over(read_suite(Path(path).parent / raw.pop("extends")), raw)
    return raw


def lay_over(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over`'s keys over `base`'s, mappings merged key by key at every depth; a list or a value replaces."""
    out = dict(base)
    for k, v in over.items():
        out[k] = lay_over(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def load_plan(path: str | Path, quick: bool = False) -> Plan:
    raw = read_suite(path)
    used: list[str] = []
    harness = dict(raw.get("harness", {}))
    names, keep = raw["arms"], [d["name"] for d in raw["drifts"]]
    seeds = resolve(raw["seeds"]["main"], "seeds.main", used)
    pre, post = raw["pre_rollouts"], resolve(raw["post_rollouts"], "post_rollouts", used)
    window = raw["outcomes"]["window"]
    if quick:
        q = raw["quick"]
        names, keep, seeds, pre, post, window = q["arms"], q["drifts"], q["seeds"], q["pre_rollouts"], \
            q["post_rollouts"], q["window"]
        harness.update(q.get("harness", {}))
        used.append("quick")
    ws = dict(raw["scenario"]["warm_start"])
    pretrain_sets = [str(x) for x in ws.pop("pretrain", [])]
    return Plan(raw["name"], arms(names), pick_drifts(raw["drifts"], keep), list(seeds), int(pre), read_post(post),
                read_lr(resolve(raw["lr"], "lr", used)), int(window), harness, raw["scenario"], used,
                warm_start_scenario(raw["name"], raw["scenario"], ws, raw["drifts"]), pretrain_sets,
                list(raw["seeds"]["pilot"]), int(raw["post_rollouts"]["pilot"]["pilot_runs"]),
                tuple(raw["admissible_start"]), raw.get("warm_start_sha256"), str(raw.get("version", "")),
                learner=tuple(str(x) for x in raw.get("learner", [])), shared_pre=bool(raw.get("shared_pre_drift")))


def warm_start_note(plan: Plan, init: str) -> str | None:
    """Why this invocation's runs may differ from the suite's reported ones: another build of the warm start (a rebuilt
    cache has other bits), else None."""
    if plan.warm_start_sha256 is None or init_sha256(init) == plan.warm_start_sha256:
        return None
    built = json.loads(meta.read_text()).get("kernels") if (meta := Path(init) / "pretrain.json").is_file() else None
    on = f", built on {built['cpu']} ({built['cpu_capability']})" if built else ""
    return (f"warm start {init} has sha256 {init_sha256(init)[:12]}...{on}, not the build the suite's reported runs "
            f"started from ({plan.warm_start_sha256[:12]}...; a pinned build's bits follow the CPU's kernels too): "
            "expect other outcomes run by run (two builds gave SAO the same pooled AUC, 0.485, with single runs up "
            "to 0.14 apart)")


def read_post(value: Any) -> int | dict[str, int]:
    return {k: int(v) for k, v in value.items()} if isinstance(value, dict) else int(value)


def post_of(plan: Plan, drift: dict) -> int:
    """The drift's post-drift rollouts: the suite's one value, or its own entry."""
    if not isinstance(plan.post, dict):
        return plan.post
    if drift["name"] not in plan.post:
        raise ValueError(f"suite {plan.name}: no post_rollouts for drift {drift['name']} (it has {sorted(plan.post)})")
    return plan.post[drift["name"]]


def read_lr(value: Any) -> float | dict[str, float]:
    return {k: float(v) for k, v in value.items()} if isinstance(value, dict) else float(value)


def has_own_lr(arm: Arm) -> bool:
    """Trained and not a control of SAO: eta0 (SAO at staleness 0) and frozen (never steps) take SAO's lr."""
    return bool(arm.sim.get("train", True)) and arm.name != "eta0"


def lr_of(plan: Plan, arm: Arm) -> float:
    """The arm's learning rate: the suite's one value, or its own entry (`has_own_lr`; else SAO's)."""
    if not isinstance(plan.lr, dict):
        return plan.lr
    name = arm.name if has_own_lr(arm) else "sao"
    if name not in plan.lr:
        raise ValueError(f"suite {plan.name}: no lr for arm {arm.name} (lr has {sorted(plan.lr)})")
    return plan.lr[name]


def warm_start_scenario(name: str, scenario: dict, warm_start: dict, drifts: list[dict]) -> dict[str, Any]:
    """The suite's warm-start scenario: its `warm_start` section, and one phase holding every drifted family at its
    pre-drift concept (what `learner.pretrain` evaluates on). Every drift of a family must start from one concept."""
    start: dict[str, str] = {}
    for d in drifts:
        if start.setdefault(d["family"], d["from"]) != d["from"]:
            raise ValueError(f"suite {name}: drift {d['name']} starts family {d['family']} from {d['from']}, another "
                             f"drift from {start[d['family']]}; the suite has one warm start, so one pre-drift concept "
                             "per family")
    return {"name": f"{name}-warm-start", "options": scenario.get("options", {}), "warm_start": warm_start,
            "phases": [{"name": "pre", "duration_tasks": 1, "families": {f: 1 for f in start}, "concepts": start}]}


def build_init(plan: Plan, cache_dir: str | Path = "runs/cache", log=print) -> Path:
    """The suite's warm start: `learner.pretrain` on `plan.warm_start` with the suite's overrides, cached."""
    path = Path(cache_dir) / f"{plan.name}-warm-start.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(plan.warm_start, sort_keys=False))
    cfg = load_config(PretrainConfig, None, [*plan.pretrain_sets, f"scenario={path}", f"cache_dir={cache_dir}"])
    return pretrain(cfg, log=log)


def drift_options(scenario_options: dict, drift: dict) -> dict:
    """The suite's family options with the drift's own `options` laid over them, family by family."""
    out = {family: dict(opts) for family, opts in scenario_options.items()}
    for family, extra in drift.get("options", {}).items():
        out[family] = {**out.get(family, {}), **extra}
    return out


def drift_scenario(plan: Plan, drift: dict) -> Scenario:
    s = plan.scenario
    raw = {"name": drift["name"], "rate": s["rate"], "arrival": s["arrival"],
           "options": drift_options(s.get("options", {}), drift),
           "phases": [{"name": "pre", "duration_tasks": plan.pre, "families": {drift["family"]: 1},
                       "concepts": {drift["family"]: drift["from"]}},
                      {"name": drift["name"], "schedule": "abrupt", "duration_tasks": post_of(plan, drift),
                       "concepts": {drift["family"]: drift["to"]}}]}
    scn = load_config(Scenario, None, [], base=raw)
    validate_scenario(scn, f"suite drift {drift['name']}")
    return scn


def sim_config(plan: Plan, arm: Arm, seed: int) -> SimConfig:
    base = {**plan.harness, **arm.sim, "group_size": arm.group_size, "seed": seed}
    return load_config(SimConfig, None, [], base=base)


def post_drift(traj: pd.DataFrame) -> pd.DataFrame:
    """The drift phase's trajectories in stream order (task seq, then group member)."""
    return traj[traj["phase"] == 1].sort_values(["seq", "member"]).reset_index(drop=True)


def run_outcomes(post: pd.DataFrame, window: int, n_rollouts: int, n_tokens: int) -> dict[str, Any]:
    """One run's outcomes at the (drift, seed)'s common budgets: `n_rollouts` trajectories, `n_tokens` tokens."""
    reward, success = post["reward"].to_numpy(float), post["success"].to_numpy(float)
    in_tokens = int(np.searchsorted(np.cumsum(post["n_gen"].to_numpy()), n_tokens, side="right"))
    out = {"auc_equal_rollouts": float(reward[:n_rollouts].mean()) if n_rollouts else math.nan,
           "auc_equal_tokens": float(reward[:in_tokens].mean()) if in_tokens else math.nan,
           "equal_rollouts_n": n_rollouts, "equal_tokens_n": in_tokens,
           "final_reward": float(reward[-window:].mean()) if len(reward) else math.nan,
           "start_success": float(success[:window].mean()) if len(success) else math.nan}
    for thr in (0.7, 0.8):
        n, hit = stats.samples_to(success, thr, window)
        out[f"samples_to_{thr}"], out[f"reached_{thr}"] = n, hit
    return out


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


def run_branches(plan: Plan, arm: Arm, drifts: list[dict], seed: int, init: str, out_dir: Path,
                 log=print) -> list[dict[str, Any]]:
    """One run of `arm` on each drift (same seed), written to its run file; several drifts that start with the same
    tasks share their simulation of those (`simulate_branches`), each run's result the same as alone."""
    streams, scns = zip(*(drift_stream(plan, d, seed, arm.group_size) for d in drifts))
    sim, sets = sim_config(plan, arm, seed), run_settings(plan, arm, drifts[0], seed)["learner_sets"]
    for d, stream in zip(drifts, streams):
        log(f"[suite] {d['name']} {arm.name} seed {seed}: {len(stream)} stream items, sim {sim}")
    if len(drifts) == 1:
        results = [simulate(sim, init, streams[0], sets, [], scns[0].rate, log)]
    else:
        results = simulate_branches(sim, init, list(streams), sets, [], scns[0].rate, log)
    return [write_run(plan, arm, d, seed, init, out_dir, res, sim.threads) for d, res in zip(drifts, results)]


def write_run(plan: Plan, arm: Arm, drift: dict, seed: int, init: str, out_dir: Path, res: Result,
              threads: int) -> dict[str, Any]:
    """The run's file: its settings, summary, by-phase table, recoveries, learner steps and post-drift rewards."""
    settings = run_settings(plan, arm, drift, seed)
    steps = res.steps[[k for k in STEP_KEYS if k in res.steps]] if len(res.steps) else res.steps
    post = post_drift(res.trajectories)
    run = {"suite": plan.name, "arm": arm.name, "drift": drift["name"], "seed": seed, "init": init,
           "init_sha256": init_sha256(init),
           "provisional": bool(plan.provisional), "provisional_values": plan.provisional,
           **settings, "summary": summary(res, threads),
           "by_phase": by_phase(res.trajectories), "recoveries": res.recoveries.to_dict("records"),
           "steps": steps.to_dict("records"),
           "post_drift": {"reward": post["reward"].tolist(), "success": post["success"].astype(float).tolist(),
                          "n_gen": post["n_gen"].astype(int).tolist()}}
    path = run_path(out_dir, arm, drift, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run, indent=1, default=json_default))
    return run


def run_path(out_dir: Path, arm: Arm, drift: dict, seed: int) -> Path:
    return out_dir / "runs" / f"{drift['name']}-{arm.name}-s{seed}.json"


def run_settings(plan: Plan, arm: Arm, drift: dict, seed: int) -> dict[str, Any]:
    """What a run's result depends on besides its init: a run file with the same is that run (`finished_run`)."""
    sim = dataclasses.asdict(sim_config(plan, arm, seed))
    return {"drift_def": drift, "pre": plan.pre, "post": post_of(plan, drift),
            "learner_sets": [*arm.learner, f"optim.lr={lr_of(plan, arm)}", *plan.learner, *plan.learner_sets],
            "sim": json.loads(json.dumps(sim, default=json_default)),
            **({"shared_pre_drift": True} if plan.shared_pre else {})}


def finished_run(plan: Plan, arm: Arm, drift: dict, seed: int, init: str, out_dir: Path) -> dict | None:
    """The run's file in `out_dir` when it was written with these very settings, else None."""
    # a SimConfig field added after the file was written had its default then
    defaults = json.loads(json.dumps(dataclasses.asdict(SimConfig()), default=json_default))
    want = {"init": init, "init_sha256": init_sha256(init), **run_settings(plan, arm, drift, seed)}
    return reusable_run(run_path(out_dir, arm, drift, seed), want,
                        lambda run: {**run, "sim": {**defaults, **run.get("sim", {})}})


def run_all(plan: Plan, todo: list[tuple[Arm, dict, int]], init: str, out_dir: Path, jobs: int = 1) -> list[dict]:
    """A run for every (arm, drift, seed), returned in order, `jobs` at a time in worker processes (spawned: no torch
    state is shared), the harness threads split between them; with `plan.shared_pre`, an arm's runs on drifts from
    one concept (`pre_key`) are one job (`run_branches`)."""
    plan = split_threads(plan, jobs)  # threads is a setting of the run (its file records it): split first
    done = {i: run for i, (arm, drift, seed) in enumerate(todo)
            if (run := finished_run(plan, arm, drift, seed, init, out_dir)) is not None}
    if done:
        print(f"[suite] {len(done)} of {len(todo)} runs already in {out_dir / 'runs'} with these settings: reused")
    branches: dict[tuple, list[int]] = {}  # the runs simulated together (one each, unless plan.shared_pre)
    for i in (i for i in range(len(todo)) if i not in done):
        arm, drift, seed = todo[i]
        branches.setdefault((arm.name, seed, pre_key(drift) if plan.shared_pre else i), []).append(i)
    groups = list(branches.values())
    results = run_parallel(run_branches, [(plan, todo[g[0]][0], [todo[i][1] for i in g], todo[g[0]][2], init, out_dir)
                                          for g in groups], jobs)
    for g, runs in zip(groups, results):
        done.update(zip(g, runs))
    return [done[i] for i in range(len(todo))]


def main_seeds(given: str, pilot_seeds: list[int], pilot: bool) -> list[int]:
    """`--seeds`: main seeds only (the pilot's seeds are never reused for a result)."""
    if pilot:
        raise ValueError("--seeds with --pilot: the pilot runs the suite's pilot seeds")
    seeds = [int(s) for s in given.split(",")]
    if set(seeds) & set(pilot_seeds):
        raise ValueError(f"--seeds {given}: {sorted(set(seeds) & set(pilot_seeds))} are pilot seeds, never reused")
    return seeds


def split_threads(plan: Plan, jobs: int) -> Plan:
    """The plan as each of `jobs` worker processes runs it: the harness threads shared out, at least one each."""
    if jobs <= 1:
        return plan
    threads = max(1, int(plan.harness.get("threads", 2)) // jobs)
    return dataclasses.replace(plan, harness={**plan.harness, "threads": threads})


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


def combine(plan: Plan, runs: list[dict]) -> dict[str, Any]:
    """Outcomes at equal budgets per (drift, seed) (`runs` rows), then `summarise`. Every run must come from one warm
    start."""
    weights = {r.get("init_sha256") for r in runs}
    if len(weights) > 1:
        raise ValueError(f"suite {plan.name}: the runs started from {len(weights)} different warm-start weights "
                         f"(init_sha256 {sorted(map(str, weights))}): their outcomes are not comparable")
    rows = []
    for (drift, seed), group in _by(runs, ("drift", "seed")).items():
        n_roll = min(len(r["post_drift"]["reward"]) for r in group)
        n_tok = min(sum(r["post_drift"]["n_gen"]) for r in group)
        for r in group:
            post = pd.DataFrame(r["post_drift"])
            rows.append({"drift": drift, "seed": seed, "arm": r["arm"],
                         **run_outcomes(post, plan.window, n_roll, n_tok),
                         "learner_steps": r["summary"]["learner_steps"],
                         "trained_frac": r["summary"]["trained"] / max(r["summary"]["trajectories"], 1)})
    ref = "sao" if "sao" in {a.name for a in plan.arms} else plan.arms[0].name
    return {"suite": plan.name, "suite_version": plan.version, "provisional": bool(plan.provisional),
            "provisional_values": plan.provisional, "init_sha256": next(iter(weights), None), "reference_arm": ref,
            "window": plan.window, **summarise(rows, ref)}


def summarise(rows: list[dict], ref: str) -> dict[str, Any]:
    """Per (drift, arm): Kaplan-Meier medians of samples to each threshold and paired bootstrap intervals of
    (arm - `ref`) over seeds; per arm, the drifts pooled (`pooled`)."""
    table = pd.DataFrame(rows)
    per_arm = []
    for (drift, arm), g in table.groupby(["drift", "arm"], sort=False):
        entry: dict[str, Any] = {"drift": drift, "arm": arm, "seeds": int(len(g))}
        for thr in (0.7, 0.8):
            t, e = g[f"samples_to_{thr}"].to_numpy(), g[f"reached_{thr}"].to_numpy(bool)
            entry[f"km_median_samples_to_{thr}"] = stats.km_median(t, e)
            entry[f"censored_{thr}"] = int((~e).sum())
        base = table[(table["drift"] == drift) & (table["arm"] == ref)].set_index("seed")
        mine = g.set_index("seed")
        for k in OUTCOMES:
            entry[k] = float(mine[k].mean())
            if arm != ref:
                common = mine.index.intersection(base.index)
                entry[f"{k}_minus_{ref}"] = stats.paired_bootstrap((mine.loc[common, k] - base.loc[common, k]).values)
        per_arm.append(entry)
    return {"runs": rows, "per_drift_arm": per_arm, "pooled": pooled(table, ref)}


# what every suite.json pooled by `pool_results` must share: one suite version, warm start, lr, arms and drifts
POOL_SAME = ("suite", "suite_version", "init_sha256", "reference_arm", "window", "lr", "pilot", "provisional",
             "provisional_values")


def pool_results(results: list[dict], names: list[str]) -> dict[str, Any]:
    """suite.json files of earlier invocations on disjoint seeds, pooled into one result (`summarise` over all their
    runs): seeds run in different sessions accumulate. Refused, naming the file and field, where they differ in
    anything but their seeds (`POOL_SAME`, and each seed's (arm, drift) runs), or share a seed."""
    first = results[0]
    for name, r in zip(names, results):
        for k in POOL_SAME:
            if k not in r:
                raise ValueError(f"--pool {name}: no '{k}' (a suite.json of an older experiments/suite.py?)")
        if diff := differing(r, first, POOL_SAME):
            raise ValueError(f"--pool {name}: {diff[0]} {r[diff[0]]!r} differs from {names[0]}'s {first[diff[0]]!r}")
    cells = {(row["arm"], row["drift"]) for row in first["runs"]}
    seen: dict[int, str] = {}
    for name, r in zip(names, results):
        for seed, rows in _by(r["runs"], ("seed",)).items():
            if seed[0] in seen:
                raise ValueError(f"--pool {name}: seed {seed[0]} is also in {seen[seed[0]]}")
            seen[seed[0]] = name
            if {(row["arm"], row["drift"]) for row in rows} != cells:
                raise ValueError(f"--pool {name}: seed {seed[0]} ran other arms or drifts than {names[0]}")
    rows = [row for r in results for row in r["runs"]]
    return {**{k: first[k] for k in POOL_SAME}, "pooled_from": names,
            "git_commits": [r.get("git_commit") for r in results], **summarise(rows, first["reference_arm"])}


OUTCOMES = ("auc_equal_rollouts", "auc_equal_tokens", "final_reward")


def seed_differences(table: pd.DataFrame, outcome: str, arm: str, ref: str) -> pd.Series:
    """Per seed, `outcome` averaged over the drifts both arms ran on that seed, `arm` minus `ref`."""
    wide = table.pivot_table(index=["seed", "drift"], columns="arm", values=outcome)
    both = wide[[arm, ref]].dropna().groupby(level="seed").mean()
    return both[arm] - both[ref]


def pooled(table: pd.DataFrame, ref: str) -> list[dict[str, Any]]:
    """Per arm, each outcome averaged over the drifts of a seed, then over seeds; against `ref`, the paired
    bootstrap over seeds of the per-seed difference (`seed_differences`), and its t interval (`_t`: with its SD, the
    difference n seeds detect at 3 standard errors, 3 sd / sqrt(n))."""
    out = []
    for arm, g in table.groupby("arm", sort=False):
        entry: dict[str, Any] = {"arm": arm, "seeds": int(g["seed"].nunique()), "drifts": int(g["drift"].nunique())}
        for k in OUTCOMES:
            entry[k] = float(g.groupby("seed")[k].mean().mean())
            if arm != ref:
                diffs = seed_differences(table, k, arm, ref).values
                entry[f"{k}_minus_{ref}"] = stats.paired_bootstrap(diffs)
                entry[f"{k}_minus_{ref}_t"] = stats.t_interval(diffs)
        out.append(entry)
    return out


def post_rollouts_rule(per_drift_arm: list[dict], pilot_post: int, quantum: int = 512) -> dict[str, dict]:
    """drift_v1's post_rollouts rule on the pilot: 1.3 x the slower arm's Kaplan-Meier median samples-to-80%,
    rounded up to a multiple of `quantum`; a censored median gives `pilot_post` and a flag."""
    out: dict[str, dict] = {}
    for e in per_drift_arm:
        d = out.setdefault(e["drift"], {"medians": {}, "flagged": False})
        d["medians"][e["arm"]] = e["km_median_samples_to_0.8"]
    for d in out.values():
        medians = list(d["medians"].values())
        if any(m is None for m in medians):
            d["post_rollouts"], d["flagged"] = pilot_post, True
        else:
            d["post_rollouts"] = quantum * math.ceil(1.3 * max(medians) / quantum)
    return out


def choose_lr(pilots: list[dict]) -> dict[str, dict]:
    """drift_v1's lr rule on pilot results (`pilot.json` of one lr each): per arm, the lr with the highest mean
    post-drift AUC at equal rollouts over every (drift, seed) run; ties go to the smaller lr."""
    auc: dict[str, dict[float, float]] = {}
    for pilot in pilots:
        lr = pilot["lr"]
        for arm, g in pd.DataFrame(pilot["runs"]).groupby("arm"):
            auc.setdefault(arm, {})[lr] = float(g["auc_equal_rollouts"].mean())
    return {arm: {"lr": min(by_lr, key=lambda lr: (-by_lr[lr], lr)), "auc_equal_rollouts_by_lr": by_lr}
            for arm, by_lr in auc.items()}


def admissibility(plan: Plan, init: str, out_dir: Path, jobs: int = 1) -> dict[str, Any]:
    """The pilot's first check: the frozen arm's post-drift start (mean success of the first `window` post-drift
    rollouts) and pre-drift reward of every drift on the pilot seeds, against `admissible_start`."""
    short = dataclasses.replace(plan, post=plan.window)
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


def pick_drifts(drifts: list[dict], names: list[str]) -> list[dict]:
    """The drifts named, in that order; every unknown name is refused at once."""
    known = {d["name"]: d for d in drifts}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown drift(s) {unknown}; the suite has {list(known)}")
    return [known[n] for n in names]


def _by(runs: list[dict], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in runs:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", required=True)
    p.add_argument("--init", help="warm-start policy directory (default: the suite's own, built and cached)")
    p.add_argument("--quick", action="store_true", help="the suite's quick section: outputs only, no result")
    p.add_argument("--admissibility", action="store_true", help="the pilot's admissibility check alone")
    p.add_argument("--pilot", action="store_true", help="the pilot: its seeds and post-drift length, pilot.json "
                   "with the post_rollouts rule applied")
    p.add_argument("--arms", default="", help="comma-separated arms instead of the suite's (e.g. the pilot's)")
    p.add_argument("--drifts", default="", help="comma-separated drifts instead of the suite's")
    p.add_argument("--seeds", default="", help="comma-separated main seeds instead of the suite's (e.g. the n the "
                   "power rule asks where the budget took fewer); never the pilot's")
    p.add_argument("--choose-lr", nargs="+", metavar="PILOT_JSON", help="apply the lr rule to pilot.json files "
                   "(one lr each) and write <out>/lr_choice.json")
    p.add_argument("--pool", nargs="+", metavar="SUITE_JSON", help="pool suite.json files of earlier invocations on "
                   "disjoint seeds (same suite version, warm start, lr, arms, drifts) into <out>/suite.json; runs "
                   "nothing")
    p.add_argument("--lr", type=float, help="every trained arm at this lr (a point of the suite's lr_grid)")
    p.add_argument("--set", dest="learner_sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a learner override for every arm, outside the plan (e.g. value.layers=1 to pilot a cheaper "
                   "critic): its runs and result are marked provisional")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, in separate processes; each gets "
                   "max(1, harness.threads // jobs) threads (the results of a run do not depend on its process)")
    p.add_argument("--out", default="runs/bench/suite")
    a = p.parse_args(argv)
    plan = load_plan(a.suite, a.quick)
    out, t0 = Path(a.out), time.monotonic()
    if a.choose_lr:
        pilots = [json.loads(Path(f).read_text()) for f in a.choose_lr]
        result = {"rule": "per arm, argmax over lr_grid of the mean post-drift AUC (equal rollouts) on the pilot "
                  "seeds; ties: the smaller", "pilots": a.choose_lr, "per_arm": choose_lr(pilots)}
        _write(out / "lr_choice.json", result, result["per_arm"])
        return 0
    if a.pool:
        result = pool_results([json.loads(Path(f).read_text()) for f in a.pool], a.pool)
        _write(out / "suite.json", result, result["pooled"])
        return 0
    a.init = a.init or str(build_init(plan))
    note = None if a.quick else warm_start_note(plan, a.init)
    if note:
        print(f"[suite] note: {note}")
    if a.admissibility:
        result = {**admissibility(plan, a.init, out, a.jobs), "wall_s": round(time.monotonic() - t0, 1)}
        _write(out / "admissibility.json", result, result["per_drift"])
        return 0
    if a.pilot:
        plan = dataclasses.replace(plan, seeds=plan.pilot_seeds, post=plan.pilot_post)
    if a.arms:
        plan = dataclasses.replace(plan, arms=arms(a.arms.split(",")))
    if a.drifts:
        plan = dataclasses.replace(plan, drifts=pick_drifts(plan.drifts, a.drifts.split(",")))
    if a.seeds:
        plan = dataclasses.replace(plan, seeds=main_seeds(a.seeds, plan.pilot_seeds, a.pilot))
    if a.lr is not None:  # one value of the lr grid (the pilot's lr choice): every trained arm at it
        plan = dataclasses.replace(plan, lr=a.lr, provisional=[p for p in plan.provisional if p != "lr"] + ["lr grid"])
    if a.learner_sets:
        plan = dataclasses.replace(plan, learner_sets=tuple(a.learner_sets),
                                   provisional=plan.provisional + [f"--set {x}" for x in a.learner_sets])
    # seed by seed: an interrupted suite leaves whole seeds (every drift and arm, the pairing unit) in <out>/runs
    todo = [(arm, drift, seed) for seed in plan.seeds for drift in plan.drifts for arm in plan.arms]
    runs = run_all(plan, todo, a.init, out, a.jobs)
    combined = {**combine(plan, runs), "wall_s": round(time.monotonic() - t0, 1), "init": a.init,
                "suite_file": str(a.suite), "pilot": a.pilot, "lr": plan.lr, "git_commit": git_commit(),
                "warm_start_note": note, "machine": {**machine(), **kernels()}}  # what the walls were measured on
    if a.pilot:
        combined["post_rollouts_rule"] = post_rollouts_rule(combined["per_drift_arm"], plan.pilot_post)
    _write(out / ("pilot.json" if a.pilot else "suite.json"), combined, combined["per_drift_arm"])
    return 0


def _write(path: Path, result: dict, shown: Any) -> None:
    """`result` as JSON at `path`, and its `shown` part printed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=json_default))
    print(json.dumps(shown, indent=1, default=json_default))


if __name__ == "__main__":
    sys.exit(main())
