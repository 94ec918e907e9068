"""`sao agent`: tasks -> rollouts -> trajectories, one consumer of `<run>.tasks` in a shared group.

Each task gets one rollout (SAO) or a group of n (`--group-size n`, GRPO family). Up to
`concurrency` tasks are in flight (`streamer.agent.rollouts`: their turns share engine batches, their tool
calls overlap). A partition's offset is committed only up to its oldest task still in flight, and
only after the finished tasks' trajectories are produced and flushed, so an agent that dies loses
nothing (its uncommitted tasks go to another agent; the learner de-duplicates by task id). New
policy versions are loaded between turns.

    sao agent --bootstrap 127.0.0.1:9092 --run exp1 --model runs/warm [--group-size 8] [--set max_new_tokens=24]
    sao agent --tasks tasks.jsonl --out trajectories.jsonl --model runs/warm     # no broker, no learner
    sao agent --run exp1 --model http://learner:8765/latest    # another host: versions pulled from the weight server

Versions come from the store at `weights_dir` or, with `weights_transport` http, the learner's weight server at
`weights_url` (`streamer.transport.weight_client`; `--model http://HOST:PORT/latest` sets both).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafka.errors import KafkaError

from streamer.agent.rollouts import ROLLOUT_ERRORS, EngineError, Finished, Rollouts
from streamer.transport.bus import DLQ_MAX_VALUE_BYTES, Consumer, Producer, SendError
from streamer.transport.kafka_bus import KafkaBus
from streamer.transport.memory_bus import MemoryBus
from streamer.transport.weight_client import fetch_initial, source_for
from streamer.transport.weights import CheckpointError, PolicyFollower, WeightStore
from streamer.wire.config import ConfigError, add_config_args, load_config
from streamer.wire.schema import DeadLetter, PolicyVersion, Task, Trajectory, encode
from streamer.wire.settings import AgentSettings
from streamer.wire.topics import Topics, partitions_by_topic

log = logging.getLogger("sao.agent")


# ----------------------------------------------------------------------------------------- the loop

@dataclass
class AgentStats:
    tasks: int = 0
    trajectories: int = 0
    commit_failures: int = 0
    failed: int = 0  # tasks whose rollout raised (sent to the DLQ)
    oversized: int = 0  # trajectories over client.max_message_bytes (sent to the DLQ, their tasks committed)
    busy_seconds: float = 0.0
    started: float = field(default_factory=time.time)


class Agent:
    """One agent process: keep up to `concurrency` tasks in flight, advance them a turn at a time,
    produce + flush the finished ones, commit; swap weights between turns."""

    def __init__(self, s: AgentSettings, engine: Any, tokenizer: Any, tasks: Consumer, producer: Producer,
                 follower: PolicyFollower | None, status_path: str = "") -> None:
        self.s, self.engine, self.tokenizer = s, engine, tokenizer
        self.tasks, self.producer, self.follower = tasks, producer, follower
        self.topics = Topics(s.run)
        self.agent_id = s.agent_id or f"{socket.gethostname()}-{os.getpid()}"
        self.rollouts = Rollouts(engine, tokenizer, s, self.agent_id)
        self.stats = AgentStats()
        self.status_path = status_path
        self.stopping = False
        self._last_status = 0.0
        self._first_version: int | None = None  # the version this agent started with (admission)
        self._started = 0  # tasks taken since then
        self._open: dict[Any, list[int]] = {}  # partition -> offsets in flight, in poll order
        self._next: dict[Any, int] = {}  # partition -> one past the newest finished offset

    def _give_up(self, task: Task, tp: Any, offset: int, err: Exception) -> None:
        """A task the environment or engine cannot run goes to the DLQ (else it would kill every agent in turn)."""
        self._letter(task, tp, offset, encode(task), "Task", f"rollout failed: {type(err).__name__}: {err}")
        self.stats.failed += 1

    def _letter(self, task: Task, tp: Any, offset: int, raw: bytes, expected: str, reason: str) -> None:
        log.error("agent %s: task %s %s -> DLQ", self.agent_id, task.task_id, reason)
        self.producer.send(self.topics.dlq, DeadLetter(
            topic=tp.topic, partition=tp.partition, offset=offset, key=task.task_id.encode(),
            value=raw[:DLQ_MAX_VALUE_BYTES], value_len=len(raw), reason=reason, expected=expected,
            consumer=self.agent_id, time=time.time()))

    def _produce(self, done: Finished, tp: Any, offset: int) -> None:
        """The task's trajectories, or, where one is over the topic's limit (the broker would refuse it and every
        agent in turn would fail the task), each oversized one to the DLQ and none of its group: the task handled."""
        raws, limit = [encode(t) for t in done.trajectories], self.s.client.max_message_bytes
        over = [r for r in raws if len(r) > limit]
        for raw in raws if not over else ():
            self.producer.send_raw(self.topics.trajectories, raw, done.task.task_id.encode())
        for raw in over:
            self._letter(done.task, tp, offset, raw, "Trajectory", f"trajectory of {len(raw)} bytes over the topic's "
                         f"{limit}-byte limit (task {done.task.task_id}; {len(raws)} in its group, none sent)")
        self.stats.oversized += len(over)
        self.stats.trajectories += 0 if over else len(raws)

    def resume_admission(self) -> None:
        """A restarted agent continues its predecessor's admission (from the status file it left): starting from
        scratch at the newest version, it would take `versions_ahead + 1` batches more than the learner asked for,
        which go stale. The tasks that were in flight were not committed: they come back and count again."""
        try:
            old = json.loads(Path(self.status_path).read_text()) if self.status_path else {}
        except (OSError, ValueError):
            return
        if old.get("first_version") is not None:
            self._first_version = int(old["first_version"])
            self._started = max(0, int(old.get("started", 0)) - int(old.get("in_flight", 0)))
            log.info("agent %s: admission resumed: %d tasks started since v%d", self.agent_id, self._started,
                     self._first_version)

    def _admissible(self) -> int:
        """Tasks this agent may still start: `tasks_per_version` per version, up to `versions_ahead` versions
        ahead of the newest one loaded (AReaL's staleness-bounded rollout; 0 ahead: synchronous)."""
        if not self.s.tasks_per_version:
            return 1 << 30
        current = int(self.engine.version) if self.follower is None else self.follower.pace_version(
            int(self.engine.version))
        if self._first_version is None:
            self._first_version = current
        versions = current - self._first_version + 1 + self.s.versions_ahead
        return versions * self.s.tasks_per_version - self._started

    def _waiting_for_version(self) -> bool:
        """This version has had its share of tasks: block on the policy topic instead."""
        return self._admissible() <= 0

    def _swap(self) -> None:
        """Load a new version if one is out; when this version has had its share and nothing is in flight,
        wait for one."""
        if self.follower is None:
            return
        if self._waiting_for_version():
            if not len(self.rollouts) and self.follower.maybe_swap(self.engine, self.s.poll_timeout_s):
                self.write_status(force=True)
        elif self.follower.maybe_swap(self.engine):
            self.write_status(force=True)

    def _take(self) -> None:
        """Poll tasks into the free slots (none while waiting for a version)."""
        if self._waiting_for_version():
            self.tasks.keep_membership()
            return
        free = min(self.s.concurrency - len(self.rollouts), self._admissible())
        if self.s.max_tasks:
            free = min(free, self.s.max_tasks - self.stats.tasks - len(self.rollouts))
        if free <= 0:
            return
        polled = self.tasks.poll(max_records=free, timeout=0 if len(self.rollouts) else self.s.poll_timeout_s)
        for task, tp, offset in polled:
            self.rollouts.start(task, (tp, offset))
            self._open.setdefault(tp, []).append(offset)
            self._started += 1

    def _finish(self, finished: list[Finished]) -> None:
        """Produce the finished tasks' trajectories (or dead letters), flush, then commit each partition
        up to its oldest task still in flight."""
        for done in finished:
            tp, offset = done.key
            if done.error is None:
                self._produce(done, tp, offset)
                self.stats.tasks += 1
            elif isinstance(done.error, (ConnectionError, KafkaError)) or not isinstance(done.error, ROLLOUT_ERRORS):
                raise done.error  # the transport failed, or a bug: do not commit, the task is redelivered
            else:
                self._give_up(done.task, tp, offset, done.error)
            self._open[tp].remove(offset)
            self._next[tp] = max(self._next.get(tp, 0), offset + 1)
        self.producer.flush()  # before the commit: a task is never committed without its trajectories
        tps = {d.key[0] for d in finished}
        if not self.tasks.commit({tp: self._open[tp][0] if self._open[tp] else self._next[tp] for tp in tps}):
            self.stats.commit_failures += 1

    def step(self) -> int:
        """Swap weights if a new version is out, take tasks into free slots, advance every rollout one
        turn (or wait for a tool). Returns the tasks finished."""
        self._swap()
        self._take()
        finished: list[Finished] = []
        if len(self.rollouts):
            t0 = time.perf_counter()
            finished = self.rollouts.advance(timeout=self.s.poll_timeout_s)
            if finished:
                self._finish(finished)
            self.stats.busy_seconds += time.perf_counter() - t0
        self.write_status()
        return len(finished)

    def run(self) -> AgentStats:
        idle_since = time.monotonic()
        try:
            while not self.stopping:
                if self.step() or len(self.rollouts):
                    idle_since = time.monotonic()
                elif self.s.idle_exit_s and time.monotonic() - idle_since > self.s.idle_exit_s:
                    break
                if self.s.max_tasks and self.stats.tasks >= self.s.max_tasks:
                    break
        finally:
            self.rollouts.close()  # tasks still in flight are not committed: they go to another agent
        self.write_status(force=True)
        return self.stats

    def status(self) -> dict[str, Any]:
        f = self.follower
        return {"agent_id": self.agent_id, "host": socket.gethostname(), "pid": os.getpid(),
                "version": int(self.engine.version),
                "tasks": self.stats.tasks, "trajectories": self.stats.trajectories, "failed": self.stats.failed,
                "oversized": self.stats.oversized,
                "assignment": sorted(f"{tp.topic}:{tp.partition}" for tp in self.tasks.assignment()),
                "dead_letters": self.tasks.dead_letters + (f.consumer.dead_letters if f else 0),
                "refused": {str(k): v for k, v in (f.refused if f else {}).items()},
                "swapped_at": f.swapped_at if f else 0.0,
                "waiting_for_version": self._waiting_for_version(), "in_flight": len(self.rollouts),
                "first_version": self._first_version, "started": self._started,
                "busy_seconds": round(self.stats.busy_seconds, 4), "time": time.time()}

    def write_status(self, force: bool = False) -> None:
        if not self.status_path or (not force and time.monotonic() - self._last_status < 0.1):
            return
        self._last_status = time.monotonic()
        tmp = f"{self.status_path}.tmp"
        Path(tmp).write_text(json.dumps(self.status()))
        os.replace(tmp, self.status_path)


# ----------------------------------------------------------------------------------------- wiring

def load_engine(s: AgentSettings, store: WeightStore | None = None) -> tuple[Any, Any]:
    """The engine and tokenizer: from `s.model`, else the newest verified version in the weight store (http: the
    server's, fetched into `model_cache` once the learner has published one)."""
    from learner.engines import make_engine
    from learner.models.tokenizer import load_tokenizer

    store, initial = store or WeightStore(s.weights_dir), fetch_initial(s)
    model_dir, pv, state = initial or (s.model, None, None)
    if not model_dir:
        pv = store.latest()
        if pv is None:
            raise ConfigError(f"agent: no --model given and the weight store {store.root} is empty")
        model_dir = str(store.resolve(pv))
    tokenizer = load_tokenizer(model_dir, s.chat_template)
    engine = make_engine(s.engine, model_dir, tokenizer)
    if pv is not None:  # raises CheckpointError on a bad hash
        engine.load_state_dict(state if state is not None else store.load(pv), pv.version)
    return engine, tokenizer


def build_agent(s: AgentSettings, bus: KafkaBus | MemoryBus, engine: Any, tokenizer: Any,
                status_path: str = "") -> Agent:
    t = Topics(s.run)
    bus.create_topics(partitions_by_topic(s.run, s.topics), s.topics.replication_factor)
    producer = bus.producer()
    tasks = bus.consumer({t.tasks: Task}, group_id=s.group_id or f"{s.run}.agents", dlq=t.dlq, producer=producer)
    policy = bus.consumer({t.policy: PolicyVersion}, group_id=None, dlq=t.dlq, producer=producer,
                          name=f"{s.agent_id or f'{socket.gethostname()}-{os.getpid()}'}.policy",  # one per agent
                          **({"fetch_max_wait_ms": 50} if isinstance(bus, KafkaBus) else {}))
    follower = PolicyFollower(policy, source_for(s), version=int(engine.version))
    agent = Agent(s, engine, tokenizer, tasks, producer, follower, status_path)
    agent.resume_admission()
    return agent


def run_offline(s: AgentSettings, engine: Any, tokenizer: Any, tasks_file: str, out: str) -> AgentStats:
    """Answer a task file (JSONL, Parquet, CSV) with no broker and no learner: an in-memory bus in between."""
    from learner.models.tokenizer import load_tokenizer
    from simulator.records import prompt_rule
    from simulator.replay import replay
    from streamer.transport.sinks import KafkaTaskSink
    from streamer.wire.schema import encode_json

    bus = MemoryBus(s.client)
    bus.create_topics(partitions_by_topic(s.run, s.topics))
    replay(tasks_file, KafkaTaskSink(None, s.run, producer=bus.producer()), speed=0,
           rule=prompt_rule(s.model, load_tokenizer))
    s.idle_exit_s = s.idle_exit_s or 0.01
    agent = build_agent(s, bus, engine, tokenizer)
    stats = agent.run()
    reader = bus.consumer({agent.topics.trajectories: Trajectory})
    with open(out, "wb") as f:
        for traj, _, _ in reader.poll(max_records=1 << 30, timeout=0):
            f.write(encode_json(traj) + b"\n")
    return stats


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sao agent", description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (default: $SAO_BOOTSTRAP)")
    p.add_argument("--run", default=None, help="run name (topic prefix)")
    p.add_argument("--model", default=None, help="policy directory (default: newest in the weight store)")
    p.add_argument("--weights-dir", default=None, help="weight store the learner publishes into")
    p.add_argument("--weights-url", default=None, help="pull versions from this weight server (http://HOST:PORT)")
    p.add_argument("--group-size", type=int, default=None, help="rollouts per task (1: single rollout)")
    p.add_argument("--max-tasks", type=int, default=None)
    add_config_args(p, "AgentSettings", "concurrency=8")
    p.add_argument("--status-file", default="", help="JSON status (version, assignment, counts) kept up to date")
    p.add_argument("--tasks", default=None, help="answer this task file instead of <run>.tasks (no broker)")
    p.add_argument("--out", default=None, help="with --tasks: trajectory JSONL output")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def settings_from_args(a: argparse.Namespace) -> AgentSettings:
    """Defaults < YAML < --set < explicit flags."""
    s = load_config(AgentSettings, a.config, a.overrides, section="agent")
    flags = {"run": a.run, "model": a.model, "weights_dir": a.weights_dir, "group_size": a.group_size,
             "max_tasks": a.max_tasks}
    for name, value in flags.items():
        if value is not None:
            setattr(s, name, value)
    if a.bootstrap:
        s.client.bootstrap = a.bootstrap
    if a.weights_url or (s.model_is_url() and not s.weights_url):  # --model http://HOST:PORT/latest names the server
        s.weights_transport, s.weights_url = "http", a.weights_url or s.model.rstrip("/").rpartition("/")[0]
    s.validate()
    Topics(s.run)  # checks the run name
    return s


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        s = settings_from_args(a)
        if bool(a.tasks) != bool(a.out):
            raise ConfigError("agent: --tasks and --out go together")
        from simulator.replay import enable_plugins

        enable_plugins(s.verifiers, s.tool_envs)
    except ValueError as e:  # ConfigError, or a bad run name
        print(f"sao agent: {e}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(s.threads)
    try:
        engine, tokenizer = load_engine(s)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"sao agent: {e}", file=sys.stderr)
        return 2
    if a.tasks:
        stats = run_offline(s, engine, tokenizer, a.tasks, a.out)
        print(json.dumps({"tasks": stats.tasks, "trajectories": stats.trajectories, "out": a.out}))
        return 0
    bus = KafkaBus(s.client.bootstrap or None, s.client)
    try:
        agent = build_agent(s, bus, engine, tokenizer, a.status_file)
    except (KafkaError, RuntimeError) as e:
        print(f"sao agent: Kafka at {bus.bootstrap}: {type(e).__name__}: {e} "
              f"(start one with `sao broker`, or set --bootstrap / $SAO_BOOTSTRAP)", file=sys.stderr)
        return 1

    def _stop(*_: Any) -> None:
        agent.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("agent %s: run %s, engine %s v%d, group size %d", agent.agent_id, s.run, s.engine,
             engine.version, s.group_size)
    try:
        stats = agent.run()
    except SendError as e:  # raised before the commit: the tasks in question are redelivered
        print(f"sao agent: Kafka at {bus.bootstrap}: {e}; stopping without committing those tasks", file=sys.stderr)
        return 1
    except EngineError as e:  # the tasks in flight are not committed: another agent (or a restart) runs them
        print(f"sao agent: {e}; stopping without committing the tasks in flight", file=sys.stderr)
        return 1
    finally:
        agent.tasks.close()
        agent.follower.consumer.close()
        agent.producer.close()
    log.info("agent %s: %d tasks, %d trajectories", agent.agent_id, stats.tasks, stats.trajectories)
    return 0
