"""Suite 2's section of docs/results.md (issue 49): the drifts' priors 2.0's pilot measured
(docs/results/suite_pilot/v2.0/) and each tuned arm's search under 2.1's rule with the main seeds it asks
(docs/results/suite_pilot/v2.1/)."""

from __future__ import annotations

from pathlib import Path

from experiments.results_format import RESULTS, Reader, f3, section, table
from experiments.suite_tune import grid_edges

PILOT = RESULTS / "suite_pilot/v2.0"
TUNING = RESULTS / "suite_pilot/v2.1"
MAIN = RESULTS / "suite_main/v2.1"


def prior_rows(d: dict) -> list[list]:
    return [[p["drift"], f3(p["start_success"]), ", ".join(f"{x:.3f}" for x in p["start_by_seed"]),
             "yes" if p["admissible"] else "no"] for p in d["per_drift"]]


def tuning_rows(tuned: dict[str, dict]) -> list[list]:
    rows = []
    for t in tuned.values():
        best = max(x["score"] for x in t["tried"])
        edges = ", ".join(grid_edges(t)) or "none"
        rows.append([t["arm"], t["chosen_setting"], f3(best), f"{t['settings_run']} of {t['budget']}", edges])
    return rows


def edge_rows(check: dict) -> list[list]:
    """The edge check: each point past a grid edge beside its arm's chosen point, scored on the pilot's seeds and
    drifts (the chosen point's score as the search recorded it / rerun)."""
    return [[r["arm"], r["chosen_setting"], f"{f3(r['recorded_score'])} / {f3(r['rerun_score'])}", b["setting"],
             f3(b["score"]), "yes" if r["inside"] else "no"] for r in check["arms"] for b in r["beyond"]]


def edge_sentence(check: dict, suite_sha: str | None) -> str:
    """What the edge check is, and which warm-start build it ran on beside the suite's."""
    build = (f"the warm start of the machine it ran on ({check['init_sha256'][:12]}…; the suite's runs: "
             f"{suite_sha[:12]}…)" if suite_sha and suite_sha != check["init_sha256"] else "the suite's warm start")
    return ("Where a search's budget ended at a grid edge, the points past it were scored after the main runs, one "
            "step at a time while a step scored higher (`python -m experiments.suite_tune --edge-check "
            f"{TUNING}`: a check, not part of the registered search), with the chosen point run again beside them, "
            f"from {build}:")


def main_progress(root: Path, get: Reader) -> str:
    """Which main seeds have run (one part's JSON a seed, pooled when all have): their names, not their outcomes,
    which are read once, pooled."""
    if (root / MAIN / "suite.json").is_file():  # read through `get`: the section's data line names it
        seeds = sorted({r["seed"] for r in get(MAIN / "suite.json")["runs"]})
        return (f"Main seeds: {', '.join(map(str, seeds))} ({len(seeds)}), pooled in {MAIN}/suite.json from one part "
                "a seed (seed-<n>.json, in git history); their verdicts: §16.")
    done = sorted(int(p.stem.split("-")[1]) for p in (root / MAIN).glob("seed-*.json"))
    return (f"Main seeds run so far ({MAIN}/seed-<n>.json, pooled and analysed once all have run): "
            f"{', '.join(map(str, done)) or 'none'} ({len(done)}).")


def suite2_section(root: Path) -> str:
    get = Reader(root)
    priors, strag = get(PILOT / "admissibility.json"), get(PILOT / "stragglers_admissibility.json")
    tuned = get.glob(TUNING, "tuning-*.json")
    what = ("Suite 2 (`experiments/suites/drift_v2*.yaml`, 2.0 pre-registered before its pilot) restarts every arm "
            "from one pre-drift checkpoint per drift, tunes every arm on the same budget of settings, and adds a "
            "factorial, a straggler regime and a stability grid. First, the frozen warm start's success on the first "
            "64 rollouts after each candidate drift (pilot seeds): 2.0 adds the two "
            "drifts with the highest prior below 0.05 (string swap and rotr) and keeps the straggler regime's tool "
            "drifts whose start lies in [0.05, 0.40]. Then the tuning search (`experiments/suite_tune.py`): each "
            "arm's chosen setting (lr, group size, KL coefficient, clip band) and its mean post-drift reward over "
            "3 pilot seeds x 3 drifts, under 2.1's rule (the lr, the group size and the clip extended at an edge while "
            "the budget of 12 lasts; 2.0 extended the lr alone); 'at a grid edge': a coordinate whose chosen value "
            "is the smallest or largest tried (a group of 2 is the least there is, not an edge).")
    parts = [table(["drift", "frozen prior", "by seed", "in [0.05, 0.40]"], prior_rows(priors)),
             table(["straggler drift", "frozen start", "by seed", "kept"], prior_rows(strag))]
    if tuned:
        parts.append(table(["arm", "chosen setting", "pilot score", "settings", "at a grid edge"],
                           tuning_rows(tuned)))
        if (root / TUNING / "edge_check.json").is_file():
            check = get(TUNING / "edge_check.json")
            suite_sha = get(MAIN / "suite.json")["init_sha256"] if (root / MAIN / "suite.json").is_file() else None
            parts.append(edge_sentence(check, suite_sha))
            parts.append(table(["arm", "chosen setting", "its score (search / rerun)", "past its edge", "score",
                                "chosen inside its grid"], edge_rows(check)))
        if (root / TUNING / "filled.json").is_file():
            rule = get(TUNING / "filled.json")["seeds_rule"]
            parts.append(f"Main seeds by 1.1's power rule on the chosen points' paired pilot differences: "
                         f"**{rule['n']}** (largest SD: {rule['largest_sd_arm']}, "
                         f"{rule['per_arm'][rule['largest_sd_arm']]['sd']:.3f}; delta {rule['delta']:.3f}).")
    else:
        parts.append("No arm has finished its tuning search yet.")
    parts.append(main_progress(root, get))
    return section("15. Suite 2: its pilot", what, parts, get.read, [])
