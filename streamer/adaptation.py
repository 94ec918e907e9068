"""The adaptation metrics: one definition, used by the learner, the benchmarks and the dashboard.

Pure functions over numpy arrays and pandas DataFrames (a leaf module: no project imports).

- online reward: each trajectory's reward at generation time, averaged over a trailing window
  of W trajectories (`windowed_reward`).
- recovery time of a drift event (`recovery`): trajectories (and learner steps) from the event
  until the windowed reward, over a window made only of post-drift trajectories, is back within
  δ (relative) of its pre-drift level; capped at the phase end and reported as censored when
  not reached.
- AUC (`auc`): mean windowed reward over the stream.
- forgetting (`forgetting`): eval reward on a concept when it recurs, minus its last value
  before it left.
- staleness (`staleness_stats`): learner version at training time minus behaviour version.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

import numpy as np
import pandas as pd

DEFAULT_WINDOW = 64
DEFAULT_DELTA = 0.1


def _as_1d(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {a.shape}")
    return a


def _check_window(window: int) -> None:
    if int(window) != window or window < 1:
        raise ValueError(f"window: expected a positive integer number of trajectories, got {window!r}")


def windowed_reward(rewards, window: int = DEFAULT_WINDOW) -> np.ndarray:
    """Trailing mean: out[i] = mean(rewards[max(0, i-W+1) : i+1]) (a partial window at the start)."""
    _check_window(window)
    r = _as_1d(rewards, "rewards")
    if r.size == 0:
        return r.copy()
    c = np.concatenate(([0.0], np.cumsum(r)))
    idx = np.arange(1, r.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def auc(rewards, window: int = DEFAULT_WINDOW) -> float:
    """Mean windowed reward over the stream (NaN for an empty stream)."""
    w = windowed_reward(rewards, window)
    return float(w.mean()) if w.size else math.nan


@dataclasses.dataclass(frozen=True)
class Recovery:
    """Recovery of one drift event for one family."""

    pre_level: float  # mean reward of the last W pre-drift trajectories
    threshold: float  # pre_level - delta * |pre_level|
    trajectories: int | None  # post-drift trajectories until recovered; the phase length when censored
    censored: bool  # True when the phase ended (or no data) before the windowed reward recovered
    index: int | None  # index into the post-drift rewards of the trajectory that completed recovery
    learner_steps: int | None = None  # learner steps from the event to recovery (or to the phase end)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def recovery(pre_rewards, post_rewards, window: int = DEFAULT_WINDOW, delta: float = DEFAULT_DELTA) -> Recovery:
    """Recovery of the windowed reward after a drift.

    `pre_rewards`: the family's rewards of the phase before the event, in generation order;
    `post_rewards`: those of the phase the event starts, up to its end. The pre-drift level is
    the mean of the last W pre rewards. Recovery is the first post index i >= W-1 (the window
    holds only post-drift trajectories) with mean(post[i-W+1 : i+1]) >= level - δ|level|;
    `trajectories` = i + 1. Not reached by the phase end: censored, trajectories = len(post).
    No pre rewards: level NaN, censored, trajectories None.
    """
    _check_window(window)
    if delta < 0:
        raise ValueError(f"delta: expected >= 0, got {delta}")
    pre = _as_1d(pre_rewards, "pre_rewards")
    post = _as_1d(post_rewards, "post_rewards")
    if pre.size == 0:
        return Recovery(math.nan, math.nan, None, True, None)
    level = float(pre[-window:].mean())
    threshold = level - delta * abs(level)
    if post.size >= window:
        full = windowed_reward(post, window)[window - 1:]
        # tolerance: a window mean that equals the threshold in exact arithmetic must count
        hit = np.flatnonzero(full >= threshold - 1e-12)
        if hit.size:
            i = int(hit[0]) + window - 1
            return Recovery(level, threshold, i + 1, False, i)
    return Recovery(level, threshold, int(post.size), True, None)


def steps_between(step_times, t0: float, t1: float) -> int:
    """Learner steps completed in (t0, t1]: the number of learner events timed in that interval."""
    times = _as_1d(step_times, "step_times")
    return int(np.count_nonzero((times > t0) & (times <= t1)))


def forgetting(eval_points: pd.DataFrame, intervals: pd.DataFrame) -> pd.DataFrame:
    """Forgetting of each concept at each recurrence.

    `eval_points`: columns time, concept, value (eval reward of that concept at that time).
    `intervals`: columns concept, start, end: when each concept was the rewarded one (one row per
    active period, e.g. from `concept_intervals`). For every period of a concept after its first,
    forgetting = (last eval of that concept at or before the period's start, and after the
    previous period's end) minus (last eval at or before the previous period's end). NaN when
    either eval is missing. Negative means the concept was forgotten while away.
    Returns columns concept, left_at, recurs_at, before, after, forgetting.
    """
    _require(eval_points, ("time", "concept", "value"), "eval_points")
    _require(intervals, ("concept", "start", "end"), "intervals")
    rows = []
    for concept, group in intervals.sort_values("start").groupby("concept", sort=False):
        ev = eval_points[eval_points["concept"] == concept].sort_values("time")
        t, v = ev["time"].to_numpy(float), ev["value"].to_numpy(float)
        periods = group[["start", "end"]].to_numpy(float)
        for (_, prev_end), (start, _) in zip(periods[:-1], periods[1:]):
            before = _last_value(t, v, prev_end, lower=-math.inf)
            after = _last_value(t, v, start, lower=prev_end)
            rows.append({"concept": concept, "left_at": prev_end, "recurs_at": start,
                         "before": before, "after": after, "forgetting": after - before})
    return pd.DataFrame(rows, columns=["concept", "left_at", "recurs_at", "before", "after", "forgetting"])


def _last_value(t: np.ndarray, v: np.ndarray, upto: float, lower: float) -> float:
    k = np.searchsorted(t, upto, side="right")
    if k == 0 or not t[k - 1] > lower:
        return math.nan
    return float(v[k - 1])


def _require(df: pd.DataFrame, cols: Iterable[str], name: str) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"{name}: missing column(s) {', '.join(missing)} (has: {', '.join(map(str, df.columns))})")


def concept_intervals(drift_events: Iterable[Mapping], family: str, start: float, end: float) -> pd.DataFrame:
    """Active periods of each concept of `family` from drift events (dicts with time, concepts,
    prev_concepts), between the stream's `start` and `end` times."""
    events = sorted((e for e in drift_events if family in e.get("concepts", {})), key=lambda e: e["time"])
    rows: list[dict] = []
    current = None
    t = start
    for e in events:
        if current is None:
            current = e.get("prev_concepts", {}).get(family)
        if current is not None and e["concepts"][family] != current:
            rows.append({"concept": current, "start": t, "end": e["time"]})
            t = e["time"]
        elif current is None:
            t = e["time"]
        current = e["concepts"][family]
    if current is not None:
        rows.append({"concept": current, "start": t, "end": end})
    return pd.DataFrame(rows, columns=["concept", "start", "end"])


