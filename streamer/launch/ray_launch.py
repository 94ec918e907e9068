"""`sao up --ray`: the agents and the learner as Ray actors; Kafka stays the data bus.

    sao up --ray                                        # a local Ray instance (ray.init())
    sao up --ray-address auto --bootstrap kafka:9092    # join the cluster this node belongs to
    sao up --ray-address ray://head:10001 --bootstrap kafka:9092 --set ray.agent.num_cpus=2

Each agent, and each learner rank, is one `streamer.launch.ray_actor.RoleActor`: it runs the very `sao <argv>` the local
launcher would run, as a child process of the actor (its log in `<run>/logs/<role>.log` on the
actor's node), and dies with it. Actors are created with `max_restarts`, so when one dies (its
process or node is lost, or its role is killed) Ray starts it again and the role's main runs again:
an agent re-joins the task consumer group (its uncommitted tasks are redelivered; the learner
de-duplicates by task id), the learner resumes from its latest checkpoint (weights, buffer, offsets).
With `learner_workers > 1` the learner ranks form a torchrun-style gang (one placement group; RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE by node, MASTER_ADDR/PORT on rank 0's node: `streamer.launch.ray_nodes`); a dead
rank restarts the whole gang. An actor on another node than the driver's logs to `<run>/logs/<hostname>/`.
The run's config.yaml travels by value (`ship`): each actor writes it on its node and its role reads that copy.
`check_shared` fails a run whose hosts do not share a path they must (`ray_nodes.run_needs`).
The broker, simulator, metrics app and dashboard stay local child processes (streamer.launch.processes).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from streamer.launch.processes import Role, Supervisor
from streamer.launch.ray_actor import SAO, RoleActor
from streamer.launch.ray_nodes import Need, check_paths, gang_env, learner_on_driver, role_verdict
from streamer.wire.config import ConfigError, load_config

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
RAY_ROLES = ("agent", "learn")  # `sao <cmd>` roles that run as actors; the rest stay local


@dataclass
class RoleResources:
    num_cpus: float = 1.0  # Ray CPUs reserved per actor (each agent / each learner rank)
    num_gpus: float = 0.0  # GPUs per actor; Ray sets CUDA_VISIBLE_DEVICES for it
    memory_mb: int = 0  # memory reserved per actor (0: none)
    resources: dict[str, float] = field(default_factory=dict)  # custom resources, e.g. {"rollout_node": 1}

    def validate(self, where: str) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0 or self.memory_mb < 0:
            raise ConfigError(f"{where}: num_cpus, num_gpus and memory_mb must be >= 0 (got {self})")


@dataclass
class LearnerResources(RoleResources):
    num_cpus: float = 2.0  # per learner rank


@dataclass
class RayConfig:
    address: str = ""  # "" -> start a local Ray instance; "auto" or "ray://head:10001" -> join that cluster
    namespace: str = "sao"
    local_num_cpus: int = 0  # logical CPUs of a local instance (0: at least 8; Ray's CPUs schedule, never pin)
    agent: RoleResources = field(default_factory=RoleResources)
    learner: LearnerResources = field(default_factory=LearnerResources)
    learner_workers: int = 1  # learner ranks (torchrun-style, for the megatron backend); 1: one actor
    learner_strategy: Strategy = "PACK"  # placement of the learner ranks (a Ray placement-group strategy)
    agent_strategy: Literal["DEFAULT", "SPREAD"] = "DEFAULT"  # agents' actors: Ray's default packing, or SPREAD
    # one learner rank on the driver's node ("driver"), anywhere ("any"), or "auto": the driver's node when weights
    # travel over the network (http, broadcast: the warm start is read there, the weight server advertised there)
    learner_node: Literal["auto", "driver", "any"] = "auto"
    runtime_env: dict[str, Any] = field(default_factory=dict)  # ray.init's, e.g. {working_dir: .} to ship the code
    max_restarts: int = -1  # Ray restarts of a dead actor (-1: always)
    min_uptime_s: float = 10.0  # a role that fails sooner than this (or with status 2: bad config) fails the run
    stop_timeout_s: float = 30.0  # SIGINT, then SIGKILL after this long

    def validate(self) -> None:
        self.agent.validate("ray.agent")
        self.learner.validate("ray.learner")
        if self.learner_workers < 1:
            raise ConfigError(f"ray.learner_workers={self.learner_workers}: need at least 1")
        if self.learner_strategy not in get_args(Strategy):
            raise ConfigError(f"ray.learner_strategy={self.learner_strategy!r}: use PACK, SPREAD, STRICT_PACK "
                              "or STRICT_SPREAD")
        if self.agent_strategy not in ("DEFAULT", "SPREAD"):
            raise ConfigError(f"ray.agent_strategy={self.agent_strategy!r}: use DEFAULT or SPREAD")
        if self.learner_node not in ("auto", "driver", "any"):
            raise ConfigError(f"ray.learner_node={self.learner_node!r}: use auto, driver or any")
        if self.learner_workers > 1 and self.learner.num_gpus % 1:
            raise ConfigError(f"ray.learner.num_gpus={self.learner.num_gpus:g} with learner_workers > 1: each rank "
                              "needs whole GPUs (NCCL ranks cannot share one)")
        if self.max_restarts < -1:
            raise ConfigError(f"ray.max_restarts={self.max_restarts}: use -1 (always) or a count >= 0")


def ray_config(address: str = "", overrides: list[str] = ()) -> RayConfig:
    cfg = load_config(RayConfig, None, [f"address={address}", *overrides] if address else list(overrides))
    cfg.validate()
    return cfg


def _actor_class():
    import ray

    return ray.remote(RoleActor)


def actor_options(res: RoleResources, name: str, max_restarts: int) -> dict[str, Any]:
    opts: dict[str, Any] = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus, "name": name,
                            "max_restarts": max_restarts, "max_task_retries": -1 if max_restarts else 0}
    if res.memory_mb:
        opts["memory"] = res.memory_mb * 2**20
    if res.resources:
        opts["resources"] = dict(res.resources)
    return opts


# ----------------------------------------------------------------------------------------- the driver

def _ray_errors():
    from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

    return ActorDiedError, (ActorUnavailableError, GetTimeoutError)


class ActorRole:
    """The `proc` of a role that runs on Ray (Popen-like: `poll()`, `returncode`, `pid`): one actor, or
    the gang of learner ranks. Watching it also restarts a gang whose rank was restarted by Ray."""

    def __init__(self, name: str, actors: list, gang: bool, stop_timeout_s: float, demand: str = "",
                 max_restarts: int = -1) -> None:
        self.name, self.actors, self.gang, self.stop_timeout_s = name, actors, gang, stop_timeout_s
        self.max_restarts, self.gang_restarts = max_restarts, 0
        self.demand, self.created, self.warned = demand, time.monotonic(), False
        self.returncode: int | None = None
        self.restarts, self.statuses = 0, []  # actor restarts seen (a gang restart: once per rank); last statuses
        self._incarnation: dict[int, int] = {}  # rank -> actor pid last seen
        self._checked = 0.0
        self.places: list[dict[str, Any]] = []  # where each actor landed (RoleActor.where), for a gang
        if gang:
            self.start_gang()

    @property
    def pid(self) -> int | None:
        return self.statuses[0]["pid"] if self.statuses else None

    def start_gang(self) -> None:
        import ray

        self.places = ray.get([a.where.remote() for a in self.actors])
        addr, port = ray.get(self.actors[0].rendezvous.remote())
        ray.get([a.start.remote(env) for a, env in zip(self.actors, gang_env(self.places, addr, port))])

    def refresh(self, timeout: float = 2.0) -> list[dict[str, Any]] | None:
        """The actors' statuses, or None while one is being restarted (or its role failed for good)."""
        import ray

        died, unavailable = _ray_errors()
        refs = [a.status.remote() for a in self.actors]
        try:
            statuses = ray.get(refs, timeout=timeout)
        except died as e:
            self.returncode = -signal.SIGKILL  # restarts exhausted (max_restarts) or killed for good
            print(f"{self.name}: actor died for good: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
            return None
        except unavailable:
            return None
        for rank, st in enumerate(statuses):
            seen = self._incarnation.setdefault(rank, -1 if st["reconstructed"] else st["actor_pid"])
            if seen != st["actor_pid"]:  # (restarts before the first look count as one)
                self._incarnation[rank] = st["actor_pid"]
                self.restarts += 1
                print(f"{self.name}: rank {rank} restarted by Ray on {st['node']} "
                      f"(restart {self.restarts})", flush=True)
        self.statuses = statuses
        return statuses

    def poll(self) -> int | None:
        if self.returncode is not None or time.monotonic() - self._checked < 1.0:
            return self.returncode
        self._checked = time.monotonic()
        statuses = self.refresh()
        if statuses is None:
            self._warn_if_pending()
            return self.returncode
        action, rc = role_verdict(statuses, self.gang, self.max_restarts, self.gang_restarts)
        if action == "restart":
            self.restart_gang()  # a lone rank cannot rejoin the process group: all ranks start again
        else:
            self.returncode = rc
        return self.returncode

    def _warn_if_pending(self) -> None:
        import ray

        if self.statuses or self.warned or time.monotonic() - self.created < 60:
            return
        self.warned = True
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        print(f"warning: {self.name} has not started after 60 s: it asks for {self.demand}, the cluster has {free} "
              "free (lower it with --set ray.agent.num_cpus=0.5)", file=sys.stderr, flush=True)

    def restart_gang(self) -> None:
        import ray

        self.gang_restarts += 1
        print(f"{self.name}: restarting all {len(self.actors)} ranks (gang restart {self.gang_restarts})", flush=True)
        ray.get([a.stop.remote(self.stop_timeout_s) for a in self.actors])
        self.start_gang()

    def stop(self, timeout: float) -> int | None:
        import ray

        died, unavailable = _ray_errors()
        try:
            codes = ray.get([a.stop.remote(timeout) for a in self.actors], timeout=timeout + 30)
        except (died, *unavailable):
            return self.returncode
        if self.returncode is None:
            self.returncode = next((c for c in codes if c not in (0, None)), 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} still running after {timeout} s")
            time.sleep(0.5)
        return self.returncode

    def tail(self, lines: int = 20) -> str:
        import ray

        try:
            return "\n".join(ray.get([a.tail.remote(lines) for a in self.actors], timeout=10))
        except Exception as e:  # a dead actor has no log to give; say why instead
            return f"(log unavailable: {type(e).__name__})"

    def kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)


