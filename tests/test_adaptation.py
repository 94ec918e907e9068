"""Adaptation metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from streamer.runs import adaptation as ad


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
    # initial [0,0] = 0 (a drop); full windows: [0,.6]=.3, [.6,1]=.8 (< .81), [1,.7]=.85 -> index 4, 5 trajectories.
    rec = ad.recovery([0.0, 0.8, 1.0], [0, 0, 0.6, 1.0, 0.7, 0.0], window=2, delta=0.1)
    assert rec.pre_level == pytest.approx(0.9) and rec.threshold == pytest.approx(0.81)
    assert (rec.status, rec.initial_level, rec.trajectories, rec.index) == ("recovered", 0.0, 5, 4)


def test_recovery_needs_a_window_of_updated_policy():
    # same rewards; the window [1,.7] (index 4) holds versions [1,1] < 2 (no update after the drift yet),
    # the last one [.7,0] = .35 is too low: censored at the 6 post-drift trajectories
    rec = ad.recovery([0.0, 0.8, 1.0], [0, 0, 0.6, 1.0, 0.7, 0.0], [1, 1, 1, 1, 1, 2], min_version=2, window=2)
    assert (rec.status, rec.trajectories, rec.index) == ("censored", 6, None)


def test_recovery_no_drop_short_block_and_no_data():
    # level 1, threshold 0.9; initial [1, .8] = .9 is within δ: no drop (no recovery time)
    rec = ad.recovery([1, 1], [1, 0.8, 0.0], window=2)
    assert (rec.status, rec.initial_level, rec.trajectories) == ("no drop", pytest.approx(0.9), None)
    # one post-drift trajectory for W=2: not judged, censored at 1 (initial level of what there is)
    rec = ad.recovery([1, 1], [1], window=2)
    assert (rec.status, rec.trajectories, rec.initial_level) == ("censored", 1, 1.0)
    rec = ad.recovery([], [1, 1], window=2)
    assert rec.status == "no data" and math.isnan(rec.pre_level) and rec.trajectories is None
    assert ad.recovery([1, 1], [], window=2).status == "no data"


# hand-made streams: (seq, phase, family, concept, reward, policy_version); finished_at = seq unless given
COLS = ["seq", "phase", "family", "concept", "reward", "policy_version"]


def stream(rows: list[tuple]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=COLS)
    return df.assign(finished_at=df["seq"].astype(float), created_at=df["seq"].astype(float))


def event(phase: int, at_seq: int, concepts: dict, prev: dict, prev_phase: int | None = None, **kw) -> dict:
    return {"phase": phase, "prev_phase": phase - 1 if prev_phase is None else prev_phase, "name": f"p{phase}",
            "schedule": "abrupt", "families": sorted(concepts), "concepts": concepts, "prev_concepts": prev,
            "at_seq": at_seq, "time": float(at_seq) - 0.5, **kw}


def learner(versions: list[int], warmup: list[int] | None = None) -> pd.DataFrame:
    return pd.DataFrame({"step": range(len(versions)), "version": versions,
                         "time": np.arange(len(versions), dtype=float), "skipped": False,
                         "learner/value_warmup": warmup or [0] * len(versions)})


def test_recovered_and_unaffected():
    traj = stream([(0, 0, "a", "a0", 1, 2), (1, 0, "b", "b0", 1, 2), (2, 0, "a", "a0", 1, 3), (3, 0, "b", "b0", 1, 3),
                   (4, 1, "a", "a1", 0, 3), (5, 1, "b", "b0", 1, 3), (6, 1, "a", "a1", 0, 4), (7, 1, "b", "b0", 1, 4),
                   (8, 1, "a", "a1", 1, 4), (9, 1, "a", "a1", 1, 5), (10, 1, "b", "b0", 1, 5)])
    ev = event(1, 4, {"a": "a1", "b": "b0"}, {"a": "a0", "b": "b0"})
    # policy updates publish versions 4 and 5; version 6 is critic-only warm-up
    out = ad.drift_recoveries(traj, [ev], learner([4, 5, 6], warmup=[0, 0, 1]), window=2).set_index("family")
    a, b = out.loc["a"], out.loc["b"]
    # a: pre [1,1] (versions 2,3: version_pre 3) -> level 1, threshold .9; post [0,0,1,1] by versions [3,4,4,5]:
    # initial 0; the window [1,1] ends at index 3 with versions {4,5}, all after the first update (4) -> 4 trajectories;
    # stream rows of the block up to seq 9: seq 4..9 -> 6; policy updates in (3, 5]: 4, 5 -> 2 steps
    assert (a["status"], a["pre_level"], a["initial_level"], a["threshold"]) == ("recovered", 1.0, 0.0, 0.9)
    assert (a["trajectories"], a["stream_trajectories"], a["learner_steps"]) == (4, 6, 2)
    assert (a["version_pre"], a["version_recovered"], a["low_pre_level"]) == (3, 5, False)
    assert (a["prev_concept"], a["concept"], a["n_pre"], a["n_post"]) == ("a0", "a1", 2, 4)
    # b: its concept did not change: unaffected, no recovery figures
    assert b["status"] == "unaffected" and pd.isna(b["trajectories"]) and pd.isna(b["learner_steps"])


def test_no_drop_censored_low_pre_level_and_no_update():
    pre = [("c", 1.0), ("c", 0.8), ("d", 1), ("d", 1), ("e", 0.4), ("e", 0.2), ("f", 1), ("f", 1)]
    post = [("c", 1, 4), ("c", 0.7, 4), ("c", 0.2, 4), ("d", 0, 4), ("d", 1, 4), ("d", 0, 5), ("d", 1, 5),
            ("e", 0, 4), ("e", 0, 4), ("e", 1, 5), ("e", 0, 5), ("f", 0, 3), ("f", 0, 3), ("f", 1, 3), ("f", 1, 3)]
    rows = [(i, 0, f, f + "0", r, 3) for i, (f, r) in enumerate(pre)]
    rows += [(8 + i, 1, f, f + "1", r, v) for i, (f, r, v) in enumerate(post)]
    fams = "cdef"
    ev = event(1, 8, {f: f + "1" for f in fams}, {f: f + "0" for f in fams})
    out = ad.drift_recoveries(stream(rows), [ev], learner([4, 5]), window=2).set_index("family")
    c, d, e, f = (out.loc[x] for x in fams)
    # c: level .9, threshold .81; initial [1,.7] = .85 >= .81: no drop
    assert (c["status"], c["pre_level"], c["initial_level"]) == ("no drop", pytest.approx(0.9), pytest.approx(0.85))
    assert pd.isna(c["trajectories"]) and pd.isna(c["learner_steps"])
    # d: windows [0,1], [1,0], [0,1] = .5 < .9: censored at its 4 trajectories, the block's 15 rows,
    # after the updates 4 and 5 (versions in (3, 5]) -> 2 steps
    assert (d["status"], d["trajectories"], d["stream_trajectories"], d["learner_steps"]) == ("censored", 4, 15, 2)
    # e: level .3 < floor .5 (flagged), threshold .27; initial 0; window [0,1] = .5 at index 2 by versions {4,5}:
    # recovered in 3; stream rows up to it: c 3 + d 4 + e 3 = 10
    assert (e["status"], e["pre_level"], e["low_pre_level"]) == ("recovered", pytest.approx(0.3), True)
    assert (e["trajectories"], e["stream_trajectories"], e["learner_steps"]) == (3, 10, 2)
    # f: the reward comes back ([1,1]) but only from version 3, the pre-drift policy: censored, 0 updates
    assert (f["status"], f["trajectories"], f["learner_steps"]) == ("censored", 4, 0)
    summary = ad.recovery_summary(out.reset_index())
    assert summary["by_status"] == {"unaffected": 0, "no drop": 1, "recovered": 1, "censored": 2, "no data": 0}
    assert (summary["n"], summary["low_pre_level"], summary["median_trajectories"]) == (4, 1, 3.0)
    assert (summary["median_stream_trajectories"], summary["median_learner_steps"]) == (10.0, 2.0)


@pytest.mark.parametrize("position", ["seq", "created_at"])
def test_rows_out_of_stream_order_are_attributed_by_phase(position):
    # finish times interleave the phases: the pre-drift task seq 0 (reward 0) finishes last, post-drift ones
    # first and out of order. By stream position: pre [0,1,1] -> level of the last 2 = 1; post [0,0,1,1] ->
    # recovered in 4. (By finish time the pre level would be .5 and post [0,1,1,0].)
    rows = [(0, 0, "a", "a0", 0, 0, 20.0), (1, 0, "a", "a0", 1, 0, 1.0), (2, 0, "a", "a0", 1, 0, 2.0),
            (3, 1, "a", "a1", 0, 1, 9.0), (4, 1, "a", "a1", 0, 1, 3.0), (5, 1, "a", "a1", 1, 1, 8.0),
            (6, 1, "a", "a1", 1, 1, 4.0)]
    traj = pd.DataFrame(rows, columns=COLS + ["finished_at"]).sample(frac=1.0, random_state=1)  # rows in any order
    traj["created_at"] = 100.0 + traj["seq"]
    if position == "created_at":
        traj = traj.drop(columns="seq")
    (rec,) = ad.drift_recoveries(traj, [event(1, 3, {"a": "a1"}, {"a": "a0"}, time=0.0)], window=2).to_dict("records")
    assert (rec["status"], rec["pre_level"], rec["initial_level"], rec["trajectories"]) == ("recovered", 1.0, 0.0, 4)
    assert pd.isna(rec["learner_steps"])  # no learner events: updates are read from the versions, not counted


def test_blocks_inside_a_phase_by_stream_position():
    # recurring: phase 1 starts at seq 4 (a0 -> a1), its second block at seq 8 (a1 -> a0, phase == prev_phase)
    rows = [(s, 0, "a", "a0", 1, 0) for s in range(4)]
    rows += [(s, 1, "a", "a1", r, 1) for s, r in zip(range(4, 8), [0, 0, 1, 1])]
    rows += [(s, 1, "a", "a0", 1, 2) for s in range(8, 12)]
    traj = stream(rows)
    events = [event(1, 8, {"a": "a0"}, {"a": "a1"}, prev_phase=1, time=7.0), event(1, 4, {"a": "a1"}, {"a": "a0"})]
    ordered = ad.sort_events(events)
    assert [e["at_seq"] for e in ordered] == [4, 8]
    expected = [0] * 4 + [1] * 4 + [2] * 4
    assert ad.drift_segments(traj, ordered).tolist() == expected
    # without seq, a block starts after the event's time (created_at of the block's last task before it)
    assert ad.drift_segments(traj.drop(columns="seq"), ordered).tolist() == expected
    out = ad.drift_recoveries(traj, events, window=2)
    # [a1 block] recovered in 4 (versions 1 > 0); [a0 again] pre = a1 block's last 2 [1,1], initial [1,1]: no drop
    assert out[["at_seq", "status", "trajectories"]].values.tolist() == [[4, "recovered", 4], [8, "no drop", pd.NA]]


def test_no_data_and_no_trajectories():
    traj = stream([(0, 0, "a", "a0", 1, 0), (1, 0, "a", "a0", 1, 0)])
    ev = event(1, 2, {"a": "a1", "b": "b0"}, {"a": "a0", "b": "b0"})
    out = ad.drift_recoveries(traj, [ev], window=2).set_index("family")
    assert (out.loc["a", "status"], out.loc["a", "n_pre"], out.loc["a", "n_post"]) == ("no data", 2, 0)
    assert out.loc["b", "status"] == "unaffected"
    empty = ad.drift_recoveries(pd.DataFrame(), [ev], window=2)
    assert empty["status"].tolist() == ["no data", "unaffected"]
    assert ad.drift_recoveries(traj, [], window=2).empty
    assert ad.recovery_summary(empty.iloc[:0])["by_status"]["recovered"] == 0


def test_drift_times_are_first_finishes_of_the_block():
    traj = stream([(0, 0, "a", "a0", 1, 0), (1, 1, "a", "a1", 1, 0), (2, 1, "a", "a1", 1, 0)])
    traj["finished_at"] = [5.0, 9.0, 7.0]
    events = [event(1, 1, {"a": "a1"}, {"a": "a0"}, time=0.5), event(2, 3, {"a": "a2"}, {"a": "a1"}, time=0.7)]
    # phase 1's first trajectory finished at 7; phase 2 has none: its own time
    assert ad.drift_times(traj, events) == [7.0, 0.7]


def test_policy_updates_trained_fraction_and_busy_share():
    lrn = pd.DataFrame({"version": [1, 2, 3, 4], "time": [10.0, 12.0, 14.0, 16.0], "n_trajectories": [8, 8, 8, 8],
                        "skipped": [False, False, True, False], "learner/value_warmup": [1.0, 0.0, 0.0, 0.0],
                        "perf/idle_s": [1.0, 0.5, 0.5, 0.0], "perf/step_s": [1.0, 1.0, 1.0, 1.0]})
    # version 1 is critic-only warm-up, version 3 a skipped (non-finite) step: updates 2 and 4
    assert ad.policy_updates(lrn).tolist() == [2.0, 4.0]
    assert ad.policy_steps(ad.policy_updates(lrn), 1, 4) == 2 and ad.first_update_after(ad.policy_updates(lrn), 2) == 4
    # 24 trajectories in applied steps of 40 generated
    assert ad.trained_fraction(lrn, 40) == pytest.approx(0.6)
    assert math.isnan(ad.trained_fraction(lrn, 0))
    # wall from 10 - 1 - 1 = 8 to 16: 8 s, idle 2 s -> busy 0.75
    assert ad.learner_busy_share(lrn) == pytest.approx(0.75)
    assert math.isnan(ad.learner_busy_share(lrn.drop(columns="perf/idle_s")))


def test_online_reward_groups_and_positions():
    traj = pd.DataFrame({"family": ["a", "b", "a", "a"], "reward": [1.0, 0.0, 0.0, 1.0],
                         "finished_at": [4.0, 1.0, 2.0, 3.0]})
    out = ad.online_reward(traj, window=2)
    # finish order: b(0) a(0) a(1) a(1): n = 1..4; a windowed (W=2) = [0, .5, 1]
    assert out["n"].tolist() == [1, 2, 3, 4]
    assert out["family"].tolist() == ["b", "a", "a", "a"]
    np.testing.assert_allclose(out["reward_w"], [0.0, 0.0, 0.5, 1.0])


def _event(phase, at_seq, concepts, prev):
    return {"phase": phase, "prev_phase": phase - 1, "name": f"p{phase}", "schedule": "recurring", "at_seq": at_seq,
            "families": sorted(concepts), "concepts": concepts, "prev_concepts": prev}


def test_forgetting_on_stream_blocks_hand_computed():
    # E1 changes b only (a's c0 stretch goes on), E2 moves a to c1, E3 brings a back to c0 and b back to b0
    events = [_event(3, 6, {"a": "c0", "b": "b0"}, {"a": "c1", "b": "b1"}),  # given out of order
              _event(1, 2, {"a": "c0", "b": "b1"}, {"a": "c0", "b": "b0"}),
              _event(2, 4, {"a": "c1", "b": "b1"}, {"a": "c0", "b": "b1"})]
    rows = [(0, 0, "a", "c0", 1.0), (1, 0, "b", "b0", 1.0), (2, 1, "a", "c0", 0.0), (3, 1, "b", "b1", 0.5),
            (4, 2, "a", "c1", 0.3), (5, 2, "a", "c0", 0.9),  # seq 5: a gradual drift's old-concept task, left out
            (6, 3, "a", "c0", 0.25), (7, 3, "b", "b0", 0.0), (8, 3, "a", "c0", 0.25)]
    traj = pd.DataFrame(rows, columns=["seq", "phase", "family", "concept", "reward"])
    traj["finished_at"] = 100.0 - traj["seq"]  # finished in reverse: the stream order counts, not the finish order
    out = ad.forgetting(traj.sample(frac=1.0, random_state=0), events, window=2)
    assert out.columns.tolist() == ad.FORGETTING_COLUMNS
    a, b = out.to_dict(orient="records")
    # a/c0: the last W=2 of its stretch (blocks 0 and 1) [1, 0] -> .5; first 2 when back [.25, .25] -> .25
    assert (a["family"], a["concept"], a["left_phase"], a["left_at_seq"], a["recurs_phase"], a["recurs_at_seq"]) == (
        "a", "c0", 2, 4, 3, 6)
    assert (a["before"], a["after"], a["forgetting"], a["n_before"], a["n_after"]) == (0.5, 0.25, -0.25, 2, 2)
    # b/b0: [1] before it left at E1, [0] when back: -1, one trajectory on each side
    assert (b["concept"], b["left_phase"], b["before"], b["after"], b["forgetting"], b["n_before"], b["n_after"]) == (
        "b0", 1, 1.0, 0.0, -1.0, 1, 1)
    assert ad.forgetting_mean(out) == pytest.approx(-0.625)


def test_forgetting_without_a_recurrence_or_its_rows():
    events = [_event(1, 2, {"a": "c1"}, {"a": "c0"}), _event(2, 4, {"a": "c0"}, {"a": "c1"})]
    traj = pd.DataFrame({"seq": [0, 1, 2], "phase": [0, 0, 1], "family": "a", "concept": ["c0", "c0", "c1"],
                         "reward": [1.0, 0.5, 0.0]})
    (row,) = ad.forgetting(traj, events, window=4).to_dict(orient="records")
    # the run ended at the recurrence: no trajectory of c0 since, so no value (the mean skips it)
    assert (row["before"], row["n_before"], row["n_after"]) == (0.75, 2, 0) and math.isnan(row["forgetting"])
    assert math.isnan(ad.forgetting_mean(pd.DataFrame([row])))
    assert ad.forgetting(traj, events[:1], window=4).empty  # c0 never comes back
    assert ad.forgetting(traj, [], window=4).empty
    with pytest.raises(ValueError, match="missing column"):
        ad.forgetting(traj.drop(columns="concept"), events)


def test_collapse_counters_and_clipped_share():
    # 20 policy steps (and 2 of critic warm-up, left out): entropy 1.0 for the first tenth, 0.05 for the last
    n = 22
    lr = pd.DataFrame({"step": range(1, n + 1), "skipped": False, "learner/value_warmup": [1.0] * 2 + [0.0] * 20,
                       "learner/entropy": [9.0] * 2 + [1.0] * 2 + [0.5] * 16 + [0.05] * 2,
                       "learner/kl_k3": [0.0] * 21 + [0.3], "learner/clip_frac": [1.0] * 2 + [0.1] * 20,
                       "learner/count_ok": [float(i) for i in range(n)],
                       "learner/count_stale": [1.0] * 21 + [math.nan]})
    traj = pd.DataFrame({"reward": [1.0, 1.0, 0.0, 0.5]})
    col = ad.collapsed(traj, lr, window=2)
    assert (col["entropy_first"], col["entropy_last"], col["kl_k3_max"]) == (1.0, 0.05, 0.3)
    assert col["blowup"] and col["collapsed"] and col["skipped_steps"] == 0
    assert (col["first_window_reward"], col["last_window_reward"]) == (1.0, 0.25)
    assert ad.masked_fraction(lr) == {"clip_frac": pytest.approx(0.1)}  # mean over policy steps only
    # running totals: the last event's value (by step); a counter the last event lacks is left out
    assert ad.learner_counts(lr.iloc[::-1]) == {"ok": 21}
    few = ad.collapsed(traj, lr.iloc[:8].assign(skipped=[False] * 7 + [True]), window=2)
    assert (few["blowup"], few["collapsed"], few["skipped_steps"]) == (False, True, 1)  # < 10 policy steps: not judged


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


def test_a_run_being_written_reads_its_last_blocks_censored_records_as_in_progress():
    rec = pd.DataFrame({"phase": [1, 1, 2, 2, 2], "family": ["a", "b", "a", "b", "c"],
                        "status": ["censored", "recovered", "censored", "recovered", "unaffected"],
                        "low_pre_level": [False] * 5, "trajectories": [40, 12, 30, 20, None],
                        "stream_trajectories": [80, 30, 60, 50, None], "learner_steps": [4, 2, 3, 5, None]})
    live = ad.in_open_block(rec)
    # phase 1's block has ended: its censored record stands; phase 2's is still open
    assert live["status"].tolist() == ["censored", "recovered", "in progress", "recovered", "unaffected"]
    summary = ad.recovery_summary(live)
    assert summary["by_status"] == {"unaffected": 1, "no drop": 0, "recovered": 2, "censored": 1, "no data": 0,
                                    "in progress": 1}
    assert summary["median_trajectories"] == 16.0  # recovered records only: (12 + 20) / 2
    assert "in progress" not in ad.recovery_summary(rec)["by_status"]  # a finished run's summary: as before
    assert ad.in_open_block(rec.iloc[:0]).empty
