"""The transport: typed producers and consumers over Kafka (kafka-python) or in memory, with a dead-letter topic.

    bus = KafkaBus("127.0.0.1:9092")            # or MemoryBus() in unit tests: same interface
    bus.create_topics(partitions_by_topic("exp1"))
    prod = bus.producer(); prod.send("exp1.tasks", task, key=task.task_id); prod.flush()
    cons = bus.consumer({"exp1.tasks": Task}, group_id="exp1.agents", dlq="exp1.dlq")
    for msg, tp, offset in cons.poll(max_records=1, timeout=1.0): ...
    cons.commit({tp: offset + 1})                # manual commits only, after the result is flushed

Every consumer sends undecodable, invalid or oversized messages to its DLQ topic as a `DeadLetter`
(reason + original bytes), counts them in `dead_letters`, and carries on.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, NamedTuple

from kafka.structs import TopicPartition

from streamer.wire.schema import DeadLetter, Message, SchemaError, decode, encode
from streamer.wire.settings import ClientSettings

log = logging.getLogger(__name__)

DLQ_MAX_VALUE_BYTES = 8 * 1024 * 1024  # original bytes above this are cut (value_len keeps the size)
STALL_S = 5.0  # a Kafka consumer that got nothing this long checks for partitions it stopped fetching


class Polled(NamedTuple):
    msg: Any  # a decoded schema struct
    tp: TopicPartition
    offset: int


class RawRecord(NamedTuple):
    tp: TopicPartition
    offset: int
    key: bytes | None
    value: bytes


def reason_kind(reason: str) -> str:
    """The counter a dead letter falls under: oversized, undecodable, schema_version or invalid."""
    if reason.startswith("oversized"):
        return "oversized"
    if "undecodable" in reason:
        return "undecodable"
    return "schema_version" if "schema version" in reason else "invalid"


def _key_bytes(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


class SendError(Exception):
    """Records the broker did not confirm after the producer's retries: the caller must not commit what they
    answer (not a RuntimeError, so no task-level handler takes it for a bad task)."""


class Producer:
    """Encodes schema structs (msgpack) and hands bytes to a transport. `flush()` returns only once every record
    sent since the last flush is confirmed by the broker, and raises `SendError` otherwise."""

    def send(self, topic: str, msg: Message, key: str | bytes | None = None) -> Any:
        """Returns the transport's delivery future (Kafka: record metadata), or None."""
        return self.send_raw(topic, encode(msg), _key_bytes(key))

    def send_raw(self, topic: str, value: bytes, key: bytes | None = None) -> Any:
        raise NotImplementedError

    def flush(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Consumer:
    """Decoding consumer with DLQ and manual commits; transports implement the `_raw_*` methods.

    Commit bookkeeping: per partition, `_high` is the offset after the last record seen (valid or
    dead-lettered) and `_pending` the valid offsets handed out and not yet committed. A commit of
    n on a partition whose handed-out records are all below n is raised to `_high`, so trailing
    dead letters are not redelivered after a restart; records handed out later are never skipped.
    """

    def __init__(self, types: dict[str, type], dlq: str | None, producer: Producer | None,
                 max_message_bytes: int, name: str) -> None:
        self.types = dict(types)
        self.dlq, self.dlq_producer = dlq, producer
        self.max_message_bytes = max_message_bytes
        self.name = name
        self.dead_letters = 0
        self.dead_by_reason: Counter[str] = Counter()
        self.in_dlq: set[tuple[str, int, int]] = set()  # (topic, partition, offset) already dead-lettered by `name`
        self._high: dict[TopicPartition, int] = {}
        self._pending: dict[TopicPartition, set[int]] = {}
        self.tracks_commits = True  # False for group-less taps: nothing to commit, nothing to remember

    # --- transport hooks
    def _raw_poll(self, max_records: int, timeout: float) -> list[RawRecord]:
        raise NotImplementedError

    def _raw_commit(self, offsets: dict[TopicPartition, int]) -> bool:
        raise NotImplementedError

    def seek(self, offsets: dict[TopicPartition, int]) -> None:
        """Next offsets to read, e.g. from a learner checkpoint (applied on assignment if not assigned yet)."""
        raise NotImplementedError

    def assignment(self) -> set[TopicPartition]:
        raise NotImplementedError

    def position(self, tp: TopicPartition) -> int:
        raise NotImplementedError

    def close(self) -> None:
        pass

    # --- shared logic
    def poll(self, max_records: int = 500, timeout: float = 1.0) -> list[Polled]:
        """Up to max_records decoded messages; bad ones go to the DLQ and are not returned."""
        out: list[Polled] = []
        dead = 0
        for rec in self._raw_poll(max_records, timeout):
            self._high[rec.tp] = max(self._high.get(rec.tp, 0), rec.offset + 1)
            msg = self._decode(rec)
            if msg is None:
                dead += 1
                continue
            if self.tracks_commits:
                self._pending.setdefault(rec.tp, set()).add(rec.offset)
            out.append(Polled(msg, rec.tp, rec.offset))
        if dead and self.dlq_producer is not None:
            self.dlq_producer.flush()
        return out

    def _decode(self, rec: RawRecord) -> Any | None:
        expected = self.types[rec.tp.topic]
        # a dead letter wraps a message up to DLQ_MAX_VALUE_BYTES: DLQ readers take that much
        limit = self.max_message_bytes if expected is not DeadLetter else DLQ_MAX_VALUE_BYTES + 64 * 1024
        if len(rec.value) > limit:
            reason = f"oversized: {len(rec.value)} bytes > max_message_bytes {limit}"
        else:
            try:
                return decode(rec.value, expected)
            except SchemaError as e:
                reason = str(e)
        self._dead_letter(rec, reason, expected.__name__)
        return None

    def _dead_letter(self, rec: RawRecord, reason: str, expected: str) -> None:
        key = (rec.tp.topic, rec.tp.partition, rec.offset)
        if key in self.in_dlq:  # read again after a restart: sent and counted already
            return
        self.in_dlq.add(key)
        self.dead_letters += 1
        self.dead_by_reason[reason_kind(reason)] += 1
        log.warning("%s: %s[%d]@%d -> DLQ: %s", self.name, rec.tp.topic, rec.tp.partition, rec.offset, reason)
        if self.dlq is None or self.dlq_producer is None:
            return
        letter = DeadLetter(topic=rec.tp.topic, partition=rec.tp.partition, offset=rec.offset, key=rec.key,
                            value=bytes(rec.value[:DLQ_MAX_VALUE_BYTES]), value_len=len(rec.value),
                            reason=reason, expected=expected, consumer=self.name, time=time.time())
        self.dlq_producer.send(self.dlq, letter, key=rec.key)

    def reject(self, msg: Message, tp: TopicPartition, offset: int, reason: str) -> None:
        """A decoded message that fails the consumer's own checks (e.g. token ids outside the model's vocabulary):
        to the DLQ (re-encoded) and counted, like one that did not decode."""
        self._dead_letter(RawRecord(tp, offset, None, encode(msg)), reason, type(msg).__name__)
        if self.dlq_producer is not None:
            self.dlq_producer.flush()

    def commit(self, offsets: dict[TopicPartition, int] | None = None) -> bool:
        """Commit next-offsets (offset of the last processed record + 1); None: all records seen so far.

        Returns False when the group took the partitions away meanwhile (the records will be
        redelivered to their new owner; downstream de-duplicates by task id)."""
        if offsets is None:
            offsets = dict(self._high)
        final: dict[TopicPartition, int] = {}
        for tp, n in offsets.items():
            pending = self._pending.get(tp, set())
            pending.difference_update({o for o in pending if o < n})
            final[tp] = self._high.get(tp, n) if not pending else n
            final[tp] = max(final[tp], n)
        return self._raw_commit(final) if final else True

    def _forget(self, tps) -> None:
        for tp in tps:
            self._high.pop(tp, None)
            self._pending.pop(tp, None)


# ----------------------------------------------------------------------------------------- Kafka

def compression_type(setting: str) -> str | None:
    """'auto': lz4 when its codec is installed, else none.

    Measured (bench/transport.py, 3 KB trajectories, 2 cores): gzip cuts producer throughput 3-5x for
    a 34% size cut; lz4 keeps it (27% cut, which matters on the in-memory broker)."""
    from kafka import codec

    if setting == "auto":
        return "lz4" if codec.has_lz4() else None
    return None if setting == "none" else setting


class KafkaProducerClient(Producer):
    def __init__(self, bootstrap: str, settings: ClientSettings, **overrides: Any) -> None:
        from kafka import KafkaProducer

        cfg = dict(bootstrap_servers=bootstrap.split(","), client_id=settings.client_id, acks="all",
                   enable_idempotence=settings.idempotence, retries=float("inf"),  # bounded by delivery_timeout_ms
                   compression_type=compression_type(settings.compression), linger_ms=settings.linger_ms,
                   batch_size=settings.batch_size, request_timeout_ms=settings.request_timeout_ms,
                   delivery_timeout_ms=max(settings.delivery_timeout_ms,
                                           settings.request_timeout_ms + settings.linger_ms),
                   max_request_size=max(DLQ_MAX_VALUE_BYTES, settings.max_message_bytes) + 64 * 1024,
                   **settings.security.kafka_python())
        cfg.update(overrides)
        self._p = KafkaProducer(**cfg)
        self._unconfirmed: list[tuple[str, Any]] = []

    def send_raw(self, topic: str, value: bytes, key: bytes | None = None) -> Any:
        future = self._p.send(topic, value=value, key=key)  # FutureRecordMetadata
        self._unconfirmed.append((topic, future))
        return future

    def flush(self, timeout: float | None = None) -> None:
        """kafka-python's flush() returns even when records failed: check every future since the last flush."""
        from kafka.errors import KafkaTimeoutError

        sent, self._unconfirmed = self._unconfirmed, []
        try:
            self._p.flush(timeout=timeout)
        except KafkaTimeoutError as e:
            raise SendError(f"{len(sent)} record(s) not confirmed by the broker within {timeout} s: {e}") from e
        failed = [(topic, f.exception) for topic, f in sent if not f.is_done or f.failed()]
        if failed:
            topics = sorted({t for t, _ in failed})
            raise SendError(f"{len(failed)} of {len(sent)} record(s) to {', '.join(topics)} failed after the "
                            f"producer's retries: {type(failed[0][1]).__name__}: {failed[0][1]}")

    def close(self) -> None:
        self._p.close(timeout=5)


class KafkaConsumerClient(Consumer):
    def __init__(self, bootstrap: str, settings: ClientSettings, types: dict[str, type], group_id: str | None,
                 dlq: str | None, producer: Producer | None, **overrides: Any) -> None:
        from kafka import ConsumerRebalanceListener, KafkaConsumer

        super().__init__(types, dlq, producer, settings.max_message_bytes, group_id or settings.client_id)
        cfg = dict(bootstrap_servers=bootstrap.split(","), client_id=settings.client_id, group_id=group_id,
                   enable_auto_commit=False, auto_offset_reset="earliest",  # Tansu: 'latest' is unreliable
                   session_timeout_ms=settings.session_timeout_ms,
                   heartbeat_interval_ms=settings.heartbeat_interval_ms,
                   max_poll_interval_ms=settings.max_poll_interval_ms, check_crcs=True,
                   request_timeout_ms=max(settings.request_timeout_ms, settings.session_timeout_ms + 5000),
                   **settings.security.kafka_python())
        cfg.update(overrides)
        self._c = KafkaConsumer(**cfg)
        self._last_records = time.monotonic()
        self._seek_on_assign: dict[TopicPartition, int] = {}
        if dlq is not None and producer is not None:
            self.in_dlq = letters_in(bootstrap, settings, dlq, self.name)
        outer = self

        class _Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked):
                outer._forget(revoked)

            def on_partitions_assigned(self, assigned):
                for tp in assigned:
                    if tp in outer._seek_on_assign:
                        outer._c.seek(tp, outer._seek_on_assign.pop(tp))

        if group_id is not None:
            self._c.subscribe(list(types), listener=_Listener())
        else:
            self._c.assign(self._all_partitions(list(types)))
            self.tracks_commits = False

    def _all_partitions(self, topics: list[str], wait_s: float = 10.0) -> list[TopicPartition]:
        deadline = time.monotonic() + wait_s
        tps: list[TopicPartition] = []
        for t in topics:
            parts = self._c.partitions_for_topic(t)
            while not parts and time.monotonic() < deadline:
                time.sleep(0.1)
                parts = self._c.partitions_for_topic(t)
            if not parts:
                raise RuntimeError(f"topic {t!r} does not exist (create it first: KafkaBus.create_topics)")
            tps += [TopicPartition(t, p) for p in sorted(parts)]
        return tps

    def _raw_poll(self, max_records: int, timeout: float) -> list[RawRecord]:
        batches = self._c.poll(timeout_ms=int(timeout * 1000), max_records=max_records)
        out = [RawRecord(tp, r.offset, r.key, r.value) for tp, recs in batches.items() for r in recs]
        now = time.monotonic()
        if out:
            self._last_records = now
        elif now - self._last_records > STALL_S:
            self._unstall()
            self._last_records = now
        return out

    def _unstall(self) -> None:
        """Seen on the embedded broker after a consumer restart: polls return nothing while a partition still has
        records after the consumer's position. Seeking to the position itself restarts that partition's fetch."""
        tps = sorted(self._c.assignment())
        if not tps:
            return
        end = self._c.end_offsets(tps)
        for tp in tps:
            pos = self._c.position(tp)
            if pos is not None and end.get(tp, 0) > pos:
                log.warning("%s: %s[%d] at %d of %d but no records for %.0f s: fetching it again", self.name,
                            tp.topic, tp.partition, pos, end[tp], STALL_S)
                self._c.seek(tp, pos)

    def _raw_commit(self, offsets: dict[TopicPartition, int]) -> bool:
        from kafka.errors import CommitFailedError, IllegalStateError
        from kafka.structs import OffsetAndMetadata

        if self._c.config["group_id"] is None:
            return True  # no group: nothing to commit to (the caller keeps its positions)
        try:
            self._c.commit({tp: OffsetAndMetadata(n, "", -1) for tp, n in offsets.items()})
            return True
        except (CommitFailedError, IllegalStateError) as e:
            log.warning("%s: commit of %s failed (partitions reassigned?): %s", self.name, offsets, e)
            return False

    def seek(self, offsets: dict[TopicPartition, int]) -> None:
        assigned = self._c.assignment()
        for tp, n in offsets.items():
            if tp in assigned:
                self._c.seek(tp, n)
                self._forget([tp])
            else:
                self._seek_on_assign[tp] = n

    def assignment(self) -> set[TopicPartition]:
        return set(self._c.assignment())

    def position(self, tp: TopicPartition) -> int:
        return self._c.position(tp)

    def close(self) -> None:
        self._c.close(autocommit=False)


