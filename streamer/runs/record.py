"""`sao record`: tap `<run>.tasks` (and its drift events) into a task-stream file that `sao replay` reads.

    sao record --bootstrap 127.0.0.1:9092 --run exp1 --out runs/exp1/tasks.jsonl [--limit N] [--idle-exit 5]

The file format follows the extension (.jsonl, .parquet, .csv; the simulator's `simulator.sinks.file_sink`, which
the caller passes); rows are the Task fields (created_at is the timestamp replay paces by) plus drift-event rows.
Partitions interleave, so rows pass through a reorder buffer sorted by (created_at, seq) before they are written.
"""

from __future__ import annotations

import argparse
import heapq
import json
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from streamer.transport.bus import Consumer
from streamer.transport.kafka_bus import KafkaBus
from streamer.wire.schema import DriftEvent, Task
from streamer.wire.settings import ClientSettings
from streamer.wire.topics import Topics


def _order_key(msg: Task | DriftEvent) -> tuple[float, float]:
    # a drift event goes right before the task that opens its phase
    return (msg.time, msg.at_seq - 0.5) if isinstance(msg, DriftEvent) else (msg.created_at, msg.seq)


class Recorder:
    """Consumer -> k-way merge of the task partitions -> TaskSink.

    Kafka keeps order within a partition only: a row is written once every task partition has a
    later row buffered (or the buffer holds `window` rows, or the tap ends). A drift event is merged
    by time with the tasks fetched with it: the simulator publishes it before its phase's tasks."""

    def __init__(self, consumer: Consumer, sink: Any, window: int = 100_000) -> None:
        self.consumer, self.sink, self.window = consumer, sink, window
        self._heap: list[tuple[tuple[float, float], int, Task | DriftEvent]] = []
        self._buffered: Counter[Any] = Counter()  # task partition -> rows in the heap
        self._tag: dict[int, Any] = {}
        self._n = 0  # tasks read
        self._i = 0  # messages read: heap tie-break and tag
        self._limit_seq: int | None = None
        self.tasks = 0
        self.drift_events = 0

    def _task_partitions(self) -> set[Any]:
        return {tp for tp in self.consumer.assignment() if tp.topic.endswith(".tasks")}

    def _emit(self) -> None:
        _, n, msg = heapq.heappop(self._heap)
        tp = self._tag.pop(n, None)
        if tp is not None:
            self._buffered[tp] -= 1
        if isinstance(msg, DriftEvent):
            self.sink.write_drift(msg)
            self.drift_events += 1
        else:
            self.sink.write(msg)
            self.tasks += 1

    def _ready(self) -> bool:
        if not self._heap:
            return False
        if len(self._heap) > self.window:
            return True
        return all(self._buffered[tp] > 0 for tp in self._task_partitions())

    def pump(self, timeout: float = 0.5, limit: int = 0) -> int:
        """Read one batch; returns the messages read. Past `limit` tasks, only earlier drift events are kept."""
        batch = self.consumer.poll(100_000, timeout)
        for msg, tp, _ in batch:
            self._i += 1
            if isinstance(msg, Task):
                if limit and self._n >= limit:
                    continue
                self._n += 1
                if self._n == limit:
                    self._limit_seq = msg.seq
                self._buffered[tp] += 1
                self._tag[self._i] = tp
            elif self._limit_seq is not None and msg.at_seq > self._limit_seq:
                continue
            heapq.heappush(self._heap, (_order_key(msg), self._i, msg))
        while self._ready():  # after the whole batch: a drift event fetched with its tasks sorts first
            self._emit()
        return len(batch)

    def close(self) -> None:
        while self._heap:
            self._emit()
        self.sink.close()

    def run(self, limit: int = 0, idle_exit_s: float = 0.0, should_stop=lambda: False) -> None:
        idle_since = time.monotonic()
        try:
            while not should_stop():
                got = self.pump(limit=limit)
                if limit and self._n >= limit and not got:
                    break  # the limit is reached and the drift events before it are in
                if got:
                    idle_since = time.monotonic()
                elif idle_exit_s and time.monotonic() - idle_since > idle_exit_s:
                    break
        finally:
            self.close()


def main(argv: list[str], file_sink: Callable[[str], Any] | None = None) -> int:
    """`file_sink(path)`: the task sink that writes the file's format (`sao record` passes the simulator's
    `simulator.sinks.file_sink`, the format `sao replay` reads; streamer.runs does not import the simulator)."""
    p = argparse.ArgumentParser(prog="sao record", description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (default: $SAO_BOOTSTRAP)")
    p.add_argument("--run", required=True, help="run name (topic prefix)")
    p.add_argument("--out", required=True, help="output file: .jsonl, .parquet or .csv")
    p.add_argument("--limit", type=int, default=0, help="stop after this many tasks (0: until stopped)")
    p.add_argument("--idle-exit", type=float, default=0.0, help="stop after this many seconds without messages")
    p.add_argument("--no-drift", action="store_true", help="tasks only (no drift-event rows)")
    p.add_argument("--window", type=int, default=100_000, help="reorder buffer size in rows")
    a = p.parse_args(argv)
    if file_sink is None:
        raise TypeError("sao record: main() needs file_sink (simulator.sinks.file_sink)")
    t = Topics(a.run)
    bus = KafkaBus(a.bootstrap, ClientSettings(client_id="sao-record"))
    types: dict[str, type] = {t.tasks: Task} if a.no_drift else {t.tasks: Task, t.drift: DriftEvent}
    from kafka.errors import KafkaError

    try:
        consumer = bus.consumer(types, group_id=None, dlq=t.dlq)  # every partition from the start
    except (KafkaError, RuntimeError) as e:
        print(f"sao record: Kafka at {bus.bootstrap}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    rec = Recorder(consumer, file_sink(a.out), a.window)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        rec.run(a.limit, a.idle_exit, lambda: stop["now"])
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    print(json.dumps({"out": a.out, "tasks": rec.tasks, "drift_events": rec.drift_events,
                      "dead_letters": consumer.dead_letters}))
    return 0
