"""The data plane for many agents (issue 46 item 3): `<run>.tasks` partitions from the agent count, topic
configuration at creation (replication factor, max.message.bytes), and the agent's producer-side size check."""

from __future__ import annotations

import logging

import pytest
from kafka.structs import TopicPartition

from streamer.transport.kafka_bus import KafkaBus, topic_configs
from streamer.transport.memory_bus import MemoryBus
from streamer.wire.config import ConfigError, load_config
from streamer.wire.schema import DeadLetter, Task, Trajectory, decode
from streamer.wire.settings import AgentSettings, ClientSettings, TopicSettings
from streamer.wire.topics import Topics, partitions_by_topic

MIB = 1024 * 1024


def test_task_partitions_are_never_fewer_than_agents():
    assert partitions_by_topic("r", agents=8) == {"r.tasks": 8, "r.trajectories": 1, "r.policy": 1, "r.learner": 1,
                                                  "r.metrics": 1, "r.drift": 1, "r.dlq": 1}
    assert partitions_by_topic("r", agents=2)["r.tasks"] == 4  # the floor, topics.tasks_partitions
    assert partitions_by_topic("r")["r.tasks"] == 4  # agent count unknown
    assert partitions_by_topic("r", TopicSettings(tasks_partitions=12), agents=8)["r.tasks"] == 12
    assert partitions_by_topic("r", agents=33)["r.trajectories"] == 1  # the learner's order: one partition


def test_sao_up_derives_the_task_partitions_every_role_reads():
    from streamer.launch.run_config import load_run_config

    assert load_run_config(launch={"agents": 8, "cores": 16}).agent.topics.tasks_partitions == 8
    assert load_run_config(launch={"agents": 2, "cores": 4}).agent.topics.tasks_partitions == 4
    cfg = load_run_config(overrides=["agent.topics.tasks_partitions=16", "agent.topics.replication_factor=3"],
                          launch={"agents": 8, "cores": 16})
    assert (cfg.agent.topics.tasks_partitions, cfg.agent.topics.replication_factor) == (16, 3)  # more: kept
    assert load_run_config(overrides=["agent.client.max_message_bytes=1048576"]).agent.client.max_message_bytes == MIB
    with pytest.raises(ConfigError, match="learner dead-letters"):  # its reader keeps the default 4 MiB
        load_run_config(overrides=["agent.client.max_message_bytes=8388608"])


def test_back_pressure_sums_the_lag_over_every_task_partition():
    """With one partition per agent (8), the simulator's bound still counts every unanswered task once."""
    from streamer.transport.backpressure import LagGate

    class Acked:  # a sent record whose metadata is in: partition p, offset o
        def __init__(self, p: int, o: int) -> None:
            self.topic, self.partition, self.offset = "r.tasks", p, o

        def add_callback(self, fn) -> None:
            fn(self)

        def add_errback(self, fn) -> None:
            pass

    committed = {TopicPartition("r.tasks", p): p % 4 for p in range(8)}  # 0,1,2,3,0,1,2,3 answered
    gate = LagGate(40, lambda tps: {tp: committed[tp] for tp in tps}, flush=lambda: None, topic="r.tasks")
    for p in range(8):
        for o in range(5):
            gate.track(Acked(p, o))
    assert gate.lag() == 40  # nothing read as committed yet
    assert gate.refresh() == 40 - (0 + 1 + 2 + 3) * 2 == 28


def test_topic_settings_are_checked():
    s = load_config(AgentSettings, None, ["topics.replication_factor=3", "client.max_message_bytes=1048576"])
    assert (s.topics.replication_factor, s.client.max_message_bytes) == (3, MIB)
    with pytest.raises(ConfigError, match="replication_factor"):
        load_config(AgentSettings, None, ["topics.replication_factor=0"])
    with pytest.raises(ConfigError, match="partition counts"):
        load_config(AgentSettings, None, ["topics.tasks_partitions=0"])


def test_topic_limits_and_the_producer_agree(monkeypatch):
    import kafka

    from streamer.transport.kafka_bus import KafkaProducerClient

    s = ClientSettings()  # 4 MiB values: 4 MiB + 64 KiB batches; the DLQ carries dead letters of up to 8 MiB
    assert topic_configs("r.trajectories", s) == {"max.message.bytes": str(4 * MIB + 65536)}  # 4259840
    assert topic_configs("r.dlq", s) == {"max.message.bytes": str(8 * MIB + 65536)}  # 8454144
    small = ClientSettings(max_message_bytes=1000)
    assert topic_configs("r.tasks", small) == {"max.message.bytes": "66536"}
    seen = {}
    monkeypatch.setattr(kafka, "KafkaProducer", lambda **cfg: seen.update(cfg))
    KafkaProducerClient("127.0.0.1:1", small)
    assert seen["max_request_size"] == 8 * MIB + 65536  # its largest record: a dead letter
    assert seen["batch_size"] == 66536  # a batch of small records stays under the topics' limit


