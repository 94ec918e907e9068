"""The run analysis: one definition of each adaptation metric, used by summary.json, the dashboard and the benchmarks.

Import them from here; each lives in its own module:

- online reward (`reward`): each trajectory's reward at generation time, averaged over a trailing
  window of W trajectories (`windowed_reward`); AUC (`auc`): its mean over the stream.
- stream order and drift blocks (`stream`): positions are the task's seq (or created_at), never
  wall time; a trajectory's block is set by its phase and, inside a phase, its stream position.
- recovery of a drift event, per family (`recovery`: `drift_recoveries`, `recovery_summary`):
  trajectories until the family's windowed reward is back within δ of its pre-drift level.
- forgetting (`forgetting`): when a concept is rewarded again, the mean online reward of its first
  W trajectories minus that of its last W before it left, on the same stream blocks.
- collapse (`stability`: `collapsed`): a non-finite update or an entropy collapse.
- staleness (`staleness_stats`): learner version at training time minus behaviour version.
- pipeline shares: `trained_fraction` (trained ÷ generated trajectories), `learner_busy_share`.

Pure functions over numpy arrays and pandas DataFrames.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np
import pandas as pd

from streamer.runs.forgetting import FORGETTING_COLUMNS, forgetting, forgetting_mean
from streamer.runs.recovery import (
    DEFAULT_DELTA,
    DEFAULT_FLOOR,
    IN_PROGRESS,
    RECOVERY_COLUMNS,
    STATUSES,
    Recovery,
    drift_recoveries,
    in_open_block,
    recovery,
    recovery_by_kind,
    recovery_summary,
)
from streamer.runs.reward import DEFAULT_WINDOW, as_1d, auc, online_reward, rate, sort_by, windowed_reward
from streamer.runs.stability import collapsed, learner_counts, masked_fraction, policy_blowup, policy_events
from streamer.runs.stream import (
    changed,
    drift_kind,
    drift_segments,
    drift_times,
    first_update_after,
    in_stream_order,
    policy_steps,
    policy_updates,
    sort_events,
    stream_position,
)

__all__ = [
    "DEFAULT_DELTA", "DEFAULT_FLOOR", "DEFAULT_WINDOW", "FORGETTING_COLUMNS", "IN_PROGRESS", "RECOVERY_COLUMNS",
    "STATUSES",
    "Recovery", "auc", "changed", "collapsed", "drift_kind", "drift_recoveries", "drift_segments", "drift_times",
    "first_update_after", "forgetting", "forgetting_mean", "in_open_block", "in_stream_order", "learner_busy_share",
    "learner_counts", "masked_fraction", "online_reward", "policy_blowup", "policy_events", "policy_steps",
    "policy_updates", "rate", "recovery", "recovery_by_kind", "recovery_summary", "sort_by", "sort_events",
    "staleness_from_histograms", "staleness_stats", "stream_position", "trained_fraction", "windowed_reward",
]


def staleness_stats(staleness) -> dict[str, float]:
    """Mean, percentiles and max of per-trajectory staleness (learner version minus behaviour version)."""
    s = as_1d(staleness, "staleness")
    s = s[~np.isnan(s)]
    if s.size == 0:
        return {"n": 0, "mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan, "max": math.nan}
    p50, p90, p99 = np.percentile(s, [50, 90, 99])
    return {"n": int(s.size), "mean": float(s.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(s.max())}


def staleness_from_histograms(histograms: Iterable[Mapping[str, int] | None]) -> np.ndarray:
    """Expand LearnerEvent.staleness histograms ({"2": 5} = five trajectories of staleness 2) to values."""
    values: list[np.ndarray] = []
    for h in histograms:
        if not h:
            continue
        for key, count in h.items():
            try:
                value = int(key)
            except ValueError:
                raise ValueError(f"staleness histogram: key {key!r} is not an integer") from None
            values.append(np.full(int(count), value, dtype=np.float64))
    return np.concatenate(values) if values else np.zeros(0)


def trained_fraction(learner: pd.DataFrame, generated: int) -> float:
    """Trajectories the learner trained on (n_trajectories of its applied steps) ÷ trajectories
    generated (NaN when none were generated). The rest were dropped (stale) or are not trained yet."""
    if not generated:
        return math.nan
    if not len(learner) or "n_trajectories" not in learner:
        return 0.0
    applied = ~learner["skipped"].fillna(False).astype(bool) if "skipped" in learner else True
    return float(pd.to_numeric(learner["n_trajectories"], errors="coerce")[applied].sum()) / generated


def learner_busy_share(learner: pd.DataFrame) -> float:
    """1 − idle time ÷ wall time of the learner: idle = Σ perf/idle_s (waiting for a batch), wall =
    from the start of the first step's wait (its time − perf/step_s − perf/idle_s) to the last
    event. NaN without perf/idle_s."""
    if not len(learner) or "perf/idle_s" not in learner:
        return math.nan
    lr = sort_by(learner, "time")
    idle = pd.to_numeric(lr["perf/idle_s"], errors="coerce").fillna(0.0).to_numpy(float)
    step = pd.to_numeric(lr["perf/step_s"], errors="coerce").fillna(0.0).to_numpy(float) \
        if "perf/step_s" in lr else np.zeros(len(lr))
    t = lr["time"].to_numpy(float)
    wall = t[-1] - (t[0] - step[0] - idle[0])
    return float(min(1.0, max(0.0, 1.0 - idle.sum() / wall))) if wall > 0 else math.nan
