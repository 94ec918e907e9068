"""Agents as real processes against the embedded broker: load sharing, exactly-once after de-dup,
kill -9 recovery, policy propagation and refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch
from kafka_fixtures import scenario_tasks

from learner.models import load_policy
from streamer.transport.kafka_bus import KafkaBus
from streamer.transport.weights import WeightStore, announce
from streamer.wire.schema import Task, Trajectory
from streamer.wire.settings import ClientSettings
from streamer.wire.topics import Topics, partitions_by_topic

pytestmark = [pytest.mark.kafka, pytest.mark.slow]  # slow: the module's `pair` fixture 9-13 s, the kill test 12-14 s


class AgentProc:
    """`sao agent` in a child process, watched through its status file."""

    def __init__(self, name: str, bootstrap: str, run: str, model: Path, weights: Path, tmp: Path,
                 *sets: str) -> None:
        self.name, self.status_path, self.log_path = name, tmp / f"{name}.status.json", tmp / f"{name}.log"
        cmd = [sys.executable, "-m", "streamer.launch.cli", "agent", "--bootstrap", bootstrap, "--run", run,
               "--model", str(model), "--weights-dir", str(weights), "--status-file", str(self.status_path),
               "--set", "max_new_tokens=4", "--set", f"agent_id={name}", "--set", "threads=1",
               *[a for kv in sets for a in ("--set", kv)]]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT, env=env)

    def status(self) -> dict:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_for(cond, timeout: float, what: str, agents=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    logs = "\n".join(f"--- {a.name}:\n{a.log_path.read_text()[-1500:]}" for a in agents)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")


def split_between(agents) -> bool:
    sets = [set(a.status().get("assignment", [])) for a in agents]
    return all(sets) and len(set().union(*sets)) == 4 and sum(map(len, sets)) == 4


class Trajectories:
    """Reads <run>.trajectories from the start (no group)."""

    def __init__(self, bus: KafkaBus, run: str) -> None:
        self.cons = bus.consumer({Topics(run).trajectories: Trajectory})
        self.all: list[Trajectory] = []

    def until(self, task_ids: set[str], timeout: float, agents=()) -> list[Trajectory]:
        def done():
            self.all += [p.msg for p in self.cons.poll(500, 0.2)]
            return task_ids <= {t.task_id for t in self.all}
        wait_for(done, timeout, f"trajectories of {len(task_ids)} tasks", agents)
        return [t for t in self.all if t.task_id in task_ids]


def produce_tasks(bus: KafkaBus, run: str, tasks) -> set[str]:
    prod = bus.producer()
    for t in tasks:
        prod.send(Topics(run).tasks, t, key=t.task_id)
    prod.flush()
    prod.close()
    return {t.task_id for t in tasks}


@pytest.fixture(scope="module")
def pair(kafka_broker, tiny_policy_dir, tmp_path_factory):
    """Two agents of one run, with the task partitions split between them."""
    tmp = tmp_path_factory.mktemp("agents")
    run = f"pair{os.getpid()}"
    bus = KafkaBus(kafka_broker, ClientSettings(client_id="sao-test"))
    bus.create_topics(partitions_by_topic(run))
    agents = [AgentProc(n, kafka_broker, run, tiny_policy_dir, tmp / "weights", tmp) for n in ("a1", "a2")]
    try:
        wait_for(lambda: split_between(agents), 60, "both agents to share the 4 task partitions", agents)
        yield bus, run, agents, tmp / "weights", Trajectories(bus, run)
    finally:
        for a in agents:
            a.stop()


def test_tasks_are_shared_and_answered_exactly_once_after_dedup(pair, kafka_broker):
    from simulator.run import main as simulate

    bus, run, agents, _, reader = pair
    # the simulator's Kafka sink publishes the first 40 tasks of the default scenario
    assert simulate(["--bootstrap", kafka_broker, "--run", run, "--limit", "40", "--seed", "3"]) == 0
    want = {t.task_id for t in scenario_tasks(40, seed=3)}
    trajs = reader.until(want, 60, agents)
    assert {t.task_id for t in trajs} == want  # nothing lost; de-dup by task id leaves one each
    assert len(trajs) == 40  # and nothing was answered twice (no agent died)
    by_agent = {a.name: sum(t.agent_id == a.name for t in trajs) for a in agents}
    assert all(n > 0 for n in by_agent.values()), by_agent


def test_new_policy_reaches_every_agent_and_bad_hash_is_refused(pair, tiny_policy_dir):
    bus, run, agents, weights, reader = pair
    model = load_policy(tiny_policy_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    store = WeightStore(weights)
    prod = bus.producer()
    announce(prod, run, store.publish(model.state_dict(), version=1, step=5))
    t0 = time.monotonic()
    wait_for(lambda: all(a.status().get("version") == 1 for a in agents), 30, "every agent on v1", agents)
    print(f"policy v1 reached both agents in {time.monotonic() - t0:.2f} s")
    tasks = scenario_tasks(20, seed=4)
    ids = produce_tasks(bus, run, tasks)
    trajs = reader.until(ids, 60, agents)
    assert {t.policy_version for t in trajs} == {1} and all(t.policy_versions == [1] for t in trajs)

    good = store.publish(model.state_dict(), version=2, step=6)
    announce(prod, run, msgspec.structs.replace(good, sha256="0" * 64))
    wait_for(lambda: all("2" in a.status().get("refused", {}) for a in agents), 30, "v2 refused", agents)
    ids = produce_tasks(bus, run, scenario_tasks(10, seed=5))
    assert {t.policy_version for t in reader.until(ids, 60, agents)} == {1}  # they kept v1
    assert all("REFUSED" in a.log_path.read_text() for a in agents)
    prod.close()


def test_killed_agent_loses_nothing(pair):
    """Runs last: it kills one agent of the pair."""
    bus, run, agents, _, reader = pair
    victim, survivor = agents
    victim_parts = set(victim.status()["assignment"])
    tasks = scenario_tasks(600, seed=6)
    ids = produce_tasks(bus, run, tasks)

    def victim_answered(n: int) -> bool:  # counted on this test's tasks: the status also counts earlier tests'
        reader.all += [p.msg for p in reader.cons.poll(500, 0.2)]
        return sum(t.agent_id == victim.name and t.task_id in ids for t in reader.all) >= n

    wait_for(lambda: victim_answered(20), 60, "the victim to answer 20 tasks", agents)
    victim.proc.kill()  # SIGKILL: no goodbye, no commit
    victim.proc.wait()
    trajs = reader.until(ids, 90, agents)
    assert {t.task_id for t in trajs} == ids  # every task answered
    # at most the one task in flight at the kill was answered twice (produced, not committed): de-dup removes it
    assert len(trajs) - len(ids) <= 1
    # where each task was published: the survivor answered the victim's uncommitted share
    where = {}
    tap = bus.consumer({Topics(run).tasks: Task})
    wait_for(lambda: ids <= set(where.update({p.msg.task_id: f"{p.tp.topic}:{p.tp.partition}"
                                             for p in tap.poll(1000, 0.2)}) or where), 30, "the task log")
    tap.close()
    by_victim = sum(t.agent_id == victim.name for t in trajs)
    redelivered = sum(t.agent_id == survivor.name and where[t.task_id] in victim_parts for t in trajs)
    in_victim_parts = sum(where[i] in victim_parts for i in ids)
    assert by_victim >= 20 and redelivered > 0
    assert by_victim + redelivered >= in_victim_parts  # together they covered the victim's partitions
    assert set(survivor.status()["assignment"]) >= victim_parts


def test_an_agent_waiting_for_a_version_lets_a_joining_agent_have_its_share(kafka_broker, tiny_policy_dir, tmp_path):
    """An agent whose version has had its share (tasks_per_version 1, no new version coming) used to stop polling
    its task consumer, so a second agent's join waited for it to be evicted (max_poll_interval_ms, 300 s) and the
    run stalled (found by bench/chaos.py). Waiting, it now keeps its membership: the partitions are shared."""
    run = f"wait{os.getpid()}"
    bus = KafkaBus(kafka_broker, ClientSettings(client_id="sao-test"))
    bus.create_topics(partitions_by_topic(run))
    produce_tasks(bus, run, scenario_tasks(8, seed=3))
    pacing = ("tasks_per_version=1", "versions_ahead=0")
    first = AgentProc("w1", kafka_broker, run, tiny_policy_dir, tmp_path / "weights", tmp_path, *pacing)
    agents = [first]
    try:
        wait_for(lambda: first.status().get("tasks") == 1 and len(first.status().get("assignment", [])) == 4, 60,
                 "the first agent to answer its one task and hold every partition", agents)
        agents.append(AgentProc("w2", kafka_broker, run, tiny_policy_dir, tmp_path / "weights", tmp_path, *pacing))
        wait_for(lambda: split_between(agents), 45, "the waiting agent to give the joining one its share", agents)
    finally:
        for a in agents:
            a.stop()
