"""Messages that decode but lie (issue 50 item 3): each lie is forged on a real topic of the embedded broker and must
reach the dead-letter topic with a reason naming its field, be counted, never reach the learner's buffer, a
checkpoint or the metrics, while every valid message around it is processed."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from learner.config import LearnerConfig
from learner.models.policy import build_policy
from learner.train import build_models
from learner.trainer.checkpoint import latest_checkpoint
from learner.trainer.loop import Trainer
from learner.trainer.publish import DirectoryPublisher
from learner.trainer.source import BusSource
from learner.trainer.synthetic import TINY_OVERRIDES, synthetic_trajectories, tiny_model_config
from streamer.wire.config import load_config
from streamer.wire.schema import (
    DeadLetter,
    LearnerEvent,
    MetricPoint,
    SchemaError,
    Task,
    Trajectory,
    decode,
    encode,
    to_dict,
)
from streamer.wire.topics import Topics, partitions_by_topic

ROOT = Path(__file__).resolve().parents[1]
FUTURE = 10**15

# name -> (the field at fault: a whole value, or one position of a per-token list, the lie, the text its dead letter's
# reason must hold; {i} is that position)
LIES = {
    "reward_1e39": ("reward", 1e39, "Trajectory.reward: 1e+39 outside +-1e+06"),
    "reward_nan": ("reward", math.nan, "Trajectory.reward: non-finite nan"),
    "mask_1e6": ("loss_mask[]", 1_000_000, "Trajectory.loss_mask[{i}]: 1000000 is not 0 or 1"),
    "mask_half": ("loss_mask[]", 0.5, "Expected `int`, got `float` - at `$.loss_mask[{i}]`"),
    "logprob_positive": ("logprobs[]", 0.5, "Trajectory.logprobs[{i}]: 0.5 is not a finite log-probability (<= 0)"),
    "temperature_1e-30": ("temperature", 1e-30, "Trajectory.temperature: 1e-30 outside 0.01..100 (<= 0: greedy)"),
    "group_1e9": ("group_size", 10**9, "Trajectory.group_size: 1000000000 outside 1..1024"),
}


def forge(good: Trajectory, name: str, field: str, lie, want: str) -> tuple[str, bytes, str]:
    """(task id, the forged message's bytes, the reason expected): a valid trajectory with one field lying, encoded
    from a plain dict (msgspec would not build some of these structs)."""
    d = to_dict(good)
    d.update(task_id=name, traj_id=name)
    i = d["prompt_len"]  # the first generated token
    if field.endswith("[]"):
        d[field[:-2]][i] = lie
    else:
        d[field] = lie
    return name, msgspec.msgpack.encode(d), want.format(i=i)


def all_lies(good: Trajectory) -> list[tuple[str, bytes, str]]:
    return [forge(good, name, *spec) for name, spec in LIES.items()]


def reasons_by_task(letters: list[DeadLetter]) -> dict[str, str]:
    """Each letter's reason by the task id in its bytes (the admission's letters carry no record key)."""
    return {msgspec.msgpack.decode(x.value)["task_id"]: x.reason for x in letters}


def read_letters(bus, dlq: str, n: int, timeout_s: float = 20.0) -> list[DeadLetter]:
    cons = bus.consumer({dlq: DeadLetter}, group_id=None)
    letters: list[DeadLetter] = []
    deadline = time.monotonic() + timeout_s
    while len(letters) < n and time.monotonic() < deadline:
        letters += [m for m, _, _ in cons.poll(max_records=100, timeout=0.5)]
    time.sleep(0.5)
    letters += [m for m, _, _ in cons.poll(max_records=100, timeout=0.5)]  # and nothing more
    cons.close()
    return letters


def test_each_lie_is_refused_at_decoding_with_its_field():
    good = synthetic_trajectories(build_policy(tiny_model_config(), seed=0), 1)[0]
    assert decode(encode(good), Trajectory) == good
    for name, raw, want in all_lies(good):
        with pytest.raises(SchemaError) as e:
            decode(raw, Trajectory)
        assert want in str(e.value), name
    greedy = msgspec.structs.replace(good, temperature=0.0)  # greedy is no lie: the learner drops it as 'greedy'
    assert decode(encode(greedy), Trajectory).temperature == 0.0
    older = msgspec.structs.replace(good, policy_version=2, policy_versions=[1, 2])  # would look fresher
    with pytest.raises(SchemaError, match=r"Trajectory.policy_version: 2 is newer than the oldest of policy_versions"):
        decode(encode(older), Trajectory)
    for cls, fields, want in ((LearnerEvent, dict(step=3, version=-1, time=1.0, n_trajectories=0, n_tokens=0),
                               "LearnerEvent.version: -1 < 0"),
                              (Task, dict(task_id="", family="arith", concept="add", prompt="1+1=", answer="2"),
                               "Task.task_id: empty"),
                              (MetricPoint, dict(name="metrics/reward", value=math.inf, time=1.0),
                               "MetricPoint.value: non-finite inf")):
        with pytest.raises(SchemaError, match=want):
            decode(msgspec.msgpack.encode(fields), cls)


@pytest.mark.kafka
def test_the_learner_dead_letters_every_lie_and_trains_every_valid_trajectory(tmp_path, kafka_bus, kafka_run):
    kafka_bus.create_topics(partitions_by_topic(kafka_run))
    topics = Topics(kafka_run)
    policy = build_policy(tiny_model_config(), seed=0)
    vocab = policy.config.vocab_size
    good = synthetic_trajectories(policy, 8, seed=1)
    lies = all_lies(good[0])
    future = msgspec.structs.replace(good[1], policy_versions=[FUTURE])
    lies.append(forge(future, "future_version", "policy_version", FUTURE, f"Trajectory.policy_version: {FUTURE} is "
                      "newer than the newest version this learner published"))
    oov = msgspec.structs.replace(good[2], task_id="out_of_vocab", traj_id="out_of_vocab",
                                  tokens=good[2].tokens[:-1] + [vocab + 5])
    lies.append(("out_of_vocab", encode(oov), f"Trajectory.tokens[{len(oov.tokens) - 1}]: id {vocab + 5} outside "
                 f"the vocabulary 0..{vocab - 1}"))
    prod = kafka_bus.producer()
    for t, (name, raw, _) in zip(good, lies):  # each lie between two valid trajectories
        prod.send(topics.trajectories, t, key=t.task_id)
        prod.send_raw(topics.trajectories, raw, name.encode())
    for name, raw, _ in lies[len(good):]:
        prod.send_raw(topics.trajectories, raw, name.encode())
    prod.flush()

    cfg = load_config(LearnerConfig, None, TINY_OVERRIDES + [
        f"checkpoint.dir={tmp_path / 'ck'}", "batch.max_trajectories=4", "batch.tokens=100000",
        "batch.max_staleness=100", "value.warmup_steps=0", "checkpoint.every=1"])
    trained, events = [], []

    def sink(e: LearnerEvent) -> None:
        events.append(e)
        trained.extend(e.task_ids)
        trainer.stop = len(trained) >= len(good)

    source = BusSource(kafka_bus.consumer({topics.trajectories: Trajectory}, group_id=None, dlq=topics.dlq))
    trainer = Trainer(cfg, build_models(cfg), source, DirectoryPublisher(tmp_path / "w"), [sink])
    try:
        trainer.run()
    finally:
        source.close()
    assert sorted(trained) == sorted(t.task_id for t in good)  # every valid one, once
    pending = (latest_checkpoint(tmp_path / "ck") / "pending.jsonl").read_text()
    assert not any(f'"{name}"' in pending for name, _, _ in lies)
    assert events[-1].metrics["learner/dead_letters"] == len(lies)  # counted
    assert trainer.admission.counts["invalid"] == 2  # the future version and the token id: the rest never decoded

    letters = read_letters(kafka_bus, topics.dlq, len(lies))
    assert len(letters) == len(lies) and all(x.expected == "Trajectory" and x.consumer == "sao-test" for x in letters)
    reasons = reasons_by_task(letters)
    for name, _, want in lies:
        assert want in reasons[name], (name, reasons.get(name))


def start_metrics(bootstrap: str, run: str, log: Path) -> subprocess.Popen:
    # commits every 600 s: a SIGKILL leaves every record uncommitted, so the restarted app reads them all again
    return subprocess.Popen([sys.executable, "-m", "streamer.launch.cli", "metrics", "--bootstrap", bootstrap, "--run",
                             run, "--window", "10", "--set", "lateness_s=0", "--set", "idle_flush_s=1",
                             "--set", "commit_interval_s=600", "--set", "loglevel=INFO"],
                            cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def read_points(bus, topic: str, until, timeout_s: float) -> list[MetricPoint]:
    cons = bus.consumer({topic: MetricPoint})
    got: list[MetricPoint] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until(got):
        got += [m for m, _, _ in cons.poll(max_records=1000, timeout=0.5)]
    cons.close()
    return got


def window_total(points: list[MetricPoint]) -> tuple[int, float]:
    """(trajectories, reward sum) over the closed windows' unlabelled points."""
    rewards = [p for p in points if p.name == "metrics/reward" and not p.labels]
    return sum(p.count for p in rewards), sum(p.value * p.count for p in rewards)


