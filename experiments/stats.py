"""The suite's statistics as short pure functions (issue 15, item 4): samples to a threshold with censoring, the
Kaplan-Meier median of such times, a paired percentile bootstrap, a t interval, and the seeds a power rule asks
for."""

from __future__ import annotations

import math

import numpy as np


def window_means(values, window: int) -> np.ndarray:
    """The mean of every `window` consecutive values (len(values) - window + 1 of them; none when fewer)."""
    x = np.asarray(values, float)
    return np.convolve(x, np.ones(window) / window, mode="valid") if x.size >= window else np.zeros(0)


def samples_to(values, threshold: float, window: int) -> tuple[int, bool]:
    """(samples until the `window`-mean of `values` first reaches `threshold`, reached). Not reached: (len, False),
    censored at the number observed. Fewer values than a window: never reached."""
    x = np.asarray(values, float)
    if x.size < window:
        return int(x.size), False
    means = window_means(x, window)
    hit = np.flatnonzero(means >= threshold - 1e-12)
    return (int(hit[0]) + window, True) if hit.size else (int(x.size), False)


def km_curve(times, events) -> list[tuple[float, float]]:
    """Kaplan-Meier survival S(t) just after each distinct event time: [(t, S(t))]. `events[i]` False: censored at
    `times[i]` (at risk up to and including it)."""
    t, e = np.asarray(times, float), np.asarray(events, bool)
    out, s = [], 1.0
    for u in np.unique(t[e]):
        at_risk = int((t >= u).sum())
        s *= 1.0 - int(((t == u) & e).sum()) / at_risk
        out.append((float(u), s))
    return out


def km_median(times, events) -> float | None:
    """The smallest event time at which S(t) <= 0.5; None when the curve never gets there (the median is censored:
    report it as "> the longest observation")."""
    return next((u for u, s in km_curve(times, events) if s <= 0.5 + 1e-12), None)


def paired_bootstrap(diffs, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> dict[str, float]:
    """Mean of the paired differences and its percentile bootstrap interval (resampling the pairs)."""
    d = np.asarray(diffs, float)
    if d.size == 0:
        return {"mean": math.nan, "low": math.nan, "high": math.nan, "n": 0}
    means = np.random.default_rng(seed).choice(d, size=(n_boot, d.size), replace=True).mean(axis=1)
    a = (1.0 - level) / 2
    return {"mean": float(d.mean()), "low": float(np.quantile(means, a)), "high": float(np.quantile(means, 1 - a)),
            "n": int(d.size)}


# two-sided 95% Student t quantiles t_{0.975, df}, df 1-10 (printed tables); beyond, the Cornish-Fisher expansion
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
Z975 = 1.959964


def t975(df: int) -> float:
    if df < 1:
        raise ValueError(f"t quantile: df must be >= 1, got {df}")
    if df <= len(T975):
        return T975[df - 1]
    z = Z975
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def t_interval(diffs) -> dict[str, float]:
    """Mean of paired differences with its 95% t interval (few pairs: wider than the bootstrap's, which understates
    with 3-6 of them)."""
    d = np.asarray(diffs, float)
    if d.size < 2:
        return {"mean": float(d.mean()) if d.size else math.nan, "low": math.nan, "high": math.nan,
                "sd": math.nan, "n": int(d.size)}
    sd = float(d.std(ddof=1))
    half = t975(d.size - 1) * sd / math.sqrt(d.size)
    return {"mean": float(d.mean()), "low": float(d.mean() - half), "high": float(d.mean() + half), "sd": sd,
            "n": int(d.size)}


def sample_sd(x) -> float | None:
    """The sample SD (ddof 1); None for fewer than two values, where it is undefined (NaN is not JSON)."""
    return float(np.std(x, ddof=1)) if len(x) > 1 else None


def seeds_for(sd_diff: float, delta: float, k_sigma: float = 3.0, minimum: int = 5) -> int:
    """Seeds n so that a mean paired difference of `delta` is `k_sigma` standard errors: n = ceil((k sd / delta)^2)."""
    if not delta > 0:
        raise ValueError(f"delta must be > 0, got {delta}")
    return max(minimum, math.ceil((k_sigma * sd_diff / delta) ** 2 - 1e-9))  # 9.000000000000002 is 9


def verdict(d: dict) -> str:
    """An interval's verdict: '+' or '-' when it excludes 0 on that side, else '0' (not separated; always so from
    one seed, whose bootstrap interval is the point itself)."""
    if d.get("n", 2) < 2:
        return "0"
    return "+" if d["low"] > 0 else "-" if d["high"] < 0 else "0"
