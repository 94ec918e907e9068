"""Exactly-once training across crashes: SIGKILL `sao learn` at random moments, restart, compare.

The effective history is the event log with every step that a restart redid replaced by its redo
(a kill loses the steps after the last checkpoint; the restart trains them again from the same
records). Every trajectory must appear in it exactly once, and the final weights must equal those
of a run that was never interrupted.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgspec
import pytest
import torch
from kafka_fixtures import train_from_topic
from safetensors.torch import load_model

from learner.config import LearnerConfig
from learner.models.policy import build_policy
from learner.train import build_models
from learner.trainer.checkpoint import latest_checkpoint
from learner.trainer.loop import Trainer
from learner.trainer.source import FileSource, write_trajectories
from learner.trainer.synthetic import TINY_OVERRIDES, synthetic_trajectories, tiny_model_config
from streamer.wire.config import load_config, set_args
from streamer.wire.schema import LearnerEvent

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = TINY_OVERRIDES + ["threads=1", "checkpoint.every=3", "batch.tokens=40", "optim.lr=0.01"]


def effective_events(path: Path) -> tuple[list[LearnerEvent], int]:
    """(the surviving step events in step order, how many emitted steps were redone)."""
    by_step: dict[int, LearnerEvent] = {}
    redone = 0
    for line in path.read_bytes().splitlines():
        try:
            e = msgspec.json.decode(line, type=LearnerEvent)
        except msgspec.DecodeError:
            continue  # the line a kill cut short
        if e.step in by_step:
            redone += 1
        for s in [s for s in by_step if s > e.step]:  # a restart rolls back every step after it
            del by_step[s]
        by_step[e.step] = e
    return [by_step[s] for s in sorted(by_step)], redone


def learn(traj_file: Path, ckpt_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "learner.train", "--trajectories", str(traj_file),
           "--checkpoint-dir", str(ckpt_dir), *set_args(OVERRIDES)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def n_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.slow  # 17-22 s on 2 busy cores: a learner subprocess killed and restarted
def test_sigkill_then_restart_trains_every_trajectory_exactly_once(tmp_path):
    trajs = synthetic_trajectories(build_policy(tiny_model_config(), seed=0), 180, seed=11)
    traj_file = write_trajectories(tmp_path / "trajs.jsonl", trajs, append=False)
    ckpt_dir, events = tmp_path / "ck", tmp_path / "ck" / "events.jsonl"
    rng = random.Random(1234)
    kills = 0
    for _ in range(2):
        proc = learn(traj_file, ckpt_dir)
        start_lines = n_lines(events)
        target = start_lines + rng.choice([1, 2, 4, 5, 7, 8])  # not a checkpoint boundary (every 3)
        deadline = time.monotonic() + 60
        while n_lines(events) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        if proc.poll() is None:
            time.sleep(rng.uniform(0.0, 0.01))
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
    proc = learn(traj_file, ckpt_dir)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert kills >= 2

    history, redone = effective_events(events)
    trained = Counter(t for e in history for t in e.task_ids)
    assert set(trained) == {t.task_id for t in trajs}
    assert max(trained.values()) == 1
    assert [e.step for e in history] == list(range(1, len(history) + 1))
    assert redone >= 1  # some kill did land between checkpoints (else nothing was tested)

    # the same stream without interruption, in this process, reaches the very same weights
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = load_config(LearnerConfig, None, OVERRIDES + [f"checkpoint.dir={tmp_path / 'ref'}"])
        ref = Trainer(cfg, build_models(cfg), FileSource(traj_file))
        assert ref.run() == len(history)
    finally:
        torch.set_num_threads(torch_threads)
    crashed = build_policy(tiny_model_config(), seed=5)
    load_model(crashed, str(latest_checkpoint(ckpt_dir) / "policy.safetensors"))
    ref_sd, got_sd = ref.models.policy.state_dict(), crashed.state_dict()
    assert all(torch.equal(ref_sd[k], got_sd[k]) for k in ref_sd)


@pytest.mark.kafka
def test_kafka_source_resumes_at_checkpointed_offsets(tmp_path, kafka_bus, kafka_run):
    """Through the real broker: train on a first lot, checkpoint, stop; a new learner trains only the second."""
    from streamer.wire.topics import Topics, partitions_by_topic

    kafka_bus.create_topics(partitions_by_topic(kafka_run))
    topic = Topics(kafka_run).trajectories
    policy = build_policy(tiny_model_config(), seed=0)
    first, second = synthetic_trajectories(policy, 8, seed=1), synthetic_trajectories(policy, 8, seed=2)
    prod = kafka_bus.producer()

    def send(lot):
        for t in lot:
            prod.send(topic, t, key=t.task_id)
        prod.flush()

    def train_until(n_expected: int, trainer_seed: int) -> list[str]:
        return train_from_topic(kafka_bus, topic, tmp_path / "ck", n_expected, trainer_seed)

    send(first)
    assert sorted(train_until(8, 0)) == sorted(t.task_id for t in first)
    send(second)
    assert sorted(train_until(8, 1)) == sorted(t.task_id for t in second)
