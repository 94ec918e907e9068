"""Run directory writers and readers: parts, compaction, torn files, summary values."""

from __future__ import annotations

import json
import math

import msgspec
import pandas as pd
import pytest

from streamer.runs import artifacts as art
from streamer.wire.schema import DriftEvent, LearnerEvent, MetricPoint, Trajectory, encode_json


def traj(i: int, family: str, phase: int, reward: float, t: float, version: int = 0) -> Trajectory:
    return Trajectory(traj_id=f"t{i}", task_id=f"k{i}", family=family, concept=f"{family}{phase}", phase=phase,
                      prompt_len=2, tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -0.5, -0.5],
                      reward=reward, success=reward > 0.5, policy_version=version, agent_id="a0",
                      created_at=t - 0.5, finished_at=t)


def test_rows_flatten_messages():
    row = art.trajectory_row(traj(0, "arith", 1, 1.0, 10.0, version=3), learner_step=7, learner_version=5)
    assert (row["n_tokens"], row["n_gen_tokens"], row["learner_version"], row["success"]) == (4, 2, 5.0, True)
    assert math.isnan(art.trajectory_row(traj(0, "arith", 1, 1.0, 10.0))["learner_step"])
    ev = LearnerEvent(step=2, version=2, time=5.0, n_trajectories=3, n_tokens=30,
                      metrics={"learner/kl": 0.01, "step": 99.0}, staleness={"0": 1, "2": 3})
    lr = art.learner_row(ev)
    # staleness values [0,2,2,2]: mean 1.5, max 2; a metric named like a field gets a prefix
    assert (lr["learner/kl"], lr["metric:step"], lr["step"]) == (0.01, 99.0, 2)
    assert (lr["staleness_mean"], lr["staleness_max"]) == (1.5, 2.0)
    mr = art.metric_row(MetricPoint(name="metrics/reward", value=0.5, time=1.0,
                                    labels={"family": "arith", "name": "x"}))
    assert (mr["family"], mr["label:name"], mr["name"]) == ("arith", "x", "metrics/reward")


def test_parts_are_readable_while_writing_and_compacted_at_close(tmp_path):
    run = tmp_path / "r1"
    w = art.RunWriter(run, config={"seed": 1}, flush_seconds=1e9)
    for i in range(3):
        w.trajectory(traj(i, "arith", 0, 1.0, float(i)))
    assert len(art.read_trajectories(run)) == 0  # buffered, nothing flushed yet
    w.flush()
    for i in range(3, 5):
        w.trajectory(traj(i, "arith", 0, 0.0, float(i)), learner_step=i)
    w.flush()
    parts = sorted(p.name for p in (run / "trajectories").iterdir())
    assert parts == ["part-00001.parquet", "part-00002.parquet"]
    df = art.read_trajectories(run)
    assert df["traj_id"].tolist() == ["t0", "t1", "t2", "t3", "t4"]
    assert df["learner_step"].isna().tolist() == [True, True, True, False, False]
    w.close()
    assert (run / "trajectories.parquet").exists() and not list((run / "trajectories").iterdir())
    assert art.read_trajectories(run)["reward"].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert art.read_config(run) == {"seed": 1}
    assert art.read_summary(run)["n_trajectories"] == 5
    assert (run / "checkpoints").is_dir()


def test_restarted_writer_continues_numbering_per_writer_id(tmp_path):
    w = art.TableWriter(tmp_path, "metrics", flush_seconds=1e9)
    w.add({"name": "a", "value": 1.0})
    w.flush()
    w2 = art.TableWriter(tmp_path, "metrics", flush_seconds=1e9)  # the same writer, restarted
    w2.add({"name": "c", "value": 3.0})
    assert w2.flush().name == "part-00002.parquet"
    wb = art.TableWriter(tmp_path, "metrics", flush_seconds=1e9, writer_id="b")  # another writer
    wb.add({"name": "b", "value": 2.0})
    assert wb.flush().name == "part-00001-b.parquet"
    # read in (part number, writer) order
    assert art.read_metrics(tmp_path)["name"].tolist() == ["a", "b", "c"]


def test_time_based_flush(tmp_path):
    w = art.TableWriter(tmp_path, "learner", flush_seconds=0.0)
    w.add({"step": 1})  # flush_seconds=0: every add flushes
    assert art.read_learner(tmp_path)["step"].tolist() == [1]


