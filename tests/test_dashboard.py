"""The dashboard's views under streamlit.testing.v1.AppTest, on a small run written by the real
artifact writers: each view must show exactly the data (values read back from the chart datasets,
tables and metrics the page sends to the browser)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from dashboard.live import close_all, wait_for
from streamer.runs import artifacts as art
from streamer.wire.schema import DriftEvent, LearnerEvent, MetricPoint, Trajectory

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
T0 = 100.0

# family a: phase 0 rewards [1,1] at t=100,101; drift at t=101.5; phase 1 rewards [0,0,1,1] at t=102..105
REWARDS = [(0, 1.0), (0, 1.0), (1, 0.0), (1, 0.0), (1, 1.0), (1, 1.0)]


def _traj(k: int, phase: int, reward: float, version: int) -> Trajectory:
    return Trajectory(traj_id=f"t{k}", task_id=f"k{k}", family="a", concept=f"c{phase}", phase=phase, prompt_len=1,
                   tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0], reward=reward, policy_version=version,
                   created_at=T0 + k, finished_at=T0 + k)


def write_run(root: Path, name: str = "r1", reward_shift: float = 0.0) -> Path:
    run = root / name
    w = art.RunWriter(run, config={"name": name}, flush_seconds=1e9)
    for k, (ph, r) in enumerate(REWARDS):
        # staleness = learner_version - version = [0, 1, 1, 2, 0, 1] -> counts {0: 2, 1: 3, 2: 1}
        stale = [0, 1, 1, 2, 0, 1][k]
        w.trajectory(_traj(k, ph, max(0.0, r - reward_shift), version=k // 2), learner_version=k // 2 + stale)
    w.drift(DriftEvent(phase=1, prev_phase=0, name="p1", schedule="abrupt", families=["a"], concepts={"a": "c1"},
                       prev_concepts={"a": "c0"}, at_seq=2, time=T0 + 1.5))
    # learner steps at t=102, 103, 104 (x_step of the drift at t=101.5 is 0)
    for s in range(3):
        w.learner_event(LearnerEvent(step=s, version=s + 1, time=T0 + 2 + s, n_trajectories=1, n_tokens=10 * (s + 1),
                                     metrics={"learner/clip_frac_low": 0.01 * (s + 1), "learner/clip_frac_high": 0.1,
                                              "learner/value_loss": 2.0 - s, "learner/explained_variance": 0.25 * s,
                                              "learner/kl": 0.003, "learner/entropy": 1.5 - 0.5 * s,
                                              "perf/idle_s": 0.5 * s, "perf/step_s": 0.5,
                                              "learner/dead_letters": float(s)}))
    for t, c, v in [(T0 + 1, "c0", 0.9), (T0 + 3, "c1", 0.2), (T0 + 5, "c1", 0.7)]:
        w.metric(MetricPoint(name="eval/reward", value=v, time=t, labels={"family": "a", "concept": c}))
    w.metric(MetricPoint(name="metrics/dlq", value=3.0, time=T0 + 4))
    w.close(window=2)
    return run


@pytest.fixture
def runs_root(tmp_path) -> Path:
    write_run(tmp_path)
    return tmp_path


@pytest.fixture(autouse=True)
def _argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # app() sets the server's options; restored after each test


def app(runs_root: Path, *options: str, **state) -> AppTest:
    """The app as `sao dashboard --runs runs_root *options` serves it, with `state` as a visitor's choices."""
    sys.argv = [APP, "--runs", str(runs_root), *options]
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["window"] = 2
    at.session_state["auto_refresh"] = False
    for k, v in state.items():
        at.session_state[k] = v
    at.run()
    assert not at.exception, at.exception
    return at


def chart_data(at: AppTest, name: str) -> dict[str, pd.DataFrame]:
    """The datasets of the chart whose spec (or one of whose layers) is named `name`, by layer name."""
    for el in at.get("vega_lite_chart"):
        spec = json.loads(el.proto.spec)
        layers = spec.get("layer", [spec])
        if not any(layer.get("name") == name for layer in layers):
            continue
        sets = {d.name: pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in el.proto.datasets}
        return {layer.get("name"): sets[layer["data"]["name"]] for layer in layers}
    raise AssertionError(f"no chart named {name!r}")


def test_header_metrics(runs_root):
    at = app(runs_root)
    shown = {m.label: m.value for m in at.metric}
    # W=2 windowed of [1,1,0,0,1,1] = [1,1,.5,0,.5,1] -> AUC 4/6; staleness mean (0*2+1*3+2)/6 = 5/6;
    # 3 steps of 1 trajectory of 6 generated; idle 0 + .5 + 1 s of the 2.5 s from 102 - .5 to 104
    assert shown == {"trajectories": "6", "learner steps": "3", "AUC (W=2)": "0.667",
                     "drift events": "1", "mean staleness": "0.83", "trained fraction": "50%",
                     "learner busy share": "40%", "dead letters": "2 · 3"}
    assert "**r1** (finished)" in [m.value for m in at.markdown]


