"""The drift suite's report (issue 15, item 8): a figure and Markdown tables from a suite's JSON and run files.

Reads a suite's JSON (DIR/suite.json, a pilot.json, or suite_plan's pilot-lr-*.json) and the run files it names
(DIR/runs/*.json, or --runs DIR [DIR ...]); writes <stem>.png beside it (post-drift success per drift and arm, mean
over seeds, and the pooled AUC difference to SAO with its 95% interval per arm) and <stem>.md (the pooled table, then
per drift and arm: AUCs with their paired differences, final reward and the Kaplan-Meier medians of samples to 70%
and 80% with their censoring counts; a censored median is "> N").

    .venv/bin/python -m experiments.suite_report runs/bench/suite/suite.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import pyplot
from experiments import stats


def interval(d: dict | None) -> str:
    """A paired difference and its interval; `*` when the interval excludes 0 (the suite's 'separates')."""
    if not d:
        return ""
    mark = "*" if stats.verdict(d) != "0" else ""
    return f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]{mark}"


def median_cell(median: float | None, censored: int, n: int, phase: int) -> str:
    """A Kaplan-Meier median of samples to a threshold: never a number when the median itself is censored."""
    shown = f"> {phase:,}" if median is None else f"{median:,.0f}"
    return f"{shown} ({censored}/{n} censored)"


