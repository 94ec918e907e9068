"""Recovery of drift events: how many trajectories a family needs to get back to its pre-drift reward.

One record per (drift event, family) (`drift_recoveries`), on the stream's blocks
(`streamer.runs.stream`). Status: "unaffected" (the family's concept did not change), "no drop"
(the first W post-drift trajectories are within δ (relative) of the pre-drift level, the last W
of the previous block), "recovered" (a later window of W is back within δ, made only of
trajectories of a policy updated after the drift; the learner's policy steps are reported),
"censored" (not back before the block ends, or fewer than W post-drift trajectories), "no data".
A pre-drift level below a floor is flagged (`low_pre_level`): a drift from nothing cannot show
recovery. Censored values are counted, never averaged (`recovery_summary`). While a run is being written its last
block has not ended: `in_open_block` reads its censored records as "in progress".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

from streamer.runs.reward import DEFAULT_WINDOW, as_1d, check_window, mean_or_nan, windowed_reward
from streamer.runs.stream import (
    drift_kind,
    family_rows,
    first_update_after,
    policy_steps,
    policy_updates,
    sort_events,
    stream_blocks,
)

DEFAULT_DELTA = 0.1
DEFAULT_FLOOR = 0.5
STATUSES = ("unaffected", "no drop", "recovered", "censored", "no data")
_EPS = 1e-12  # a window mean that equals the threshold in exact arithmetic must count
RECOVERY_COLUMNS = ["phase", "prev_phase", "name", "schedule", "at_seq", "family", "prev_concept", "concept",
                    "status", "pre_level", "initial_level", "threshold", "low_pre_level", "trajectories",
                    "stream_trajectories", "learner_steps", "version_pre", "version_recovered", "n_pre", "n_post"]
_COUNT_COLUMNS = ("prev_phase", "at_seq", "trajectories", "stream_trajectories", "learner_steps", "version_pre",
                  "version_recovered", "n_pre", "n_post")
_STREAM_COLUMNS = ("phase", "family", "reward", "policy_version")


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
    check_window(window)
    if delta < 0:
        raise ValueError(f"delta: expected >= 0, got {delta}")
    pre, post = as_1d(pre_rewards, "pre_rewards"), as_1d(post_rewards, "post_rewards")
    if pre.size == 0 or post.size == 0:
        return Recovery("no data", mean_or_nan(pre[-window:]), mean_or_nan(post[:window]), math.nan, None, None)
    level = float(pre[-window:].mean())
    threshold, initial = level - delta * abs(level), float(post[:window].mean())
    if post.size < window:
        return Recovery("censored", level, initial, threshold, int(post.size), None)
    if initial >= threshold - _EPS:
        return Recovery("no drop", level, initial, threshold, None, None)
    versions = np.full(post.size, np.inf) if post_versions is None else as_1d(post_versions, "post_versions")
    back = windowed_reward(post, window)[window - 1:] >= threshold - _EPS
    hit = np.flatnonzero(back & (_window_min(versions, window) >= min_version))
    if hit.size:
        i = int(hit[0]) + window - 1
        return Recovery("recovered", level, initial, threshold, i + 1, i)
    return Recovery("censored", level, initial, threshold, int(post.size), None)


def _window_min(a: np.ndarray, window: int) -> np.ndarray:
    """min(a[i : i+W]) for each full window."""
    return np.lib.stride_tricks.sliding_window_view(a, window).min(axis=1)


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
    blocks = stream_blocks(trajectories, events, _STREAM_COLUMNS)
    updates = policy_updates(learner)
    rows = [_record(e, fam, blocks[k - 1], blocks[k], updates, window, delta, floor)
            for k, e in enumerate(events, 1) for fam in (e.get("families") or sorted(e.get("concepts", {})))]
    out = pd.DataFrame(rows, columns=RECOVERY_COLUMNS)
    return out.astype({c: "Int64" for c in _COUNT_COLUMNS})  # counts stay integers where some are missing


def _record(e: Mapping, fam: str, pre_block: pd.DataFrame, block: pd.DataFrame, updates: np.ndarray | None,
            window: int, delta: float, floor: float) -> dict:
    prev_c, new_c = e.get("prev_concepts", {}).get(fam), e.get("concepts", {}).get(fam)
    pre, post = family_rows(pre_block, fam, prev_c), family_rows(block, fam, new_c)
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


IN_PROGRESS = "in progress"  # a run still being written: its last block has not ended, so nothing is censored yet


def in_open_block(recoveries: pd.DataFrame) -> pd.DataFrame:
    """`drift_recoveries` of a run still being written: the last drift event's block has not ended, so its
    censored records (not back yet) are "in progress"; earlier blocks' records stand as they are."""
    if not len(recoveries):
        return recoveries
    last = recoveries["phase"] == recoveries["phase"].iloc[-1]
    return recoveries.assign(status=recoveries["status"].mask(last & (recoveries["status"] == "censored"),
                                                              IN_PROGRESS))


def recovery_summary(recoveries: pd.DataFrame) -> dict[str, Any]:
    """Counts per status and, over recovered records only, median recovery (family trajectories,
    stream trajectories, learner steps). Censored records are counted, never averaged as speeds
    (their value is a lower bound); the medians are conditional on recovering."""
    rec = recoveries if len(recoveries) else pd.DataFrame(columns=RECOVERY_COLUMNS)
    won = rec[rec["status"] == "recovered"]
    affected = rec[rec["status"] != "unaffected"]
    statuses = [*STATUSES, *([IN_PROGRESS] if (rec["status"] == IN_PROGRESS).any() else [])]
    out: dict[str, Any] = {"n": int(len(rec)), "by_status": {s: int((rec["status"] == s).sum()) for s in statuses},
                           "low_pre_level": int(affected["low_pre_level"].astype(bool).sum())}
    for col in ("trajectories", "stream_trajectories", "learner_steps"):
        v = pd.to_numeric(won[col], errors="coerce").dropna()
        out[f"median_{col}"] = float(v.median()) if len(v) else math.nan
    return out


def recovery_by_kind(trajectories: pd.DataFrame, learner: pd.DataFrame | None, drift_events: list[Mapping],
                     window: int = DEFAULT_WINDOW, delta: float = DEFAULT_DELTA) -> dict[str, dict[str, Any]]:
    """Per drift type (`stream.drift_kind`): `recovery_summary` of the run's `drift_recoveries`
    (counts per status, medians over recovered records only)."""
    if not drift_events:
        return {}
    rec = drift_recoveries(trajectories, drift_events, learner, window, delta)
    kinds = {(e["phase"], e.get("at_seq")): drift_kind(e) for e in drift_events}
    kind = [kinds.get((p, s), "?") for p, s in zip(rec["phase"], rec["at_seq"])]
    return {k: recovery_summary(g) for k, g in rec.assign(kind=kind).groupby("kind")}
