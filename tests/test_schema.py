import msgspec
import pytest

from streamer.wire.schema import (
    SCHEMA_VERSION,
    DriftEvent,
    SchemaError,
    Task,
    Trajectory,
    decode,
    decode_json,
    encode,
    encode_json,
)


def _traj(**kw):
    base = dict(traj_id="t1", task_id="k1", family="arith", concept="add", prompt_len=2,
                tokens=[1, 5, 6, 2], loss_mask=[0, 0, 1, 1], logprobs=[0.0, 0.0, -0.5, -0.1], reward=1.0)
    base.update(kw)
    return Trajectory(**base)


def test_round_trip_msgpack_and_json():
    t = _traj(reward_parts={"correct": 1.0}, policy_versions=[3, 4])
    assert decode(encode(t), Trajectory) == t
    assert decode_json(encode_json(t), Trajectory) == t


def test_bad_bytes_raise_schema_error():
    with pytest.raises(SchemaError, match="undecodable"):
        decode(b"\xc1\xff garbage", Task)


def test_wrong_field_type_names_the_field():
    raw = msgspec.msgpack.encode({"task_id": "x", "family": "arith", "concept": "add", "prompt": 5, "answer": "1"})
    with pytest.raises(SchemaError, match=r"\$\.prompt"):
        decode(raw, Task)


def test_missing_field_names_the_field():
    raw = msgspec.json.encode({"task_id": "x", "family": "arith", "concept": "add", "answer": "1"})
    with pytest.raises(SchemaError, match="prompt"):
        decode_json(raw, Task)


def test_wrong_schema_version_refused():
    t = Task(task_id="x", family="arith", concept="add", prompt="1+1=", answer="2", v=SCHEMA_VERSION + 1)
    with pytest.raises(SchemaError, match=r"Task\.v: schema version"):
        decode(encode(t), Task)


def test_inconsistent_trajectory_lengths_refused():
    with pytest.raises(SchemaError, match="Trajectory.logprobs"):
        decode(encode(_traj(logprobs=[0.0])), Trajectory)


def test_drift_event_round_trip():
    e = DriftEvent(phase=1, prev_phase=0, name="b", schedule="abrupt", families=["arith"],
                   concepts={"arith": "sub"}, at_seq=100)
    assert decode(encode(e), DriftEvent) == e