def test_unreadable_part_is_skipped_with_warning(tmp_path):
    w = art.TableWriter(tmp_path, "trajectories", flush_seconds=1e9)
    w.add({"reward": 1.0})
    w.flush()
    (tmp_path / "trajectories" / "part-00002.parquet").write_bytes(b"PAR1 torn")
    with pytest.warns(UserWarning, match="part-00002.parquet: skipped unreadable part"):
        df = art.read_trajectories(tmp_path)
    assert df["reward"].tolist() == [1.0]


def test_drift_jsonl_torn_last_line_skipped_bad_middle_line_raises(tmp_path):
    ev = DriftEvent(phase=1, prev_phase=0, name="p1", schedule="abrupt", families=["arith"],
                    concepts={"arith": "mul"}, at_seq=100, time=3.0)
    path = tmp_path / "drift.jsonl"
    path.write_bytes(encode_json(ev) + b"\n" + encode_json(ev)[:20])
    assert [e.phase for e in art.read_drift(tmp_path)] == [1]
    path.write_bytes(b"{bad\n" + encode_json(ev) + b"\n")
    with pytest.raises(art.ArtifactError, match="drift.jsonl:1"):
        art.read_drift(tmp_path)


def test_unknown_table_and_bad_json_name_the_path(tmp_path):
    with pytest.raises(art.ArtifactError, match="unknown table 'x'"):
        art.read_table(tmp_path, "x")
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(art.ArtifactError, match="config.json"):
        art.read_config(tmp_path)


def test_list_runs(tmp_path):
    art.RunWriter(tmp_path / "a", config={}).close()
    (tmp_path / "not_a_run").mkdir()
    assert [p.name for p in art.list_runs(tmp_path)] == ["a"]
    assert art.list_runs(tmp_path / "missing") == []


def test_summarize_hand_computed(tmp_path):
    run = tmp_path / "r"
    w = art.RunWriter(run, config={}, flush_seconds=1e9)
    # arith: phase 0 rewards [1,1] at t=1,2; drift; phase 1 rewards [0,1,1] at t=3,4,5 by policy versions 1,1,2
    rows = [(0, 1, 1, 0), (0, 1, 2, 0), (1, 0, 3, 1), (1, 1, 4, 1), (1, 1, 5, 2)]
    for i, (ph, r, t, v) in enumerate(rows):
        w.trajectory(traj(i, "arith", ph, float(r), float(t), version=v), learner_version=v + i % 2)
    w.drift(DriftEvent(phase=1, prev_phase=0, name="p1", schedule="abrupt", families=["arith"],
                       concepts={"arith": "arith1"}, prev_concepts={"arith": "arith0"}, at_seq=2, time=2.5))
    for s, t in enumerate([3.0, 4.0, 6.0]):
        w.learner_event(LearnerEvent(step=s, version=s, time=t, n_trajectories=1, n_tokens=100,
                                     metrics={"perf/idle_s": 0.5 * s, "perf/step_s": 0.5}))
    # eval of arith0: 0.9 at t=2 (before it left); it never recurs -> no forgetting rows
    w.metric(MetricPoint(name="eval/reward", value=0.9, time=2.0, labels={"family": "arith", "concept": "arith0"}))
    w.close(window=2)
    s = art.read_summary(run)
    assert s["window"] == 2
    # W=2: windowed of [1,1,0,1,1] = [1,1,.5,.5,1] -> AUC 0.8
    assert s["auc"] == pytest.approx(0.8)
    # pre level 1, threshold 0.9; initial [0,1] = .5 (a drop); window [1,1] = 1 ends at index 2, its versions
    # {1,2} are all newer than the pre-drift version 0 -> recovered in 3; policy steps with version in (0, 2]: 2
    (rec,) = s["recoveries"]
    assert (rec["status"], rec["trajectories"], rec["stream_trajectories"], rec["learner_steps"]) == (
        "recovered", 3, 3, 2)
    assert (rec["pre_level"], rec["initial_level"], rec["low_pre_level"]) == (1.0, 0.5, False)
    assert (rec["version_pre"], rec["version_recovered"]) == (0, 2)
    assert s["recovery_summary"]["by_status"] == {"unaffected": 0, "no drop": 0, "recovered": 1, "censored": 0,
                                                  "no data": 0}
    assert s["recovery_summary"]["median_trajectories"] == 3
    # last W=2 of each concept: arith0 [1,1] -> 1; arith1 [1,1] -> 1
    assert s["final_reward_per_concept"] == {"arith/arith0": 1.0, "arith/arith1": 1.0}
    # staleness = learner_version - version = [0,1,0,1,0]: mean 0.4, max 1
    assert (s["staleness"]["mean"], s["staleness"]["max"]) == (pytest.approx(0.4), 1.0)
    # 5 trajectories over 4 s; 300 tokens over 3 s
    assert s["trajectories_per_s"] == pytest.approx(1.25)
    assert s["learner_tokens_per_s"] == pytest.approx(100.0)
    assert s["learner_idle"] == {"perf/idle_s": 0.5}  # mean of 0, .5, 1
    # 3 trained of 5 generated; idle 1.5 s of the 3.5 s from the first wait (3 - 0.5 - 0) to the last event (6)
    assert s["trained_fraction"] == pytest.approx(0.6)
    assert s["learner_busy_share"] == pytest.approx(1 - 1.5 / 3.5)
    assert s["forgetting"] == []
    json.dumps(s, allow_nan=False)  # NaN-free JSON


