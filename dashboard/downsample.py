"""Downsampling of long series for plotting: min/max buckets keep every spike a line chart would show.

A 1,000,000-point series becomes ~`max_points` points in a few milliseconds (numpy, no Python loop).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

MAX_POINTS = 2000


def minmax_indices(y: np.ndarray, max_points: int = MAX_POINTS) -> np.ndarray:
    """Sorted indices of the points to keep: first, last, and the min and max of each of
    ~max_points/2 equal-count buckets (NaNs never chosen over a number in their bucket)."""
    n = len(y)
    if max_points < 4:
        raise ValueError(f"max_points: expected >= 4, got {max_points}")
    if n <= max_points:
        return np.arange(n)
    n_buckets = (max_points - 2) // 2
    size = -(-n // n_buckets)  # ceil
    pad = n_buckets * size - n
    yf = np.asarray(y, dtype=np.float64)
    lo = np.concatenate([np.where(np.isnan(yf), np.inf, yf), np.full(pad, np.inf)]).reshape(n_buckets, size)
    hi = np.concatenate([np.where(np.isnan(yf), -np.inf, yf), np.full(pad, -np.inf)]).reshape(n_buckets, size)
    base = np.arange(n_buckets) * size
    keep = np.concatenate([[0, n - 1], base + lo.argmin(axis=1), base + hi.argmax(axis=1)])
    keep = keep[keep < n]
    return np.unique(keep)


def downsample(df: pd.DataFrame, y: str, by: str | list[str] | None = None,
               max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Min/max-bucket downsampling of `df[y]`, per group of `by` (each group gets
    max_points / number of groups points, at least 100); rows keep their order within a group."""
    if len(df) <= max_points:
        return df
    if by is None:
        return df.iloc[minmax_indices(df[y].to_numpy(), max_points)]
    groups = df.groupby(by, sort=False).indices
    per = max(100, max_points // max(1, len(groups)))
    keep = [idx[minmax_indices(df[y].to_numpy()[idx], per)] for idx in groups.values()]
    return df.iloc[np.sort(np.concatenate(keep))] if keep else df
