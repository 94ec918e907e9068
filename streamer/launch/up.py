"""`sao up`: the whole pipeline on the embedded default, in one command.

    sao up                                   # default scenario, resource plan, SAO, dashboard on :8501
    sao up --scenario benchmark --agents 3 --loss ppo
    sao up --bootstrap kafka:9092 --no-dashboard --batch 32 --staleness 4 --set learner.optim.lr=1e-4
    sao up --config my-run.yaml --set agent.concurrency=8 --set pretrain.steps=600
    sao up --prepare --runs-dir /app/runs    # warm start and config.yaml only (docker compose's `prepare` step)

Warms up the tiny policy (cached under runs/cache), starts the embedded broker (unless
--bootstrap) and creates the run's topics, then runs the metrics app, the learner, the agents, the
dashboard and the simulator as child processes (logs in runs/<run>/logs/) and records the run
into runs/<run>/ in-process. It stops at the scenario's end (every task answered) or on Ctrl-C,
leaving config.yaml (the whole run configuration, `streamer.launch.run_config`: each role read its section),
scenario.yaml (the scenario file as it ran),
config.json, the tables (Parquet), checkpoints and summary.json.
"""

from __future__ import annotations

import argparse
import math
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from learner.profiles import explain as explain_profile
from simulator.scenario import resolve_path
from streamer.launch.processes import Role, Supervisor
from streamer.launch.resources import AGENT_NICE, SIDE_NICE, thread_env
from streamer.launch.run_config import (
    RunConfig,
    UpConfig,
    advertise_on,
    bind_init,
    load_run_config,
    max_lag_default,
    role_env,
    seed_of,
    write_run_config,
)
from streamer.wire.config import ConfigError, add_config_args, set_args

FLAGS = {  # flag -> (type, help); each sets the launch field of the same name (defaults: UpConfig)
    "scenario": (str, "scenario file or name under simulator/scenarios/"),
    "run": (str, "run name (topic prefix, directory under --runs-dir)"),
    "runs_dir": (str, "where run directories go"),
    "bootstrap": (str, "use this Kafka instead of the embedded broker"),
    "agents": (int, "agent processes (0: from the resource plan)"),
    "group_size": (int, "rollouts per task (1: single rollout)"),
    "loss": (str, "policy loss: sao, ppo, dual_clip, dapo, gspo, cispo, decoupled_ppo"),
    "seed": (int, "seed of the task stream, learner and agents"),
    "batch": (int, "trajectories per learner batch (one per version)"),
    "staleness": (int, "versions a trajectory may lag the learner; agents are admitted to stay within it"),
    "cores": (int, "cores to plan for (0: all this process may use)"),
    "sync_batch": (int, "with --sync: trajectories per version"),
    "limit": (int, "stop the simulator after this many tasks"),
    "max_lag": (int, "simulator back-pressure: tasks published ahead of the agents (-1: derived, 0: none)"),
    "stream": (str, "replay this recorded task stream (JSONL, Parquet, CSV; production rows too) instead of the "
                    "scenario's simulator; the scenario still defines the warm start"),
    "speed": (float, "with --stream: time scale of its recorded arrivals (0: as fast as back-pressure lets)"),
    "model": (str, "start from this HF model directory (any causal LM with its tokenizer; a chat template is "
                   "applied to prompts) instead of warm-starting the embedded tiny model"),
    "eval_interval": (float, "seconds between held-out evaluations"),
    "dashboard_port": (int, "the dashboard's port"),
    "max_seconds": (float, "stop after this long (0: at the scenario's end)"),
    "drain_seconds": (float, "after the last trajectory, let the learner finish its batch"),
    "restarts": (int, "restarts of each crashed role (it resumes from its checkpoint or committed offsets)"),
    "broker_silence_s": (float, "stop the run when the broker answers no metadata request for this long (0: never)"),
    "ray_address": (str, "join this Ray cluster: auto, ray://head:10001 (implies --ray)"),
    "weights_transport": (str, "how versions reach the agents: directory (a shared path), http (pulled from a "
                               "weight server beside the learner) or broadcast (a torch.distributed group of the "
                               "learner's rank 0 and the agents; those outside it pull over http)"),
}
SWITCHES = {  # flag -> (field, value, help)
    "sync": ("sync", True, "synchronous baseline: agents wait for each version"),
    "realtime": ("realtime", True, "publish tasks at the scenario's rate"),
    "no_dashboard": ("dashboard", False, "no dashboard"),
    "eval": ("eval", True, "held-out evaluation of each version (default: on above 2 cores)"),
    "no_eval": ("eval", False, "no held-out evaluation"),
    "ray": ("ray", True, "run agents and learner as Ray actors (local Ray if no address)"),
}


