"""The equal tuning budget (issue 49, item 1): every tuned arm searches the same number of settings on the pilot seeds,
one coordinate at a time, and its chosen point is inside its grid or says it is not.

A suite's `tuning:` section names the pilot's seeds, drifts and post-drift length, the budget of settings per arm and
four coordinates, searched in this order from the arm's defaults:
  lr         the lr grid
  structure  group size for an arm with groups; none otherwise (the critic comes with the common start, its depth
             the suite's)
  kl         loss.kl_coef: 0 and the learner's default (the whole grid: never extended)
  clip       the loss's own clip band (eps_low, eps_high) scaled by each factor; a lower bound of 1.0 (none) stays
While a coordinate's best value is at an end of its grid and budget is left beyond the new settings the coordinates
still to come need, the grid is extended there (2.1's amendment; 2.0 extended the lr alone): the lr halved or doubled,
the group size doubled (a group of 2 is the least a group baseline takes: that end is the domain's, not the grid's),
the clip's scale halved below or one step of the grid above. `at_grid_edge` says where the budget ended at an end.
What is left of the budget then refines the lr around the chosen one (factors 2^(+-1/2), 2^(+-1/4), 2^(+-3/4), ...,
each not tried yet), so every arm runs exactly `budget` settings. Score of a setting: the mean post-drift reward over
the pilot's drifts and seeds (its AUC at equal rollouts: every setting has the same rollouts). The best score wins;
ties keep the current value. Runs are the suite's run files (`run_all`): an interrupted search resumes where
it stopped.

    .venv/bin/python -m experiments.suite_tune --suite experiments/suites/drift_v2.yaml --arms sao,grpo --jobs 2
    .venv/bin/python -m experiments.suite_tune --suite experiments/suites/drift_v2.yaml --fill   # tuned.filled, seeds
    .venv/bin/python -m experiments.suite_tune --suite experiments/suites/drift_v2.yaml \
        --edge-check docs/results/suite_pilot/v2.1   # after the search: past the edges its budget ended at
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

from experiments.arms import Arm, arms, setting_of, with_setting
from experiments.arms import arm as arm_named
from experiments.common import init_sha256
from experiments.suite_config import Plan, build_init, load_plan, pick_drifts, read_suite
from experiments.suite_plan import seeds_rule
from experiments.suite_runs import json_default, run_all, run_path
from learner.algorithms.losses import loss_params

COORDINATES = ("lr", "structure", "kl", "clip")


@dataclasses.dataclass(frozen=True)
class Tuning:
    seeds: list[int]
    drifts: list[str]
    post: int
    budget: int  # settings run per arm, extensions included
    lr: list[float]
    group_sizes: list[int]
    kl: list[float]
    clip_scales: list[float]


def read_tuning(suite: str | Path) -> Tuning:
    raw = read_suite(suite)["tuning"]
    return Tuning(list(raw["seeds"]), list(raw["drifts"]), int(raw["post_rollouts"]), int(raw["budget"]),
                  [float(x) for x in raw["lr"]], [int(x) for x in raw["group_size"]],
                  [float(x) for x in raw["kl_coef"]], [float(x) for x in raw["clip_scale"]])


def loss_name(arm: Arm) -> str:
    return setting_of(arm, "loss.name", "sao")


def structure(arm: Arm, t: Tuning) -> tuple[str, list] | None:
    """The arm's second coordinate: its group size when it has groups, else none (a critic's depth is the common
    start's, not an arm's: experiments.common_start)."""
    return ("group_size", list(t.group_sizes)) if arm.group_size > 1 else None


def clip_band(arm: Arm, scale: float) -> tuple[float, float]:
    """The loss's own clip band (eps_low, eps_high) times `scale`; a lower bound of 1.0 (none) stays."""
    p = loss_params(loss_name(arm))
    low, high = float(p.get("eps_low", 0.2)), float(p.get("eps_high", 0.2))
    return (low if low >= 1.0 else low * scale, high * scale)


def start_point(arm: Arm, t: Tuning) -> dict[str, Any]:
    p = loss_params(loss_name(arm))
    return {"lr": None, "group_size": arm.group_size, "kl": 0.1,
            "clip": (float(p.get("eps_low", 0.2)), float(p.get("eps_high", 0.2)))}