def test_readers_add_the_stream_position_from_the_task_id(tmp_path):
    w = art.RunWriter(tmp_path, flush_seconds=1e9)
    for i, task in enumerate(["default-0-12", "default-0-3"]):
        w.trajectory(msgspec.structs.replace(traj(i, "a", 0, 1.0, 1.0), task_id=task))
    w.close(summary=False)
    assert art.read_trajectories(tmp_path)["seq"].tolist() == [12, 3]
    only = art.read_part(tmp_path / "trajectories.parquet", ["reward", "seq"])
    assert list(only.columns) == ["reward", "seq"] and only["seq"].tolist() == [12, 3]


def test_summarize_empty_run(tmp_path):
    s = art.summarize(tmp_path)
    assert s["n_trajectories"] == 0 and s["recoveries"] == [] and s["staleness"]["n"] == 0
    assert s["window"] == 64
    pd.DataFrame(s["recoveries"])  # shape the dashboard expects


def test_restart_after_compaction_appends_and_reads_every_row_once(tmp_path):
    w = art.TableWriter(tmp_path, "metrics", flush_seconds=1e9)
    for v in (1.0, 2.0):
        w.add({"name": "m", "value": v})
        w.flush()
    w.compact()  # parts 1-2 merged; the single file records "through 2"
    assert art.compacted_through(tmp_path / "metrics.parquet") == {"": 2}
    w2 = art.TableWriter(tmp_path, "metrics", flush_seconds=1e9)  # a restarted run
    w2.add({"name": "m", "value": 3.0})
    assert w2.flush().name == "part-00003.parquet"  # numbering continues past the compacted parts
    assert art.read_metrics(tmp_path)["value"].tolist() == [1.0, 2.0, 3.0]
    w2.compact()
    assert art.read_metrics(tmp_path)["value"].tolist() == [1.0, 2.0, 3.0]
    assert art.compacted_through(tmp_path / "metrics.parquet") == {"": 3}


def test_reader_mid_compaction_sees_no_duplicates(tmp_path):
    # the state between writing the single file and removing the parts: both are on disk
    w = art.TableWriter(tmp_path, "learner", flush_seconds=1e9)
    for s in (1, 2):
        w.add({"step": s})
        w.flush()
    merged = art.read_learner(tmp_path)
    art.write_atomic(merged, tmp_path / "learner.parquet", {"sao.compacted_through": '{"": 2}'})
    assert (tmp_path / "learner" / "part-00001.parquet").exists()
    assert art.read_learner(tmp_path)["step"].tolist() == [1, 2]
    assert art.table_files(tmp_path, "learner") == [tmp_path / "learner.parquet"]


def test_compaction_by_one_writer_keeps_another_writers_later_parts(tmp_path):
    # the tap compacts at close while the learner (its own writer id) is still writing the same table
    tap = art.TableWriter(tmp_path, "learner", flush_seconds=1e9, writer_id="tap")
    lrn = art.TableWriter(tmp_path, "learner", flush_seconds=1e9, writer_id="learner")
    for s in (1, 2, 3):
        lrn.add({"step": s})
        lrn.flush()  # part-00001..3-learner
    tap.add({"step": 0})
    tap.flush()  # part-00001-tap
    tap.compact()
    assert art.compacted_through(tmp_path / "learner.parquet") == {"learner": 3, "tap": 1}
    lrn.add({"step": 4})
    assert lrn.flush().name == "part-00004-learner.parquet"
    assert sorted(art.read_table(tmp_path, "learner")["step"].tolist()) == [0, 1, 2, 3, 4]
    # a new learner process after that continues at 5, not 1
    assert art.TableWriter(tmp_path, "learner", writer_id="learner").seq == 4


