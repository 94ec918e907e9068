"""Adaptation metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from streamer import adaptation as ad


def test_windowed_reward_partial_then_trailing():
    # W=3 over [1,0,0,1,1]: [1/1, 1/2, 1/3, (0+0+1)/3, (0+1+1)/3]
    out = ad.windowed_reward([1, 0, 0, 1, 1], 3)
    np.testing.assert_allclose(out, [1.0, 0.5, 1 / 3, 1 / 3, 2 / 3])


def test_windowed_reward_rejects_bad_window_and_shape():
    with pytest.raises(ValueError, match="window"):
        ad.windowed_reward([1.0], 0)
    with pytest.raises(ValueError, match="rewards"):
        ad.windowed_reward([[1.0]], 2)
    assert ad.windowed_reward([], 4).size == 0


def test_auc_is_mean_of_windowed():
    # windowed (W=2) of [0,1,1,0] = [0, .5, 1, .5] -> mean 0.5
    assert ad.auc([0, 1, 1, 0], 2) == pytest.approx(0.5)
    assert math.isnan(ad.auc([], 2))


def test_recovery_reached():
    # pre level = mean of last W=2 pre rewards [.8, 1] = 0.9; threshold = 0.9 - 0.1*0.9 = 0.81.
    # post full windows (W=2): [0,0]=0, [0,.6]=.3, [.6,1]=.8 (< .81), [1,.7]=.85 -> index 4, 5 trajectories.
    rec = ad.recovery([0.0, 0.8, 1.0], [0, 0, 0.6, 1.0, 0.7, 0.0], window=2, delta=0.1)
    assert rec.pre_level == pytest.approx(0.9)
    assert rec.threshold == pytest.approx(0.81)
    assert (rec.trajectories, rec.index, rec.censored) == (5, 4, False)


def test_recovery_needs_a_full_post_window():
    # Post starts with a success but W=3 needs 3 post trajectories: first full window [1,1,1] ends at index 2.
    rec = ad.recovery([1, 1, 1], [1, 1, 1, 0], window=3)
    assert (rec.trajectories, rec.censored) == (3, False)


def test_recovery_censored_at_phase_end():
    # level 1, threshold 0.9; the post windows (W=2) reach at most 0.5: censored at the phase length 4.
    rec = ad.recovery([1, 1], [0, 1, 0, 0], window=2)
    assert (rec.trajectories, rec.censored, rec.index) == (4, True, None)
    # phase shorter than the window: censored too
    assert ad.recovery([1, 1], [1], window=2).censored


def test_recovery_no_pre_data():
    rec = ad.recovery([], [1, 1], window=2)
    assert math.isnan(rec.pre_level) and rec.censored and rec.trajectories is None


def test_steps_between_counts_events_in_half_open_interval():
    # events at 1,2,3,4: (1.5, 3] holds 2 and 3
    assert ad.steps_between([1, 2, 3, 4], 1.5, 3.0) == 2
    assert ad.steps_between([], 0, 10) == 0


def test_drift_recoveries_per_family():
    # family a: phase 0 rewards [1,1], phase 1 rewards [0,1,1] (W=2: full windows .5, 1 -> recovered at 3)
    # family b: phase 0 [1,1], phase 1 [0,0] -> censored at 2.
    # A late phase-0 trajectory of a (finished at 3.5) must not count as post-drift.
    rows = [("a", 0, 1.0, 1), ("a", 0, 1.0, 2), ("a", 1, 0.0, 3), ("a", 0, 1.0, 3.5), ("a", 1, 1.0, 4),
            ("a", 1, 1.0, 5), ("b", 0, 1.0, 1.1), ("b", 0, 1.0, 2.1), ("b", 1, 0.0, 3.1), ("b", 1, 0.0, 4.1)]
    traj = pd.DataFrame(rows, columns=["family", "phase", "reward", "finished_at"])
    events = [{"phase": 1, "prev_phase": 0, "name": "p1", "families": ["a", "b"],
               "concepts": {"a": "x2", "b": "y2"}, "prev_concepts": {"a": "x1", "b": "y1"}, "time": 2.5}]
    # learner steps at 3, 4, 4.5, 6: from 2.5 to a's recovery at t=5 -> 3 steps; to b's last at 4.1 -> 2
    out = ad.drift_recoveries(traj, events, learner_times=[3, 4, 4.5, 6], window=2).set_index("family")
    assert out.loc["a", "trajectories"] == 3 and not out.loc["a", "censored"]
    assert out.loc["a", "learner_steps"] == 3 and out.loc["a", "recovered_at"] == 5
    assert out.loc["a", "pre_level"] == pytest.approx(1.0)
    assert out.loc["b", "trajectories"] == 2 and out.loc["b", "censored"]
    assert out.loc["b", "learner_steps"] == 2
    assert out.loc["b", "concept"] == "y2" and out.loc["b", "prev_concept"] == "y1"


def test_online_reward_groups_and_positions():
    traj = pd.DataFrame({"family": ["a", "b", "a", "a"], "reward": [1.0, 0.0, 0.0, 1.0],
                         "finished_at": [4.0, 1.0, 2.0, 3.0]})
    out = ad.online_reward(traj, window=2)
    # finish order: b(0) a(0) a(1) a(1): n = 1..4; a windowed (W=2) = [0, .5, 1]
    assert out["n"].tolist() == [1, 2, 3, 4]
    assert out["family"].tolist() == ["b", "a", "a", "a"]
    np.testing.assert_allclose(out["reward_w"], [0.0, 0.0, 0.5, 1.0])


def test_concept_intervals_and_forgetting():
    # arith: add on [0,10), mul on [10,20), add again on [20,30)
    events = [{"time": 10.0, "concepts": {"arith": "mul"}, "prev_concepts": {"arith": "add"}},
              {"time": 20.0, "concepts": {"arith": "add"}, "prev_concepts": {"arith": "mul"}}]
    iv = ad.concept_intervals(events, "arith", 0.0, 30.0)
    assert iv.values.tolist() == [["add", 0.0, 10.0], ["mul", 10.0, 20.0], ["add", 20.0, 30.0]]
    # eval of add: 0.9 at t=9 (last before it left at 10), 0.6 at t=19 (last before it recurs at 20),
    # 0.95 at t=25 (after recurrence, ignored). Forgetting = 0.6 - 0.9 = -0.3.
    ev = pd.DataFrame({"time": [5, 9, 19, 25, 15], "concept": ["add", "add", "add", "add", "mul"],
                       "value": [0.5, 0.9, 0.6, 0.95, 0.7]})
    out = ad.forgetting(ev, iv)
    assert len(out) == 1
    row = out.iloc[0]
    assert (row["concept"], row["before"], row["after"]) == ("add", 0.9, 0.6)
    assert row["forgetting"] == pytest.approx(-0.3)


def test_forgetting_nan_without_eval_while_away_and_missing_columns():
    iv = pd.DataFrame({"concept": ["add", "mul", "add"], "start": [0, 10, 20], "end": [10, 20, 30]})
    ev = pd.DataFrame({"time": [9.0], "concept": ["add"], "value": [0.9]})
    # the only eval of add predates its departure: no value "when it recurs"
    assert math.isnan(ad.forgetting(ev, iv)["forgetting"].iloc[0])
    with pytest.raises(ValueError, match="eval_points: missing column"):
        ad.forgetting(ev.drop(columns="value"), iv)


def test_staleness_stats_and_histograms():
    # histograms {0:2, 1:1} and {3:1} -> values [0,0,1,3]: mean 1, median 0.5, max 3
    vals = ad.staleness_from_histograms([{"0": 2, "1": 1}, None, {"3": 1}])
    assert sorted(vals.tolist()) == [0, 0, 1, 3]
    st = ad.staleness_stats(vals)
    assert (st["n"], st["mean"], st["p50"], st["max"]) == (4, 1.0, 0.5, 3.0)
    assert ad.staleness_stats([])["n"] == 0
    with pytest.raises(ValueError, match="not an integer"):
        ad.staleness_from_histograms([{"x": 1}])


def test_rate():
    # 5 events over 2 s -> 2.5/s; weights sum 40 over 2 s -> 20/s
    assert ad.rate([0, 0.5, 1, 1.5, 2]) == pytest.approx(2.5)
    assert ad.rate([0, 1, 2], weights=[10, 10, 20]) == pytest.approx(20.0)
    assert math.isnan(ad.rate([1.0]))
