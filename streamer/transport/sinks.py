"""The Kafka task sink of the simulator: tasks to `<run>.tasks` (keyed by task id), drift events to `<run>.drift`.

Implements simulator.sinks.TaskSink (`write`, `write_drift`, `close`), so `sao simulate --bootstrap ...` works.
With `max_lag` > 0 every message first waits until the agents' group has fewer than `max_lag` tasks unanswered
(streamer.transport.backpressure), so a drift event goes out together with the first task of its phase.
"""

from __future__ import annotations

from streamer.transport.bus import Producer
from streamer.transport.kafka_bus import KafkaBus
from streamer.wire.schema import DriftEvent, Task
from streamer.wire.settings import ClientSettings, TopicSettings
from streamer.wire.topics import Topics, partitions_by_topic


class KafkaTaskSink:
    def __init__(self, bootstrap: str | None, run: str, settings: ClientSettings | None = None,
                 topics: TopicSettings | None = None, producer: Producer | None = None,
                 max_lag: int = 0, group: str = "") -> None:
        """Creates the run's topics if missing. `producer` (e.g. a MemoryBus producer) replaces Kafka.
        `max_lag` > 0: back-pressure against consumer group `group` ("" -> "<run>.agents"); needs Kafka."""
        self.topics = Topics(run)
        self.gate = None
        if producer is None:
            bus = KafkaBus(bootstrap, settings)
            bus.create_topics(partitions_by_topic(run, topics))
            producer = bus.producer()
            if max_lag > 0:
                self.gate = self._gate(bus, max_lag, group or f"{run}.agents", producer)
        elif max_lag > 0:
            raise ValueError("KafkaTaskSink: max_lag needs Kafka (no committed offsets on a given producer)")
        self.producer = producer
        self.sent = 0

    def _gate(self, bus: KafkaBus, max_lag: int, group: str, producer: Producer):
        from streamer.transport.backpressure import CommittedOffsets, LagGate

        committed = CommittedOffsets(bus.bootstrap, group, client_id=bus.settings.client_id)
        return LagGate(max_lag, committed, producer.flush, topic=self.topics.tasks)

    def write(self, task: Task) -> None:
        if self.gate is not None:
            self.gate.wait()
            self.gate.track(self.producer.send(self.topics.tasks, task, key=task.task_id))
        else:
            self.producer.send(self.topics.tasks, task, key=task.task_id)
        self.sent += 1

    def write_drift(self, event: DriftEvent) -> None:
        if self.gate is not None:
            self.gate.wait()  # the next task (its phase's first) passes the same gate at once
        self.producer.send(self.topics.drift, event, key=str(event.phase))

    def flush(self) -> None:
        self.producer.flush()

    def close(self) -> None:
        self.producer.flush()
        self.producer.close()
        if self.gate is not None:
            self.gate.committed.close()