PREPARE_HELP = ("warm start (cached) and write <runs-dir>/<run>/config.yaml, then exit: the roles started "
                "elsewhere (docker compose) read their sections of it")


def parse_args(argv: list[str]) -> RunConfig:
    return parse_command(argv)[0]


def parse_command(argv: list[str]) -> tuple[RunConfig, bool]:
    """The run configuration, and whether only to prepare it (--prepare)."""
    p = argparse.ArgumentParser(prog="sao up", description=__doc__.split("\n")[0])
    p.add_argument("--prepare", action="store_true", help=PREPARE_HELP)
    add_config_args(p, "run (sections launch, pretrain, learner, agent, metrics, ray)", "learner.optim.lr=1e-4")
    for name, (kind, help_) in FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=argparse.SUPPRESS, help=help_)
    for name, (dest, value, help_) in SWITCHES.items():
        p.add_argument(f"--{name.replace('_', '-')}", dest=dest, action="store_const", const=value,
                       default=argparse.SUPPRESS, help=help_)
    args = vars(p.parse_args(argv))
    only_prepare = args.pop("prepare")
    path, overrides = args.pop("config"), args.pop("overrides")
    try:
        return load_run_config(path, overrides, args, measure=True), only_prepare
    except ConfigError as e:
        p.error(str(e))


def warm_start(cfg: RunConfig) -> Path:
    from learner.pretrain import pretrain
    from streamer.agent.rollouts import run_tasks

    return pretrain(cfg.pretrain, log=lambda line: print(line, flush=True), run_tasks=run_tasks)


def initial_model(cfg: RunConfig) -> Path:
    """The model every role starts from: --model as it is, else the tiny policy's (cached) warm start; then, with
    finetune.rows, fine-tuned on the demonstrations of the stream's first rows (`learner.finetune`, cached)."""
    up = cfg.launch
    if up.model:
        model = Path(up.model).resolve()
        if not (model / "config.json").is_file():
            raise ConfigError(f"--model {up.model}: not an HF model directory (no config.json)")
        print(f"[1/4] model: {model} (given: no warm start)", flush=True)
    else:
        print("[1/4] warm start of the tiny policy (supervised, cached under runs/cache); nothing else runs "
              "meanwhile", flush=True)
        model = warm_start(cfg)
    if cfg.finetune.rows:
        from learner.finetune import finetune
        from simulator.replay import enable_plugins

        enable_plugins(cfg.agent.verifiers, cfg.agent.tool_envs)
        print(f"      supervised warm start on the demonstrations of the stream's first {cfg.finetune.rows} rows",
              flush=True)
        model = finetune(model, up.stream, cfg.finetune, log=lambda line: print(line, flush=True)).resolve()
    return model


def prepare(cfg: RunConfig) -> Path:
    """The plan, the warm start, then runs/<run>/config.yaml (the run configuration every role reads)."""
    up = cfg.launch
    adm, (batch, staleness) = up.admission(), up.pacing()
    print(f"{up.plan().describe()}\nadmission: learner batch {batch}, staleness "
          f"<= {staleness}; each agent starts {adm.tasks_per_version} task(s) per version, "
          f"{adm.versions_ahead} version(s) ahead", flush=True)
    print("\n".join(explain_profile(cfg.learner, up.model)), flush=True)  # learner.profiles: which and why
    bind_init(cfg, initial_model(cfg))  # before the broker: the 2 cores of a small machine are the warm start's alone
    up.max_lag = max_lag_default(cfg)  # for a simulator started elsewhere (`sao simulate --run-config`)
    config_file = Path(up.runs_dir) / up.run / "config.yaml"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    write_run_config(cfg, config_file)  # secrets left out: the roles get them in their environment (role_env)
    if not up.stream:  # the scenario as run: its file may be edited later, and a replay must read what ran
        scenario = resolve_path(up.scenario)
        if scenario.is_file():
            shutil.copyfile(scenario, config_file.parent / "scenario.yaml")
    return config_file


