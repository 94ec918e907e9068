"""A drift suite's plan (experiments/suites/*.yaml) resolved for one invocation: the suite file read (with its
`extends:`), its `pilot:` placeholders resolved, each arm's lr and each drift's length, the suite's warm start, a
drift's scenario and an arm's SimConfig."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from experiments.arms import Arm, arm, arms, laid_over, with_setting
from experiments.common import init_sha256
from experiments.harness import SimConfig
from learner.pretrain import PretrainConfig, pretrain
from simulator.scenario import Scenario, validate_scenario
from streamer.agent.rollouts import run_tasks
from streamer.wire.config import load_config


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
    common_start: str | None = None  # every arm starts each drift from this arm's pre-drift checkpoint
    reference: Arm | None = None  # that arm at its tuned setting (the checkpoint is the same in every file of a suite)


def resolve(value: Any, name: str, used: list[str]) -> Any:
    """A plain value, a `pilot:` placeholder's `filled` value (its rule applied to the pilot), or else its
    provisional value (recorded in `used`)."""
    if isinstance(value, dict) and "pilot" in value:
        if value.get("filled") is not None:  # null: a later version's placeholder over an earlier one's filled value
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
    # `run_drifts`: the drifts a file runs, of the suite's `drifts` (all of which make its warm start)
    names, keep = raw["arms"], raw.get("run_drifts") or [d["name"] for d in raw["drifts"]]
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
    tuned = resolve(raw["tuned"], "tuned", used) if "tuned" in raw else None
    chosen, lr = apply_tuned(arms(names), read_lr(resolve(raw["lr"], "lr", used)), tuned or {},
                             raw.get("tuned", {}).get("from", {}), raw.get("tuned", {}).get("own_group_size", []))
    reference = None
    if common := raw.get("common_start"):  # at its tuned setting and lr whichever arms the file runs
        (reference,), ref_lr = apply_tuned([arm(common)], lr, tuned or {}, {})
        lr = {**lr, common: ref_lr[common]} if isinstance(lr, dict) and isinstance(ref_lr, dict) else lr
    if "grid" in raw:
        chosen, lr = grid_arms(chosen, lr, raw["grid"])
    return Plan(raw["name"], chosen, pick_drifts(raw["drifts"], keep), list(seeds), int(pre), read_post(post),
                lr, int(window), harness, raw["scenario"], used,
                warm_start_scenario(raw["name"], raw["scenario"], ws, raw["drifts"]), pretrain_sets,
                list(raw["seeds"]["pilot"]), int(raw["post_rollouts"]["pilot"]["pilot_runs"]),
                tuple(raw["admissible_start"]), raw.get("warm_start_sha256"), str(raw.get("version", "")),
                learner=tuple(str(x) for x in raw.get("learner", [])), shared_pre=bool(raw.get("shared_pre_drift")),
                common_start=raw.get("common_start"), reference=reference)


def apply_tuned(chosen: list[Arm], lr: float | dict[str, float], tuned: dict[str, dict],
                takes: dict[str, str], own_size: list[str] = ()) -> tuple[list[Arm], float | dict[str, float]]:
    """Each arm at its tuned setting (experiments.suite_tune), or at the one of the arm it `takes` with its own
    difference laid over it (`laid_over`); the arms in `own_size` keep the group size they are defined with (the
    factorial's rloo_n4 is RLOO with groups of 4, whatever n the main suite's search chose); their lrs laid over the
    suite's."""
    if not tuned:
        return chosen, lr
    out, lrs = [], dict(lr) if isinstance(lr, dict) else {name: lr for name in ["sao", *(a.name for a in chosen)]}
    for a in chosen:
        source = takes.get(a.name, a.name)
        if source in tuned:
            point, lrs[a.name] = tuned[source], float(tuned[source]["lr"])
            a = with_setting(a, point) if source == a.name else laid_over(a, arm(source), point)
        out.append(dataclasses.replace(a, group_size=arm(a.name).group_size) if a.name in own_size else a)
    return out, lrs


def grid_arms(chosen: list[Arm], lr: float | dict[str, float], grid: dict[str, list]) -> tuple[list[Arm], dict]:
    """Every trained arm at every cell of `grid` (eta x updates per batch x a factor on its lr: the stability grid),
    named <arm>@eta<e>-u<u>-lrx<f>; the frozen control once."""
    out, lrs = [], dict(lr) if isinstance(lr, dict) else {}
    for a in chosen:
        if not a.sim.get("train", True):  # the frozen control: one run, no cell of its own
            out.append(a)
            continue
        base = lrs.get(a.name, lr if not isinstance(lr, dict) else lrs.get("sao"))
        for eta in grid["eta"]:
            for u in grid["updates_per_batch"]:
                for f in grid["lr_factor"]:
                    name = f"{a.name}@eta{eta}-u{u}-lrx{f:g}"
                    out.append(dataclasses.replace(a, name=name, learner=(*a.learner, f"optim.updates_per_batch={u}"),
                                       sim={**a.sim, "eta": eta}))
                    lrs[name] = float(base) * f
    return out, lrs


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
    return pretrain(cfg, log=log, run_tasks=run_tasks)


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


def pick_arms(chosen: list[Arm], names: list[str]) -> list[Arm]:
    """The named arms, in the plan's order: the plan's own (at their tuned settings; a name picks every grid cell
    <name>@... too), then any other arm by its name (`arms`, which refuses an unknown one)."""
    def mine(n: str) -> list[Arm]:
        return [a for a in chosen if n in (a.name, a.name.split("@")[0])]
    return [a for a in chosen if any(a in mine(n) for n in names)] + arms([n for n in names if not mine(n)])


def pick_drifts(drifts: list[dict], names: list[str]) -> list[dict]:
    """The drifts named, in that order; every unknown name is refused at once."""
    known = {d["name"]: d for d in drifts}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown drift(s) {unknown}; the suite has {list(known)}")
    return [known[n] for n in names]


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
