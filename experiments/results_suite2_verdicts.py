"""Suite 2.1's verdicts (docs/results.md §16, issue 49 item 8): one table with each claim of the design beside its
verdict, and each arm's pooled figures, from docs/results/suite_main/v2.1/ (the pooled main file and the verdicts
experiments.suite_claims and experiments.suite_collapse wrote from it, the factorial, the straggler regime and the
stability grid). A part whose JSON is not committed yet is named as not run."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments.results_format import RESULTS, Reader, f3, section, table
from experiments.results_verdicts import POOLED, signed
from experiments.suite_claims import CLAIM_PAIRS
from experiments.suite_stats import p_cell

MAIN = RESULTS / "suite_main/v2.1"
PARTS = {"main": MAIN / "suite.json", "arms": MAIN / "arms.json", "factorial": MAIN / "factorial_claims.json",
         "stragglers": MAIN / "stragglers_claims.json", "stability": MAIN / "stability.json"}
WHAT = {"main": "the main file (pooled)", "arms": "its verdicts", "factorial": "the factorial",
        "stragglers": "the straggler regime", "stability": "the stability grid"}
STRAGGLER_RUNS = MAIN / "stragglers/suite.json"  # the regime's own runs, beside its verdicts
SYNC = RESULTS / "sync_baselines/sync_baselines.json"
SHORT = {"auc_equal_rollouts": "rollouts", "auc_equal_tokens": "tokens", "auc_equal_steps": "steps",
         "auc_equal_compute": "compute", "auc_equal_sim_time": "simulated time"}
CLAIM_OF_ARM = {"ppo": "SAO adapts faster than PPO, each tuned (the clip alone: the factorial)",
                "sao_no_strict_clip": "the strict clip beats no trust region",
                "sao_no_warmup": "critic warm-up helps", "sao_coupled_lambda": "decoupled lambda helps",
                "eta0": "training on stale rollouts (eta 4) beats eta 0", "frozen": "SAO learns (against frozen)"}
HEAD = ["claim of the design", "answered by", "difference [95%]", "Holm p", "verdict", "other views"]


def interval_cell(r: dict) -> str:
    return f"{signed(r['mean'])} [{signed(r['low'])}, {signed(r['high'])}]"


def others(by_outcome: dict[str, dict], key: str) -> list[str]:
    """Each non-primary view's verdict for `key` ('—' where that view left it out)."""
    return [f"{SHORT.get(o, o)}: {by_outcome[o][key]['verdict'] if key in by_outcome[o] else '—'}"
            for o in list(by_outcome)[1:]]


def twins(main: dict) -> dict[str, str]:
    """Arm -> the earlier arm whose runs it repeats outcome for outcome (after tuning their settings are one: an
    arm's own difference laid over a point that already has it, e.g. no KL over a point tuned to KL 0)."""
    runs: dict[str, dict] = {}
    for r in main["runs"]:
        runs.setdefault(r["arm"], {})[(r["drift"], r["seed"])] = (r["auc_equal_rollouts"], r["auc_equal_tokens"])
    found: dict[str, str] = {}
    for i, a in enumerate(names := list(runs)):
        if first := next((b for b in names[:i] if runs[b] == runs[a]), None):
            found[a] = first
    return found


def arm_rows(d: dict, where: str, pooled: dict, regime: str = "", twin: dict | None = None) -> list[list]:
    """One row per arm against the reference: the primary view's difference, Holm p and verdict, the other views'
    verdicts, and (where the arm is in every committed draw's pool) the pooled verdict."""
    by, twin = d["arms"], twin or {}
    rows = []
    for key, r in by[d["outcomes"][0]].items():
        arm = key.split(" vs ")[1]
        other = others(by, key) + ([f"every draw pooled: {pooled[arm]['verdict']}"] if arm in pooled else [])
        claim = CLAIM_OF_ARM.get(arm, f"SAO adapts faster than {arm}") + regime
        if arm in twin:
            claim += f" (the same runs as {twin[arm]}: one setting after tuning)"
        rows.append([claim, f"{where}: {key}", interval_cell(r), p_cell(r["holm_p"], d["n_boot"]), r["verdict"],
                     "; ".join(other) or "—"])
    return rows


def factorial_rows(d: dict) -> list[list]:
    """Each claim at eta 4 from its 4 cell pairs (their differences' range, the largest Holm p), eta 0 beside."""
    by = d["claims"]
    primary = by[d["outcomes"][0]]
    rows = []
    for claim in CLAIM_PAIRS:
        pairs = primary["eta4"][claim]["pairs"].values()
        means = [p["mean"] for p in pairs]
        other = others({o: v["eta4"] for o, v in by.items()}, claim) + [f"eta 0: {primary['eta0'][claim]['verdict']}"]
        worst_p = max(p["holm_p"] for p in pairs)
        rows.append([claim, f"factorial, {len(means)} cell pairs at eta 4", f"{signed(min(means))} to "
                     f"{signed(max(means))}", p_cell(worst_p, d["n_boot"]), primary["eta4"][claim]["verdict"],
                     "; ".join(other)])
    return rows