def roles(cfg: RunConfig, config_file: Path, run_dir: Path, bootstrap: str) -> list[Role]:
    """The child processes of a run: metrics app, learner and agents read their sections of `config_file`
    (Kafka from $SAO_BOOTSTRAP); evaluator, dashboard and simulator take flags."""
    up, plan = cfg.launch, cfg.launch.plan()
    common = ["--config", str(config_file)]
    side = {"env": thread_env(1), "nice": SIDE_NICE}
    learner = ["learn", *common, "--backend", cfg.learner.backend.name]  # the flag tells Ray launches a gang
    out = [Role("metrics", ["metrics", *common], **side),
           Role("learner", learner, env=thread_env(plan.learner_threads))]
    for i in range(plan.agents):
        # a stable id: a restarted agent's consumers skip the dead letters its predecessor sent
        agent = ["agent", *common, "--status-file", str(run_dir / f"agent-{i}.json"),
                 *set_args([f"agent_id={cfg.agent.agent_id or 'agent'}-{i}"])]
        if up.seed >= 0:
            agent += set_args([f"seed={seed_of(up, 1 + i, cfg.agent.seed)}"])
        if cfg.agent.model_is_url():  # each its own cache of the fetched model (two filling one race)
            agent += set_args([f"model_cache={run_dir / f'agent-{i}-model'}"])
        out.append(Role(f"agent-{i}", agent, env=thread_env(plan.agent_threads), nice=AGENT_NICE))
    run = ["--run", up.run, "--bootstrap", bootstrap]
    if plan.eval:
        weights = ["--weights-url", cfg.agent.weights_url] if cfg.agent.weights_url else []  # http, broadcast
        out.append(Role("eval", ["eval", *run, "--scenario", up.scenario, "--model", cfg.learner.io.init,
                                 "--weights-dir", cfg.agent.weights_dir, *weights, "--threads", "1", "--min-interval",
                                 str(up.eval_interval)], required=False, **side))
    if up.dashboard:
        out.append(Role("dashboard", ["dashboard", "--runs", up.runs_dir, "--port", str(up.dashboard_port), *run],
                        required=False, **side))
    # a restart would publish the stream again
    out.append(Role("simulator", task_source(cfg, run, run_dir), restartable=False, **side))
    return out


def task_source(cfg: RunConfig, run: list[str], run_dir: Path) -> list[str]:
    """The command that publishes the tasks: the scenario's simulator, or a replay of --stream (its bad rows set
    aside into the run directory, the agents' user verifiers enabled for its validation)."""
    up = cfg.launch
    common = [*run, "--max-lag", str(max_lag_default(cfg))] + (["--limit", str(up.limit)] if up.limit else [])
    if up.stream:
        return ["replay", up.stream, *common, "--speed", str(up.speed), "--skip-bad", "--rejects",
                str(run_dir / "rejects.jsonl"), "--model", cfg.learner.io.init,
                *[f"--verifier={v}" for v in cfg.agent.verifiers], *[f"--tool-env={t}" for t in cfg.agent.tool_envs]]
    simulate = ["simulate", "--scenario", up.scenario, *common]
    if up.seed >= 0:
        simulate += ["--seed", str(up.seed)]
    if up.realtime:
        simulate.append("--realtime")
    return simulate


def progress_line(t0: float, tap) -> str:
    ev = tap.learner
    learner = f"step {ev.step} v{ev.version}" if ev else "step -"
    reward = tap.mean_reward
    reward_txt = "-" if math.isnan(reward) else f"{reward:.3f}"
    concepts = " ".join(f"{k} {v:.2f}" for k, v in tap.concept_means().items())
    return (f"[{time.monotonic() - t0:6.0f}s] tasks {tap.tasks} answered {len(tap.task_ids)} "
            f"reward(last {tap.recent_rewards.maxlen}) {reward_txt} learner {learner} drifts {tap.drifts} "
            f"dlq {tap.consumer.dead_letters} | last 64 per newest concept: {concepts}")


