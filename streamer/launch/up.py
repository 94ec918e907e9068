"""`sao up`: the whole pipeline on the embedded default, in one command.

    sao up                                   # default scenario, resource plan, SAO, dashboard on :8501
    sao up --scenario benchmark --agents 3 --loss ppo
    sao up --bootstrap kafka:9092 --no-dashboard --batch 32 --staleness 4 --set optim.lr=1e-4

Warms up the tiny policy (cached under runs/cache), starts the embedded broker (unless
--bootstrap) and creates the run's topics, then runs the metrics app, the learner, the agents, the
dashboard and the simulator as child processes (logs in runs/<run>/logs/) and records the run
into runs/<run>/ in-process. It stops at the scenario's end (every task answered) or on Ctrl-C,
leaving config.json, the tables (Parquet), checkpoints and summary.json.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from streamer.launch.processes import Role, Supervisor
from streamer.launch.resources import (AGENT_NICE, SIDE_NICE, Admission, ResourcePlan, available_cores, check_pacing,
                                paced_admission, plan_resources, thread_env)


@dataclass
class UpConfig:
    scenario: str = "default"
    run: str = ""  # "" -> up-<date>-<time>
    runs_dir: str = "runs"
    bootstrap: str = ""  # "" -> start the embedded broker
    agents: int = 0  # 0: from the resource plan (one per core the learner leaves, 1 on 2 cores)
    group_size: int = 1  # >1 for the GRPO family (set advantage.estimator too)
    loss: str = "sao"
    seed: int = -1  # >= 0: the task stream's, the learner's and the agents' seeds (-1: the scenario's and defaults)
    batch: int = 64  # trajectories per learner batch (batch.max_trajectories); agents generate one per version
    staleness: int = 2  # versions a trajectory may lag the learner: learner max_staleness and agent admission
    sync: bool = False
    sync_batch: int = 64  # with --sync: trajectories per policy version (the learner's batch.sync_batch)
    limit: int = 0  # stop the simulator after this many tasks (0: the whole scenario)
    realtime: bool = False  # publish tasks at the scenario's rate instead of as fast as the agents answer
    max_lag: int = -1  # simulator back-pressure: tasks published ahead of the agents (-1: derived, 0: none)
    dashboard: bool = True
    eval: bool | None = None  # held-out greedy evaluation of each policy version; None: on above 2 cores
    eval_interval: float = 30.0  # seconds between evaluations (each costs about 16 s of one core)
    cores: int = 0  # cores the resource plan shares out (0: those this process may run on)
    dashboard_port: int = 8501
    max_seconds: float = 0.0  # stop after this long (0: at the scenario's end)
    drain_seconds: float = 5.0  # after the last trajectory, let the learner finish its batch
    restarts: int = 3  # times each crashed role (learner, agent, metrics app, dashboard) is started again
    pretrain: list[str] = field(default_factory=list)  # PretrainConfig overrides
    learner: list[str] = field(default_factory=list)  # LearnerConfig overrides
    agent: list[str] = field(default_factory=list)  # AgentSettings overrides, e.g. concurrency=8
    ray: bool = False  # agents and learner as Ray actors (streamer.launch.ray_launch)
    ray_address: str = ""  # join this Ray cluster ("auto", "ray://head:10001"); implies --ray
    ray_set: list[str] = field(default_factory=list)  # RayConfig overrides, e.g. agent.num_cpus=2

    def plan(self) -> ResourcePlan:
        return plan_resources(self.cores or available_cores(), self.agents, self.eval)

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


# learner settings that `sao up` derives from --batch / --staleness / the resource plan, validated together
PACED_KEYS = ("batch.max_staleness", "batch.max_trajectories", "batch.tokens", "batch.sync_batch", "threads")
# a batch must close at --batch trajectories, not at a token budget: agents generate exactly one batch per version
TOKENS_PER_TRAJECTORY = 1024
PACED_AGENT_KEYS = ("tasks_per_version", "versions_ahead", "threads")


def _check_overrides(p: argparse.ArgumentParser, cfg: UpConfig) -> None:
    for flag, given, keys in (("--set", cfg.learner, PACED_KEYS), ("--agent-set", cfg.agent, PACED_AGENT_KEYS)):
        for kv in given:
            key = kv.split("=", 1)[0].strip()
            if key in keys:
                p.error(f"{flag} {kv}: sao up derives {key} from --batch, --staleness, --sync-batch and the resource "
                        f"plan (--cores, --agents); set those instead so learner and agents stay consistent")
    if cfg.batch < 1 or cfg.staleness < 0:
        p.error(f"--batch {cfg.batch} / --staleness {cfg.staleness}: need batch >= 1 and staleness >= 0")


def parse_args(argv: list[str]) -> UpConfig:
    d = UpConfig()
    p = argparse.ArgumentParser(prog="sao up", description=__doc__.split("\n")[0])
    p.add_argument("--scenario", default=d.scenario, help="scenario file or name under simulator/scenarios/")
    p.add_argument("--run", default=d.run, help="run name (topic prefix, directory under --runs-dir)")
    p.add_argument("--runs-dir", default=d.runs_dir)
    p.add_argument("--bootstrap", default=d.bootstrap, help="use this Kafka instead of the embedded broker")
    p.add_argument("--agents", type=int, default=d.agents, help="agent processes (0: from the resource plan)")
    p.add_argument("--group-size", type=int, default=d.group_size)
    p.add_argument("--loss", default=d.loss, help="policy loss: sao, ppo, dual_clip, dapo, gspo, cispo, decoupled_ppo")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the task stream, learner and agents")
    p.add_argument("--batch", type=int, default=d.batch, help="trajectories per learner batch (one per version)")
    p.add_argument("--staleness", type=int, default=d.staleness,
                   help="versions a trajectory may lag the learner; agents are admitted to stay within it")
    p.add_argument("--cores", type=int, default=d.cores, help="cores to plan for (0: all this process may use)")
    p.add_argument("--sync", action="store_true", help="synchronous baseline: agents wait for each version")
    p.add_argument("--sync-batch", type=int, default=d.sync_batch, help="with --sync: trajectories per version")
    p.add_argument("--limit", type=int, default=d.limit, help="stop the simulator after this many tasks")
    p.add_argument("--realtime", action="store_true", help="publish tasks at the scenario's rate")
    p.add_argument("--max-lag", type=int, default=d.max_lag,
                   help="simulator back-pressure: tasks published ahead of the agents (-1: derived, 0: none)")
    p.add_argument("--no-dashboard", dest="dashboard", action="store_false")
    p.add_argument("--eval", dest="eval", action="store_true", default=None,
                   help="held-out evaluation of each version (default: on above 2 cores)")
    p.add_argument("--no-eval", dest="eval", action="store_false", help="no held-out evaluation")
    p.add_argument("--eval-interval", type=float, default=d.eval_interval)
    p.add_argument("--dashboard-port", type=int, default=d.dashboard_port)
    p.add_argument("--max-seconds", type=float, default=d.max_seconds)
    p.add_argument("--drain-seconds", type=float, default=d.drain_seconds)
    p.add_argument("--restarts", type=int, default=d.restarts,
                   help="restarts of each crashed role (it resumes from its checkpoint or committed offsets)")
    p.add_argument("--pretrain", action="append", default=[], metavar="KEY=VALUE", help="warm-start override")
    p.add_argument("--set", dest="learner", action="append", default=[], metavar="KEY=VALUE",
                   help="learner override, e.g. batch.tokens=2048")
    p.add_argument("--agent-set", dest="agent", action="append", default=[], metavar="KEY=VALUE",
                   help="agent override, e.g. concurrency=8 (tasks in flight per agent)")
    p.add_argument("--ray", action="store_true", help="run agents and learner as Ray actors (local Ray if no address)")
    p.add_argument("--ray-address", default=d.ray_address, help="join this Ray cluster: auto, ray://head:10001")
    p.add_argument("--ray-set", dest="ray_set", action="append", default=[], metavar="KEY=VALUE",
                   help="Ray resources/restarts, e.g. agent.num_cpus=2 learner.num_gpus=1 max_restarts=5")
    cfg = UpConfig(**vars(p.parse_args(argv)))
    if cfg.agents < 0:
        p.error(f"--agents {cfg.agents}: need at least one agent (0: from the resource plan)")
    _check_overrides(p, cfg)
    cfg.run = cfg.run or time.strftime("up-%Y%m%d-%H%M%S")
    cfg.ray = cfg.ray or bool(cfg.ray_address)
    if cfg.ray:
        from streamer.wire.config import ConfigError
        from streamer.launch.ray_launch import ray_config

        try:
            ray_config(cfg.ray_address, cfg.ray_set)
        except ConfigError as e:
            p.error(f"--ray-set: {e}")
    return cfg


def warm_start(cfg: UpConfig) -> Path:
    from learner.pretrain import PretrainConfig, pretrain
    from streamer.wire.config import load_config

    pcfg = load_config(PretrainConfig, None, [f"scenario={cfg.scenario}", f"cache_dir={cfg.runs_dir}/cache",
                                              *cfg.pretrain])
    return pretrain(pcfg, log=lambda line: print(line, flush=True))


def roles(cfg: UpConfig, bootstrap: str, run_dir: Path, init: Path) -> list[Role]:
    plan, adm = cfg.plan(), cfg.admission()
    common = ["--bootstrap", bootstrap, "--run", cfg.run]
    weights = str(run_dir / "weights")
    side = {"env": thread_env(1), "nice": SIDE_NICE}
    learner = ["learn", *common, "--init", str(init), "--weights-dir", weights, "--run-dir", str(run_dir),
               "--checkpoint-dir", str(run_dir / "checkpoints"), "--loss", cfg.loss,
               f"threads={plan.learner_threads}", f"batch.max_staleness={cfg.staleness}",
               f"batch.max_trajectories={cfg.batch}", f"batch.tokens={cfg.batch * TOKENS_PER_TRAJECTORY}",
               *seeded(cfg, 0), *cfg.learner]
    if cfg.sync:
        learner += ["--sync", f"batch.sync_batch={cfg.sync_batch}"]
    out = [Role("metrics", ["metrics", *common], **side),
           Role("learner", learner, env=thread_env(plan.learner_threads))]
    for i in range(plan.agents):
        agent = ["agent", *common, "--model", str(init), "--weights-dir", weights, "--group-size",
                 str(cfg.group_size), "--status-file", str(run_dir / f"agent-{i}.json")]
        for kv in (f"threads={plan.agent_threads}", f"concurrency={adm.concurrency}",
                   f"tasks_per_version={adm.tasks_per_version}", f"versions_ahead={adm.versions_ahead}",
                   *seeded(cfg, 1 + i), *cfg.agent):
            agent += ["--set", kv]
        out.append(Role(f"agent-{i}", agent, env=thread_env(plan.agent_threads), nice=AGENT_NICE))
    if plan.eval:
        out.append(Role("eval", ["eval", *common, "--scenario", cfg.scenario, "--model", str(init), "--weights-dir",
                                 weights, "--threads", "1", "--min-interval", str(cfg.eval_interval)], required=False,
                        **side))
    if cfg.dashboard:
        out.append(Role("dashboard", ["dashboard", "--runs", cfg.runs_dir, "--port", str(cfg.dashboard_port),
                                      *common], required=False, **side))
    simulate = ["simulate", "--scenario", cfg.scenario, *common, "--max-lag", str(max_lag(cfg, plan, adm))]
    if cfg.seed >= 0:
        simulate += ["--seed", str(cfg.seed)]
    if cfg.limit:
        simulate += ["--limit", str(cfg.limit)]
    if cfg.realtime:
        simulate.append("--realtime")
    out.append(Role("simulator", simulate, restartable=False, **side))  # a restart would publish the stream again
    return out


def seeded(cfg: UpConfig, offset: int) -> list[str]:
    """`seed=` for a role when --seed is given: each role its own stream of random numbers."""
    return [f"seed={1000 * cfg.seed + offset}"] if cfg.seed >= 0 else []


def max_lag(cfg: UpConfig, plan: ResourcePlan, adm: Admission) -> int:
    """Back-pressure bound: what the agents may hold in flight plus one batch (0 with --realtime unless given)."""
    from streamer.transport.backpressure import default_max_lag

    if cfg.max_lag >= 0:
        return cfg.max_lag
    if cfg.realtime:
        return 0
    return default_max_lag(plan.agents, adm.concurrency, adm.tasks_per_version, adm.versions_ahead,
                           math.ceil(cfg.pacing()[0] / cfg.group_size))


def progress_line(t0: float, tap) -> str:
    ev = tap.learner
    learner = f"step {ev.step} v{ev.version}" if ev else "step -"
    reward = tap.mean_reward
    reward_txt = "-" if math.isnan(reward) else f"{reward:.3f}"
    concepts = " ".join(f"{k} {v:.2f}" for k, v in tap.concept_means().items())
    return (f"[{time.monotonic() - t0:6.0f}s] tasks {tap.tasks} answered {len(tap.task_ids)} "
            f"reward(last {tap.recent_rewards.maxlen}) {reward_txt} learner {learner} drifts {tap.drifts} "
            f"dlq {tap.consumer.dead_letters} | last 64 per newest concept: {concepts}")


def finished(cfg: UpConfig, sup: Supervisor, simulator: Role, tap, t0: float, last_new: list[float]) -> str | None:
    """Why the run is over, or None."""
    if cfg.max_seconds and time.monotonic() - t0 > cfg.max_seconds:
        return f"--max-seconds {cfg.max_seconds} reached"
    bad = sup.failed()
    if bad:
        return "failed: " + ", ".join(f"{r.name} exited {r.proc.returncode}" for r in bad)
    done = simulator.proc.poll() == 0 and tap.tasks > 0 and len(tap.task_ids) >= tap.tasks
    if done and time.monotonic() - last_new[0] > cfg.drain_seconds:
        return "scenario finished: every task answered"
    return None


def wait_for_agents(cfg: UpConfig, sup: Supervisor, run_dir: Path, timeout_s: float = 180.0) -> None:
    """With --realtime, publish only once every agent is up (its status file written): agents take
    ~20 s to load, and a stream published meanwhile would reach them as a backlog, phases mixed
    across partitions, instead of at the scenario's rate."""
    t0 = time.monotonic()
    files = [run_dir / f"agent-{i}.json" for i in range(cfg.plan().agents)]
    while not all(f.is_file() for f in files) and not sup.failed() and time.monotonic() - t0 < timeout_s:
        time.sleep(0.5)
    print(f"agents ready after {time.monotonic() - t0:.0f}s: starting the simulator", flush=True)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(cfg: UpConfig) -> int:
    from streamer.runs.artifacts import summarize, write_json
    from streamer.transport.broker import BrokerSettings, EmbeddedBroker
    from streamer.transport.bus import KafkaBus
    from streamer.runs.tap import close_tap, open_tap
    from streamer.wire.topics import partitions_by_topic

    run_dir = Path(cfg.runs_dir) / cfg.run
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("agent-*.json"):  # a restarted agent resumes from its status: not an older run's
        stale.unlink()
    adm, (batch, staleness) = cfg.admission(), cfg.pacing()
    print(f"{cfg.plan().describe()}\nadmission: learner batch {batch}, staleness "
          f"<= {staleness}; each agent starts {adm.tasks_per_version} task(s) per version, "
          f"{adm.versions_ahead} version(s) ahead", flush=True)
    print("[1/4] warm start of the tiny policy (supervised, cached under runs/cache); nothing else runs meanwhile",
          flush=True)
    try:
        init = warm_start(cfg)  # before the broker: the 2 cores of a small machine are the warm start's alone
    except KeyboardInterrupt:
        print("stopping: interrupted during the warm start (nothing else was started)", flush=True)
        return 130
    broker = None
    print("[2/4] broker: " + ("starting the embedded Tansu broker" if not cfg.bootstrap else cfg.bootstrap), flush=True)
    if not cfg.bootstrap:
        broker = EmbeddedBroker(BrokerSettings(port=0, log_path=str(run_dir / "logs" / "broker.log"))).start()
        print(f"      embedded Tansu at {broker.bootstrap}", flush=True)
    bootstrap = cfg.bootstrap or broker.bootstrap
    env = {"SAO_BOOTSTRAP": bootstrap, "SAO_RUN": cfg.run}
    if cfg.ray:  # agents and learner as Ray actors; broker, simulator, metrics, dashboard stay local
        from streamer.launch.ray_launch import RaySupervisor, ray_config

        sup = RaySupervisor(run_dir / "logs", env, ray_config(cfg.ray_address, cfg.ray_set))
    else:
        sup = Supervisor(run_dir / "logs", env=env, restarts=cfg.restarts)
    tap, tap_thread = None, None
    reason = "interrupted (Ctrl-C or SIGTERM)"
    # A shell starts `nohup sao up ... &` with SIGINT ignored, and SIGTERM kills without cleanup: both
    # would leave the children running and no summary.json. Both stop the run the Ctrl-C way.
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # restored at the end:
    signal.signal(signal.SIGINT, _interrupt)  # an ignored SIGINT would be inherited by later child processes
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        KafkaBus(bootstrap).create_topics(partitions_by_topic(cfg.run))
        print("[3/4] starting the roles: metrics app, learner, agents" + (", evaluator" if cfg.plan().eval else "")
              + (", dashboard" if cfg.dashboard else "") + ", simulator", flush=True)
        tap = open_tap(bootstrap, cfg.run, str(run_dir), config={"up": asdict(cfg), "init": str(init),
                                                                    "plan": asdict(cfg.plan()), "admission": asdict(adm)})
        tap_thread = threading.Thread(target=tap.run, name="tap", daemon=True)
        tap_thread.start()
        plan = roles(cfg, bootstrap, run_dir, init)
        for role in plan[:-1]:
            sup.start(role)
        if cfg.realtime and not cfg.ray:
            wait_for_agents(cfg, sup, run_dir)
        sup.start(plan[-1])  # the simulator
        if cfg.dashboard:
            print(f"dashboard: http://localhost:{cfg.dashboard_port}", flush=True)
        print(f"[4/4] run {cfg.run}: {cfg.plan().agents} agent(s), loss {cfg.loss}; progress every 5 s; logs in "
              f"{run_dir / 'logs'}; Ctrl-C stops", flush=True)
        t0, last_print, last_new, seen = time.monotonic(), 0.0, [time.monotonic()], 0
        while True:
            time.sleep(0.5)
            for role, code in sup.restart_dead():
                print(f"{role.name} exited {code}: restarted ({role.restarts} of {cfg.restarts})", flush=True)
            if len(tap.task_ids) != seen:
                seen, last_new[0] = len(tap.task_ids), time.monotonic()
            if time.monotonic() - last_print >= 5:
                print(progress_line(t0, tap), flush=True)
                last_print = time.monotonic()
            why = finished(cfg, sup, plan[-1], tap, t0, last_new)
            if why:
                reason = why
                break
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave children behind
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"stopping: {reason}", flush=True)
        sup.stop_all()
        for role in sup.failed():
            print(f"--- {role.name} exited {role.proc.returncode}; last log lines:\n{sup.tail(role)}", file=sys.stderr)
        if tap is not None:
            time.sleep(1.0)  # the last messages of the stopped roles
            tap.stop()
            if tap_thread is not None:
                tap_thread.join(timeout=10)
            close_tap(tap, summary=False)
        if broker is not None:
            broker.stop()
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    summary = summarize(run_dir)
    summary["stopped"] = reason
    write_json(run_dir / "summary.json", summary)
    print(f"summary: {run_dir / 'summary.json'}", flush=True)
    return 1 if reason.startswith("failed") else 0


def main(argv: list[str]) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