def staleness_stats(staleness) -> dict[str, float]:
    """Mean, percentiles and max of per-trajectory staleness (learner version minus behaviour version)."""
    s = _as_1d(staleness, "staleness")
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


def rate(times, weights=None) -> float:
    """Events (or summed weights) per second over the span of `times` (NaN with < 2 events or no span)."""
    t = _as_1d(times, "times")
    t = t[~np.isnan(t)]
    if t.size < 2 or t.max() <= t.min():
        return math.nan
    total = float(t.size) if weights is None else float(np.nansum(_as_1d(weights, "weights")))
    return total / float(t.max() - t.min())


def sort_by(df: pd.DataFrame, col: str) -> pd.DataFrame:
    """Stable sort by `col`, skipped when already sorted (the usual case: rows are written in finish order)."""
    return df if df[col].is_monotonic_increasing else df.sort_values(col, kind="stable")


def online_reward(trajectories: pd.DataFrame, window: int = DEFAULT_WINDOW, by: str | None = "family",
                  time_col: str = "finished_at") -> pd.DataFrame:
    """Windowed online reward per group (`by`, or the whole stream when None), in generation order.

    Returns the input rows sorted by `time_col` with two added columns: `n` (position in the whole
    stream, from 1: the "trajectories" x-axis) and `reward_w` (windowed within the group).
    """
    _require(trajectories, ("reward", time_col) + ((by,) if by else ()), "trajectories")
    df = sort_by(trajectories, time_col).reset_index(drop=True)
    df["n"] = np.arange(1, len(df) + 1)
    rewards, out = df["reward"].to_numpy(float), np.full(len(df), np.nan)
    groups = df.groupby(by, sort=False, observed=True).indices.values() if by else [np.arange(len(df))]
    for idx in groups:
        out[idx] = windowed_reward(rewards[idx], window)
    df["reward_w"] = out
    return df


