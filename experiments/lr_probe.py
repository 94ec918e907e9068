"""Learning-rate probe: SAO on a stationary stream at a few policy learning rates, reward per 100 trajectories.

The benchmark scenario's first phase alone (no drift, so a falling reward is the optimiser's doing),
one agent with 8 tasks in flight running up to 4 versions ahead, batches of 16 trajectories, 60
learner steps per rate. Writes <out>/lr_probe.json: per rate the windowed reward by 100 trajectories
and the clipped fraction per step. This is how the default `optim.lr` was chosen.

    .venv/bin/python -m experiments.lr_probe                       # 3e-4 and 5e-5, 60 steps each (~4 min)
    .venv/bin/python -m experiments.lr_probe --lrs 1e-4 --steps 100
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.common import machine, save_json
from experiments import common as c
from experiments.stability import algorithms, stationary


def probe(lr: str, steps: int, out: Path, base_path: Path, scn: Path) -> dict:
    sao = next(a for a in algorithms() if a.name == "sao")
    r = c.launch(sao, f"lr{lr}", scn, out / "runs", c.Budget(learner_steps=steps, max_seconds=300), [], base_path,
                 agents=1, extra_sets=["batch.max_staleness=4", "batch.tokens=1048576", "batch.max_trajectories=16",
                                       "threads=1", f"optim.lr={lr}"],
                 agent_sets=["concurrency=8", "tasks_per_version=16", "versions_ahead=4"])
    traj, learner, _ = c.read_run(r["run_dir"])
    traj = traj.sort_values("finished_at")
    reward = [float(traj.iloc[i:i + 100]["reward"].mean()) for i in range(0, len(traj), 100)]
    return {"lr": float(lr), **r, "learner_steps": int(len(learner)), "trajectories": int(len(traj)),
            "reward_per_100": reward, "clip_frac": [float(x) for x in learner.get("learner/clip_frac", [])]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lrs", default="3e-4,5e-5", help="comma-separated policy learning rates")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default="runs/bench/lr_probe")
    args = p.parse_args(argv)
    out, t0, machine_before = Path(args.out), time.monotonic(), machine()
    base_path = c.snapshot_base()
    scn = c.write_scenario(stationary(c.base_scenario(base_path), 4000), out / "stationary.yaml")
    rows = [probe(lr, args.steps, out, base_path, scn) for lr in args.lrs.split(",")]
    result = {"bench": "lr_probe", "command": " ".join(["python -m experiments.lr_probe", *(argv or sys.argv[1:])]),
              "machine_before": machine_before, "machine_after": machine(), "wall_s": time.monotonic() - t0,
              "runs": rows}
    save_json(result, out / "lr_probe.json")
    for r in rows:
        print(f"lr {r['lr']:g}: {r['learner_steps']} steps, reward per 100 trajectories "
              f"{[round(x, 3) for x in r['reward_per_100']]}")
    print(f"wrote {out / 'lr_probe.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
