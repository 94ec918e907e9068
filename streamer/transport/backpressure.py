"""Simulator back-pressure: keep the task topic's lag under a bound, so a drift happens at one moment for every agent.

Without it the simulator publishes the whole stream in seconds; agents own different partitions and consume them
at different speeds, so the phases interleave (a family's reward falls before its drift marker). With a bound N the
simulator publishes a message only while fewer than N tasks are published and not yet committed by the agents'
consumer group (summed over partitions): when the first task of phase k+1 goes out, at most N-1 tasks of phase k are
still unanswered, whichever partitions they sit in.

Works the same on Apache Kafka and on the embedded Tansu broker, whose end offsets are wrong: what was published
is read from the producer's record metadata (absolute offsets, per partition), what was answered from the group's
committed offsets (an OffsetFetch by a consumer that carries the group id but never joins it). Agents commit a
partition only up to their oldest task in flight, after flushing its trajectories, so committed offsets are a safe
lower bound of what is answered.

    gate = LagGate(max_lag=default_max_lag(agents=2, concurrency=4, tasks_per_version=32, versions_ahead=1),
                   committed=CommittedOffsets(bootstrap, "exp1.agents"), flush=producer.flush)
    gate.wait(); gate.track(producer.send(...))   # KafkaTaskSink(max_lag=...) does this for every message
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kafka.structs import TopicPartition

log = logging.getLogger("sao.backpressure")

DEFAULT_BATCH_TASKS = 64  # the learner's default batch (batch.sync_batch) when the caller names none
POLL_S = 0.2  # how often a closed gate re-reads the committed offsets
QUIET_S = 60.0  # a closed gate says so once per this many seconds without progress, else nothing


def default_max_lag(agents: int, concurrency: int, tasks_per_version: int = 0, versions_ahead: int = 0,
                    batch: int = 0) -> int:
    """A bound from the consumers: the tasks all agents can hold in flight plus one learner batch (in tasks).

    An agent holds at most `concurrency` tasks, and with staleness-bounded admission (`tasks_per_version` > 0) at
    most (versions_ahead + 1) * tasks_per_version. `batch` (tasks per learner batch: trajectories / group size)
    defaults to agents * tasks_per_version, else DEFAULT_BATCH_TASKS: the slack that keeps every agent busy while
    partitions fill unevenly, and the most a phase interleaves with the next beyond what is in flight."""
    if agents < 1 or concurrency < 1 or tasks_per_version < 0 or versions_ahead < 0 or batch < 0:
        raise ValueError("default_max_lag: agents, concurrency >= 1; tasks_per_version, versions_ahead, batch >= 0")
    held = concurrency if not tasks_per_version else min(concurrency, (versions_ahead + 1) * tasks_per_version)
    batch = batch or agents * tasks_per_version or DEFAULT_BATCH_TASKS
    return agents * held + batch


class CommittedOffsets:
    """The committed offsets of a consumer group, read without joining it (works on Kafka and Tansu)."""

    def __init__(self, bootstrap: str, group: str, client_id: str = "sao-simulator") -> None:
        from kafka import KafkaConsumer

        self.group = group
        from streamer.wire.settings import KafkaSecurity

        self._c = KafkaConsumer(bootstrap_servers=bootstrap.split(","), group_id=group, client_id=client_id,
                                enable_auto_commit=False,  # never subscribes: no member, no rebalance
                                **KafkaSecurity().kafka_python())

    def __call__(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """Next offset the group will consume per partition (0 where it never committed)."""
        return {tp: self._c.committed(tp) or 0 for tp in tps}

    def close(self) -> None:
        self._c.close(autocommit=False)


class LagGate:
    """Blocks the publisher while published - committed >= max_lag (tasks, summed over partitions).

    `track(future)` counts a sent record: unacknowledged until its metadata arrives (counted as lag meanwhile),
    then by its partition's highest offset. `committed` maps partitions to the group's next offsets; `flush`
    makes the producer acknowledge what it holds."""

    def __init__(self, max_lag: int, committed: Callable[[Iterable[TopicPartition]], dict[TopicPartition, int]],
                 flush: Callable[[], Any], topic: str = "", poll_s: float = POLL_S) -> None:
        if max_lag < 1:
            raise ValueError(f"LagGate: max_lag must be >= 1 (got {max_lag}); 0 means no gate")
        self.max_lag, self.committed, self.flush = max_lag, committed, flush
        self.topic, self.poll_s = topic, poll_s
        self.high: dict[TopicPartition, int] = {}  # partition -> one past the highest acknowledged offset
        self.done: dict[TopicPartition, int] = {}  # partition -> committed offset, as last read
        self.unacked = 0
        self.waited_s = 0.0
        self._lock = threading.Lock()

    def track(self, future: Any) -> None:
        """Count a record sent with this future (kafka-python FutureRecordMetadata)."""
        with self._lock:
            self.unacked += 1
        future.add_callback(self._acked)
        future.add_errback(self._lost)

    def _acked(self, md: Any) -> None:
        tp = TopicPartition(md.topic, md.partition)
        with self._lock:
            self.unacked -= 1
            self.high[tp] = max(self.high.get(tp, 0), md.offset + 1)

    def _lost(self, _err: Any) -> None:
        with self._lock:
            self.unacked -= 1  # never published: nothing for the agents to answer

    def lag(self) -> int:
        """Tasks published (or in the producer) and not committed, by the offsets last read."""
        with self._lock:
            return self.unacked + sum(max(0, n - self.done.get(tp, 0)) for tp, n in self.high.items())

    def refresh(self) -> int:
        """Acknowledge what the producer holds, re-read the committed offsets; returns the lag."""
        self.flush()
        with self._lock:
            tps = list(self.high)
        fresh = self.committed(tps)
        with self._lock:
            for tp, n in fresh.items():
                self.done[tp] = max(self.done.get(tp, 0), n)
        return self.lag()

    def wait(self) -> float:
        """Return once lag < max_lag; the seconds waited. The offsets are re-read only when the cached ones
        (a lower bound: commits only grow) say the gate is closed."""
        if self.lag() < self.max_lag:
            return 0.0
        t0 = last = time.monotonic()
        seen = self.lag()
        while (lag := self.refresh()) >= self.max_lag:
            if lag < seen:
                seen, last = lag, time.monotonic()
            elif time.monotonic() - last > QUIET_S:
                log.warning("back-pressure: %d tasks of %s unanswered for %.0f s (bound %d): are agents running?",
                            lag, self.topic or "the task topic", time.monotonic() - last, self.max_lag)
                last = time.monotonic()
            time.sleep(self.poll_s)
        waited = time.monotonic() - t0
        self.waited_s += waited
        return waited
