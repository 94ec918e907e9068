"""`sao up`: the whole pipeline on the embedded default, in one command.

    sao up                                   # default scenario, 2 agents, SAO, dashboard on :8501
    sao up --scenario benchmark --agents 3 --loss ppo
    sao up --bootstrap kafka:9092 --no-dashboard --set batch.tokens=2048

Starts the embedded broker (unless --bootstrap), creates the run's topics, warms up the tiny
policy (cached under runs/cache), then runs the metrics app, the learner, the agents, the
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

from streamer.processes import Role, Supervisor


@dataclass
class UpConfig:
    scenario: str = "default"
    run: str = ""  # "" -> up-<date>-<time>
    runs_dir: str = "runs"
    bootstrap: str = ""  # "" -> start the embedded broker
    agents: int = 2
    group_size: int = 1  # >1 for the GRPO family (set advantage.estimator too)
    loss: str = "sao"
    sync: bool = False
    sync_batch: int = 64  # with --sync: trajectories per policy version (the learner's batch.sync_batch)
    limit: int = 0  # stop the simulator after this many tasks (0: the whole scenario)
    realtime: bool = False  # publish tasks at the scenario's rate instead of all at once
    dashboard: bool = True
    eval: bool = True  # held-out greedy evaluation of each policy version (eval reward, forgetting)
    eval_interval: float = 30.0  # seconds between evaluations (each costs about 16 s of one core)
    dashboard_port: int = 8501
    max_seconds: float = 0.0  # stop after this long (0: at the scenario's end)
    drain_seconds: float = 5.0  # after the last trajectory, let the learner finish its batch
    pretrain: list[str] = field(default_factory=list)  # PretrainConfig overrides
    learner: list[str] = field(default_factory=list)  # LearnerConfig overrides
    agent: list[str] = field(default_factory=list)  # AgentSettings overrides, e.g. concurrency=8
    ray: bool = False  # agents and learner as Ray actors (streamer.ray_launch)
    ray_address: str = ""  # join this Ray cluster ("auto", "ray://head:10001"); implies --ray
    ray_set: list[str] = field(default_factory=list)  # RayConfig overrides, e.g. agent.num_cpus=2


def parse_args(argv: list[str]) -> UpConfig:
    d = UpConfig()
    p = argparse.ArgumentParser(prog="sao up", description=__doc__.split("\n")[0])
    p.add_argument("--scenario", default=d.scenario, help="scenario file or name under simulator/scenarios/")
    p.add_argument("--run", default=d.run, help="run name (topic prefix, directory under --runs-dir)")
    p.add_argument("--runs-dir", default=d.runs_dir)
    p.add_argument("--bootstrap", default=d.bootstrap, help="use this Kafka instead of the embedded broker")
    p.add_argument("--agents", type=int, default=d.agents)
    p.add_argument("--group-size", type=int, default=d.group_size)
    p.add_argument("--loss", default=d.loss, help="policy loss: sao, ppo, dual_clip, dapo, gspo, cispo, decoupled_ppo")
    p.add_argument("--sync", action="store_true", help="synchronous baseline: agents wait for each version")
    p.add_argument("--sync-batch", type=int, default=d.sync_batch, help="with --sync: trajectories per version")
    p.add_argument("--limit", type=int, default=d.limit, help="stop the simulator after this many tasks")
    p.add_argument("--realtime", action="store_true", help="publish tasks at the scenario's rate")
    p.add_argument("--no-dashboard", dest="dashboard", action="store_false")
    p.add_argument("--no-eval", dest="eval", action="store_false", help="no held-out evaluation")
    p.add_argument("--eval-interval", type=float, default=d.eval_interval)
    p.add_argument("--dashboard-port", type=int, default=d.dashboard_port)
    p.add_argument("--max-seconds", type=float, default=d.max_seconds)
    p.add_argument("--drain-seconds", type=float, default=d.drain_seconds)
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
    if cfg.agents < 1:
        p.error(f"--agents {cfg.agents}: need at least one agent")
    cfg.run = cfg.run or time.strftime("up-%Y%m%d-%H%M%S")
    cfg.ray = cfg.ray or bool(cfg.ray_address)
    if cfg.ray:
        from streamer.config import ConfigError
        from streamer.ray_launch import ray_config

        try:
            ray_config(cfg.ray_address, cfg.ray_set)
        except ConfigError as e:
            p.error(f"--ray-set: {e}")
    return cfg


def warm_start(cfg: UpConfig) -> Path:
    from learner.pretrain import PretrainConfig, pretrain
    from streamer.config import load_config

    pcfg = load_config(PretrainConfig, None, [f"scenario={cfg.scenario}", f"cache_dir={cfg.runs_dir}/cache",
                                              *cfg.pretrain])
    return pretrain(pcfg, log=lambda line: print(line, flush=True))


def roles(cfg: UpConfig, bootstrap: str, run_dir: Path, init: Path) -> list[Role]:
    common = ["--bootstrap", bootstrap, "--run", cfg.run]
    weights = str(run_dir / "weights")
    learner = ["learn", *common, "--init", str(init), "--weights-dir", weights, "--run-dir", str(run_dir),
               "--checkpoint-dir", str(run_dir / "checkpoints"), "--loss", cfg.loss, *cfg.learner]
    if cfg.sync:
        learner += ["--sync", f"batch.sync_batch={cfg.sync_batch}"]
    out = [Role("metrics", ["metrics", *common]), Role("learner", learner)]
    for i in range(cfg.agents):
        agent = ["agent", *common, "--model", str(init), "--weights-dir", weights, "--group-size",
                 str(cfg.group_size), "--status-file", str(run_dir / f"agent-{i}.json")]
        if cfg.sync:  # each agent answers its share of a batch, then waits for the next version
            agent += ["--set", f"tasks_per_version={max(1, cfg.sync_batch // cfg.agents)}", "--set", "versions_ahead=0"]
        for kv in cfg.agent:
            agent += ["--set", kv]
        out.append(Role(f"agent-{i}", agent))
    if cfg.eval:
        out.append(Role("eval", ["eval", *common, "--scenario", cfg.scenario, "--model", str(init), "--weights-dir",
                                 weights, "--threads", "1", "--min-interval", str(cfg.eval_interval)], required=False))
    if cfg.dashboard:
        out.append(Role("dashboard", ["dashboard", "--runs", cfg.runs_dir, "--port", str(cfg.dashboard_port),
                                      *common], required=False))
    simulate = ["simulate", "--scenario", cfg.scenario, *common]
    if cfg.limit:
        simulate += ["--limit", str(cfg.limit)]
    if cfg.realtime:
        simulate.append("--realtime")
    out.append(Role("simulator", simulate))
    return out


def progress_line(t0: float, tap) -> str:
    ev = tap.learner
    learner = f"step {ev.step} v{ev.version}" if ev else "step -"
    reward = tap.mean_reward
    reward_txt = "-" if math.isnan(reward) else f"{reward:.3f}"
    return (f"[{time.monotonic() - t0:6.0f}s] tasks {tap.tasks} answered {len(tap.task_ids)} "
            f"reward(last {tap.recent_rewards.maxlen}) {reward_txt} learner {learner} drifts {tap.drifts} "
            f"dlq {tap.consumer.dead_letters}")


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
    files = [run_dir / f"agent-{i}.json" for i in range(cfg.agents)]
    while not all(f.is_file() for f in files) and not sup.failed() and time.monotonic() - t0 < timeout_s:
        time.sleep(0.5)
    print(f"agents ready after {time.monotonic() - t0:.0f}s: starting the simulator", flush=True)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(cfg: UpConfig) -> int:
    from streamer.artifacts import summarize, write_json
    from streamer.broker import BrokerSettings, EmbeddedBroker
    from streamer.bus import KafkaBus
    from streamer.tap import close_tap, open_tap
    from streamer.topics import partitions_by_topic

    run_dir = Path(cfg.runs_dir) / cfg.run
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    broker = None
    if not cfg.bootstrap:
        broker = EmbeddedBroker(BrokerSettings(port=0, log_path=str(run_dir / "logs" / "broker.log"))).start()
        print(f"broker: embedded Tansu at {broker.bootstrap}", flush=True)
    bootstrap = cfg.bootstrap or broker.bootstrap
    env = {"SAO_BOOTSTRAP": bootstrap, "SAO_RUN": cfg.run}
    if cfg.ray:  # agents and learner as Ray actors; broker, simulator, metrics, dashboard stay local
        from streamer.ray_launch import RaySupervisor, ray_config

        sup = RaySupervisor(run_dir / "logs", env, ray_config(cfg.ray_address, cfg.ray_set))
    else:
        sup = Supervisor(run_dir / "logs", env=env)
    tap, tap_thread = None, None
    reason = "interrupted (Ctrl-C or SIGTERM)"
    # A shell starts `nohup sao up ... &` with SIGINT ignored, and SIGTERM kills without cleanup: both
    # would leave the children running and no summary.json. Both stop the run the Ctrl-C way.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        KafkaBus(bootstrap).create_topics(partitions_by_topic(cfg.run))
        init = warm_start(cfg)
        tap = open_tap(bootstrap, cfg.run, str(run_dir), config={"up": asdict(cfg), "init": str(init)})
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
        print(f"run {cfg.run}: {cfg.agents} agents, loss {cfg.loss}; logs in {run_dir / 'logs'}; Ctrl-C stops",
              flush=True)
        t0, last_print, last_new, seen = time.monotonic(), 0.0, [time.monotonic()], 0
        while True:
            time.sleep(0.5)
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
    summary = summarize(run_dir)
    summary["stopped"] = reason
    write_json(run_dir / "summary.json", summary)
    print(f"summary: {run_dir / 'summary.json'}", flush=True)
    return 1 if reason.startswith("failed") else 0


def main(argv: list[str]) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