@pytest.mark.kafka
@pytest.mark.slow
def test_the_metrics_app_dead_letters_every_lie_once_even_after_a_restart(tmp_path, kafka_bus, kafka_run):
    """The lies reach the DLQ (consumer metrics-app) naming their field, are counted in metrics/dlq and never enter
    a window; the app SIGKILLed before committing reads them all again when restarted and sends no letter twice
    (it sent every one again before: it never read its own letters)."""
    kafka_bus.create_topics(partitions_by_topic(kafka_run))
    topics = Topics(kafka_run)
    now = time.time()
    good = [msgspec.structs.replace(t, finished_at=now - 100) for t in  # one window, closed by the idle flush
            synthetic_trajectories(build_policy(tiny_model_config(), seed=0), 6, seed=2)]
    lies = all_lies(good[0])
    bad_event = msgspec.msgpack.encode(dict(step=1, version=2, time=now, n_trajectories=-3, n_tokens=0))
    prod = kafka_bus.producer()
    for i, t in enumerate(good):
        prod.send(topics.trajectories, t, key=t.task_id)
        for name, raw, _ in lies[i::len(good)]:
            prod.send_raw(topics.trajectories, raw, name.encode())
    prod.send_raw(topics.learner, bad_event, b"event")
    prod.flush()
    n_bad = len(lies) + 1
    log = tmp_path / "metrics.log"

    def counted(points):
        return window_total(points)[0] >= len(good) and any(p.name == "metrics/dlq" and p.value == n_bad
                                                            for p in points)

    proc = start_metrics(kafka_bus.bootstrap, kafka_run, log)
    try:
        first = read_points(kafka_bus, topics.metrics, counted, 90)
        letters = read_letters(kafka_bus, topics.dlq, n_bad)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert counted(first), log.read_text()[-3000:]
    n, reward_sum = window_total(first)
    assert n == len(good) and reward_sum == pytest.approx(sum(t.reward for t in good))  # no lie in a window
    assert len(letters) == n_bad and all(x.consumer == "metrics-app" for x in letters)
    by_key = {x.key: x.reason for x in letters}
    for name, _, want in lies:
        assert want in by_key[name.encode()], name
    assert by_key[b"event"] == "LearnerEvent.n_trajectories: -3 < 0"

    proc = start_metrics(kafka_bus.bootstrap, kafka_run, log)  # the same group, nothing committed: all read again
    try:
        again = read_points(kafka_bus, topics.metrics, lambda g: window_total(g)[0] >= 2 * len(good), 90)
        letters_after = read_letters(kafka_bus, topics.dlq, n_bad + 1, timeout_s=5)
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
    assert rc == 0, log.read_text()[-3000:]
    assert window_total(again)[0] == 2 * len(good), "the restarted app did not read the topic again"
    assert len(letters_after) == n_bad  # not one letter sent again
    assert not [p for p in again if p.name == "metrics/dlq" and p.value > n_bad]  # nor counted again


