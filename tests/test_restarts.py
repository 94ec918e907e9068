"""Restarts the way they happen: a power cut that leaves a damaged checkpoint (issue 14)."""

from __future__ import annotations

import logging

from learner.config import LearnerConfig
from learner.models.policy import build_policy
from learner.train import build_models
from learner.trainer.checkpoint import MANIFEST, damage, step_dirs
from learner.trainer.loop import Trainer
from learner.trainer.source import FileSource, write_trajectories
from learner.trainer.synthetic import TINY_OVERRIDES, synthetic_trajectories, tiny_model_config
from streamer.config import load_config


def _cfg(tmp_path, *extra: str) -> LearnerConfig:
    return load_config(LearnerConfig, None, TINY_OVERRIDES + [
        f"checkpoint.dir={tmp_path / 'ck'}", "batch.max_trajectories=2", "batch.tokens=100000", "checkpoint.every=1",
        "checkpoint.keep=3", "value.warmup_steps=0", "threads=1", *extra])


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, caplog):
    """A truncated policy.safetensors used to stop the learner for good (SafetensorError: incomplete metadata)."""
    trajs = synthetic_trajectories(build_policy(tiny_model_config(), seed=0), 6, seed=3)
    path = write_trajectories(tmp_path / "t.jsonl", trajs, append=False)
    cfg = _cfg(tmp_path)
    first = Trainer(cfg, build_models(cfg), FileSource(path))
    assert first.run() == 3
    dirs = step_dirs(tmp_path / "ck")
    assert [d.name for d in dirs] == ["step_00000001", "step_00000002", "step_00000003"]
    assert all(damage(d) is None for d in dirs) and all((d / MANIFEST).is_file() for d in dirs)
    newest = dirs[-1] / "policy.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # a power cut before the data reached the disk
    flipped = dirs[-2] / "value.safetensors"
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF
    flipped.write_bytes(bytes(data))

    again = Trainer(cfg, build_models(cfg), FileSource(path))
    with caplog.at_level(logging.WARNING):
        assert again.resume()
    assert again.step == 1 and len(again.batcher.pending()) == 4  # read ahead with step 1, buffered
    warned = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert f"checkpoint {dirs[-1]} is damaged (policy.safetensors has 100 bytes" in warned[0]
    assert f"checkpoint {dirs[-2]} is damaged (value.safetensors does not match its sha256" in warned[1]
    assert again.run() == 2  # the two batches after step 1, trained again

