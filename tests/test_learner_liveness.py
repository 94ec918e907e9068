"""What keeps a live learner moving and its run tables whole: a partial batch trained once no trajectory comes
(paced agents would otherwise wait on a version while the learner waits on a batch), and the learner's table
flushed with every checkpoint (a kill after it loses no row of a step that is not redone)."""

from __future__ import annotations

from learner.config import LearnerConfig
from learner.models.policy import build_policy
from learner.train import build_models, build_outputs
from learner.trainer.loop import Trainer
from learner.trainer.source import FileSource, write_trajectories
from learner.trainer.synthetic import TINY_OVERRIDES, synthetic_trajectories, tiny_model_config
from streamer.runs.readers import read_table
from streamer.wire.config import load_config


def config(tmp_path, *overrides: str) -> LearnerConfig:
    return load_config(LearnerConfig, None, TINY_OVERRIDES + [f"checkpoint.dir={tmp_path / 'ck'}", "threads=1",
                                                             "value.warmup_steps=0", "loss.kl_coef=0", *overrides])


def trajectories(n: int):
    return synthetic_trajectories(build_policy(tiny_model_config(), seed=0), n)


def test_a_partial_batch_is_trained_once_no_trajectory_came_for_idle_flush_s(tmp_path):
    path = write_trajectories(tmp_path / "t.jsonl", trajectories(5), append=False)
    # a batch needs far more tokens than 5 trajectories hold; the followed file never ends
    cfg = config(tmp_path, "batch.tokens=100000", "batch.idle_flush_s=0")
    waiting = Trainer(cfg, build_models(cfg), FileSource(path, follow=True))
    waiting.start()
    assert waiting.next_batch(max_wait_s=1.0) == []  # 0: never flushed, the learner keeps waiting

    cfg = config(tmp_path / "b", "batch.tokens=100000", "batch.idle_flush_s=0.5", "max_steps=1")
    events = []
    trainer = Trainer(cfg, build_models(cfg), FileSource(path, follow=True), sinks=[events.append])
    assert trainer.run() == 1
    assert [e.n_trajectories for e in events] == [5]
    assert trainer.counters["idle_flushes"] == 1
    assert events[0].metrics["learner/count_idle_flushes"] == 1.0


def test_the_learner_table_holds_every_step_checkpointed_before_a_kill(tmp_path):
    run_dir = tmp_path / "run"
    path = write_trajectories(tmp_path / "t.jsonl", trajectories(12), append=False)
    cfg = config(tmp_path, f"io.trajectories={path}", f"io.run_dir={run_dir}", "batch.max_trajectories=4",
                 "checkpoint.every=1")
    publisher, sinks, _closers = build_outputs(cfg)
    table = next(s for s in sinks if hasattr(s, "flush"))
    table.writer.flush_seconds = 1e9  # never by time: only a checkpoint writes the rows
    trainer = Trainer(cfg, build_models(cfg), FileSource(path), publisher, sinks)
    assert trainer.run() == 3
    # the closers never run, as after a SIGKILL: the rows are on disk because each checkpoint flushed them
    rows = read_table(run_dir, "learner")
    assert sorted(rows["step"]) == [1, 2, 3]
    assert sorted(rows["n_trajectories"]) == [4, 4, 4]
