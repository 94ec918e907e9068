"""Simulator back-pressure: the bound from the consumers, the lag gate, and phase ordering against the real broker.

The broker tests watch the consumer side: when a task of phase k+1 is first consumed, at most `max_lag` tasks of
phase k may still be unconsumed; with `--max-lag 0` the simulator publishes everything at once, as before.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from kafka.structs import TopicPartition

from simulator.run import main as simulate_main
from streamer.transport.backpressure import DEFAULT_BATCH_TASKS, LagGate, default_max_lag
from streamer.transport.memory_bus import MemoryBus
from streamer.transport.sinks import KafkaTaskSink
from streamer.wire.schema import Task

PHASES, PER_PHASE = 3, 40
SCENARIO = "name: bp\nphases:\n" + "".join(
    f"  - name: p{i}\n    duration_tasks: {PER_PHASE}\n"
    + ("    families: {arith: 1, string: 1}\n" if i == 0 else "")
    + f"    concepts: {{arith: {['add10', 'sub10', 'add10'][i]}, string: {['reverse', 'sort', 'reverse'][i]}}}\n"
    for i in range(PHASES))


# ----------------------------------------------------------------------------------------- no broker

def test_default_max_lag_is_what_agents_hold_plus_one_batch():
    assert default_max_lag(agents=2, concurrency=4, tasks_per_version=32, versions_ahead=1) == 2 * 4 + 64
    assert default_max_lag(agents=2, concurrency=8, tasks_per_version=2, versions_ahead=1) == 2 * 4 + 4
    assert default_max_lag(agents=1, concurrency=1) == 1 + DEFAULT_BATCH_TASKS
    assert default_max_lag(agents=3, concurrency=2, batch=10) == 16
    with pytest.raises(ValueError):
        default_max_lag(agents=0, concurrency=1)


class _Future:
    def __init__(self, md=None):
        self.md, self.cbs = md, []

    def add_callback(self, fn):
        if self.md is not None:
            fn(self.md)
        else:
            self.cbs.append(fn)

    def add_errback(self, fn):
        pass


class _Md:
    def __init__(self, partition, offset):
        self.topic, self.partition, self.offset = "r.tasks", partition, offset


def test_gate_counts_unacked_and_acked_and_opens_when_commits_catch_up():
    committed = {TopicPartition("r.tasks", 0): 0, TopicPartition("r.tasks", 1): 0}
    pending = _Future()
    def flush():  # the producer acknowledges the pending record: partition 1, offset 0
        while pending.cbs:
            pending.cbs.pop()(_Md(1, 0))

    gate = LagGate(3, lambda tps: {tp: committed[tp] for tp in tps}, flush=flush, poll_s=0.01)
    gate.track(_Future(_Md(0, 5)))  # partition 0 offsets 0..5 published: 6 ahead of a commit at 0
    gate.track(pending)
    assert gate.lag() == 7  # the unacknowledged record counts until its metadata arrives

    def commit_later():
        time.sleep(0.1)
        committed[TopicPartition("r.tasks", 0)] = 5
        committed[TopicPartition("r.tasks", 1)] = 1

    threading.Thread(target=commit_later).start()
    assert gate.wait() >= 0.05  # closed until the commits bring the lag to 1
    assert gate.lag() == 1 and gate.wait() == 0.0


def test_file_sinks_ignore_max_lag_and_memory_producers_refuse_it(tmp_path, capsys):
    out = tmp_path / "tasks.jsonl"
    assert simulate_main(["--scenario", "default", "--out", str(out), "--limit", "20", "--max-lag", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["tasks"] == 20
    with pytest.raises(ValueError, match="max_lag needs Kafka"):
        KafkaTaskSink(None, "r", producer=MemoryBus().producer(), max_lag=3)


# ----------------------------------------------------------------------------------------- real broker

def _agent(bus, run: str, work_s: float, phases: list[int], ready: threading.Event, stop: threading.Event) -> None:
    """One consumer in the agents' group: takes a task, works `work_s`, commits it."""
    cons = bus.consumer({f"{run}.tasks": Task}, group_id=f"{run}.agents")
    try:
        while not stop.is_set():
            for task, tp, offset in cons.poll(max_records=1, timeout=0.2):
                phases.append(task.phase)
                time.sleep(work_s)
                cons.commit({tp: offset + 1})
            if len(cons.assignment()) == 2:  # the group is settled: two partitions each
                ready.set()
    finally:
        cons.close()


def _interleave(phases: list[int]) -> int:
    """Most tasks of a phase still unconsumed when the first task of the next phase is consumed."""
    worst = 0
    for k in range(max(phases)):
        first_next = phases.index(k + 1)
        worst = max(worst, phases.count(k) - phases[:first_next].count(k))
    return worst


def _run(kafka_bus, kafka_run, tmp_path, capsys, max_lag: int) -> tuple[list[int], dict, int]:
    """A fast and a slow agent (2 and 30 ms a task, two partitions each) answer the scenario's stream."""
    path = tmp_path / "bp.yaml"
    path.write_text(SCENARIO)
    KafkaTaskSink(kafka_bus.bootstrap, kafka_run).close()  # creates the topics before the agents subscribe
    phases: list[int] = []
    ready, stop = [threading.Event(), threading.Event()], threading.Event()
    agents = [threading.Thread(target=_agent, args=(kafka_bus, kafka_run, w, phases, r, stop))
              for w, r in zip((0.002, 0.03), ready)]
    for a in agents:
        a.start()
    try:
        assert all(r.wait(20) for r in ready), "the agents' group did not settle"
        assert simulate_main(["--scenario", str(path), "--bootstrap", kafka_bus.bootstrap, "--run", kafka_run,
                              "--max-lag", str(max_lag)]) == 0
        consumed_when_done = len(phases)
        deadline = time.monotonic() + 20
        while len(phases) < PHASES * PER_PHASE and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for a in agents:
            a.join(10)
    assert len(phases) == PHASES * PER_PHASE
    captured = capsys.readouterr()
    return phases, {"summary": json.loads(captured.out), "err": captured.err}, consumed_when_done


@pytest.mark.kafka
def test_back_pressure_keeps_phases_apart(kafka_bus, kafka_run, tmp_path, capsys):
    phases, out, _ = _run(kafka_bus, kafka_run, tmp_path, capsys, max_lag=8)
    assert _interleave(phases) <= 8, phases
    assert "at most 8 tasks" in out["err"] and f"{kafka_run}.agents" in out["err"]
    assert out["summary"]["max_lag"] == 8 and out["summary"]["waited_s"] > 0


@pytest.mark.kafka
def test_max_lag_0_publishes_everything_at_once(kafka_bus, kafka_run, tmp_path, capsys):
    phases, out, consumed_when_done = _run(kafka_bus, kafka_run, tmp_path, capsys, max_lag=0)
    assert consumed_when_done < PER_PHASE  # the whole stream was out before the agent got far
    assert "max_lag" not in out["summary"] and "no back-pressure" in out["err"]
    assert _interleave(phases) > 8, phases  # partitions drained one after another: phases interleave
