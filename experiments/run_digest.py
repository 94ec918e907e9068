"""Figures of a `sao up` run directory, as JSON (quoted in docs/results/runs/<name>/; never typed by hand).

    .venv/bin/python -m experiments.run_digest runs/<run> > docs/results/runs/<name>/digest.json

Learner: steps, skipped steps, steps with a non-finite loss/metric, clip fractions (low/high/all:
the masked fraction of the sao loss) over policy steps, entropy first/last tenth. Trajectories: mean
reward per phase and per (phase, family), first/last window of the online reward.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pandas as pd

from streamer.runs.adaptation import DEFAULT_WINDOW
from streamer.runs.artifacts import read_learner, read_summary, read_trajectories

CLIP = ("learner/clip_frac", "learner/clip_frac_low", "learner/clip_frac_high")


def _num(s: pd.Series) -> pd.Series:
    return pd.to_numeric(s, errors="coerce")


def learner_figures(lrn: pd.DataFrame) -> dict:
    lrn = lrn.sort_values("step")
    metric_cols = [c for c in lrn.columns if c.startswith("learner/")]
    values = lrn[metric_cols].apply(_num)
    # a policy step has a policy loss; value warm-up steps leave it NaN by design (not "non-finite")
    pol = lrn[_num(lrn.get("learner/policy_loss", pd.Series(np.nan, index=lrn.index))).notna()]
    inf_rows = np.isinf(values.to_numpy(float)).any(axis=1)
    out = {"steps": int(len(lrn)), "last_step": int(lrn["step"].max()) if len(lrn) else 0,
           "skipped_steps": int(lrn["skipped"].sum()) if "skipped" in lrn else 0,
           "steps_with_inf_metric": int(inf_rows.sum()), "policy_steps": int(len(pol)),
           "policy_steps_with_nan_loss_or_grad": int(
               (_num(pol["learner/policy_loss"]).isna() | _num(pol["learner/grad_norm"]).isna()).sum())
           if len(pol) else 0}
    for c in CLIP:
        if c in pol and len(pol):
            v = _num(pol[c])
            out[c.split("/")[-1]] = {"mean": float(v.mean()), "max": float(v.max()), "p99": float(v.quantile(0.99))}
    if "learner/entropy" in pol and len(pol) >= 10:
        e, k = _num(pol["learner/entropy"]).to_numpy(float), max(1, len(pol) // 10)
        out["entropy_first_tenth"], out["entropy_last_tenth"] = float(np.nanmean(e[:k])), float(np.nanmean(e[-k:]))
    if "learner/kl_k3" in pol and len(pol):
        out["kl_k3_max"] = float(_num(pol["learner/kl_k3"]).max())
    if "staleness_mean" in lrn:
        out["staleness_mean"] = float(_num(lrn["staleness_mean"]).mean())
    counts = [c for c in lrn.columns if c.startswith("learner/count_")]
    out["learner_counts_last"] = {c.split("count_")[-1]: float(lrn[c].dropna().iloc[-1])
                                  for c in counts if lrn[c].notna().any()}
    return out


def reward_figures(traj: pd.DataFrame, window: int = DEFAULT_WINDOW) -> dict:
    traj = traj.sort_values("finished_at")
    r = traj["reward"].to_numpy(float)
    per_phase = traj.groupby("phase")["reward"].agg(["mean", "size"])
    fam = traj.groupby(["phase", "family"])["reward"].mean()
    return {"trajectories": int(len(traj)),
            "reward_per_phase": {str(p): {"mean": float(m), "n": int(n)} for p, (m, n) in per_phase.iterrows()},
            "reward_per_phase_family": {f"{p}/{f}": float(v) for (p, f), v in fam.items()},
            "first_window_reward": float(r[:window].mean()) if r.size else math.nan,
            "last_window_reward": float(r[-window:].mean()) if r.size else math.nan}


def digest(run_dir: str) -> dict:
    summary = read_summary(run_dir) or {}
    return {"run": run_dir, "stopped": summary.get("stopped"), "learner": learner_figures(read_learner(run_dir)),
            "rewards": reward_figures(read_trajectories(run_dir))}


if __name__ == "__main__":
    print(json.dumps(digest(sys.argv[1]), indent=1, default=float))