@pytest.mark.kafka
@pytest.mark.slow
def test_an_agent_dead_letters_lying_tasks_at_intake_and_answers_the_rest(kafka_bus, kafka_run, tiny_policy_dir):
    from kafka_fixtures import scenario_tasks

    from learner.engines import make_engine
    from streamer.agent.agent import build_agent
    from streamer.wire.settings import AgentSettings

    topics = Topics(kafka_run)
    kafka_bus.create_topics(partitions_by_topic(kafka_run))
    tasks = scenario_tasks(4)
    lying = {"empty_id": (dict(task_id=""), "Task.task_id: empty"),
             "nan_time": (dict(created_at=math.nan), "Task.created_at: non-finite nan"),
             "negative_seq": (dict(seq=-7), "Task.seq: -7 < 0")}
    prod = kafka_bus.producer()
    for t, (key, (changes, _)) in zip(tasks, lying.items()):
        prod.send(topics.tasks, t, key=t.task_id)
        prod.send_raw(topics.tasks, msgspec.msgpack.encode({**to_dict(t), **changes}), key.encode())
    prod.send(topics.tasks, tasks[-1], key=tasks[-1].task_id)
    prod.flush()
    engine = make_engine("torch", tiny_policy_dir)
    s = AgentSettings(run=kafka_run, max_new_tokens=4, idle_exit_s=6)  # runs until the topic is quiet
    stats = build_agent(s, kafka_bus, engine, engine.tokenizer).run()
    assert stats.tasks == len(tasks)
    trajs = kafka_bus.consumer({topics.trajectories: Trajectory}, group_id=None)
    got: list[Trajectory] = []
    for _ in range(20):
        got += [m for m, _, _ in trajs.poll(max_records=100, timeout=0.5)]
        if len(got) >= len(tasks):
            break
    trajs.close()
    assert sorted(t.task_id for t in got) == sorted(t.task_id for t in tasks)
    letters = read_letters(kafka_bus, topics.dlq, len(lying))
    reasons = {x.key: x.reason for x in letters}
    assert len(letters) == len(lying) and all(want in reasons[k.encode()] for k, (_, want) in lying.items())
    assert all(x.expected == "Task" and x.consumer == f"{kafka_run}.agents" for x in letters)
