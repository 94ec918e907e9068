"""Wire schema: every message on every topic, as msgspec structs with a schema version.

A leaf module: it imports nothing from the project, and every package may import it.
Encode with `encode(msg)` (msgpack) or `encode_json(msg)`; decode with `decode(data, Type)`,
which raises `SchemaError` naming the message type and the field at fault. Decoding checks meaning too,
not only shape (each type's `validate`, against `Limits`): a message that decodes but lies (a reward of 1e39, a
loss mask of 5, a log-prob above 0, a temperature of 1e-30, a group of 1e9, a negative version) is refused
there, so every consumer dead-letters it the way it does undecodable bytes.

Versioning: `v` changes only for an incompatible change (a field removed, renamed or retyped, or a
new field without a default). A new field with a default keeps `v`: older messages decode with the
default, and older readers ignore the field (`forbid_unknown_fields=False`). E.g.
`Trajectory.temperature` (default 1.0, what every agent sampled at before the field existed).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

SCHEMA_VERSION = 1


class SchemaError(ValueError):
    """Bytes that are not a valid message of the expected type (the text names the field)."""


@dataclass(frozen=True)
class Limits:
    """What a message may claim beyond its shape: bounds no run of this project comes near, so a value past one is a
    lie (forged, or a bug upstream), refused by `decode` at every consumer. A consumer that knows more (the learner:
    its vocabulary, positions and newest published version) checks that on top (learner.trainer.staleness)."""

    max_abs_reward: float = 1e6  # verifiers give [-1, 1]; 1e39 is inf in float32 and poisons a batch's advantages
    min_temperature: float = 1e-2  # positive temperatures below it blow up logits / T (<= 0 is greedy, not a lie)
    max_temperature: float = 100.0
    max_group_size: int = 1024  # a group of 1e9 never completes and sits in the learner's buffer forever
    logprob_slack: float = 1e-5  # rounding an engine may leave above log(1) = 0


LIMITS = Limits()


def _finite(where: str, x: float) -> None:
    if not math.isfinite(x):
        raise SchemaError(f"{where}: non-finite {x}")


def _at_least(where: str, x: int | float, low: int | float) -> None:
    if not x >= low:
        raise SchemaError(f"{where}: {x} < {low}")


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    v: int = SCHEMA_VERSION  # schema version; decode() refuses any other

    def validate(self) -> None:
        """Meaning beyond shape (finite, in range, consistent); raises SchemaError naming the field."""


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

    def validate(self) -> None:
        if not self.task_id:
            raise SchemaError("Task.task_id: empty (it keys de-duplication and the agents' commits)")
        _at_least("Task.seq", self.seq, 0)
        _at_least("Task.phase", self.phase, 0)
        _finite("Task.created_at", self.created_at)


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

    def validate(self, limits: Limits = LIMITS) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "logprobs"):
            if len(getattr(self, name)) != n:
                raise SchemaError(f"Trajectory.{name}: length {len(getattr(self, name))} != len(tokens) {n}")
        if not 0 < self.prompt_len <= n:
            raise SchemaError(f"Trajectory.prompt_len: {self.prompt_len} outside 1..{n}")
        self._check_reward(limits)
        self._check_tokens(limits)
        self._check_sampling(limits)
        self._check_counts()

    def _check_reward(self, limits: Limits) -> None:
        for where, x in [("reward", self.reward), *((f"reward_parts[{k!r}]", v) for k, v in self.reward_parts.items())]:
            _finite(f"Trajectory.{where}", x)
            if abs(x) > limits.max_abs_reward:
                raise SchemaError(f"Trajectory.{where}: {x:g} outside +-{limits.max_abs_reward:g}")

    def _check_tokens(self, limits: Limits) -> None:
        bad = next((i for i, m in enumerate(self.loss_mask) if m not in (0, 1)), None)
        if bad is not None:
            raise SchemaError(f"Trajectory.loss_mask[{bad}]: {self.loss_mask[bad]} is not 0 or 1")
        bad = next((i for i, x in enumerate(self.tokens) if x < 0), None)
        if bad is not None:
            raise SchemaError(f"Trajectory.tokens[{bad}]: negative id {self.tokens[bad]}")
        bad = next((i for i, x in enumerate(self.logprobs) if not -math.inf < x <= limits.logprob_slack), None)
        if bad is not None:
            raise SchemaError(f"Trajectory.logprobs[{bad}]: {self.logprobs[bad]} is not a finite log-probability "
                              "(<= 0)")

    def _check_sampling(self, limits: Limits) -> None:
        _finite("Trajectory.temperature", self.temperature)
        if 0 < self.temperature < limits.min_temperature or self.temperature > limits.max_temperature:
            raise SchemaError(f"Trajectory.temperature: {self.temperature:g} outside {limits.min_temperature:g}.."
                              f"{limits.max_temperature:g} (<= 0: greedy)")
        if not 1 <= self.group_size <= limits.max_group_size:
            raise SchemaError(f"Trajectory.group_size: {self.group_size} outside 1..{limits.max_group_size}")
        _at_least("Trajectory.policy_version", self.policy_version, 0)
        if self.policy_versions and self.policy_version > min(self.policy_versions):  # would look fresher than it is
            raise SchemaError(f"Trajectory.policy_version: {self.policy_version} is newer than the oldest of "
                              f"policy_versions {sorted(self.policy_versions)[:8]}")

    def _check_counts(self) -> None:
        for name in ("phase", "n_turns", "n_tool_calls"):
            _at_least(f"Trajectory.{name}", getattr(self, name), 0)
        for name in ("created_at", "started_at", "finished_at", "gen_seconds", "env_seconds"):
            _finite(f"Trajectory.{name}", getattr(self, name))


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

    def validate(self) -> None:  # metrics may be non-finite: a skipped step reports its loss as it was
        for name in ("step", "version", "n_trajectories", "n_tokens"):
            _at_least(f"LearnerEvent.{name}", getattr(self, name), 0)
        _finite("LearnerEvent.time", self.time)
        bad = next((k for k, c in self.staleness.items() if c < 0), None)
        if bad is not None:
            raise SchemaError(f"LearnerEvent.staleness[{bad!r}]: negative count {self.staleness[bad]}")


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

    def validate(self) -> None:
        _at_least("DriftEvent.phase", self.phase, 0)
        _at_least("DriftEvent.at_seq", self.at_seq, 0)
        _finite("DriftEvent.time", self.time)


class MetricPoint(Message, kw_only=True):
    name: str  # namespaced, e.g. "metrics/reward"
    value: float
    time: float  # wall-clock end of the window
    labels: dict[str, str] = {}  # e.g. {"family": "arith", "concept": "add"}
    window: float = 0.0  # window length in seconds
    count: int = 0  # observations in the window
    trajectories: int = 0  # trajectories seen so far (x-axis)
    learner_step: int = 0  # latest learner step seen (x-axis)

    def validate(self) -> None:
        for name in ("value", "time", "window"):
            _finite(f"MetricPoint.{name}", getattr(self, name))
        for name in ("window", "count", "trajectories", "learner_step"):
            _at_least(f"MetricPoint.{name}", getattr(self, name), 0)


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

    def validate(self) -> None:
        for name in ("partition", "offset"):
            _at_least(f"DeadLetter.{name}", getattr(self, name), 0)
        _at_least("DeadLetter.value_len", self.value_len, len(self.value))


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