def test_close_fills_the_step_and_version_that_trained_each_trajectory(tmp_path):
    # (traj id, task id, behaviour version, finish time); k1 is answered twice, g is a group of two
    rows = [("t0", "k0", 0, 1.0), ("t1", "k1", 0, 2.0), ("t2", "k2", 1, 3.0), ("t3", "k3", 1, 4.0),
            ("t4", "k4", 1, 5.0), ("t5", "k1", 1, 6.0), ("t6", "g", 2, 7.0), ("t7", "g", 2, 7.5)]
    tap = art.RunWriter(tmp_path, writer_id="tap", flush_seconds=1e9)
    for i, (tid, task, v, t) in enumerate(rows):
        tap.trajectory(msgspec.structs.replace(traj(i, "arith", 0, 1.0, t, version=v), traj_id=tid, task_id=task))
    tap.flush()
    learner = art.TableWriter(tmp_path, "learner", writer_id="learner", flush_seconds=1e9)

    def event(step, version, tasks, hist, skipped=False):
        learner.add(art.learner_row(LearnerEvent(step=step, version=version, time=float(step),
                                                 n_trajectories=len(tasks), n_tokens=4 * len(tasks), staleness=hist,
                                                 task_ids=tasks, skipped=skipped)))

    event(1, 1, ["k0", "k1"], {"0": 2})  # trained at version 0, publishes 1
    event(2, 2, ["k2"], {"0": 1})  # lost: the learner restarts from its step-1 checkpoint ...
    event(2, 2, ["k2", "k1"], {"0": 2})  # ... and redoes step 2 at version 1 with k1's second answer
    event(3, 3, ["k3"], {"0": 1}, skipped=True)  # non-finite: nothing trained, the version still moves on
    event(4, 4, ["g", "g"], {"1": 2})  # at version 3
    learner.flush()
    tap.close()

    df = art.read_trajectories(tmp_path).set_index("traj_id")
    nan = math.nan
    want = {"t0": (1, 0), "t1": (1, 0), "t2": (2, 1), "t3": (nan, nan), "t4": (nan, nan), "t5": (2, 1),
            "t6": (4, 3), "t7": (4, 3)}
    got = {t: (r.learner_step, r.learner_version) for t, r in df.iterrows()}
    assert {t: tuple(None if math.isnan(x) else x for x in v) for t, v in got.items()} == \
        {t: tuple(None if math.isnan(x) else x for x in v) for t, v in want.items()}
    # learner_version - policy_version is the staleness the learner counted for each standing, applied step
    ev = art.effective_events(art.read_learner(tmp_path))
    assert ev["step"].tolist() == [1, 2, 3, 4] and ev["version_before"].tolist() == [0, 1, 2, 3]
    hists = {r.step: json.loads(r.staleness) for r in art.read_learner(tmp_path).itertuples()}
    trained = df.dropna(subset=["learner_step"])
    for step, g in trained.groupby("learner_step"):
        counts = (g["learner_version"] - g["policy_version"]).astype(int).astype(str).value_counts().to_dict()
        assert counts == hists[int(step)]
    # the file keeps its compaction record; a second fill finds nothing left to fill
    assert art.compacted_through(tmp_path / "trajectories.parquet") == {"tap": 1}
    assert art.fill_learner_columns(tmp_path) == 0
    assert art.read_summary(tmp_path)["staleness"]["max"] == 1.0


def test_effective_events_without_the_step_before_leave_the_version_unknown():
    lr = pd.DataFrame({"step": [5, 6], "version": [5, 6], "skipped": [False, False], "task_ids": ['["a"]', '["b"]']})
    ev = art.effective_events(lr)
    assert math.isnan(ev["version_before"][0]) and ev["version_before"][1] == 5
    traj_df = pd.DataFrame({"task_id": ["b", "a", "c"], "finished_at": [2.0, 1.0, 3.0]})
    got = art.trained_by(traj_df, lr)
    assert got["learner_step"].tolist()[:2] == [6.0, 5.0] and got.isna().values[2].all()
