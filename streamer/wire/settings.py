"""Typed configuration of the streaming plane: broker, clients, topics, agents.

Dataclasses with defaults; build one with `streamer.wire.config.load_config(AgentSettings, yaml, overrides)`.
`SAO_BOOTSTRAP` names the Kafka bootstrap servers when `--bootstrap` is not given.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Literal

from streamer.wire.config import ConfigError

BOOTSTRAP_ENV = "SAO_BOOTSTRAP"
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


def default_bootstrap() -> str:
    """`$SAO_BOOTSTRAP`, else the broker `sao broker` starts by default."""
    return os.environ.get(BOOTSTRAP_ENV, "") or DEFAULT_BOOTSTRAP


# how policy versions reach the agents (streamer.transport.weights)
WeightsTransport = Literal["directory", "http", "broadcast"]
WEIGHTS_TRANSPORTS = ("directory", "http", "broadcast")
PULLS = ("http", "broadcast")  # the transports with a weight server (broadcast: for the agents outside its group)


def parse_hostport(text: str, where: str) -> tuple[str, int]:
    """`HOST:PORT` (port 0: a free one) as (host, port); a ConfigError naming `where` otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{where}: {text!r} is not HOST:PORT (e.g. 127.0.0.1:8765, 0.0.0.0:8765)")
    return host.strip("[]"), int(port)


def check_weights_url(url: str, where: str) -> None:
    """A weight server's base URL: http(s)://HOST:PORT, nothing after it."""
    scheme, sep, rest = url.partition("://")
    if scheme not in ("http", "https") or not sep or not rest.rstrip("/") or "/" in rest.rstrip("/"):
        raise ConfigError(f"{where}: {url!r} is not a weight server's address, http://HOST:PORT")


@dataclass
class BrokerSettings:
    host: str = "127.0.0.1"  # loopback only: the embedded broker has no authentication
    port: int = 9092  # 0 picks a free port
    advertised: str = ""  # HOST:PORT clients are told to use (a container's service name); "" -> host:port
    log_path: str = ""  # broker stdout/stderr; "" -> a temporary file
    start_timeout_s: float = 15.0  # until it answers a Kafka Metadata request
    stop_timeout_s: float = 5.0  # after SIGINT, then SIGKILL


_warned: set[str] = set()


def warn_once(text: str) -> None:
    """A warning logged once per process (settings are resolved for every client)."""
    if text not in _warned:
        _warned.add(text)
        logging.getLogger(__name__).warning(text)


SECURITY_ENV = {  # the environment fills each setting left empty (compose and secrets stores set these)
    "security_protocol": "SAO_KAFKA_SECURITY_PROTOCOL", "sasl_mechanism": "SAO_KAFKA_SASL_MECHANISM",
    "sasl_username": "SAO_KAFKA_SASL_USERNAME", "sasl_password": "SAO_KAFKA_SASL_PASSWORD",
    "ssl_cafile": "SAO_KAFKA_SSL_CAFILE", "ssl_certfile": "SAO_KAFKA_SSL_CERTFILE",
    "ssl_keyfile": "SAO_KAFKA_SSL_KEYFILE",
}
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