def drift_recoveries(trajectories: pd.DataFrame, drift_events: Iterable[Mapping],
                     learner_times=(), window: int = DEFAULT_WINDOW, delta: float = DEFAULT_DELTA) -> pd.DataFrame:
    """Recovery of every (drift event, affected family) pair.

    `trajectories`: columns family, phase, reward, finished_at. `drift_events`: dicts with phase,
    prev_phase, name, families, concepts, prev_concepts, time. A family's pre-drift trajectories
    are those of `prev_phase`, its post-drift ones those of `phase` (so trajectories of the old
    phase that finish late never count as post-drift), each in finish order. Learner steps count
    learner events (`learner_times`) from the event time to the finish of the trajectory that
    completed recovery (to the last of the phase when censored): `until`, that time.
    """
    _require(trajectories, ("family", "phase", "reward", "finished_at"), "trajectories")
    steps_t = _as_1d(learner_times, "learner_times")
    df = sort_by(trajectories, "finished_at")
    # integer codes once: comparing a million strings per event costs far more
    fam_codes, fam_names = pd.factorize(df["family"])
    fam_index = {str(f): i for i, f in enumerate(fam_names)}
    phases = df["phase"].to_numpy()
    rows = []
    for e in drift_events:
        for fam in e.get("families") or sorted(e.get("concepts", {})):
            in_fam = fam_codes == fam_index.get(fam, -2)
            pre = df[in_fam & (phases == e["prev_phase"])]
            post = df[in_fam & (phases == e["phase"])]
            rec = recovery(pre["reward"].to_numpy(float), post["reward"].to_numpy(float), window, delta)
            t0 = float(e.get("time") or (post["created_at"].min() if "created_at" in post and len(post) else math.nan))
            end_i = rec.index if rec.index is not None else len(post) - 1
            t1 = float(post["finished_at"].iloc[end_i]) if len(post) else math.nan
            steps = steps_between(steps_t, t0, t1) if len(post) and steps_t.size else None
            rows.append({"phase": e["phase"], "prev_phase": e["prev_phase"], "name": e.get("name", ""),
                         "family": fam, "concept": e.get("concepts", {}).get(fam, ""),
                         "prev_concept": e.get("prev_concepts", {}).get(fam, ""), "time": t0,
                         "pre_level": rec.pre_level, "threshold": rec.threshold,
                         "trajectories": rec.trajectories, "learner_steps": steps, "censored": rec.censored,
                         "recovered_at": t1 if not rec.censored else math.nan, "until": t1})
    cols = ["phase", "prev_phase", "name", "family", "concept", "prev_concept", "time", "pre_level", "threshold",
            "trajectories", "learner_steps", "censored", "recovered_at", "until"]
    return pd.DataFrame(rows, columns=cols)
