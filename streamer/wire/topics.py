"""Run-prefixed topic names (`<run>.tasks`, ...) and the message type each topic carries."""

from __future__ import annotations

import re
from dataclasses import dataclass

from streamer.wire.schema import DriftEvent, LearnerEvent, MetricPoint, PolicyVersion, Task, Trajectory
from streamer.wire.settings import TopicSettings

KINDS = ("tasks", "trajectories", "policy", "learner", "metrics", "drift", "dlq")
_RUN_RE = re.compile(r"^[A-Za-z0-9_-]{1,200}$")  # a topic name allows [A-Za-z0-9._-]; '.' separates the kind

# The message type of each topic kind (the DLQ carries streamer.wire.schema.DeadLetter).
TYPES: dict[str, type] = {
    "tasks": Task,
    "trajectories": Trajectory,
    "policy": PolicyVersion,
    "learner": LearnerEvent,
    "metrics": MetricPoint,
    "drift": DriftEvent,
}


def check_run(run: str) -> str:
    if not _RUN_RE.match(run):
        raise ValueError(f"run name {run!r}: use 1-200 characters of A-Z a-z 0-9 _ - (no dots)")
    return run


def topic(run: str, kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"topic kind {kind!r}: expected one of {', '.join(KINDS)}")
    return f"{check_run(run)}.{kind}"


def kind_of(name: str) -> str:
    """'exp1.tasks' -> 'tasks'."""
    kind = name.rpartition(".")[2]
    if kind not in KINDS:
        raise ValueError(f"topic {name!r}: not a '<run>.<kind>' name with kind in {', '.join(KINDS)}")
    return kind


@dataclass(frozen=True)
class Topics:
    """The topic names of one run: `Topics("exp1").tasks == "exp1.tasks"`."""

    run: str

    def __post_init__(self) -> None:
        check_run(self.run)

    tasks = property(lambda self: topic(self.run, "tasks"))
    trajectories = property(lambda self: topic(self.run, "trajectories"))
    policy = property(lambda self: topic(self.run, "policy"))
    learner = property(lambda self: topic(self.run, "learner"))
    metrics = property(lambda self: topic(self.run, "metrics"))
    drift = property(lambda self: topic(self.run, "drift"))
    dlq = property(lambda self: topic(self.run, "dlq"))

    def all(self) -> list[str]:
        return [topic(self.run, k) for k in KINDS]


def tasks_partitions(settings: TopicSettings, agents: int = 0) -> int:
    """Partitions of `<run>.tasks`: never fewer than the agents of the group that shares them (a consumer beyond the
    partition count gets none), at least `settings.tasks_partitions`."""
    return max(settings.tasks_partitions, agents)


def partitions_by_topic(run: str, settings: TopicSettings | None = None, agents: int = 0) -> dict[str, int]:
    """Every topic of a run with its partition count (`agents`: the run's agent count, 0 when unknown)."""
    s = settings or TopicSettings()
    counts = {"tasks": tasks_partitions(s, agents), "trajectories": s.trajectories_partitions}
    return {topic(run, k): counts.get(k, s.other_partitions) for k in KINDS}