class Stop:
    """Ends a running `run(cfg, stop)` from another thread (a benchmark's budget, an embedding program):
    `stop.request("token budget reached")`; the run stops as on Ctrl-C, and summary.json's `stopped` is the reason."""

    def __init__(self) -> None:
        self._event, self.reason = threading.Event(), ""

    def request(self, reason: str) -> None:
        self.reason = self.reason or reason
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()


def finished(up: UpConfig, sup: Supervisor, simulator: Role, tap, t0: float, last_new: list[float],
             stop: Stop | None = None) -> str | None:
    """Why the run is over, or None."""
    if stop is not None and stop.requested:
        return f"stopped by request: {stop.reason}"
    if up.max_seconds and time.monotonic() - t0 > up.max_seconds:
        return f"--max-seconds {up.max_seconds} reached"
    bad = sup.failed()
    if bad:
        return "failed: " + ", ".join(f"{r.name} exited {r.proc.returncode}" for r in bad)
    done = simulator.proc.poll() == 0 and tap.tasks > 0 and tap.accounted >= tap.tasks
    if done and time.monotonic() - last_new[0] > up.drain_seconds:
        return "scenario finished: every task answered" + (f" or dead-lettered ({len(tap.given_up)})"
                                                            if tap.given_up else "")
    return None


