"""summary.json: a run's figures in one file, computed from its directory with the shared definitions.

AUC, recovery of every (drift event, family) and its counts per status, forgetting of recurring
concepts, final reward per concept, staleness, throughput and the learner's shares; each defined
once in `streamer.runs.adaptation`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pandas as pd

from streamer.wire.reductions import reduce_values
from streamer.runs import adaptation as ad
from streamer.runs.layout import finite
from streamer.runs.readers import read_drift, read_learner, read_trajectories

IDLE_METRICS = ("perf/idle_s",)  # the learner's idle-time metrics: `learner_idle` reduces each over the run


def summarize(run_dir: str | Path, window: int = ad.DEFAULT_WINDOW, delta: float = ad.DEFAULT_DELTA,
              floor: float = ad.DEFAULT_FLOOR) -> dict[str, Any]:
    """The run's summary (NaN written as null): see the module doc."""
    traj, learner = read_trajectories(run_dir), read_learner(run_dir)
    drift = [msgspec.to_builtins(e) for e in read_drift(run_dir)]
    out: dict[str, Any] = {"run": Path(run_dir).name, "window": window, "delta": delta, "floor": floor,
                           "n_trajectories": int(len(traj)), "n_learner_steps": int(len(learner)),
                           "n_drift_events": len(drift)}
    if len(traj):
        out.update(_reward(ad.sort_by(traj, "finished_at"), window))
    rec = ad.drift_recoveries(traj, drift, learner, window, delta, floor)
    out["recoveries"] = rec.to_dict(orient="records")
    out["recovery_summary"] = ad.recovery_summary(rec)
    out["staleness"] = _staleness(traj, learner)
    out["trained_fraction"] = ad.trained_fraction(learner, len(traj))
    out["learner_busy_share"] = ad.learner_busy_share(learner)
    if len(learner):
        out["learner_tokens_per_s"] = ad.rate(learner["time"], learner["n_tokens"])
        out["learner_steps_per_s"] = ad.rate(learner["time"])
        out["learner_idle"] = {c: reduce_values(c, pd.to_numeric(learner[c], errors="coerce"))
                               for c in IDLE_METRICS if c in learner}
    out["forgetting"] = ad.forgetting(traj, drift, window).to_dict(orient="records") if drift else []
    return finite(out)


def _reward(traj: pd.DataFrame, window: int) -> dict[str, Any]:
    """AUC (whole stream and per family), final reward per concept (its last W), trajectories per second."""
    return {"auc": ad.auc(traj["reward"].to_numpy(float), window),
            "auc_per_family": {f: ad.auc(g["reward"].to_numpy(float), window) for f, g in traj.groupby("family")},
            "final_reward_per_concept": {f"{f}/{c}": float(g["reward"].to_numpy(float)[-window:].mean())
                                         for (f, c), g in traj.groupby(["family", "concept"])},
            "trajectories_per_s": ad.rate(traj["finished_at"])}


def _staleness(traj: pd.DataFrame, learner: pd.DataFrame) -> dict[str, float]:
    if len(traj) and "learner_version" in traj and traj["learner_version"].notna().any():
        return ad.staleness_stats((traj["learner_version"] - traj["policy_version"]).to_numpy(float))
    if len(learner) and "staleness" in learner:
        return ad.staleness_stats(ad.staleness_from_histograms(json.loads(s) for s in learner["staleness"]))
    return ad.staleness_stats([])


def eval_points(metrics: pd.DataFrame) -> pd.DataFrame:
    """Eval rewards per concept: MetricPoint rows named `eval/reward` with a `concept` label (the held-out
    evaluator's), columns time, concept, value (and family)."""
    if not len(metrics) or "concept" not in metrics or "name" not in metrics:
        return pd.DataFrame(columns=["time", "concept", "value", "family"])
    ev = metrics[metrics["name"] == "eval/reward"]
    cols = ["time", "concept", "value"] + (["family"] if "family" in ev else [])
    return ev[cols].reset_index(drop=True)
