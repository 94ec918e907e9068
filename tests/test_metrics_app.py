"""The metrics app: windowed aggregates by hand, the app state's DLQ and staleness rules, and the
real faust app against the embedded broker, compared with a pandas computation."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from streamer.metrics.app import MetricsSettings, MetricsState, dead_letter, parse_args
from streamer.metrics.windows import (
    Aggregate,
    ClosedWindow,
    Observation,
    TumblingWindows,
    fold,
    levels,
    values,
    window_points,
)
from streamer.wire.config import ConfigError
from streamer.wire.schema import DeadLetter, LearnerEvent, MetricPoint, Trajectory, decode, encode

ROOT = Path(__file__).resolve().parents[1]


def obs(t, reward=1.0, success=True, length=4, staleness=0, family="arith", concept="add"):
    return Observation(family, concept, t, reward, success, length, staleness)


def traj(i, *, family="arith", concept="add", t=1000.0, reward=1.0, success=True, length=3, policy_version=0):
    prompt_len = 2
    n = prompt_len + length
    return Trajectory(traj_id=f"tr{i}", task_id=f"t{i}", family=family, concept=concept, prompt_len=prompt_len,
                      tokens=list(range(n)), loss_mask=[0] * prompt_len + [1] * length, logprobs=[0.0] * n,
                      reward=reward, success=success, policy_version=policy_version, finished_at=t)


# ---------------------------------------------------------------- pure aggregation


def test_values_of_one_window_by_hand():
    agg = Aggregate()
    for o in (obs(0.1, 1.0, True, 4, 0), obs(0.2, 0.0, False, 6, 2), obs(0.3, 0.5, True, 8, 1)):
        agg = fold(agg, o)
    v = values(agg, window_s=2.0)
    # reward (1 + 0 + 0.5)/3 = 0.5; success 2/3; length (4+6+8)/3 = 6; staleness (0+2+1)/3 = 1, max 2;
    # throughput 3 trajectories / 2 s = 1.5
    assert v == pytest.approx({"reward": 0.5, "success_rate": 2 / 3, "length": 6.0, "staleness": 1.0,
                               "staleness_max": 2.0, "throughput": 1.5})
    assert agg.count == 3


def test_fold_leaves_its_argument_unchanged():
    a = Aggregate()
    b = fold(a, obs(0.0))
    assert a.count == 0 and b.count == 1


def test_windows_close_on_watermark_then_late_then_flush():
    w = TumblingWindows(window_s=1.0, lateness_s=0.5)
    assert w.add(obs(0.2)) and w.add(obs(0.7)) and w.add(obs(1.4))
    # watermark 1.4 < end of window 0 (1.0) + lateness 0.5 = 1.5: nothing closes yet
    assert w.close_due() == []
    assert w.add(obs(1.6))
    closed = w.close_due()  # watermark 1.6 >= 1.5: window 0 closes with its 2 observations
    assert [(c.index, sum(a.count for a in c.groups.values()), c.cumulative) for c in closed] == [(0, 2, 2)]
    assert not w.add(obs(0.9))  # window 0 is closed: late, counted, not aggregated
    assert w.late == 1
    rest = w.flush()  # window 1 holds 1.4 and 1.6; cumulative 2 + 2 = 4
    assert [(c.index, sum(a.count for a in c.groups.values()), c.cumulative) for c in rest] == [(1, 2, 4)]
    assert w.open == {}


def test_window_index_of_negative_and_boundary_times():
    w = TumblingWindows(window_s=2.0)
    w.add(obs(4.0))  # a boundary belongs to the window it starts: [4, 6) -> index 2
    w.add(obs(-0.5))  # floor(-0.25) = -1
    assert sorted(w.open) == [-1, 2]


def test_levels_family_and_total():
    a1 = fold(Aggregate(), obs(0, reward=1.0))
    a2 = fold(fold(Aggregate(), obs(0, reward=0.0, concept="sub")), obs(0, reward=0.0, concept="sub"))
    b = fold(Aggregate(), obs(0, reward=0.5, family="tool", concept="v1"))
    lv = {tuple(sorted(lab.items())): agg for lab, agg in levels({("arith", "add"): a1, ("arith", "sub"): a2,
                                                                  ("tool", "v1"): b})}
    assert lv[(("family", "arith"),)].count == 3
    assert lv[(("family", "arith"),)].reward_sum == 1.0  # 1 + 0 + 0
    assert lv[()].count == 4 and lv[()].reward_sum == 1.5  # 1 + 0 + 0 + 0.5
    assert len(lv) == 3 + 2 + 1


def test_window_points_names_time_and_counts():
    win = ClosedWindow(index=3, groups={("arith", "add"): fold(Aggregate(), obs(6.5))}, cumulative=9)
    pts = window_points(win, window_s=2.0, learner_step=4)
    assert len(pts) == 6 * 3  # six metrics at three label levels
    assert {p.time for p in pts} == {8.0}  # end of [6, 8)
    assert {p.name for p in pts} == {f"metrics/{m}" for m in
                                    ("reward", "success_rate", "length", "staleness", "staleness_max", "throughput")}
    assert all(p.count == 1 and p.trajectories == 9 and p.learner_step == 4 and p.window == 2.0 for p in pts)


def test_windows_refuse_bad_sizes():
    with pytest.raises(ValueError, match="window_s"):
        TumblingWindows(window_s=0)


# ---------------------------------------------------------------- app state (no broker)


def state(**kw) -> MetricsState:
    return MetricsState(MetricsSettings(run="t", **kw))


def test_staleness_uses_latest_learner_version_and_never_goes_back():
    s = state(window_s=10.0)
    s.on_learner(encode(LearnerEvent(step=5, version=4, time=1.0, n_trajectories=0, n_tokens=0)))
    s.on_learner(encode(LearnerEvent(step=3, version=2, time=0.5, n_trajectories=0, n_tokens=0)))  # redelivered
    assert (s.learner_version, s.learner_step) == (4, 5)
    s.on_trajectory(encode(traj(0, t=1.0, policy_version=1)), timestamp=0.0)
    s.on_trajectory(encode(traj(1, t=2.0, policy_version=4)), timestamp=0.0)
    s.on_trajectory(encode(traj(2, t=3.0, policy_version=6)), timestamp=0.0)  # newer than the learner: 0
    pts = {p.name: p for p in s.on_tick(force=True) if p.labels == {}}
    # staleness 4-1 = 3, 4-4 = 0, max(0, 4-6) = 0 -> mean 1, max 3
    assert pts["metrics/staleness"].value == 1.0 and pts["metrics/staleness_max"].value == 3.0
    assert pts["metrics/reward"].learner_step == 5


def test_bad_messages_are_rejected_with_reasons_and_counted():
    s = state(max_message_bytes=10_000)
    pts, reason = s.on_trajectory(b"\x00not msgpack", 0.0)
    assert "Trajectory" in reason and pts[0].name == "metrics/dlq" and pts[0].value == 1.0
    wrong_version = encode(traj(1)).replace(b"\xa1v\x01", b"\xa1v\x63", 1)  # msgpack "v": 1 -> "v": 99
    _, reason = s.on_trajectory(wrong_version, 0.0)
    assert "schema version 99" in reason
    _, reason = s.on_trajectory(b"x" * 10_001, 0.0)
    assert "oversized" in reason
    _, reason = s.on_learner(encode(traj(2)))  # a trajectory on the learner topic
    assert "LearnerEvent" in reason
    assert s.dlq == 4 and s.windows.open == {}


def test_non_finite_and_far_future_times_are_dead_lettered_and_move_no_clock():
    """finished_at=inf raised in the handler; one trajectory 1e9 s ahead made the next 49 of 50 late (issue 14)."""
    s = state(window_s=5.0, lateness_s=1.0)
    now = time.time()
    _, reason = s.on_trajectory(encode(traj(0, t=math.inf)), 0.0)
    assert reason == "Trajectory.finished_at: non-finite inf"
    _, reason = s.on_trajectory(encode(traj(1, t=now + 1e9)), 0.0)
    assert reason.startswith(f"Trajectory.finished_at: {now + 1e9} is 1000000000 s ahead of this clock") \
        and "max_clock_skew_s 300" in reason
    _, reason = s.on_learner(encode(LearnerEvent(step=1, version=1, time=math.nan, n_trajectories=0, n_tokens=0)))
    assert reason == "LearnerEvent.time: non-finite nan"
    for i in range(50):
        assert s.on_trajectory(encode(traj(10 + i, t=now - 10 + 0.1 * i)), 0.0)[1] is None
    assert s.windows.late == 0 and s.dlq == 3


def test_idle_tick_closes_only_windows_the_wall_clock_has_passed():
    s = state(window_s=5.0, lateness_s=1.0, idle_flush_s=0.01)
    s.on_trajectory(encode(traj(0, t=100.0)), 0.0)  # window [100, 105)
    s.on_trajectory(encode(traj(1, t=106.0)), 0.0)  # window [105, 110); watermark 106 = 105 + 1 closes [100, 105)
    assert s.windows.closed_below == 21 and list(s.windows.open) == [21]
    assert s.on_tick(now=106.5) == []  # not idle yet
    time.sleep(0.02)
    assert s.on_tick(now=110.5) == []  # idle, but [105, 110) + 1 s lateness has not passed: a live stream
    pts = s.on_tick(now=111.0)
    assert {p.time for p in pts if p.window} == {110.0} and s.windows.open == {}
    s.on_trajectory(encode(traj(2, t=107.0)), 0.0)  # its window is closed now: late
    assert s.windows.late == 1
    s.on_trajectory(encode(traj(3, t=112.0)), 0.0)
    assert [p.time for p in s.on_tick(force=True) if p.name == "metrics/reward" and p.labels == {}] == [115.0]


def test_timestamp_stands_in_for_missing_finished_at():
    s = state(window_s=1.0)
    s.on_trajectory(encode(traj(0, t=0.0)), timestamp=42.5)
    assert list(s.windows.open) == [42]


def test_dead_letter_keeps_the_original_bytes_and_reason():
    rec = decode(dead_letter("r.trajectories", 1, 7, b"k", b"\xff\x00", "bad", "Trajectory"), DeadLetter)
    assert (rec.topic, rec.partition, rec.offset, rec.key, rec.value, rec.value_len, rec.reason, rec.expected) == \
        ("r.trajectories", 1, 7, b"k", b"\xff\x00", 2, "bad", "Trajectory")


def test_parse_args_flags_win_and_bad_values_are_named(tmp_path):
    cfg = tmp_path / "m.yaml"
    cfg.write_text("window_s: 7\nrun: fromfile\nlateness_s: 2\n")
    s = parse_args(["--config", str(cfg), "--run", "demo", "--set", "idle_flush_s=4"])
    assert (s.run, s.window_s, s.lateness_s, s.idle_flush_s) == ("demo", 7.0, 2.0, 4.0)
    with pytest.raises(ConfigError, match="window_s"):
        parse_args(["--run", "x", "--set", "window_s=-1"])
    with pytest.raises(ConfigError, match="run"):
        parse_args(["--run", "a.b"])


# ---------------------------------------------------------------- the faust app on the real broker

W = 2.0  # window of the integration test, seconds of event time
LEARNER_VERSION = 3


def make_stream(n: int = 120, seed: int = 0) -> list[Trajectory]:
    """Trajectories over 6 windows of event time, 2 families x 2 concepts, random rewards and versions."""
    rng = np.random.default_rng(seed)
    base = 1_700_000_000.0  # in the past (idle windows close by the wall clock); a window boundary
    out = []
    for i in range(n):
        fam = ("arith", "tool")[i % 2]
        con = (f"{fam}-a", f"{fam}-b")[int(rng.integers(2))]
        out.append(traj(i, family=fam, concept=con, t=base + i * 0.1 + float(rng.uniform(0, 0.05)),
                        reward=round(float(rng.uniform()), 3), success=bool(rng.integers(2)),
                        length=int(rng.integers(1, 9)), policy_version=int(rng.integers(0, 5))))
    return out


def expected_frame(trajs: list[Trajectory]) -> pd.DataFrame:
    """The same aggregates computed by pandas, one row per (window end, labels)."""
    df = pd.DataFrame({"family": t.family, "concept": t.concept, "t": t.finished_at, "reward": t.reward,
                       "success": float(t.success), "length": len(t.tokens) - t.prompt_len,
                       "staleness": max(0, LEARNER_VERSION - t.policy_version)} for t in trajs)
    df["end"] = (np.floor(df["t"] / W) + 1) * W
    aggs = dict(reward=("reward", "mean"), success_rate=("success", "mean"), length=("length", "mean"),
                staleness=("staleness", "mean"), staleness_max=("staleness", "max"), count=("reward", "size"))
    frames = []
    for keys in (["end", "family", "concept"], ["end", "family"], ["end"]):
        g = df.groupby(keys).agg(**aggs).reset_index()
        g["labels"] = [tuple((k, row[k]) for k in keys[1:]) for _, row in g.iterrows()]
        frames.append(g)
    out = pd.concat(frames, ignore_index=True)
    out["throughput"] = out["count"] / W
    return out.set_index(["end", "labels"]).sort_index()


def read_points(consumer, until, timeout_s: float) -> list[MetricPoint]:
    got: list[MetricPoint] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until(got):
        got += [m.msg for m in consumer.poll(max_records=1000, timeout=0.5)]
    return got


@pytest.mark.kafka
def test_faust_app_aggregates_equal_pandas(kafka_bus, kafka_run, tmp_path):
    from streamer.wire.topics import Topics, partitions_by_topic

    names = Topics(kafka_run)
    kafka_bus.create_topics(partitions_by_topic(kafka_run))
    prod = kafka_bus.producer()
    prod.send(names.learner, LearnerEvent(step=11, version=LEARNER_VERSION, time=time.time(), n_trajectories=0,
                                          n_tokens=0))
    prod.flush()
    log = open(tmp_path / "metrics.log", "wb")
    # lateness covers the whole stream: the two partitions interleave arbitrarily, so every window
    # closes by the idle flush and none is late.
    proc = subprocess.Popen([sys.executable, "-m", "streamer.launch.cli", "metrics", "--bootstrap", kafka_bus.bootstrap,
                             "--run", kafka_run, "--window", str(W), "--set", "lateness_s=100",
                             "--set", "idle_flush_s=2", "--set", "max_message_bytes=100000", "--set", "loglevel=INFO"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        cons = kafka_bus.consumer({names.metrics: MetricPoint})
        # wait until the app has the learner version, so staleness is deterministic
        got = read_points(cons, lambda g: any(p.name == "metrics/learner_version" for p in g), 60)
        assert any(p.name == "metrics/learner_version" and p.value == LEARNER_VERSION for p in got), \
            (tmp_path / "metrics.log").read_text()[-3000:]
        trajs = make_stream()
        for t in trajs:
            prod.send(names.trajectories, t, key=t.task_id)
        bad = {"Trajectory: Expected `object`": b"\x00 not a trajectory",  # (reason fragment, value)
               "schema version 2": encode(trajs[0]).replace(b"\xa1v\x01", b"\xa1v\x02", 1),
               "oversized": b"\x00" * 100_001}
        for value in bad.values():
            prod.send_raw(names.trajectories, value)
        prod.send_raw(names.learner, b"\x00 not a learner event")
        prod.flush()
        want = expected_frame(trajs)
        # every metric of every (window, labels) row: the unlabelled reward of the last window can arrive before
        # that window's labelled points, so waiting for it alone can stop the read a few points short
        def done(g):
            return len({(p.time, tuple(p.labels.items()), p.name) for p in g if p.window == W}) >= len(want) * 6 and \
                any(p.name == "metrics/dlq" and p.value == 4 for p in g)
        got += read_points(cons, done, 60)
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
    assert rc == 0, (tmp_path / "metrics.log").read_text()[-3000:]

    windowed = [p for p in got if p.window == W]
    assert {p.name for p in windowed} == {f"metrics/{m}" for m in
                                         ("reward", "success_rate", "length", "staleness", "staleness_max",
                                          "throughput")}
    seen = {}
    for p in windowed:
        key = (p.time, tuple(sorted(p.labels.items(), key=lambda kv: kv[0] != "family")), p.name)
        assert key not in seen, f"window emitted twice: {key}"
        seen[key] = p
    assert len(seen) == len(want) * 6
    for (end, labels), row in want.iterrows():
        for m in ("reward", "success_rate", "length", "staleness", "staleness_max", "throughput"):
            p = seen[(end, labels, f"metrics/{m}")]
            assert p.value == pytest.approx(row[m], rel=1e-9), (end, labels, m)
            assert p.count == row["count"]
    # x-axis: on-time trajectories up to each window, the running sum of the window counts
    totals = want.xs((), level="labels")["count"].cumsum()
    for end, cum in totals.items():
        assert seen[(end, (), "metrics/reward")].trajectories == cum
        assert seen[(end, (), "metrics/reward")].learner_step == 11
    # 3 bad trajectories + 1 bad learner event: counted, dead-lettered with their bytes, and the
    # windows above came out complete all the same
    assert sorted(p.value for p in got if p.name == "metrics/dlq") == [1.0, 2.0, 3.0, 4.0]
    assert all(p.value == 0.0 for p in got if p.name == "metrics/late")
    dlq = kafka_bus.consumer({names.dlq: DeadLetter})
    dead, deadline = [], time.monotonic() + 20
    while len(dead) < 4 and time.monotonic() < deadline:
        dead += [m.msg for m in dlq.poll(max_records=10, timeout=0.5)]
    letters = {(d.topic, d.value, d.expected): d.reason for d in dead}
    assert len(dead) == 4
    for reason, value in bad.items():
        assert reason in letters[(names.trajectories, value[:100_001], "Trajectory")]
    assert "LearnerEvent" in letters[(names.learner, b"\x00 not a learner event", "LearnerEvent")]
