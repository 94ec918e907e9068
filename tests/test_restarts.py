"""Restarts the way they happen: a power cut that leaves a damaged checkpoint (issue 14)."""

from __future__ import annotations

import logging

import pytest

from learner.config import LearnerConfig
from learner.models.policy import build_policy
from learner.train import build_models
from learner.trainer.checkpoint import MANIFEST, damage, step_dirs
from learner.trainer.loop import Trainer
from learner.trainer.source import FileSource, write_trajectories
from learner.trainer.synthetic import TINY_OVERRIDES, synthetic_trajectories, tiny_model_config
from streamer.wire.config import load_config


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



def test_a_restart_neither_makes_trajectories_stale_nor_publishes_while_it_redoes_lost_steps(tmp_path):
    """The learner resumed at its checkpoint's step but published `latest + 1`, so the trajectories it read again
    (and its buffered ones) looked older than they were and were dropped as stale (issue 14, finding 1); the steps
    it redid published their versions a second time (finding 8)."""
    from learner.trainer.publish import DirectoryPublisher

    policy = build_policy(tiny_model_config(), seed=0)
    # two trajectories per version, as paced agents generate them: version v's pair trains at step v + 1
    trajs = [t for v in range(6) for t in synthetic_trajectories(policy, 2, seed=v, version=v, prefix=f"v{v}-")]
    path = write_trajectories(tmp_path / "t.jsonl", trajs, append=False)
    cfg = _cfg(tmp_path, "batch.max_staleness=2", "checkpoint.every=1000")
    store = tmp_path / "weights"

    crashed = Trainer(cfg, build_models(cfg), FileSource(path), DirectoryPublisher(store))
    crashed.start()
    trained = []
    for _ in range(5):
        crashed.step_once()
        if crashed.step == 3:
            crashed.checkpoint()  # the last checkpoint before the crash: step 3, version 3
    assert DirectoryPublisher(store).versions() == [0, 1, 2, 3, 4, 5]
    del crashed  # SIGKILL: steps 4 and 5 are lost

    events = []
    again = Trainer(cfg, build_models(cfg), FileSource(path), DirectoryPublisher(store), [events.append])
    assert again.resume() and (again.step, again.version) == (3, 3)
    assert again.run() == 3
    trained = [tid for e in events for tid in e.task_ids]
    assert trained == [t.task_id for t in trajs[6:]]  # steps 4, 5 redone, then step 6
    assert again.admission.counts["stale"] == 0 and [e.staleness for e in events] == [{"0": 2}] * 3
    # nothing while redoing steps 4 and 5 (versions 4 and 5 exist: the agents hold them), then 6 after step 6
    assert DirectoryPublisher(store).versions() == [0, 1, 2, 3, 4, 5, 6]
    assert again.counters["redone_versions"] == 2 and again.version == 6 and again.admission.lineage.anchors == []


def test_redone_steps_replace_their_events_in_the_run_tables(tmp_path):
    """A redone step's event replaced nothing: learner.parquet counted it twice (issue 14, finding 8)."""
    from streamer.runs import artifacts as art
    from streamer.wire.schema import LearnerEvent

    w = art.RunWriter(tmp_path, config={}, flush_seconds=1e9, writer_id="tap")
    for step, version in ((1, 1), (2, 2), (3, 3), (4, 4), (3, 3), (4, 4), (5, 5)):  # crash after 4, resume at 2
        w.learner_event(LearnerEvent(step=step, version=version, time=float(step), n_trajectories=2, n_tokens=10,
                                     task_ids=[f"k{step}a", f"k{step}b"]))
    w.close()
    learner = art.read_learner(tmp_path)
    assert learner["step"].tolist() == [1, 2, 3, 4, 5] and int(learner["n_trajectories"].sum()) == 10


@pytest.mark.slow  # 13-19 s on 2 busy cores: a role crashes and restarts
def test_the_supervisor_restarts_a_crashed_role_a_bounded_number_of_times(tmp_path):
    """`sao up` failed the whole run when a role crashed; now it starts the role again (`--restarts`), and a role
    that cannot be restarted (the simulator would publish its stream twice) fails the run as before."""
    import time

    from streamer.launch.processes import Role, Supervisor

    sup = Supervisor(tmp_path, restarts=2)
    crashing = sup.start(Role("crashing", ["replay", str(tmp_path / "missing.jsonl"), "--out", "o.jsonl"]))
    once = sup.start(Role("once", ["replay", str(tmp_path / "missing.jsonl"), "--out", "o.jsonl"], restartable=False))
    codes = []
    for _ in range(3):
        sup.wait(crashing, timeout=60)
        sup.wait(once, timeout=60)
        assert once in sup.failed()
        codes += [code for role, code in sup.restart_dead() if role is crashing]
        time.sleep(0.1)
    assert codes == [2, 2] and crashing.restarts == 2 and sup.failed() == [crashing, once]
    log = (tmp_path / "crashing.log").read_text()
    assert log.count("no such file") == 3 and "--- exited 2: restart 2 of 2 ---" in log


@pytest.mark.slow  # 5-10 s: one learner process builds its model and refuses
def test_a_role_that_refuses_what_it_found_is_not_restarted(tmp_path):
    """A learner whose every checkpoint is damaged exits EXIT_REFUSED (78); the supervisor fails the run at once
    instead of spending its restarts on starts that would end the same way."""
    from streamer.launch.processes import Role, Supervisor
    from streamer.wire.config import EXIT_REFUSED

    (tmp_path / "ck" / "step_00000001").mkdir(parents=True)  # a checkpoint without its state.json: damaged
    (tmp_path / "t.jsonl").write_text("")
    sup = Supervisor(tmp_path, restarts=3)
    learner = sup.start(Role("learner", ["learn", "--trajectories", str(tmp_path / "t.jsonl"),
                                         "--checkpoint-dir", str(tmp_path / "ck")]))
    assert sup.wait(learner, timeout=120) == EXIT_REFUSED
    assert sup.restart_dead() == [] and learner.restarts == 0 and sup.failed() == [learner]
    assert "every checkpoint is damaged" in (tmp_path / "learner.log").read_text()