FACTOR = {"single": "single rollout", "group4": "groups of 4", "value": "value model", "base": "no critic",
          "strict": "strict clip", "oneside": "one-side clip"}
FACTORIAL_POINTS = (
    "No factorial cell is tuned on its own: each takes the tuned point of the main arm it equals in loss and baseline "
    "(experiments/suites/drift_v2_factorial.yaml), so a pair that changes the loss or the baseline changes the lr, "
    "KL and clip width with it (the value cells' clip pair is SAO's point against PPO's; a value-model pair, SAO's or "
    "PPO's against GRPO's or REINFORCE++'s). Only the no-critic cells' clip pairs share one point; at eta 0 they "
    "repeat run for run, as registered: on-policy the clip does not bind.")


def factorial_pair_rows(d: dict) -> list[list]:
    """Each claim's 4 cell pairs, named by the factors they hold fixed: the difference at eta 4 with its Holm p and
    verdict, and eta 0's beside (where the factors interact, the claim's pairs disagree)."""
    by = d["claims"][d["outcomes"][0]]
    rows = []
    for claim, pairs in CLAIM_PAIRS.items():
        for b, w in pairs:
            fixed = ", ".join(FACTOR[x] for x, y in zip(b.split("_"), w.split("_")) if x == y)
            at = {eta: by[eta][claim]["pairs"][f"f_{b}_{eta} vs f_{w}_{eta}"] for eta in ("eta4", "eta0")}
            rows.append([claim, fixed, interval_cell(at["eta4"]), p_cell(at["eta4"]["holm_p"], d["n_boot"]),
                         at["eta4"]["verdict"], interval_cell(at["eta0"]), at["eta0"]["verdict"]])
    return rows