def label(point: dict[str, Any]) -> str:
    lo, hi = point["clip"]
    return f"lr{point['lr']:.3g}-n{point['group_size']}-kl{point['kl']:g}-clip{lo:.3g}_{hi:.3g}"


def variant(arm: Arm, point: dict[str, Any]) -> Arm:
    """The arm at one setting, named by it (its run files are its own)."""
    return with_setting(arm, point, name=f"{arm.name}@{label(point)}")


def pilot_plan(plan: Plan, t: Tuning) -> Plan:
    """The suite's plan on the pilot's seeds, drifts and length."""
    return dataclasses.replace(plan, seeds=t.seeds, drifts=pick_drifts(plan.drifts, t.drifts), post=t.post)


def score(plan: Plan, arm: Arm, point: dict[str, Any], init: str, out: Path, jobs: int) -> float:
    """The setting's mean post-drift reward over the pilot's drifts and seeds."""
    v = variant(arm, point)
    base = plan.lr if isinstance(plan.lr, dict) else {"sao": plan.lr}  # the common start's arm keeps the suite's lr
    p = dataclasses.replace(plan, arms=[v], lr={**base, v.name: point["lr"]})
    runs = run_all(p, [(v, d, s) for s in plan.seeds for d in plan.drifts], init, out, jobs)
    return float(np.mean([np.mean(r["post_drift"]["reward"]) for r in runs]))


def best(scores: dict, current: Any) -> Any:
    """The value with the highest score; a tie keeps `current` (else the first value listed)."""
    top = max(scores.values())
    tied = [v for v, s in scores.items() if s >= top - 1e-12]
    return current if current in tied else tied[0]


def refine_factors(depth: int = 6):
    """lr factors for the refinement, coarse first: 2^(-+1/2), then 2^(-+1/4), 2^(-+3/4), then eighths, ..."""
    for k in range(1, depth + 1):
        for j in range(1, 2 ** k, 2):
            yield 2 ** (-j / 2 ** k)
            yield 2 ** (j / 2 ** k)


# One value beyond a grid's end (`low`: below it), or None where the coordinate cannot go further. A group of 2 is the
# least a group baseline takes; the clip grid holds scales of the loss's own band.
EXTEND = {
    "lr": lambda grid, low: grid[0] / 2 if low else grid[-1] * 2,
    "group_size": lambda grid, low: None if low else grid[-1] * 2,
    "clip": lambda grid, low: grid[0] / 2 if low else grid[-1] + (grid[-1] - grid[-2]),
}


