"""Online reward over a run's stream: the windowed reward, its AUC, event rates.

Each trajectory's reward at generation time, averaged over a trailing window of W trajectories
(`windowed_reward`); AUC is the mean of that over the stream. Pure functions over numpy arrays and
pandas DataFrames; also the small checks the other analysis modules share (`require`, `as_1d`).
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import pandas as pd

DEFAULT_WINDOW = 64


def as_1d(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {a.shape}")
    return a


def check_window(window: int) -> None:
    if int(window) != window or window < 1:
        raise ValueError(f"window: expected a positive integer number of trajectories, got {window!r}")


def require(df: pd.DataFrame, cols: Iterable[str], name: str) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"{name}: missing column(s) {', '.join(missing)} (has: {', '.join(map(str, df.columns))})")


def mean_or_nan(a: np.ndarray) -> float:
    return float(a.mean()) if a.size else math.nan


def windowed_reward(rewards, window: int = DEFAULT_WINDOW) -> np.ndarray:
    """Trailing mean: out[i] = mean(rewards[max(0, i-W+1) : i+1]) (a partial window at the start)."""
    check_window(window)
    r = as_1d(rewards, "rewards")
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


def rate(times, weights=None) -> float:
    """Events (or summed weights) per second over the span of `times` (NaN with < 2 events or no span)."""
    t = as_1d(times, "times")
    t = t[~np.isnan(t)]
    if t.size < 2 or t.max() <= t.min():
        return math.nan
    total = float(t.size) if weights is None else float(np.nansum(as_1d(weights, "weights")))
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
    require(trajectories, ("reward", time_col) + ((by,) if by else ()), "trajectories")
    df = sort_by(trajectories, time_col).reset_index(drop=True)
    df["n"] = np.arange(1, len(df) + 1)
    rewards, out = df["reward"].to_numpy(float), np.full(len(df), np.nan)
    groups = df.groupby(by, sort=False, observed=True).indices.values() if by else [np.arange(len(df))]
    for idx in groups:
        out[idx] = windowed_reward(rewards[idx], window)
    df["reward_w"] = out
    return df
