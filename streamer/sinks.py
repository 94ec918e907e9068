"""The Kafka task sink of the simulator: tasks to `<run>.tasks` (keyed by task id), drift events to `<run>.drift`.

Implements simulator.sinks.TaskSink (`write`, `write_drift`, `close`), so `sao simulate --bootstrap ...` works.
"""

from __future__ import annotations

from streamer.bus import KafkaBus, Producer
from streamer.schema import DriftEvent, Task
from streamer.settings import ClientSettings, TopicSettings
from streamer.topics import Topics, partitions_by_topic


class KafkaTaskSink:
    def __init__(self, bootstrap: str | None, run: str, settings: ClientSettings | None = None,
                 topics: TopicSettings | None = None, producer: Producer | None = None) -> None:
        """Creates the run's topics if missing. `producer` (e.g. a MemoryBus producer) replaces Kafka."""
        self.topics = Topics(run)
        if producer is None:
            bus = KafkaBus(bootstrap, settings)
            bus.create_topics(partitions_by_topic(run, topics))
            producer = bus.producer()
        self.producer = producer
        self.sent = 0

    def write(self, task: Task) -> None:
        self.producer.send(self.topics.tasks, task, key=task.task_id)
        self.sent += 1

    def write_drift(self, event: DriftEvent) -> None:
        self.producer.send(self.topics.drift, event, key=str(event.phase))

    def flush(self) -> None:
        self.producer.flush()

    def close(self) -> None:
        self.producer.flush()
        self.producer.close()
