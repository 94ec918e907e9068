"""The adaptation metrics: one definition, used by summary.json, the benchmarks and the dashboard.

Pure functions over numpy arrays and pandas DataFrames (a leaf module: no project imports).

- online reward: each trajectory's reward at generation time, averaged over a trailing window
  of W trajectories (`windowed_reward`).
- recovery of a drift event, per family (`drift_recoveries`, one record per (event, family)).
  Measured on the stream position (the task's seq, or created_at), never on wall time: the
  whole stream may be published in seconds and answered out of order, so the drift's publish
  time says nothing about which trajectories came before it. A trajectory's phase is its
  `phase` column. Status: "unaffected" (the family's concept did not change), "no drop" (the
  first W post-drift trajectories are within δ (relative) of the pre-drift level, the last W
  of the previous block), "recovered" (a later window of W is back within δ, made only of
  trajectories of a policy updated after the drift; the learner's policy steps are reported),
  "censored" (not back before the block ends, or fewer than W post-drift trajectories), "no
  data". A pre-drift level below a floor is flagged (`low_pre_level`): a drift from nothing
  cannot show recovery. Censored values are counted, never averaged (`recovery_summary`).
- AUC (`auc`): mean windowed reward over the stream.
- forgetting (`forgetting`): eval reward on a concept when it recurs, minus its last value
  before it left.
- staleness (`staleness_stats`): learner version at training time minus behaviour version.
- pipeline shares: `trained_fraction` (trained ÷ generated trajectories), `learner_busy_share`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

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


# ---------------------------------------------------------------- recovery of drift events

STATUSES = ("unaffected", "no drop", "recovered", "censored", "no data")
DEFAULT_FLOOR = 0.5
_EPS = 1e-12  # a window mean that equals the threshold in exact arithmetic must count
RECOVERY_COLUMNS = ["phase", "prev_phase", "name", "schedule", "at_seq", "family", "prev_concept", "concept",
                    "status", "pre_level", "initial_level", "threshold", "low_pre_level", "trajectories",
                    "stream_trajectories", "learner_steps", "version_pre", "version_recovered", "n_pre", "n_post"]


@dataclasses.dataclass(frozen=True)
class Recovery:
    """Recovery of one family from one drift event (`recovery`)."""

    status: str  # "no drop", "recovered", "censored" or "no data" (the caller decides "unaffected")
    pre_level: float  # mean reward of the last W pre-drift trajectories
    initial_level: float  # mean reward of the first W post-drift trajectories (fewer when the block is shorter)
    threshold: float  # pre_level - delta * |pre_level|
    trajectories: int | None  # post-drift trajectories to recovery; those observed when censored
    index: int | None  # index into the post-drift rows of the trajectory that completed recovery

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def recovery(pre_rewards, post_rewards, post_versions=None, min_version: float = -math.inf,
             window: int = DEFAULT_WINDOW, delta: float = DEFAULT_DELTA) -> Recovery:
    """Recovery of one family's windowed reward after a drift, on stream positions.

    `pre_rewards`: the family's rewards before the event, `post_rewards` (and their behaviour
    `post_versions`) after it up to the end of its block, both in stream order. Level = mean of
    the last W pre rewards, threshold = level - δ|level|, initial = mean of the first W post
    rewards. Fewer than W post rewards: censored (not judged). Initial >= threshold: "no drop".
    Else recovered at the first window of W post rewards (ending at index i >= W) whose mean
    is >= threshold and whose every trajectory has a version >= `min_version` (the first policy
    after the drift): trajectories = i + 1. Not reached: censored, trajectories = len(post).
    """
    _check_window(window)
    if delta < 0:
        raise ValueError(f"delta: expected >= 0, got {delta}")
    pre, post = _as_1d(pre_rewards, "pre_rewards"), _as_1d(post_rewards, "post_rewards")
    if pre.size == 0 or post.size == 0:
        return Recovery("no data", _mean(pre[-window:]), _mean(post[:window]), math.nan, None, None)
    level = float(pre[-window:].mean())
    threshold, initial = level - delta * abs(level), float(post[:window].mean())
    if post.size < window:
        return Recovery("censored", level, initial, threshold, int(post.size), None)
    if initial >= threshold - _EPS:
        return Recovery("no drop", level, initial, threshold, None, None)
    versions = np.full(post.size, np.inf) if post_versions is None else _as_1d(post_versions, "post_versions")
    back = windowed_reward(post, window)[window - 1:] >= threshold - _EPS
    hit = np.flatnonzero(back & (_window_min(versions, window) >= min_version))
    if hit.size:
        i = int(hit[0]) + window - 1
        return Recovery("recovered", level, initial, threshold, i + 1, i)
    return Recovery("censored", level, initial, threshold, int(post.size), None)


def _mean(a: np.ndarray) -> float:
    return float(a.mean()) if a.size else math.nan


def _window_min(a: np.ndarray, window: int) -> np.ndarray:
    """min(a[i : i+W]) for each full window."""
    return np.lib.stride_tricks.sliding_window_view(a, window).min(axis=1)


def stream_position(trajectories: pd.DataFrame) -> tuple[np.ndarray, str]:
    """Each trajectory's place in the task stream and its unit: the task's `seq` when every row has
    one (artifacts.read_part derives it from the simulator's task ids), else the task's
    `created_at` (also in stream order). Never the finish time: tasks are answered out of order."""
    if "seq" in trajectories and len(trajectories):
        seq = pd.to_numeric(trajectories["seq"], errors="coerce").to_numpy(float)
        if not np.isnan(seq).any():
            return seq, "seq"
    _require(trajectories, ("created_at",), "trajectories (no seq)")
    return trajectories["created_at"].to_numpy(float), "created_at"


def in_stream_order(trajectories: pd.DataFrame) -> pd.DataFrame:
    """The rows sorted by stream position (then finish time), index reset, with a `pos` column."""
    pos, _ = stream_position(trajectories)
    fin = trajectories["finished_at"].to_numpy(float) if "finished_at" in trajectories else np.zeros(len(pos))
    order = np.lexsort((fin, pos))
    return trajectories.iloc[order].reset_index(drop=True).assign(pos=pos[order])


def sort_events(drift_events: Iterable[Mapping]) -> list[Mapping]:
    """Drift events in stream order: by phase, then task sequence number (then time)."""
    return sorted(drift_events, key=lambda e: (e["phase"], e.get("at_seq", 0), e.get("time", 0.0)))


def drift_segments(trajectories: pd.DataFrame, events: list[Mapping]) -> np.ndarray:
    """For each row, how many of `events` (in stream order, `sort_events`) precede it: 0 before the
    first event, k in the block the k-th event starts. A phase comes from the row's `phase` column;
    a block inside a phase (recurring, incremental: phase == prev_phase) from its stream position
    (seq >= at_seq, or created_at > the event's time when the rows carry no seq)."""
    _require(trajectories, ("phase",), "trajectories")
    phase = trajectories["phase"].to_numpy()
    seg = np.zeros(len(trajectories), dtype=np.int64)
    pos, unit = stream_position(trajectories) if any(e["phase"] == e.get("prev_phase") for e in events) else (None, "")
    for e in events:
        same = phase == e["phase"]
        if e["phase"] == e.get("prev_phase"):
            same &= pos >= e.get("at_seq", 0) if unit == "seq" else pos > e.get("time", 0.0)
        seg += (phase > e["phase"]) | same
    return seg


def drift_times(trajectories: pd.DataFrame, drift_events: Iterable[Mapping]) -> list[float]:
    """When each event (in the given order) reached the agents: the first finish of a trajectory of
    its block, or the event's own time when its block has none (the publish time of the event
    says nothing when the whole stream is published at once)."""
    events = list(drift_events)
    if not len(trajectories) or not events:
        return [float(e.get("time", math.nan)) for e in events]
    ordered = sort_events(events)
    seg, fin = drift_segments(trajectories, ordered), trajectories["finished_at"].to_numpy(float)
    first = {id(e): fin[seg == k].min() if (seg == k).any() else math.nan for k, e in enumerate(ordered, 1)}
    return [float(first[id(e)]) if math.isfinite(first[id(e)]) else float(e.get("time", math.nan)) for e in events]


def policy_updates(learner: pd.DataFrame | None) -> np.ndarray | None:
    """Sorted versions published by learner steps that changed the policy (applied, not critic-only
    warm-up); None without learner events (versions are then taken as updates)."""
    if learner is None or not len(learner) or "version" not in learner:
        return None
    ok = np.ones(len(learner), dtype=bool)
    if "skipped" in learner:
        ok &= ~learner["skipped"].fillna(False).astype(bool).to_numpy()
    if "learner/value_warmup" in learner:
        ok &= pd.to_numeric(learner["learner/value_warmup"], errors="coerce").to_numpy(float) != 1.0
    return np.sort(learner["version"].to_numpy(float)[ok])


def policy_steps(updates: np.ndarray | None, v0: float, v1: float) -> int | None:
    """Policy updates published after version v0, up to and including v1."""
    if updates is None or not math.isfinite(v0) or not math.isfinite(v1):
        return None
    return int(np.count_nonzero((updates > v0) & (updates <= v1)))


def first_update_after(updates: np.ndarray | None, v0: float) -> float:
    """The first policy version that holds an update made after v0 (inf when none yet)."""
    if updates is None:
        return v0 + 1
    later = updates[updates > v0]
    return float(later[0]) if later.size else math.inf


def drift_recoveries(trajectories: pd.DataFrame, drift_events: Iterable[Mapping], learner: pd.DataFrame | None = None,
                     window: int = DEFAULT_WINDOW, delta: float = DEFAULT_DELTA,
                     floor: float = DEFAULT_FLOOR) -> pd.DataFrame:
    """Recovery of every (drift event, family): the one definition (summary.json, dashboard, benchmarks).

    `trajectories`: columns phase, family, concept, reward, policy_version, finished_at and seq or
    created_at (`stream_position`). `drift_events`: DriftEvent dicts. `learner`: learner events
    (version, skipped, learner/value_warmup), to count policy updates. Blocks come from
    `drift_segments`; in a block, a family's rows are those rewarded under the block's concept
    (a gradual drift's old-concept tasks are left out), in stream order. Status: "unaffected"
    when the family's concept did not change, else `recovery`'s, where recovering needs windows
    made only of trajectories generated by a policy updated after every pre-drift trajectory of
    the family (`version_pre`). `low_pre_level`: the pre-drift level is below `floor`.
    Columns: RECOVERY_COLUMNS.
    """
    events = sort_events(drift_events)
    df = _stream_rows(trajectories)
    seg = drift_segments(df, events) if len(df) else np.zeros(0, dtype=np.int64)
    blocks = [df[seg == k] for k in range(len(events) + 1)]
    updates = policy_updates(learner)
    rows = [_record(e, fam, blocks[k - 1], blocks[k], updates, window, delta, floor)
            for k, e in enumerate(events, 1) for fam in (e.get("families") or sorted(e.get("concepts", {})))]
    out = pd.DataFrame(rows, columns=RECOVERY_COLUMNS)
    return out.astype({c: "Int64" for c in _COUNT_COLUMNS})  # counts stay integers where some are missing


_COUNT_COLUMNS = ("prev_phase", "at_seq", "trajectories", "stream_trajectories", "learner_steps", "version_pre",
                  "version_recovered", "n_pre", "n_post")
_STREAM_COLUMNS = ("phase", "family", "reward", "policy_version")


def _stream_rows(trajectories: pd.DataFrame) -> pd.DataFrame:
    if not len(trajectories):
        return pd.DataFrame({c: [] for c in _STREAM_COLUMNS + ("pos",)})
    _require(trajectories, _STREAM_COLUMNS, "trajectories")
    return in_stream_order(trajectories)


def _family_rows(block: pd.DataFrame, family: str, concept: str | None) -> pd.DataFrame:
    keep = block["family"] == family
    if concept is not None and "concept" in block:
        keep &= block["concept"] == concept
    return block[keep]


def _record(e: Mapping, fam: str, pre_block: pd.DataFrame, block: pd.DataFrame, updates: np.ndarray | None,
            window: int, delta: float, floor: float) -> dict:
    prev_c, new_c = e.get("prev_concepts", {}).get(fam), e.get("concepts", {}).get(fam)
    pre, post = _family_rows(pre_block, fam, prev_c), _family_rows(block, fam, new_c)
    versions = post["policy_version"].to_numpy(float)
    v0 = float(pre["policy_version"].max()) if len(pre) else math.nan
    rec = recovery(pre["reward"].to_numpy(float), post["reward"].to_numpy(float), versions,
                   first_update_after(updates, v0), window, delta)
    status = "unaffected" if prev_c is not None and prev_c == new_c else rec.status
    out = {"phase": e["phase"], "prev_phase": e.get("prev_phase"), "name": e.get("name", ""),
           "schedule": e.get("schedule", ""), "at_seq": e.get("at_seq"), "family": fam,
           "prev_concept": prev_c or "", "concept": new_c or "", "status": status, "pre_level": rec.pre_level,
           "initial_level": rec.initial_level, "threshold": rec.threshold,
           "low_pre_level": bool(rec.pre_level < floor), "trajectories": None, "stream_trajectories": None,
           "learner_steps": None, "version_pre": v0, "version_recovered": math.nan,
           "n_pre": int(len(pre)), "n_post": int(len(post))}
    if status == "recovered":
        v1 = float(versions[rec.index - window + 1:rec.index + 1].max())
        stream = int((block["pos"] <= post["pos"].iloc[rec.index]).sum())
        out.update(version_recovered=v1)
    elif status == "censored":
        v1, stream = float(versions.max()), int(len(block))
    else:
        return out
    return {**out, "trajectories": rec.trajectories, "stream_trajectories": stream,
            "learner_steps": policy_steps(updates, v0, v1)}


def recovery_summary(recoveries: pd.DataFrame) -> dict[str, Any]:
    """Counts per status and, over recovered records only, median recovery (family trajectories,
    stream trajectories, learner steps). Censored records are counted, never averaged as speeds
    (their value is a lower bound); the medians are conditional on recovering."""
    rec = recoveries if len(recoveries) else pd.DataFrame(columns=RECOVERY_COLUMNS)
    won = rec[rec["status"] == "recovered"]
    affected = rec[rec["status"] != "unaffected"]
    out: dict[str, Any] = {"n": int(len(rec)), "by_status": {s: int((rec["status"] == s).sum()) for s in STATUSES},
                           "low_pre_level": int(affected["low_pre_level"].astype(bool).sum())}
    for col in ("trajectories", "stream_trajectories", "learner_steps"):
        v = pd.to_numeric(won[col], errors="coerce").dropna()
        out[f"median_{col}"] = float(v.median()) if len(v) else math.nan
    return out


# ---------------------------------------------------------------- pipeline shares

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
