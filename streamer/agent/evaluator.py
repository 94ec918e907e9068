"""`sao eval`: greedy held-out reward of each policy version, per (family, concept) -> `<run>.metrics`.

A fixed set of k untagged tasks per (family, concept) of every concept the scenario's phases reward
(seeded, apart from the training stream: `simulator.warmstart.held_out_tasks`) is answered with the
agents' own env loop (`streamer.agent.rollouts.run_tasks`) at temperature 0, once at start (the
`--model` policy, version 0) and then for the newest version announced on `<run>.policy`, at most once
per `--min-interval` seconds: versions announced meanwhile are skipped. Each evaluation publishes one
`MetricPoint(name="eval/reward", labels={"family", "concept"}, count=k, learner_step=<its step>)`
per (family, concept): the dashboard's eval reward per concept.

    sao eval --bootstrap 127.0.0.1:9092 --run exp1 --scenario default --model runs/warm --weights-dir runs/weights
    sao eval --run exp1 --weights-url http://learner:8765      # versions (and, without --model, v0) over HTTP

Versions are read as the agents read them (`streamer.agent.agent.load_engine`, a `PolicyFollower` over
`streamer.transport.weight_client.source_for`): the store at `--weights-dir`, or the weight server at `--weights-url`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from streamer.wire.config import ConfigError
from streamer.wire.schema import MetricPoint, PolicyVersion, Task
from streamer.wire.settings import AgentSettings, ClientSettings
from streamer.wire.topics import Topics

log = logging.getLogger("sao.eval")

EVAL_SEED = 900_001  # held-out base seed: the training stream uses the scenario's seed, pretraining small ones


# ----------------------------------------------------------------------------------------- held-out set

def scenario_concepts(scn: Any) -> list[tuple[str, str]]:
    """Every (family, concept) a phase of the scenario rewards (each step of an incremental list), sorted."""
    pairs = set()
    for phase in scn.phases:
        for fam, c in phase.concepts.items():
            pairs |= {(fam, step) for step in (c if isinstance(c, list) else [c])}
    return sorted(pairs)


def held_out_set(scn: Any, k: int, seed: int = EVAL_SEED) -> dict[tuple[str, str], list[Task]]:
    """k untagged tasks per (family, concept), each pair from its own seed (adding a concept keeps the others')."""
    # the warm start's held-out generator (demos, tag off, concept pinned) draws families from the
    # warm-start mix, so each pair gets a one-family copy of the scenario
    from simulator.warmstart import held_out_tasks

    if k < 1:
        raise ConfigError(f"--tasks-per-concept: must be >= 1, got {k}")
    out = {}
    for fam, concept in scenario_concepts(scn):
        ws = dataclasses.replace(scn.warm_start, families={fam: 1.0}, mixture={fam: {concept: 1.0}})
        one = dataclasses.replace(scn, warm_start=ws)
        pair_seed = seed + zlib.crc32(f"{fam}:{concept}".encode())
        tasks = held_out_tasks(one, {fam: concept}, k, pair_seed)
        out[(fam, concept)] = [msgspec.structs.replace(t, task_id=f"eval-{fam}-{concept}-{i}")
                               for i, t in enumerate(tasks)]
    return out


# ----------------------------------------------------------------------------------------- evaluation

def evaluate(engine: Any, tokenizer: Any, tasks: dict[tuple[str, str], list[Task]], s: AgentSettings,
             stop: Callable[[], bool] = lambda: False) -> dict[tuple[str, str], float] | None:
    """Mean reward of one greedy rollout per task, per (family, concept), a pair's tasks in flight together;
    None if `stop()` turned true."""
    from streamer.agent.rollouts import run_tasks

    out = {}
    for pair, group in tasks.items():
        if stop():
            return None
        trajs = run_tasks(engine, tokenizer, group, dataclasses.replace(s, concurrency=len(group)), agent_id="eval")
        out[pair] = sum(t[0].reward for t in trajs) / len(group)
    return out


def metric_points(rewards: dict[tuple[str, str], float], k: int, step: int, t: float) -> list[MetricPoint]:
    return [MetricPoint(name="eval/reward", value=float(v), time=t, labels={"family": f, "concept": c},
                        count=k, learner_step=step) for (f, c), v in sorted(rewards.items())]


@dataclass
class EvalStats:
    evaluations: int = 0
    versions: list[int] = field(default_factory=list)  # versions evaluated, in order
    seconds: list[float] = field(default_factory=list)  # wall seconds of each evaluation


class Evaluator:
    """Evaluates the engine's version, then follows `<run>.policy` (newest version, rate-limited)."""

    def __init__(self, engine: Any, tokenizer: Any, tasks: dict[tuple[str, str], list[Task]], s: AgentSettings,
                 follower: Any, producer: Any, step: int = 0, min_interval_s: float = 10.0) -> None:
        self.engine, self.tokenizer, self.tasks, self.s = engine, tokenizer, tasks, s
        self.follower, self.producer = follower, producer
        self.step, self.min_interval_s = step, min_interval_s
        self.topic = Topics(s.run).metrics
        self.stats = EvalStats()
        self.stopping = False
        self._last = -float("inf")  # monotonic start of the last evaluation

    def evaluate_current(self) -> bool:
        self._last = time.monotonic()
        rewards = evaluate(self.engine, self.tokenizer, self.tasks, self.s, stop=lambda: self.stopping)
        if rewards is None:
            return False
        k = len(next(iter(self.tasks.values())))
        for p in metric_points(rewards, k, self.step, time.time()):
            self.producer.send(self.topic, p, key=f"eval/{p.labels['family']}/{p.labels['concept']}")
        self.producer.flush()
        dt = time.monotonic() - self._last
        self.stats.evaluations += 1
        self.stats.versions.append(int(self.engine.version))
        self.stats.seconds.append(dt)
        log.info("eval v%d (step %d) in %.1f s: %s", self.engine.version, self.step, dt,
                 " ".join(f"{f}/{c}={v:.2f}" for (f, c), v in sorted(rewards.items())))
        return True

    def step_once(self) -> bool:
        """Evaluate the newest announced version if one is out and the interval has passed."""
        pv: PolicyVersion | None = self.follower.poll(self.s.poll_timeout_s)
        if pv is None or time.monotonic() - self._last < self.min_interval_s:
            return False
        if not self.follower.maybe_swap(self.engine):  # refused (bad checkpoint): logged, keep waiting
            return False
        self.step = int(self.follower.newest.step)  # maybe_swap loads the newest announcement
        return self.evaluate_current()

    def run(self, max_evaluations: int = 0) -> EvalStats:
        self.evaluate_current()
        while not self.stopping and not (max_evaluations and self.stats.evaluations >= max_evaluations):
            self.step_once()
        return self.stats


# ----------------------------------------------------------------------------------------- wiring

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sao eval", description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (default: $SAO_BOOTSTRAP)")
    p.add_argument("--run", default="default", help="run name (topic prefix)")
    p.add_argument("--scenario", default="default", help="scenario YAML (or a name under simulator/scenarios/)")
    p.add_argument("--model", default="", help="version-0 policy directory (default: newest in the weight store)")
    p.add_argument("--weights-dir", default="runs/weights", help="weight store the learner publishes into")
    p.add_argument("--weights-url", default="", help="pull versions from this weight server (http://HOST:PORT)")
    p.add_argument("--tasks-per-concept", type=int, default=32, help="held-out tasks per (family, concept)")
    p.add_argument("--min-interval", type=float, default=10.0, help="seconds between evaluation starts")
    p.add_argument("--seed", type=int, default=EVAL_SEED, help="held-out set seed")
    p.add_argument("--max-new-tokens", type=int, default=AgentSettings.max_new_tokens, help="per turn")
    p.add_argument("--max-evaluations", type=int, default=0, help="stop after this many (0: run until stopped)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def settings_from_args(a: argparse.Namespace) -> AgentSettings:
    s = AgentSettings(run=a.run, model=a.model, weights_dir=a.weights_dir, temperature=0.0, group_size=1,
                      max_new_tokens=a.max_new_tokens, threads=a.threads, client=ClientSettings(client_id="sao-eval"),
                      weights_transport="http" if a.weights_url else "directory", weights_url=a.weights_url)
    if a.bootstrap:
        s.client.bootstrap = a.bootstrap
    if a.min_interval < 0:
        raise ConfigError(f"--min-interval: must be >= 0, got {a.min_interval}")
    s.validate()
    Topics(s.run)  # checks the run name
    return s


def _step_of(source: Any, version: int) -> int:
    """The learner step of the source's newest version, if the engine runs it (else 0)."""
    pv = source.latest()
    return pv.step if pv is not None and pv.version == version else 0


def main(argv: list[str]) -> int:
    from kafka.errors import KafkaError

    from simulator.scenario import load_scenario
    from streamer.agent.agent import load_engine
    from streamer.transport.kafka_bus import KafkaBus
    from streamer.transport.weight_client import source_for
    from streamer.transport.weights import CheckpointError, PolicyFollower
    from streamer.wire.topics import partitions_by_topic

    a = parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        s = settings_from_args(a)
        tasks = held_out_set(load_scenario(a.scenario), a.tasks_per_concept, a.seed)
    except ValueError as e:  # ConfigError, ScenarioError, or a bad run name
        print(f"sao eval: {e}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(s.threads)
    source = source_for(s)
    try:
        engine, tokenizer = load_engine(s)
        step = 0 if s.model else _step_of(source, int(engine.version))  # --model is version 0, before any step
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"sao eval: {e}", file=sys.stderr)
        return 2
    bus = KafkaBus(s.client.bootstrap or None, s.client)
    t = Topics(s.run)
    try:
        bus.create_topics(partitions_by_topic(s.run, s.topics))
        producer = bus.producer()
        policy = bus.consumer({t.policy: PolicyVersion}, group_id=None, fetch_max_wait_ms=50)
    except (KafkaError, RuntimeError) as e:
        print(f"sao eval: Kafka at {bus.bootstrap}: {type(e).__name__}: {e} "
              f"(start one with `sao broker`, or set --bootstrap / $SAO_BOOTSTRAP)", file=sys.stderr)
        return 1
    follower = PolicyFollower(policy, source, version=int(engine.version))
    ev = Evaluator(engine, tokenizer, tasks, s, follower, producer, step=step, min_interval_s=a.min_interval)

    def _stop(*_: Any) -> None:
        ev.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("eval: run %s, %d (family, concept) pairs x %d tasks, greedy, v%d", s.run, len(tasks),
             a.tasks_per_concept, engine.version)
    try:
        stats = ev.run(a.max_evaluations)
    finally:
        policy.close()
        producer.close()
    log.info("eval: %d evaluations (versions %s)", stats.evaluations, stats.versions)
    return 0
