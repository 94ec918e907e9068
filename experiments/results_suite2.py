"""Suite 2.0's section of docs/results.md (issue 49): the drifts' priors its pilot measured and each tuned arm's search
so far, from docs/results/suite_pilot/v2.0/."""

from __future__ import annotations

from pathlib import Path

from experiments.results_format import RESULTS, Reader, f3, section, table
from experiments.suite_tune import grid_edges

PILOT = RESULTS / "suite_pilot/v2.0"


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


def suite2_section(root: Path) -> str:
    get = Reader(root)
    priors, strag = get(PILOT / "admissibility.json"), get(PILOT / "stragglers_admissibility.json")
    tuned = get.glob(PILOT, "tuning-*.json")
    what = ("Suite 2.0 (`experiments/suites/drift_v2*.yaml`, pre-registered before its pilot) restarts every arm from "
            "one pre-drift checkpoint per drift, tunes every arm on the same budget of settings, and adds a "
            "factorial, a straggler regime and a stability grid. Its main seeds have not run. First, the frozen warm "
            "start's success on the first 64 rollouts after each candidate drift (pilot seeds): 2.0 adds the two "
            "drifts with the highest prior below 0.05 (string swap and rotr) and keeps the straggler regime's tool "
            "drifts whose start lies in [0.05, 0.40]. Then the tuning search (`experiments/suite_tune.py`): each "
            "arm's chosen setting (lr, group size, KL coefficient, clip band) and its mean post-drift reward over "
            "3 pilot seeds x 3 drifts, for the arms whose search has finished; 'at a grid edge': a coordinate whose "
            "chosen value is the smallest or largest tried (only the lr's grid is extended at an edge).")
    parts = [table(["drift", "frozen prior", "by seed", "in [0.05, 0.40]"], prior_rows(priors)),
             table(["straggler drift", "frozen start", "by seed", "kept"], prior_rows(strag))]
    if tuned:
        parts.append(table(["arm", "chosen setting", "pilot score", "settings", "at a grid edge"],
                           tuning_rows(tuned)))
    else:
        parts.append("No arm has finished its tuning search yet.")
    return section("15. Suite 2.0: its pilot so far", what, parts, get.read, [])
