"""The run configuration: one typed tree for everything `sao up` starts, written to `runs/<run>/config.yaml`.

Sections: `launch` (this command's own options: scenario, agents, batch, staleness, ...), `pretrain`, `finetune`,
`learner`, `agent`, `metrics`, `ray`. Values come from the defaults, then `--config FILE`, then
`--set section.key=value`, then the launch flags (`--batch 32`). `derive` then fills what one launch setting drives
in several roles: the staleness bound and the batch set the learner's batching and the agents' admission, the
resource plan sets the threads, the run's name and paths reach every role, `weights_transport` picks how versions
reach the agents (the directory store, or the learner's weight server over HTTP) for both sides. Setting a derived
key by hand is refused (it would desynchronise learner and agents): the cross-role validation lives here, in one
place. Each role is started with `--config runs/<run>/config.yaml` (a Ray actor: its node's copy, sent by value) and
reads its own section (`streamer.wire.config.load_config(..., section=)`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from learner.config import IOConfig, LearnerConfig
from learner.finetune import FinetuneConfig
from learner.pretrain import PretrainConfig
from learner.profiles import resolve as resolve_profile
from streamer.launch.ray_launch import RayConfig
from streamer.launch.resources import (
    Admission,
    ResourcePlan,
    available_cores,
    check_pacing,
    paced_admission,
    plan_resources,
)
from streamer.metrics.app import MetricsSettings
from streamer.wire.config import ConfigError, load_config, read_yaml, to_dict, write_yaml
from streamer.wire.settings import (
    WEIGHTS_TRANSPORTS,
    AgentSettings,
    ClientSettings,
    WeightsTransport,
    parse_hostport,
)
from streamer.wire.topics import tasks_partitions

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# a batch must close at --batch trajectories, not at a token budget: agents generate exactly one batch per version
TOKENS_PER_TRAJECTORY = 1024
DERIVED = {  # section -> keys `derive` sets from the launch section and the resource plan
    "learner": ("batch.max_staleness", "batch.max_trajectories", "batch.tokens", "batch.sync", "batch.sync_batch",
                "threads", "loss.name", "io.run", "io.init", "io.weights_dir", "io.run_dir",
                "checkpoint.dir", "io.weights_transport", "io.weights_bind", "io.weights_advertised",
                "io.weights_group_bind"),
    "agent": ("tasks_per_version", "versions_ahead", "threads", "group_size", "run", "model", "weights_dir",
              "weights_transport", "weights_url", "weights_group"),
    "metrics": ("run",),
    "pretrain": ("scenario", "cache_dir"),
    "finetune": ("cache_dir",),
}


@dataclass
class UpConfig:
    """`sao up`'s own options (the `launch` section); each has a flag of the same name."""

    scenario: str = "default"
    run: str = ""  # "" -> up-<date>-<time>
    runs_dir: str = "runs"
    bootstrap: str = ""  # "" -> start the embedded broker
    agents: int = 0  # 0: from the resource plan (one per core the learner leaves, 1 on 2 cores)
    group_size: int = 1  # >1 for the GRPO family (set learner.advantage.estimator too)
    loss: str = "sao"  # the learner's policy loss (learner.loss.name)
    seed: int = -1  # >= 0: the task stream's, the learner's and the agents' seeds (-1: the scenario's and defaults)
    batch: int = 64  # trajectories per learner batch (batch.max_trajectories); agents generate one per version
    staleness: int = 2  # versions a trajectory may lag the learner: learner max_staleness and agent admission
    sync: bool = False
    sync_batch: int = 64  # with --sync: trajectories per policy version (the learner's batch.sync_batch)
    limit: int = 0  # stop the simulator after this many tasks (0: the whole scenario)
    realtime: bool = False  # publish tasks at the scenario's rate instead of as fast as the agents answer
    max_lag: int = -1  # simulator back-pressure: tasks published ahead of the agents (-1: derived, 0: none)
    stream: str = ""  # replay this recorded task stream (JSONL, Parquet, CSV) instead of simulating the scenario
    speed: float = 0.0  # with stream: time scale of its recorded arrivals (0: as fast as back-pressure lets)
    model: str = ""  # start from this HF model directory (any causal LM and its tokenizer) instead of the warm start
    dashboard: bool = True
    eval: bool | None = None  # held-out greedy evaluation of each policy version; None: on above 2 cores
    eval_interval: float = 30.0  # seconds between evaluations (each costs about 16 s of one core)
    cores: int = 0  # cores the resource plan shares out (0: those this process may run on)
    # torch threads of the learner and of each agent (0: from the resource plan: the fixed rule, or with --model and
    # none of agents / learner_threads / agent_threads given, measured on this machine: streamer.launch.resources)
    learner_threads: int = 0
    agent_threads: int = 0
    dashboard_port: int = 8501
    max_seconds: float = 0.0  # stop after this long (0: at the scenario's end)
    drain_seconds: float = 5.0  # after the last trajectory, let the learner finish its batch
    restarts: int = 3  # times each crashed role (learner, agent, metrics app, dashboard) is started again
    broker_silence_s: float = 30.0  # the run stops when its broker answers no Metadata request this long
    ray: bool = False  # agents and learner as Ray actors (streamer.launch.ray_launch)
    ray_address: str = ""  # join this Ray cluster ("auto", "ray://head:10001"); implies --ray
    # how policy versions reach the agents: "directory" (the run's weight store, a path every agent's host shares)
    # or "http" (the learner serves the store, agents pull each version into memory: no shared filesystem)
    weights_transport: WeightsTransport = "directory"
    weights_bind: str = "127.0.0.1:0"  # http: the learner's weight server HOST:PORT (port 0: a free one, picked now)
    weights_advertised: str = ""  # http: HOST:PORT agents reach it at ("" -> weights_bind; 0.0.0.0 -> this host's name)
    # "broadcast": the learner's rank 0 also sends each version to the agents in a torch.distributed group (gloo; NCCL
    # for GPU weights), agents outside it pull over http as above; its rendezvous store listens on this HOST:PORT
    # (port 0: a free one, picked now; agents reach it at weights_advertised's host, if given)
    weights_group_bind: str = "127.0.0.1:0"

    def plan(self) -> ResourcePlan:
        return plan_resources(self.cores or available_cores(), self.agents, self.eval, self.learner_threads,
                              self.agent_threads)

    def pacing(self) -> tuple[int, int]:
        """(trajectories per learner batch, staleness bound): --sync trains one batch per version, none stale."""
        return (self.sync_batch, 0) if self.sync else (self.batch, self.staleness)

    def admission(self) -> Admission:
        """Agent admission: paced by the learner's batch and staleness bound (sync: one batch per version)."""
        agents = self.plan().agents
        batch, staleness = self.pacing()
        adm = paced_admission(staleness, batch, agents, self.group_size)
        check_pacing(adm, agents, self.group_size, batch, staleness)
        return adm

    def validate(self) -> None:
        if self.batch < 1 or self.sync_batch < 1 or self.staleness < 0:
            raise ConfigError(f"launch: batch {self.batch} and sync_batch {self.sync_batch} must be >= 1, staleness "
                              f"{self.staleness} >= 0")
        if self.agents < 0:
            raise ConfigError(f"launch.agents: {self.agents}; need at least one agent (0: from the resource plan)")
        if self.learner_threads < 0 or self.agent_threads < 0:
            raise ConfigError(f"launch.learner_threads {self.learner_threads} / launch.agent_threads "
                              f"{self.agent_threads}: must be >= 0 (0: from the resource plan)")
        if self.stream and not Path(self.stream).is_file():
            raise ConfigError(f"launch.stream: {self.stream}: no such file")
        if self.stream and self.realtime:
            raise ConfigError("launch.realtime paces the simulator; a --stream is paced by --speed")
        if self.speed < 0:
            raise ConfigError(f"launch.speed: {self.speed} must be >= 0 (0: no waiting)")


