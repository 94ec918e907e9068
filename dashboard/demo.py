"""A synthetic run directory (for the dashboard's tests, its benchmark and a demo), written with the
real artifact writers: rewards that drop at each drift and recover, learner events with the usual
metrics, eval points per concept. Vectorised, so a 1,000,000-trajectory run takes seconds.

    python -m dashboard.demo runs/demo --trajectories 20000 [--live-seconds 30]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd

from streamer.runs import artifacts as art
from streamer.wire.schema import DriftEvent

FAMILIES = ("arith", "string")
CONCEPTS = {"arith": ("add", "mul", "add"), "string": ("rev", "upper", "rev")}  # phase 2 recurs to phase 0


def frames(n: int, seed: int = 0, t0: float = 1_000_000.0, rate: float = 50.0, traj_per_step: int = 32,
           n_phases: int = 3) -> dict:
    """All rows of a synthetic run: trajectories, learner rows, metric rows, drift events."""
    rng = np.random.default_rng(seed)
    i = np.arange(n)
    fin = t0 + i / rate
    phase = np.minimum(i * n_phases // max(n, 1), n_phases - 1)
    fam = np.array(FAMILIES)[i % len(FAMILIES)]
    start = np.array([p * n // n_phases for p in range(n_phases)])
    since = i - start[phase]
    # success probability: 0.9 at the end of a phase; after a drift it drops to 0.2 and climbs back
    p = np.where(phase == 0, 0.9, 0.9 - 0.7 * np.exp(-since / max(1.0, n / n_phases / 8)))
    reward = (rng.random(n) < p).astype(float)
    concept = np.empty(n, dtype=object)
    for f in FAMILIES:
        for ph in range(n_phases):
            concept[(fam == f) & (phase == ph)] = CONCEPTS[f][ph % len(CONCEPTS[f])]
    version = i // traj_per_step
    stale = rng.integers(0, 4, n)
    traj = pd.DataFrame({"traj_id": [f"t{k}" for k in i], "task_id": [f"k{k}" for k in i], "family": fam,
                         "concept": concept, "phase": phase, "reward": reward, "success": reward > 0.5,
                         "policy_version": np.maximum(version - stale, 0), "n_tokens": 24, "n_gen_tokens": 8,
                         "agent_id": "a0", "created_at": fin - 0.2, "finished_at": fin,
                         "learner_step": (version + 1).astype(float), "learner_version": (version + 1).astype(float)})
    n_steps = n // traj_per_step
    s = np.arange(n_steps)
    st = t0 + (s + 1) * traj_per_step / rate
    learner = pd.DataFrame({"step": s, "version": s + 1, "time": st, "n_trajectories": traj_per_step,
                            "n_tokens": traj_per_step * 8, "skipped": False,
                            "staleness": ['{"0": 8, "1": 24}'] * n_steps, "staleness_mean": 0.75,
                            "staleness_max": 1.0, "task_ids": ["[]"] * n_steps,
                            "learner/clip_frac_low": 0.01 + 0.01 * np.sin(s / 7) ** 2,
                            "learner/clip_frac_high": 0.02 + 0.01 * np.cos(s / 9) ** 2,
                            "learner/value_loss": 1.0 / (1 + s / 50),
                            "learner/explained_variance": 1 - 1 / (1 + s / 50),
                            "learner/kl": 0.001 * (1 + np.sin(s / 11) ** 2), "learner/entropy": 1.5 / (1 + s / 200),
                            "perf/idle_s": 0.05 + 0.02 * (s % 5)})
    drift = [DriftEvent(phase=ph, prev_phase=ph - 1, name=f"phase{ph}", schedule="abrupt", families=list(FAMILIES),
                        concepts={f: CONCEPTS[f][ph] for f in FAMILIES},
                        prev_concepts={f: CONCEPTS[f][ph - 1] for f in FAMILIES}, at_seq=int(start[ph]),
                        time=float(t0 + (start[ph] - 0.5) / rate)) for ph in range(1, n_phases)]
    ev_t = t0 + np.arange(0, n, max(1, n // 40)) / rate
    rows = []
    for t in ev_t:
        ph = int(np.searchsorted(start, (t - t0) * rate, side="right") - 1)
        for f in FAMILIES:
            for c in sorted(set(CONCEPTS[f])):
                active = CONCEPTS[f][ph] == c
                rows.append({"name": "eval/reward", "value": 0.9 if active else 0.4, "time": float(t), "window": 0.0,
                             "count": 64, "trajectories": int((t - t0) * rate), "learner_step": 0,
                             "family": f, "concept": c})
    return {"trajectories": traj, "learner": learner, "metrics": pd.DataFrame(rows), "drift": drift}


def write(run_dir: str | Path, n: int, parts: int = 4, delay_s: float = 0.0, seed: int = 0,
          close: bool = True, t0: float | None = None) -> Path:
    """Write a synthetic run in `parts` chunks (sleeping `delay_s` between them, as a live run would)."""
    t0 = time.time() - n / 50.0 if t0 is None else t0
    f = frames(n, seed, t0=t0)
    w = art.RunWriter(run_dir, config={"demo": True, "trajectories": n, "seed": seed})
    bounds = np.linspace(0, n, parts + 1).astype(int)
    emitted = 0
    for k in range(parts):
        lo, hi = bounds[k], bounds[k + 1]
        t_hi = f["trajectories"]["finished_at"].iloc[hi - 1] if hi > lo else -math.inf
        w.tables["trajectories"].write_frame(f["trajectories"].iloc[lo:hi])
        lr = f["learner"][(f["learner"]["time"] <= t_hi) & (f["learner"]["step"] >= _steps_done(w))]
        if len(lr):
            w.tables["learner"].write_frame(lr)
        m = f["metrics"]
        m = m[(m["time"] <= t_hi) & (m["time"] > (f["trajectories"]["finished_at"].iloc[lo - 1] if lo else -math.inf))]
        if len(m):
            w.tables["metrics"].write_frame(m)
        for e in f["drift"][emitted:]:
            if e.time <= t_hi:
                w.drift(e)
                emitted += 1
        if delay_s and k < parts - 1:
            time.sleep(delay_s)
    # close=False leaves the parts as a live run has them (no compaction, no summary)
    w.close(compact=close, summary=close)
    return Path(run_dir)


def _steps_done(w: art.RunWriter) -> int:
    df = art.read_learner(w.dir)
    return int(df["step"].max()) + 1 if len(df) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dashboard.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--trajectories", type=int, default=20000)
    p.add_argument("--parts", type=int, default=10)
    p.add_argument("--live-seconds", type=float, default=0.0, help="spread the parts over this many seconds")
    a = p.parse_args(argv)
    write(a.run_dir, a.trajectories, a.parts, a.live_seconds / max(1, a.parts - 1))
    print(a.run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
