"""A full disk and damaged checkpoints (issue 50 item 4), on a real filesystem that fills: a small tmpfs.

A checkpoint that failed with ENOSPC used to crash-loop the learner and leave its temporary directories behind;
a directory whose checkpoints were all damaged made the learner start from offset 0 without a word.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from learner.config import LearnerConfig
from learner.models.policy import build_policy
from learner.train import build_models
from learner.trainer.checkpoint import OutOfSpace, damage, step_dirs
from learner.trainer.loop import Trainer
from learner.trainer.publish import DirectoryPublisher
from learner.trainer.source import FileSource, write_trajectories
from learner.trainer.synthetic import TINY_OVERRIDES, synthetic_trajectories, tiny_model_config
from streamer.wire.config import EXIT_NO_SPACE, EXIT_REFUSED, load_config, set_args

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = TINY_OVERRIDES + ["threads=1", "batch.max_trajectories=4", "batch.tokens=100000",
                              "value.warmup_steps=0", "checkpoint.every=2"]


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs (a checkpoint of the tiny model takes about 0.3 MB), unmounted after the test."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {done.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(fs: Path, leave: int) -> Path:
    """Write a file until the filesystem is full, then give back `leave` bytes."""
    filler = fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * (1 << 16))
    except OSError:
        pass
    finally:
        os.close(fd)
    os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


def _trainer(ck: Path, path: Path, publisher=None, *extra: str):
    cfg = load_config(LearnerConfig, None, OVERRIDES + [f"checkpoint.dir={ck}", *extra])
    events = []
    return Trainer(cfg, build_models(cfg), FileSource(path), publisher, [events.append]), events


def learn(path: Path, ck: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "learner.train", "--trajectories", str(path), "--checkpoint-dir", str(ck), *flags,
           *set_args(OVERRIDES)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith((".tmp", ".trash", ".v")))


@pytest.mark.slow  # 12-20 s on 2 busy cores: a learner process refused at start
def test_a_full_disk_stops_the_learner_with_the_reason_and_a_run_with_space_resumes(tmp_path, small_fs):
    trajs = synthetic_trajectories(build_policy(tiny_model_config(), seed=0), 24, seed=2)
    path = write_trajectories(tmp_path / "t.jsonl", trajs, append=False)
    ck = small_fs / "ck"
    first, events = _trainer(ck, path)
    assert not first.resume()
    first.start()
    first.checkpoint()
    first.step_once()
    first.step_once()
    first.checkpoint()
    filler = fill(small_fs, leave=64 * 1024)
    first.step_once()
    first.step_once()
    with pytest.raises(OutOfSpace, match=f"checkpoint.dir {ck}: no space left on its filesystem") as raised:
        first.checkpoint()
    assert "bytes free" in str(raised.value) and "resumes from its newest intact checkpoint" in str(raised.value)
    assert leftovers(ck) == []  # the half-written checkpoint was removed
    assert [d.name for d in step_dirs(ck)] == ["step_00000000", "step_00000002"]
    assert all(damage(d) is None for d in step_dirs(ck))

    # the real process, started again on the full disk (as a supervisor would): refused at once, exit code 74
    again = learn(path, ck)
    assert again.returncode == EXIT_NO_SPACE, again.stderr[-2000:]
    assert f"sao learn: checkpoint.dir {ck}:" in again.stderr and "less than the" in again.stderr
    assert "step_00000002" in again.stderr and leftovers(ck) == []

    filler.unlink()  # space again: resume from step 2, train each trajectory once
    later, later_events = _trainer(ck, path)
    assert later.resume() and later.step == 2
    assert later.run() == 4
    trained = [tid for e in events[:2] + later_events for tid in e.task_ids]
    assert sorted(trained) == sorted(t.task_id for t in trajs)


def test_a_full_disk_under_the_weight_store_stops_the_learner_and_leaves_no_half_written_version(tmp_path, small_fs):
    trajs = synthetic_trajectories(build_policy(tiny_model_config(), seed=0), 8, seed=3)
    path = write_trajectories(tmp_path / "t.jsonl", trajs, append=False)
    store, ck = small_fs / "weights", tmp_path / "ck"
    (store / ".v000007.tmp4242").mkdir(parents=True)  # left by a killed learner
    (ck / ".tmp-step_00000009-4242").mkdir(parents=True)
    trainer, _ = _trainer(ck, path, DirectoryPublisher(store))
    assert not trainer.resume()
    assert leftovers(store) == [] and leftovers(ck) == []  # removed at start
    fill(small_fs, leave=16 * 1024)
    with pytest.raises(OutOfSpace, match=f"io.weights_dir {store}: no space left on its filesystem"):
        trainer.start()  # publishes version 0 (~0.1 MB)
    assert leftovers(store) == [] and DirectoryPublisher(store).versions() == []


@pytest.mark.slow  # 15-20 s on 2 busy cores: two learner processes
def test_when_every_checkpoint_is_damaged_the_learner_refuses_to_start_from_zero_until_told_to(tmp_path):
    trajs = synthetic_trajectories(build_policy(tiny_model_config(), seed=0), 12, seed=4)
    path = write_trajectories(tmp_path / "t.jsonl", trajs, append=False)
    ck = tmp_path / "ck"
    trainer, _ = _trainer(ck, path)
    trainer.resume()
    assert trainer.run() == 3
    kept = step_dirs(ck)
    assert [d.name for d in kept] == ["step_00000002", "step_00000003"]
    cut = kept[1] / "policy.safetensors"
    cut.write_bytes(cut.read_bytes()[:100])
    flipped = kept[0] / "state.json"
    flipped.write_text(flipped.read_text().replace('"step": 2', '"step": 9'))

    refused = learn(path, ck)
    assert refused.returncode == EXIT_REFUSED, refused.stderr[-2000:]  # never restarted by sao up
    err = refused.stderr
    assert f"sao learn: checkpoint.dir {ck}: every checkpoint is damaged" in err
    assert "step_00000003: policy.safetensors has 100 bytes, the manifest says" in err
    assert "step_00000002: state.json does not match its sha256 in the manifest" in err
    assert "--from-scratch" in err and "train every trajectory again from offset 0" in err
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == [d.name for d in kept]  # untouched

    over = learn(path, ck, "--from-scratch")
    assert over.returncode == 0, over.stderr[-2000:]
    assert sorted(p.name for p in (ck / "damaged").iterdir()) == ["step_00000002", "step_00000003"]
    assert "moved into damaged/" in over.stderr and "starting at step 0" in over.stderr
    assert [d.name for d in step_dirs(ck)] == ["step_00000002", "step_00000003"]  # its own, from zero
    assert all(damage(d) is None for d in step_dirs(ck))
