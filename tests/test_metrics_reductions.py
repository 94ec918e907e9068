"""The declared metric reductions: the table, the counter prefix, and an unknown name as an error."""

from __future__ import annotations

import math

import pytest

from streamer.metrics.windows import METRICS
from streamer.wire.reductions import REDUCTIONS, UnknownMetric, reduce_values, reduction


def test_each_reduction_by_hand():
    # learner/value_loss mean of [1, 2, NaN, 3] = 2 (NaN left out); n_tokens sum; ratio_max max; counters last
    assert reduce_values("learner/value_loss", [1.0, 2.0, math.nan, 3.0]) == 2.0
    assert reduce_values("learner/n_tokens", [10, 20, None]) == 30.0
    assert reduce_values("learner/ratio_max", [1.5, 3.0, 2.0]) == 3.0
    assert reduce_values("learner/count_stale", [1.0, 4.0, math.nan]) == 4.0
    assert reduce_values("learner/dead_letters", [0.0, 2.0]) == 2.0
    assert math.isnan(reduce_values("perf/idle_s", [math.nan]))


def test_counters_match_the_declared_prefix_and_unknown_names_raise():
    assert reduction("learner/count_uniform_group") == "last"
    for name in ("learner/count_", "learner/new_thing", "clip_frac", "learner/clip_frac_maximal"):
        with pytest.raises(UnknownMetric, match="no declared reduction"):
            reduction(name)


def test_every_metric_the_metrics_app_emits_is_declared():
    assert {f"metrics/{m}" for m in METRICS} <= set(REDUCTIONS)
    assert REDUCTIONS["metrics/staleness_max"] == "max" and REDUCTIONS["metrics/reward"] == "mean"
