"""The drift suite's verdicts over every committed draw (docs/results.md, issue 49 item 5), from
experiments/suite_stats.py's docs/results/suite_main/pooled_draws.json."""

from __future__ import annotations

from pathlib import Path

from experiments.results_format import RESULTS, Reader, section, table
from experiments.suite_stats import p_cell

POOLED = RESULTS / "suite_main/pooled_draws.json"


def signed(x: float) -> str:
    return f"{x:+.3f}"


def verdicts_section(root: Path) -> str:
    get = Reader(root)
    d = get(POOLED)
    names = [draw["name"] for draw in d["per_draw"]]
    per_draw = {draw["name"]: draw["arms"] for draw in d["per_draw"]}
    rows = []
    for arm, r in d["pooled"].items():
        draws = [signed(per_draw[n][arm]["hierarchical"]["mean"]) if arm in per_draw[n] else "—" for n in names]
        rows.append([arm, *draws, f"{signed(r['mean'])} [{signed(r['low'])}, {signed(r['high'])}]",
                     p_cell(r["holm_p"], d["n_boot"]), r["verdict"]])
    narrowed = {n: ", ".join(sorted(a for a, r in per_draw[n].items() if r["seeds_only"]["separates"]
                                    and r["verdict"] == "not separable at this power")) for n in names}
    lost = "; ".join(f"{n}: {a}" for n, a in narrowed.items() if a)
    versions = sorted({draw["suite_version"] for draw in d["per_draw"]},
                      key=lambda v: [int(x) for x in v.split(".")])
    what = (f"Every committed main-seed draw of suites {', '.join(versions)} (`experiments/suites/draws.yaml`: "
            f"versions, machine builds, one exploratory strict-clip run), post-drift AUC at equal rollouts, arm minus "
            f"{d['reference_arm']}. Each draw's column: its mean difference over its own drifts. Pooled: over the "
            f"{len(d['drifts'])} drifts every draw ran, a bootstrap ({d['n_boot']:,} resamples) that draws the "
            "draws, the seeds within each and the drifts with replacement; Holm's correction across the arms; "
            "'holds': the arm is below SAO, 'does not': above it. An arm is pooled under its name as each version "
            "defined it (from 2.0 each tuned arm runs at its own tuned point, and every arm restarts a drift from one "
            "common checkpoint). The old reports resampled seeds alone; with drifts "
            f"resampled too, these verdicts of single draws no longer separate: {lost}.")
    head = ["arm", *names, "pooled mean [95%]", "Holm p", "verdict"]
    return section("14. The suite's verdicts over every committed draw", what, [table(head, rows)],
                   [*get.read, POOLED.with_suffix(".md")], [])
