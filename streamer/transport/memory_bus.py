"""In-memory transport with the Kafka bus's interface (partitions, consumer groups, commits, the DLQ), for unit
tests and single-process tools: `MemoryBus()` wherever a `KafkaBus(bootstrap)` would go."""

from __future__ import annotations

import time

from kafka.structs import TopicPartition

from streamer.transport.bus import Consumer, Producer, RawRecord
from streamer.wire.settings import ClientSettings


class MemoryBus:
    """In-process broker with the Kafka bus's interface: topics of partitions, groups, committed offsets.

    Each group's partitions are split round-robin among its open consumers at every poll."""

    def __init__(self, settings: ClientSettings | None = None) -> None:
        self.settings = settings or ClientSettings()
        self.logs: dict[str, list[list[tuple[bytes | None, bytes]]]] = {}
        self.committed: dict[str, dict[TopicPartition, int]] = {}
        self.members: dict[str, list["MemoryConsumer"]] = {}
        self._rr = 0

    def create_topics(self, partitions: dict[str, int], replication_factor: int = 1) -> list[str]:
        new = [t for t in partitions if t not in self.logs]
        for t in new:
            self.logs[t] = [[] for _ in range(partitions[t])]
        return new

    def append(self, topic: str, value: bytes, key: bytes | None) -> None:
        if topic not in self.logs:
            self.create_topics({topic: 1})  # like auto.create.topics.enable
        parts = self.logs[topic]
        if key:
            p = _stable_hash(key) % len(parts)
        else:
            p, self._rr = self._rr % len(parts), self._rr + 1
        parts[p].append((key, value))

    def producer(self) -> "MemoryProducer":
        return MemoryProducer(self)

    def consumer(self, types: dict[str, type], group_id: str | None = None, dlq: str | None = None,
                 producer: Producer | None = None, name: str | None = None) -> "MemoryConsumer":
        if dlq is not None and producer is None:
            producer = self.producer()
        return MemoryConsumer(self, types, group_id, dlq, producer, name)


def _stable_hash(key: bytes) -> int:
    h = 2166136261  # FNV-1a: stable across processes, unlike hash()
    for b in key:
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


class MemoryProducer(Producer):
    def __init__(self, bus: MemoryBus) -> None:
        self.bus = bus

    def send_raw(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self.bus.append(topic, bytes(value), key)

    def flush(self, timeout: float | None = None) -> None:
        pass


class MemoryConsumer(Consumer):
    def __init__(self, bus: MemoryBus, types: dict[str, type], group_id: str | None, dlq: str | None,
                 producer: Producer | None, name: str | None = None) -> None:
        super().__init__(types, dlq, producer, bus.settings.max_message_bytes, name or group_id or "memory")
        self.bus, self.group_id = bus, group_id
        self.tracks_commits = group_id is not None
        self._positions: dict[TopicPartition, int] = {}
        bus.create_topics({t: 1 for t in types})
        bus.members.setdefault(group_id or f"_solo{id(self)}", []).append(self)

    def assignment(self) -> set[TopicPartition]:
        all_tps = [TopicPartition(t, p) for t in sorted(self.types) for p in range(len(self.bus.logs[t]))]
        members = self.bus.members.get(self.group_id, [self]) if self.group_id else [self]
        idx = members.index(self)
        mine = {tp for i, tp in enumerate(all_tps) if i % len(members) == idx}
        for tp in set(self._positions) - mine:  # revoked
            del self._positions[tp]
            self._forget([tp])
        return mine

    def position(self, tp: TopicPartition) -> int:
        if tp not in self._positions:
            self._positions[tp] = self.bus.committed.get(self.group_id or "", {}).get(tp, 0)
        return self._positions[tp]

    def _raw_poll(self, max_records: int, timeout: float) -> list[RawRecord]:
        out: list[RawRecord] = []
        for tp in sorted(self.assignment()):
            log_ = self.bus.logs[tp.topic][tp.partition]
            pos = self.position(tp)
            for off in range(pos, min(len(log_), pos + max_records - len(out))):
                out.append(RawRecord(tp, off, *log_[off]))
            self._positions[tp] = pos + sum(1 for r in out if r.tp == tp)
        if not out and timeout > 0:
            time.sleep(min(timeout, 0.01))
        return out

    def _raw_commit(self, offsets: dict[TopicPartition, int]) -> bool:
        if self.group_id is None:
            return True
        mine = self.assignment()
        if any(tp not in mine for tp in offsets):
            return False
        self.bus.committed.setdefault(self.group_id, {}).update(offsets)
        return True

    def seek(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, n in offsets.items():
            self._positions[tp] = n
            self._forget([tp])

    def close(self) -> None:
        members = self.bus.members.get(self.group_id or f"_solo{id(self)}", [])
        if self in members:
            members.remove(self)
