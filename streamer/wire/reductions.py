"""How each metric reduces: one table, metric name -> reduction, instead of guessing from a name's suffix.

A reduction says how several values of one metric combine into one: the parts of a learner step
(micro-batches, ranks: "mean" is then token-weighted), or the events of a run (summary.json, the
benchmarks, the dashboard). The reductions:

- "mean": an average quantity (losses, fractions, seconds per step);
- "sum": an amount (tokens, updates applied);
- "max": a worst case (`ratio_max`, `staleness_max`);
- "last": a running total or a state (`learner/count_*` counters, dead letters, versions).

Names are the published ones (`LearnerEvent.metrics`, `MetricPoint.name`); a trainer key `k` is
`learner/k`. Counters whose name carries a reason (`learner/count_<reason>`) match the declared
prefix in `PREFIXES`. Any other name is an error (`UnknownMetric`), not a guess: a new metric is
added to the table with its reduction. A leaf module (no project imports), so the trainer may use it too.
"""

from __future__ import annotations

import math
from typing import Iterable, Literal

import numpy as np

Reduction = Literal["mean", "sum", "max", "last"]

_LEARNER_MEAN = ("policy_loss", "loss", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ess_frac",
                 "kl_k1", "kl_k3", "kl_ref", "entropy", "behav_drop_frac", "behav_weight_mean", "value_loss",
                 "value_clip_frac", "explained_variance", "value_mean", "return_mean", "grad_norm",
                 "value_grad_norm", "value_warmup")

REDUCTIONS: dict[str, Reduction] = {
    **{f"learner/{k}": "mean" for k in _LEARNER_MEAN},
    "learner/ratio_max": "max",
    "learner/n_tokens": "sum",
    "learner/updates_applied": "sum",
    "learner/policy_steps": "last",  # running count of steps that changed the policy
    "learner/dead_letters": "last",  # running count of trajectories sent to the DLQ
    "perf/step_s": "mean",
    "perf/tokens_per_s": "mean",
    "perf/idle_s": "mean",  # seconds waited for the batch before each step (summary.json: mean per step)
    "metrics/reward": "mean",
    "metrics/success_rate": "mean",
    "metrics/length": "mean",
    "metrics/staleness": "mean",
    "metrics/staleness_max": "max",
    "metrics/throughput": "mean",
    "metrics/late": "last",  # running count of trajectories whose window had closed
    "metrics/dlq": "last",  # running count of dead letters
    "metrics/learner_version": "last",
    "eval/reward": "last",  # the newest evaluation of a concept
}

PREFIXES: dict[str, Reduction] = {
    "learner/count_": "last",  # admission and trainer counters, one per reason: running totals
}


class UnknownMetric(KeyError):
    """A metric name with no declared reduction."""

    def __str__(self) -> str:
        return (f"metric {self.args[0]!r} has no declared reduction: add it to "
                f"streamer.wire.reductions.REDUCTIONS (mean, sum, max or last)")


def reduction(name: str) -> Reduction:
    """The declared reduction of a metric (`UnknownMetric` when it has none)."""
    if name in REDUCTIONS:
        return REDUCTIONS[name]
    for prefix, red in PREFIXES.items():
        if name.startswith(prefix) and len(name) > len(prefix):
            return red
    raise UnknownMetric(name)


def reduce_values(name: str, values: Iterable[float]) -> float:
    """The values of one metric (in time order) reduced by its declared reduction; NaNs are left out,
    NaN when none is left."""
    red = reduction(name)
    v = np.asarray([np.nan if x is None else x for x in values], dtype=np.float64)
    v = v[~np.isnan(v)]
    if not v.size:
        return math.nan
    if red == "mean":
        return float(v.mean())
    if red == "sum":
        return float(v.sum())
    if red == "max":
        return float(v.max())
    return float(v[-1])
