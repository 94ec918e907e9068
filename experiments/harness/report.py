"""What a harness run's Result says: the per-(phase, family, concept) table and the run's summary."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from experiments.harness.loop import Result


def by_phase(traj: pd.DataFrame) -> list[dict]:
    """Mean reward and trajectories of each (phase, family, concept), and what happened to them."""
    out = []
    for (ph, fam, con), g in traj.sort_values(["seq", "member"]).groupby(["phase", "family", "concept"]):
        r = g["reward"].to_numpy(float)
        out.append({"phase": int(ph), "family": fam, "concept": con, "n": int(len(r)), "reward": float(r.mean()),
                    "first64": float(r[:64].mean()), "last64": float(r[-64:].mean()),
                    "trained": int((g["status"] == "trained").sum()), "stale": int((g["status"] == "stale").sum())})
    return out


def summary(res: Result, threads: int) -> dict[str, Any]:
    t = res.trajectories
    trained = t[t["status"] == "trained"] if len(t) else t
    return {"trajectories": int(len(t)), "learner_steps": int(len(res.steps)), "wall_s": round(res.wall_s, 2),
            "sim_s": round(res.sim_s, 2), "trajectories_per_wall_s": round(res.per_wall_s, 1),
            "cpu_s": round(res.cpu_s, 2), "trajectories_per_cpu_s_per_thread": round(res.per_cpu_s(threads), 1),
            "sections": res.sections,
            "trained": int(len(trained)), "reward_mean": float(t["reward"].mean()) if len(t) else math.nan,
            "staleness_at_train": {str(k): int(v) for k, v in
                                   trained["staleness_at_train"].value_counts().sort_index().items()},
            "counts": res.counts}

