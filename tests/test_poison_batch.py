"""A batch that fails every time (issue 50 item 4): it used to be redone after each restart until the restarts
were spent. Now its trajectories are dead-lettered after `batch.poison_after` failures and the learner goes on.

The failure is injected with `$SAO_FAULT_POISON_TASK` (learner.trainer.quarantine.injected_fault): a
`torch.OutOfMemoryError` on every batch holding that task. No trajectory the learner admits makes its step raise
(admission refuses what the forward pass would crash on; a non-finite loss skips the step), so there is no real input
to send instead.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from test_trainer_kill import effective_events

from learner.config import LearnerConfig
from learner.models.policy import build_policy
from learner.train import build_models
from learner.trainer.loop import Trainer
from learner.trainer.quarantine import FAULT_ENV, FILE
from learner.trainer.source import FileSource, write_trajectories
from learner.trainer.synthetic import TINY_OVERRIDES, synthetic_trajectories, tiny_model_config
from streamer.wire.config import load_config, set_args

OVERRIDES = TINY_OVERRIDES + ["threads=1", "batch.max_trajectories=4", "batch.tokens=100000",
                              "value.warmup_steps=0", "checkpoint.every=2"]


def _trainer(tmp_path, path, *extra):
    cfg = load_config(LearnerConfig, None, OVERRIDES + [f"checkpoint.dir={tmp_path / 'ck'}", *extra])
    events = []
    trainer = Trainer(cfg, build_models(cfg), FileSource(path), None, [events.append])
    trainer.resume()
    return trainer, events


def test_a_poison_group_is_dead_lettered_after_three_failures_and_the_rest_trains_once(tmp_path, monkeypatch):
    """Each failure takes the learner down (a new Trainer resumes from the checkpoint, as a restart does); the
    count survives in quarantine.json; after the third failure the same learner trains the batch's halves as batches
    of their own: the group without the poison task trains, the poison task's group (a group estimator's unit: a
    batch never splits a group) goes to the dead letters, and everything else is trained once."""
    trajs = synthetic_trajectories(build_policy(tiny_model_config(), seed=0), 24, seed=5, group_size=2)
    poison = trajs[10].task_id  # group 5: the third batch holds groups 4 and 5 (trajectories 8 to 11)
    monkeypatch.setenv(FAULT_ENV, poison)
    path = write_trajectories(tmp_path / "t.jsonl", trajs, append=False)
    grpo = ["advantage.estimator=grpo", "advantage.group_size=2", "batch.poison_after=3"]
    batch3 = [f"{t.task_id}/{t.traj_id}" for t in trajs[8:12]]  # the group estimator's key: group/member
    trained: dict[int, list[str]] = {}
    for attempt in (1, 2):
        trainer, events = _trainer(tmp_path, path, *grpo)
        with pytest.raises(torch.OutOfMemoryError, match=f"injected by \\${FAULT_ENV}={poison}"):
            trainer.run()
        assert trainer.step == 2  # steps 1 and 2, then the third batch fails
        trained.update({e.step: e.task_ids for e in events})
        counts = json.loads((tmp_path / "ck" / FILE).read_text())
        assert {k: v["failures"] for k, v in counts.items()} == dict.fromkeys(batch3, attempt)
    trainer, events = _trainer(tmp_path, path, *grpo)
    assert trainer.run() == 4  # group 4 alone, then the three batches after it
    trained.update({e.step: e.task_ids for e in events})
    flat = [tid for step in sorted(trained) for tid in trained[step]]
    assert sorted(trained) == [1, 2, 3, 4, 5, 6] and trained[3] == [trajs[8].task_id] * 2
    assert sorted(flat) == sorted(t.task_id for t in trajs[:10] + trajs[12:])  # each one once
    assert trainer.source.dead_letters == 2 and trainer.counters["poison"] == 2
    assert events[-1].metrics["learner/count_poison"] == 2.0
    # group 4 trained: its failures are forgotten; group 5 stays poison (failed alone once more): a crash before
    # the next checkpoint must not train it either
    counts = json.loads((tmp_path / "ck" / FILE).read_text())
    assert sorted(counts) == batch3[2:]
    assert all(v["failures"] == 4 and v["error"] == f"OutOfMemoryError: injected by ${FAULT_ENV}={poison}"
               for v in counts.values())


@pytest.mark.kafka
@pytest.mark.slow  # two `sao learn` processes over the embedded broker
def test_sao_learn_dead_letters_a_batch_that_fails_twice_and_spends_one_restart(tmp_path, kafka_bus, kafka_run):
    """The real learner process under sao up's supervisor: the batch fails, the learner exits, the supervisor
    starts it again, the batch fails again; the learner halves it until the trajectory that fails alone is found,
    which goes to the dead-letter topic with its error; it trains the rest, each trajectory once, and ends with
    restarts to spare."""
    from streamer.launch.processes import Role, Supervisor
    from streamer.wire.schema import DeadLetter
    from streamer.wire.topics import Topics, partitions_by_topic

    kafka_bus.create_topics(partitions_by_topic(kafka_run))
    topics = Topics(kafka_run)
    trajs = synthetic_trajectories(build_policy(tiny_model_config(), seed=0), 24, seed=7, prefix="p")
    poison = trajs[9].task_id  # the third batch: trajectories 8 to 11
    prod = kafka_bus.producer()
    for t in trajs:
        prod.send(topics.trajectories, t, key=b"one-partition")  # batches come out the same after a restart
    prod.flush()
    ck = tmp_path / "ck"
    sup = Supervisor(tmp_path / "logs", env={FAULT_ENV: poison}, restarts=3)
    argv = ["learn", "--run", kafka_run, "--bootstrap", kafka_bus.bootstrap, "--checkpoint-dir", str(ck),
            "--max-steps", "7", *set_args(OVERRIDES)]
    role = sup.start(Role("learner", argv))
    deadline = time.monotonic() + 300
    while role.proc.poll() != 0 and not sup.failed() and time.monotonic() < deadline:
        sup.restart_dead()
        time.sleep(0.2)
    log = (tmp_path / "logs" / "learner.log").read_text()
    assert role.proc.poll() == 0 and role.restarts == 1, log[-3000:]
    assert "--- exited 1: restart 1 of 3 ---" in log and log.count(f"injected by ${FAULT_ENV}={poison}") >= 2

    steps, _ = effective_events(ck / "events.jsonl")
    # the failing batch (8 to 11) halved: [8, 9] fails, [8] trains as step 3, [9] fails alone; [10, 11] is step 4
    assert [e.task_ids for e in steps[2:4]] == [[trajs[8].task_id], [trajs[10].task_id, trajs[11].task_id]]
    assert [e.step for e in steps] == [1, 2, 3, 4, 5, 6, 7]
    trained = [tid for e in steps for tid in e.task_ids]
    assert sorted(trained) == sorted(t.task_id for t in trajs if t.task_id != poison)  # each one once
    dlq = kafka_bus.consumer({topics.dlq: DeadLetter}, group_id=None)
    letters: list[DeadLetter] = []
    for _ in range(10):
        letters += [m for m, _, _ in dlq.poll(max_records=50, timeout=0.5)]
    dlq.close()
    assert [(x.topic, x.offset, x.expected) for x in letters] == [(topics.trajectories, 9, "Trajectory")]
    assert letters[0].reason == f"poison batch: OutOfMemoryError: injected by ${FAULT_ENV}={poison}"