@dataclass
class KafkaSecurity:
    """How every client (kafka-python producers, consumers, admin; the faust metrics app) authenticates and
    encrypts. Empty fields come from $SAO_KAFKA_* (SECURITY_ENV); all empty: PLAINTEXT, as the embedded broker."""

    security_protocol: Literal["", "PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = ""
    sasl_mechanism: Literal["", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = ""  # with the SASL_* protocols
    sasl_username: str = ""
    sasl_password: str = ""
    ssl_cafile: str = ""  # CA bundle that signed the brokers' certificates (SSL, SASL_SSL)
    ssl_certfile: str = ""  # client certificate (mutual TLS)
    ssl_keyfile: str = ""

    def resolved(self) -> "KafkaSecurity":
        out = KafkaSecurity(**{k: getattr(self, k) or os.environ.get(env, "") for k, env in SECURITY_ENV.items()})
        out.security_protocol = out.security_protocol or "PLAINTEXT"
        out.check()
        if out.security_protocol == "SASL_PLAINTEXT" and out.sasl_mechanism == "PLAIN":
            warn_once("SASL PLAIN over SASL_PLAINTEXT sends the Kafka password UNENCRYPTED to the broker: anyone on "
                      "the network path can read it; use SASL_SSL, or a SCRAM mechanism at least")
        return out

    def check(self) -> None:
        where = "ClientSettings.security"
        if self.security_protocol not in PROTOCOLS:
            raise ConfigError(f"{where}.security_protocol: {self.security_protocol!r} not in {list(PROTOCOLS)}")
        sasl = self.security_protocol.startswith("SASL")
        if sasl and self.sasl_mechanism not in MECHANISMS:
            raise ConfigError(f"{where}.sasl_mechanism: {self.sasl_mechanism!r} not in {list(MECHANISMS)} "
                              f"(needed by {self.security_protocol})")
        if sasl and not (self.sasl_username and self.sasl_password):
            raise ConfigError(f"{where}: {self.security_protocol} needs sasl_username and sasl_password "
                              f"(or ${SECURITY_ENV['sasl_username']} and ${SECURITY_ENV['sasl_password']})")
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ConfigError(f"{where}.{name}: {path}: no such file")

    def kafka_python(self) -> dict[str, str]:
        """Keyword arguments for KafkaProducer / KafkaConsumer / KafkaAdminClient."""
        r = self.resolved()
        kw = {"security_protocol": r.security_protocol}
        if r.security_protocol.startswith("SASL"):
            kw.update(sasl_mechanism=r.sasl_mechanism, sasl_plain_username=r.sasl_username,
                      sasl_plain_password=r.sasl_password)
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if getattr(r, name):
                kw[name] = getattr(r, name)
        return kw

    def faust_credentials(self):
        """faust's `broker_credentials` (None for PLAINTEXT)."""
        r = self.resolved()
        if r.security_protocol == "PLAINTEXT":
            return None
        import ssl

        import faust

        ssl_context = None
        if r.security_protocol.endswith("SSL"):
            ssl_context = ssl.create_default_context(cafile=r.ssl_cafile or None)
            if r.ssl_certfile:
                ssl_context.load_cert_chain(r.ssl_certfile, r.ssl_keyfile or None)
        if not r.security_protocol.startswith("SASL"):
            return faust.SSLCredentials(ssl_context)
        return faust.SASLCredentials(username=r.sasl_username, password=r.sasl_password,
                                     mechanism=r.sasl_mechanism, ssl_context=ssl_context)


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
    # largest message value on the run's topics: topics are created with max.message.bytes = this + 64 KiB
    # (framing; the DLQ at least 8 MiB + 64 KiB), producers are sized to it and agents dead-letter a bigger
    # trajectory instead of sending it; consumers dead-letter bigger records
    max_message_bytes: int = 4 * 1024 * 1024
    request_timeout_ms: int = 30_000
    idempotence: bool = True  # idempotent producers: a retried send is written once (Apache Kafka and Tansu)
    delivery_timeout_ms: int = 120_000  # a record unconfirmed after this long (retries included) fails its flush()
    client_id: str = "sao"
    security: KafkaSecurity = field(default_factory=KafkaSecurity)

    def resolved_bootstrap(self) -> str:
        return self.bootstrap or default_bootstrap()

    def validate(self) -> None:
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ConfigError("ClientSettings.heartbeat_interval_ms: must be <= session_timeout_ms / 3")
        if self.max_message_bytes <= 0:
            raise ConfigError("ClientSettings.max_message_bytes: must be > 0")


@dataclass
class TopicSettings:
    """How a run's topics are created (`streamer.wire.topics.partitions_by_topic`; an existing topic is kept)."""

    # at least this many; raised to the agent count (`sao up` derives it, `sao topics --agents N`): agents of one
    # group share the task stream by partition, so an agent beyond the partition count would sit idle
    tasks_partitions: int = 4
    # One: the learner (a single reader) gets them in the order they were produced, also when it reads a backlog
    # after a restart; with two, it read one partition's backlog first and the other's older records went stale.
    trajectories_partitions: int = 1
    other_partitions: int = 1  # policy, learner, metrics, drift, dlq: ordered, low rate
    replication_factor: int = 1  # copies of each partition: 1 for one broker (embedded, compose); 3 on a cluster

    def validate(self) -> None:
        if min(self.tasks_partitions, self.trajectories_partitions, self.other_partitions) < 1:
            raise ConfigError("TopicSettings: partition counts must be >= 1")
        if self.replication_factor < 1:
            raise ConfigError("TopicSettings.replication_factor: must be >= 1")


@dataclass
class AgentSettings:
    run: str = "default"
    agent_id: str = ""  # "" -> hostname-pid
    group_id: str = ""  # consumer group; "" -> "<run>.agents"
    engine: Literal["torch", "hf", "vllm"] = "torch"  # learner.engines.factory
    model: str = ""  # model directory (HF format); "" -> the latest version in the weight store
    chat_template: bool = True  # prompts through the model tokenizer's chat template, when it has one
    stop: list[str] = field(default_factory=list)  # strings that also end a turn (e.g. a chat format's end of turn)
    tool_call: list[str] = field(default_factory=lambda: ["<call>", "</call>"])  # how the agent's text calls a tool
    observation: list[str] = field(default_factory=lambda: ["<obs>", "</obs>"])  # how the tool's answer comes back
    weights_dir: str = "runs/weights"  # weight store that <run>.policy announcements point into (directory)
    # how announced versions are read: "directory" (weights_dir, a path this host shares with the learner) or "http"
    # (pulled from the learner's weight server at weights_url, into memory; `sao up` derives both) or "broadcast"
    # (received in the learner's process group, streamer.transport.weight_receiver; pulled from weights_url while
    # this agent is not in the group)
    weights_transport: WeightsTransport = "directory"
    weights_url: str = ""  # http, broadcast: the weight server, http://HOST:PORT; versions are fetched from it alone
    weights_group: str = ""  # broadcast: HOST:PORT of the learner's rendezvous store (its io.weights_group_bind)
    model_cache: str = "runs/agent-cache"  # http: where an initial model fetched from the server is kept
    weights_timeout_s: float = 30.0  # http: one request's timeout (a timeout is transient: retried with a backoff)
    weights_wait_s: float = 300.0  # http, no local model: how long to wait at start for the server's first version
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
    # user verifiers of recorded streams to enable, by entry-point name (group sao_lab.verifiers; simulator.verifiers)
    verifiers: list[str] = field(default_factory=list)
    # user tool environments of recorded streams, by entry-point name (group sao_lab.tools; simulator.tool_envs)
    tool_envs: list[str] = field(default_factory=list)
    # a user verifier's limit per answer: it runs in a worker process, killed past this; the task is dead-lettered
    verifier_timeout_s: float = 5.0
    client: ClientSettings = field(default_factory=ClientSettings)
    topics: TopicSettings = field(default_factory=TopicSettings)

    def model_is_url(self) -> bool:
        """`model` names a weight server's version (http://HOST:PORT/latest or /v000123), not a directory."""
        return self.model.startswith(("http://", "https://"))

    def _validate_weights(self) -> None:
        if self.weights_transport not in WEIGHTS_TRANSPORTS:
            raise ConfigError(f"AgentSettings.weights_transport: {self.weights_transport!r} not in "
                              f"{list(WEIGHTS_TRANSPORTS)}")
        if self.weights_transport in PULLS:
            check_weights_url(self.weights_url,
                              f"AgentSettings.weights_url (weights_transport {self.weights_transport})")
        if self.weights_transport == "broadcast":
            parse_hostport(self.weights_group, "AgentSettings.weights_group (weights_transport broadcast)")
        if self.model_is_url():
            base, _, which = self.model.rstrip("/").rpartition("/")
            if self.weights_transport not in PULLS or base.rstrip("/") != self.weights_url.rstrip("/"):
                raise ConfigError(f"AgentSettings.model: {self.model} is fetched from the weight server, which must "
                                  f"be weights_url ({self.weights_url or 'unset'}) with weights_transport http")
            if which != "latest" and not (which[:1] == "v" and which[1:].isdigit()):
                raise ConfigError(f"AgentSettings.model: {self.model}: end it with /latest or a version, /v000123")
        if self.weights_timeout_s <= 0 or self.weights_wait_s < 0:
            raise ConfigError("AgentSettings.weights_timeout_s / weights_wait_s: must be > 0 / >= 0")

    def validate(self) -> None:
        from streamer.wire.schema import LIMITS  # what every consumer accepts (refused there as a lie otherwise)

        if not 1 <= self.group_size <= LIMITS.max_group_size:
            raise ConfigError(f"AgentSettings.group_size: must be 1..{LIMITS.max_group_size} (1 = single rollout)")
        if 0 < self.temperature < LIMITS.min_temperature or self.temperature > LIMITS.max_temperature:
            raise ConfigError(f"AgentSettings.temperature: {self.temperature}: must be <= 0 (greedy) or within "
                              f"{LIMITS.min_temperature}..{LIMITS.max_temperature}")
        if self.concurrency < 1:
            raise ConfigError("AgentSettings.concurrency: must be >= 1 (tasks in flight per agent)")
        if self.tasks_per_version < 0 or self.versions_ahead < 0:
            raise ConfigError("AgentSettings.tasks_per_version / versions_ahead: must be >= 0 (tasks_per_version 0 = "
                              "unbounded)")
        for name in ("tool_call", "observation"):
            pair = getattr(self, name)
            if len(pair) != 2 or not all(isinstance(x, str) and x for x in pair):
                raise ConfigError(f"AgentSettings.{name}: expected [open, close], two non-empty strings; got {pair!r}")
        if self.max_new_tokens < 1 or self.max_turns < 1:
            raise ConfigError("AgentSettings.max_new_tokens / max_turns: must be >= 1")
        if not 0 < self.verifier_timeout_s < float("inf"):
            raise ConfigError("AgentSettings.verifier_timeout_s: must be a finite number of seconds > 0")
        self._validate_weights()
        self.client.validate()
        self.topics.validate()