def test_reward_view_values_and_drift_marker(runs_root):
    at = app(runs_root)
    d = chart_data(at, "reward_lines")
    # windowed W=2 within family a: [1, 1, .5, 0, .5, 1]; x = seconds since t0 = 100
    assert d["reward_lines"]["reward_w"].tolist() == [1.0, 1.0, 0.5, 0.0, 0.5, 1.0]
    assert d["reward_lines"]["x_time"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    # the drift mark stands where the drift reached the agents: the first phase-1 trajectory finished at t=102
    # (the event's own time, 101.5, is when it was published)
    rule = d["drift_rules"]
    assert rule["x_time"].tolist() == [2.0] and rule["text"].tolist() == ["p1"]
    assert set(d) == {"reward_lines", "drift_rules", "drift_labels"}  # recovery is in the table, not on the chart


def test_x_axis_switch_to_trajectories_and_steps(runs_root):
    at = app(runs_root, x_axis="trajectories")
    d = chart_data(at, "reward_lines")
    assert d["reward_lines"]["x_traj"].tolist() == [1, 2, 3, 4, 5, 6]
    assert d["drift_rules"]["x_traj"].tolist() == [3]  # the third trajectory is the first of phase 1
    at.sidebar.radio[0].set_value("learner steps").run()
    d = chart_data(at, "reward_lines")
    # steps done at t=100..105 (steps at 102, 103, 104): [0, 0, 1, 2, 3, 3]
    assert d["reward_lines"]["x_step"].tolist() == [0, 0, 1, 2, 3, 3]
    assert at.session_state["x_axis"] == "learner steps"


def test_drift_table(runs_root):
    at = app(runs_root)
    table = at.dataframe[0].value
    (row,) = table.to_dict("records")
    # pre [1,1] by version 0; post [0,0,1,1] by versions [1,1,2,2]: the window [1,1] (versions 2, 2) ends at the 4th;
    # policy steps published versions 1, 2 (of 1, 2, 3) up to the recovering window's version 2 -> 2
    assert row == {"phase": 1, "name": "p1", "family": "a", "from": "c0", "to": "c1", "status": "recovered",
                   "pre-drift level": 1.0, "initial level": 0.0, "recovery (family trajectories)": 4,
                   "recovery (stream trajectories)": 4, "recovery (policy steps)": 2, "low pre-drift level": False}
    assert any("recovered: 1" in c.value for c in at.caption)


def test_eval_view(runs_root):
    at = app(runs_root)
    ev = chart_data(at, "eval")["eval"]
    assert ev.sort_values("x_time")[["x_time", "value", "series"]].values.tolist() == [
        [1.0, 0.9, "a/c0"], [3.0, 0.2, "a/c1"], [5.0, 0.7, "a/c1"]]


def test_staleness_histogram(runs_root):
    at = app(runs_root)
    st = chart_data(at, "staleness_bars")["staleness_bars"]
    assert dict(zip(st["staleness"], st["count"])) == {0: 2, 1: 3, 2: 1}


@pytest.mark.parametrize("view,expected", [
    ("clip", {"learner/clip_frac_low": [0.01, 0.02, 0.03], "learner/clip_frac_high": [0.1, 0.1, 0.1]}),
    ("value_loss", {"learner/value_loss": [2.0, 1.0, 0.0]}),
    ("explained_variance", {"learner/explained_variance": [0.0, 0.25, 0.5]}),
    ("kl_entropy", {"learner/kl": [0.003] * 3, "learner/entropy": [1.5, 1.0, 0.5]}),
    ("idle", {"perf/idle_s": [0.0, 0.5, 1.0]}),
])
def test_learner_metric_views(runs_root, view, expected):
    at = app(runs_root)
    df = chart_data(at, view)[view]
    got = {s: g.sort_values("x_time")["value"].round(6).tolist() for s, g in df.groupby("series")}
    assert got == expected
    assert sorted(df["x_time"].unique().tolist()) == [2.0, 3.0, 4.0]


def test_explained_variance_axis_is_held_to_minus_one_one(runs_root):
    # a critic's EV of -25 early in a run would squash every later point to a flat line near 0
    at = app(runs_root)
    specs = [json.loads(el.proto.spec) for el in at.get("vega_lite_chart")]
    ev = next(sp for sp in specs if sp.get("name") == "explained_variance")
    assert ev["encoding"]["y"]["scale"] == {"domain": [-1.0, 1.0], "clamp": True}
    loss = next(sp for sp in specs if sp.get("name") == "value_loss")
    assert "scale" not in loss["encoding"]["y"]


def test_throughput_view(runs_root):
    at = app(runs_root)
    tok = chart_data(at, "learner_tokens_per_s")["learner_tokens_per_s"].sort_values("x_time")
    # tokens 20 and 30 over 1 s each (the first step has no predecessor)
    assert tok["value"].tolist() == [20.0, 30.0] and set(tok["series"]) == {"learner tokens/s"}
    traj = chart_data(at, "trajectories_per_s")["trajectories_per_s"]
    assert set(traj["series"]) == {"trajectories/s"}
    # finish times 0..5 s in 5 s buckets: [0,5) holds 5, [5,10) holds 1 -> 1.0 and 0.2 per second
    assert sorted(traj["value"].tolist()) == [0.2, 1.0]


def test_runs_side_by_side(runs_root):
    write_run(runs_root, "r2", reward_shift=1.0)  # every reward 0
    at = app(runs_root, runs=["r1", "r2"])
    d = chart_data(at, "reward_lines")["reward_lines"]
    by = {s: g["reward_w"].tolist() for s, g in d.groupby("series")}
    assert by == {"r1 · a": [1.0, 1.0, 0.5, 0.0, 0.5, 1.0], "r2 · a": [0.0] * 6}
    assert sorted(at.dataframe[0].value["run"].tolist()) == ["r1", "r2"]


def test_live_run_being_written(tmp_path):
    run = tmp_path / "live1"
    w = art.RunWriter(run, flush_seconds=1e9)
    for k, (ph, r) in enumerate(REWARDS[:3]):
        w.trajectory(_traj(k, ph, r, 0))
    w.flush()
    at = app(tmp_path)
    assert {m.label: m.value for m in at.metric}["trajectories"] == "3"
    assert "**live1** (being written)" in [m.value for m in at.markdown]
    for k, (ph, r) in enumerate(REWARDS[3:], start=3):
        w.trajectory(_traj(k, ph, r, 0))
    w.flush()
    at.run()  # a refresh keeps the selection and shows the new part
    assert at.session_state["runs"] == ["live1"]
    assert {m.label: m.value for m in at.metric}["trajectories"] == "6"
    w.close()


def test_live_trained_fraction_counts_the_steps_up_to_the_newest_trajectory_read(tmp_path):
    # the learner's table flushed ahead of the trajectories': steps at t=101 and t=103 of 2 trajectories each, the
    # trajectories read so far finished at t=100..102 -> 2 of 3 (not 4 of 3 = 133%); then all 6 read -> 4 of 6
    w = art.RunWriter(tmp_path / "live2", flush_seconds=1e9)
    for s in range(2):
        w.learner_event(LearnerEvent(step=s, version=s + 1, time=T0 + 1 + 2 * s, n_trajectories=2, n_tokens=4))
    for k, (ph, r) in enumerate(REWARDS[:3]):
        w.trajectory(_traj(k, ph, r, 0))
    w.flush()
    at = app(tmp_path)
    assert {m.label: m.value for m in at.metric}["trained fraction"] == "67%"
    for k, (ph, r) in enumerate(REWARDS[3:], start=3):
        w.trajectory(_traj(k, ph, r, 0))
    w.flush()
    at.run()
    shown = {m.label: m.value for m in at.metric}
    assert (shown["trajectories"], shown["trained fraction"]) == ("6", "67%")
    w.close()


def test_missing_runs_dir_and_unreachable_broker_give_messages(tmp_path):
    at = app(tmp_path / "nope", "--bootstrap", "127.0.0.1:1", "--run", "ghost")
    texts = [i.value for i in at.info] + [w.value for w in at.warning] + [s.value for s in at.success]
    assert any("No run selected" in t for t in texts)
    assert any("127.0.0.1:1" in t and "ghost" in t for t in texts)  # "connecting to ..." at first
    # the tap gives up on the closed port in the background; a refresh then says why, with no traceback
    assert wait_for(lambda: any("broker not reachable" in w.value for w in at.run().warning), 60)
    assert not at.exception
    close_all()


def test_downsampling_keeps_extremes_and_bounds_points():
    from dashboard.downsample import downsample, minmax_indices

    y = np.zeros(1_000_000)
    y[123_457] = 5.0  # a spike
    y[800_001] = -3.0
    idx = minmax_indices(y, 2000)
    assert len(idx) <= 2000 and 123_457 in idx and 800_001 in idx and idx[0] == 0 and idx[-1] == 999_999
    df = pd.DataFrame({"g": np.repeat(["a", "b"], 5000), "v": np.arange(10_000.0)})
    out = downsample(df, "v", by="g", max_points=400)
    assert len(out) <= 400 and set(out["g"]) == {"a", "b"}
    assert out["v"].is_monotonic_increasing  # order kept


def test_censored_recovery_is_shown_as_censored(tmp_path):
    run = tmp_path / "c1"
    w = art.RunWriter(run, flush_seconds=1e9)
    # phase 0 rewards [1,1]; phase 1 rewards [0,0,0] never recover: censored at the phase length 3
    for k, (ph, r) in enumerate([(0, 1.0), (0, 1.0), (1, 0.0), (1, 0.0), (1, 0.0)]):
        w.trajectory(_traj(k, ph, r, 0))
    w.drift(DriftEvent(phase=1, prev_phase=0, name="p1", schedule="abrupt", families=["a"], concepts={"a": "c1"},
                       at_seq=2, time=T0 + 1.5))
    w.flush()
    at = app(tmp_path)  # being written: the last block has not ended, so it is not censored yet
    assert at.dataframe[0].value.iloc[0]["status"] == "in progress"
    w.close(window=2)
    at = app(tmp_path)
    row = at.dataframe[0].value.iloc[0]
    # no learner events: a recovery would need trajectories of a version after 0; none, and no reward back either
    assert (row["status"], row["recovery (family trajectories)"]) == ("censored", 3)
    assert pd.isna(row["recovery (policy steps)"])


def test_launcher_options_bind_localhost_and_pass_app_options():
    from dashboard import launch

    a = launch.parse(["--port", "8600", "--runs", "r/", "--bootstrap", "h:1", "--run", "x"])
    args = launch.streamlit_args(a)
    assert args[:2] == ["run", str(launch.APP)]
    assert args[args.index("--server.address") + 1] == "127.0.0.1"
    assert args[args.index("--server.port") + 1] == "8600"
    assert args[args.index("--") + 1:] == ["--runs", "r/", "--refresh", "3.0", "--max-live", "4", "--bootstrap",
                                           "h:1", "--run", "x"]
    assert "--allow-any-broker" in launch.streamlit_args(launch.parse(["--allow-any-broker"]))
    with pytest.raises(SystemExit):
        launch.parse(["--port", "70000"])


def test_forgetting_table_when_a_concept_recurs(tmp_path):
    import msgspec

    run = tmp_path / "f1"
    w = art.RunWriter(run, flush_seconds=1e9)
    # concept c0 in phase 0, c1 in phase 1, c0 again in phase 2 (two trajectories each, in stream order)
    for k, (ph, concept, r) in enumerate([(0, "c0", 1.0), (0, "c0", 0.8), (1, "c1", 0.3), (1, "c1", 0.4),
                                          (2, "c0", 0.2), (2, "c0", 0.6)]):
        w.trajectory(msgspec.structs.replace(_traj(k, ph, r, 0), concept=concept))
    for ph, (prev, new), t in [(1, ("c0", "c1"), 102.0), (2, ("c1", "c0"), 104.0)]:
        w.drift(DriftEvent(phase=ph, prev_phase=ph - 1, name=f"p{ph}", schedule="recurring", families=["a"],
                           concepts={"a": new}, prev_concepts={"a": prev}, at_seq=2 * ph, time=t))
    w.close(window=2)
    at = app(tmp_path)
    fg = at.dataframe[1].value  # [0] is the drift table
    (row,) = fg.to_dict(orient="records")
    # online reward, W=2: the last two of c0 before it left [1, .8] -> .9; its first two when back [.2, .6] -> .4
    assert (row["family"], row["concept"], row["left_phase"], row["recurs_phase"]) == ("a", "c0", 1, 2)
    assert (row["n_before"], row["n_after"]) == (2, 2)
    assert (row["before"], row["after"]) == (pytest.approx(0.9), pytest.approx(0.4))
    assert row["forgetting"] == pytest.approx(-0.5)
    assert any("Forgetting of a concept rewarded again" in c.value for c in at.caption)
    assert art.read_summary(run)["forgetting"][0]["forgetting"] == pytest.approx(-0.5)  # summary.json: the same


def test_live_run_with_a_directory_is_read_from_files_not_topics(runs_root):
    # as `sao up` starts it: --bootstrap and --run name a run whose directory the tap is writing
    at = app(runs_root, "--bootstrap", "127.0.0.1:1", "--run", "r1")
    assert at.session_state["runs"] == ["r1"]
    assert any("read from its directory" in c.value for c in at.caption)
    assert not at.warning  # no tap was started, so no broker message


def test_long_run_sends_a_bounded_number_of_points(tmp_path):
    from dashboard import demo

    demo.write(tmp_path / "big", 100_000, parts=3)
    at = app(tmp_path, window=64)
    d = chart_data(at, "reward_lines")
    # 100,000 trajectories in 2 families: at most ~2,000 points reach the browser, both families kept
    assert 1000 <= len(d["reward_lines"]) <= 2000
    assert set(d["reward_lines"]["series"]) == {"arith", "string"}
    assert len(d["drift_rules"]) == 2
    assert {m.label: m.value for m in at.metric}["trajectories"] == "100,000"