def read_topic(bootstrap: str, settings: ClientSettings, topic: str, timeout_s: float = 15.0,
               idle_polls: int = 2) -> list[tuple[int, int, bytes]]:
    """(partition, offset, value) of every record of `topic`, read from the start until every partition has
    reached its end offset and `idle_polls` polls of 0.25 s in a row brought nothing (the embedded broker's end
    offsets can be short). Raises TimeoutError after `timeout_s`."""
    from kafka import KafkaConsumer

    c = KafkaConsumer(bootstrap_servers=bootstrap.split(","), client_id=settings.client_id, group_id=None,
                      enable_auto_commit=False, request_timeout_ms=settings.request_timeout_ms,
                      **settings.security.kafka_python())
    out: list[tuple[int, int, bytes]] = []
    try:
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or ())]
        if not tps:
            return out
        c.assign(tps)
        c.seek_to_beginning(*tps)
        end = c.end_offsets(tps)
        deadline, idle = time.monotonic() + timeout_s, 0
        while idle < idle_polls or any(c.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: not read to its end within {timeout_s} s")
            batches = c.poll(timeout_ms=250)
            idle = 0 if batches else idle + 1
            out += [(r.partition, r.offset, r.value) for records in batches.values() for r in records]
    finally:
        c.close(autocommit=False)
    return out


def letters_in(bootstrap: str, settings: ClientSettings, dlq: str, name: str,
               timeout_s: float = 15.0) -> set[tuple[str, int, int]]:
    """(topic, partition, offset) of every dead letter consumer `name` has sent to `dlq`: a consumer restarted from
    older offsets reads those records again and must not send their letters twice. The DLQ is small (bad input
    only); it is read whole at the consumer's creation."""
    try:
        records = read_topic(bootstrap, settings, dlq, timeout_s)
    except TimeoutError:
        raise SendError(f"{dlq}: could not read the dead letters already sent within {timeout_s} s") from None
    found: set[tuple[str, int, int]] = set()
    for _, _, value in records:
        try:
            letter = decode(value, DeadLetter)
        except SchemaError:
            continue
        if letter.consumer == name:
            found.add((letter.topic, letter.partition, letter.offset))
    return found


class KafkaBus:
    """Clients for one Kafka (or Tansu) cluster, with the project's defaults."""

    def __init__(self, bootstrap: str | None = None, settings: ClientSettings | None = None) -> None:
        self.settings = settings or ClientSettings()
        self.bootstrap = bootstrap or self.settings.resolved_bootstrap()

    def producer(self, **overrides: Any) -> KafkaProducerClient:
        return KafkaProducerClient(self.bootstrap, self.settings, **overrides)

    def consumer(self, types: dict[str, type], group_id: str | None = None, dlq: str | None = None,
                 producer: Producer | None = None, **overrides: Any) -> KafkaConsumerClient:
        """group_id None: read every partition from the start, no commits (taps, dashboards)."""
        if dlq is not None and producer is None:
            producer = self.producer()
        return KafkaConsumerClient(self.bootstrap, self.settings, types, group_id, dlq, producer, **overrides)

    def create_topics(self, partitions: dict[str, int]) -> list[str]:
        """Create the missing topics; returns those created."""
        from kafka import KafkaAdminClient
        from kafka.admin import NewTopic
        from kafka.errors import TopicAlreadyExistsError

        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap.split(","), client_id=self.settings.client_id,
                                 **self.settings.security.kafka_python())
        try:
            existing = set(admin.list_topics())
            new = [NewTopic(t, n, 1) for t, n in partitions.items() if t not in existing]
            if new:
                try:
                    admin.create_topics(new)
                except TopicAlreadyExistsError:
                    pass  # another process created it first
            return [t.name for t in new]
        finally:
            admin.close()


# ----------------------------------------------------------------------------------------- memory

class MemoryBus:
    """In-process broker with the Kafka bus's interface: topics of partitions, groups, committed offsets.

    Each group's partitions are split round-robin among its open consumers at every poll."""

    def __init__(self, settings: ClientSettings | None = None) -> None:
        self.settings = settings or ClientSettings()
        self.logs: dict[str, list[list[tuple[bytes | None, bytes]]]] = {}
        self.committed: dict[str, dict[TopicPartition, int]] = {}
        self.members: dict[str, list["MemoryConsumer"]] = {}
        self._rr = 0

    def create_topics(self, partitions: dict[str, int]) -> list[str]:
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
                 producer: Producer | None = None) -> "MemoryConsumer":
        if dlq is not None and producer is None:
            producer = self.producer()
        return MemoryConsumer(self, types, group_id, dlq, producer)


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
                 producer: Producer | None) -> None:
        super().__init__(types, dlq, producer, bus.settings.max_message_bytes, group_id or "memory")
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