def wait_for_agents(up: UpConfig, sup: Supervisor, run_dir: Path, timeout_s: float = 180.0) -> None:
    """With --realtime, publish only once every agent is up (its status file written): agents take
    ~20 s to load, and a stream published meanwhile would reach them as a backlog, phases mixed
    across partitions, instead of at the scenario's rate."""
    t0 = time.monotonic()
    files = [run_dir / f"agent-{i}.json" for i in range(up.plan().agents)]
    while not all(f.is_file() for f in files) and not sup.failed() and time.monotonic() - t0 < timeout_s:
        time.sleep(0.5)
    print(f"agents ready after {time.monotonic() - t0:.0f}s: starting the simulator", flush=True)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(cfg: RunConfig, stop: Stop | None = None) -> int:
    """The whole pipeline; `stop.request(reason)` from another thread ends it as Ctrl-C does."""
    from learner.models.tokenizer import load_tokenizer
    from streamer.launch.broker_watch import BrokerWatch
    from streamer.runs.artifacts import summarize, write_json
    from streamer.runs.tap import close_tap, open_tap
    from streamer.transport.broker import BrokerSettings, EmbeddedBroker
    from streamer.transport.kafka_bus import KafkaBus
    from streamer.wire.topics import partitions_by_topic

    up = cfg.launch
    run_dir = Path(up.runs_dir) / up.run
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("agent-*.json"):  # a restarted agent resumes from its status: not an older run's
        stale.unlink()
    adm = up.admission()
    try:
        config_file = prepare(cfg)
        init = Path(cfg.learner.io.init)
    except KeyboardInterrupt:
        print("stopping: interrupted during the warm start (nothing else was started)", flush=True)
        return 130
    broker = None
    print("[2/4] broker: " + ("starting the embedded Tansu broker" if not up.bootstrap else up.bootstrap), flush=True)
    if not up.bootstrap:
        broker = EmbeddedBroker(BrokerSettings(port=0, log_path=str(run_dir / "logs" / "broker.log"))).start()
        print(f"      embedded Tansu at {broker.bootstrap} (memory storage: lost if it dies)", flush=True)
    bootstrap = up.bootstrap or broker.bootstrap
    watch = BrokerWatch(bootstrap, broker, cfg.agent.client, up.broker_silence_s)
    env = {"SAO_BOOTSTRAP": bootstrap, "SAO_RUN": up.run, **role_env(cfg)}  # the policy key, the Kafka password
    if up.ray:  # agents and learner as Ray actors; broker, simulator, metrics, dashboard stay local
        from streamer.launch.ray_launch import RaySupervisor
        from streamer.launch.ray_nodes import driver_ip, learner_on_driver

        sup = RaySupervisor(run_dir / "logs", env, cfg.ray, up.weights_transport)
        if learner_on_driver(cfg.ray, up.weights_transport) and advertise_on(cfg, driver_ip()):
            write_run_config(cfg, config_file)  # the weight server at the learner node's IP
        sup.ship(run_dir, {"config.yaml": config_file.read_text()})  # by value: no node reads ours
    else:
        sup = Supervisor(run_dir / "logs", env=env, restarts=up.restarts)
    tap, tap_thread = None, None
    reason = "interrupted (Ctrl-C or SIGTERM)"
    # A shell starts `nohup sao up ... &` with SIGINT ignored, and SIGTERM kills without cleanup: both
    # would leave the children running and no summary.json. Both stop the run the Ctrl-C way.
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # restored at the end:
    signal.signal(signal.SIGINT, _interrupt)  # an ignored SIGINT would be inherited by later child processes
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        KafkaBus(bootstrap, cfg.agent.client).create_topics(partitions_by_topic(up.run, cfg.agent.topics),
                                                             cfg.agent.topics.replication_factor)
        print("[3/4] starting the roles: metrics app, learner, agents" + (", evaluator" if up.plan().eval else "")
              + (", dashboard" if up.dashboard else "") + ", simulator", flush=True)
        tap = open_tap(bootstrap, up.run, str(run_dir), config={"up": asdict(up), "init": str(init),
                                                                   "plan": asdict(up.plan()), "admission": asdict(adm)},
                       decode=load_tokenizer(init).decode)  # the answers' text in samples.jsonl
        tap_thread = threading.Thread(target=tap.run, name="tap", daemon=True)
        tap_thread.start()
        plan = roles(cfg, config_file, run_dir, bootstrap)
        for role in plan[:-1]:
            sup.start(role)
        if up.ray:  # hosts that must share a path (the model, checkpoints, directory weights) do, or stop here
            from streamer.launch.ray_nodes import run_needs

            sup.check_shared(run_needs(cfg))
        if (up.realtime or up.stream and up.speed > 0) and not up.ray:
            wait_for_agents(up, sup, run_dir)
        sup.start(plan[-1])  # the simulator
        if up.dashboard:
            print(f"dashboard: http://localhost:{up.dashboard_port}", flush=True)
        print(f"[4/4] run {up.run}: {up.plan().agents} agent(s), loss {up.loss}; progress every 5 s; logs in "
              f"{run_dir / 'logs'}; Ctrl-C stops", flush=True)
        t0, last_print, last_new, seen = time.monotonic(), 0.0, [time.monotonic()], 0
        while True:
            time.sleep(0.5)
            for role, code in sup.restart_dead():
                print(f"{role.name} exited {code}: restarted ({role.restarts} of {up.restarts})", flush=True)
            if len(tap.task_ids) != seen:
                seen, last_new[0] = len(tap.task_ids), time.monotonic()
            if time.monotonic() - last_print >= 5:
                print(progress_line(t0, tap), flush=True)
                last_print = time.monotonic()
            why = watch.lost() or finished(up, sup, plan[-1], tap, t0, last_new, stop)
            if why:
                reason = why
                break
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave children behind
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"stopping: {reason}", flush=True)
        watch.close()
        sup.stop_all()
        for role in sup.failed():
            print(f"--- {role.name} exited {role.proc.returncode}; last log lines:\n{sup.tail(role)}", file=sys.stderr)
        if tap is not None:
            gone = watch.lost() is not None  # no last messages to read, and a poll of a dead broker can hang
            time.sleep(0.0 if gone else 1.0)  # the last messages of the stopped roles
            tap.stop()
            if tap_thread is not None:
                tap_thread.join(timeout=2 if gone else 10)
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
    cfg, only_prepare = parse_command(argv)
    try:
        if only_prepare:
            print(f"sao up --prepare: wrote {prepare(cfg)}", flush=True)
            return 0
        return run(cfg)
    except ConfigError as e:
        print(f"sao up: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