def pooled_table(result: dict) -> str:
    ref = result["reference_arm"]
    lines = [f"| arm | seeds | AUC, equal rollouts | minus {ref} [95%] | AUC, equal tokens | minus {ref} [95%] | "
             f"final reward | minus {ref} [95%] |", "|---|---|---|---|---|---|---|---|"]
    for e in result["pooled"]:
        cells = [e["arm"], str(e["seeds"])]
        for k in ("auc_equal_rollouts", "auc_equal_tokens", "final_reward"):
            cells += [f"{e[k]:.3f}", interval(e.get(f"{k}_minus_{ref}"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def drift_table(result: dict, phase: dict[str, int]) -> str:
    ref = result["reference_arm"]
    lines = [f"| drift | arm | AUC, equal rollouts | minus {ref} [95%] | AUC, equal tokens | final | "
             "samples to 0.7 (KM median) | samples to 0.8 (KM median) |", "|---|---|---|---|---|---|---|---|"]
    for e in result["per_drift_arm"]:
        n, post = e["seeds"], phase.get(e["drift"], 0)
        lines.append("| " + " | ".join([
            e["drift"], e["arm"], f"{e['auc_equal_rollouts']:.3f}", interval(e.get(f"auc_equal_rollouts_minus_{ref}")),
            f"{e['auc_equal_tokens']:.3f}", f"{e['final_reward']:.3f}",
            median_cell(e["km_median_samples_to_0.7"], e["censored_0.7"], n, post),
            median_cell(e["km_median_samples_to_0.8"], e["censored_0.8"], n, post)]) + " |")
    return "\n".join(lines)


def success_curves(runs: list[dict], window: int) -> dict[str, dict[str, np.ndarray]]:
    """Per drift and arm, the `window`-mean post-drift success, averaged over the seeds (cut to the shortest)."""
    by: dict[str, dict[str, list[np.ndarray]]] = {}
    for r in runs:
        s = r["post_drift"]["success"]
        if len(s) >= window:
            by.setdefault(r["drift"], {}).setdefault(r["arm"], []).append(stats.window_means(s, window))
    return {d: {a: np.mean([c[:min(map(len, cs))] for c in cs], axis=0) for a, cs in arms.items()}
            for d, arms in by.items()}


def figure_title(result: dict, runs: list[dict]) -> str:
    """The suite, the seeds per cell, and the seeds the curves hold where that is fewer (a pooled result whose
    earlier parts' run files are gone)."""
    pilot = "PILOT, " if result.get("pilot") else ""
    title = f"{result['suite']}: {pilot}seeds per cell {result['pooled'][0]['seeds']}"
    drawn, pooled = sorted({r["seed"] for r in runs}), sorted({r["seed"] for r in result["runs"]})
    if drawn != pooled:
        title += f"; curves: seeds {', '.join(map(str, drawn))} only (the others' run files not given)"
    return title + (" (provisional values used)" if result.get("provisional") else "")


def figure(result: dict, runs: list[dict], window: int, path: Path) -> Path:
    plt = pyplot()
    curves = success_curves(runs, window)
    drifts = list(curves)
    cols = 4
    rows = -(-(len(drifts) + 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    arms = [e["arm"] for e in result["pooled"]]
    colours = {a: plt.get_cmap("tab20")((2 * i) % 20 + (2 * i) // 20) for i, a in enumerate(arms)}  # hues first
    for ax, d in zip(axes.flat, drifts):
        for a in arms:
            if a in curves[d]:
                y = curves[d][a]
                ax.plot(np.arange(window, window + len(y)), y, lw=1.6 if a == result["reference_arm"] else 1.0,
                        ls="--" if a == "frozen" else "-", color=colours[a], label=a)
        ax.set_title(d, fontsize=10)
        ax.set_xlabel("post-drift rollouts", fontsize=8)
        ax.set_ylabel(f"success ({window}-window)", fontsize=8)
        ax.set_ylim(0, 1)
        ax.tick_params(labelsize=7)
    forest = axes.flat[len(drifts)]
    ref = result["reference_arm"]
    others = [e for e in result["pooled"] if e["arm"] != ref]
    for i, e in enumerate(others):
        d = e[f"auc_equal_rollouts_minus_{ref}"]
        forest.errorbar(d["mean"], i, xerr=[[d["mean"] - d["low"]], [d["high"] - d["mean"]]], fmt="o",
                        color=colours[e["arm"]], capsize=3)
    forest.axvline(0, color="grey", lw=0.8)
    forest.set_yticks(range(len(others)), [e["arm"] for e in others], fontsize=7)
    forest.set_xlabel(f"pooled post-drift AUC minus {ref} (95% CI, seeds resampled, drifts fixed)", fontsize=8)
    forest.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(drifts) + 1:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6, ncol=2)
    fig.suptitle(figure_title(result, runs), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(result_path: Path, runs_dirs: list[Path] | None = None, out_dir: Path | None = None) -> dict[str, Any]:
    """<stem>.png and <stem>.md for a suite's (or pilot's) JSON, from the run files it names in `runs_dirs` (default:
    the JSON's directory's runs/; a pooled suite.json names the runs of every part)."""
    result = json.loads(result_path.read_text())
    runs_dirs = runs_dirs or [result_path.parent / "runs"]
    out_dir = out_dir or result_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    keep = {(r["arm"], r["drift"], r["seed"]) for r in result["runs"]}
    runs = [r for d in runs_dirs for f in sorted(d.glob("*.json")) if (r := json.loads(f.read_text()))
            and (r["arm"], r["drift"], r["seed"]) in keep]
    window = int(result.get("window", 64))  # pilot.json files of drift_v1 1.0 did not record it: 64 then
    phase = {r["drift"]: len(r["post_drift"]["success"]) for r in runs}
    png = figure(result, runs, window, out_dir / f"{result_path.stem}.png")
    md = out_dir / f"{result_path.stem}.md"
    title = (f"Pooled over drifts ({result['suite']}; intervals resample seeds, drifts fixed; `*`: the 95% interval "
             "excludes 0)")
    md.write_text("\n\n".join([title,
                                pooled_table(result), "Per drift and arm", drift_table(result, phase)]) + "\n")
    return {"png": str(png), "report": str(md)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="a suite.json, pilot.json or pilot-lr-*.json")
    p.add_argument("--runs", nargs="+", help="the run files' directories (default: runs/ beside the JSON)")
    p.add_argument("--out", help="where the PNG and Markdown go (default: beside the JSON)")
    a = p.parse_args(argv)
    print(json.dumps(report(Path(a.result), a.runs and [Path(d) for d in a.runs], a.out and Path(a.out))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