# ----------------------------------------------------------------------------------------- oversized trajectories

def _tasks(run: str) -> list[Task]:
    """Short prompts, and one whose trajectory (prompt tokens, 11 bytes a token on the wire) is ~2 KB."""
    def mk(i: int, prompt: str) -> Task:
        return Task(task_id=f"{run}-t{i}", family="arith", concept="add7", prompt=prompt, answer="5",
                    spec={"op": "add", "mod": 7, "a": 6, "b": 6})

    return [mk(0, "6#6="), mk(1, "6#" * 90 + "6="), mk(2, "6#6=")]


def test_group_with_an_oversized_member_is_dead_lettered_whole(tiny_policy_dir):
    from learner.engines import make_engine
    from streamer.agent.agent import build_agent

    bus = MemoryBus(ClientSettings(max_message_bytes=1200))
    s = AgentSettings(run="g", max_new_tokens=4, idle_exit_s=0.01, group_size=2, client=bus.settings,
                      topics=TopicSettings(tasks_partitions=1))
    bus.create_topics(partitions_by_topic("g", s.topics))
    prod = bus.producer()
    for t in _tasks("g"):
        prod.send(Topics("g").tasks, t, key=t.task_id)
    engine = make_engine("torch", tiny_policy_dir)
    agent = build_agent(s, bus, engine, engine.tokenizer)
    stats = agent.run()
    trajs = [decode(v, Trajectory) for part in bus.logs["g.trajectories"] for _, v in part]
    letters = [decode(v, DeadLetter) for part in bus.logs["g.dlq"] for _, v in part]
    assert sorted(t.task_id for t in trajs) == ["g-t0", "g-t0", "g-t2", "g-t2"]  # no half group of g-t1
    assert (stats.tasks, stats.trajectories, stats.oversized) == (3, 4, 2)
    assert [lt.key for lt in letters] == [b"g-t1", b"g-t1"] and {lt.expected for lt in letters} == {"Trajectory"}
    assert agent.status()["oversized"] == 2
    assert bus.committed["g.agents"] == {TopicPartition("g.tasks", 0): 3}


@pytest.mark.kafka
def test_create_topics_sets_partitions_replication_and_max_message_bytes(kafka_broker, kafka_run):
    """CreateTopics carries the configuration; Tansu answers DescribeConfigs with it (it does not enforce it)."""
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType

    bus = KafkaBus(kafka_broker, ClientSettings(client_id="sao-test", max_message_bytes=100_000))
    t = Topics(kafka_run)
    assert sorted(bus.create_topics(partitions_by_topic(kafka_run, agents=6), replication_factor=1)) == sorted(t.all())
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    try:
        parts = {d["name"]: len(d["partitions"]) for d in admin.describe_topics(t.all())}
        got = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in (t.tasks, t.dlq)],
                                     config_filter="all")["topic"]
    finally:
        admin.close()
    assert parts == partitions_by_topic(kafka_run, agents=6) and parts[t.tasks] == 6
    assert got[t.tasks]["max.message.bytes"]["value"] == "165536"  # 100,000 + 64 KiB
    assert got[t.dlq]["max.message.bytes"]["value"] == str(8 * MIB + 65536)


@pytest.mark.kafka
def test_existing_task_topic_with_fewer_partitions_than_agents_is_reported(kafka_bus, kafka_run, caplog):
    """Tansu has no CreatePartitions: the topic keeps its count and a warning names the idle agents' cause."""
    from kafka import KafkaAdminClient

    tasks = Topics(kafka_run).tasks
    kafka_bus.create_topics({tasks: 2})
    with caplog.at_level(logging.WARNING, logger="streamer.transport.kafka_bus"):
        created = kafka_bus.create_topics(partitions_by_topic(kafka_run, agents=6))
    assert tasks not in created
    admin = KafkaAdminClient(bootstrap_servers=kafka_bus.bootstrap)
    try:
        n = len(admin.describe_topics([tasks])[0]["partitions"])
    finally:
        admin.close()
    if n == 6:  # a broker that adds partitions (Apache Kafka)
        assert "partitions added" in caplog.text
    else:
        assert n == 2 and f"{tasks}: 2 partitions, fewer than the 6 wanted" in caplog.text


