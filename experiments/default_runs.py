"""`sao up` on its defaults for several seeds: does the main job recover every drift of the default scenario?

Each seed is one `sao up --seed S` (dashboard included, as `make up` runs it) (the task stream, the learner and the
agents seeded; the warm start is shared and cached). Per seed it keeps summary.json, and it draws the reward of every
concept by phase (windowed over each family's trajectories in stream order, drift positions marked) into one PNG. The
verdict per drift event and family is `streamer.runs.adaptation.drift_recoveries`' status, the one definition of the
project.

    .venv/bin/python -m experiments.default_runs --seeds 0,1,2 --out docs/results/runs/default
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import machine, pyplot, save_figure, save_json
from streamer.runs.adaptation import in_stream_order
from streamer.runs.artifacts import read_trajectories

WINDOW = 64


def run_seed(seed: int, runs_dir: Path, extra: list[str]) -> Path:
    run = f"default-seed{seed}"
    if (runs_dir / run).exists():
        shutil.rmtree(runs_dir / run)
    cmd = [sys.executable, "-m", "streamer.launch.cli", "up", "--seed", str(seed), "--run", run,
           "--runs-dir", str(runs_dir), *extra]
    print("$ " + " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=False)
    return runs_dir / run


def verdicts(summary: dict) -> list[dict]:
    keep = ("name", "family", "prev_concept", "concept", "status", "pre_level", "initial_level", "trajectories",
            "stream_trajectories", "learner_steps", "low_pre_level")
    return [{k: r.get(k) for k in keep} for r in summary.get("recoveries", []) if r.get("status") != "unaffected"]


def plot(runs: list[Path], path: Path) -> Path:
    plt = pyplot()
    fams = ["arith", "string", "format", "tool"]
    fig, axes = plt.subplots(len(fams), 1, figsize=(10, 2.2 * len(fams)), sharex=True)
    for run in runs:
        t = in_stream_order(read_trajectories(run))
        t["i"] = np.arange(len(t))
        bounds = t.groupby("phase")["i"].min().tolist()[1:]
        for ax, fam in zip(axes, fams):
            f = t[t["family"] == fam]
            for con, g in f.groupby("concept"):
                r = g["reward"].rolling(WINDOW, min_periods=WINDOW // 4).mean()
                ax.plot(g["i"], r, lw=1, label=f"{con} (seed {run.name.removeprefix('default-seed')})")
            for b in bounds:
                ax.axvline(b, color="grey", ls="--", lw=0.7)
            ax.set_ylabel(fam)
            ax.set_ylim(0, 1.05)
    for ax in axes:
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles[:8], labels[:8], fontsize=6, loc="lower left", ncol=4)
    axes[-1].set_xlabel("task stream position (trajectories); dashed: phase starts")
    return save_figure(fig, path, f"reward by concept ({WINDOW}-trajectory window of each family), {len(runs)} seeds")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--out", default="runs/bench/default")
    p.add_argument("extra", nargs="*", help="more `sao up` arguments (after --)")
    a = p.parse_args(argv)
    out, runs_dir = Path(a.out), Path(a.runs_dir)
    out.mkdir(parents=True, exist_ok=True)
    results, runs = [], []
    for seed in (int(s) for s in a.seeds.split(",")):
        t0 = time.monotonic()
        run_dir = run_seed(seed, runs_dir, a.extra)
        wall = time.monotonic() - t0
        summary = json.loads((run_dir / "summary.json").read_text())
        shutil.copy(run_dir / "summary.json", out / f"summary-seed{seed}.json")
        runs.append(run_dir)
        v = verdicts(summary)
        results.append({"seed": seed, "wall_s": round(wall, 1), "stopped": summary.get("stopped"), "drifts": v,
                        "recovered": sum(r["status"] == "recovered" for r in v), "drifted": len(v)})
        for r in v:
            print(f"seed {seed} {r['name']:16s} {r['family']:7s} {r['prev_concept']}->{r['concept']}: {r['status']} "
                  f"pre {r['pre_level']:.2f} initial {r['initial_level']:.2f} traj {r['trajectories']} "
                  f"steps {r['learner_steps']}", flush=True)
    png = plot(runs, out / "reward_by_phase.png")
    command = " ".join(["python -m experiments.default_runs", *(argv or sys.argv[1:])])
    save_json({"bench": "default_runs", "command": command,
               "machine": machine(), "png": str(png), "runs": results}, out / "default_runs.json")
    print(f"wrote {out / 'default_runs.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
