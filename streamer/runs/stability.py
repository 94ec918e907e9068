"""The learner's health over a run: collapse, the clipped share of tokens, its admission counters.

Collapse (`collapsed`): a non-finite (skipped) update, or an entropy collapse (`policy_blowup`: the
mean entropy of the last tenth of policy steps below 10% of the first tenth's; not judged with
fewer than 10 policy steps). The reward of the first and last windows and the largest KL (k3)
between learner and behaviour policy are reported, not judged: drifts lower the reward by design,
and at high staleness the KL is large by construction. Policy steps leave out critic warm-up.
Each learner metric reduces over the run as `streamer.wire.reductions` declares.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from streamer.wire.reductions import reduce_values
from streamer.runs.reward import mean_or_nan

CLIP_METRICS = ("learner/clip_frac", "learner/clip_frac_low", "learner/clip_frac_high")


def policy_events(learner: pd.DataFrame) -> pd.DataFrame:
    """Learner events that updated the policy (value warm-up steps left out)."""
    if not len(learner) or "learner/value_warmup" not in learner:
        return learner
    return learner[learner["learner/value_warmup"] != 1.0]


def learner_counts(learner: pd.DataFrame) -> dict[str, int]:
    """The learner's admission counters (`learner/count_<reason>`, running totals) at its last event by step
    (ok, stale = dropped as too old, ...)."""
    if not len(learner):
        return {}
    ordered = learner.sort_values("step")
    out = {}
    for k in learner.columns:
        if str(k).startswith("learner/count_"):
            v = reduce_values(k, ordered[k].iloc[-1:])  # "last" of the last event: a NaN there is no count
            if math.isfinite(v):
                out[k.split("count_", 1)[1]] = int(v)
    return out


def masked_fraction(learner: pd.DataFrame) -> dict[str, float]:
    """Share of response tokens the clip cut, over policy steps (not value warm-up): clip_frac and its
    low and high sides, each reduced over the steps as declared (mean)."""
    if not len(learner):
        return {}
    pol = policy_events(learner)
    return {k.split("/")[-1]: reduce_values(k, pd.to_numeric(pol[k], errors="coerce"))
            for k in CLIP_METRICS if k in pol}


def policy_blowup(learner: pd.DataFrame) -> dict[str, Any]:
    """Entropy collapse: the mean entropy of the last tenth of policy steps < 10% of the first tenth's (not
    judged with fewer than 10 policy steps), and the largest KL (k3), reported only."""
    pol = policy_events(learner)
    if len(pol) < 10 or "learner/entropy" not in pol:
        return {"entropy_first": None, "entropy_last": None, "kl_k3_max": None, "blowup": False}
    tenth = max(1, len(pol) // 10)
    ent = pd.to_numeric(pol["learner/entropy"], errors="coerce")
    kl = pd.to_numeric(pol["learner/kl_k3"], errors="coerce") if "learner/kl_k3" in pol else pd.Series(dtype=float)
    e0, e1 = float(ent.iloc[:tenth].mean()), float(ent.iloc[-tenth:].mean())
    kmax = float(kl.max()) if kl.notna().any() else math.nan
    return {"entropy_first": e0, "entropy_last": e1, "kl_k3_max": kmax, "blowup": bool(e0 > 0 and e1 < 0.1 * e0)}


def collapsed(traj: pd.DataFrame, learner: pd.DataFrame, window: int) -> dict[str, Any]:
    """Collapse: a non-finite (skipped) update or an entropy collapse (`policy_blowup`), with the mean reward
    of the first and last `window` trajectories (in the given order) reported."""
    skipped = int(learner["skipped"].sum()) if len(learner) and "skipped" in learner else 0
    r = traj["reward"].to_numpy(float) if len(traj) else np.zeros(0)
    blow = policy_blowup(learner)
    return {"collapsed": bool(skipped > 0 or blow["blowup"]), "skipped_steps": skipped,
            "first_window_reward": mean_or_nan(r[:window]), "last_window_reward": mean_or_nan(r[-window:]), **blow}