@pytest.mark.kafka
def test_sao_topics_takes_the_agent_count_and_topic_settings(kafka_broker, kafka_run, capsys):
    from kafka import KafkaAdminClient

    from streamer.launch.topics import main

    assert main(["--bootstrap", kafka_broker, "--run", kafka_run, "--agents", "7",
                 "--set", "topics.replication_factor=1", "--set", "client.max_message_bytes=2000000"]) == 0
    assert f"{kafka_run}.tasks (7 partitions, created)" in capsys.readouterr().out
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    try:
        assert len(admin.describe_topics([Topics(kafka_run).tasks])[0]["partitions"]) == 7
    finally:
        admin.close()


@pytest.mark.kafka
def test_agent_dead_letters_an_oversized_trajectory_and_goes_on(kafka_broker, kafka_run, tiny_policy_dir):
    """A trajectory over the limit is not sent (the broker would refuse it and each agent in turn would fail the
    task): it goes to the DLQ with its size and task, the task is committed, the next task is answered."""
    from learner.engines import make_engine
    from streamer.agent.agent import build_agent
    from streamer.transport.backpressure import CommittedOffsets
    from streamer.transport.kafka_bus import read_topic

    client = ClientSettings(client_id="sao-test", max_message_bytes=1200, bootstrap=kafka_broker)
    s = AgentSettings(run=kafka_run, agent_id="big", max_new_tokens=4, max_tasks=3, idle_exit_s=30, client=client,
                      topics=TopicSettings(tasks_partitions=1))
    bus, t = KafkaBus(kafka_broker, client), Topics(kafka_run)
    bus.create_topics(partitions_by_topic(kafka_run, s.topics))
    prod = bus.producer()
    for task in _tasks(kafka_run):
        prod.send(t.tasks, task, key=task.task_id)
    prod.flush()
    prod.close()
    engine = make_engine("torch", tiny_policy_dir)
    agent = build_agent(s, bus, engine, engine.tokenizer)
    try:
        stats = agent.run()
    finally:
        agent.tasks.close()
        agent.follower.consumer.close()
        agent.producer.close()
    assert (stats.tasks, stats.trajectories, stats.oversized) == (3, 2, 1)
    trajs = [decode(v, Trajectory) for _, _, v in read_topic(kafka_broker, client, t.trajectories)]
    assert sorted(tr.task_id for tr in trajs) == [f"{kafka_run}-t0", f"{kafka_run}-t2"]
    letters = [decode(v, DeadLetter) for _, _, v in read_topic(kafka_broker, client, t.dlq)]
    assert len(letters) == 1
    lt = letters[0]
    assert lt.reason.startswith(f"trajectory of {lt.value_len} bytes over the topic's 1200-byte limit (task "
                                f"{kafka_run}-t1") and lt.value_len > 1200
    assert (lt.topic, lt.partition, lt.offset, lt.expected, lt.consumer) == (t.tasks, 0, 1, "Trajectory", "big")
    assert decode(lt.value, Trajectory).task_id == f"{kafka_run}-t1"  # the whole trajectory, for inspection
    committed = CommittedOffsets(kafka_broker, f"{kafka_run}.agents")
    try:
        assert committed([TopicPartition(t.tasks, 0)]) == {TopicPartition(t.tasks, 0): 3}  # not redelivered
    finally:
        committed.close()


# ----------------------------------------------------------------------------------------- skipped offsets

class _Rec:
    def __init__(self, offset: int) -> None:
        self.offset = offset


def test_gap_guard_fetches_a_skipped_offset_again_then_takes_a_lasting_gap_as_real():
    """Tansu answered a fetch at n with records from n+1 on (n not yet visible): the reader seeks back to n."""
    from streamer.transport.gaps import GapGuard

    now, seeks = [0.0], []
    guard = GapGuard(lambda tp, n: seeks.append((tp, n)), wait_s=10.0, clock=lambda: now[0])
    tp = TopicPartition("r.trajectories", 0)
    guard.expect(tp, 0)
    assert [r.offset for r in guard.admit(tp, [_Rec(0), _Rec(1), _Rec(3), _Rec(4)])] == [0, 1]  # 2 skipped
    assert seeks == [(tp, 2)] and guard.refetches == 1
    assert [r.offset for r in guard.admit(tp, [_Rec(2), _Rec(3), _Rec(4)])] == [2, 3, 4]  # fetched again: all
    assert guard.admit(tp, [_Rec(7)]) == [] and seeks[-1] == (tp, 5)
    now[0] = 10.5  # still missing after wait_s (Apache Kafka: compaction, retention): a real gap
    assert [r.offset for r in guard.admit(tp, [_Rec(7), _Rec(8)])] == [7, 8] and guard.accepted == 1
    other = TopicPartition("r.trajectories", 1)  # first records of a partition never sought: taken as they come
    assert [r.offset for r in guard.admit(other, [_Rec(40), _Rec(41)])] == [40, 41]
    guard.forget([tp])
    assert [r.offset for r in guard.admit(tp, [_Rec(100)])] == [100]  # revoked and assigned again: no expectation
