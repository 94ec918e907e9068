"""Typed configuration of the streaming plane: broker, clients, topics, agents.

Dataclasses with defaults; build one with `streamer.config.load_config(AgentSettings, yaml, overrides)`.
`SAO_BOOTSTRAP` names the Kafka bootstrap servers when `--bootstrap` is not given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from streamer.config import ConfigError

BOOTSTRAP_ENV = "SAO_BOOTSTRAP"
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


def default_bootstrap() -> str:
    """`$SAO_BOOTSTRAP`, else the broker `sao broker` starts by default."""
    return os.environ.get(BOOTSTRAP_ENV, "") or DEFAULT_BOOTSTRAP


@dataclass
class BrokerSettings:
    host: str = "127.0.0.1"  # loopback only: the embedded broker has no authentication
    port: int = 9092  # 0 picks a free port
    log_path: str = ""  # broker stdout/stderr; "" -> a temporary file
    start_timeout_s: float = 15.0  # until it answers a Kafka Metadata request
    stop_timeout_s: float = 5.0  # after SIGINT, then SIGKILL


@dataclass
class ClientSettings:
    """kafka-python defaults. Tansu needs the short session: group joins take ~session_timeout/2."""

    bootstrap: str = ""  # "" -> $SAO_BOOTSTRAP -> 127.0.0.1:9092
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 1000
    max_poll_interval_ms: int = 300_000  # one rollout with slow tools must fit between polls
    compression: Literal["none", "gzip", "lz4", "snappy", "zstd", "auto"] = "auto"  # auto: lz4 if installed, else none
    linger_ms: int = 5
    batch_size: int = 256 * 1024
    max_message_bytes: int = 4 * 1024 * 1024  # bigger messages go to the DLQ on the consumer side
    request_timeout_ms: int = 30_000
    idempotence: bool = True  # idempotent producers: a retried send is written once (Apache Kafka and Tansu)
    delivery_timeout_ms: int = 120_000  # a record unconfirmed after this long (retries included) fails its flush()
    client_id: str = "sao"

    def resolved_bootstrap(self) -> str:
        return self.bootstrap or default_bootstrap()

    def validate(self) -> None:
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ConfigError("ClientSettings.heartbeat_interval_ms: must be <= session_timeout_ms / 3")
        if self.max_message_bytes <= 0:
            raise ConfigError("ClientSettings.max_message_bytes: must be > 0")


@dataclass
class TopicSettings:
    tasks_partitions: int = 4  # upper bound on agents that share the task stream
    trajectories_partitions: int = 2
    other_partitions: int = 1  # policy, learner, metrics, drift, dlq: ordered, low rate


@dataclass
class AgentSettings:
    run: str = "default"
    agent_id: str = ""  # "" -> hostname-pid
    group_id: str = ""  # consumer group; "" -> "<run>.agents"
    engine: str = "torch"
    model: str = ""  # model directory (HF format); "" -> the latest version in the weight store
    weights_dir: str = "runs/weights"  # weight store that <run>.policy announcements point into
    group_size: int = 1  # 1: single rollout (SAO); n>1: GRPO-family group sharing one policy version
    concurrency: int = 1  # tasks in flight: their turns share engine batches, their tool calls overlap
    max_new_tokens: int = 32  # per turn
    max_turns: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_tasks: int = 0  # stop after this many tasks (0: run until stopped)
    # staleness-bounded rollout (AReaL's eta): start at most `tasks_per_version` tasks per policy version,
    # running at most `versions_ahead` versions ahead of the newest one loaded; 0 ahead is the synchronous
    # baseline (answer a share of the batch, then wait). tasks_per_version 0: unbounded
    tasks_per_version: int = 0
    versions_ahead: int = 0
    idle_exit_s: float = 0.0  # stop after this long without tasks (0: never)
    poll_timeout_s: float = 0.5
    seed: int = 0
    device: str = "cpu"
    threads: int = 1
    client: ClientSettings = field(default_factory=ClientSettings)
    topics: TopicSettings = field(default_factory=TopicSettings)

    def validate(self) -> None:
        if self.group_size < 1:
            raise ConfigError("AgentSettings.group_size: must be >= 1 (1 = single rollout)")
        if self.concurrency < 1:
            raise ConfigError("AgentSettings.concurrency: must be >= 1 (tasks in flight per agent)")
        if self.tasks_per_version < 0 or self.versions_ahead < 0:
            raise ConfigError("AgentSettings.tasks_per_version / versions_ahead: must be >= 0 (tasks_per_version 0 = "
                              "unbounded)")
        if self.max_new_tokens < 1 or self.max_turns < 1:
            raise ConfigError("AgentSettings.max_new_tokens / max_turns: must be >= 1")
        self.client.validate()
