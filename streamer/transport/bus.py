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

log = logging.getLogger(__name__)

DLQ_MAX_VALUE_BYTES = 8 * 1024 * 1024  # original bytes above this are cut (value_len keeps the size)
ENVELOPE_BYTES = 64 * 1024  # a record's key, headers and batch framing, and a dead letter's fields, above a value


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

    def keep_membership(self) -> None:
        """Take part in the group's rebalances without taking a record (a consumer that is waiting, e.g. an agent
        waiting for a policy version: a member that stops polling holds every rebalance up)."""

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


# ----------------------------------------------------------------------------------------- memory