def init_ray(cfg: RayConfig) -> bool:
    """Connect to (or start) Ray; False when this process was already connected."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": cfg.namespace, "log_to_driver": False, "include_dashboard": False}
    if cfg.address:
        kwargs["address"] = cfg.address
    elif not os.environ.get("RAY_ADDRESS"):  # (with it set, ray.init joins that cluster)
        kwargs["num_cpus"] = cfg.local_num_cpus or max(os.cpu_count() or 1, 8)
    if cfg.runtime_env:
        kwargs["runtime_env"] = dict(cfg.runtime_env)
    ray.init(**kwargs)
    return True


def distributed_learner(argv: list[str]) -> bool:
    """Does this `sao learn` argv select the megatron backend (`--backend megatron`, `--set backend.name=megatron`)?
    (`sao up` always passes `--backend`: the run's config.yaml is not read here.)"""
    pairs = list(zip(argv, argv[1:] + [""]))
    return ("--backend=megatron" in argv or any(a == "--backend" and b == "megatron" for a, b in pairs)
            or any(a == "--set" and b == "backend.name=megatron" for a, b in pairs))


def _loopback(bootstrap: str) -> bool:
    return any(h.split(":")[0] in ("127.0.0.1", "localhost", "::1") for h in bootstrap.split(",") if h)


class RaySupervisor:
    """`streamer.launch.processes.Supervisor`'s interface: agents and the learner as Ray actors, the rest local."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None, cfg: RayConfig,
                 weights_transport: str = "directory") -> None:
        self.cfg, self.env, self.weights_transport = cfg, dict(env or {}), weights_transport
        self.run_dir, self.files = "", {}  # the files every actor writes into its node's run dir (`ship`)
        self.log_dir = Path(log_dir).resolve()
        self.local = Supervisor(log_dir, env)
        self.roles: list[Role] = []
        self.placement_groups: list = []
        self.entry = list(SAO)  # how an actor runs a role: python <entry> <argv>
        self.owns_ray = init_ray(cfg)
        bootstrap = self.env.get("SAO_BOOTSTRAP", "")
        if cfg.address and _loopback(bootstrap):
            print(f"warning: Kafka at {bootstrap} is loopback-only: actors on other nodes cannot reach it "
                  "(use --bootstrap host:port of a Kafka every node can reach)", file=sys.stderr, flush=True)

    def start(self, role: Role) -> Role:
        if role.argv[0] not in RAY_ROLES:
            self.local.start(role)
        else:
            role.proc = self._start_actors(role)
        self.roles.append(role)
        return role

    def _start_actors(self, role: Role) -> ActorRole:
        learner = role.argv[0] == "learn"
        res = self.cfg.learner if learner else self.cfg.agent
        n = self.cfg.learner_workers if learner else 1
        if n > 1 and not distributed_learner(role.argv):
            raise ConfigError(f"ray.learner_workers={n}: only the megatron backend trains as one job over "
                              "several ranks; add --set backend.name=megatron, or use learner_workers=1 (the torch "
                              f"backend would run {n} independent learners on one checkpoint directory)")
        run = self.env.get("SAO_RUN", "sao")
        import ray

        # with a runtime_env working_dir the role runs in it (the code shipped), not in a checkout at our cwd
        cwd = "" if "working_dir" in self.cfg.runtime_env else os.getcwd()
        driver = ray.get_runtime_context().get_node_id()
        common = dict(argv=role.argv, env=self.env, log_dir=str(self.log_dir), cwd=cwd, entry=self.entry,
                      min_uptime_s=self.cfg.min_uptime_s, driver_node=driver, run_dir=self.run_dir, files=self.files)
        actors, pg = [], self._placement_group(res, n) if n > 1 else None
        for rank in range(n):
            opts = actor_options(res, f"{run}/{role.name}" + (f"-{rank}" if n > 1 else ""), self.cfg.max_restarts)
            if pg is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
            elif not learner and self.cfg.agent_strategy == "SPREAD":
                opts["scheduling_strategy"] = "SPREAD"
            elif learner and learner_on_driver(self.cfg, self.weights_transport):
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(driver, soft=False)
            name = f"{role.name}-{rank}" if n > 1 else role.name
            actors.append(_actor_class().options(**opts).remote(**{**common, "name": name}, autostart=n == 1))
        demand = f"{n} x {res.num_cpus:g} CPU" + (f" + {res.num_gpus:g} GPU" if res.num_gpus else "")
        return ActorRole(role.name, actors, gang=n > 1, stop_timeout_s=self.cfg.stop_timeout_s, demand=demand,
                         max_restarts=self.cfg.max_restarts)

    def _placement_group(self, res: RoleResources, n: int):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        bundle = {"CPU": res.num_cpus, **({"GPU": res.num_gpus} if res.num_gpus else {}), **res.resources}
        pg = placement_group([dict(bundle) for _ in range(n)], strategy=self.cfg.learner_strategy)
        try:
            ray.get(pg.ready(), timeout=300)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(f"ray: no room for {n} learner ranks of {bundle} ({self.cfg.learner_strategy}) after "
                               f"300 s; free: {ray.available_resources()}") from None
        self.placement_groups.append(pg)
        return pg

    def ship(self, run_dir: Path, files: dict[str, str]) -> None:
        """The run's files by value (name -> text: config.yaml), written by each actor on its node (`RoleActor`)."""
        self.run_dir, self.files = str(Path(run_dir).resolve()), dict(files)

    def check_shared(self, needs: list[Need]) -> None:
        """ConfigError unless the nodes running the roles of each need share its path (`ray_nodes.check_paths`)."""
        check_paths(needs, {r.name: r.proc.actors for r in self.roles if isinstance(r.proc, ActorRole)})

    def restart_dead(self) -> list[tuple[Role, int]]:
        """Ray restarts its actors itself (RayConfig max_restarts); the local roles are not restarted here."""
        return []

    def failed(self) -> list[Role]:
        """Required roles that exited with an error (a role Ray is restarting has not failed)."""
        return [r for r in self.roles if r.required and r.proc.poll() not in (None, 0)]

    def tail(self, role: Role, lines: int = 20) -> str:
        return role.proc.tail(lines) if isinstance(role.proc, ActorRole) else self.local.tail(role, lines)

    def stop(self, role: Role, timeout: float | None = None) -> int | None:
        timeout = self.cfg.stop_timeout_s if timeout is None else timeout
        if isinstance(role.proc, ActorRole):
            return role.proc.stop(timeout)
        return self.local.stop(role, timeout)

    def stop_all(self, timeout: float | None = None) -> None:
        for role in reversed(self.roles):  # consumers of a role stop before it
            self.stop(role, timeout)
        self.shutdown()

    def shutdown(self) -> None:
        """Remove this run's actors and placement groups (and Ray itself when we started it)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for role in self.roles:
            if isinstance(role.proc, ActorRole):
                role.proc.kill()
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.placement_groups = []
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False

    def wait(self, role: Role, timeout: float | None = None) -> int:
        return role.proc.wait(timeout) if isinstance(role.proc, ActorRole) else self.local.wait(role, timeout)