def group_by(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    """The rows by their values of `keys`, in first-seen order."""
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        by.setdefault(tuple(r[k] for k in keys), []).append(r)
    return by


def stability_row(d: dict) -> list:
    """Collapsed cells per arm, against the run's start and against the frozen policy (counts; no test)."""
    cells = ", ".join(f"{a} {sum(c['cell_collapsed_vs_start'] for c in cs)}/"
                      f"{sum(c['cell_collapsed_vs_frozen'] for c in cs)} of {len(cs)}"
                      for (a,), cs in group_by(d["cells"], "arm").items())
    return ["the strict clip keeps SAO from collapsing where the others collapse",
            "stability grid (cells collapsed vs start/vs frozen)", cells, "—", "counts (no test registered)", "—"]


def stability_rows(d: dict) -> list[list]:
    """The grid by arm and eta (its cells: updates per batch x lr factor): cells collapsed by each measure, the
    cells' mean start and final reward, and the lowest cell's final."""
    return [[arm, eta, len(cs), sum(c["cell_collapsed_vs_start"] for c in cs),
             sum(c["cell_collapsed_vs_frozen"] for c in cs), f3(np.mean([c["start"] for c in cs])),
             f3(np.mean([c["final"] for c in cs])), f3(min(c["final"] for c in cs))]
            for (arm, eta), cs in group_by(d["cells"], "arm", "eta").items()]


def collapse_lines(d: dict) -> str:
    """Where the registered collapse rule draws its lines, beside the lowest final: a start near 0 leaves no room."""
    cells, r = d["cells"], d["ratio"]
    start, frozen = (float(np.mean([c[k] for c in cells])) for k in ("start", "frozen_final"))
    return (f"A cell collapses when {d['quorum']} of its seeds end below {r:g} of their start or of the frozen arm's "
            f"final: on average below {f3(r * start)} or {f3(r * frozen)}; the lowest cell ended at "
            f"{f3(min(c['final'] for c in cells))}.")




def straggler_rows(d: dict) -> list[list]:
    """Each arm of the straggler regime: its AUC in simulated time and at equal rollouts, how many runs reached 0.7
    and in how many simulated seconds (the median of those that did)."""
    rows, runs = [], group_by(d["runs"], "arm")
    for p in d["pooled"]:
        rs = runs[(p["arm"],)]
        reached = [r["sim_s_to_0.7"] for r in rs if r["reached_0.7_sim"]]
        rows.append([p["arm"], len(rs), f3(p["auc_equal_sim_time"]), f3(p["auc_equal_rollouts"]),
                     f3(float(np.mean([r["start_success"] for r in rs]))), len(reached),
                     f"{np.median(reached):,.0f}" if reached else "—",
                     f"{np.mean([r['post_drift_learner_steps'] for r in rs]):.1f}"])
    return rows


def sync_row(d: dict) -> list:
    auc = {m["mode"]: m["post_auc"] for m in d["per_mode"]}
    best = max((m for m in auc if m != "async"), key=auc.get)
    return ["asynchronous adapts faster than synchronous", f"§4, {d['per_mode'][0]['seeds']} seeds",
            f"async {f3(auc['async'])}, {best} {f3(auc[best])}", "—",
            f"{best if auc[best] > auc['async'] else 'async'} higher (no test)", "—"]


def pooled_rows(main: dict, twin: dict[str, str]) -> list[list]:
    """Each arm's pooled outcomes as the main file gives them, with its runs' mean start success and post-drift
    learner steps (which the pool does not average)."""
    rows, runs = [], group_by(main["runs"], "arm")
    for p in main["pooled"]:
        rs = runs[(p["arm"],)]
        start, steps = (float(np.mean([r[k] for r in rs])) for k in ("start_success", "post_drift_learner_steps"))
        name = p["arm"] + (f" (= {twin[p['arm']]})" if p["arm"] in twin else "")
        rows.append([name, len(rs), f3(p["auc_equal_rollouts"]), f3(start),
                     signed(p["auc_equal_rollouts"] - start), f3(p["auc_equal_steps"]), f3(p["auc_equal_compute"]),
                     f"{steps:.1f}"])
    return rows


def suite2_verdicts_section(root: Path) -> str:
    get = Reader(root)
    have = {k: get(p) for k, p in PARTS.items() if (root / p).is_file()}
    missing = [f"{WHAT[k]} ({p.name})" for k, p in PARTS.items() if k not in have]
    pooled = get(POOLED)["pooled"] if "arms" in have and (root / POOLED).is_file() else {}
    rows, parts = [], []
    twin = twins(have["main"]) if "main" in have else {}
    if "arms" in have:
        rows += arm_rows(have["arms"], "main", pooled, twin=twin)
    if "factorial" in have:
        rows += factorial_rows(have["factorial"])
    if "stragglers" in have:
        rows += arm_rows(have["stragglers"], "stragglers", {}, ", with stragglers, in simulated time")
    if "stability" in have:
        rows.append(stability_row(have["stability"]))
    rows.append(sync_row(get(SYNC)))
    what = ("Suite 2.1 (`experiments/suites/drift_v2*.yaml`, pre-registered): every arm restarts each drift from one "
            "common pre-drift checkpoint at its tuned point (§15). Each claim of the design beside its verdict: "
            "'holds' (Holm p < 0.05 in the claimed direction), 'does not' (separates the other way), 'not separable "
            "at this power'. Differences: arm minus SAO (a factorial claim: the worse cell minus the better, over its "
            "pairs), post-drift AUC at equal rollouts (the straggler regime: in simulated time), a bootstrap over "
            "seeds and drifts; other views: the same test at equal tokens, learner steps and compute (the critic's "
            "forward and backward charged), and over every committed draw (§14).")
    parts.append(table(HEAD, rows))
    if "main" in have:
        parts.append(table(["arm", "runs", "AUC (equal rollouts)", "start success", "AUC − start",
                            "AUC (equal steps)", "AUC (equal compute)", "post-drift learner steps"],
                           pooled_rows(have["main"], twin)))
    if "factorial" in have:
        parts.append(table(["factorial: claim", "pair holds fixed", "eta 4: difference [95%]", "Holm p", "verdict",
                            "eta 0: difference [95%]", "verdict"], factorial_pair_rows(have["factorial"])))
        parts.append(FACTORIAL_POINTS)
    if "stragglers" in have and (root / STRAGGLER_RUNS).is_file():
        parts.append(table(["straggler regime: arm", "runs", "AUC (simulated time)", "AUC (equal rollouts)",
                            "start success", "runs reaching 0.7", "median simulated s to 0.7",
                            "post-drift learner steps"], straggler_rows(get(STRAGGLER_RUNS))))
    if "stability" in have:
        parts.append(table(["stability grid: arm", "eta", "cells", "collapsed vs start", "collapsed vs frozen",
                            "start", "final", "lowest cell's final"], stability_rows(have["stability"])))
        parts.append(collapse_lines(have["stability"]))
    if missing:
        parts.append(f"Not run yet, in {MAIN}/: {', '.join(missing)}.")
    reports = [d / f"suite.{x}" for d in (MAIN, MAIN / "factorial", MAIN / "stragglers") for x in ("md", "png")]
    report = [p for p in [*reports, MAIN / "stability.md", MAIN / "stability.png"] if (root / p).is_file()]
    return section("16. Suite 2.1: each claim beside its verdict", what, parts, [*get.read, *report], [])