@dataclass
class RunConfig:
    launch: UpConfig = field(default_factory=UpConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    agent: AgentSettings = field(default_factory=AgentSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    ray: RayConfig = field(default_factory=RayConfig)


def _given_keys(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out.add(path)
        if isinstance(value, dict):
            out |= _given_keys(value, path + ".")
    return out


def load_run_config(path: str | Path | None = None, overrides: list[str] = (), launch: dict | None = None,
                    measure: bool = False) -> RunConfig:
    """Defaults, the file, `--set` overrides, then launch flags; derived keys filled and checked (`derive`).
    A run without a name gets up-<date>-<time>. `measure` (`sao up`): with --model, the resource plan measured on
    this machine (`streamer.launch.plan_measure`, printed, cached), then the derived keys filled again from it."""
    given = _given_keys(read_yaml(path)) if path else set()
    given |= {item.partition("=")[0].strip() for item in overrides}
    cfg = load_config(RunConfig, path, list(overrides))
    if launch:
        cfg.launch = dataclasses.replace(cfg.launch, **launch)
    cfg.launch.ray = cfg.launch.ray or bool(cfg.launch.ray_address)
    if cfg.launch.ray_address:
        cfg.ray.address = cfg.launch.ray_address
    if cfg.launch.ray:  # actors may run elsewhere than our cwd (another host, a runtime_env working_dir)
        cfg.launch.runs_dir = str(Path(cfg.launch.runs_dir).absolute())
    cfg.launch.run = cfg.launch.run or time.strftime("up-%Y%m%d-%H%M%S")
    cfg.launch.validate()
    cfg.ray.validate()
    derive(cfg, given)
    resolve_profile(cfg.learner, cfg.launch.model, {k[8:] for k in given if k.startswith("learner.")})  # yours win
    if measure and cfg.launch.model:
        from streamer.launch.plan_measure import apply_measured_plan

        if apply_measured_plan(cfg, log=lambda line: print(line, flush=True)):
            derive(cfg, given)
    return cfg


def _refuse_derived(given: set[str]) -> None:
    for section, keys in DERIVED.items():
        for key in keys:
            if f"{section}.{key}" in given:
                raise ConfigError(f"{section}.{key}: sao up derives it from the launch section (--batch, --staleness, "
                                  f"--sync-batch, --loss, --seed, --group-size, --cores, --agents, --run, "
                                  f"launch.weights_*); set those instead so learner and agents stay consistent")


def seed_of(launch: UpConfig, offset: int, default: int) -> int:
    """Each role its own stream of random numbers when --seed is given (learner 0, agent i: 1 + i); without it,
    the role's own seed (its default, or `--set learner.seed=...`)."""
    return 1000 * launch.seed + offset if launch.seed >= 0 else default


def derive(cfg: RunConfig, given: set[str] = frozenset()) -> None:
    """Fill every key one launch setting drives in several roles (see DERIVED), after refusing hand-set ones.
    The agents' concurrency follows their admission unless given (`--set agent.concurrency=8`)."""
    _refuse_derived(given)
    up, plan, adm = cfg.launch, cfg.launch.plan(), cfg.launch.admission()
    batch, staleness = up.pacing()
    run_dir = Path(up.runs_dir) / up.run
    lb = cfg.learner.batch
    lb.max_staleness, lb.max_trajectories, lb.tokens = staleness, batch, batch * TOKENS_PER_TRAJECTORY
    lb.sync, lb.sync_batch = up.sync, up.sync_batch
    cfg.learner.threads, cfg.learner.loss.name = plan.learner_threads, up.loss
    cfg.learner.seed = seed_of(up, 0, cfg.learner.seed)
    a = cfg.agent
    a.tasks_per_version, a.versions_ahead = adm.tasks_per_version, adm.versions_ahead
    a.concurrency = a.concurrency if "agent.concurrency" in given else adm.concurrency
    a.threads, a.group_size, a.seed = plan.agent_threads, up.group_size, seed_of(up, 1, a.seed)
    a.topics.tasks_partitions = tasks_partitions(a.topics, plan.agents)  # one per agent at least, for every role
    if a.client.max_message_bytes > ClientSettings.max_message_bytes:  # the learner's reader has the default limit
        raise ConfigError(f"agent.client.max_message_bytes: {a.client.max_message_bytes} is above "
                          f"{ClientSettings.max_message_bytes}, the limit above which the learner dead-letters")
    cfg.pretrain.scenario, cfg.pretrain.cache_dir = up.scenario, f"{up.runs_dir}/cache"
    cfg.finetune.cache_dir = cfg.pretrain.cache_dir
    if cfg.finetune.rows and not up.stream:
        raise ConfigError("finetune.rows: the demonstrations come from a recorded stream; give --stream FILE")
    cfg.learner.io.run = a.run = cfg.metrics.run = up.run
    if up.bootstrap:  # a role started from config.yaml alone, on another host, finds the run's Kafka
        for key, holder in (("learner.io", cfg.learner.io), ("agent.client", a.client), ("metrics", cfg.metrics)):
            if f"{key}.bootstrap" not in given:
                holder.bootstrap = up.bootstrap
    cfg.learner.io.weights_dir = a.weights_dir = str(run_dir / "weights")
    cfg.learner.io.run_dir, cfg.learner.checkpoint.dir = str(run_dir), str(run_dir / "checkpoints")
    derive_weights(up, cfg.learner.io, a, cluster=up.ray and bool(cfg.ray.address))
    cfg.learner.validate()


def derive_weights(up: UpConfig, io: IOConfig, agent: AgentSettings, cluster: bool = False) -> None:
    """One transport for learner and agents; over http (and broadcast), the server's address (a free port if none
    is given); with broadcast, the group's rendezvous address too. On a Ray cluster (`cluster`) with no advertised
    address given, loopback binds become 0.0.0.0 (same port): `advertise_on` names the learner node's IP later."""
    if up.weights_transport not in WEIGHTS_TRANSPORTS:
        raise ConfigError(f"launch.weights_transport: {up.weights_transport!r} not in {list(WEIGHTS_TRANSPORTS)}")
    io.weights_transport = agent.weights_transport = up.weights_transport
    if up.weights_transport == "directory":
        return
    from streamer.transport.broker import free_port
    from streamer.transport.weight_server import advertised_host

    wide = lambda h: "0.0.0.0" if cluster and not up.weights_advertised and h in LOOPBACK else h  # noqa: E731
    host, port = parse_hostport(up.weights_bind, "launch.weights_bind")
    host = wide(host)
    port = port or free_port(host)
    io.weights_bind = f"{host}:{port}"
    io.weights_advertised = up.weights_advertised or f"{advertised_host(host)}:{port}"
    parse_hostport(io.weights_advertised, "launch.weights_advertised")
    agent.weights_url = f"http://{io.weights_advertised}"
    if up.weights_transport == "broadcast":
        host, port = parse_hostport(up.weights_group_bind, "launch.weights_group_bind")
        host = wide(host)
        port = port or free_port(host)
        io.weights_group_bind = f"{host}:{port}"
        agent.weights_group = f"{io.weights_advertised.rpartition(':')[0]}:{port}"


SECRETS = {"sasl_password": "SAO_KAFKA_SASL_PASSWORD"}  # a field never written to config.yaml -> the variable


def _without_secrets(tree: dict, found: dict[str, dict[str, str]], path: str = "") -> dict:
    """`tree` with each non-empty secret field emptied; `found`: variable -> {dotted key: value}."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            value = _without_secrets(value, found, f"{path}{key}.")
        elif key in SECRETS and value:
            found.setdefault(SECRETS[key], {})[f"{path}{key}"] = value
            value = ""
        out[key] = value
    return out


def role_env(cfg: RunConfig) -> dict[str, str]:
    """The secrets every role gets in its environment, never in config.yaml: the run's policy key
    (`streamer.transport.signing.run_key`) and the Kafka password (each role's empty field reads it from there)."""
    from streamer.transport.signing import KEY_ENV, run_key

    found: dict[str, dict[str, str]] = {}
    _without_secrets(to_dict(cfg), found)
    env = {KEY_ENV: run_key(Path(cfg.launch.runs_dir) / cfg.launch.run)}
    for var in SECRETS.values():
        values = set(found.get(var, {}).values())
        if len(values) > 1:
            raise ConfigError(f"{', '.join(found[var])}: different values; every role gets one, in ${var}")
        value = values.pop() if values else os.environ.get(var, "")
        if value:
            env[var] = value
    return env


def write_run_config(cfg: RunConfig, path: str | Path) -> dict[str, str]:
    """Write `cfg` to `path` (config.yaml) with its secrets left empty; returns `role_env`, what the roles need
    in their environment instead (the run's policy key made now if it is not there yet)."""
    env = role_env(cfg)
    write_yaml(_without_secrets(to_dict(cfg), {}), path)
    return env


def is_derived(key: str) -> bool:
    section, _, rest = key.partition(".")
    return rest in DERIVED.get(section, ())


def pin_derived(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """A copy of `cfg` with derived keys set by hand, for benchmarks that pin them on purpose (tables measured
    before learner-paced admission). Users go through `load_run_config`, which refuses them."""
    return load_config(RunConfig, None, list(overrides), base=to_dict(cfg))


def bind_init(cfg: RunConfig, init: Path) -> None:
    """The warm start every role starts from (known once `sao pretrain` ran or was found in the cache). On a Ray
    cluster with weights over the network, the agents start from the learner's weight server instead (its version
    0, published before anything), so no agent node needs the warm start's directory."""
    cfg.learner.io.init = cfg.agent.model = str(init)
    if cfg.launch.ray and cfg.ray.address and cfg.agent.weights_url:
        cfg.agent.model = cfg.agent.weights_url.rstrip("/") + "/latest"


def advertise_on(cfg: RunConfig, ip: str) -> bool:
    """The weight server (and broadcast rendezvous) advertised at `ip`, the learner node's, unless the user gave
    launch.weights_advertised or the server binds one address; True when the configuration changed."""
    io, a, up = cfg.learner.io, cfg.agent, cfg.launch
    if up.weights_transport == "directory" or up.weights_advertised or not io.weights_bind.startswith("0.0.0.0:"):
        return False
    old = io.weights_advertised
    io.weights_advertised = f"{ip}:{io.weights_bind.rpartition(':')[2]}"
    a.weights_url = f"http://{io.weights_advertised}"
    if a.model_is_url():
        a.model = f"{a.weights_url}/latest"
    if a.weights_group:
        a.weights_group = f"{ip}:{a.weights_group.rpartition(':')[2]}"
    return io.weights_advertised != old


def max_lag_default(cfg: RunConfig) -> int:
    """Back-pressure bound: what the agents may hold in flight plus one batch (0 with --realtime unless given)."""
    from streamer.transport.backpressure import default_max_lag

    up, adm = cfg.launch, cfg.launch.admission()
    if up.max_lag >= 0:
        return up.max_lag
    if up.realtime:
        return 0
    return default_max_lag(up.plan().agents, adm.concurrency, adm.tasks_per_version, adm.versions_ahead,
                           math.ceil(up.pacing()[0] / up.group_size))