def tune_arm(arm: Arm, t: Tuning, score, log=print) -> dict[str, Any]:
    """The coordinate search of one arm, exactly `t.budget` settings (see the module's docstring); `score(point)` is
    a setting's pilot score (`pilot_score`)."""
    point, tried, at_edge = start_point(arm, t), {}, {}

    def run(key: str, values: list) -> dict:
        for v in values:
            if (name := label({**point, key: v})) not in tried:
                tried[name] = {"setting": name, "coordinate": key, "value": v, "score": score({**point, key: v})}
                log(f"[tune] {arm.name} {name}: {tried[name]['score']:.4f} ({len(tried)}/{t.budget})")
        return {v: tried[label({**point, key: v})]["score"] for v in values}

    def search(key: str, grid: list, reserve: int, value=lambda g: g) -> None:
        """Scores `grid`, extended at the best end while more than `reserve` settings are left; `value` maps a grid
        entry to the point's value (the clip's scale to its band)."""
        while True:
            b = best(run(key, [value(g) for g in grid]), point[key])
            ends = {value(grid[0]): True, value(grid[-1]): False}  # value -> is it the low end
            beyond = EXTEND[key](grid, ends[b]) if b in ends and key in EXTEND else None
            if beyond is None or len(tried) >= t.budget - reserve:
                break
            grid = [beyond, *grid] if ends[b] else [*grid, beyond]
        point[key], at_edge[key] = b, beyond is not None

    coords = [("lr", list(t.lr), lambda g: g)]
    if structure(arm, t):
        coords.append(structure(arm, t) + (lambda g: g,))
    coords += [("kl", list(t.kl), lambda g: g), ("clip", list(t.clip_scales), lambda s: clip_band(arm, s))]
    point["lr"] = t.lr[len(t.lr) // 2]
    for i, (key, grid, value) in enumerate(coords):  # reserve: the new settings of the coordinates still to come
        search(key, grid, sum(len(g) - 1 for _, g, _ in coords[i + 1:]), value)
    for factor in refine_factors():  # the rest of the budget refines the lr around the chosen one
        if len(tried) >= t.budget:
            break
        if label({**point, "lr": point["lr"] * factor}) not in tried:  # a value already tried lost to this one
            point["lr"] = best(run("lr", [point["lr"], point["lr"] * factor]), point["lr"])
    if len(tried) != t.budget:
        raise RuntimeError(f"{arm.name}: {len(tried)} settings run, the budget is {t.budget}")
    return {"arm": arm.name, "chosen": point, "chosen_setting": label(point), "settings_run": len(tried),
            "budget": t.budget, "at_grid_edge": at_edge, "tried": list(tried.values())}


def grid_edges(search: dict) -> list[str]:
    """The coordinates (lr, group size, clip) whose chosen value is the smallest or largest the search tried (a group
    of 2 is the domain's end, not an edge): the search's best point at the edge of its grid."""
    out = []
    for key in ("lr", "group_size", "clip"):
        tried = [t["value"][1] if key == "clip" else t["value"] for t in search["tried"] if t["coordinate"] == key]
        chosen = search["chosen"][key][1] if key == "clip" else search["chosen"][key]
        low = None if key == "group_size" and min(tried, default=0) == 2 else min(tried, default=None)
        if len(set(tried)) > 1 and chosen in (low, max(tried)):
            out.append(key)
    return out


def grid_ends(arm: Arm, search: dict, t: Tuning) -> list[tuple[str, list[float], bool]]:
    """(coordinate, grid, low) for each coordinate the search left at an end of its grid with the budget spent
    (`at_grid_edge`): the suite's grid and every value the search tried (the clip's as scales of the loss's own band),
    and whether the chosen value is its low end."""
    chosen, own_high = search["chosen"], clip_band(arm, 1.0)[1]
    base = {"lr": t.lr, "group_size": t.group_sizes, "clip": t.clip_scales}
    out = []
    for key in (k for k, edge in search["at_grid_edge"].items() if edge and k in EXTEND):
        tried = [e["value"][1] / own_high if key == "clip" else e["value"]
                 for e in search["tried"] if e["coordinate"] == key]
        grid = sorted({round(float(v), 12) for v in [*base[key], *tried]})
        at = round(chosen["clip"][1] / own_high if key == "clip" else float(chosen[key]), 12)
        out.append((key, grid, at <= grid[0]))
    return out


def edge_check(searches: list[dict], t: Tuning, score_of, max_steps: int = 4) -> list[dict[str, Any]]:
    """For each search left at a grid edge: its chosen point scored again (the same seeds and drifts) and the points
    past each edge, one step at a time (the search's own extension), while a step scores higher than the best before
    it (at most `max_steps`). After the registered search and never part of it: the chosen point is inside its grid
    in fact when the first step past every edge scores no higher. `score_of(arm)` gives the arm's `score(point)`."""
    rows = []
    for search in searches:
        arm = arm_named(search["arm"])
        if not (ends := grid_ends(arm, search, t)):
            continue
        score = score_of(arm)
        chosen = {**search["chosen"], "clip": tuple(search["chosen"]["clip"])}
        recorded = next(e["score"] for e in search["tried"] if e["setting"] == search["chosen_setting"])
        rerun, steps, inside = score(chosen), [], True
        for key, grid, low in ends:
            top = rerun
            for n in range(max_steps):
                if (v := EXTEND[key](grid, low)) is None:
                    break
                grid = [v, *grid] if low else [*grid, v]
                point = {**chosen, key: clip_band(arm, v) if key == "clip" else v}
                steps.append({"coordinate": key, "setting": label(point), "score": score(point)})
                if n == 0:  # the first step past this edge
                    inside &= steps[-1]["score"] <= rerun
                if steps[-1]["score"] <= top:
                    break
                top = steps[-1]["score"]
        rows.append({"arm": arm.name, "chosen_setting": search["chosen_setting"], "recorded_score": recorded,
                     "rerun_score": rerun, "beyond": steps, "inside": inside})
    return rows


def pilot_score(plan: Plan, arm: Arm, init: str, out: Path, jobs: int):
    return lambda point: score(plan, arm, point, init, out, jobs)


def chosen_runs(plan: Plan, searches: list[dict], out: Path) -> pd.DataFrame:
    """Each searched arm's runs at its chosen setting (run files under `out`): arm, seed, drift, mean post-drift
    reward."""
    rows = []
    for t in searches:
        point = {**t["chosen"], "clip": tuple(t["chosen"]["clip"])}
        v = variant(arm_named(t["arm"]), point)
        for s in plan.seeds:
            for d in plan.drifts:
                run = json.loads(run_path(out, v, d, s).read_text())
                rows.append({"arm": t["arm"], "seed": s, "drift": d["name"],
                             "auc_equal_rollouts": float(np.mean(run["post_drift"]["reward"]))})
    return pd.DataFrame(rows)


def fill(plan: Plan, out: Path, ref: str = "sao") -> dict[str, Any]:
    """The pilot's rules applied to the finished searches in `out`: `tuned.filled` (each arm's chosen point) and the
    main seeds by 1.1's power rule on the chosen points' paired pilot differences (suite_plan.seeds_rule)."""
    searches = [json.loads(f.read_text()) for f in sorted(out.glob("tuning-*.json"))]
    if ref not in {t["arm"] for t in searches}:
        raise ValueError(f"{out}: no finished search of {ref}, the power rule's reference")
    tuned = {t["arm"]: {**t["chosen"], "clip": list(t["chosen"]["clip"])} for t in searches}
    rule = seeds_rule(chosen_runs(plan, searches, out), ref) if len(searches) > 1 else None
    return {"tuned": tuned, "seeds_rule": rule, "arms_searched": sorted(tuned)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", required=True)
    p.add_argument("--arms", default="", help="comma-separated arms to tune (a part of the pilot)")
    p.add_argument("--fill", action="store_true", help="apply the pilot's rules to the searches finished in --out")
    p.add_argument("--edge-check", metavar="DIR", help="score the points past every grid edge the searches in DIR "
                   "(tuning-<arm>.json) ended at, a step at a time while a step scores higher, and their chosen "
                   "points again: a check after the search, not part of it; writes edge_check.json")
    p.add_argument("--init", help="warm-start policy directory (default: the suite's own, built and cached)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", default="runs/bench/suite_tune")
    a = p.parse_args(argv)
    if not (a.arms or a.fill or a.edge_check):
        p.error("name the arms to tune (--arms), --fill or --edge-check DIR")
    plan, t = load_plan(a.suite), read_tuning(a.suite)
    plan, out, t0 = pilot_plan(plan, t), Path(a.out), time.monotonic()
    if a.fill:
        result = fill(plan, out)
        (out / "filled.json").write_text(json.dumps(result, indent=1, default=json_default))
        print(json.dumps(result, indent=1, default=json_default))
        return 0
    init = a.init or str(build_init(plan))
    if a.edge_check:
        searches = [json.loads(f.read_text()) for f in sorted(Path(a.edge_check).glob("tuning-*.json"))]
        rows = edge_check(searches, t, lambda arm: pilot_score(plan, arm, init, out, a.jobs))
        out.mkdir(parents=True, exist_ok=True)
        (out / "edge_check.json").write_text(json.dumps(
            {"suite_version": plan.version, "searches": a.edge_check, "init_sha256": init_sha256(init), "arms": rows},
            indent=1, default=json_default))
        print(json.dumps(rows, indent=1, default=json_default))
        return 0
    for arm in arms(a.arms.split(",")):
        if (done := out / f"tuning-{arm.name}.json").is_file() and json.loads(done.read_text()).get(
                "suite_version") == plan.version:
            print(f"[tune] {arm.name}: finished earlier ({done})")
            continue
        result = {**tune_arm(arm, t, pilot_score(plan, arm, init, out, a.jobs)), "suite_version": plan.version,
                  "wall_s": round(time.monotonic() - t0, 1)}
        (out / f"tuning-{arm.name}.json").write_text(json.dumps(result, indent=1, default=json_default))
        print(json.dumps({k: result[k] for k in ("arm", "chosen_setting", "settings_run", "at_grid_edge")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
