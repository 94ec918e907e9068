"""The transport: decoding, dead letters, manual commits; in memory and against the embedded broker."""

from __future__ import annotations

import time

import msgspec
import pytest
from kafka.structs import TopicPartition

from streamer.transport.memory_bus import MemoryBus
from streamer.wire.schema import SCHEMA_VERSION, DeadLetter, Task, Trajectory, decode
from streamer.wire.settings import ClientSettings
from streamer.wire.topics import TYPES, Topics, kind_of, partitions_by_topic, topic


def _task(i: int) -> Task:
    return Task(task_id=f"t{i}", family="arith", concept="add", prompt=f"{i}+1=", answer=str(i + 1), seq=i)


def _bad_payloads(max_bytes: int, good=None) -> dict[str, bytes]:
    good = _task(0) if good is None else good
    wrong_version = msgspec.msgpack.encode({**msgspec.to_builtins(good), "v": SCHEMA_VERSION + 1})
    return {"undecodable": b"\xc1\xff not msgpack", "wrong_version": wrong_version,
            "oversized": b"\x00" * (max_bytes + 1)}


def _drain(consumer, want: int, timeout_s: float = 20.0) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += consumer.poll(100, 0.2)
    return got


# ------------------------------------------------------------------ topic names

def test_topic_names_are_run_prefixed_and_checked():
    t = Topics("exp1")
    assert t.tasks == "exp1.tasks" and t.dlq == "exp1.dlq" and len(t.all()) == 7
    assert kind_of("exp1.trajectories") == "trajectories"
    assert partitions_by_topic("exp1")["exp1.tasks"] == 4
    with pytest.raises(ValueError, match="no dots"):
        topic("a.b", "tasks")
    with pytest.raises(ValueError, match="expected one of"):
        topic("a", "nope")


# ------------------------------------------------------------------ in memory

def test_memory_bus_roundtrip_dlq_and_commit_past_trailing_dead_letters():
    bus = MemoryBus(ClientSettings(max_message_bytes=1000))
    bus.create_topics({"r.tasks": 1})
    prod = bus.producer()
    prod.send("r.tasks", _task(0), key="t0")
    for value in _bad_payloads(1000).values():
        prod.send_raw("r.tasks", value)
    cons = bus.consumer({"r.tasks": Task}, group_id="g", dlq="r.dlq")
    got = cons.poll(10, 0)
    assert [p.msg.task_id for p in got] == ["t0"] and got[0].offset == 0
    assert cons.dead_letters == 3
    assert cons.dead_by_reason == {"undecodable": 1, "schema_version": 1, "oversized": 1}
    letters = [decode(v, DeadLetter) for _, v in bus.logs["r.dlq"][0]]
    assert [d.offset for d in letters] == [1, 2, 3]
    assert "schema version 2" in letters[1].reason and letters[2].value_len == 1001
    assert letters[0].value == b"\xc1\xff not msgpack"
    # committing the valid record (next offset 1) also covers the dead letters behind it: 4
    assert cons.commit({got[0].tp: 1})
    assert bus.committed["g"][TopicPartition("r.tasks", 0)] == 4


def test_memory_commit_never_skips_records_handed_out_but_unprocessed():
    bus = MemoryBus()
    bus.create_topics({"r.tasks": 1})
    prod = bus.producer()
    for i in range(3):
        prod.send("r.tasks", _task(i))
    cons = bus.consumer({"r.tasks": Task}, group_id="g")
    got = cons.poll(10, 0)
    cons.commit({got[0].tp: 1})  # only t0 done; t1, t2 still pending
    assert bus.committed["g"][got[0].tp] == 1
    cons.close()
    again = bus.consumer({"r.tasks": Task}, group_id="g")  # a restarted agent resumes at t1
    assert [p.msg.task_id for p in again.poll(10, 0)] == ["t1", "t2"]


def test_memory_group_splits_partitions_and_seek_rewinds():
    bus = MemoryBus()
    bus.create_topics({"r.tasks": 4})
    prod = bus.producer()
    for i in range(40):
        prod.send("r.tasks", _task(i), key=f"t{i}")
    a = bus.consumer({"r.tasks": Task}, group_id="g")
    b = bus.consumer({"r.tasks": Task}, group_id="g")
    assert a.assignment().isdisjoint(b.assignment()) and len(a.assignment() | b.assignment()) == 4
    ids_a = {p.msg.task_id for p in a.poll(100, 0)}
    ids_b = {p.msg.task_id for p in b.poll(100, 0)}
    assert ids_a | ids_b == {f"t{i}" for i in range(40)} and not ids_a & ids_b
    tp = min(a.assignment())
    a.seek({tp: 0})
    assert {p.tp for p in a.poll(100, 0)} == {tp}


# ------------------------------------------------------------------ embedded broker

@pytest.mark.kafka
@pytest.mark.parametrize("kind", ["tasks", "trajectories", "policy", "learner"])
def test_bad_messages_on_each_consumed_topic_land_in_the_dlq(kafka_run, bootstrap, kind):
    from streamer.transport.kafka_bus import KafkaBus

    settings = ClientSettings(max_message_bytes=64 * 1024, client_id="sao-test")
    bus = KafkaBus(bootstrap, settings)
    t = Topics(kafka_run)
    src = topic(kafka_run, kind)
    bus.create_topics({src: 1, t.dlq: 1})
    prod = bus.producer()
    good = {"tasks": _task(1), "trajectories": Trajectory(
        traj_id="x", task_id="t1", family="arith", concept="add", prompt_len=1, tokens=[5, 6],
        loss_mask=[0, 1], logprobs=[0.0, -0.5], reward=1.0)}.get(kind)
    if good is None:  # policy / learner: a minimal valid message of the topic's type
        good = msgspec.convert({"version": 1, "uri": "u", "sha256": "s", "step": 1, "time": 0.0,
                                "n_trajectories": 0, "n_tokens": 0}, TYPES[kind], strict=False)
    bad = _bad_payloads(settings.max_message_bytes, good)
    for value in bad.values():
        prod.send_raw(src, value, key=b"k")
    prod.send(src, good, key="k")  # the pipeline goes on after the bad ones
    prod.flush()
    cons = bus.consumer({src: TYPES[kind]}, group_id=f"{kafka_run}.g", dlq=t.dlq)
    got = _drain(cons, 1)
    assert len(got) == 1 and type(got[0].msg) is TYPES[kind] and got[0].offset == 3
    assert cons.dead_by_reason == {"undecodable": 1, "schema_version": 1, "oversized": 1}
    assert cons.commit({got[0].tp: got[0].offset + 1})
    cons.close()
    tap = bus.consumer({t.dlq: DeadLetter})
    letters = [p.msg for p in _drain(tap, 3)]
    tap.close()
    assert sorted(d.offset for d in letters) == [0, 1, 2]
    by_offset = {d.offset: d for d in letters}
    assert by_offset[0].value == bad["undecodable"] and "undecodable" in by_offset[0].reason
    assert "schema version" in by_offset[1].reason
    assert by_offset[2].reason.startswith("oversized") and by_offset[2].value_len == 64 * 1024 + 1
    assert all(d.topic == src and d.expected == TYPES[kind].__name__ for d in letters)
