"""Wire schema: every message on every topic, as msgspec structs with a schema version.

A leaf module: it imports nothing from the project, and every package may import it.
Encode with `encode(msg)` (msgpack) or `encode_json(msg)`; decode with `decode(data, Type)`,
which raises `SchemaError` naming the message type and the field at fault.

Versioning: `v` changes only for an incompatible change (a field removed, renamed or retyped, or a
new field without a default). A new field with a default keeps `v`: older messages decode with the
default, and older readers ignore the field (`forbid_unknown_fields=False`). E.g.
`Trajectory.temperature` (default 1.0, what every agent sampled at before the field existed).
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

import msgspec

SCHEMA_VERSION = 1


class SchemaError(ValueError):
    """Bytes that are not a valid message of the expected type (the text names the field)."""


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    v: int = SCHEMA_VERSION  # schema version; decode() refuses any other


class Task(Message, kw_only=True):
    task_id: str
    family: str  # "arith", "tool", "format", "string"
    concept: str  # the concept that is rewarded for this task
    phase: int = 0  # index of the scenario phase that produced it
    prompt: str
    answer: str  # reference answer (what the verifier accepts, before any wrapper)
    spec: dict[str, Any] = {}  # family-specific parameters the environment and verifier need
    seq: int = 0  # position in the task stream
    created_at: float = 0.0


class Trajectory(Message, kw_only=True):
    traj_id: str
    task_id: str
    family: str
    concept: str
    phase: int = 0
    group_id: str = ""  # task id shared by the n members of a GRPO-family group
    group_size: int = 1
    prompt_len: int  # tokens[:prompt_len] is the prompt
    tokens: list[int]  # prompt + generated tokens + environment observations, in order
    loss_mask: list[int]  # 1 where the policy generated the token (trained on), 0 elsewhere
    logprobs: list[float]  # behaviour log-prob of each token (0.0 where loss_mask is 0)
    temperature: float = 1.0  # sampling temperature of the logprobs (the learner scores at it); <= 0: greedy
    reward: float
    reward_parts: dict[str, float] = {}
    success: bool = False
    policy_version: int = 0  # the oldest version that generated a token (staleness uses it)
    policy_versions: list[int] = []  # every version that generated tokens, in order
    n_turns: int = 1
    n_tool_calls: int = 0
    agent_id: str = ""
    created_at: float = 0.0  # when the task was created
    started_at: float = 0.0
    finished_at: float = 0.0
    gen_seconds: float = 0.0  # time spent generating
    env_seconds: float = 0.0  # time spent in the environment (tool latency)

    def validate(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "logprobs"):
            if len(getattr(self, name)) != n:
                raise SchemaError(f"Trajectory.{name}: length {len(getattr(self, name))} != len(tokens) {n}")
        if not 0 < self.prompt_len <= n:
            raise SchemaError(f"Trajectory.prompt_len: {self.prompt_len} outside 1..{n}")


class PolicyVersion(Message, kw_only=True):
    version: int
    uri: str  # where the safetensors checkpoint lies (a directory in the weight store)
    sha256: str  # of the model.safetensors file
    step: int  # learner step that produced it
    created_at: float = 0.0
    # broadcast transport: sha256 of the tensors as sent (streamer.transport.weight_group.tensors_digest); "" otherwise
    tensors_sha256: str = ""
    sig: str = ""  # HMAC-SHA256 of the fields above with the run's key (streamer.transport.signing); "" unsigned


class LearnerEvent(Message, kw_only=True):
    step: int
    version: int  # policy version after this step
    time: float
    n_trajectories: int
    n_tokens: int
    metrics: dict[str, float] = {}  # namespaced: "learner/...", "perf/..."
    staleness: dict[str, int] = {}  # staleness (as a string) -> count of trajectories
    task_ids: list[str] = []  # the tasks trained on in this step
    skipped: bool = False  # non-finite loss or gradient: the update was not applied


class DriftEvent(Message, kw_only=True):
    phase: int  # the phase that starts
    prev_phase: int
    name: str  # the phase's name
    schedule: str  # "abrupt", "gradual", "recurring", "incremental"
    families: list[str]
    concepts: dict[str, str]  # family -> concept rewarded in the new phase
    prev_concepts: dict[str, str] = {}
    at_seq: int  # task sequence number at which the phase starts
    time: float = 0.0


class MetricPoint(Message, kw_only=True):
    name: str  # namespaced, e.g. "metrics/reward"
    value: float
    time: float  # wall-clock end of the window
    labels: dict[str, str] = {}  # e.g. {"family": "arith", "concept": "add"}
    window: float = 0.0  # window length in seconds
    count: int = 0  # observations in the window
    trajectories: int = 0  # trajectories seen so far (x-axis)
    learner_step: int = 0  # latest learner step seen (x-axis)


class DeadLetter(Message, kw_only=True):
    """A message a consumer could not use, with the reason and the original bytes."""

    topic: str
    partition: int
    offset: int
    key: bytes | None = None
    value: bytes  # the original bytes (cut to streamer.transport.bus.DLQ_MAX_VALUE_BYTES)
    value_len: int  # length of the original value
    reason: str  # "oversized: ...", or the SchemaError text naming the field
    expected: str  # the message type the consumer expected
    consumer: str = ""  # group id / client id of the consumer that gave up on it
    time: float = 0.0


M = TypeVar("M", bound=Message)

_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_decoders: dict[tuple[type, str], Any] = {}


def encode(msg: Message) -> bytes:
    return _msgpack_encoder.encode(msg)


def encode_json(msg: Message) -> bytes:
    return _json_encoder.encode(msg)


def _decoder(cls: type, fmt: str):
    key = (cls, fmt)
    if key not in _decoders:
        mod = msgspec.msgpack if fmt == "msgpack" else msgspec.json
        _decoders[key] = mod.Decoder(cls)
    return _decoders[key]


def decode(data: bytes, cls: type[M], fmt: str = "msgpack") -> M:
    """Decode one message of type `cls`; any defect raises SchemaError naming the field."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError(f"{cls.__name__}: expected bytes, got {type(data).__name__}")
    try:
        msg = _decoder(cls, fmt).decode(data)
    except msgspec.ValidationError as e:
        # msgspec's text ends with "- at `$.field`"
        raise SchemaError(f"{cls.__name__}: {e}") from None
    except msgspec.DecodeError as e:
        raise SchemaError(f"{cls.__name__}: undecodable {fmt}: {e}") from None
    if msg.v != SCHEMA_VERSION:
        raise SchemaError(f"{cls.__name__}.v: schema version {msg.v}, this build reads {SCHEMA_VERSION}")
    if isinstance(msg, Trajectory):
        msg.validate()
    return msg


def decode_json(data: bytes, cls: type[M]) -> M:
    return decode(data, cls, fmt="json")


def to_dict(msg: Message) -> dict[str, Any]:
    return msgspec.to_builtins(msg)


def from_dict(d: dict[str, Any], cls: type[M]) -> M:
    try:
        msg = msgspec.convert(d, cls)
    except msgspec.ValidationError as e:
        raise SchemaError(f"{cls.__name__}: {e}") from None
    if msg.v != SCHEMA_VERSION:
        raise SchemaError(f"{cls.__name__}.v: schema version {msg.v}, this build reads {SCHEMA_VERSION}")
    return msg


def now() -> float:
    return time.time()
